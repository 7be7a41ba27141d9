//! `tine`: the command line. Each verb is a thin layer over the library crates.

mod image_cmd;
mod size;
mod vmm_cmd;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// tine forks running computers.
#[derive(Parser)]
#[command(name = "tine", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run one vm in the foreground: this process is its VMM.
    Vmm(vmm_cmd::VmmArgs),
    /// Guest images.
    #[command(subcommand)]
    Image(image_cmd::ImageCommand),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TINE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Vmm(args) => vmm_cmd::run(args),
        Command::Image(cmd) => image_cmd::run(cmd),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tine: {}", chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its sources on one line.
fn chain(e: &anyhow::Error) -> String {
    let mut s = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !s.contains(&c) {
            s.push_str(": ");
            s.push_str(&c);
        }
    }
    s
}
