//! Work inside a running vm through its agent: the connection that exec
//! and file transfers use (the protocol is crates/protocol's).

use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::error::Context;
use crate::state::{self, VmDir, VmState};
use crate::{agent, Error, Host};

/// How long the agent's connection may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The running vm `name` with an agent, or a clear error.
pub fn agent_vm(h: &Host, name: &str) -> crate::Result<VmDir> {
    state::validate_name(name)?;
    let vm = VmDir::new(&h.home, name);
    let r = vm.read_record()?;
    match vm.state(&r) {
        VmState::Running => {}
        _ => {
            return Err(Error::conflict(format!(
                "vm {name:?} is {}; start a new one with `tine run`",
                vm.not_running(&r)
            )))
        }
    }
    if !r.agent {
        return Err(Error::invalid(format!(
            "vm {name:?} has no agent (a micro guest); exec and files need a Linux image"
        )));
    }
    Ok(vm)
}

/// A connection to vm `name`'s agent, Hello exchanged.
pub fn connect(h: &Host, name: &str) -> crate::Result<UnixStream> {
    let vm = agent_vm(h, name)?;
    agent::connect(&vm.vsock(), CONNECT_TIMEOUT)
        .with_context(|| format!("cannot reach the agent of vm {name:?}"))
}
