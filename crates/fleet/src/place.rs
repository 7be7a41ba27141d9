//! Where a sleeping branch wakes: the placement policy.
//!
//! Every host that is up, satisfies the snapshot's compatibility manifest
//! and has room is a candidate; the best score wins:
//!
//! ```text
//! score = free memory after placing / total memory
//!       - 0.25 × running vms / vCPUs          (load)
//!       + 0.10 if the host is the preferred one (it holds the branch's
//!              chunks in its cache, or the caller asked)
//! ```
//!
//! E2B samples K=3 nodes and takes the least loaded; scanning every host
//! costs microseconds at fleet sizes a PostgreSQL row per host serves
//! (bench/fleet: 100 hosts), so the best host is never missed by sampling.
//! A fork into N children places them one at a time, taking each child's
//! memory off its host's free memory, so they spread once a host fills.
//! A refusal names every host and why it was passed over.

use serde::Serialize;
use snapshot::compat::Compat;

use crate::hosts::{HostRow, HostState};

/// Memory left free on a host for its own processes (tined, VMM overhead,
/// page cache that MemAvailable counts), in MiB.
pub const RESERVE_MIB: u64 = 256;

/// What a vm needs from its host.
#[derive(Clone, Debug, Default)]
pub struct Need {
    pub mem_mib: u64,
    pub vcpus: u64,
    /// The snapshot's compatibility manifest (None: anything goes).
    pub compat: Option<Compat>,
}

/// A host chosen.
#[derive(Clone, Debug, Serialize)]
pub struct Placement {
    pub host: String,
    pub address: String,
    pub score: f64,
}

/// Why no host could take it: each host and its reasons.
#[derive(Clone, Debug, Serialize)]
pub struct Refusal {
    pub hosts: Vec<(String, Vec<String>)>,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.hosts.is_empty() {
            return f.write_str("no host is registered (is tined running? `tine hosts`)");
        }
        write!(f, "no host can take it:")?;
        for (h, why) in &self.hosts {
            write!(f, "\n  - {h}: {}", why.join("; "))?;
        }
        Ok(())
    }
}

/// Why `h` cannot take `need`, given `used` MiB already placed on it in
/// this decision; empty when it can.
fn reasons(h: &HostRow, need: &Need, used: u64) -> Vec<String> {
    let mut why = Vec::new();
    match h.state {
        HostState::Up => {}
        HostState::Stopped => why.push("its tined is stopped".into()),
        HostState::Lost => why.push(format!(
            "lost (no heartbeat for {} s)",
            (crate::now_ms() - h.heartbeat_ms).max(0) / 1000
        )),
    }
    if let Some(c) = &need.compat {
        if let Err(e) = snapshot::compat::check(c, &h.offer) {
            why.extend(e.mismatches.iter().map(|m| m.to_string()));
        }
    }
    let free = h
        .capacity
        .mem_available_mib
        .saturating_sub(RESERVE_MIB)
        .saturating_sub(used);
    if free < need.mem_mib {
        why.push(format!(
            "{free} MiB free (after {RESERVE_MIB} MiB kept for the host), needs {} MiB",
            need.mem_mib
        ));
    }
    why
}

fn score(h: &HostRow, need: &Need, used: u64, prefer: Option<&str>) -> f64 {
    let total = h.capacity.mem_total_mib.max(1) as f64;
    let free_after = h
        .capacity
        .mem_available_mib
        .saturating_sub(used + need.mem_mib) as f64;
    let load = h.capacity.vms as f64 / h.capacity.vcpus.max(1) as f64;
    let local = if prefer == Some(h.id.as_str()) {
        0.10
    } else {
        0.0
    };
    free_after / total - 0.25 * load + local
}

/// The best host for one vm.
pub fn place(hosts: &[HostRow], need: &Need, prefer: Option<&str>) -> Result<Placement, Refusal> {
    place_many(hosts, need, 1, prefer).map(|mut v| v.remove(0))
}

/// Hosts for `n` vms of the same need (a fork), one at a time: each
/// placement counts against its host for the next.
pub fn place_many(
    hosts: &[HostRow],
    need: &Need,
    n: usize,
    prefer: Option<&str>,
) -> Result<Vec<Placement>, Refusal> {
    let mut used = vec![0u64; hosts.len()];
    let mut placed_here = vec![0u64; hosts.len()];
    let mut out = Vec::with_capacity(n);
    for _ in 0..n.max(1) {
        let mut best: Option<(usize, f64)> = None;
        for (i, h) in hosts.iter().enumerate() {
            if !reasons(h, need, used[i]).is_empty() {
                continue;
            }
            // Children placed in this decision count as load too.
            let mut h2 = h.clone();
            h2.capacity.vms += placed_here[i];
            let s = score(&h2, need, used[i], prefer);
            if best.is_none_or(|(_, b)| s > b) {
                best = Some((i, s));
            }
        }
        let Some((i, s)) = best else {
            return Err(Refusal {
                hosts: hosts
                    .iter()
                    .enumerate()
                    .map(|(i, h)| {
                        let mut why = reasons(h, need, used[i]);
                        if why.is_empty() {
                            why.push("full with the other children of this request".into());
                        }
                        (h.id.clone(), why)
                    })
                    .collect(),
            });
        };
        used[i] += need.mem_mib;
        placed_here[i] += 1;
        out.push(Placement {
            host: hosts[i].id.clone(),
            address: hosts[i].address.clone(),
            score: s,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hosts::Capacity;
    use snapshot::compat::{CpuidEntry, HostCompat};

    fn offer(ecx: u32) -> HostCompat {
        HostCompat {
            tine_version: "0.1.0".into(),
            format_version: snapshot::Version::new(1, 0),
            kernel: "6.1".into(),
            cpu_vendor: "GenuineIntel".into(),
            cpuid: vec![CpuidEntry {
                function: 1,
                ecx,
                ..Default::default()
            }],
            msrs: vec![],
            caps: vec![],
            tsc_khz: None,
        }
    }

    pub(crate) fn host(id: &str, avail: u64, vms: u64, ecx: u32) -> HostRow {
        HostRow {
            id: id.into(),
            address: format!("unix:/{id}"),
            state: HostState::Up,
            offer: offer(ecx),
            capacity: Capacity {
                mem_total_mib: 4096,
                mem_available_mib: avail,
                vcpus: 2,
                vms,
                vm_mem_mib: 0,
            },
            started_ms: 0,
            heartbeat_ms: crate::now_ms(),
            lease_ms: crate::now_ms() + 10_000,
            kernel: "6.1".into(),
            cpu_vendor: "GenuineIntel".into(),
            tine_version: "0.1.0".into(),
            owner: "o".into(),
        }
    }

    fn compat(ecx: u32) -> Compat {
        Compat {
            tine_version: "0.1.0".into(),
            format_version: snapshot::Version::new(1, 0),
            host_kernel: "6.1".into(),
            cpu_vendor: "GenuineIntel".into(),
            cpuid: vec![CpuidEntry {
                function: 1,
                ecx,
                ..Default::default()
            }],
            msrs: vec![],
            caps: vec![],
            tsc_khz: None,
            devices: vec![],
            mem_mib: 256,
            vcpus: 1,
            cpu_template: None,
        }
    }

    #[test]
    fn picks_the_emptiest_compatible_host() {
        let hosts = [
            host("a", 1000, 0, 0b11),
            host("b", 3000, 0, 0b01),
            host("c", 2000, 0, 0b11),
        ];
        let need = Need {
            mem_mib: 256,
            vcpus: 1,
            compat: Some(compat(0b11)),
        };
        // b has the most memory but lacks a CPU feature the snapshot saw.
        let p = place(&hosts, &need, None).expect("placed");
        assert_eq!(p.host, "c");
        // Preferring a (its cache) does not outweigh a much emptier host.
        assert_eq!(place(&hosts, &need, Some("a")).expect("placed").host, "c");
    }

    #[test]
    fn refuses_naming_every_host() {
        let mut lost = host("c", 4000, 0, 0b11);
        lost.state = HostState::Lost;
        let hosts = [host("a", 300, 0, 0b11), host("b", 3000, 0, 0b01), lost];
        let need = Need {
            mem_mib: 256,
            vcpus: 1,
            compat: Some(compat(0b11)),
        };
        let r = place(&hosts, &need, None).expect_err("refused");
        let text = r.to_string();
        assert!(text.contains("a: 44 MiB free"), "{text}");
        assert!(text.contains("b: ") && text.contains("CPU"), "{text}");
        assert!(text.contains("c: lost"), "{text}");
    }

    #[test]
    fn a_fork_spreads_once_a_host_fills() {
        let hosts = [host("a", 1300, 0, 1), host("b", 1300, 0, 1)];
        let need = Need {
            mem_mib: 256,
            vcpus: 1,
            compat: None,
        };
        let p = place_many(&hosts, &need, 4, None).expect("placed");
        let on_a = p.iter().filter(|p| p.host == "a").count();
        assert_eq!(on_a, 2, "{p:?}");
        // 1300 - 256 reserve = 1044: four fit per host, so ten do not.
        let r = place_many(&hosts, &need, 10, None).expect_err("too many");
        assert!(
            r.to_string().contains("full") || r.to_string().contains("free"),
            "{r}"
        );
    }
}
