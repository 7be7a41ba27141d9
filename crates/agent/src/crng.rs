//! The kernel's CRNG around a moment: what makes a fork's reproducible
//! children draw the same kernel randomness, and for how long.
//!
//! Linux 6.1 keeps one base key and one key per CPU. A reseed
//! (`crng_reseed`) mixes RDSEED/RDRAND (or the TSC) and the input pool,
//! which holds interrupt timings: no two copies can reseed alike. It runs
//! on RNDRESEEDCRNG and, on demand, at the first draw once the base key is
//! older than an interval (`crng_has_old_seed`): 60 s, or uptime/2 during
//! the first two minutes. Children of one moment therefore draw alike only
//! while their inherited seed is younger than that, counted in guest time
//! from the last reseed before the moment. So the quiesce reseeds just
//! before the moment (the seed's age then counts from there, and a child's
//! clock only runs from its resume: children start parked), and derives
//! every CPU's key from the new base key in CPU order, so no child derives
//! one later in an order of its own.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};

/// `_IO('R', 0x07)`: reseed the CRNG from the input pool now.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;
/// Linux's `CRNG_RESEED_INTERVAL`.
const RESEED_INTERVAL_MS: u64 = 60_000;
/// Before two minutes of uptime Linux reseeds at uptime/2, in whole
/// seconds: a seed born at uptime B lasts until about 2B, a little less
/// for the rounding.
const EARLY_ROUNDING_MS: u64 = 1_000;

/// When this agent last reseeded the CRNG, in CLOCK_MONOTONIC ns (0:
/// never), and how long the kernel keeps that seed. A copy inherits both
/// with the agent's memory, so its wake can say how old its seed is in
/// its own time.
static RESEEDED_AT_NS: AtomicU64 = AtomicU64::new(0);
static WINDOW_MS: AtomicU64 = AtomicU64::new(0);

/// What a reseed for a moment did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reseeded {
    /// How long the kernel keeps the new seed (guest time from now).
    pub window_ms: u64,
    /// CPUs whose key was derived from it, in order.
    pub cpus: usize,
}

/// How long Linux keeps a seed born at `uptime_ms` (CLOCK_MONOTONIC,
/// which is what `ktime_get_seconds` and jiffies follow).
pub fn window_for(uptime_ms: u64) -> u64 {
    if uptime_ms >= RESEED_INTERVAL_MS {
        RESEED_INTERVAL_MS
    } else {
        uptime_ms.saturating_sub(EARLY_ROUNDING_MS)
    }
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime fills the timespec we pass and keeps nothing.
    if unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) } != 0 {
        return 0;
    }
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

fn ioctl_reseed() -> Result<(), String> {
    let f = File::open("/dev/urandom").map_err(|e| format!("/dev/urandom: {e}"))?;
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG) } < 0 {
        return Err(format!("RNDRESEEDCRNG: {}", io::Error::last_os_error()));
    }
    Ok(())
}

/// Reseeds the CRNG now and notes when (a secure wake's reseed).
pub fn reseed() -> Result<u64, String> {
    ioctl_reseed()?;
    Ok(note())
}

fn note() -> u64 {
    let now = monotonic_ns();
    let window = window_for(now / 1_000_000);
    RESEEDED_AT_NS.store(now, Ordering::Relaxed);
    WINDOW_MS.store(window, Ordering::Relaxed);
    window
}

/// Reseeds the CRNG for a moment about to be taken, then derives every
/// CPU's key from the new base key, lowest CPU first.
pub fn reseed_for_moment() -> Result<Reseeded, String> {
    ioctl_reseed()?;
    let cpus = derive_cpu_keys();
    Ok(Reseeded {
        window_ms: note(),
        cpus,
    })
}

/// The CPUs this thread may run on, lowest first.
fn allowed_cpus() -> Option<(libc::cpu_set_t, Vec<usize>)> {
    // SAFETY: cpu_set_t is plain old data; all zeroes is an empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: sched_getaffinity writes at most size_of::<cpu_set_t>()
    // bytes into the set we own; 0 is the calling thread.
    let rc =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return None;
    }
    let cpus = (0..libc::CPU_SETSIZE as usize)
        // SAFETY: CPU_ISSET reads the set within its bounds (< CPU_SETSIZE).
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect();
    Some((set, cpus))
}

fn pin(cpu: usize) -> bool {
    // SAFETY: as in allowed_cpus; CPU_SET writes within the set's bounds.
    let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: cpu < CPU_SETSIZE (it came from allowed_cpus).
    unsafe { libc::CPU_SET(cpu, &mut one) };
    // SAFETY: sched_setaffinity reads the set we pass; 0 is this thread.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one) == 0 }
}

fn unpin(set: &libc::cpu_set_t) {
    // SAFETY: sched_setaffinity reads the set we pass; 0 is this thread.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) };
}

/// One draw on each CPU in turn: each per-CPU key is derived from the base
/// key in a fixed order (deriving one also advances the base key). Returns
/// how many CPUs drew.
fn derive_cpu_keys() -> usize {
    let Some((set, cpus)) = allowed_cpus() else {
        return 0;
    };
    let mut n = 0;
    for &cpu in &cpus {
        let mut b = [0u8; 1];
        // SAFETY: getrandom writes at most 1 byte into `b`.
        if pin(cpu) && unsafe { libc::getrandom(b.as_mut_ptr().cast(), 1, 0) } == 1 {
            n += 1;
        }
    }
    unpin(&set);
    n
}

/// 32 bytes from /dev/urandom, read on the lowest allowed CPU (per-CPU
/// keys: a copy's draws match its siblings' on the same CPU), as hex;
/// empty on failure.
pub fn sample() -> String {
    let pinned = allowed_cpus().filter(|(_, cpus)| !cpus.is_empty());
    if let Some((_, cpus)) = &pinned {
        pin(cpus[0]);
    }
    let mut b = [0u8; 32];
    let got = File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    if let Some((set, _)) = &pinned {
        unpin(set);
    }
    match got {
        Ok(()) => protocol::wake::to_hex(&b),
        Err(_) => String::new(),
    }
}

/// The inherited seed: its age now (guest time since the last reseed this
/// agent made) and how long the kernel keeps it, in ms; None when this
/// agent never reseeded.
pub fn seed_age() -> Option<(u64, u64)> {
    match RESEEDED_AT_NS.load(Ordering::Relaxed) {
        0 => None,
        at => Some((
            monotonic_ns().saturating_sub(at) / 1_000_000,
            WINDOW_MS.load(Ordering::Relaxed),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_window_follows_linux_reseed_interval() {
        // Past a minute of uptime the kernel keeps a seed 60 s.
        assert_eq!(window_for(60_000), 60_000);
        assert_eq!(window_for(600_000), 60_000);
        // Younger: it reseeds at twice the seed's birth uptime.
        assert_eq!(window_for(20_000), 19_000);
        assert_eq!(window_for(500), 0);
    }

    #[test]
    fn test_allowed_cpus_lists_where_we_run() {
        let (_, cpus) = allowed_cpus().expect("sched_getaffinity");
        assert!(!cpus.is_empty());
        assert!(cpus.windows(2).all(|w| w[0] < w[1]));
    }
}
