//! Writing a snapshot: [`Store::begin`] gives a [`SnapshotWriter`] that
//! stores layers (chunked, deduplicated against the parent's windows) and
//! blobs, then commits it (with a branch change) or aborts it.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::chunk::{self, ChunkId};
use crate::fault::{self, Point};
use crate::layer::{Dirty, LayerView, Source, Window};
use crate::lease;
use crate::meta::{
    BranchChange, BranchId, Entry, LayerKind, LayerRow, MetaError, NewWindow, Pin, SnapshotId,
};
use crate::pack;
use crate::progress::Progress;
use crate::store::{parallel, LayerStats, Store, StoreError};

/// A snapshot being written. Invisible until [`SnapshotWriter::commit`];
/// dropped without commit, its rows are removed (its chunks are left for
/// gc). A process killed mid-write leaves a pending row that gc reaps.
pub struct SnapshotWriter {
    store: Store,
    id: SnapshotId,
    parent: Option<SnapshotId>,
    layers: Vec<(LayerKind, LayerRow)>,
    blobs: Vec<(String, Vec<u8>)>,
    working_set: Vec<u64>,
    done: bool,
}

impl std::fmt::Debug for SnapshotWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SnapshotWriter({})", self.id)
    }
}

impl Store {
    /// Starts a snapshot whose parent is `parent` (a committed snapshot:
    /// its layers are the parents of this one's) with `manifest` (JSON
    /// text: the caller's record; checked to be JSON).
    pub fn begin(
        &self,
        parent: Option<SnapshotId>,
        manifest: &str,
    ) -> Result<SnapshotWriter, StoreError> {
        serde_json::from_str::<serde_json::Value>(manifest)
            .map_err(|e| StoreError::Invalid(format!("the manifest is not JSON: {e}")))?;
        self.claim()?;
        let id = self
            .inner
            .meta
            .begin_snapshot(parent, manifest, &self.lease())?;
        Ok(SnapshotWriter {
            store: self.clone(),
            id,
            parent,
            layers: Vec::new(),
            blobs: Vec::new(),
            working_set: Vec::new(),
            done: false,
        })
    }
}

impl SnapshotWriter {
    /// This snapshot's id (not visible to readers until commit).
    pub fn id(&self) -> SnapshotId {
        self.id
    }

    /// Stores a layer of `kind` read from `source`. With a parent layer
    /// (the parent snapshot's layer of the same kind) only the windows
    /// `dirty` names are looked at, and of those only the ones that differ
    /// from the parent are recorded; without one, every non-zero window
    /// is recorded. Chunks are durable in the backend when this returns.
    pub fn put_layer<S: Source + ?Sized>(
        &mut self,
        kind: LayerKind,
        source: &S,
        dirty: &Dirty<'_>,
        progress: &dyn Progress,
    ) -> Result<LayerStats, StoreError> {
        if self.layers.iter().any(|(k, _)| *k == kind) {
            return Err(StoreError::Invalid(format!(
                "snapshot {} already has a {kind} layer",
                self.id
            )));
        }
        let store = self.store.clone();
        let meta = &store.inner.meta;
        let parent_view = match self.parent {
            Some(p) => match store.layer(p, kind) {
                Ok(v) => Some(v),
                Err(StoreError::NoLayer { .. }) => None,
                Err(e) => return Err(e),
            },
            None => None,
        };
        let ws = parent_view
            .as_ref()
            .map_or(store.inner.window_size, |v| v.window_size());
        let size = source.len();
        let count = size.div_ceil(ws);
        let todo: Vec<u64> = match (&parent_view, dirty.windows(ws, count)) {
            (Some(_), Some(list)) => list,
            _ => (0..count).collect(),
        };
        let layer = meta.add_layer(
            self.id,
            kind,
            parent_view.as_ref().map(|v| v.top.id),
            size,
            ws,
        )?;
        let row = meta
            .layer(layer)?
            .ok_or_else(|| MetaError::Corrupt(format!("layer {layer:?} vanished")))?;
        self.layers.push((kind, row));

        // Batches of about 8 MiB: each is read, hashed, compressed, pinned,
        // put and marked stored by one worker.
        let per = ((8u64 << 20) / ws).max(1) as usize;
        let batches: Vec<&[u64]> = todo.chunks(per).collect();
        let stats = Mutex::new(LayerStats {
            windows: count,
            ..LayerStats::default()
        });
        progress.start(&format!("{kind} layer"), todo.len() as u64 * ws);
        let res = parallel(store.threads(), &batches, |batch| {
            let s = self.put_batch(kind, layer, source, size, ws, batch, parent_view.as_ref())?;
            let mut g = stats.lock().unwrap_or_else(|e| e.into_inner());
            g.examined += s.examined;
            g.recorded += s.recorded;
            g.zero += s.zero;
            g.unchanged += s.unchanged;
            g.chunks_put += s.chunks_put;
            g.stored_bytes_put += s.stored_bytes_put;
            g.deduplicated += s.deduplicated;
            g.logical_bytes += s.logical_bytes;
            drop(g);
            progress.advance(batch.len() as u64 * ws);
            Ok(())
        });
        progress.finish();
        res?;
        Ok(stats.into_inner().unwrap_or_else(|e| e.into_inner()))
    }

    #[allow(clippy::too_many_arguments)]
    fn put_batch<S: Source + ?Sized>(
        &self,
        kind: LayerKind,
        layer: crate::meta::LayerId,
        source: &S,
        size: u64,
        ws: u64,
        batch: &[u64],
        parent: Option<&LayerView>,
    ) -> Result<LayerStats, StoreError> {
        let store = &self.store;
        let meta = &store.inner.meta;
        let chunks = &store.inner.chunks;
        let mut st = LayerStats::default();
        let mut buf = vec![0u8; ws as usize];
        let mut items: Vec<Item> = Vec::with_capacity(batch.len());
        let read = |buf: &mut [u8], idx: u64| -> Result<usize, StoreError> {
            let off = idx * ws;
            let len = ws.min(size - off) as usize;
            source
                .read_at(&mut buf[..len], off)
                .map_err(|source| StoreError::Source {
                    kind,
                    offset: off,
                    source,
                })?;
            Ok(len)
        };
        for &idx in batch {
            let len = read(&mut buf, idx)?;
            let data = &buf[..len];
            st.examined += 1;
            let entry = if chunk::is_zero(data) {
                Entry::Zero
            } else {
                Entry::Chunk(ChunkId::of(data))
            };
            match parent {
                Some(p) => {
                    let before = match p.window(idx) {
                        Some(Window::Chunk { id, .. }) => Entry::Chunk(id),
                        _ => Entry::Zero,
                    };
                    if before == entry {
                        st.unchanged += 1;
                        continue;
                    }
                }
                None if entry == Entry::Zero => {
                    st.zero += 1;
                    continue;
                }
                None => {}
            }
            let stored = match entry {
                Entry::Chunk(id) if !meta.chunk_stored(&id)? => {
                    Some(chunks.encode(data).map_err(StoreError::Compress)?)
                }
                _ => None,
            };
            if entry == Entry::Zero {
                st.zero += 1;
            }
            items.push(Item {
                index: idx,
                entry,
                stored,
                raw_len: len as u64,
            });
        }
        if items.is_empty() {
            return Ok(st);
        }
        let windows: Vec<NewWindow> = items
            .iter()
            .map(|it| NewWindow {
                index: it.index,
                entry: it.entry,
                stored_len: it.stored.as_ref().map_or(0, |s| s.len() as u64),
                raw_len: if it.entry == Entry::Zero {
                    0
                } else {
                    it.raw_len
                },
            })
            .collect();
        let started = Instant::now();
        let need = loop {
            match meta.pin(self.id, layer, &windows, store.lease_expiry(), &lease::gone)? {
                Pin::Pinned(v) => break v,
                Pin::Busy(id) => {
                    if started.elapsed() > store.inner.lease_ttl {
                        return Err(StoreError::GcBusy(id));
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        st.recorded += items.len() as u64;
        let mut put_now: HashSet<ChunkId> = HashSet::new();
        let mut marked: Vec<(ChunkId, u64)> = Vec::new();
        for (it, need) in items.into_iter().zip(need) {
            let Entry::Chunk(id) = it.entry else { continue };
            st.logical_bytes += it.raw_len;
            if !need {
                st.deduplicated += 1;
                continue;
            }
            if !put_now.insert(id) {
                continue;
            }
            let stored = match it.stored {
                Some(s) => s,
                None => {
                    // The hint said stored, the pin says put (a gc took it
                    // meanwhile): read the window again.
                    let len = read(&mut buf, it.index)?;
                    if ChunkId::of(&buf[..len]) != id {
                        return Err(StoreError::SourceChanged {
                            kind,
                            window: it.index,
                        });
                    }
                    chunks.encode(&buf[..len]).map_err(StoreError::Compress)?
                }
            };
            chunks.put(&id, &stored)?;
            fault::point(Point::MidChunks);
            st.chunks_put += 1;
            st.stored_bytes_put += stored.len() as u64;
            marked.push((id, stored.len() as u64));
        }
        if !marked.is_empty() {
            meta.mark_stored(&marked)?;
        }
        Ok(st)
    }

    /// A named blob committed with the snapshot (e.g. `state`: the vCPU
    /// and device state).
    pub fn put_blob(&mut self, name: &str, data: Vec<u8>) {
        self.blobs.retain(|(n, _)| n != name);
        self.blobs.push((name.into(), data));
    }

    /// Pages (4 KiB page numbers of the memory layer) to prefetch on the
    /// next wake.
    pub fn set_working_set(&mut self, pages: Vec<u64>) {
        self.working_set = pages;
    }

    /// Makes the snapshot visible (all its chunks are durable already).
    pub fn commit(self) -> Result<SnapshotId, StoreError> {
        self.commit_with(None).map(|(s, _)| s)
    }

    /// Commits and, in the same transaction, creates or moves a branch to
    /// this snapshot (`tine sleep`: the branch now sleeps in it).
    pub fn commit_branch(self, change: BranchChange) -> Result<(SnapshotId, BranchId), StoreError> {
        let (s, b) = self.commit_with(Some(change))?;
        let b = b.ok_or_else(|| StoreError::Invalid("the branch change returned no id".into()))?;
        Ok((s, b))
    }

    fn commit_with(
        mut self,
        change: Option<BranchChange>,
    ) -> Result<(SnapshotId, Option<BranchId>), StoreError> {
        fault::point(Point::AfterChunks);
        self.put_pack()?;
        let meta = &self.store.inner.meta;
        for (name, data) in &self.blobs {
            meta.put_blob(self.id, name, data)?;
        }
        fault::point(Point::BeforeCommit);
        let b = meta.commit_snapshot(self.id, &self.working_set, change.as_ref())?;
        self.done = true;
        fault::point(Point::AfterCommit);
        Ok((self.id, b))
    }

    /// With a working set (and packs on, see [`Store::set_packs`]):
    /// stores ONE object holding the stored bytes of the chunks of the
    /// working set's windows, in first-touch order, so the next cold wake
    /// fetches them in a few requests, and names it in the pending row
    /// first (gc keeps objects a row names; the commit then makes it the
    /// committed snapshot's). Only chunks in hand cheaply go in: from the
    /// local cache (a remote store), or the local backend; a chunk that
    /// is in neither is left out and a wake fetches it on its own, so the
    /// pack may be partial and the sleep never downloads for it. A pack
    /// that cannot be stored is logged and the snapshot commits without
    /// one (a wake then fetches chunk by chunk, as before packs).
    fn put_pack(&self) -> Result<(), StoreError> {
        let store = &self.store;
        if self.working_set.is_empty() || !store.inner.packs.load(Ordering::Relaxed) {
            return Ok(());
        }
        let Some((_, row)) = self.layers.iter().find(|(k, _)| *k == LayerKind::Memory) else {
            return Ok(());
        };
        let view = store.view(*row)?;
        let ws = view.window_size();
        let chunks = &store.inner.chunks;
        let mut seen_windows = HashSet::new();
        let mut seen_chunks = HashSet::new();
        let mut entries: Vec<(ChunkId, u32, Vec<u8>)> = Vec::new();
        let mut skipped = 0u64;
        for &page in &self.working_set {
            let w = page.saturating_mul(4096) / ws;
            if !seen_windows.insert(w) {
                continue;
            }
            let Some(Window::Chunk { id, .. }) = view.window(w) else {
                continue;
            };
            if !seen_chunks.insert(id) {
                continue;
            }
            let raw_len = view.window_range(w).end - view.window_range(w).start;
            let stored = match chunks.cache() {
                Some(c) => c.get(&id),
                None => chunks.backend().get(&id),
            };
            match stored {
                Ok(Some(b)) => entries.push((id, raw_len as u32, b)),
                Ok(None) => skipped += 1,
                Err(e) => {
                    tracing::debug!("working-set pack: chunk {id} left out: {e}");
                    skipped += 1;
                }
            }
        }
        if entries.is_empty() {
            return Ok(());
        }
        let bytes = pack::build(self.id.0 as u64, &entries);
        let id = ChunkId::of(&bytes);
        let meta = &store.inner.meta;
        meta.set_pack(self.id, Some((id, bytes.len() as u64)))?;
        if let Err(e) = chunks.backend().put(&id, &bytes) {
            tracing::warn!(
                "snapshot {}: storing its working-set pack failed ({e}); it commits without one",
                self.id
            );
            meta.set_pack(self.id, None)?;
            return Ok(());
        }
        fault::point(Point::PackPut);
        tracing::debug!(
            "snapshot {}: working-set pack {id}: {} chunks, {} bytes ({skipped} chunks not at hand, left out)",
            self.id,
            entries.len(),
            bytes.len()
        );
        Ok(())
    }

    /// Drops the snapshot (its chunks are left for gc).
    pub fn abort(mut self) -> Result<(), StoreError> {
        self.done = true;
        Ok(self.store.inner.meta.abort_snapshot(self.id)?)
    }
}

impl Drop for SnapshotWriter {
    fn drop(&mut self) {
        if !self.done {
            if let Err(e) = self.store.inner.meta.abort_snapshot(self.id) {
                tracing::warn!("dropping pending snapshot {}: {e}", self.id);
            }
        }
    }
}

/// One window's result before it is pinned.
struct Item {
    index: u64,
    entry: Entry,
    stored: Option<Vec<u8>>,
    raw_len: u64,
}
