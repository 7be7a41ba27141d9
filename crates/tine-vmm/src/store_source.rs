//! The store-side page source of a lazy wake (`tine wake --lazy`): page
//! faults of the VMM are served from a memory layer of the snapshot store,
//! its local chunk cache first, with the working-set pack streamed in
//! while the machine restores (docs/design/store.md).

use anyhow::Context;
use store::{LayerKind, SnapshotId, Store, StoreConfig};

/// Serves a lazily woken vm's page faults from a memory layer of the
/// store (its local cache first, then the backend; every chunk's hash is
/// checked).
struct StoreSource {
    view: store::LayerView,
    layout: vmm::layer::RamLayout,
    /// Chunks come from a remote backend (through the local cache).
    remote: bool,
    /// The working-set pack being fetched into the cache, if any.
    pack: Option<std::sync::Arc<PackGate>>,
}

/// A working-set pack fetch in flight: fills of the windows it covers
/// wait for their chunk to arrive from it (it streams in, in working-set
/// order) rather than each GET its chunk, which would put the
/// per-request cost the pack avoids back (docs/design/store.md,
/// "working-set packs").
struct PackGate {
    /// Windows whose chunk the pack should bring.
    windows: std::collections::HashMap<u64, store::ChunkId>,
    /// Chunks checked and cached so far, and whether the fetch ended.
    state: std::sync::Mutex<(std::collections::HashSet<store::ChunkId>, bool)>,
    cv: std::sync::Condvar,
}

/// How long a fill waits for the pack before it fetches its chunk itself.
const PACK_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

impl PackGate {
    fn ready(&self, id: &store::ChunkId) {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        g.0.insert(*id);
        drop(g);
        self.cv.notify_all();
    }

    fn finish(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.cv.notify_all();
    }

    fn wait(&self, windows: std::ops::RangeInclusive<u64>) {
        let ids: Vec<store::ChunkId> = windows
            .filter_map(|w| self.windows.get(&w).copied())
            .collect();
        if ids.is_empty() {
            return;
        }
        let g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self
            .cv
            .wait_timeout_while(g, PACK_WAIT, |(have, done)| {
                !*done && !ids.iter().all(|i| have.contains(i))
            })
            .unwrap_or_else(|e| e.into_inner());
    }
}

/// Prefetch requests in flight for a remote store.
const REMOTE_PREFETCH_THREADS: usize = 16;
/// Windows read ahead of a fault on a remote store (4 MiB).
const REMOTE_READAHEAD: usize = 16;

impl vmm::pagein::PageSource for StoreSource {
    fn fill(
        &self,
        gpa: u64,
        buf: &mut [u8],
    ) -> Result<vmm::pagein::Fill, vmm::pagein::SourceError> {
        let off = self
            .layout
            .offset(gpa)
            .ok_or_else(|| format!("guest address {gpa:#x} is not RAM"))?;
        let len = buf.len() as u64;
        let first = self.view.window_of(off);
        let last = self.view.window_of(off + len.saturating_sub(1));
        if (first..=last).all(|w| matches!(self.view.window(w), Some(store::Window::Zero) | None)) {
            return Ok(vmm::pagein::Fill::Zero);
        }
        if let Some(g) = &self.pack {
            g.wait(first..=last);
        }
        // A chunk that cannot be read (corrupt, missing) ends the vm; the
        // error names the snapshot, window and chunk. A fill of exactly one
        // window (the page-in unit is the window size) is read straight
        // into `buf`, without read_at's bounce buffer.
        if self.view.window_range(first) == (off..off + len) {
            self.view.read_window(first, buf)?;
        } else {
            self.view.read_at(buf, off)?;
        }
        Ok(vmm::pagein::Fill::Data)
    }

    /// A remote store answers each 256 KiB GET after a round trip (tens
    /// of ms on S3), so the working set is fetched with many requests in
    /// flight. bench/store against an S3 server taking ~35 ms per GET:
    /// 4 threads fetched ~110 windows a second, 16 the whole 64.8 MiB
    /// (259 windows) in 0.5-0.9 s.
    fn prefetch_threads(&self) -> usize {
        if self.remote {
            REMOTE_PREFETCH_THREADS
        } else {
            vmm::pagein::DEFAULT_PREFETCH_THREADS
        }
    }

    /// For the same reason a fault on a remote store reads the next
    /// windows in the background: a guest reading on through memory no
    /// working set covers (a cold wake, a set cut short by its window)
    /// otherwise waits for one round trip per window.
    fn readahead(&self) -> usize {
        if self.remote {
            REMOTE_READAHEAD
        } else {
            0
        }
    }
}

/// The page source and the prefetch list for a lazy wake of store
/// snapshot `id` (the VMM process side of `tine wake --lazy`).
pub fn lazy_source(
    id: i64,
    layout: vmm::layer::RamLayout,
) -> anyhow::Result<(
    std::sync::Arc<dyn vmm::pagein::PageSource>,
    Option<vmm::pagein::WorkingSet>,
)> {
    let home = image::default_home()?;
    let store =
        Store::open(StoreConfig::from_env(&home)?).context("cannot open the snapshot store")?;
    let id = SnapshotId(id);
    let view = store.layer(id, LayerKind::Memory)?;
    anyhow::ensure!(
        layout.len() == view.size(),
        "snapshot {id}'s memory layer has {} bytes, the vm's RAM {}",
        view.size(),
        layout.len()
    );
    let pages = store.snapshot(id)?.working_set;
    let prefetch = (!pages.is_empty()).then(|| vmm::pagein::WorkingSet {
        ranges: pages
            .iter()
            .filter_map(|p| layout.gpa(p * 4096).map(|g| (g, 4096)))
            .collect(),
        window_ms: 0,
    });
    let remote = store.chunks().cache().is_some();
    // Windows of the working set whose chunk is not in the local cache:
    // when there are none (this host slept or woke it lately) the pack is
    // not fetched at all.
    let ws = view.window_size();
    let uncached: std::collections::HashMap<u64, store::ChunkId> = match store.chunks().cache() {
        // One cache lookup (a stat) per window, not per page.
        Some(cache) if remote => pages
            .iter()
            .map(|p| p * 4096 / ws)
            .collect::<std::collections::BTreeSet<u64>>()
            .into_iter()
            .filter_map(|w| match view.window(w) {
                Some(store::Window::Chunk { id, .. })
                    if !store::Backend::exists(cache, &id).unwrap_or(false) =>
                {
                    Some((w, id))
                }
                _ => None,
            })
            .collect(),
        _ => Default::default(),
    };
    let pack = (!uncached.is_empty()).then(|| {
        let gate = std::sync::Arc::new(PackGate {
            windows: uncached,
            state: std::sync::Mutex::new(Default::default()),
            cv: std::sync::Condvar::new(),
        });
        let g = gate.clone();
        let store = store.clone();
        // Fetched while the VMM restores the machine; a pack that is
        // missing or corrupt is logged and its chunks come one GET each
        // as without a pack (every cached chunk was checked).
        let spawned = std::thread::Builder::new()
            .name("pack-fetch".into())
            .spawn(move || {
                vmm::seccomp::apply(vmm::seccomp::Thread::PageIn);
                let t = std::time::Instant::now();
                match store.fetch_pack_with(id, &|c| g.ready(c)) {
                    Ok(Some(f)) => tracing::info!(
                        "working-set pack of snapshot {id}: {} chunks, {} bytes in {} ms",
                        f.chunks,
                        f.stored_bytes,
                        t.elapsed().as_millis()
                    ),
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!("{e}; prefetching the working set chunk by chunk instead")
                    }
                }
                g.finish();
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start the working-set pack fetch ({e}); chunk by chunk instead");
            gate.finish();
        }
        gate
    });
    Ok((
        std::sync::Arc::new(StoreSource {
            view,
            layout,
            remote,
            pack,
        }),
        prefetch,
    ))
}
