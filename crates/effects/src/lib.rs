//! The effects gateway: guests reach HTTP(S) destinations only through it,
//! and it journals every request, so a branch never repeats what its
//! ancestors already did (docs/design/effects.md, issue 7).
//!
//! - [`gateway`]: the host process (`tine gateway serve`): one Unix
//!   listener per vm at `vms/NAME/vsock.sock_3128` (the VMM bridges a guest
//!   connection to CID 2 port 3128 there), an HTTP/1 forward proxy with
//!   CONNECT tunnels, and a control socket for the CLI.
//! - [`journal`]: the SQLite journal.
//! - [`control`]: the control protocol and its client (register a vm,
//!   bracket a moment, list, resolve).

pub mod control;
pub mod gateway;
pub mod journal;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use contract::{EffectPolicy, Effects};

/// The vsock port guests send proxy connections to (CID 2, the host).
pub const PROXY_PORT: u32 = 3128;

/// Errors of the gateway, its journal and its control client.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("effects journal: {0}")]
    Journal(String),
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
    #[error("effects gateway: {0}")]
    Gateway(String),
    #[error("effects gateway control: {0}")]
    Control(String),
}

impl From<rusqlite::Error> for Error {
    fn from(e: rusqlite::Error) -> Self {
        Error::Journal(e.to_string())
    }
}

/// What kind of moment a lineage step went through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MomentKind {
    /// A fork: the branch after it is a child.
    Fork,
    /// A checkpoint: the branch after it is the same vm rolled back.
    Checkpoint,
    /// A snapshot: the branch after it is a restored copy (a child).
    Snapshot,
}

impl MomentKind {
    pub fn as_str(self) -> &'static str {
        match self {
            MomentKind::Fork => "fork",
            MomentKind::Checkpoint => "checkpoint",
            MomentKind::Snapshot => "snapshot",
        }
    }
}

/// One step of a lineage: the ancestor branch and the moment this branch
/// continues from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    pub branch: String,
    pub moment: String,
    pub kind: MomentKind,
}

/// A vm's branch, as the CLI registers it with the gateway.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Unique id of this copy (never reused, even when a vm name is).
    pub branch: String,
    /// The vm's name (for people: listings and messages).
    pub vm: String,
    /// The Unix socket the gateway listens on for this branch
    /// (`vms/NAME/vsock.sock_3128`).
    pub socket: PathBuf,
    /// From the root: each ancestor and the moment this branch descends from.
    #[serde(default)]
    pub lineage: Vec<Step>,
    /// Policies (the vm's contract's `[effects]`).
    #[serde(default)]
    pub effects: Effects,
}

impl Registration {
    /// The tree: the root branch of the lineage.
    pub fn tree(&self) -> &str {
        self.lineage
            .first()
            .map(|s| s.branch.as_str())
            .unwrap_or(&self.branch)
    }

    /// A child: a copy made by a fork or a restore somewhere in its lineage
    /// (a rolled-back vm is not).
    pub fn is_child(&self) -> bool {
        self.lineage
            .iter()
            .any(|s| matches!(s.kind, MomentKind::Fork | MomentKind::Snapshot))
    }
}

/// Where the gateway keeps its state: `$TINE_HOME/effects/`.
#[derive(Clone, Debug)]
pub struct Paths {
    pub dir: PathBuf,
}

impl Paths {
    pub fn new(home: &Path) -> Self {
        Paths {
            dir: home.join("effects"),
        }
    }
    pub fn journal(&self) -> PathBuf {
        self.dir.join("journal.db")
    }
    pub fn control(&self) -> PathBuf {
        self.dir.join("control.sock")
    }
    pub fn pidfile(&self) -> PathBuf {
        self.dir.join("gateway.pid")
    }
    /// Held (flock) by the running gateway: at most one per home.
    pub fn lock(&self) -> PathBuf {
        self.dir.join("gateway.lock")
    }
    /// Serializes `start` of several CLIs.
    pub fn start_lock(&self) -> PathBuf {
        self.dir.join("start.lock")
    }
    pub fn log(&self) -> PathBuf {
        self.dir.join("gateway.log")
    }
}

/// A fresh random 128-bit id in hex (branch and moment ids).
pub fn random_id() -> Result<String, Error> {
    let mut b = [0u8; 16];
    let mut done = 0;
    while done < b.len() {
        // SAFETY: getrandom(2) writes at most len bytes into the live,
        // exclusively borrowed tail of `b`.
        let n = unsafe { libc::getrandom(b[done..].as_mut_ptr().cast(), b.len() - done, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::Io("getrandom".into(), e));
        }
        done += n as usize;
    }
    Ok(hex(&b))
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
