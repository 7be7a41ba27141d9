//! `tine-vmm`: the VMM process, one per vm. tined starts one per vm it
//! boots or restores; forks and checkpoints are fork(2)s of it, so this
//! process never runs an async runtime. It exits when the guest powers off
//! (status 0), resets (0), or the host stops it (SIGINT/SIGTERM).

mod args;
use vmm::size;
mod store_source;

use std::process::ExitCode;

use clap::Parser;

/// tine's VMM: runs one vm in the foreground.
#[derive(Parser)]
#[command(name = "tine-vmm", version, about)]
struct Cli {
    #[command(flatten)]
    args: Box<args::VmmArgs>,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TINE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    // Guest memory, sockets and logs are the vm's owner's alone.
    // SAFETY: umask(2) only changes this process's file mode mask.
    unsafe {
        libc::umask(0o077);
    }
    let cli = Cli::parse();
    match args::run(*cli.args) {
        Ok(code) => code,
        Err(e) => {
            // tined reads the last `tine: ` line of vmm.log as the reason.
            eprintln!("tine: {e:#}");
            ExitCode::FAILURE
        }
    }
}
