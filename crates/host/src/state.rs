//! Where a vm's state lives on the host, and how its state is read back.
//!
//! Each VMM process tree (a vm started by `run` or a wake, and every child
//! forked from it) has a directory of its own, `$TINE_HOME/t/TREE/`: its
//! vms' directories (`t/TREE/NAME/`) and the frozen layers its forks made
//! (`t/TREE/.layers/`). A jailed VMM sees only its tree's directory
//! (docs/design/isolation.md); one directory because a fork renames a
//! vm's top layer into `.layers`, which rename(2) does only within a
//! mount. `$TINE_HOME/vms/NAME` is a link to the vm's directory, so the
//! host finds a vm by name (a home from before trees has real
//! directories there, and vms in them stay as they were).
//!
//! A vm's directory holds `vm.json` (what was started: pid, config),
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

/// Frozen disk layers of the vms made before trees had directories,
/// shared by the vms stacked on them (kept when a vm is removed: its
/// children may still use them).
pub fn layers_dir(home: &Path) -> PathBuf {
    home.join("layers")
}

/// Every directory of frozen layers: the home's own (from before trees)
/// and each tree's.
pub fn all_layers_dirs(home: &Path) -> Vec<PathBuf> {
    let mut out = vec![layers_dir(home)];
    out.extend(trees(home).into_iter().map(|t| t.join(TREE_LAYERS)));
    out
}

/// The links to all vms' directories (`vms/NAME`).
pub fn vms_dir(home: &Path) -> PathBuf {
    home.join("vms")
}

/// The directory of all trees.
pub fn trees_dir(home: &Path) -> PathBuf {
    home.join(TREES)
}

/// `trees_dir`'s name in the home (short: socket paths run through it).
const TREES: &str = "t";

/// A tree's frozen layers, beside its vms' directories (a vm name never
/// starts with a dot).
const TREE_LAYERS: &str = ".layers";

/// The directories of all trees, sorted.
pub fn trees(home: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(trees_dir(home))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(is_tree_id))
        .map(|e| e.path())
        .collect();
    out.sort();
    out
}

/// The names of the vm directories in tree directory `tree` (whether or
/// not their records are written yet: a fork makes its children's
/// directories first).
pub fn vms_in_tree(tree: &Path) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(tree)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| validate_name(n).is_ok())
        .collect();
    out.sort();
    out
}

/// Tree ids are 8 lowercase hex digits: short, because a vm's socket
/// paths (at most 107 bytes) run through them.
fn is_tree_id(s: &str) -> bool {
    s.len() == 8
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The directory `link` (`vms/NAME`) leads to when it is a link of the
/// form tine makes, `../t/TREE/NAME`; anything else is not followed.
fn follow(home: &Path, link: &Path, name: &str) -> Option<PathBuf> {
    let to = std::fs::read_link(link).ok()?;
    let mut parts = to.components().map(|c| c.as_os_str().to_str());
    let ok = parts.next() == Some(Some(".."))
        && parts.next() == Some(Some(TREES))
        && parts.next().flatten().is_some_and(is_tree_id)
        && parts.next() == Some(Some(name))
        && parts.next().is_none();
    ok.then(|| home.join(to.components().skip(1).collect::<PathBuf>()))
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
    /// The directory itself: `t/TREE/NAME`, or `vms/NAME` for a vm from
    /// before trees (or one not made yet).
    pub dir: PathBuf,
    /// `vms/NAME`: the link to `dir` (or `dir` itself).
    link: PathBuf,
}

impl VmDir {
    /// Vm `name` of `home`, where its link leads.
    pub fn new(home: &Path, name: &str) -> Self {
        let link = vms_dir(home).join(name);
        Self {
            name: name.to_string(),
            dir: follow(home, &link, name).unwrap_or_else(|| link.clone()),
            link,
        }
    }

    /// A vm not made yet, in a tree of its own (a `run` or a wake: a new
    /// VMM process tree). Its tree's id is new: nothing else is in it.
    pub fn new_tree(home: &Path, name: &str) -> crate::Result<Self> {
        let trees = trees_dir(home);
        std::fs::create_dir_all(&trees)
            .with_context(|| format!("cannot create {}", trees.display()))?;
        for _ in 0..16 {
            let mut id = [0u8; 4];
            crate::wake::random_bytes(&mut id)?;
            let id: String = id.iter().map(|b| format!("{b:02x}")).collect();
            let tree = trees.join(&id);
            let vm = Self {
                name: name.to_string(),
                dir: tree.join(name),
                link: vms_dir(home).join(name),
            };
            // Before anything is made (every id has the same length).
            vm.check_socket_paths()?;
            match std::fs::create_dir(&tree) {
                Ok(()) => return Ok(vm),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => {
                    return Err(
                        crate::Error::from(e).context(format!("cannot create {}", tree.display()))
                    )
                }
            }
        }
        Err(crate::Error::failed(format!(
            "no free tree id in {} after 16 tries",
            trees.display()
        )))
    }

    /// A vm not made yet in this vm's tree (a fork child).
    pub fn sibling(&self, name: &str) -> Self {
        let link = self.link.with_file_name(name);
        let dir = match self.tree() {
            Some(t) => t.join(name),
            None => link.clone(),
        };
        Self {
            name: name.to_string(),
            dir,
            link,
        }
    }

    /// `$TINE_HOME`: the link is `HOME/vms/NAME`.
    fn home(&self) -> &Path {
        self.link
            .parent()
            .and_then(Path::parent)
            .unwrap_or(Path::new("/"))
    }

    /// The directory of this vm's tree (`t/TREE`): all a jailed VMM of
    /// the tree sees of the home's vms and layers. `None` for a vm from
    /// before trees.
    pub fn tree(&self) -> Option<&Path> {
        if self.dir == self.link {
            return None;
        }
        self.dir.parent()
    }

    /// Where this vm's forks and snapshots put the frozen layers they
    /// make: its tree's `.layers` (the same mount as its top layers).
    pub fn layers_dir(&self) -> PathBuf {
        match self.tree() {
            Some(t) => t.join(TREE_LAYERS),
            None => layers_dir(self.home()),
        }
    }

    /// Makes the vm's directory (empty: whatever a vm of this name left
    /// before goes first) and its link.
    pub fn create(&self) -> crate::Result<()> {
        self.remove_dir()?;
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("cannot create {}", self.dir.display()))?;
        if let Some(id) = self.tree().and_then(Path::file_name) {
            // Relative (`../t/TREE/NAME`): a home moved elsewhere keeps working.
            let rel = Path::new("..").join(TREES).join(id).join(&self.name);
            let vms = vms_dir(self.home());
            std::fs::create_dir_all(&vms)
                .with_context(|| format!("cannot create {}", vms.display()))?;
            std::os::unix::fs::symlink(&rel, &self.link)
                .with_context(|| format!("cannot link {}", self.link.display()))?;
        }
        Ok(())
    }

    /// Removes the vm's directory and its link: where the link leads
    /// now (a vm of this name made before, in another tree) as well as
    /// this one's directory. Nothing there is not an error.
    pub fn remove_dir(&self) -> crate::Result<()> {
        let now = follow(self.home(), &self.link, &self.name);
        for d in now.iter().chain(std::iter::once(&self.dir)) {
            if *d == self.link {
                continue;
            }
            match std::fs::remove_dir_all(d) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(
                        crate::Error::from(e).context(format!("cannot remove {}", d.display()))
                    )
                }
                _ => {}
            }
        }
        // The link, or a vm directory from before trees.
        let gone = match std::fs::symlink_metadata(&self.link) {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&self.link),
            Ok(_) => std::fs::remove_file(&self.link),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(e),
        };
        gone.with_context(|| format!("cannot remove {}", self.link.display()))
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
    /// Whether the sockets the vm's VMM binds fit in a socket path (the
    /// console's is the longest name).
    pub fn check_socket_paths(&self) -> crate::Result<()> {
        check_socket_path(&self.console_socket(), &format!("vm {:?}", self.name))
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

/// The longest path a Unix socket can be bound at (`sun_path` holds 108
/// bytes with the closing NUL).
const SOCKET_PATH_MAX: usize = 107;

/// Refuses a socket path too long to bind, before anything is made: the
/// VMM would otherwise fail at its start (or a checkpoint at its fork)
/// with a message about SUN_LEN.
pub fn check_socket_path(path: &Path, what: &str) -> crate::Result<()> {
    let n = path.as_os_str().len();
    if n > SOCKET_PATH_MAX {
        return Err(crate::Error::invalid(format!(
            "{what} needs the socket {} ({n} bytes), longer than the {SOCKET_PATH_MAX} a Unix socket path may have: use a shorter name, or a shorter TINE_HOME",
            path.display()
        )));
    }
    Ok(())
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

    /// A run's vm gets a tree of its own, a fork child its parent's; the
    /// link finds both; removal takes the directory and the link; a link
    /// tine did not make is not followed.
    #[test]
    fn test_a_vm_lives_in_its_tree_and_vms_links_to_it() {
        let home = tempfile::tempdir().expect("home");
        let h = home.path();
        let a = VmDir::new_tree(h, "a").expect("tree");
        a.create().expect("create");
        let tree = a.tree().expect("in a tree").to_path_buf();
        assert_eq!(tree.parent(), Some(trees_dir(h).as_path()));
        assert_eq!(a.layers_dir(), tree.join(".layers"));
        std::fs::write(a.record_path(), b"{}").expect("record");
        let found = VmDir::new(h, "a");
        assert_eq!(found.dir, a.dir);
        assert!(found.exists());
        let b = found.sibling("b");
        b.create().expect("create");
        assert_eq!(VmDir::new(h, "b").dir, tree.join("b"));
        let other = VmDir::new_tree(h, "c").expect("tree");
        assert_ne!(other.tree(), a.tree());
        assert_eq!(trees(h).len(), 2);
        // A leftover of the same name, in another tree, goes first.
        let again = VmDir::new_tree(h, "a").expect("tree");
        again.create().expect("create");
        assert!(!a.dir.exists());
        assert_eq!(VmDir::new(h, "a").dir, again.dir);
        again.remove_dir().expect("remove");
        assert!(!again.dir.exists());
        assert!(std::fs::symlink_metadata(vms_dir(h).join("a")).is_err());
        assert!(VmDir::new(h, "a").tree().is_none());
        // Links of other shapes lead nowhere.
        for (name, to) in [
            ("x", "/etc"),
            ("y", "../t/0000000g/y"),
            ("z", "../t/00000000/w"),
        ] {
            std::os::unix::fs::symlink(to, vms_dir(h).join(name)).expect("link");
            let d = VmDir::new(h, name);
            assert_eq!(d.dir, vms_dir(h).join(name), "{to}");
            assert!(d.tree().is_none());
        }
        // A vm from before trees: its directory is `vms/NAME`, its layers
        // the home's.
        let old = VmDir::new(h, "old");
        old.create().expect("create");
        assert!(vms_dir(h).join("old").is_dir());
        assert!(old.tree().is_none());
        assert_eq!(old.layers_dir(), layers_dir(h));
        assert_eq!(old.sibling("kid").dir, vms_dir(h).join("kid"));
        old.remove_dir().expect("remove");
        assert!(!vms_dir(h).join("old").exists());
    }

    #[test]
    fn test_validate_name_rejects_paths_and_empty() {
        assert!(validate_name("web-1").is_ok());
        assert!(validate_name("a.b_c").is_ok());
        for bad in ["", "../x", "a/b", "-x", ".x", "a b", &"x".repeat(49)] {
            assert!(validate_name(bad).is_err(), "{bad:?}");
        }
    }
}
