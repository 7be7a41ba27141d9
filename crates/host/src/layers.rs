//! Frozen disk layers: who uses them, and freeing the ones nobody does.
//!
//! Every moment of a vm with a disk freezes its top layer into
//! `$TINE_HOME/layers/` and stacks a new top on it; children and
//! checkpoints stack on the frozen one too. A frozen layer is in use while
//! some chain reaches it: a vm's disk chain, a checkpoint's, a snapshot
//! directory's that this home wrote. After a removal (a vm, a child, a
//! checkpoint) the layers no chain reaches are deleted, and the ones only
//! their own vm's chain reaches, directly under its top, are folded into
//! that top by its VMM, off the pause path, so chains stay short
//! (docs/design/fork.md, "Bounded chains").
//!
//! Moments take the layers lock shared; freeing takes it exclusive, so no
//! layer is judged unused while a moment is between freezing it and
//! stacking the new tops on it.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::error::Context;
use crate::state;
use crate::Host;

const LOCK: &str = ".layers";

/// Held by every operation that freezes or stacks layers.
pub fn shared(h: &Host) -> crate::Result<crate::lock::SharedLock> {
    crate::lock::acquire_shared(&h.home, LOCK, crate::lock::DEFAULT_WAIT)
}

/// The snapshot directories this home wrote (their disks may be frozen
/// layers of ours): one file per directory under `snapdirs/`.
fn snapdirs(home: &Path) -> PathBuf {
    home.join("snapdirs")
}

/// Remembers a snapshot directory written from one of our vms.
pub fn register_snapshot_dir(h: &Host, dir: &Path) -> crate::Result<()> {
    let d = snapdirs(&h.home);
    std::fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
    let key = blake3::hash(dir.as_os_str().as_encoded_bytes()).to_hex();
    state::write_atomic(&d.join(&key[..16]), dir.as_os_str().as_encoded_bytes())
}

/// The snapshot directories still there (forgetting the ones removed).
fn snapshot_dirs(h: &Host) -> Vec<PathBuf> {
    let Ok(rd) = std::fs::read_dir(snapdirs(&h.home)) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in rd.flatten() {
        let Ok(bytes) = std::fs::read(e.path()) else {
            continue;
        };
        let dir = PathBuf::from(String::from_utf8_lossy(&bytes).into_owned());
        if dir.join(vmm::snapshot_dir::MANIFEST).is_file() {
            out.push(dir);
        } else if !dir.exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
    out
}

/// Every file some chain of this home reaches (tops, frozen layers,
/// bases). `Err` when a chain cannot be read: then nothing may be judged
/// unused.
fn in_use(h: &Host) -> crate::Result<HashSet<PathBuf>> {
    let mut used = HashSet::new();
    let mut add_chain = |top: &Path| -> crate::Result<()> {
        for l in disk::chain(top)
            .with_context(|| format!("cannot read the chain of {}", top.display()))?
        {
            used.insert(std::fs::canonicalize(&l.path).unwrap_or(l.path));
        }
        Ok(())
    };
    for vm in state::list(&h.home)? {
        for i in 0.. {
            let top = vm.disk_layer(i);
            if !top.exists() {
                break;
            }
            add_chain(&top)?;
        }
        for c in crate::fork::list_checkpoints(h, &vm.name)? {
            for l in &c.layers {
                if l.exists() {
                    add_chain(l)?;
                }
            }
        }
    }
    for dir in snapshot_dirs(h) {
        if let Ok((m, _)) = vmm::snapshot_dir::load(&dir) {
            for d in &m.disks {
                if d.path.exists() {
                    add_chain(&d.path)?;
                }
            }
        }
    }
    Ok(used)
}

/// Paths some chain of this home reaches; empty when that cannot be told
/// (callers then keep everything).
pub fn paths_in_use(h: &Host) -> Vec<PathBuf> {
    match in_use(h) {
        Ok(s) => s.into_iter().collect(),
        Err(_) => vec![PathBuf::from("/")],
    }
}

/// After a removal: deletes the frozen layers nothing uses. Returns how
/// many were freed and any trouble (never fatal: what is left is freed by
/// the next removal or `gc`). Skipped when a moment is being taken right
/// now (the next call catches up).
pub fn after_removal(h: &Host) -> (usize, Vec<String>) {
    let Ok(Some(_lock)) = crate::lock::try_acquire(&h.home, LOCK) else {
        return (0, Vec::new());
    };
    let used = match in_use(h) {
        Ok(u) => u,
        Err(e) => return (0, vec![format!("frozen layers kept: {e}")]),
    };
    let dir = state::layers_dir(&h.home);
    let Ok(rd) = std::fs::read_dir(&dir) else {
        return (0, Vec::new());
    };
    let mut freed = 0;
    let mut problems = Vec::new();
    for e in rd.flatten() {
        let p = e.path();
        let canon = std::fs::canonicalize(&p).unwrap_or_else(|_| p.clone());
        if used.contains(&canon) {
            continue;
        }
        match std::fs::remove_file(&p) {
            Ok(()) => freed += 1,
            Err(e) => problems.push(format!("cannot remove {}: {e}", p.display())),
        }
    }
    (freed, problems)
}
