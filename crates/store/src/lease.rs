//! Leases: who holds a pending snapshot or a gc pass, and until when.
//!
//! An owner is `BOOT_ID:PID:START` (the kernel's boot id, the process id
//! and its start time in clock ticks, which together never name two
//! processes). On the host (and boot) that took it, a lease is gone
//! exactly when that process no longer exists: a writer killed with
//! SIGKILL frees its lease at once, and a slow but living one keeps it.
//! Elsewhere (another host sharing the metadata, or an earlier boot) only
//! the expiry time tells; holders renew it as they work.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// This process's owner string.
pub fn me() -> &'static str {
    static ME: OnceLock<String> = OnceLock::new();
    // Computed once per process; a fork(2)ed child has another pid, so
    // it must not reuse the parent's string (checked in `owner`).
    ME.get_or_init(|| owner_of(std::process::id() as i32))
}

/// This process's owner string, correct after fork(2) as well.
pub fn owner() -> String {
    let pid = std::process::id() as i32;
    let cached = me();
    if cached.split(':').nth(1) == Some(&pid.to_string()) {
        cached.to_owned()
    } else {
        owner_of(pid)
    }
}

fn owner_of(pid: i32) -> String {
    format!("{}:{}:{}", boot_id(), pid, start_time(pid).unwrap_or(0))
}

fn boot_id() -> &'static str {
    static ID: OnceLock<String> = OnceLock::new();
    ID.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| "unknown-boot".into())
    })
}

/// A process's start time (field 22 of /proc/PID/stat), or None if it
/// does not exist.
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: split
    // after its last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Whether process `pid` exists on this host.
pub fn pid_alive(pid: i32) -> bool {
    if pid <= 0 {
        return false;
    }
    // SAFETY: kill with signal 0 only checks that the process exists and
    // may be signalled; it has no effect on it.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Whether the lease held by `owner` until `expires_ms` is gone: its
/// process (on this boot of this host) has exited, or, for an owner of
/// another host or boot, the expiry time has passed.
pub fn gone(owner: &str, expires_ms: i64) -> bool {
    let expired = now_ms() > expires_ms;
    let mut parts = owner.split(':');
    let (Some(boot), Some(pid), Some(start)) = (parts.next(), parts.next(), parts.next()) else {
        return expired;
    };
    if boot != boot_id() {
        return expired;
    }
    let (Ok(pid), Ok(start)) = (pid.parse::<i32>(), start.parse::<u64>()) else {
        return expired;
    };
    start_time(pid) != Some(start)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_living_local_owner_keeps_its_lease_past_expiry() {
        let me = owner();
        assert!(!gone(&me, now_ms() + 60_000));
        assert!(!gone(&me, now_ms() - 1));
        // Another host's (or boot's) lease: only its expiry counts.
        assert!(!gone("other-boot:1:1", now_ms() + 60_000));
        assert!(gone("other-boot:1:1", now_ms() - 1));
        assert!(gone("garbage", now_ms() - 1));
    }

    #[test]
    fn dead_process_frees_its_lease() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        let o = owner_of(pid);
        child.wait().unwrap();
        assert!(gone(&o, now_ms() + 60_000), "{o}");
        assert!(pid_alive(std::process::id() as i32));
    }
}
