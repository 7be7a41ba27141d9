//! A vm's agent, reached through the VMM's hybrid vsock socket.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use protocol::client::{self, ClientError};

/// Connects to the agent and exchanges Hello.
pub fn connect(uds: &Path, timeout: Duration) -> Result<UnixStream, ClientError> {
    let mut s = client::connect_vsock_uds(uds, protocol::AGENT_PORT, timeout)?;
    s.set_read_timeout(Some(timeout))
        .map_err(ClientError::Local)?;
    client::hello(&mut s)?;
    s.set_read_timeout(None).map_err(ClientError::Local)?;
    Ok(s)
}

/// Whether the agent answers a ping within `timeout`.
pub fn ping(uds: &Path, timeout: Duration) -> Result<client::Pong, ClientError> {
    let mut s = connect(uds, timeout)?;
    s.set_read_timeout(Some(timeout))
        .map_err(ClientError::Local)?;
    client::ping(&mut s)
}

/// Asks the agent to power the guest off.
pub fn shutdown(uds: &Path, timeout: Duration) -> Result<(), ClientError> {
    let s = connect(uds, timeout)?;
    s.set_read_timeout(Some(timeout))
        .map_err(ClientError::Local)?;
    client::shutdown(s)
}
