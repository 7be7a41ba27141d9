//! The contract verbs: `tine contract show|set` and `tine secret add|ls`.
//! A vm's contract lives in `vms/NAME/contract.toml` (crates/contract);
//! secrets are registered in it by name and policy, their values only ever
//! reach the guest.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Subcommand;
use contract::{Contract, OnFork, Secret};
use protocol::client;

use crate::agent_client;
use crate::exec_cmds::agent_vm;
use crate::state::{self, VmDir};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

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
        #[arg(long = "on-fork", value_parser = parse_on_fork)]
        on_fork: OnFork,
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

fn parse_on_fork(s: &str) -> Result<OnFork, String> {
    match s {
        "keep" => Ok(OnFork::Keep),
        "revoke" => Ok(OnFork::Revoke),
        "rotate" => Ok(OnFork::Rotate),
        _ => Err(format!("{s:?}: say keep, revoke or rotate")),
    }
}

fn existing(home: &Path, name: &str) -> anyhow::Result<VmDir> {
    state::validate_name(name)?;
    let vm = VmDir::new(home, name);
    vm.read_record()?;
    Ok(vm)
}

pub fn contract(home: &Path, cmd: ContractCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ContractCommand::Show { name } => {
            let vm = existing(home, &name)?;
            print!("{}", vm.read_contract()?.to_toml());
        }
        ContractCommand::Set { name, file } => {
            let vm = existing(home, &name)?;
            let c = crate::fork_cmds::effective_contract(&vm, Some(&file))?;
            vm.write_contract(&c)?;
            println!("{name}: contract set from {}", file.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

pub fn secret(home: &Path, cmd: SecretCommand) -> anyhow::Result<ExitCode> {
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
            let vm = agent_vm(home, &name)?;
            let mut c: Contract = vm.read_contract()?;
            c.secrets.insert(
                secret.clone(),
                Secret {
                    path: path.clone(),
                    on_fork,
                    provider,
                    revoke_hook,
                },
            );
            // Checked before the value is read or anything is written.
            c.validate()?;
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
            if value.is_empty() {
                bail!(
                    "the secret {secret:?} is empty: give its value on stdin or with --value-file"
                );
            }
            let dir = Path::new(&path)
                .parent()
                .and_then(Path::to_str)
                .unwrap_or("/")
                .to_string();
            let mut conn = agent_client::connect(&vm.vsock(), CONNECT_TIMEOUT)
                .with_context(|| format!("cannot reach the agent of vm {name:?}"))?;
            let info = client::exec(
                &mut conn,
                client::ExecRequest::new(["mkdir", "-p", "-m", "0700", dir.as_str()]),
                None::<std::io::Empty>,
                std::io::sink(),
                std::io::stderr(),
            )?;
            if info.exit_code() != 0 {
                bail!("cannot create {dir} in vm {name:?}");
            }
            let mut conn = agent_client::connect(&vm.vsock(), CONNECT_TIMEOUT)?;
            client::write_file(&mut conn, &path, 0o600, &value[..])
                .with_context(|| format!("cannot write {name}:{path}"))?;
            vm.write_contract(&c)?;
            println!(
                "{name}: secret {secret} at {path}, on fork: {}",
                on_fork_text(on_fork)
            );
        }
        SecretCommand::Ls { name } => {
            let vm = existing(home, &name)?;
            for (n, s) in &vm.read_contract()?.secrets {
                println!("{n}\t{}\t{}", s.path, on_fork_text(s.on_fork));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn on_fork_text(o: OnFork) -> &'static str {
    match o {
        OnFork::Keep => "keep",
        OnFork::Revoke => "revoke",
        OnFork::Rotate => "rotate",
    }
}
