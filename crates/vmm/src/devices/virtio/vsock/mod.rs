//! virtio-vsock emulated in userspace with Firecracker's hybrid convention:
//! the guest's vsock streams are bridged to Unix sockets on the host.
//!
//! - `device.rs`: the [`Vsock`] device (config space, features, queues);
//! - `event_handler.rs`: its reaction to events on the device thread;
//! - `unix.rs`: the muxer, i.e. the connection table and the host sockets;
//! - `packet.rs`: the packet header and descriptor-chain access.

mod device;
mod event_handler;
pub mod packet;
mod unix;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use device::{Vsock, VsockState, EVQ, NUM_QUEUES, QUEUE_SIZE, RXQ, TXQ};
pub use unix::{port_path, CONN_BUF_ALLOC, HOST_CID, MAX_CONNECTIONS};

/// Default guest CID.
pub const DEFAULT_GUEST_CID: u64 = 3;

/// How to build a vsock device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockConfig {
    /// The guest's context id (3 ..= u32::MAX - 1).
    pub guest_cid: u64,
    /// Host socket the VMM listens on; guest-initiated connections to port
    /// P go to `<uds_path>_<P>`.
    pub uds_path: PathBuf,
}

/// Errors while creating a vsock device.
#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    /// The socket path exists but is not a socket.
    #[error(
        "Vsock socket path {} exists and is not a socket: remove it or choose another path",
        .0.display()
    )]
    NotASocket(PathBuf),
    /// Creating the activate event failed.
    #[error("Cannot create the vsock activate event")]
    EventFd(#[source] std::io::Error),
    /// Binding the socket failed.
    #[error("Cannot listen on vsock socket {}", path.display())]
    Bind {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The guest CID is reserved or out of range.
    #[error("Invalid vsock guest CID {0}: use a value from 3 to 4294967294")]
    InvalidCid(u64),
    /// Another vm serves this socket path.
    #[error(
        "Vsock socket path {} is in use by another vm: choose another path or stop that vm",
        .0.display()
    )]
    PathInUse(PathBuf),
    /// Checking whether an existing socket file is live failed.
    #[error("Cannot check existing vsock socket {}", path.display())]
    Probe {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A stale socket file could not be removed.
    #[error("Cannot remove stale vsock socket {}", path.display())]
    RemoveStale {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}
