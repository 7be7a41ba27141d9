//! Layers: a memory or disk image cut into fixed-size windows. A layer
//! records, per window, nothing (look in the parent layer), zero, or a
//! chunk; [`LayerView`] is a layer with its chain resolved top-down, ready
//! to be read window by window (lazy page-in) or restored whole.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use crate::chunk::ChunkId;
use std::collections::HashSet;

use crate::meta::{Entry, LayerKind, LayerRow, MetaError, SnapshotId};
use crate::progress::Progress;
use crate::store::{Store, StoreError};

/// What a layer is read from when it is stored: random access to `len`
/// bytes. Read from several threads at once.
pub trait Source: Sync {
    /// Bytes of the image (guest RAM, a disk's virtual size).
    fn len(&self) -> u64;
    /// Fills `buf` from `offset` (`offset + buf.len() <= len()`).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Whether the image has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Source for [u8] {
    fn len(&self) -> u64 {
        <[u8]>::len(self) as u64
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::InvalidInput)?;
        let src = self
            .get(start..start + buf.len())
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

impl Source for Vec<u8> {
    fn len(&self) -> u64 {
        self.as_slice().len() as u64
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        Source::read_at(self.as_slice(), buf, offset)
    }
}

/// A file (its current length); holes read as zeros.
impl Source for File {
    fn len(&self) -> u64 {
        self.metadata().map(|m| m.len()).unwrap_or(0)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.read_exact_at(buf, offset)
    }
}

/// A source from a length and a closure (e.g. a disk chain's `read_at`).
pub struct FnSource<F> {
    pub len: u64,
    pub read: F,
}

impl<F: Fn(&mut [u8], u64) -> io::Result<()> + Sync> Source for FnSource<F> {
    fn len(&self) -> u64 {
        self.len
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        (self.read)(buf, offset)
    }
}

/// Where a restored layer is written; written from several threads at
/// once, each window at its own offset.
pub trait Sink: Sync {
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()>;
}

impl Sink for File {
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.write_all_at(data, offset)
    }
}

/// A sink from a closure (e.g. a copy into guest memory).
pub struct FnSink<F>(pub F);

impl<F: Fn(&[u8], u64) -> io::Result<()> + Sync> Sink for FnSink<F> {
    fn write_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        (self.0)(data, offset)
    }
}

/// Which windows of a layer changed since the parent snapshot. Ignored for
/// a layer that has no parent layer (a first snapshot stores every
/// non-zero window).
#[derive(Clone, Copy, Debug)]
pub enum Dirty<'a> {
    /// Every window is looked at (unchanged ones are still recognised by
    /// their hash and not recorded).
    All,
    /// These window indexes.
    Windows(&'a [u64]),
    /// A bitmap of dirty pages: bit `i` (of word `i / 64`, least
    /// significant first, as KVM's dirty log) is page `i` of
    /// `page_size` bytes.
    Pages { bitmap: &'a [u64], page_size: u64 },
}

impl Dirty<'_> {
    /// The sorted, distinct window indexes below `count` it names (None:
    /// all).
    pub fn windows(&self, window_size: u64, count: u64) -> Option<Vec<u64>> {
        match *self {
            Dirty::All => None,
            Dirty::Windows(w) => {
                let mut v: Vec<u64> = w.iter().copied().filter(|&i| i < count).collect();
                v.sort_unstable();
                v.dedup();
                Some(v)
            }
            Dirty::Pages { bitmap, page_size } => {
                let mut v: Vec<u64> = Vec::new();
                for (wi, &word) in bitmap.iter().enumerate() {
                    let mut bits = word;
                    while bits != 0 {
                        let b = u64::from(bits.trailing_zeros());
                        bits &= bits - 1;
                        let page = wi as u64 * 64 + b;
                        let win = page.saturating_mul(page_size) / window_size;
                        if win < count && v.last() != Some(&win) {
                            v.push(win);
                        }
                    }
                }
                v.dedup();
                Some(v)
            }
        }
    }
}

/// A window of a resolved layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    /// All zero (recorded so, or recorded nowhere in the chain).
    Zero,
    /// A chunk, recorded by the layer of snapshot `from`.
    Chunk { id: ChunkId, from: SnapshotId },
}

/// What a restore did.
#[derive(Clone, Copy, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct RestoreStats {
    pub windows: u64,
    pub chunk_windows: u64,
    pub zero_windows: u64,
    /// Bytes written to the sink.
    pub bytes_written: u64,
}

/// A layer with its chain resolved: for every window, zero or the chunk
/// of the nearest layer (top first) that records it. Cheap to share
/// between threads; reads go through the store's chunk cache and are
/// verified.
#[derive(Debug)]
pub struct LayerView {
    pub(crate) store: Store,
    pub(crate) top: LayerRow,
    pub(crate) slots: Vec<Window>,
}

impl LayerView {
    /// The snapshot whose layer this is.
    pub fn snapshot(&self) -> SnapshotId {
        self.top.snapshot
    }
    pub fn kind(&self) -> LayerKind {
        self.top.kind
    }
    /// Bytes of the image.
    pub fn size(&self) -> u64 {
        self.top.size
    }
    pub fn window_size(&self) -> u64 {
        self.top.window_size
    }
    /// Number of windows.
    pub fn windows(&self) -> u64 {
        self.slots.len() as u64
    }
    /// The window at `index` (None past the end).
    pub fn window(&self, index: u64) -> Option<Window> {
        self.slots.get(usize::try_from(index).ok()?).copied()
    }
    /// The window that holds byte `offset`.
    pub fn window_of(&self, offset: u64) -> u64 {
        offset / self.top.window_size
    }
    /// Byte range of window `index`.
    pub fn window_range(&self, index: u64) -> std::ops::Range<u64> {
        let start = index
            .saturating_mul(self.top.window_size)
            .min(self.top.size);
        start..(start + self.top.window_size).min(self.top.size)
    }
    /// The windows that hold these pages of `page_size` bytes, sorted,
    /// distinct (for prefetching a working set).
    pub fn windows_of_pages(&self, pages: &[u64], page_size: u64) -> Vec<u64> {
        let mut v: Vec<u64> = pages
            .iter()
            .map(|p| p.saturating_mul(page_size) / self.top.window_size)
            .filter(|&w| w < self.windows())
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    fn context(&self, index: u64, from: SnapshotId) -> String {
        let r = self.window_range(index);
        let mut s = format!(
            "snapshot {}, {} layer, window {index} (bytes {:#x}..{:#x})",
            self.top.snapshot, self.top.kind, r.start, r.end
        );
        if from != self.top.snapshot {
            s.push_str(&format!(", recorded by snapshot {from}"));
        }
        s
    }

    /// Fills `buf` (at least the window's length; only that much is
    /// written) with window `index`, verified. Errors name the snapshot,
    /// layer, window and chunk.
    pub fn read_window(&self, index: u64, buf: &mut [u8]) -> Result<usize, StoreError> {
        let w = self.window(index).ok_or_else(|| {
            StoreError::Invalid(format!("window {index} is past the layer's end"))
        })?;
        let len = {
            let r = self.window_range(index);
            (r.end - r.start) as usize
        };
        let buf = buf.get_mut(..len).ok_or_else(|| {
            StoreError::Invalid(format!("a {len}-byte window needs a buffer that large"))
        })?;
        match w {
            Window::Zero => buf.fill(0),
            Window::Chunk { id, from } => {
                let data = self
                    .store
                    .chunks()
                    .get(&id, self.top.window_size as usize)
                    .map_err(|source| StoreError::Chunk {
                        context: self.context(index, from),
                        source: Box::new(source),
                    })?;
                if data.len() != len {
                    return Err(StoreError::Invalid(format!(
                        "{}: chunk {id} has {} bytes, the window {len}",
                        self.context(index, from),
                        data.len()
                    )));
                }
                buf.copy_from_slice(&data);
            }
        }
        Ok(len)
    }

    /// Reads `buf.len()` bytes at `offset` (any alignment).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), StoreError> {
        if offset.saturating_add(buf.len() as u64) > self.top.size {
            return Err(StoreError::Invalid(format!(
                "read of {} bytes at {offset} is past the layer's {} bytes",
                buf.len(),
                self.top.size
            )));
        }
        let ws = self.top.window_size;
        let mut scratch = vec![0u8; ws as usize];
        let mut done = 0usize;
        while done < buf.len() {
            let pos = offset + done as u64;
            let idx = pos / ws;
            let within = (pos - idx * ws) as usize;
            let n = self.read_window(idx, &mut scratch)?;
            let take = (n - within).min(buf.len() - done);
            buf[done..done + take].copy_from_slice(&scratch[within..within + take]);
            done += take;
        }
        Ok(())
    }

    /// Writes every window to `sink` at its offset, in parallel; zero
    /// windows are skipped when `skip_zero` (the sink already reads as
    /// zeros: a new sparse file, fresh anonymous memory).
    pub fn restore(
        &self,
        sink: &dyn Sink,
        skip_zero: bool,
        progress: &dyn Progress,
    ) -> Result<RestoreStats, StoreError> {
        let total = self.top.size;
        progress.start(
            &format!("{} layer of snapshot {}", self.top.kind, self.top.snapshot),
            total,
        );
        let next = AtomicUsize::new(0);
        let failed = AtomicBool::new(false);
        let chunk_w = AtomicU64::new(0);
        let zero_w = AtomicU64::new(0);
        let written = AtomicU64::new(0);
        let threads = self.store.threads().min(self.slots.len().max(1));
        let result = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| -> Result<(), StoreError> {
                        let mut buf = vec![0u8; self.top.window_size as usize];
                        loop {
                            if failed.load(Ordering::Relaxed) {
                                return Ok(());
                            }
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            let Some(&w) = self.slots.get(i) else {
                                return Ok(());
                            };
                            let r = self.window_range(i as u64);
                            let len = (r.end - r.start) as usize;
                            if w == Window::Zero {
                                zero_w.fetch_add(1, Ordering::Relaxed);
                                if skip_zero {
                                    progress.advance(len as u64);
                                    continue;
                                }
                            } else {
                                chunk_w.fetch_add(1, Ordering::Relaxed);
                            }
                            let res = self.read_window(i as u64, &mut buf).and_then(|n| {
                                sink.write_at(&buf[..n], r.start).map_err(|source| {
                                    StoreError::Sink {
                                        context: self.context(i as u64, self.top.snapshot),
                                        source,
                                    }
                                })
                            });
                            if let Err(e) = res {
                                failed.store(true, Ordering::Relaxed);
                                return Err(e);
                            }
                            written.fetch_add(len as u64, Ordering::Relaxed);
                            progress.advance(len as u64);
                        }
                    })
                })
                .collect();
            let mut first = Ok(());
            for h in handles {
                let r = h.join().unwrap_or_else(|_| {
                    Err(StoreError::Invalid("a restore thread panicked".into()))
                });
                if first.is_ok() {
                    first = r;
                }
            }
            first
        });
        progress.finish();
        result?;
        Ok(RestoreStats {
            windows: self.slots.len() as u64,
            chunk_windows: chunk_w.into_inner(),
            zero_windows: zero_w.into_inner(),
            bytes_written: written.into_inner(),
        })
    }

    /// Brings the chunks of these windows into the local cache (verified),
    /// in parallel; returns the stored bytes fetched. Without a remote
    /// backend there is no cache and nothing to do.
    pub fn prefetch(&self, windows: &[u64], progress: &dyn Progress) -> Result<u64, StoreError> {
        let ids: Vec<(u64, ChunkId, SnapshotId)> = windows
            .iter()
            .filter_map(|&i| match self.window(i) {
                Some(Window::Chunk { id, from }) => Some((i, id, from)),
                _ => None,
            })
            .collect();
        if self.store.chunks().cache().is_none() || ids.is_empty() {
            return Ok(0);
        }
        progress.start("prefetch", ids.len() as u64 * self.top.window_size);
        let fetched = AtomicU64::new(0);
        let res = crate::store::parallel(self.store.threads(), &ids, |&(i, id, from)| {
            let n = self
                .store
                .chunks()
                .prefetch(&id, self.top.window_size as usize)
                .map_err(|source| StoreError::Chunk {
                    context: self.context(i, from),
                    source: Box::new(source),
                })?;
            fetched.fetch_add(n, Ordering::Relaxed);
            progress.advance(self.top.window_size);
            Ok(())
        });
        progress.finish();
        res?;
        Ok(fetched.into_inner())
    }

    /// The distinct chunks this view reads.
    pub fn chunk_ids(&self) -> Vec<ChunkId> {
        let mut v: Vec<ChunkId> = self
            .slots
            .iter()
            .filter_map(|w| match w {
                Window::Chunk { id, .. } => Some(*id),
                Window::Zero => None,
            })
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }
}

impl Store {
    /// The `kind` layer of committed snapshot `id`, its chain resolved.
    pub fn layer(&self, id: SnapshotId, kind: LayerKind) -> Result<LayerView, StoreError> {
        let info = self.snapshot(id)?;
        let top = info
            .layers
            .iter()
            .find(|l| l.kind == kind)
            .copied()
            .ok_or(StoreError::NoLayer { snapshot: id, kind })?;
        self.view(top)
    }

    pub(crate) fn view(&self, top: LayerRow) -> Result<LayerView, StoreError> {
        let n = top.size.div_ceil(top.window_size);
        let n = usize::try_from(n)
            .map_err(|_| StoreError::Invalid(format!("a layer of {} bytes", top.size)))?;
        let mut slots: Vec<Option<Window>> = vec![None; n];
        let mut unset = n;
        let mut layer = Some(top);
        let mut seen = HashSet::new();
        while let Some(l) = layer {
            if unset == 0 {
                break;
            }
            if !seen.insert(l.id) {
                return Err(
                    MetaError::Corrupt(format!("layer {:?} is its own ancestor", l.id)).into(),
                );
            }
            if l.window_size != top.window_size {
                return Err(MetaError::Corrupt(format!(
                    "layer {:?} has {}-byte windows, its child {}",
                    l.id, l.window_size, top.window_size
                ))
                .into());
            }
            for (idx, e) in self.inner.meta.windows(l.id)? {
                let Some(slot) = usize::try_from(idx).ok().and_then(|i| slots.get_mut(i)) else {
                    continue;
                };
                if slot.is_none() {
                    *slot = Some(match e {
                        Entry::Zero => Window::Zero,
                        Entry::Chunk(id) => Window::Chunk {
                            id,
                            from: l.snapshot,
                        },
                    });
                    unset -= 1;
                }
            }
            layer = match l.parent {
                Some(p) => Some(
                    self.inner
                        .meta
                        .layer(p)?
                        .ok_or_else(|| MetaError::Corrupt(format!("layer {p:?} is missing")))?,
                ),
                None => None,
            };
        }
        Ok(LayerView {
            store: self.clone(),
            top,
            slots: slots
                .into_iter()
                .map(|s| s.unwrap_or(Window::Zero))
                .collect(),
        })
    }

    // --- branches ---
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn dirty_pages_to_windows() {
        // Pages 0, 63, 64 and 1000 of 4 KiB; windows of 256 KiB (64 pages).
        let mut bm = vec![0u64; 16];
        for p in [0u64, 63, 64, 1000] {
            bm[(p / 64) as usize] |= 1 << (p % 64);
        }
        let d = Dirty::Pages {
            bitmap: &bm,
            page_size: 4096,
        };
        assert_eq!(d.windows(256 << 10, 100), Some(vec![0, 1, 15]));
        assert_eq!(d.windows(256 << 10, 10), Some(vec![0, 1]));
        assert_eq!(
            Dirty::Windows(&[5, 1, 5, 99]).windows(4096, 10),
            Some(vec![1, 5])
        );
        assert_eq!(Dirty::All.windows(4096, 10), None);
    }

    #[test]
    fn slice_source() {
        let v: Vec<u8> = (0..100u8).collect();
        let mut b = [0u8; 10];
        Source::read_at(v.as_slice(), &mut b, 90).unwrap();
        assert_eq!(b[0], 90);
        assert!(Source::read_at(v.as_slice(), &mut b, 95).is_err());
    }
}
