//! What a VMM process does to itself before it reads a byte of a guest or
//! a snapshot (docs/design/isolation.md, "The jail"): join the cgroups the
//! host made for its vm, its own root (binds of tine's files, the home's
//! state masked) and namespaces, its tree's uid, no core dumps and no
//! ptrace from its peers, a bounded fd table, `no_new_privs`, and every
//! capability dropped (CAP_NET_ADMIN is kept only for a tap it must open
//! by name; the host passes taps as open fds).
//!
//! The host prepares what needs privilege (the groups and their limits,
//! `host::cgroup`; the taps); the VMM enters the rest itself, first
//! thing, so nothing of it runs outside. Fork children inherit all of it;
//! the host moves each child into its own group while it is still paused.

use std::path::{Path, PathBuf};

/// tined's datagram socket in `$TINE_HOME` where a tree's init (the pid 1
/// of a VMM process tree's PID namespace) reports each wait status it
/// reaps: `HOSTPID STATUS`, the status as waitpid(2) gave it.
pub const REAPED_SOCKET: &str = "reaped.sock";

use caps::{CapSet, Capability, CapsHashSet};

/// The file descriptors a VMM may hold: its devices, disks, sockets,
/// vsock connections and a fork's pipes stay far below.
pub const MAX_FDS: u64 = 4096;

/// What the host asks of the VMM's jail.
#[derive(Clone, Debug, Default)]
pub struct Jail {
    /// Groups to join (one per cgroup v1 hierarchy, or the v2 group).
    pub cgroups: Vec<PathBuf>,
    /// Keep CAP_NET_ADMIN (the vm has a tap; a fork child creates its own).
    pub net_admin: bool,
    /// A mount namespace whose root holds only these; None keeps the
    /// host's filesystem.
    pub mounts: Option<Mounts>,
    /// An empty network namespace (no interface, not even `lo`): for a
    /// vm without a tap whose memory comes from no remote store.
    pub no_network: bool,
    /// The uid (and gid) to run as, one per process tree of the host's
    /// choosing, so that a VMM taken over can signal, trace or share
    /// kernel keys with its own tree only. Files are still reached as
    /// root's (fsuid 0; see [`become_user`]).
    pub uid: Option<u32>,
}

/// The VMM's own root: an empty tmpfs mounted on `root` (an empty
/// directory of tine's), the `binds` mounted into it at their own paths,
/// then pivoted into. Paths the host names later (a snapshot's directory
/// outside `$TINE_HOME`) are mounted into the namespace by the host.
#[derive(Clone, Debug, Default)]
pub struct Mounts {
    pub root: PathBuf,
    pub binds: Vec<Bind>,
    /// Symbolic links to make in the root (path, target) where no bind
    /// shows them: a link to a link to a bound directory resolves then.
    pub links: Vec<(PathBuf, PathBuf)>,
    /// Paths inside a bind to hide: a directory gets an empty tmpfs over
    /// it (binds below it still show), a file an empty one nobody may read.
    pub masks: Vec<PathBuf>,
}

/// A host path the jail sees, at the same path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bind {
    pub path: PathBuf,
    pub writable: bool,
}

impl Bind {
    pub fn ro(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            writable: false,
        }
    }
    pub fn rw(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            writable: true,
        }
    }
}

/// What [`enter`] did, for the VMM's log and the tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// The effective capabilities left.
    pub kept: Vec<String>,
    /// The uid it runs as now, if it changed.
    pub uid: Option<u32>,
    pub cgroups: usize,
    /// Whether it runs in its own root and namespaces (only a
    /// privileged VMM does).
    pub pivoted: bool,
}

/// Why the jail could not be entered; the VMM then refuses to start.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("Cannot join the cgroup {path} (does it exist, and is this root?)")]
    Cgroup {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("Cannot set the resource limit {what}")]
    Rlimit {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("Cannot set {what} on the VMM process")]
    Prctl {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("Cannot drop the VMM's capabilities")]
    Caps(#[source] caps::errors::CapsError),
    #[error("Cannot become uid {uid}: {what}")]
    User {
        uid: u32,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("Cannot set up the VMM's jail: {what} {path}")]
    Mount {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Enters the jail: on return this process (and whatever it forks) is in
/// the groups, cannot dump core, be ptraced by a process without
/// CAP_SYS_PTRACE, gain privileges by exec, or use a capability but the
/// one kept.
pub fn enter(jail: &Jail) -> Result<Report, JailError> {
    for dir in &jail.cgroups {
        join_cgroup(dir)?;
    }
    // A VMM started by an unprivileged user has nothing to drop and may
    // not make namespaces: its reach is that user's.
    let privileged =
        caps::has_cap(None, CapSet::Effective, Capability::CAP_SYS_ADMIN).unwrap_or(false);
    let mut pivoted = false;
    if let (Some(m), true) = (&jail.mounts, privileged) {
        crate::title::prepare();
        pivot(m)?;
        pivoted = true;
    }
    if privileged {
        // Its own (empty) System V IPC and host name; no network unless
        // it needs one.
        let mut ns = nix::sched::CloneFlags::CLONE_NEWIPC | nix::sched::CloneFlags::CLONE_NEWUTS;
        if jail.no_network {
            ns |= nix::sched::CloneFlags::CLONE_NEWNET;
        }
        nix::sched::unshare(ns).map_err(mount_err("unshare(IPC, UTS, NET)", Path::new("/")))?;
    }
    let uid = match (jail.uid, privileged) {
        (Some(uid), true) => {
            become_user(uid)?;
            Some(uid)
        }
        _ => None,
    };
    // Guest memory never lands in a core file.
    set_rlimit(libc::RLIMIT_CORE, 0, "RLIMIT_CORE")?;
    let (_, hard) = get_rlimit(libc::RLIMIT_NOFILE);
    let nofile = hard.min(MAX_FDS);
    set_rlimit(libc::RLIMIT_NOFILE, nofile, "RLIMIT_NOFILE")?;
    // Not dumpable: /proc/PID/mem, maps and ptrace of this process need
    // CAP_SYS_PTRACE, which no other VMM has; inherited by fork children.
    prctl(libc::PR_SET_DUMPABLE, 0, "PR_SET_DUMPABLE=0")?;
    prctl(libc::PR_SET_NO_NEW_PRIVS, 1, "PR_SET_NO_NEW_PRIVS")?;
    let mut keep = CapsHashSet::new();
    if jail.net_admin {
        keep.insert(Capability::CAP_NET_ADMIN);
    }
    drop_capabilities(&keep)?;
    let mut kept: Vec<String> = keep.iter().map(|c| c.to_string()).collect();
    kept.sort();
    Ok(Report {
        kept,
        uid,
        cgroups: jail.cgroups.len(),
        pivoted,
    })
}

/// Runs as `uid`:`uid` with no supplementary groups, while files are
/// still reached with uid and gid 0 (setfsuid(2)): what the jail's root
/// shows is tine's own files, all root's and 0600, and giving each tree
/// its own would mean chowning images, layers and snapshots that trees
/// share. What the uid takes away is everything the kernel decides by
/// real or effective uid: signals to root's processes (tined, the host's
/// daemons), ptrace, root's keyrings, per-user limits. Capabilities are
/// kept across the change (PR_SET_KEEPCAPS) only long enough to set the
/// fs ids; [`drop_capabilities`] then clears them.
fn become_user(uid: u32) -> Result<(), JailError> {
    use nix::unistd::{setfsgid, setfsuid, setgroups, setresgid, setresuid, Gid, Uid};
    let err = |what: &'static str| {
        move |e: nix::Error| JailError::User {
            uid,
            what,
            source: std::io::Error::from(e),
        }
    };
    if uid == 0 {
        return Ok(());
    }
    prctl(libc::PR_SET_KEEPCAPS, 1, "PR_SET_KEEPCAPS")?;
    setgroups(&[]).map_err(err("setgroups"))?;
    let (u, g) = (Uid::from_raw(uid), Gid::from_raw(uid));
    setresgid(g, g, g).map_err(err("setresgid"))?;
    setresuid(u, u, u).map_err(err("setresuid"))?;
    prctl(libc::PR_SET_KEEPCAPS, 0, "PR_SET_KEEPCAPS=0")?;
    // The uid change cleared the effective set; the permitted set stayed.
    for cap in [Capability::CAP_SETUID, Capability::CAP_SETGID] {
        caps::raise(None, CapSet::Effective, cap).map_err(JailError::Caps)?;
    }
    setfsgid(Gid::from_raw(0));
    setfsuid(Uid::from_raw(0));
    // setfsuid(2) reports only the old value: ask again to know.
    let fsuid = setfsuid(Uid::from_raw(0)).as_raw();
    let fsgid = setfsgid(Gid::from_raw(0)).as_raw();
    if fsuid != 0 || fsgid != 0 {
        return Err(JailError::User {
            uid,
            what: "setfsuid(0)",
            source: std::io::Error::from_raw_os_error(libc::EPERM),
        });
    }
    Ok(())
}

/// Moves this process (all its threads) into the group at `dir`.
pub fn join_cgroup(dir: &Path) -> Result<(), JailError> {
    let path = dir.join("cgroup.procs");
    // "0" is the writing process itself.
    std::fs::write(&path, b"0\n").map_err(|source| JailError::Cgroup { path, source })
}

/// One mount of the jail's root.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Step {
    Bind(Bind),
    Mask(PathBuf),
}

impl Step {
    fn path(&self) -> &Path {
        match self {
            Step::Bind(b) => &b.path,
            Step::Mask(p) => p,
        }
    }
}

/// Binds and masks in the order they can be mounted (a parent before what
/// lies in it), without binds a writable (or equally read-only) parent
/// already shows unless a mask between hides them, and without paths that
/// do not exist.
fn plan(binds: &[Bind], masks: &[PathBuf]) -> Vec<Step> {
    let mut v: Vec<Step> = binds
        .iter()
        .filter(|b| b.path.is_absolute() && b.path.exists())
        .cloned()
        .map(Step::Bind)
        .chain(
            masks
                .iter()
                .filter(|m| m.is_absolute())
                .cloned()
                .map(Step::Mask),
        )
        .collect();
    // Parents first; at one path a mask before a bind, a writable bind
    // before a read-only one.
    let rank = |s: &Step| match s {
        Step::Mask(_) => 0,
        Step::Bind(b) if b.writable => 1,
        Step::Bind(_) => 2,
    };
    v.sort_by(|a, b| a.path().cmp(b.path()).then(rank(a).cmp(&rank(b))));
    let mut out: Vec<Step> = Vec::new();
    for s in v {
        let keep = match &s {
            Step::Mask(m) => out
                .iter()
                .any(|o| matches!(o, Step::Bind(_)) && m.starts_with(o.path())),
            Step::Bind(b) => {
                let covered = out.iter().any(|o| match o {
                    Step::Bind(o) => b.path.starts_with(&o.path) && (o.writable || !b.writable),
                    Step::Mask(_) => false,
                });
                let masked = masks.iter().any(|m| b.path.starts_with(m));
                !covered || masked
            }
        };
        if keep && !out.contains(&s) {
            out.push(s);
        }
    }
    out
}

fn mount_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(nix::Error) -> JailError + 'a {
    move |e| JailError::Mount {
        what,
        path: path.to_path_buf(),
        source: std::io::Error::from(e),
    }
}

/// A new mount namespace (slave to the host's, so nothing mounted here
/// reaches the host), a tmpfs root holding the binds, pivoted into; the
/// host's tree is detached.
fn pivot(m: &Mounts) -> Result<(), JailError> {
    use nix::mount::{mount, umount2, MntFlags, MsFlags};
    let none: Option<&str> = None;
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
        .map_err(mount_err("unshare(CLONE_NEWNS)", Path::new("/")))?;
    mount(none, "/", none, MsFlags::MS_REC | MsFlags::MS_SLAVE, none)
        .map_err(mount_err("make slave", Path::new("/")))?;
    let root = &m.root;
    std::fs::create_dir_all(root).map_err(|source| JailError::Mount {
        what: "mkdir",
        path: root.clone(),
        source,
    })?;
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(
        Some("tmpfs"),
        root,
        Some("tmpfs"),
        flags,
        Some("mode=0755,size=4m"),
    )
    .map_err(mount_err("mount tmpfs on", root))?;
    for step in plan(&m.binds, &m.masks) {
        let b = match step {
            Step::Bind(b) => b,
            Step::Mask(path) => {
                mask(root, &path)?;
                continue;
            }
        };
        let rel = b.path.strip_prefix("/").unwrap_or(&b.path);
        let target = root.join(rel);
        // A mount point a bind before already shows (a disk in a
        // snapshot directory shown read-only) is used as it is: making
        // it would fail there, and truncate the file where writable.
        let made = if target.symlink_metadata().is_ok() {
            Ok(())
        } else if b.path.is_dir() {
            std::fs::create_dir_all(&target)
        } else {
            target
                .parent()
                .map(std::fs::create_dir_all)
                .unwrap_or(Ok(()))
                .and_then(|_| std::fs::File::create(&target).map(drop))
        };
        made.map_err(|source| JailError::Mount {
            what: "make the mount point",
            path: target.clone(),
            source,
        })?;
        // Recursive: a home's images may be a mount of their own (the
        // nested test host's); this jail's root, below the home, then
        // shows inside itself once, which opens nothing new.
        mount(
            Some(&b.path),
            &target,
            none,
            MsFlags::MS_BIND | MsFlags::MS_REC,
            none,
        )
        .map_err(mount_err("bind", &b.path))?;
        let mut ro = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_NOSUID;
        if !b.writable {
            ro |= MsFlags::MS_RDONLY;
        }
        mount(none, &target, none, ro, none).map_err(mount_err("remount", &b.path))?;
    }
    for (link, to) in &m.links {
        let at = root.join(link.strip_prefix("/").unwrap_or(link));
        if at.symlink_metadata().is_ok() {
            continue;
        }
        at.parent()
            .map(std::fs::create_dir_all)
            .unwrap_or(Ok(()))
            .and_then(|()| std::os::unix::fs::symlink(to, &at))
            .map_err(|source| JailError::Mount {
                what: "make the link",
                path: at.clone(),
                source,
            })?;
    }
    std::env::set_current_dir(root).map_err(|source| JailError::Mount {
        what: "chdir",
        path: root.clone(),
        source,
    })?;
    // pivot_root(".", "."): the old root ends up on top of the new one,
    // and is detached at once.
    nix::unistd::pivot_root(".", ".").map_err(mount_err("pivot_root to", root))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(mount_err("detach the host's root", root))?;
    std::env::set_current_dir("/").map_err(|source| JailError::Mount {
        what: "chdir",
        path: "/".into(),
        source,
    })?;
    Ok(())
}

/// Hides `path` (shown by a bind already mounted in `root`): a directory
/// under an empty 64 KiB tmpfs (its own mount points go there: a snapshot
/// directory the host exposes later, a bind below it), a file under an
/// empty file of mode 0 (unreadable without CAP_DAC_OVERRIDE). A path
/// gone since it was listed needs no mask.
fn mask(root: &Path, path: &Path) -> Result<(), JailError> {
    use nix::mount::{mount, MsFlags};
    let none: Option<&str> = None;
    let target = root.join(path.strip_prefix("/").unwrap_or(path));
    // A link is not followed: mount(2) would mask its target instead.
    let Ok(meta) = target.symlink_metadata() else {
        return Ok(());
    };
    if meta.file_type().is_symlink() {
        return Ok(());
    }
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    if meta.is_dir() {
        return mount(
            Some("tmpfs"),
            &target,
            Some("tmpfs"),
            flags,
            Some("mode=0700,size=64k"),
        )
        .map_err(mount_err("mask", path));
    }
    // A file or a socket (tined.sock) gets the empty file bound over it.
    let empty = root.join(".masked");
    if !empty.exists() {
        std::fs::File::create(&empty)
            .and_then(|f| f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o000)))
            .map_err(|source| JailError::Mount {
                what: "make the mask file",
                path: empty.clone(),
                source,
            })?;
    }
    mount(Some(&empty), &target, none, MsFlags::MS_BIND, none).map_err(mount_err("mask", path))?;
    mount(
        none,
        &target,
        none,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | flags,
        none,
    )
    .map_err(mount_err("mask (read-only)", path))
}

/// The bounding set first (it needs CAP_SETPCAP, about to go), then the
/// ambient, inheritable, permitted and effective sets.
fn drop_capabilities(keep: &CapsHashSet) -> Result<(), JailError> {
    // Only a process with CAP_SETPCAP may shrink its bounding set (an
    // unprivileged one has no capability to bound).
    // A change of uid cleared the effective set but kept the permitted.
    let setpcap = caps::has_cap(None, CapSet::Permitted, Capability::CAP_SETPCAP).unwrap_or(false)
        && caps::raise(None, CapSet::Effective, Capability::CAP_SETPCAP).is_ok();
    for cap in caps::all().into_iter().filter(|_| setpcap) {
        if !keep.contains(&cap) {
            // A capability this kernel does not know is not in the set.
            match caps::drop(None, CapSet::Bounding, cap) {
                Ok(()) => {}
                Err(_) if !caps::has_cap(None, CapSet::Bounding, cap).unwrap_or(false) => {}
                Err(e) => return Err(JailError::Caps(e)),
            }
        }
    }
    caps::clear(None, CapSet::Ambient).map_err(JailError::Caps)?;
    caps::clear(None, CapSet::Inheritable).map_err(JailError::Caps)?;
    let permitted = caps::read(None, CapSet::Permitted).map_err(JailError::Caps)?;
    let left: CapsHashSet = permitted.intersection(keep).copied().collect();
    caps::set(None, CapSet::Effective, &left).map_err(JailError::Caps)?;
    caps::set(None, CapSet::Permitted, &left).map_err(JailError::Caps)?;
    Ok(())
}

fn get_rlimit(res: libc::__rlimit_resource_t) -> (u64, u64) {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one struct rlimit we own.
    unsafe { libc::getrlimit(res, &mut r) };
    (r.rlim_cur, r.rlim_max)
}

fn set_rlimit(
    res: libc::__rlimit_resource_t,
    value: u64,
    what: &'static str,
) -> Result<(), JailError> {
    let r = libc::rlimit {
        rlim_cur: value,
        rlim_max: value,
    };
    // SAFETY: setrlimit reads one struct rlimit that outlives the call.
    if unsafe { libc::setrlimit(res, &r) } != 0 {
        return Err(JailError::Rlimit {
            what,
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

fn prctl(option: libc::c_int, arg: libc::c_ulong, what: &'static str) -> Result<(), JailError> {
    // SAFETY: these prctl options take one integer and no pointers.
    if unsafe { libc::prctl(option, arg, 0, 0, 0) } != 0 {
        return Err(JailError::Prctl {
            what,
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_plan_mounts_parents_first_and_masks_before_what_shows_below_them() {
        let dir = std::env::temp_dir().join(format!("tine-jail-plan-{}", std::process::id()));
        let home = dir.join("home");
        for d in ["vms/a", "store/staging/x", "layers"] {
            std::fs::create_dir_all(home.join(d)).expect("dir");
        }
        let steps = plan(
            &[
                Bind::ro(home.join("store/staging/x")),
                Bind::rw(home.join("vms/a")),
                Bind::rw(&home),
                Bind::ro(dir.join("missing")),
            ],
            &[home.join("store"), home.join("intents")],
        );
        assert_eq!(
            steps,
            vec![
                Step::Bind(Bind::rw(&home)),
                // A mask is mounted over a bind, before what shows below
                // it; a missing path's mask is skipped when mounted.
                Step::Mask(home.join("intents")),
                Step::Mask(home.join("store")),
                // Below a mask a bind shows again, even under a writable
                // one; `vms/a` is shown by the home's bind already.
                Step::Bind(Bind::ro(home.join("store/staging/x"))),
            ]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
