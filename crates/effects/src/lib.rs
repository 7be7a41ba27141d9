//! The effects gateway: guests reach HTTP(S) destinations only through it,
//! and it journals every request, so a branch never repeats what its
//! ancestors already did (docs/design/effects.md, issue 7).
//!
//! - [`gateway`]: the host process (`tine gateway serve`): one Unix
//!   listener per vm at `vms/NAME/vsock.sock_3128` (the VMM bridges a guest
//!   connection to CID 2 port 3128 there), an HTTP/1 forward proxy with
//!   CONNECT tunnels, and a control socket for the CLI.
//! - [`journal`]: the journal, in SQLite or in a PostgreSQL database that
//!   the hosts of a fleet share (`TINE_META`).
//! - [`egress`]: where a branch may connect (the contract's `[network]`,
//!   never the host itself).
//! - [`tls`]: HTTPS interception (`effects.https = "intercept"`).
//! - [`control`]: the control protocol and its client (register a vm,
//!   bracket a moment, list, resolve).

pub mod control;
pub mod egress;
pub mod gateway;
pub mod journal;
pub mod tls;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

pub use contract::{EffectPolicy, Effects, Egress, Https, Network};

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

impl From<postgres::Error> for Error {
    fn from(e: postgres::Error) -> Self {
        Error::Journal(pg_error(&e))
    }
}

/// A PostgreSQL error with the server's message (the client's own
/// `Display` says only "db error").
pub(crate) fn pg_error(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("postgres: {} ({})", db.message(), db.code().code()),
        None => format!("postgres: {e}"),
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
    /// Egress (the vm's contract's `[network]`): a child whose contract
    /// denies egress reaches only its allow-list through the gateway too.
    #[serde(default)]
    pub network: Network,
    /// The uid the branch's VMM runs as: a connection from any other uid
    /// (root aside) is refused, so the VMM of another tree, which sees
    /// this socket in the home's `vms/`, cannot speak as this branch.
    #[serde(default)]
    pub peer_uid: Option<u32>,
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
    /// The CA of intercepted HTTPS: certificate and key (0600).
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    /// This host's id, as the fleet knows it: `TINE_HOST_ID`, else the one
    /// kept in `$TINE_HOME/host-id` (tined's, shared with its fleet
    /// registration; made here in tined's form, the hostname and a random
    /// suffix, if the gateway runs first). A shared journal records it on
    /// the effects this host's gateway is sending and on the branches it
    /// binds, so a gateway that starts marks only its own in doubt and
    /// re-binds only its own vms.
    pub fn host_id(&self) -> Result<String, Error> {
        if let Some(id) = std::env::var("TINE_HOST_ID")
            .ok()
            .filter(|v| !v.trim().is_empty())
        {
            return Ok(id.trim().to_string());
        }
        let home = self.dir.parent().unwrap_or(&self.dir);
        let path = home.join("host-id");
        let io = |e| Error::Io(path.display().to_string(), e);
        match std::fs::read_to_string(&path) {
            Ok(s) if !s.trim().is_empty() => return Ok(s.trim().to_string()),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(e)),
        }
        std::fs::create_dir_all(home).map_err(|e| Error::Io(home.display().to_string(), e))?;
        let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
        let name: String = name
            .trim()
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
            .take(40)
            .collect();
        let id = format!(
            "{}-{}",
            if name.is_empty() { "host" } else { &name },
            &random_id()?[..6]
        );
        // Written aside and linked into place (never over an existing
        // one): of two processes making it at once, both keep the winner's.
        let tmp = home.join(format!("host-id.{}.tmp", std::process::id()));
        std::fs::write(&tmp, &id).map_err(io)?;
        let linked = std::fs::hard_link(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        match linked {
            Ok(()) => Ok(id),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Ok(std::fs::read_to_string(&path)
                    .map_err(io)?
                    .trim()
                    .to_string())
            }
            Err(e) => Err(io(e)),
        }
    }

    /// The journal `TINE_META` selects for this home (SQLite: [`Self::journal`]).
    pub fn meta(&self) -> Result<journal::Meta, Error> {
        journal::Meta::from_env(&self.journal())
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
