//! The VMM process's control socket: one JSON request and one JSON reply
//! per connection, over a Unix socket (`vms/NAME/api.sock`). The CLI is the
//! client; a checkpoint's template process serves the same protocol.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A request to a VMM process (or a checkpoint template).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Is the process there; what is it.
    Ping,
    /// Fork the running vm into `children`; the vm continues in a new
    /// process (its pid is in the reply).
    Fork {
        children: Vec<Identity>,
        /// Where frozen disk layers go.
        layers_dir: PathBuf,
    },
    /// Freeze the vm into a template process listening on `socket`.
    Checkpoint {
        tag: String,
        socket: PathBuf,
        layers_dir: PathBuf,
    },
    /// Write the frozen vm to `dir` (memory, state, manifest) while it
    /// runs on.
    Snapshot {
        dir: PathBuf,
        layers_dir: PathBuf,
        /// Stored in the manifest (the vm's fork contract, TOML).
        #[serde(default)]
        contract: Option<String>,
    },
    /// To a template: start the vm again from the checkpoint as `vm`.
    Rollback { vm: Identity },
    /// To a template: exit.
    Drop,
    /// Let a vm started paused (a child with `start_paused`) run.
    Resume,
    /// [`Request::Snapshot`] with memory as a layer for the store
    /// (docs/design/store.md, "Memory layers in the VMM"): `dir` gets
    /// `state`, `manifest.json` (with `memory_layer`) and `memory.layer`
    /// instead of `memory`. A diff layer (only pages dirtied since the
    /// vm's dirty base) unless `full` or the vm has no base; the reply's
    /// `layer` says which. With `rebase`, the vm's continuation starts an
    /// empty dirty set relative to that label (the id the caller stores
    /// this snapshot under). With `expect_base`, a diff only over that
    /// base (a full layer if the vm's base is another: the caller lost
    /// track of it, say a crash between a rebase and its record). The vm
    /// runs on meanwhile, as for Snapshot.
    SnapshotLayer {
        dir: PathBuf,
        layers_dir: PathBuf,
        #[serde(default)]
        contract: Option<String>,
        #[serde(default)]
        full: bool,
        #[serde(default)]
        rebase: Option<String>,
        #[serde(default)]
        expect_base: Option<String>,
    },
    /// Turn dirty tracking on (KVM's dirty log; a no-op if on). The set
    /// has no base until a `SnapshotLayer` with `rebase`.
    TrackDirty,
    /// Lazy page-in counters of a woken vm (`pagein` in the reply; None
    /// for other vms); with `working_set_to`, also write the working set
    /// recorded so far there (JSON, [`crate::pagein::WorkingSet`]).
    PageIn {
        #[serde(default)]
        working_set_to: Option<PathBuf>,
    },
    /// Fold `layers` into the vm's top layers while it runs: frozen layers
    /// directly under the top of each disk that no other chain uses, top-most
    /// first (refused otherwise). The reply's `fold` says what each disk
    /// folded; then the host may delete the files.
    FoldLayers { layers: Vec<PathBuf> },
}

/// The host side of a vm: what a forked or restored vm gets as its own.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Identity {
    pub name: String,
    /// A child starts with its vCPUs parked and runs only on `Resume`, so
    /// nothing of it runs before its wake-up step.
    #[serde(default)]
    pub start_paused: bool,
    /// COM1 output.
    pub console_log: PathBuf,
    /// COM1 input socket, if the vm has one.
    #[serde(default)]
    pub console_socket: Option<PathBuf>,
    /// The VMM's own stdout/stderr.
    pub log: PathBuf,
    /// Top layer to create for each writable disk, in disk order.
    pub disks: Vec<PathBuf>,
    /// A tap and MAC for each of the parent's nets.
    pub nets: Vec<NetIdentity>,
    /// The vsock socket, if the parent has a vsock.
    pub vsock: Option<PathBuf>,
    pub api_socket: PathBuf,
    /// Why the vm ended, written when it does.
    pub exit_file: PathBuf,
}

/// A virtio-net's host side.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NetIdentity {
    pub tap: String,
    pub mac: [u8; 6],
    /// Which of the fds sent with the request (SCM_RIGHTS) is this tap,
    /// opened by the host in its own network namespace: the VMM then
    /// needs neither CAP_NET_ADMIN nor the host's network. Without it
    /// the VMM opens (creates) the tap by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fd_index: Option<usize>,
    /// The fd itself, once received (never on the wire).
    #[serde(skip)]
    pub fd: Option<i32>,
}

/// A reply.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Reply {
    /// Set when the request failed; nothing else is then meaningful.
    pub error: Option<String>,
    /// The process answering.
    pub pid: u32,
    /// The vm's name (or the template's tag).
    pub name: String,
    /// The pid the vm continues in (fork, checkpoint, snapshot, rollback).
    pub continuation_pid: Option<u32>,
    /// Pids of the children, in request order.
    pub children: Vec<u32>,
    /// The checkpoint template's pid.
    pub template_pid: Option<u32>,
    /// How long the guest was paused (pause → continuation running).
    pub pause_ms: Option<f64>,
    /// Request → each child running.
    pub child_running_ms: Vec<f64>,
    /// Request → all children running.
    pub all_children_ms: Option<f64>,
    /// Snapshot: request → files complete.
    pub snapshot_ms: Option<f64>,
    /// Snapshot: bytes of memory written (sparse file, data only).
    pub memory_bytes: Option<u64>,
    /// SnapshotLayer: what the memory layer holds.
    #[serde(default)]
    pub layer: Option<crate::layer::LayerInfo>,
    /// The vm's dirty tracking (TrackDirty, SnapshotLayer: after it).
    #[serde(default)]
    pub dirty: Option<crate::dirty::DirtyTracking>,
    /// PageIn: the counters of a lazily woken vm.
    #[serde(default)]
    pub pagein: Option<crate::pagein::PageInStats>,
    /// FoldLayers: what each disk folded.
    #[serde(default)]
    pub fold: Vec<crate::fold::FoldReport>,
}

impl Reply {
    /// A failed reply.
    pub fn error(e: impl std::fmt::Display) -> Self {
        Self {
            error: Some(e.to_string()),
            pid: std::process::id(),
            ..Self::default()
        }
    }
}

/// Errors talking to a VMM process.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("Cannot reach the VMM at {path}: {source} (is the vm running?)")]
    Connect {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("The VMM at {path} did not answer: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("The VMM at {path} sent a reply that is not valid: {source}")]
    Decode {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

/// An open request to a VMM: the reply has been read, the connection is
/// still open. A forking VMM waits for the client to close it before it
/// ends, so the caller can record the new pids first.
pub struct Call {
    pub reply: Reply,
    _stream: UnixStream,
}

/// Sends `req` to the VMM at `socket` and reads its reply.
pub fn call(socket: &Path, req: &Request, timeout: Duration) -> Result<Call, ApiError> {
    call_with_fds(socket, req, &[], timeout)
}

/// [`call`], with `fds` passed along (SCM_RIGHTS, with the request's
/// first bytes); the request names them by index ([`NetIdentity::fd_index`]).
pub fn call_with_fds(
    socket: &Path,
    req: &Request,
    fds: &[std::os::fd::RawFd],
    timeout: Duration,
) -> Result<Call, ApiError> {
    let connect = |source| ApiError::Connect {
        path: socket.into(),
        source,
    };
    let io = |source| ApiError::Io {
        path: socket.into(),
        source,
    };
    let mut stream = UnixStream::connect(socket).map_err(connect)?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    let mut line = serde_json::to_vec(req).map_err(|e| io(std::io::Error::other(e)))?;
    line.push(b'\n');
    let sent = if fds.is_empty() {
        0
    } else {
        use vmm_sys_util::sock_ctrl_msg::ScmSocket;
        stream
            .send_with_fds(&[&line[..]], fds)
            .map_err(|e| io(std::io::Error::from_raw_os_error(e.errno())))?
    };
    stream.write_all(&line[sent..]).map_err(io)?;
    let mut reader = BufReader::new(stream.try_clone().map_err(io)?);
    let mut text = String::new();
    reader.read_line(&mut text).map_err(io)?;
    if text.is_empty() {
        return Err(io(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "connection closed without a reply",
        )));
    }
    let reply = serde_json::from_str(&text).map_err(|source| ApiError::Decode {
        path: socket.into(),
        source,
    })?;
    Ok(Call {
        reply,
        _stream: stream,
    })
}
