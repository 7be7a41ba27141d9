//! Which verbs run here and which go through the machine (the nested test
//! host) when this host has no hardware virtualization.
//!
//! - `run` of a Linux image goes to the machine (started on first use);
//!   micro guests run here, on this host's /dev/kvm.
//! - Verbs on a named vm run here when the vm is here, else in the machine
//!   if it runs (a vm cannot be there otherwise).
//! - `ls` merges both, with the same rows and `--json` either way.
//! - `sleep` goes where the vm is; `wake` where the branch sleeps (each
//!   host has its own store unless `TINE_STORE` names a shared one).
//! - `cp` streams file contents through the forwarded command, because
//!   the machine sees the host's files read-only and its writes stay inside.

use std::io::IsTerminal;
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context;

use crate::machine::{self, MachineState};
use crate::Command;
use host::state::VmDir;

/// Runs `cmd` through the machine when it belongs there; `None` = run here.
pub fn through_machine(
    home: &Path,
    cmd: &Command,
    args: &[String],
) -> Option<anyhow::Result<ExitCode>> {
    match machine::needed() {
        Ok(true) => {}
        Ok(false) => return None,
        Err(e) => return Some(Err(e)),
    }
    let running = || machine::status(home).state == MachineState::Running;
    let remote_vm = |name: &str| !VmDir::new(home, name).exists() && running();
    let forward = |stdin: bool| machine::forward(home, args, &[], stdin).map(machine::exit_code);
    match cmd {
        Command::Run(r) if !r.is_micro() => Some(forward(false)),
        Command::Exec(e) if remote_vm(e.name()) => Some(forward(e.wants_stdin())),
        Command::Console { name, .. }
        | Command::Stop { name, .. }
        | Command::Kill { name }
        | Command::Disk(crate::DiskCommand::Layers { name, .. })
        | Command::Checkpoint { name, .. }
        | Command::Rollback { name, .. }
        | Command::Checkpoints { name, .. }
        | Command::Snapshot { name, .. }
        | Command::Sleep { name, .. }
        | Command::Keep { name, .. }
            if remote_vm(name) =>
        {
            Some(forward(false))
        }
        Command::Contract(
            crate::agent_cmds::ContractCommand::Show { name }
            | crate::agent_cmds::ContractCommand::Set { name, .. },
        )
        | Command::Secret(crate::agent_cmds::SecretCommand::Ls { name })
            if remote_vm(name) =>
        {
            Some(forward(false))
        }
        Command::Secret(crate::agent_cmds::SecretCommand::Add { name, .. }) if remote_vm(name) => {
            Some(forward(true))
        }
        Command::Effects(e) if e.vm().is_some_and(remote_vm) => Some(forward(false)),
        // `NAME@TAG` is a checkpoint of vm NAME; a sleeping branch of this
        // host's store is removed here.
        Command::Rm { name, .. }
            if remote_vm(name.split('@').next().unwrap_or(name))
                && !host::tree::has_branch_in(home, name) =>
        {
            Some(forward(false))
        }
        Command::Fork { name, .. }
            if remote_vm(name) && !host::tree::is_sleeping_in(home, name) =>
        {
            Some(forward(false))
        }
        // A branch sleeps in the store of the host its vm ran on.
        Command::Wake { branch, .. } if !host::tree::has_branch_in(home, branch) && running() => {
            Some(forward(false))
        }
        Command::Cp { src, dst } => {
            let vm = [src, dst]
                .iter()
                .find_map(|s| s.split_once(':').map(|(vm, _)| vm.to_string()))?;
            remote_vm(&vm).then(|| cp(home, src, dst))
        }
        _ => None,
    }
}

/// `tine cp` to or from a vm in the machine: the file's bytes travel
/// through the forwarded command's stdin or stdout.
fn cp(home: &Path, src: &str, dst: &str) -> anyhow::Result<ExitCode> {
    let args = |a: &str, b: &str| vec!["cp".to_string(), a.to_string(), b.to_string()];
    let code = if dst.contains(':') && src != "-" {
        let f = std::fs::File::open(src).with_context(|| format!("cannot open {src}"))?;
        machine::forward_io(
            home,
            &args("-", dst),
            &[],
            Some(Box::new(f)),
            &mut std::io::sink(),
        )?
    } else if src.contains(':') && dst != "-" {
        let tmp = format!("{dst}.tine-cp.{}", std::process::id());
        let mut out =
            std::fs::File::create(&tmp).with_context(|| format!("cannot create {dst}"))?;
        let code = machine::forward_io(home, &args(src, "-"), &[], None, &mut out)?;
        if code == 0 {
            std::fs::rename(&tmp, dst).with_context(|| format!("cannot write {dst}"))?;
        } else {
            let _ = std::fs::remove_file(&tmp);
        }
        code
    } else {
        let stdin = !std::io::stdin().is_terminal();
        machine::forward(home, &args(src, dst), &[], stdin)?
    };
    Ok(machine::exit_code(code))
}
