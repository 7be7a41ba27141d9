//! Frozen disk layers: who uses them, and freeing the ones nobody does.
//!
//! Every moment of a vm with a disk freezes its top layer into its
//! tree's `.layers/` (`$TINE_HOME/layers/` for a vm from before trees,
//! crates/host/src/state.rs) and stacks a new top on it; children and
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

/// The same lock, exclusive, if no one holds it now (gc's sweep of wake
/// copies: a wake holds it shared from materializing its copy until its
/// vm uses it).
pub fn try_exclusive(h: &Host) -> crate::Result<Option<crate::lock::Lock>> {
    crate::lock::try_acquire(&h.home, LOCK)
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

/// Who a chain belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Owner {
    /// Disk `disk` of a vm (its top is its own).
    Vm { name: String, disk: usize },
    /// A checkpoint template, a snapshot directory.
    Other,
}

/// Every chain of this home, top first, canonical paths. `Err` when one
/// cannot be read: then nothing may be judged unused.
fn chains(h: &Host) -> crate::Result<Vec<(Owner, Vec<PathBuf>)>> {
    let read = |top: &Path| -> crate::Result<Vec<PathBuf>> {
        Ok(disk::chain(top)
            .with_context(|| format!("cannot read the chain of {}", top.display()))?
            .into_iter()
            .map(|l| std::fs::canonicalize(&l.path).unwrap_or(l.path))
            .collect())
    };
    let mut out = Vec::new();
    for vm in state::list(&h.home)? {
        for i in 0.. {
            let top = vm.disk_layer(i);
            if !top.exists() {
                break;
            }
            out.push((
                Owner::Vm {
                    name: vm.name.clone(),
                    disk: i,
                },
                read(&top)?,
            ));
        }
        for c in crate::checkpoints::list_checkpoints(h, &vm.name)? {
            for l in &c.layers {
                if l.exists() {
                    out.push((Owner::Other, read(l)?));
                }
            }
        }
    }
    for dir in snapshot_dirs(h) {
        if let Ok((m, _)) = vmm::snapshot_dir::load(&dir) {
            for d in &m.disks {
                if d.path.exists() {
                    out.push((Owner::Other, read(&d.path)?));
                }
            }
        }
    }
    Ok(out)
}

/// Every file some chain of this home reaches (tops, frozen layers,
/// bases).
fn in_use(h: &Host) -> crate::Result<HashSet<PathBuf>> {
    Ok(chains(h)?.into_iter().flat_map(|(_, c)| c).collect())
}

/// Paths some chain of this home reaches; `/` when that cannot be told
/// (callers then keep everything).
pub fn paths_in_use(h: &Host) -> Vec<PathBuf> {
    match in_use(h) {
        Ok(s) => s.into_iter().collect(),
        Err(_) => vec![PathBuf::from("/")],
    }
}

/// For each vm, the frozen layers directly under a top of its that no
/// other chain reaches (in chain order), which its VMM can fold into the
/// top.
fn foldable(h: &Host, chains: &[(Owner, Vec<PathBuf>)]) -> Vec<(String, Vec<PathBuf>)> {
    let frozen_dirs: Vec<PathBuf> = state::all_layers_dirs(&h.home)
        .into_iter()
        .map(|d| std::fs::canonicalize(&d).unwrap_or(d))
        .collect();
    let mut users: std::collections::HashMap<&PathBuf, usize> = Default::default();
    for (_, c) in chains {
        for l in c {
            *users.entry(l).or_default() += 1;
        }
    }
    let mut by_vm: std::collections::BTreeMap<String, Vec<PathBuf>> = Default::default();
    for (owner, c) in chains {
        let Owner::Vm { name, .. } = owner else {
            continue;
        };
        // Below the top, down to the first layer someone else uses (or
        // the bottom, which stays the chain's base).
        for l in c.iter().skip(1).take(c.len().saturating_sub(2)) {
            if users.get(l) != Some(&1) || !frozen_dirs.iter().any(|d| l.starts_with(d)) {
                break;
            }
            by_vm.entry(name.clone()).or_default().push(l.clone());
        }
    }
    by_vm.into_iter().collect()
}

/// After a removal: folds the frozen layers only one running vm still
/// uses into that vm's top (its VMM copies them while the guest runs on,
/// so its chain stays short), then deletes the frozen layers nothing uses.
/// Returns how many layers were freed and any trouble (never fatal: what
/// is left is freed by the next removal or `gc`). Skipped when a moment is
/// being taken right now (the next call catches up).
pub fn after_removal(h: &Host) -> (usize, Vec<String>) {
    let mut problems = Vec::new();
    let candidates = {
        let Ok(Some(_lock)) = crate::lock::try_acquire(&h.home, LOCK) else {
            return (0, problems);
        };
        match chains(h) {
            Ok(c) => foldable(h, &c),
            Err(e) => return (0, vec![format!("frozen layers kept: {e}")]),
        }
    };
    for (name, layers) in candidates {
        if let Err(e) = fold(h, &name, &layers) {
            problems.push(format!("the layers under vm {name:?} are not folded: {e}"));
        }
    }
    let (freed, more) = delete_unused(h);
    problems.extend(more);
    (freed, problems)
}

/// Asks vm `name`'s VMM to fold `layers` into its tops, with the vm's lock
/// (skipped when another operation holds it: the next removal folds).
fn fold(h: &Host, name: &str, layers: &[PathBuf]) -> crate::Result<()> {
    let Some(_lock) = crate::lock::try_acquire(&h.home, name)? else {
        return Ok(());
    };
    let vm = crate::state::VmDir::new(&h.home, name);
    let r = vm.read_record()?;
    if vm.state(&r) != crate::state::VmState::Running {
        return Ok(());
    }
    let c = vmm::api::call(
        &vm.api_socket(),
        &vmm::api::Request::FoldLayers {
            layers: layers.to_vec(),
        },
        FOLD_TIMEOUT,
    )?;
    if let Some(e) = &c.reply.error {
        return Err(crate::Error::failed(e.clone()));
    }
    for f in &c.reply.fold {
        tracing::debug!(
            "vm {name}: disk {} folded {} layers ({} bytes) in {:.1} ms, depth {}",
            f.disk,
            f.folded.len(),
            f.bytes_copied,
            f.ms,
            f.depth
        );
    }
    Ok(())
}

/// How long a fold may take (it copies what the vm wrote since its base).
const FOLD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// Deletes the frozen layers nothing uses.
fn delete_unused(h: &Host) -> (usize, Vec<String>) {
    let Ok(Some(_lock)) = crate::lock::try_acquire(&h.home, LOCK) else {
        return (0, Vec::new());
    };
    let used = match in_use(h) {
        Ok(u) => u,
        Err(e) => return (0, vec![format!("frozen layers kept: {e}")]),
    };
    let mut freed = 0;
    let mut problems = Vec::new();
    for dir in state::all_layers_dirs(&h.home) {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
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
    }
    problems.extend(sweep_trees(h));
    (freed, problems)
}

/// Removes what no vm's link leads to in the trees' directories (a vm
/// directory a crash left between its making and its link) and the trees
/// left empty. Called with the layers lock held exclusive: every
/// operation that makes a tree or a vm in one holds it shared.
fn sweep_trees(h: &Host) -> Vec<String> {
    let mut problems = Vec::new();
    for tree in state::trees(&h.home) {
        let Ok(rd) = std::fs::read_dir(&tree) else {
            continue;
        };
        for e in rd.flatten() {
            let Some(name) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if name.starts_with('.') || state::VmDir::new(&h.home, &name).dir == e.path() {
                continue;
            }
            if let Err(err) = std::fs::remove_dir_all(e.path()) {
                problems.push(format!("cannot remove {}: {err}", e.path().display()));
            }
        }
        // Fails while anything is left in it.
        let _ = std::fs::remove_dir(tree.join(".layers"));
        let _ = std::fs::remove_dir(&tree);
    }
    problems
}
