//! Verbs that work inside a vm through its agent: `exec` and `cp` go
//! through tined's `attach` (the connection then speaks the agent's
//! protocol, so stdin and output stream both ways as they come), and the
//! contract and secret verbs.

use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use base64::Engine;
use clap::{Args, Subcommand};
use hyper::Method;
use protocol::client::{self, ExecRequest};

use crate::client::Client;

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

/// `tine exec NAME -- CMD...`: exit status passes through (128+N for a signal).
pub fn exec(c: &Client, args: ExecArgs) -> anyhow::Result<ExitCode> {
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
        ..ExecRequest::default()
    };
    let mut conn = c.attach(&args.name)?;
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
pub fn cp(c: &Client, src: &str, dst: &str) -> anyhow::Result<ExitCode> {
    match (parse_location(src), parse_location(dst)) {
        (Location::Host(h), Location::Guest { vm, path }) => {
            let (input, mode): (Box<dyn Read>, u32) = if h == "-" {
                (Box::new(std::io::stdin()), 0o644)
            } else {
                let f = std::fs::File::open(h).with_context(|| format!("cannot open {h}"))?;
                let mode =
                    std::os::unix::fs::PermissionsExt::mode(&f.metadata()?.permissions()) & 0o7777;
                (Box::new(f), mode)
            };
            let mut conn = c.attach(vm)?;
            client::write_file(&mut conn, path, mode, input)
                .with_context(|| format!("cannot write {vm}:{path}"))?;
        }
        (Location::Guest { vm, path }, Location::Host(h)) => {
            let mut conn = c.attach(vm)?;
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

#[derive(Subcommand)]
pub enum ContractCommand {
    /// Print a vm's effective fork contract (TOML).
    Show { name: String },
    /// Replace a vm's contract with FILE (its registered secrets stay
    /// unless FILE names them).
    Set { name: String, file: PathBuf },
}

#[derive(Subcommand)]
pub enum SecretCommand {
    /// Write a secret into a running vm and register what forks do to it.
    /// The value comes from --value-file, or stdin.
    Add {
        name: String,
        secret: String,
        /// Where the secret's file lives in the guest (absolute).
        #[arg(long)]
        path: String,
        /// keep | revoke | rotate.
        #[arg(long = "on-fork")]
        on_fork: String,
        /// For rotate: host command printing a child's value; it gets the
        /// child's and the parent's names as arguments.
        #[arg(long)]
        provider: Option<String>,
        /// For revoke: guest command run after the file is wiped.
        #[arg(long = "revoke-hook")]
        revoke_hook: Option<String>,
        #[arg(long = "value-file")]
        value_file: Option<PathBuf>,
    },
    /// The secrets registered with a vm (names and policies, not values).
    Ls { name: String },
}

pub fn contract(c: &Client, cmd: ContractCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ContractCommand::Show { name } => {
            let b: serde_json::Value = c.get(&format!("/v1/vms/{name}/contract"))?;
            print!("{}", b["toml"].as_str().unwrap_or_default());
        }
        ContractCommand::Set { name, file } => {
            let toml = crate::verbs::read_contract(Some(&file))?.unwrap_or_default();
            let _: serde_json::Value = c
                .call(
                    Method::PUT,
                    &format!("/v1/vms/{name}/contract"),
                    Some(&serde_json::json!({ "toml": toml })),
                    &[],
                )
                .with_context(|| format!("in {}", file.display()))?;
            println!("{name}: contract set from {}", file.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn secret(c: &Client, cmd: SecretCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        SecretCommand::Add {
            name,
            secret,
            path,
            on_fork,
            provider,
            revoke_hook,
            value_file,
        } => {
            let mut value = Vec::new();
            match &value_file {
                Some(f) => {
                    value =
                        std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?
                }
                None => {
                    std::io::stdin()
                        .read_to_end(&mut value)
                        .context("cannot read the secret from stdin")?;
                }
            }
            // The owner of this host names a host command: it joins the
            // host's allow-list (host::providers).
            if let Some(p) = &provider {
                host::providers::allow(&crate::home()?, p)?;
            }
            let body = serde_json::json!({
                "path": path,
                "on_fork": on_fork,
                "provider": provider,
                "revoke_hook": revoke_hook,
                "value_b64": base64::engine::general_purpose::STANDARD.encode(&value),
            });
            let info: host::contract::SecretInfo = c.call(
                Method::PUT,
                &format!("/v1/vms/{name}/secrets/{secret}"),
                Some(&body),
                &[],
            )?;
            println!(
                "{name}: secret {} at {}, on fork: {}",
                info.name, info.path, info.on_fork
            );
        }
        SecretCommand::Ls { name } => {
            let list: Vec<host::contract::SecretInfo> =
                c.get(&format!("/v1/vms/{name}/secrets"))?;
            for s in list {
                println!("{}\t{}\t{}", s.name, s.path, s.on_fork);
            }
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
