//! `tine-vmm`: the VMM process, one per vm. tined starts one per vm it
//! boots or restores; forks and checkpoints are fork(2)s of it, so this
//! process never runs an async runtime. It exits when the guest powers off
//! (status 0), resets (0), or the host stops it (SIGINT/SIGTERM).

mod args;
mod jail;
use vmm::size;
mod store_source;
mod tree_init;

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
    // The tree's PID namespace first, while this process has one thread.
    if let Err(e) = args::enter_pid_namespace(&cli.args) {
        eprintln!("tine: {e:#}");
        return ExitCode::FAILURE;
    }
    if let Err(e) = seccomp_from_env() {
        eprintln!("tine: {e:#}");
        return ExitCode::FAILURE;
    }
    match args::run(*cli.args) {
        Ok(code) => code,
        Err(e) => {
            // tined reads the last `tine: ` line of vmm.log as the reason.
            eprintln!("tine: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Every thread of the VMM runs under its seccomp filter (vmm::seccomp,
/// docs/design/isolation.md). `TINE_SECCOMP=log` logs a syscall outside
/// a list instead of killing the process, `off` installs none: for
/// debugging only.
fn seccomp_from_env() -> anyhow::Result<()> {
    use vmm::seccomp::{enable, Mode};
    match std::env::var("TINE_SECCOMP").as_deref() {
        Err(_) | Ok("" | "on" | "kill") => {
            vmm::seccomp::report_violations()?;
            enable(Mode::Kill)?
        }
        Ok("log") => enable(Mode::Log)?,
        Ok("off") => {}
        Ok(other) => anyhow::bail!("TINE_SECCOMP={other}: expected on, log or off"),
    }
    Ok(())
}
