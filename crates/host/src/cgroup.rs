//! One cgroup per VMM process tree (a `run` or a wake and every vm forked
//! from it), with limits from its vms' sizes (docs/design/isolation.md,
//! "The jail"). The host makes the group and writes its limits; the
//! tree's first VMM joins it itself before it reads a guest byte
//! (`vmm::jail`); fork children are born in it (fork(2) keeps the
//! group), so nothing is moved on the fork path and everything a child
//! allocates as it starts is charged to its tree. Moving each child into
//! a group of its own cost a fork an RCU grace period (6-12 ms on this
//! machine's v1 hierarchies) and left what a child allocated before the
//! move (its KVM VM, page tables: about 4 MiB a child) charged to its
//! parent's group, which 300 children of one vm filled (bench/fork
//! --thousand). The tree is the unit the jail already isolates by (its
//! uid, root and PID namespace); its limits are the sum of its vms'
//! (they share one size), raised before a fork and lowered after an
//! `rm`. The jailed VMM sees no cgroup filesystem, so it cannot change
//! them. When a tree's last vm goes, whatever is left in its group ends
//! and the group is removed. A vm from before trees keeps a group of its
//! own, and its fork children are moved into theirs after the fork.
//!
//! cgroup v2 when its hierarchy has the memory, pids and cpu controllers
//! (the nested test host); otherwise the v1 hierarchies of those
//! controllers (this machine mounts them v1 beside an empty v2).
//! Groups live at the hierarchy's root, under `tine-<home>` (a digest of
//! `$TINE_HOME`), so every process of this home finds them whatever group
//! it runs in itself.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::error::Context;

/// A vm's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of memory its processes may have charged.
    pub memory: u64,
    /// Processes and threads.
    pub pids: u64,
    /// CPU time per period, in µs (of [`CPU_PERIOD_US`]).
    pub cpu_quota_us: u64,
}

/// The CPU bandwidth period.
pub const CPU_PERIOD_US: u64 = 100_000;

/// Processes and threads of one vm: vCPUs, devices, console, API, page-in
/// (the store's runtime), one process per checkpoint and per writer.
/// Generous for what a vm does, tight for a fork bomb.
pub const PIDS_PER_VM: u64 = 1024;

/// Memory beyond the guest's for the VMM itself (devices, page tables,
/// the page cache of what it writes).
const OVERHEAD_MIB: u64 = 256;

impl Limits {
    /// The limits of `n` vms of these limits each (a tree's).
    pub fn times(self, n: usize) -> Self {
        let n = n.max(1) as u64;
        Self {
            memory: self.memory.saturating_mul(n),
            pids: self.pids.saturating_mul(n),
            cpu_quota_us: self.cpu_quota_us.saturating_mul(n),
        }
    }

    /// From the vm's size. Memory: twice the guest's plus the VMM's
    /// overhead, because a page is charged to the group that first
    /// touched it: after a fork the children keep the parent's pages
    /// (charged to the parent's group) while the parent writes new ones.
    /// CPU: one core per vCPU plus one for the device and API threads.
    pub fn of(mem_mib: u64, vcpus: u8) -> Self {
        Self {
            memory: (2 * mem_mib + OVERHEAD_MIB) << 20,
            pids: PIDS_PER_VM,
            cpu_quota_us: (u64::from(vcpus) + 1) * CPU_PERIOD_US,
        }
    }
}

/// Where groups are made.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Hierarchy {
    /// The cgroup2 mount point.
    V2(PathBuf),
    /// The v1 mount points of the memory, pids and cpu controllers.
    V1 {
        memory: PathBuf,
        pids: PathBuf,
        cpu: PathBuf,
    },
}

/// This host's hierarchy, found once; None when neither has the
/// controllers (no cgroup filesystem mounted, or not root).
fn hierarchy() -> Option<&'static Hierarchy> {
    static H: OnceLock<Option<Hierarchy>> = OnceLock::new();
    H.get_or_init(|| {
        let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        detect(&info, |p| std::fs::read_to_string(p).ok())
    })
    .as_ref()
}

/// The hierarchy from /proc/self/mountinfo; `read` reads a file (the
/// v2 root's `cgroup.controllers`).
fn detect(mountinfo: &str, read: impl Fn(&Path) -> Option<String>) -> Option<Hierarchy> {
    let mut v2 = None;
    let (mut memory, mut pids, mut cpu) = (None, None, None);
    for line in mountinfo.lines() {
        // id parent major:minor root mountpoint options [optional...] - fstype source superoptions
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let f: Vec<&str> = left.split(' ').collect();
        let r: Vec<&str> = right.split(' ').collect();
        let (Some(root), Some(point), Some(fstype)) = (f.get(3), f.get(4), r.first()) else {
            continue;
        };
        // A bind mount of a subgroup is not a hierarchy's root.
        if *root != "/" {
            continue;
        }
        let point = PathBuf::from(point);
        match *fstype {
            "cgroup2" => v2 = v2.or(Some(point)),
            "cgroup" => {
                let opts = r.get(2).copied().unwrap_or("");
                for o in opts.split(',') {
                    match o {
                        "memory" => memory = memory.or(Some(point.clone())),
                        "pids" => pids = pids.or(Some(point.clone())),
                        "cpu" => cpu = cpu.or(Some(point.clone())),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    if let Some(root) = v2 {
        let controllers = read(&root.join("cgroup.controllers")).unwrap_or_default();
        let has = |c: &str| controllers.split_whitespace().any(|x| x == c);
        if has("memory") && has("pids") && has("cpu") {
            return Some(Hierarchy::V2(root));
        }
    }
    Some(Hierarchy::V1 {
        memory: memory?,
        pids: pids?,
        cpu: cpu?,
    })
}

/// The group vm `vm`'s processes run in: its tree's, or for a vm from
/// before trees its own (named after the vm). A tree's group name starts
/// with `_`, which no vm name does.
pub fn group_of(vm: &crate::state::VmDir) -> String {
    match vm.tree().and_then(|t| t.file_name()) {
        Some(t) => format!("_tree-{}", t.to_string_lossy()),
        None => vm.name.clone(),
    }
}

/// The per-home parent group's name.
fn home_group(home: &Path) -> String {
    let h = blake3::hash(home.as_os_str().as_encoded_bytes());
    format!("tine-{}", &h.to_hex()[..12])
}

/// Makes (or reuses) group `name` ([`group_of`]) with `limits` and
/// returns the directories a VMM joins (`tine-vmm --cgroup`). Empty when
/// this host has no usable cgroup hierarchy: the vm then runs without
/// limits.
pub fn prepare(home: &Path, name: &str, limits: Limits) -> crate::Result<Vec<PathBuf>> {
    let Some(h) = hierarchy() else {
        return Ok(Vec::new());
    };
    let parent = home_group(home);
    let dirs = match h {
        Hierarchy::V2(root) => {
            let base = root.join(&parent);
            let dir = base.join(name);
            mkdir(&base)?;
            // Controllers reach a group only if its parent delegates them.
            for d in [root.as_path(), base.as_path()] {
                write(&d.join("cgroup.subtree_control"), "+memory +pids +cpu")?;
            }
            mkdir_group(&dir)?;
            // Guest memory never goes to swap (where it would outlive
            // the vm on a disk).
            let _ = write(&dir.join("memory.swap.max"), "0");
            // An OOM in a tree ends its largest process (a runaway VMM),
            // not every vm of the tree.
            write(&dir.join("memory.oom.group"), "0")?;
            vec![dir]
        }
        Hierarchy::V1 { memory, pids, cpu } => {
            let mut dirs = Vec::new();
            for root in [memory, pids, cpu] {
                let dir = root.join(&parent).join(name);
                mkdir_group(&dir)?;
                dirs.push(dir);
            }
            write(
                &dirs[2].join("cpu.cfs_period_us"),
                &CPU_PERIOD_US.to_string(),
            )?;
            // One hierarchy may hold several controllers (cpu,cpuacct):
            // the same directory then appears once.
            dirs.dedup();
            dirs
        }
    };
    for (file, value) in limit_files(h, home, name, limits) {
        write(&file, &value)?;
    }
    Ok(dirs)
}

/// The files of group `name`'s memory, pids and CPU limits, and what
/// `limits` writes into each.
fn limit_files(h: &Hierarchy, home: &Path, name: &str, limits: Limits) -> [(PathBuf, String); 3] {
    let parent = home_group(home);
    let (memory, pids, cpu) = match h {
        Hierarchy::V2(root) => {
            let dir = root.join(&parent).join(name);
            (
                dir.join("memory.max"),
                dir.join("pids.max"),
                dir.join("cpu.max"),
            )
        }
        Hierarchy::V1 { memory, pids, cpu } => (
            memory
                .join(&parent)
                .join(name)
                .join("memory.limit_in_bytes"),
            pids.join(&parent).join(name).join("pids.max"),
            cpu.join(&parent).join(name).join("cpu.cfs_quota_us"),
        ),
    };
    let quota = match h {
        Hierarchy::V2(_) => format!("{} {CPU_PERIOD_US}", limits.cpu_quota_us),
        Hierarchy::V1 { .. } => limits.cpu_quota_us.to_string(),
    };
    [
        (memory, limits.memory.to_string()),
        (pids, limits.pids.to_string()),
        (cpu, quota),
    ]
}

/// Moves process `pid` (all its threads) into the group at `dirs` (from
/// [`prepare`]).
pub fn enter(dirs: &[PathBuf], pid: u32) -> crate::Result<()> {
    // "0" would move the writer itself.
    if pid == 0 {
        return Ok(());
    }
    for d in dirs {
        write(&d.join("cgroup.procs"), &pid.to_string())?;
    }
    Ok(())
}

/// Lowers (or raises) group `name`'s limits, if it exists: best effort
/// (a memory limit below what the group uses now is refused by v1 and
/// stays where it was).
pub fn set_limits(home: &Path, name: &str, limits: Limits) {
    let Some(h) = hierarchy() else { return };
    if dirs_of(home, name).iter().all(|d| !d.is_dir()) {
        return;
    }
    for (file, value) in limit_files(h, home, name, limits) {
        if let Err(e) = write(&file, &value) {
            tracing::debug!("{e}");
        }
    }
}

/// Group `name`'s directories (whether or not they exist).
fn dirs_of(home: &Path, name: &str) -> Vec<PathBuf> {
    let parent = home_group(home);
    let mut dirs: Vec<PathBuf> = match hierarchy() {
        None => Vec::new(),
        Some(Hierarchy::V2(root)) => vec![root.join(&parent).join(name)],
        Some(Hierarchy::V1 { memory, pids, cpu }) => [memory, pids, cpu]
            .iter()
            .map(|r| r.join(&parent).join(name))
            .collect(),
    };
    dirs.dedup();
    dirs
}

/// The processes in group `name`.
pub fn pids(home: &Path, name: &str) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    for d in dirs_of(home, name) {
        if let Ok(text) = std::fs::read_to_string(d.join("cgroup.procs")) {
            out.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// Ends every process left in group `name` and removes the group.
/// Returns how many processes it killed. Best effort: a group that cannot
/// go yet (a process in uninterruptible sleep) is left for the next `rm`
/// or reconcile.
pub fn remove(home: &Path, name: &str) -> usize {
    let dirs = dirs_of(home, name);
    if dirs.iter().all(|d| !d.exists()) {
        return 0;
    }
    // Distinct processes found alive: one still exiting shows again.
    let mut killed = std::collections::HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left: Vec<u32> = pids(home, name)
            .into_iter()
            .filter(|p| crate::proc::ProcStat::read(*p).is_some_and(|s| !s.is_exited()))
            .collect();
        if left.is_empty() {
            break;
        }
        for pid in &left {
            // SAFETY: kill(2) with a pid from the group and SIGKILL.
            if unsafe { libc::kill(*pid as libc::pid_t, libc::SIGKILL) } == 0 {
                killed.insert(*pid);
            }
        }
        if Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for d in &dirs {
        // A process the kernel has not finished tearing down (a VMM
        // unmapping its guest memory) still holds the group: EBUSY for a
        // moment under load.
        while let Err(e) = std::fs::remove_dir(d) {
            if e.raw_os_error() != Some(libc::EBUSY) || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // The home's group goes with its last vm (fails while others live).
        if let Some(parent) = d.parent() {
            let _ = std::fs::remove_dir(parent);
        }
    }
    killed.len()
}

/// Removes the groups of this home that no vm runs in any more (`live`
/// are the groups of the vms that exist). For reconcile.
pub fn sweep(home: &Path, live: &[String]) {
    let parent = home_group(home);
    let roots: Vec<PathBuf> = match hierarchy() {
        None => return,
        Some(Hierarchy::V2(root)) => vec![root.clone()],
        Some(Hierarchy::V1 { memory, pids, cpu }) => {
            vec![memory.clone(), pids.clone(), cpu.clone()]
        }
    };
    let mut gone = Vec::new();
    for root in roots {
        let Ok(entries) = std::fs::read_dir(root.join(&parent)) else {
            continue;
        };
        for e in entries.flatten() {
            if !e.path().is_dir() {
                continue;
            }
            let name = e.file_name().to_string_lossy().into_owned();
            if !live.contains(&name) && !gone.contains(&name) {
                gone.push(name);
            }
        }
    }
    for name in gone {
        remove(home, &name);
    }
}

/// Makes `dir` and its parent (the home's group, which a concurrent
/// [`remove`] of the home's last vm may take away between the two).
fn mkdir_group(dir: &Path) -> crate::Result<()> {
    let parent = dir.parent().unwrap_or(dir);
    for _ in 0..3 {
        mkdir(parent)?;
        match std::fs::create_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(mkdir_error(dir, e)),
        }
    }
    mkdir(dir)
}

fn mkdir_error(dir: &Path, e: std::io::Error) -> crate::Error {
    crate::Error::from(e).context(format!(
        "cannot create the cgroup {} (is tine run as root?)",
        dir.display()
    ))
}

fn mkdir(dir: &Path) -> crate::Result<()> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(mkdir_error(dir, e)),
    }
}

/// One write(2): cgroup files take a whole value per write.
fn write(path: &Path, value: &str) -> crate::Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|mut f| f.write_all(value.as_bytes()))
        .with_context(|| format!("cannot write {value:?} to {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const V1: &str = "\
25 24 0:22 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
30 25 0:27 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
31 25 0:28 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
32 25 0:29 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
33 25 0:30 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";

    #[test]
    fn test_v1_is_used_when_v2_has_no_controllers() {
        let h = detect(V1, |_| Some("hugetlb\n".into()));
        assert_eq!(
            h,
            Some(Hierarchy::V1 {
                memory: "/sys/fs/cgroup/memory".into(),
                pids: "/sys/fs/cgroup/pids".into(),
                cpu: "/sys/fs/cgroup/cpu".into(),
            })
        );
    }

    #[test]
    fn test_v2_with_controllers_wins() {
        let info = "40 1 0:35 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        let h = detect(info, |_| Some("cpuset cpu io memory pids\n".into()));
        assert_eq!(h, Some(Hierarchy::V2("/sys/fs/cgroup".into())));
        // No controllers and no v1: no cgroups.
        assert_eq!(detect(info, |_| Some(String::new())), None);
        // A bind-mounted subgroup is not a root.
        let sub = "40 1 0:35 /x /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n";
        assert_eq!(detect(sub, |_| Some("cpu memory pids".into())), None);
    }

    #[test]
    fn test_limits_follow_the_size() {
        let l = Limits::of(1024, 2);
        assert_eq!(l.memory, (2048 + 256) << 20);
        assert_eq!(l.cpu_quota_us, 300_000);
        assert_eq!(l.pids, PIDS_PER_VM);
    }
}
