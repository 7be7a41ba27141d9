//! The branches of this host's store as the vms see them: which stored
//! snapshot a vm was woken from (`vms/NAME/branch.json`), whether a name
//! is a sleeping branch, the links of fork children, and forgetting the
//! branch of a removed vm. Below the moments and rm, which ask it; tree.rs
//! (sleep, wake, lineage, gc) builds on it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use store::{BranchState, SnapshotId, Store, StoreConfig};

use crate::error::Context;
use crate::state::{self, VmDir, VmState};
use crate::{bail, Host};

/// Which stored snapshot a vm was woken from (`vms/NAME/branch.json`):
/// its next sleep stores only what changed since.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BranchLink {
    pub branch: String,
    pub snapshot: i64,
    /// The label of the VMM's dirty base when it is not the snapshot's id:
    /// a move's pre-copy round gives its own (the id is not known when
    /// the VMM restarts its dirty set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
}

impl BranchLink {
    /// What the VMM's diff layers name as their base.
    pub fn base_label(&self) -> String {
        self.base
            .clone()
            .unwrap_or_else(|| self.snapshot.to_string())
    }
}

pub(crate) fn link_path(vm: &VmDir) -> PathBuf {
    vm.dir.join("branch.json")
}

/// The store snapshot a vm started from (a woken branch), if any.
pub fn vm_snapshot(vm: &VmDir) -> Option<i64> {
    read_link(vm).map(|l| l.snapshot)
}

pub(crate) fn read_link(vm: &VmDir) -> Option<BranchLink> {
    let text = std::fs::read_to_string(link_path(vm)).ok()?;
    serde_json::from_str(&text).ok()
}

/// The store of this host (`TINE_STORE` picks a backend, see crates/store).
pub fn open(h: &Host) -> crate::Result<Store> {
    let cfg = StoreConfig::from_env(&h.home)?;
    Store::open(cfg).context("cannot open the snapshot store")
}

/// Size limit of the local chunk cache in front of a remote store
/// (`TINE_STORE_CACHE`, e.g. `20G`; default 16 GiB).
pub const CACHE_ENV: &str = "TINE_STORE_CACHE";
const DEFAULT_CACHE_MIB: u64 = 16 << 10;

/// Keeps the chunk cache within its budget, least recently used chunks
/// first (they stay in the backend). Run after the work of a sleep, wake
/// or gc, so it costs the command, not the vm's time to ready. A bad
/// budget or a failed trim is logged, never fatal: the cache is only a
/// cache.
pub(crate) fn trim_cache(store: &Store) {
    let budget_mib = match std::env::var(CACHE_ENV) {
        Ok(v) => match crate::size::parse_mib(&v) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!("{CACHE_ENV}={v:?} is not a size ({e}); the cache keeps {DEFAULT_CACHE_MIB} MiB");
                DEFAULT_CACHE_MIB
            }
        },
        Err(_) => DEFAULT_CACHE_MIB,
    };
    match store.trim_cache(budget_mib << 20) {
        Ok((0, _)) => {}
        Ok((n, bytes)) => tracing::debug!("chunk cache: {n} chunks ({bytes} bytes) dropped"),
        Err(e) => tracing::warn!("cannot trim the chunk cache: {e}"),
    }
}

/// Children of a fork of a vm woken from the store descend from the same
/// stored snapshot: their VMMs inherit the parent's dirty tracking
/// (relative to that snapshot), so their sleeps store diff layers under it
/// and the tree draws them there. Without a link, nothing to do.
pub(crate) fn link_children(h: &Host, parent: &VmDir, children: &[&VmDir]) -> Vec<String> {
    let Some(link) = read_link(parent) else {
        return Vec::new();
    };
    let store = match open(h) {
        Ok(s) => s,
        Err(e) => return vec![format!("the children are not linked into the tree: {e}")],
    };
    let snapshot = SnapshotId(link.snapshot);
    let mut problems = Vec::new();
    for c in children {
        let res = (|| -> crate::Result<()> {
            if let Some(b) = store.branch(&c.name)? {
                bail!("a {} branch of that name is in the store", b.state);
            }
            let l = BranchLink {
                branch: c.name.clone(),
                snapshot: link.snapshot,
                base: link.base.clone(),
            };
            state::write_atomic(&link_path(c), &serde_json::to_vec(&l)?)?;
            store.create_branch(&c.name, snapshot, BranchState::Running)?;
            Ok(())
        })();
        if let Err(e) = res {
            problems.push(format!(
                "{}: not linked under snapshot {snapshot} (its sleep will store a new root): {e}",
                c.name
            ));
        }
    }
    problems
}

/// Whether `name` is a sleeping branch of this host's store (and not a vm).
pub fn is_sleeping(h: &Host, name: &str) -> bool {
    is_sleeping_in(&h.home, name)
}

/// [`is_sleeping`] for the store of `home` (the CLI's routing asks it
/// without a daemon).
pub fn is_sleeping_in(home: &Path, name: &str) -> bool {
    !VmDir::new(home, name).exists()
        && branch_in(home, name).is_some_and(|b| b.state == BranchState::Sleeping)
}

/// Whether branch `name` sleeps in this host's store (a vm of that name
/// may still exist: a sleep between its commit and the vm's end).
pub(crate) fn branch_sleeps(h: &Host, name: &str) -> bool {
    branch_row(h, name).is_some_and(|b| b.state == BranchState::Sleeping)
}

/// Whether the store of `home` knows a running or sleeping branch `name`.
pub fn has_branch_in(home: &Path, name: &str) -> bool {
    branch_in(home, name).is_some()
}

/// Branch `name` of this host's store, if there is a store and it has one.
pub(crate) fn branch_row(h: &Host, name: &str) -> Option<store::BranchRow> {
    branch_in(&h.home, name)
}

pub(crate) fn branch_in(home: &Path, name: &str) -> Option<store::BranchRow> {
    if !store_exists_in(home) {
        return None;
    }
    let cfg = StoreConfig::from_env(home).ok()?;
    Store::open(cfg).ok()?.branch(name).ok().flatten()
}

pub(crate) fn store_exists(h: &Host) -> bool {
    store_exists_in(&h.home)
}

pub(crate) fn store_exists_in(home: &Path) -> bool {
    // The directory alone is made with the home (to be masked in the
    // VMMs' jails); a local store has its index.
    home.join("store").join("tree.db").exists()
        || std::env::var_os(store::BACKEND_ENV).is_some()
        || std::env::var_os("TINE_META").is_some()
}

/// The branch a removed vm ran is gone (its snapshot no longer needs to
/// be kept for it).
pub(crate) fn forget_vm(h: &Host, vm: &VmDir) -> crate::Result<()> {
    let Some(link) = read_link(vm) else {
        return Ok(());
    };
    let store = open(h)?;
    if let Some(b) = store.branch(&link.branch)? {
        if b.state == BranchState::Running && b.snapshot.0 == link.snapshot {
            store.set_branch(b.id, None, BranchState::Gone)?;
        }
    }
    Ok(())
}

/// Branches whose vm is gone are marked gone (they keep nothing alive).
pub(crate) fn reap_branches(h: &Host, store: &Store) -> crate::Result<()> {
    let shared = std::env::var(store::META_ENV)
        .is_ok_and(|v| v.starts_with("postgres://") || v.starts_with("postgresql://"));
    for b in store.branches()? {
        if b.state != BranchState::Running {
            continue;
        }
        let vm = VmDir::new(&h.home, &b.name);
        // With metadata other hosts share, a branch running with no vm
        // here runs on another host: its own host reaps it (a lost host's
        // stays, and keeps its snapshot: `tine hosts` names it).
        if shared && !vm.exists() {
            continue;
        }
        let alive = vm
            .read_record()
            .is_ok_and(|r| vm.state(&r) == VmState::Running)
            && read_link(&vm).is_some_and(|l| l.snapshot == b.snapshot.0);
        if !alive {
            store.set_branch(b.id, None, BranchState::Gone)?;
        }
    }
    Ok(())
}
