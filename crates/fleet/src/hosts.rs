//! Hosts and their heartbeat leases, and the vms each one runs.
//!
//! A host's row is written by its own tined only: at start
//! ([`Fleet::register`]), every heartbeat ([`Fleet::heartbeat`], which
//! also replaces the host's list of vms), and at a clean stop. Its state
//! is read from the lease: a host whose lease ran out without a stop is
//! `lost`, and the vms it listed are reported lost with the snapshot they
//! last started from or slept in.

use serde::{Deserialize, Serialize};
use snapshot::compat::HostCompat;

use crate::db::{Db, MetaUrl, V};
use crate::{now_ms, FleetError};

/// What a host has, as its tined last reported it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    /// MemTotal.
    pub mem_total_mib: u64,
    /// MemAvailable: what new guests can still take.
    pub mem_available_mib: u64,
    /// Online CPUs.
    pub vcpus: u64,
    /// vms running.
    pub vms: u64,
    /// Their configured memory, summed.
    pub vm_mem_mib: u64,
}

impl Capacity {
    /// This machine's, with `vms` running vms of `vm_mem_mib` in all.
    pub fn probe(vms: u64, vm_mem_mib: u64) -> Capacity {
        let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let field = |name: &str| -> u64 {
            info.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|kib| kib.parse::<u64>().ok())
                .map_or(0, |kib| kib / 1024)
        };
        Capacity {
            mem_total_mib: field("MemTotal:"),
            mem_available_mib: field("MemAvailable:"),
            vcpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
            vms,
            vm_mem_mib,
        }
    }
}

/// A host's state, from its row and the clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HostState {
    /// Its lease is current: it takes work.
    Up,
    /// Its tined stopped cleanly (its vms, if any, still run there).
    Stopped,
    /// Its lease ran out without a stop: the host, or its tined, died.
    Lost,
}

impl std::fmt::Display for HostState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HostState::Up => "up",
            HostState::Stopped => "stopped",
            HostState::Lost => "lost",
        })
    }
}

/// A registered host.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HostRow {
    pub id: String,
    /// How other hosts reach its tined: `unix:/path/tined.sock` or
    /// `http://addr:port`.
    pub address: String,
    pub state: HostState,
    /// What it offers a snapshot (CPU, KVM, tine's format).
    #[serde(skip_serializing)]
    pub offer: HostCompat,
    pub capacity: Capacity,
    pub started_ms: i64,
    pub heartbeat_ms: i64,
    pub lease_ms: i64,
    /// Its kernel, CPU vendor and tine, from the offer (for listings).
    pub kernel: String,
    pub cpu_vendor: String,
    pub tine_version: String,
    #[serde(skip)]
    pub owner: String,
}

/// A vm a host runs, as its last heartbeat listed it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct VmRow {
    pub name: String,
    pub host: String,
    /// running | stopped | crashed | ...
    pub state: String,
    pub mem_mib: u64,
    pub vcpus: u64,
    /// The store snapshot it started from or last slept in, if any.
    pub snapshot: Option<i64>,
    pub updated_ms: i64,
}

/// What a tined registers.
#[derive(Clone, Debug)]
pub struct Registration {
    pub id: String,
    pub address: String,
    /// The registering process (`BOOT_ID:PID:START`): another process
    /// may take the id over only once this one's lease ran out.
    pub owner: String,
    pub offer: HostCompat,
    pub capacity: Capacity,
    /// How long a heartbeat keeps the host up.
    pub lease_ms: i64,
    /// Whether the holder of a live lease (its owner string, the lease's
    /// expiry) is known to have ended (`store::lease::gone`: a process of
    /// this boot of this machine that is not there): a tined restarted
    /// after a kill -9 takes its id back at once, not a lease later.
    pub owner_gone: fn(&str, i64) -> bool,
}

/// The fleet's tables.
#[derive(Debug)]
pub struct Fleet {
    db: Db,
}

fn json<T: Serialize>(v: &T) -> Result<String, FleetError> {
    serde_json::to_string(v).map_err(|e| FleetError::Corrupt(e.to_string()))
}

fn int(v: u64) -> V {
    V::I(i64::try_from(v).unwrap_or(i64::MAX))
}

const HOST_COLS: &str =
    "id, address, owner, offer, capacity, started_ms, heartbeat_ms, lease_ms, stopped_ms";

impl Fleet {
    /// Opens the fleet's tables in the database `url` names (migrating).
    pub fn open(url: &MetaUrl) -> Result<Fleet, FleetError> {
        Ok(Fleet { db: Db::open(url)? })
    }

    /// Where its tables are (password hidden).
    pub fn describe(&self) -> String {
        self.db.url().describe()
    }

    /// Whether other hosts can share this fleet.
    pub fn shared(&self) -> bool {
        self.db.url().shared()
    }

    /// Registers (or re-registers) this host. Refused while another
    /// process holds the id under a live lease.
    pub fn register(&self, r: &Registration) -> Result<(), FleetError> {
        let now = now_ms();
        if let Some(h) = self.host(&r.id)? {
            if h.state == HostState::Up
                && h.owner != r.owner
                && !(r.owner_gone)(&h.owner, h.lease_ms)
            {
                return Err(FleetError::HostIdTaken {
                    id: r.id.clone(),
                    address: h.address,
                    age_ms: now - h.heartbeat_ms,
                });
            }
        }
        self.db.write(&[(
            "INSERT INTO fleet_hosts (id, address, owner, offer, capacity, started_ms, heartbeat_ms, lease_ms, stopped_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $6, $7, NULL)
             ON CONFLICT (id) DO UPDATE SET address = excluded.address, owner = excluded.owner,
               offer = excluded.offer, capacity = excluded.capacity, started_ms = excluded.started_ms,
               heartbeat_ms = excluded.heartbeat_ms, lease_ms = excluded.lease_ms, stopped_ms = NULL",
            vec![
                V::T(r.id.clone()),
                V::T(r.address.clone()),
                V::T(r.owner.clone()),
                V::T(json(&r.offer)?),
                V::T(json(&r.capacity)?),
                V::I(now),
                V::I(now + r.lease_ms),
            ],
        )])?;
        Ok(())
    }

    /// Renews this host's lease, with its capacity and the vms it runs
    /// now (replacing the list its last heartbeat gave). Fails when
    /// another process took the id over.
    pub fn heartbeat(
        &self,
        id: &str,
        owner: &str,
        capacity: &Capacity,
        vms: &[VmRow],
        lease_ms: i64,
    ) -> Result<(), FleetError> {
        let now = now_ms();
        let mut stmts: Vec<(&str, Vec<V>)> = vec![
            (
                "UPDATE fleet_hosts SET capacity = $1, heartbeat_ms = $2, lease_ms = $3, stopped_ms = NULL
                 WHERE id = $4 AND owner = $5",
                vec![
                    V::T(json(capacity)?),
                    V::I(now),
                    V::I(now + lease_ms),
                    V::T(id.into()),
                    V::T(owner.into()),
                ],
            ),
            (
                "DELETE FROM fleet_vms WHERE host = $1",
                vec![V::T(id.into())],
            ),
        ];
        for v in vms {
            stmts.push((
                "INSERT INTO fleet_vms (name, host, state, mem_mib, vcpus, snapshot, updated_ms)
                 VALUES ($1, $2, $3, $4, $5, $6, $7)
                 ON CONFLICT (name) DO UPDATE SET host = excluded.host, state = excluded.state,
                   mem_mib = excluded.mem_mib, vcpus = excluded.vcpus, snapshot = excluded.snapshot,
                   updated_ms = excluded.updated_ms",
                vec![
                    V::T(v.name.clone()),
                    V::T(id.into()),
                    V::T(v.state.clone()),
                    int(v.mem_mib),
                    int(v.vcpus),
                    v.snapshot.map_or(V::Null, V::I),
                    V::I(now),
                ],
            ));
        }
        let n = self.db.write(&stmts)?;
        if n.first().copied() == Some(0) {
            return Err(FleetError::Config(format!(
                "host {id:?} is no longer registered to this tined (another process took the id, or it was removed with `tine hosts rm`)"
            )));
        }
        Ok(())
    }

    /// Marks this host stopped cleanly (its lease no longer counts).
    pub fn stop(&self, id: &str, owner: &str) -> Result<(), FleetError> {
        self.db.write(&[(
            "UPDATE fleet_hosts SET stopped_ms = $1 WHERE id = $2 AND owner = $3",
            vec![V::I(now_ms()), V::T(id.into()), V::T(owner.into())],
        )])?;
        Ok(())
    }

    /// Removes a host's rows (one that will not come back).
    pub fn forget(&self, id: &str) -> Result<bool, FleetError> {
        let n = self.db.write(&[
            (
                "DELETE FROM fleet_vms WHERE host = $1",
                vec![V::T(id.into())],
            ),
            (
                "DELETE FROM fleet_hosts WHERE id = $1",
                vec![V::T(id.into())],
            ),
        ])?;
        Ok(n.get(1).copied().unwrap_or(0) > 0)
    }

    /// One host.
    pub fn host(&self, id: &str) -> Result<Option<HostRow>, FleetError> {
        let rows = self.db.query(
            &format!("SELECT {HOST_COLS} FROM fleet_hosts WHERE id = $1"),
            &[V::T(id.into())],
        )?;
        let now = now_ms();
        rows.iter().map(|r| host_row(r, now)).next().transpose()
    }

    /// Every registered host, by id.
    pub fn hosts(&self) -> Result<Vec<HostRow>, FleetError> {
        let rows = self.db.query(
            &format!("SELECT {HOST_COLS} FROM fleet_hosts ORDER BY id"),
            &[],
        )?;
        let now = now_ms();
        rows.iter().map(|r| host_row(r, now)).collect()
    }

    /// Every vm the hosts listed, by name.
    pub fn vms(&self) -> Result<Vec<VmRow>, FleetError> {
        let rows = self.db.query(
            "SELECT name, host, state, mem_mib, vcpus, snapshot, updated_ms FROM fleet_vms ORDER BY name",
            &[],
        )?;
        rows.iter()
            .map(|r| {
                let bad = || FleetError::Corrupt(format!("fleet_vms row {r:?}"));
                Ok(VmRow {
                    name: r.first().and_then(V::text).ok_or_else(bad)?.to_string(),
                    host: r.get(1).and_then(V::text).ok_or_else(bad)?.to_string(),
                    state: r.get(2).and_then(V::text).ok_or_else(bad)?.to_string(),
                    mem_mib: r.get(3).and_then(V::int).ok_or_else(bad)?.max(0) as u64,
                    vcpus: r.get(4).and_then(V::int).ok_or_else(bad)?.max(0) as u64,
                    snapshot: r.get(5).and_then(V::int),
                    updated_ms: r.get(6).and_then(V::int).ok_or_else(bad)?,
                })
            })
            .collect()
    }
}

fn host_row(r: &[V], now: i64) -> Result<HostRow, FleetError> {
    let bad = |what: &str| FleetError::Corrupt(format!("fleet_hosts: {what}"));
    let text = |i: usize, what: &str| {
        r.get(i)
            .and_then(V::text)
            .map(str::to_string)
            .ok_or_else(|| bad(what))
    };
    let num = |i: usize, what: &str| r.get(i).and_then(V::int).ok_or_else(|| bad(what));
    let id = text(0, "id")?;
    let offer: HostCompat = serde_json::from_str(&text(3, "offer")?)
        .map_err(|e| bad(&format!("host {id}: offer: {e}")))?;
    let capacity: Capacity = serde_json::from_str(&text(4, "capacity")?)
        .map_err(|e| bad(&format!("host {id}: capacity: {e}")))?;
    let lease_ms = num(7, "lease_ms")?;
    let stopped = r.get(8).and_then(V::int).is_some();
    let state = if stopped {
        HostState::Stopped
    } else if lease_ms >= now {
        HostState::Up
    } else {
        HostState::Lost
    };
    Ok(HostRow {
        address: text(1, "address")?,
        owner: text(2, "owner")?,
        kernel: offer.kernel.clone(),
        cpu_vendor: offer.cpu_vendor.clone(),
        tine_version: offer.tine_version.clone(),
        offer,
        capacity,
        started_ms: num(5, "started_ms")?,
        heartbeat_ms: num(6, "heartbeat_ms")?,
        lease_ms,
        state,
        id,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn offer() -> HostCompat {
        HostCompat {
            tine_version: "0.1.0".into(),
            format_version: snapshot::Version::new(1, 0),
            kernel: "6.1".into(),
            cpu_vendor: "GenuineIntel".into(),
            cpuid: vec![],
            msrs: vec![],
            caps: vec![],
            tsc_khz: None,
        }
    }

    fn reg(id: &str, owner: &str) -> Registration {
        Registration {
            id: id.into(),
            address: format!("unix:/tmp/{id}.sock"),
            owner: owner.into(),
            offer: offer(),
            capacity: Capacity {
                mem_total_mib: 1024,
                mem_available_mib: 512,
                vcpus: 2,
                vms: 0,
                vm_mem_mib: 0,
            },
            lease_ms: 60_000,
            owner_gone: |owner, _| owner == "dead",
        }
    }

    fn fleet() -> (tempfile::TempDir, Fleet) {
        let d = tempfile::tempdir().expect("tempdir");
        let f = Fleet::open(&MetaUrl::Sqlite(d.path().join("tree.db"))).expect("open");
        (d, f)
    }

    #[test]
    fn register_heartbeat_stop_and_states() {
        let (_d, f) = fleet();
        f.register(&reg("h1", "a")).expect("register");
        f.register(&reg("h2", "b")).expect("register");
        let hs = f.hosts().expect("hosts");
        assert_eq!(hs.len(), 2);
        assert!(hs.iter().all(|h| h.state == HostState::Up));
        let vm = VmRow {
            name: "v".into(),
            host: "h1".into(),
            state: "running".into(),
            mem_mib: 256,
            vcpus: 1,
            snapshot: Some(3),
            updated_ms: 0,
        };
        f.heartbeat(
            "h1",
            "a",
            &Capacity::default(),
            std::slice::from_ref(&vm),
            60_000,
        )
        .expect("heartbeat");
        let vms = f.vms().expect("vms");
        assert_eq!(vms.len(), 1);
        assert_eq!(vms[0].snapshot, Some(3));
        // A heartbeat replaces the list.
        f.heartbeat("h1", "a", &Capacity::default(), &[], 60_000)
            .expect("heartbeat");
        assert!(f.vms().expect("vms").is_empty());
        // A lease that ran out is lost; a stop is stopped.
        f.heartbeat("h2", "b", &Capacity::default(), &[], -1)
            .expect("heartbeat");
        f.stop("h1", "a").expect("stop");
        let hs = f.hosts().expect("hosts");
        assert_eq!(hs[0].state, HostState::Stopped);
        assert_eq!(hs[1].state, HostState::Lost);
        assert!(f.forget("h2").expect("forget"));
        assert_eq!(f.hosts().expect("hosts").len(), 1);
    }

    #[test]
    fn a_live_id_is_not_taken_over() {
        let (_d, f) = fleet();
        f.register(&reg("h1", "a")).expect("register");
        let e = f.register(&reg("h1", "b")).expect_err("taken");
        assert!(e.to_string().contains("TINE_HOST_ID"), "{e}");
        // Nor can the other process heartbeat under it.
        assert!(f
            .heartbeat("h1", "b", &Capacity::default(), &[], 1000)
            .is_err());
        // Once its lease ran out, it can.
        f.heartbeat("h1", "a", &Capacity::default(), &[], -1)
            .expect("heartbeat");
        f.register(&reg("h1", "b")).expect("taken over");
        // A holder known dead (a kill -9 on this machine) at once.
        f.register(&reg("h2", "dead")).expect("register");
        f.register(&reg("h2", "c")).expect("a dead holder's id");
    }

    #[test]
    fn capacity_probe_reads_this_machine() {
        let c = Capacity::probe(0, 0);
        assert!(
            c.mem_total_mib > 0 && c.mem_available_mib <= c.mem_total_mib,
            "{c:?}"
        );
        assert!(c.vcpus >= 1);
    }
}
