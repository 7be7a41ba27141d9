//! What a VMM process does to itself before it reads a byte of a guest or
//! a snapshot (docs/design/isolation.md, "The jail"): join the cgroups the
//! host made for its vm, no core dumps and no ptrace from its peers, a
//! bounded fd table, `no_new_privs`, and every capability dropped but
//! CAP_NET_ADMIN when the vm has a network (its forks create their taps).
//!
//! The host prepares what needs privilege (the groups and their limits,
//! `host::cgroup`); the VMM enters them itself, first thing, so nothing
//! of it runs outside them. Fork children inherit all of it; the host
//! moves each child into its own group while it is still paused.

use std::path::{Path, PathBuf};

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
}

/// What [`enter`] did, for the VMM's log and the tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    /// The effective capabilities left.
    pub kept: Vec<String>,
    pub cgroups: usize,
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
}

/// Enters the jail: on return this process (and whatever it forks) is in
/// the groups, cannot dump core, be ptraced by a process without
/// CAP_SYS_PTRACE, gain privileges by exec, or use a capability but the
/// one kept.
pub fn enter(jail: &Jail) -> Result<Report, JailError> {
    for dir in &jail.cgroups {
        join_cgroup(dir)?;
    }
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
        cgroups: jail.cgroups.len(),
    })
}

/// Moves this process (all its threads) into the group at `dir`.
pub fn join_cgroup(dir: &Path) -> Result<(), JailError> {
    let path = dir.join("cgroup.procs");
    // "0" is the writing process itself.
    std::fs::write(&path, b"0\n").map_err(|source| JailError::Cgroup { path, source })
}

/// The bounding set first (it needs CAP_SETPCAP, about to go), then the
/// ambient, inheritable, permitted and effective sets.
fn drop_capabilities(keep: &CapsHashSet) -> Result<(), JailError> {
    for cap in caps::all() {
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

/// The effective capabilities of process `pid` (`CapEff` of its status),
/// as a bit mask; None when it is gone.
pub fn effective_caps(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("CapEff:"))?;
    u64::from_str_radix(line.split_whitespace().nth(1)?, 16).ok()
}
