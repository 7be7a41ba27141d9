//! `tine exec` and `tine cp`: work inside a running vm through its agent.

use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use protocol::client::{self, ExecRequest};

use crate::agent_client;
use crate::state::{VmDir, VmState};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Args, Debug)]
pub struct ExecArgs {
    /// The vm.
    name: String,
    /// Environment for the command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V")]
    env: Vec<String>,
    /// Working directory in the guest.
    #[arg(long)]
    cwd: Option<String>,
    /// Kill the command after this many seconds.
    #[arg(long)]
    timeout: Option<f64>,
    /// Pass stdin to the command even when it is a terminal (it is passed
    /// when it is a pipe or file).
    #[arg(long, short = 'i')]
    interactive: bool,
    /// The command and its arguments.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

impl ExecArgs {
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Whether this process's stdin goes to the command.
    pub fn wants_stdin(&self) -> bool {
        self.interactive || !std::io::stdin().is_terminal()
    }
}

/// The running vm `name` with an agent, or a clear error.
pub fn agent_vm(home: &Path, name: &str) -> anyhow::Result<VmDir> {
    let vm = VmDir::new(home, name);
    let r = vm.read_record()?;
    match vm.state(&r) {
        VmState::Running => {}
        s => bail!("vm {name:?} is {s}; start a new one with `tine run`"),
    }
    if !r.agent {
        bail!("vm {name:?} has no agent (a micro guest); exec and cp need a Linux image");
    }
    Ok(vm)
}

/// `tine exec NAME -- CMD...`: exit status passes through (128+N for a signal).
pub fn exec(home: &Path, args: ExecArgs) -> anyhow::Result<ExitCode> {
    let vm = agent_vm(home, &args.name)?;
    let wants_stdin = args.wants_stdin();
    let env = args
        .env
        .iter()
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_string(), v.to_string())),
            _ => bail!("--env {kv:?} is not K=V"),
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let timeout = match args.timeout {
        Some(t) if t > 0.0 && t.is_finite() => Some(Duration::from_secs_f64(t)),
        Some(t) => bail!("--timeout {t} must be a positive number of seconds"),
        None => None,
    };
    let req = ExecRequest {
        argv: args.command,
        env,
        cwd: args.cwd,
        timeout,
    };
    let mut conn = agent_client::connect(&vm.vsock(), CONNECT_TIMEOUT)
        .with_context(|| format!("cannot reach the agent of vm {:?}", args.name))?;
    let stdin = wants_stdin.then(std::io::stdin);
    let info = client::exec(&mut conn, req, stdin, std::io::stdout(), std::io::stderr())?;
    if info.timed_out {
        eprintln!("tine: command timed out and was killed");
    }
    Ok(ExitCode::from(info.exit_code().clamp(0, 255) as u8))
}

/// One side of `tine cp`: a host path (or `-`) or `NAME:PATH` in a vm.
#[derive(Debug, PartialEq, Eq)]
enum Location<'a> {
    Host(&'a str),
    Guest { vm: &'a str, path: &'a str },
}

fn parse_location(s: &str) -> Location<'_> {
    match s.split_once(':') {
        Some((vm, path)) if !vm.is_empty() && !vm.contains('/') && path.starts_with('/') => {
            Location::Guest { vm, path }
        }
        _ => Location::Host(s),
    }
}

/// `tine cp SRC DST`: one side is `NAME:/path`; `-` is stdin or stdout.
pub fn cp(home: &Path, src: &str, dst: &str) -> anyhow::Result<ExitCode> {
    match (parse_location(src), parse_location(dst)) {
        (Location::Host(h), Location::Guest { vm, path }) => {
            let dir = agent_vm(home, vm)?;
            let (input, mode): (Box<dyn std::io::Read>, u32) = if h == "-" {
                (Box::new(std::io::stdin()), 0o644)
            } else {
                let f = std::fs::File::open(h).with_context(|| format!("cannot open {h}"))?;
                let mode =
                    std::os::unix::fs::PermissionsExt::mode(&f.metadata()?.permissions()) & 0o7777;
                (Box::new(f), mode)
            };
            let mut conn = agent_client::connect(&dir.vsock(), CONNECT_TIMEOUT)
                .with_context(|| format!("cannot reach the agent of vm {vm:?}"))?;
            client::write_file(&mut conn, path, mode, input)
                .with_context(|| format!("cannot write {vm}:{path}"))?;
        }
        (Location::Guest { vm, path }, Location::Host(h)) => {
            let dir = agent_vm(home, vm)?;
            let mut conn = agent_client::connect(&dir.vsock(), CONNECT_TIMEOUT)
                .with_context(|| format!("cannot reach the agent of vm {vm:?}"))?;
            if h == "-" {
                client::read_file(&mut conn, path, std::io::stdout().lock())
                    .with_context(|| format!("cannot read {vm}:{path}"))?;
            } else {
                // Into a temporary file, renamed when complete: a failed copy
                // leaves no half file behind.
                let tmp = format!("{h}.tine-cp.{}", std::process::id());
                let out =
                    std::fs::File::create(&tmp).with_context(|| format!("cannot create {h}"))?;
                match client::read_file(&mut conn, path, std::io::BufWriter::new(out)) {
                    Ok(info) => {
                        use std::os::unix::fs::PermissionsExt;
                        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(info.mode))?;
                        std::fs::rename(&tmp, h).with_context(|| format!("cannot write {h}"))?;
                    }
                    Err(e) => {
                        let _ = std::fs::remove_file(&tmp);
                        return Err(e).with_context(|| format!("cannot read {vm}:{path}"));
                    }
                }
            }
        }
        (Location::Guest { .. }, Location::Guest { .. }) => {
            bail!("copy between two vms is not supported; go through the host")
        }
        (Location::Host(_), Location::Host(_)) => {
            bail!("one side of `tine cp` must be NAME:/path in a vm")
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_parse_location_needs_absolute_guest_path() {
        assert_eq!(
            parse_location("vm1:/etc/hosts"),
            Location::Guest {
                vm: "vm1",
                path: "/etc/hosts"
            }
        );
        assert_eq!(parse_location("./a:b"), Location::Host("./a:b"));
        assert_eq!(parse_location("file.txt"), Location::Host("file.txt"));
        assert_eq!(parse_location("-"), Location::Host("-"));
        assert_eq!(parse_location("vm1:rel"), Location::Host("vm1:rel"));
    }
}
