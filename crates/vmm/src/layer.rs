//! Memory layers: guest RAM as `(guest address, bytes)` windows, either
//! all populated non-zero memory (a full layer) or only the pages dirtied
//! since a base (a diff layer), and the file a snapshot writes them to.
//!
//! [`windows`] reads a frozen view in place (no copy of RAM first);
//! [`write()`] streams those windows to `memory.layer`; [`LayerReader`]
//! reads that file back window by window, which is what the store
//! consumes. Format (little-endian), docs/design/store.md:
//!
//! ```text
//! "TINELAYR"  u32 version (1)  u32 flags (bit 0: diff)
//! u32 n_regions  n × (u64 guest start, u64 bytes)       RAM layout
//! u32 base_len   base_len bytes of UTF-8                 the base (diff)
//! records: u64 guest address, u64 bytes, u32 kind, u32 0, then the bytes
//!          kind 0 = data (bytes follow), 1 = zero (none follow)
//! end:     u64 u64::MAX, u64 0, u32 0, u32 0, then u64 records, u64 data bytes
//! ```
//!
//! A full layer holds every populated page that is not all zeros; pages
//! it does not name are zero. A diff layer names every page dirtied since
//! its base, zero pages as zero records; pages it does not name are as in
//! the base. Records are page aligned, at most [`MAX_WINDOW`] bytes, in
//! address order.

use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use crate::dirty::{PageBitmap, PAGE_SIZE};
use crate::memory::GuestMemoryMmap;

/// How a memory layer is written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayerMode {
    /// All populated non-zero memory.
    Full,
    /// The pages dirtied since this base.
    Diff(String),
}

/// Largest window (record).
pub const MAX_WINDOW: usize = 1 << 20;
const MAGIC: &[u8; 8] = b"TINELAYR";
const VERSION: u32 = 1;
const END: u64 = u64::MAX;

/// Which pages a layer holds.
#[derive(Clone, Copy, Debug)]
pub enum Selection<'a> {
    /// Every populated page that is not all zeros (a full layer).
    Populated,
    /// Exactly these pages, zero ones as [`Window::Zero`] (a diff layer).
    Pages(&'a PageBitmap),
}

/// One window of guest memory.
#[derive(Debug, PartialEq, Eq)]
pub enum Window<'a> {
    /// `bytes` at guest address `gpa`.
    Data { gpa: u64, bytes: &'a [u8] },
    /// `len` zero bytes at `gpa`.
    Zero { gpa: u64, len: u64 },
}

impl Window<'_> {
    /// Guest address.
    pub fn gpa(&self) -> u64 {
        match self {
            Window::Data { gpa, .. } | Window::Zero { gpa, .. } => *gpa,
        }
    }

    /// Bytes covered.
    pub fn len(&self) -> u64 {
        match self {
            Window::Data { bytes, .. } => bytes.len() as u64,
            Window::Zero { len, .. } => *len,
        }
    }

    /// Whether it covers nothing (never, for windows made here).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Errors reading or writing layers.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a tine memory layer: {why}")]
    Format { path: PathBuf, why: String },
    #[error("Cannot read which guest pages are populated (mincore)")]
    Mincore(#[source] std::io::Error),
}

/// Calls `f` on every window of `sel` in `mem`, in address order, reading
/// guest memory in place. `mem` must not change meanwhile (a frozen view,
/// or a paused vm with its devices quiet). Stops at the first error `f`
/// returns.
pub fn windows<E>(
    mem: &GuestMemoryMmap,
    sel: Selection<'_>,
    mut f: impl FnMut(Window<'_>) -> Result<(), E>,
) -> Result<(), E>
where
    E: From<LayerError>,
{
    for region in mem.iter() {
        let base = region.as_ptr();
        let len = region.len() as usize;
        let start = region.start_addr().0;
        let pages = len / PAGE_SIZE as usize;
        // Which pages to look at: populated ones, or the selected ones.
        let wanted: Vec<bool> = match sel {
            Selection::Populated => populated(base, len)?,
            Selection::Pages(set) => (0..pages)
                .map(|p| set.contains(start + (p as u64) * PAGE_SIZE))
                .collect(),
        };
        let mut p = 0;
        while p < pages {
            if !wanted[p] {
                p += 1;
                continue;
            }
            // SAFETY: page `p` lies inside this live mapping of guest RAM.
            let zero = is_zero(unsafe { page(base, p) });
            if zero && matches!(sel, Selection::Populated) {
                p += 1;
                continue;
            }
            let first = p;
            let max = MAX_WINDOW / PAGE_SIZE as usize;
            p += 1;
            while p < pages && wanted[p] && p - first < max {
                // SAFETY: as above.
                if is_zero(unsafe { page(base, p) }) != zero {
                    break;
                }
                p += 1;
            }
            let gpa = start + first as u64 * PAGE_SIZE;
            let n = (p - first) * PAGE_SIZE as usize;
            let w = if zero {
                Window::Zero { gpa, len: n as u64 }
            } else {
                // SAFETY: the run lies inside the mapping; the caller keeps
                // the memory unchanged while `f` runs.
                let bytes =
                    unsafe { std::slice::from_raw_parts(base.add(first * PAGE_SIZE as usize), n) };
                Window::Data { gpa, bytes }
            };
            f(w)?;
        }
    }
    Ok(())
}

/// # Safety
/// Page `p` must lie inside the mapping at `base`.
unsafe fn page<'a>(base: *const u8, p: usize) -> &'a [u8] {
    let sz = PAGE_SIZE as usize;
    // SAFETY: the caller guarantees the page is mapped.
    unsafe { std::slice::from_raw_parts(base.add(p * sz), sz) }
}

fn is_zero(b: &[u8]) -> bool {
    // Word compares: a page is checked in ~100 ns.
    let (pre, words, post) = {
        // SAFETY: u64 has no invalid bit patterns; align_to splits safely.
        unsafe { b.align_to::<u64>() }
    };
    pre.iter().all(|&x| x == 0) && words.iter().all(|&x| x == 0) && post.iter().all(|&x| x == 0)
}

/// One flag per page: whether it is present in this process (mincore).
fn populated(base: *mut u8, len: usize) -> Result<Vec<bool>, LayerError> {
    let pages = len / PAGE_SIZE as usize;
    let mut vec = vec![0u8; pages];
    // SAFETY: `base..base+len` is one live mapping and `vec` has one byte
    // per page, as mincore(2) requires.
    let rc = unsafe { libc::mincore(base.cast(), len, vec.as_mut_ptr()) };
    if rc != 0 {
        return Err(LayerError::Mincore(std::io::Error::last_os_error()));
    }
    Ok(vec.into_iter().map(|v| v & 1 == 1).collect())
}

/// What [`write()`] wrote.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerInfo {
    /// The base a diff layer applies to (None: a full layer).
    pub base: Option<String>,
    /// Pages named by the layer (data and zero).
    pub pages: u64,
    /// Bytes of data records.
    pub data_bytes: u64,
}

/// Writes the windows of `sel` to `path` in the layer format; `base` is
/// recorded for a diff layer (`Selection::Pages`).
pub fn write(
    mem: &GuestMemoryMmap,
    sel: Selection<'_>,
    base: Option<&str>,
    path: &Path,
) -> Result<LayerInfo, LayerError> {
    let io = |source| LayerError::Io {
        path: path.into(),
        source,
    };
    let file = File::create(path).map_err(io)?;
    let mut w = BufWriter::with_capacity(MAX_WINDOW, file);
    let diff = matches!(sel, Selection::Pages(_));
    let mut head = Vec::new();
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&VERSION.to_le_bytes());
    head.extend_from_slice(&u32::from(diff).to_le_bytes());
    head.extend_from_slice(&(mem.num_regions() as u32).to_le_bytes());
    for r in mem.iter() {
        head.extend_from_slice(&r.start_addr().0.to_le_bytes());
        head.extend_from_slice(&r.len().to_le_bytes());
    }
    let base = if diff { base.unwrap_or("") } else { "" };
    head.extend_from_slice(&(base.len() as u32).to_le_bytes());
    head.extend_from_slice(base.as_bytes());
    w.write_all(&head).map_err(io)?;
    let mut info = LayerInfo {
        base: (diff && !base.is_empty()).then(|| base.to_string()),
        ..LayerInfo::default()
    };
    let mut records = 0u64;
    windows(mem, sel, |win| -> Result<(), LayerError> {
        let (kind, bytes): (u32, &[u8]) = match &win {
            Window::Data { bytes, .. } => (0, bytes),
            Window::Zero { .. } => (1, &[]),
        };
        w.write_all(&record_head(win.gpa(), win.len(), kind))
            .and_then(|()| w.write_all(bytes))
            .map_err(io)?;
        records += 1;
        info.pages += win.len() / PAGE_SIZE;
        info.data_bytes += bytes.len() as u64;
        Ok(())
    })?;
    w.write_all(&record_head(END, 0, 0)).map_err(io)?;
    w.write_all(&records.to_le_bytes()).map_err(io)?;
    w.write_all(&info.data_bytes.to_le_bytes()).map_err(io)?;
    let file = w.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    Ok(info)
}

fn record_head(gpa: u64, len: u64, kind: u32) -> [u8; 24] {
    let mut h = [0u8; 24];
    h[..8].copy_from_slice(&gpa.to_le_bytes());
    h[8..16].copy_from_slice(&len.to_le_bytes());
    h[16..20].copy_from_slice(&kind.to_le_bytes());
    h
}

/// A record read back by [`LayerReader`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    /// `len` bytes of data at `gpa` (in the buffer given to `next`).
    Data { gpa: u64, len: u64 },
    /// `len` zero bytes at `gpa`.
    Zero { gpa: u64, len: u64 },
}

/// Reads a `memory.layer` file window by window.
pub struct LayerReader {
    r: BufReader<File>,
    path: PathBuf,
    /// RAM layout, `(guest start, bytes)` per region.
    pub regions: Vec<(u64, u64)>,
    /// Whether it is a diff layer.
    pub diff: bool,
    /// The base of a diff layer.
    pub base: Option<String>,
    records: u64,
    data: u64,
    done: bool,
}

impl LayerReader {
    /// Opens a layer file and reads its header.
    pub fn open(path: &Path) -> Result<Self, LayerError> {
        let file = File::open(path).map_err(|source| LayerError::Io {
            path: path.into(),
            source,
        })?;
        let mut me = Self {
            r: BufReader::with_capacity(MAX_WINDOW, file),
            path: path.into(),
            regions: Vec::new(),
            diff: false,
            base: None,
            records: 0,
            data: 0,
            done: false,
        };
        let mut magic = [0u8; 8];
        me.read(&mut magic)?;
        if &magic != MAGIC {
            return Err(me.bad("bad magic"));
        }
        if me.u32()? != VERSION {
            return Err(me.bad("unknown version"));
        }
        me.diff = me.u32()? & 1 == 1;
        let n = me.u32()?;
        if n > 64 {
            return Err(me.bad("too many regions"));
        }
        for _ in 0..n {
            let s = me.u64()?;
            let l = me.u64()?;
            me.regions.push((s, l));
        }
        let blen = me.u32()? as usize;
        if blen > 4096 {
            return Err(me.bad("base label too long"));
        }
        let mut b = vec![0u8; blen];
        me.read(&mut b)?;
        let b = String::from_utf8(b).map_err(|_| me.bad("base label is not UTF-8"))?;
        me.base = (!b.is_empty()).then_some(b);
        Ok(me)
    }

    /// The next record; a data record's bytes are in `buf` (resized).
    /// None at the end, after the trailer was checked.
    pub fn next_record(&mut self, buf: &mut Vec<u8>) -> Result<Option<Record>, LayerError> {
        if self.done {
            return Ok(None);
        }
        let gpa = self.u64()?;
        let len = self.u64()?;
        let kind = self.u32()?;
        let _ = self.u32()?;
        if gpa == END {
            let records = self.u64()?;
            let data = self.u64()?;
            if records != self.records || data != self.data {
                return Err(self.bad("trailer does not match the records (truncated?)"));
            }
            self.done = true;
            return Ok(None);
        }
        if len == 0 || len > MAX_WINDOW as u64 || gpa % PAGE_SIZE != 0 || len % PAGE_SIZE != 0 {
            return Err(self.bad(&format!("bad record at {gpa:#x} of {len} bytes")));
        }
        let in_ram = self
            .regions
            .iter()
            .any(|&(s, l)| gpa >= s && gpa + len <= s + l);
        if !in_ram {
            return Err(self.bad(&format!("record at {gpa:#x} is outside RAM")));
        }
        self.records += 1;
        match kind {
            0 => {
                buf.resize(len as usize, 0);
                self.read(buf)?;
                self.data += len;
                Ok(Some(Record::Data { gpa, len }))
            }
            1 => Ok(Some(Record::Zero { gpa, len })),
            k => Err(self.bad(&format!("unknown record kind {k}"))),
        }
    }

    fn read(&mut self, b: &mut [u8]) -> Result<(), LayerError> {
        self.r.read_exact(b).map_err(|source| LayerError::Io {
            path: self.path.clone(),
            source,
        })
    }

    fn u32(&mut self) -> Result<u32, LayerError> {
        let mut b = [0u8; 4];
        self.read(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    fn u64(&mut self) -> Result<u64, LayerError> {
        let mut b = [0u8; 8];
        self.read(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn bad(&self, why: &str) -> LayerError {
        LayerError::Format {
            path: self.path.clone(),
            why: why.into(),
        }
    }
}

/// Guest RAM as one flat image: the regions at consecutive offsets, as a
/// snapshot directory's `memory` file and the store's memory layers lay
/// it out. Converts between guest addresses and image offsets.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RamLayout {
    /// `(guest start, bytes, image offset)` per region.
    regions: Vec<(u64, u64, u64)>,
}

impl RamLayout {
    /// The layout of `(guest start, bytes)` regions.
    pub fn new(regions: &[(u64, u64)]) -> Self {
        let mut off = 0;
        Self {
            regions: regions
                .iter()
                .map(|&(s, l)| {
                    let r = (s, l, off);
                    off += l;
                    r
                })
                .collect(),
        }
    }

    /// The layout of a moment's RAM regions.
    pub fn of(regions: &[(vm_memory::GuestAddress, usize)]) -> Self {
        Self::new(
            &regions
                .iter()
                .map(|r| (r.0 .0, r.1 as u64))
                .collect::<Vec<_>>(),
        )
    }

    /// Bytes of the image (all of RAM).
    pub fn len(&self) -> u64 {
        self.regions.iter().map(|r| r.1).sum()
    }

    /// Whether there is no RAM.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The image offset of guest address `gpa` (None: not RAM).
    pub fn offset(&self, gpa: u64) -> Option<u64> {
        self.regions
            .iter()
            .find(|&&(s, l, _)| gpa >= s && gpa < s + l)
            .map(|&(s, _, o)| o + (gpa - s))
    }

    /// The guest address of image offset `off` (None: past the end).
    pub fn gpa(&self, off: u64) -> Option<u64> {
        self.regions
            .iter()
            .find(|&&(_, l, o)| off >= o && off < o + l)
            .map(|&(s, _, o)| s + (off - o))
    }

    /// `(guest address, image offset, bytes)` of the parts of image range
    /// `off..off+len`, one per region it crosses.
    fn pieces(&self, off: u64, len: u64) -> Vec<(u64, u64, u64)> {
        let end = off.saturating_add(len);
        self.regions
            .iter()
            .filter_map(|&(s, l, o)| {
                let lo = off.max(o);
                let hi = end.min(o + l);
                (lo < hi).then(|| (s + (lo - o), lo, hi - lo))
            })
            .collect()
    }

    /// A page set as a bitmap over the image's 4 KiB pages (bit `i` of
    /// word `i / 64`, least significant first, as KVM's dirty log).
    pub fn flat_bitmap(&self, pages: &PageBitmap) -> Vec<u64> {
        let total = self.len().div_ceil(PAGE_SIZE);
        let mut bits = vec![0u64; total.div_ceil(64) as usize];
        for (gpa, len) in pages.runs() {
            let Some(off) = self.offset(gpa) else {
                continue;
            };
            for p in off / PAGE_SIZE..(off + len) / PAGE_SIZE {
                if let Some(w) = bits.get_mut((p / 64) as usize) {
                    *w |= 1 << (p % 64);
                }
            }
        }
        bits
    }

    /// Image page indexes (offset / 4 KiB) of `ranges` of guest
    /// addresses (a working set), in order.
    pub fn flat_pages(&self, ranges: &[(u64, u64)]) -> Vec<u64> {
        let mut out = Vec::new();
        for &(gpa, len) in ranges {
            for a in (gpa..gpa.saturating_add(len)).step_by(PAGE_SIZE as usize) {
                if let Some(off) = self.offset(a) {
                    out.push(off / PAGE_SIZE);
                }
            }
        }
        out
    }
}

/// A `memory.layer` file opened for random access by image offset: what
/// a store needs to cut the layer into its own windows. A window of a
/// diff layer is the base's window with [`LayerFile::overlay`] applied;
/// a full layer's is [`LayerFile::read_at`].
pub struct LayerFile {
    file: File,
    path: PathBuf,
    layout: RamLayout,
    diff: bool,
    base: Option<String>,
    /// `(guest address, bytes, data offset in the file or None for zero)`,
    /// in address order.
    records: Vec<(u64, u64, Option<u64>)>,
    pages: PageBitmap,
}

impl LayerFile {
    /// Opens `path` and indexes its records (reads the headers only).
    pub fn open(path: &Path) -> Result<Self, LayerError> {
        let mut r = LayerReader::open(path)?;
        let mut records = Vec::new();
        let mut pages = PageBitmap::empty(&r.regions);
        // Data offset: header, then per record 24 bytes + data.
        let mut pos = header_len(&r);
        let mut buf = Vec::new();
        while let Some(rec) = r.next_record(&mut buf)? {
            pos += 24;
            match rec {
                Record::Data { gpa, len } => {
                    records.push((gpa, len, Some(pos)));
                    pages.insert(gpa, len);
                    pos += len;
                }
                Record::Zero { gpa, len } => {
                    records.push((gpa, len, None));
                    pages.insert(gpa, len);
                }
            }
        }
        let file = File::open(path).map_err(|source| LayerError::Io {
            path: path.into(),
            source,
        })?;
        Ok(Self {
            file,
            path: path.into(),
            layout: RamLayout::new(&r.regions),
            diff: r.diff,
            base: r.base.clone(),
            records,
            pages,
        })
    }

    /// The RAM layout the layer was written for.
    pub fn layout(&self) -> &RamLayout {
        &self.layout
    }

    /// Whether it is a diff layer (pages not named are the base's).
    pub fn is_diff(&self) -> bool {
        self.diff
    }

    /// The base of a diff layer.
    pub fn base(&self) -> Option<&str> {
        self.base.as_deref()
    }

    /// The pages the layer names (data and zero).
    pub fn pages(&self) -> &PageBitmap {
        &self.pages
    }

    /// The named pages as a bitmap over the image's pages (a store's
    /// dirty list).
    pub fn flat_bitmap(&self) -> Vec<u64> {
        self.layout.flat_bitmap(&self.pages)
    }

    /// Writes the layer's pages over `buf`, which holds the image bytes
    /// at `offset` (the base's, for a diff); pages it does not name are
    /// left as they are.
    pub fn overlay(&self, buf: &mut [u8], offset: u64) -> Result<(), LayerError> {
        for (gpa, off, len) in self.layout.pieces(offset, buf.len() as u64) {
            let first = self.records.partition_point(|r| r.0 + r.1 <= gpa);
            for &(rg, rl, data) in &self.records[first..] {
                if rg >= gpa + len {
                    break;
                }
                let lo = rg.max(gpa);
                let hi = (rg + rl).min(gpa + len);
                let dst = &mut buf[(off + (lo - gpa) - offset) as usize..][..(hi - lo) as usize];
                match data {
                    Some(d) => self
                        .file
                        .read_exact_at(dst, d + (lo - rg))
                        .map_err(|source| LayerError::Io {
                            path: self.path.clone(),
                            source,
                        })?,
                    None => dst.fill(0),
                }
            }
        }
        Ok(())
    }

    /// Reads image bytes at `offset` from a full layer (pages it does not
    /// name are zero).
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), LayerError> {
        buf.fill(0);
        self.overlay(buf, offset)
    }
}

fn header_len(r: &LayerReader) -> u64 {
    8 + 4 + 4 + 4 + 16 * r.regions.len() as u64 + 4 + r.base.as_ref().map_or(0, |b| b.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress};

    fn mem() -> GuestMemoryMmap {
        crate::memory::create_guest_memory(&[(GuestAddress(0), 4 << 20)]).expect("memory")
    }

    fn read_all(path: &Path) -> (LayerReader, Vec<(Record, Vec<u8>)>) {
        let mut r = LayerReader::open(path).expect("open");
        let mut out = Vec::new();
        let mut buf = Vec::new();
        while let Some(rec) = r.next_record(&mut buf).expect("record") {
            out.push((rec, buf.clone()));
        }
        (r, out)
    }

    #[test]
    fn test_full_layer_skips_zero_and_unpopulated_pages() {
        let m = mem();
        m.write_slice(&[7u8; 8192], GuestAddress(0x10000))
            .expect("write");
        m.write_slice(&[0u8; 4096], GuestAddress(0x20000))
            .expect("write zeros");
        m.write_slice(&[9u8; 1], GuestAddress(0x3f_f000))
            .expect("write");
        let dir = std::env::temp_dir().join(format!("tine-layer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("full.layer");
        let info = write(&m, Selection::Populated, None, &path).expect("write layer");
        assert_eq!(info.pages, 3);
        assert_eq!(info.data_bytes, 3 * 4096);
        let (r, recs) = read_all(&path);
        assert!(!r.diff && r.base.is_none());
        assert_eq!(r.regions, vec![(0, 4 << 20)]);
        assert_eq!(recs.len(), 2);
        assert_eq!(
            recs[0].0,
            Record::Data {
                gpa: 0x10000,
                len: 8192
            }
        );
        assert!(recs[0].1.iter().all(|&b| b == 7));
        assert_eq!(
            recs[1].0,
            Record::Data {
                gpa: 0x3f_f000,
                len: 4096
            }
        );

        // A diff of chosen pages: zero pages are named as zero records.
        let mut set = PageBitmap::empty_for(&m);
        set.insert(0x11000, 0x10000);
        let path = dir.join("diff.layer");
        let info = write(&m, Selection::Pages(&set), Some("s1"), &path).expect("write diff");
        assert_eq!(info.pages, 16);
        let (r, recs) = read_all(&path);
        assert!(r.diff);
        assert_eq!(r.base.as_deref(), Some("s1"));
        assert_eq!(
            recs[0].0,
            Record::Data {
                gpa: 0x11000,
                len: 4096
            }
        );
        assert_eq!(
            recs[1].0,
            Record::Zero {
                gpa: 0x12000,
                len: 0xf000
            }
        );

        // Random access by image offset: a base window with the diff on it.
        let lf = LayerFile::open(&path).expect("layer file");
        assert!(lf.is_diff() && lf.base() == Some("s1"));
        let mut window = vec![5u8; 0x20000];
        lf.overlay(&mut window, 0x10000).expect("overlay");
        assert!(
            window[..0x1000].iter().all(|&b| b == 5),
            "not named: base kept"
        );
        assert!(window[0x1000..0x2000].iter().all(|&b| b == 7), "data page");
        assert!(
            window[0x2000..0x11000].iter().all(|&b| b == 0),
            "zero pages"
        );
        assert!(window[0x11000..].iter().all(|&b| b == 5));
        let bits = lf.flat_bitmap();
        assert_eq!(bits[0], 0xffff << 0x11, "pages 0x11..0x21");

        // A truncated file is an error, not a short layer.
        let bytes = std::fs::read(&path).expect("read");
        std::fs::write(&path, &bytes[..bytes.len() - 8]).expect("truncate");
        let mut r = LayerReader::open(&path).expect("open");
        let mut buf = Vec::new();
        let mut res = Ok(Some(Record::Zero { gpa: 0, len: 0 }));
        while let Ok(Some(_)) = res {
            res = r.next_record(&mut buf);
        }
        assert!(res.is_err(), "truncated layer read without error");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn test_ram_layout_maps_addresses_and_offsets_across_the_hole() {
        let l = RamLayout::new(&[(0, 3 << 30), (4 << 30, 1 << 30)]);
        assert_eq!(l.len(), 4 << 30);
        assert_eq!(l.offset(0x1000), Some(0x1000));
        assert_eq!(l.offset(3 << 30), None, "the hole is not RAM");
        assert_eq!(l.offset((4 << 30) + 0x2000), Some((3 << 30) + 0x2000));
        assert_eq!(l.gpa((3 << 30) + 0x2000), Some((4 << 30) + 0x2000));
        assert_eq!(l.gpa(4 << 30), None);
        // A range across the end of the first region is two pieces.
        assert_eq!(
            l.pieces((3 << 30) - 0x1000, 0x2000),
            vec![
                ((3 << 30) - 0x1000, (3 << 30) - 0x1000, 0x1000),
                (4 << 30, 3 << 30, 0x1000)
            ]
        );
        let mut set = PageBitmap::empty(&[(0, 3 << 30), (4 << 30, 1 << 30)]);
        set.insert(4 << 30, 0x2000);
        let bits = l.flat_bitmap(&set);
        let first = (3u64 << 30) / PAGE_SIZE;
        assert_eq!(bits[(first / 64) as usize], 0b11);
        assert_eq!(l.flat_pages(&[(4 << 30, 0x2000)]), vec![first, first + 1]);
    }
}
