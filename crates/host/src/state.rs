//! Where a vm's state lives on the host, and how its state is read back.
//!
//! `$TINE_HOME/vms/NAME/` holds `vm.json` (what was started: pid, config),
//! `console.log` (COM1), `vmm.log` (the VMM's own stderr), `vsock.sock`
//! (the agent's hybrid vsock socket) and, once the VMM has ended,
//! `exit.json` (why). A vm whose VMM process is gone without an `exit.json`
//! crashed or was killed from outside: `ls` reports it as `crashed` and `rm`
//! cleans it up.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::Context;
use serde::{Deserialize, Serialize};

/// What `tine run` started.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VmRecord {
    pub name: String,
    pub pid: u32,
    /// Start time of the VMM process (clock ticks since boot, /proc/PID/stat
    /// field 22), so a reused pid is not mistaken for our VMM.
    pub pid_start: u64,
    /// Unix time in milliseconds.
    pub created_ms: u64,
    pub image: String,
    pub mem_mib: u64,
    pub vcpus: u8,
    /// Whether the guest runs tine-agent (Linux images do; micro guests do not).
    pub agent: bool,
    /// The vm this one was forked from.
    #[serde(default)]
    pub parent: Option<String>,
    /// Number of disks (each with its own top layer `disk{i}.qcow2`).
    #[serde(default)]
    pub disks: usize,
    /// Whether it has a tap (`tt-NAME`) and which MAC its guest sees.
    #[serde(default)]
    pub mac: Option<[u8; 6]>,
    /// Whether it has a vsock device (`vsock.sock`).
    #[serde(default)]
    pub vsock: bool,
    /// Its address in its tree's network (when it has a tap).
    #[serde(default)]
    pub lease: Option<crate::net::Lease>,
    /// This copy's branch in the effects journal: new for every vm and
    /// copy, never reused (docs/design/effects.md).
    #[serde(default)]
    pub branch: String,
    /// From the root: each ancestor branch and the moment this copy
    /// continues from.
    #[serde(default)]
    pub lineage: Vec<effects::Step>,
    /// Its RAM is paged in lazily from the store (a lazy wake).
    #[serde(default)]
    pub lazy: bool,
    /// The uid its VMM's process tree runs as (`host::jail::uid_for` of
    /// the vm that booted it; a fork child keeps its parent's).
    #[serde(default)]
    pub uid: Option<u32>,
}

/// Written by the VMM when it ends.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExitRecord {
    pub reason: String,
    pub ended_ms: u64,
}

/// How a vm's VMM process ended, as its reaper saw it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReapedRecord {
    pub pid: u32,
    /// The wait status (`signal: 9 (SIGKILL)`, `exit status: 101`).
    pub status: String,
    pub ended_ms: u64,
}

/// A vm's state as `ls` shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum VmState {
    Running,
    /// The VMM ended normally (poweroff, reset, stop).
    Stopped,
    /// The VMM process is gone without saying why (crash, kill -9).
    Crashed,
}

impl std::fmt::Display for VmState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            VmState::Running => "running",
            VmState::Stopped => "stopped",
            VmState::Crashed => "crashed",
        })
    }
}

/// Frozen disk layers, shared by the vms stacked on them (kept when a
/// vm is removed: its children may still use them).
pub fn layers_dir(home: &Path) -> PathBuf {
    home.join("layers")
}

/// The directory of all vms.
pub fn vms_dir(home: &Path) -> PathBuf {
    home.join("vms")
}

/// Checks a vm name: it becomes a directory and a tap/socket name part.
pub fn validate_name(name: &str) -> crate::Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 48
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
        && name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric());
    crate::ensure!(
        ok,
        "invalid vm name {name:?}: use 1-48 letters, digits, '-', '_' or '.', starting with a letter or digit"
    );
    Ok(())
}

/// One vm's directory and files.
#[derive(Clone, Debug)]
pub struct VmDir {
    pub name: String,
    pub dir: PathBuf,
}

impl VmDir {
    pub fn new(home: &Path, name: &str) -> Self {
        Self {
            name: name.to_string(),
            dir: vms_dir(home).join(name),
        }
    }
    pub fn record_path(&self) -> PathBuf {
        self.dir.join("vm.json")
    }
    pub fn exit_path(&self) -> PathBuf {
        self.dir.join("exit.json")
    }
    /// How the vm's VMM process ended as its reaper (tined) saw it, for a
    /// process that left no exit record (killed by a signal).
    pub fn reaped_path(&self) -> PathBuf {
        self.dir.join("reaped.json")
    }
    pub fn console_log(&self) -> PathBuf {
        self.dir.join("console.log")
    }
    /// Bytes written here reach the guest's console (COM1 input).
    pub fn console_socket(&self) -> PathBuf {
        self.dir.join("console.sock")
    }
    pub fn vmm_log(&self) -> PathBuf {
        self.dir.join("vmm.log")
    }
    pub fn vsock(&self) -> PathBuf {
        self.dir.join("vsock.sock")
    }
    /// The VMM's control socket (fork, checkpoint, snapshot).
    pub fn api_socket(&self) -> PathBuf {
        self.dir.join("api.sock")
    }
    /// Checkpoint templates of this vm: `TAG.sock` and `TAG.json`.
    pub fn checkpoints(&self) -> PathBuf {
        self.dir.join("checkpoints")
    }
    /// The vm's own top layer of disk `i` (a qcow2 overlay on the base).
    pub fn disk_layer(&self, i: usize) -> PathBuf {
        self.dir.join(format!("disk{i}.qcow2"))
    }
    pub fn exists(&self) -> bool {
        self.record_path().is_file()
    }
    /// The vm's fork contract (TOML); absent means the default contract.
    pub fn contract_path(&self) -> PathBuf {
        self.dir.join("contract.toml")
    }

    /// The vm's effective contract.
    pub fn read_contract(&self) -> crate::Result<contract::Contract> {
        let p = self.contract_path();
        match std::fs::read_to_string(&p) {
            Ok(text) => contract::Contract::parse(&text)
                .with_context(|| format!("the contract of vm {:?} ({})", self.name, p.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Default::default()),
            Err(e) => Err(crate::Error::from(e).context(format!("cannot read {}", p.display()))),
        }
    }

    pub fn write_contract(&self, c: &contract::Contract) -> crate::Result<()> {
        write_atomic(&self.contract_path(), c.to_toml().as_bytes())
    }

    pub fn read_record(&self) -> crate::Result<VmRecord> {
        let p = self.record_path();
        let text = std::fs::read_to_string(&p).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                crate::Error::not_found(format!("no vm named {:?} (see `tine ls`)", self.name))
            } else {
                crate::Error::from(e).context(format!("cannot read {}", p.display()))
            }
        })?;
        serde_json::from_str(&text).with_context(|| format!("corrupt {}", p.display()))
    }

    pub fn write_record(&self, r: &VmRecord) -> crate::Result<()> {
        write_atomic(&self.record_path(), &serde_json::to_vec_pretty(r)?)
    }

    pub fn read_exit(&self) -> Option<ExitRecord> {
        let text = std::fs::read_to_string(self.exit_path()).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// Records how process `pid` of this vm ended (its wait status), when
    /// it left no exit record of its own.
    pub fn write_reaped(&self, pid: u32, status: &str) -> crate::Result<()> {
        let rec = ReapedRecord {
            pid,
            status: status.to_string(),
            ended_ms: now_ms(),
        };
        write_atomic(&self.reaped_path(), &serde_json::to_vec(&rec)?)
    }

    /// How the process of record `r` ended, if its reaper recorded it.
    pub fn read_reaped(&self, r: &VmRecord) -> Option<ReapedRecord> {
        let text = std::fs::read_to_string(self.reaped_path()).ok()?;
        serde_json::from_str::<ReapedRecord>(&text)
            .ok()
            .filter(|x| x.pid == r.pid)
    }

    /// Why a vm that is not running is not: its state and what ended it,
    /// for error messages (`crashed (...: signal: 9 (SIGKILL))`).
    pub fn not_running(&self, r: &VmRecord) -> String {
        match self.state(r) {
            VmState::Running => "running".into(),
            VmState::Stopped => match self.read_exit() {
                Some(e) => format!("stopped ({})", e.reason),
                None => "stopped".into(),
            },
            s => format!("{s} (its {})", self.crash_detail(r)),
        }
    }

    /// What is known of how a crashed vm's VMM ended (`ls` shows it).
    pub fn crash_detail(&self, r: &VmRecord) -> String {
        match self.read_reaped(r) {
            Some(x) => format!("VMM process ended without an exit record: {}", x.status),
            None => "VMM process gone without an exit record".into(),
        }
    }

    /// The vm's state, from its record, its process and its exit record.
    pub fn state(&self, r: &VmRecord) -> VmState {
        if crate::proc::process_alive(r.pid, r.pid_start) {
            VmState::Running
        } else if self.read_exit().is_some() {
            VmState::Stopped
        } else {
            VmState::Crashed
        }
    }
}

/// Writes a file by rename, so readers never see half of it.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> crate::Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}

/// Makes `home` (created if missing) reachable by its owner only: guest
/// memory, disks, sockets that exec in guests and the effects journal
/// live under it. Files in it are 0600 by the processes' umask
/// ([`private_umask`]).
pub fn close_home(home: &Path) -> crate::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    std::fs::create_dir_all(home).with_context(|| format!("cannot create {}", home.display()))?;
    let meta =
        std::fs::metadata(home).with_context(|| format!("cannot read {}", home.display()))?;
    if meta.uid() != nix::unistd::geteuid().as_raw() {
        return Err(crate::Error::invalid(format!(
            "{} belongs to uid {}, not to this user: tine keeps guest memory and keys there, so it uses only a directory of its own (set TINE_HOME)",
            home.display(),
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(home, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("cannot make {} private", home.display()))?;
    }
    // The directories of the home's state, made now so that every VMM's
    // jail masks them (it masks what exists when it starts).
    for dir in MASKED_DIRS {
        std::fs::create_dir_all(home.join(dir))
            .with_context(|| format!("cannot create {}", home.join(dir).display()))?;
    }
    Ok(())
}

/// Directories of the home that hold state no VMM may read (the store's
/// chunks and index, the effects journal, the network leases).
const MASKED_DIRS: &[&str] = &["store", "effects", "net"];

/// Every file and socket this process creates is its user's alone (0600,
/// directories 0700), whatever umask it was started with.
pub fn private_umask() {
    // SAFETY: umask(2) only changes this process's file mode mask.
    unsafe {
        libc::umask(0o077);
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// All vm directories, sorted by name.
pub fn list(home: &Path) -> crate::Result<Vec<VmDir>> {
    let dir = vms_dir(home);
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => {
            return Err(crate::Error::from(e).context(format!("cannot read {}", dir.display())))
        }
    };
    let mut vms: Vec<VmDir> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(|n| VmDir::new(home, n)))
        .filter(VmDir::exists)
        .collect();
    vms.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(vms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_validate_name_rejects_paths_and_empty() {
        assert!(validate_name("web-1").is_ok());
        assert!(validate_name("a.b_c").is_ok());
        for bad in ["", "../x", "a/b", "-x", ".x", "a b", &"x".repeat(49)] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
    }
}
