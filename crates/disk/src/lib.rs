//! Copy-on-write disk layers for tine: qcow2 backing chains that freeze and branch.
//!
//! A disk is a chain of layers: a raw or qcow2 base at the bottom, qcow2 overlays above it.
//! Only the top layer is ever opened for writing; every layer below it is opened read-only
//! and is never written. A fork does not copy the disk: [`freeze`] makes the current top
//! read-only and puts N new, empty overlays on it, one per branch.
//!
//! # What the `imago` crate does for us, and what it does not
//!
//! The qcow2 data path (cluster mapping, copy-on-write allocation, L2/refcount caches,
//! metadata write-back on flush, discard, write-zeroes) is [`imago`] (by QEMU's block
//! maintainer), built with its `sync` feature: plain blocking `fn`s, no async runtime.
//! It is the hard part of qcow2 and it writes images that `qemu-img check` accepts.
//!
//! We do by hand, and why:
//! - **Walking the backing chain** ([`Disk::open`]). imago can open a backing chain
//!   implicitly, but it recurses without a depth limit or cycle detection (a→b→a recurses
//!   until the stack or the fd table runs out), it does not compare virtual sizes, and its
//!   errors do not say which file of the chain is at fault. We walk the chain ourselves,
//!   read-only, validate every layer (exists, format, header, size, no cycle, depth), and
//!   only then open the top writable and hand each opened layer to the one above it
//!   explicitly (`Qcow2OpenBuilder::backing`), with `DenyImplicitOpenGate` so imago itself
//!   opens nothing we did not check.
//! - **Creating an empty overlay** ([`create_overlay`]). imago's `Qcow2::create_builder`
//!   works, but it opens the new image through its full driver and flushes it: median 0.28 ms,
//!   worst 4.9 ms per overlay in release, 1.7 ms median in debug. An empty overlay is four
//!   small fixed structures (header with backing name and format, one refcount-table entry,
//!   one refcount block, a zero L1 table) that we write directly with three `pwrite`s:
//!   0.02-0.05 ms, under the 1 ms per overlay a fork needs with a wide margin.
//! - **Read-only guarantees and locking.** Root ignores `chmod a-w`, so a writable open checks
//!   the mode bits itself and refuses frozen layers (an in-process registry too), and every
//!   open layer carries an advisory `flock` (exclusive on a writable top, shared below), so
//!   a layer cannot be frozen while a writer has it open, nor opened for write while a
//!   branch reads it, in this process or another one using this crate.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::{self, File as StdFile, OpenOptions};
use std::io;
use std::ops::Range;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use imago::file::File as ImagoFile;
use imago::qcow2::Qcow2;
use imago::raw::Raw;
use imago::{
    DenyImplicitOpenGate, FormatAccess, FormatDriverBuilder, ShallowMapping, StorageOpenOptions,
};

mod fold;
mod overlay;

pub use fold::{Fold, FoldDone, FOLD_STEP};
pub use overlay::create_overlay;

/// The deepest backing chain we open. Each open layer costs one file descriptor.
pub const MAX_CHAIN_DEPTH: usize = 256;

const QCOW2_MAGIC: [u8; 4] = *b"QFI\xfb";

/// Image format of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Raw,
    Qcow2,
}

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Raw => "raw",
            Format::Qcow2 => "qcow2",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One layer of a chain, top first in [`Disk::chain`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerInfo {
    pub path: PathBuf,
    pub format: Format,
    /// Size the guest sees, in bytes.
    pub virtual_size: u64,
    /// Bytes the layer's file occupies on the host (`st_blocks * 512`).
    pub allocated_bytes: u64,
}

/// Everything that can go wrong, each naming the file and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("{}: no such file{}; create it, or fix the backing file name recorded in the layer above", path.display(), referenced_by.as_ref().map(|r| format!(" (backing file of {})", r.display())).unwrap_or_default())]
    Missing {
        path: PathBuf,
        referenced_by: Option<PathBuf>,
    },
    #[error("{}: backing chain has a cycle ({}); every layer must have a distinct backing file, rebuild the chain", path.display(), chain.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" -> "))]
    Cycle { path: PathBuf, chain: Vec<PathBuf> },
    #[error("{}: backing chain deeper than {max} layers; flatten it with `qemu-img convert`", path.display())]
    TooDeep { path: PathBuf, max: usize },
    #[error("{}: truncated qcow2 header ({len} bytes, a header needs at least {need}); the file is damaged, restore it or recreate the layer", path.display())]
    Truncated { path: PathBuf, len: u64, need: u64 },
    #[error("{}: not a valid qcow2 image: {detail}; check it with `qemu-img check`", path.display())]
    Corrupt { path: PathBuf, detail: String },
    #[error("{}: unsupported: {what}", path.display())]
    Unsupported { path: PathBuf, what: String },
    #[error("{}: virtual size {size} differs from its backing file {} ({backing_size}); every layer of a chain must have the same size, recreate the overlay on that backing file", path.display(), backing.display())]
    SizeMismatch {
        path: PathBuf,
        size: u64,
        backing: PathBuf,
        backing_size: u64,
    },
    #[error("{}: read-only (no write permission, or a frozen layer); open it read-only, or put an overlay on it with create_overlay and write there", path.display())]
    ReadOnly { path: PathBuf },
    #[error("{}: in use: another open disk {what}; close that disk first", path.display())]
    Busy { path: PathBuf, what: &'static str },
    #[error("{}: already exists; choose another name or remove it", path.display())]
    Exists { path: PathBuf },
    #[error("{}: the disk was opened read-only; writes and discards are refused", path.display())]
    NotWritable { path: PathBuf },
    #[error("{}: request [{offset}, +{len}) is beyond the disk size {size}", path.display())]
    OutOfRange {
        path: PathBuf,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("{}: the chain has {depth} layers, there is no layer {layer} to compare against", path.display())]
    NoSuchLayer {
        path: PathBuf,
        layer: usize,
        depth: usize,
    },
    #[error("{}: {op}: {source}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: io::Error,
    },
}

pub(crate) fn io_err<'a>(
    path: &'a Path,
    op: &'static str,
) -> impl FnOnce(io::Error) -> DiskError + 'a {
    move |source| DiskError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

/// (st_dev, st_ino) of a file: identity that survives different spellings of its path.
type FileId = (u64, u64);

/// Layers frozen by this process, by identity and canonical path (the path too, because an
/// inode number is reused once a frozen file is deleted). Root ignores permission bits, so a
/// writable open also consults this set: a frozen layer is never written again by this
/// process, whatever its mode bits say later.
fn frozen() -> &'static Mutex<HashMap<FileId, PathBuf>> {
    static FROZEN: OnceLock<Mutex<HashMap<FileId, PathBuf>>> = OnceLock::new();
    FROZEN.get_or_init(|| Mutex::new(HashMap::new()))
}

fn is_frozen(id: FileId, path: &Path) -> bool {
    let Ok(set) = frozen().lock() else {
        return true;
    };
    match set.get(&id) {
        None => false,
        Some(p) => fs::canonicalize(path).map(|c| &c == p).unwrap_or(true),
    }
}

/// Header facts we need before handing a layer to imago.
#[derive(Debug, Clone)]
pub(crate) struct Probe {
    pub format: Format,
    pub virtual_size: u64,
    /// Backing file name as recorded in the header, and its format if recorded.
    pub backing: Option<(String, Option<String>)>,
}

fn be32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_be_bytes(a)
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// Read just enough of a layer to know its format, size and backing file.
///
/// `format` is the format recorded by the layer above, if any; with none we probe the magic
/// (the base is never written by us, so a guest cannot plant a qcow2 header in it).
pub(crate) fn probe(
    path: &Path,
    file: &StdFile,
    format: Option<Format>,
) -> Result<Probe, DiskError> {
    let len = file.metadata().map_err(io_err(path, "stat"))?.len();
    let mut head = [0u8; 4];
    let n = file
        .read_at(&mut head, 0)
        .map_err(io_err(path, "read header"))?;
    let is_qcow2 = n == 4 && head == QCOW2_MAGIC;
    if n < 4 && n > 0 && head[..n] == QCOW2_MAGIC[..n] {
        // A qcow2 image cut inside its magic; a raw disk of 1..3 bytes is not plausible.
        return Err(DiskError::Truncated {
            path: path.into(),
            len,
            need: 72,
        });
    }
    let format = match format {
        Some(f) => f,
        None if is_qcow2 => Format::Qcow2,
        None => Format::Raw,
    };
    if format == Format::Raw {
        return Ok(Probe {
            format,
            virtual_size: len,
            backing: None,
        });
    }
    if !is_qcow2 {
        if len < 4 {
            return Err(DiskError::Truncated {
                path: path.into(),
                len,
                need: 72,
            });
        }
        return Err(DiskError::Corrupt {
            path: path.into(),
            detail: "no qcow2 magic".into(),
        });
    }
    let corrupt = |detail: String| DiskError::Corrupt {
        path: path.into(),
        detail,
    };
    let mut h = [0u8; 104];
    let got = read_full_at(file, &mut h, 0).map_err(io_err(path, "read header"))?;
    if got < 72 {
        return Err(DiskError::Truncated {
            path: path.into(),
            len,
            need: 72,
        });
    }
    let version = be32(&h, 4);
    let need = match version {
        2 => 72,
        3 => 104,
        v => return Err(corrupt(format!("qcow2 version {v} (only 2 and 3 exist)"))),
    };
    if (got as u64) < need {
        return Err(DiskError::Truncated {
            path: path.into(),
            len,
            need,
        });
    }
    let header_len = if version == 3 {
        u64::from(be32(&h, 100))
    } else {
        72
    };
    let backing_offset = be64(&h, 8);
    let backing_size = u64::from(be32(&h, 16));
    let virtual_size = be64(&h, 24);
    // Tables the header points at must lie inside the file, or the image was cut short.
    let cluster_bits = be32(&h, 20);
    if !(9..=21).contains(&cluster_bits) {
        return Err(corrupt(format!(
            "cluster_bits {cluster_bits} out of range 9..=21"
        )));
    }
    let l1_end = be64(&h, 40).saturating_add(u64::from(be32(&h, 36)) * 8);
    let rt_end = be64(&h, 48).saturating_add(u64::from(be32(&h, 56)) << cluster_bits);
    if l1_end > len || rt_end > len {
        return Err(DiskError::Truncated {
            path: path.into(),
            len,
            need: l1_end.max(rt_end),
        });
    }
    if header_len > len {
        return Err(DiskError::Truncated {
            path: path.into(),
            len,
            need: header_len,
        });
    }
    let backing_name = if backing_offset != 0 && backing_size != 0 {
        if backing_size > 1023 {
            return Err(corrupt(format!(
                "backing file name of {backing_size} bytes (max 1023)"
            )));
        }
        let end = backing_offset.saturating_add(backing_size);
        if end > len {
            return Err(DiskError::Truncated {
                path: path.into(),
                len,
                need: end,
            });
        }
        let mut name = vec![0u8; backing_size as usize];
        read_full_at(file, &mut name, backing_offset).map_err(io_err(path, "read backing name"))?;
        Some(
            String::from_utf8(name)
                .map_err(|_| corrupt("backing file name is not UTF-8".into()))?,
        )
    } else {
        None
    };
    // Header extensions (v3, and v2 images written by QEMU) follow the header up to the
    // first cluster; the backing file format extension is the one we need.
    let mut backing_format = None;
    if backing_name.is_some() {
        let cluster_bits = be32(&h, 20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(corrupt(format!(
                "cluster_bits {cluster_bits} out of range 9..=21"
            )));
        }
        let limit = (1u64 << cluster_bits)
            .min(len)
            .min(backing_offset.max(header_len));
        let mut at = header_len;
        while at + 8 <= limit {
            let mut eh = [0u8; 8];
            read_full_at(file, &mut eh, at).map_err(io_err(path, "read header extension"))?;
            let (ty, elen) = (be32(&eh, 0), u64::from(be32(&eh, 4)));
            if ty == 0 {
                break;
            }
            if at + 8 + elen > limit {
                return Err(corrupt(format!(
                    "header extension {ty:#x} runs past the header"
                )));
            }
            if ty == 0xE279_2ACA {
                let mut f = vec![0u8; elen as usize];
                read_full_at(file, &mut f, at + 8)
                    .map_err(io_err(path, "read header extension"))?;
                backing_format = Some(String::from_utf8_lossy(&f).into_owned());
            }
            at += 8 + elen.div_ceil(8) * 8;
        }
    }
    Ok(Probe {
        format,
        virtual_size,
        backing: backing_name.map(|n| (n, backing_format)),
    })
}

fn read_full_at(file: &StdFile, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Resolve a backing file name the way QEMU does: relative names are relative to the
/// directory of the layer that records them.
pub(crate) fn resolve_backing(layer: &Path, name: &str) -> PathBuf {
    let p = Path::new(name);
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        layer.parent().unwrap_or(Path::new(".")).join(p)
    }
}

pub(crate) fn file_id(m: &fs::Metadata) -> FileId {
    (m.dev(), m.ino())
}

fn open_ro(path: &Path, referenced_by: Option<&Path>) -> Result<StdFile, DiskError> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                DiskError::Missing {
                    path: path.into(),
                    referenced_by: referenced_by.map(Path::to_path_buf),
                }
            } else {
                DiskError::Io {
                    path: path.into(),
                    op: "open",
                    source: e,
                }
            }
        })
}

/// Opens a top layer for writing; no permission is [`DiskError::ReadOnly`].
fn open_rw(path: &Path) -> Result<StdFile, DiskError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => DiskError::Missing {
                path: path.into(),
                referenced_by: None,
            },
            io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem => {
                DiskError::ReadOnly { path: path.into() }
            }
            _ => DiskError::Io {
                path: path.into(),
                op: "open",
                source: e,
            },
        })
}

/// Take an advisory lock, `exclusive` for the writable top, shared otherwise.
///
/// Non-blocking, but retried for a short while: a process forked by another thread of ours
/// (e.g. `qemu-img`) briefly holds copies of our descriptors, and so our locks, until it execs.
fn try_flock(path: &Path, file: &StdFile, exclusive: bool) -> Result<(), DiskError> {
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    } | libc::LOCK_NB;
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(100);
    loop {
        // SAFETY: flock on an fd we own; no memory is passed.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(io_err(path, "flock")(err));
        }
        if std::time::Instant::now() >= deadline {
            return Err(DiskError::Busy {
                path: path.into(),
                what: if exclusive {
                    "reads or writes it"
                } else {
                    "holds it open for writing"
                },
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

struct Layer {
    path: PathBuf,
    format: Format,
    virtual_size: u64,
    /// The layer's one open file, which holds its advisory lock.
    fd: LayerFd,
}

/// Who owns a layer's file: the layer (a walked chain), or imago, to which
/// [`Disk::open`] lends it so each layer costs one fd, not two.
enum LayerFd {
    Own(StdFile),
    /// Owned by the imago driver of the same [`Disk`], open as long as it.
    Lent(std::os::fd::RawFd),
}

impl Layer {
    /// The layer's file, for stat, flock and fsync.
    fn file(&self) -> std::mem::ManuallyDrop<StdFile> {
        use std::os::fd::FromRawFd;
        let fd = match &self.fd {
            LayerFd::Own(f) => f.as_raw_fd(),
            LayerFd::Lent(fd) => *fd,
        };
        // SAFETY: the fd is open for as long as this layer is: owned by it,
        // or by the imago driver of the same Disk, which drops no layer
        // file before the Disk. ManuallyDrop never closes it.
        std::mem::ManuallyDrop::new(unsafe { StdFile::from_raw_fd(fd) })
    }

    /// Hands the file to imago; the layer keeps its number.
    fn lend(&mut self) -> Option<StdFile> {
        match std::mem::replace(&mut self.fd, LayerFd::Lent(-1)) {
            LayerFd::Own(f) => {
                self.fd = LayerFd::Lent(f.as_raw_fd());
                Some(f)
            }
            lent => {
                self.fd = lent;
                None
            }
        }
    }

    fn allocated_bytes(&self) -> u64 {
        self.file()
            .metadata()
            .map(|m| m.blocks() * 512)
            .unwrap_or(0)
    }
}

/// An open chain of layers. Reads fall through to the first layer that has the data;
/// writes go to the top layer only.
///
/// `Disk` is `Send + Sync`; reads and writes take `&self` (imago serialises metadata
/// updates internally), so one virtio-blk worker thread can own it.
pub struct Disk {
    top: FormatAccess<ImagoFile>,
    layers: Vec<Layer>,
    writable: bool,
    size: u64,
}

impl fmt::Debug for Disk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Disk")
            .field("top", &self.layers[0].path)
            .field("depth", &self.layers.len())
            .field("writable", &self.writable)
            .field("size", &self.size)
            .finish()
    }
}

fn imago_err<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(io::Error) -> DiskError + 'a {
    move |e| match e.kind() {
        io::ErrorKind::InvalidData | io::ErrorKind::UnexpectedEof => DiskError::Corrupt {
            path: path.into(),
            detail: format!("{op}: {e}"),
        },
        io::ErrorKind::Unsupported => DiskError::Unsupported {
            path: path.into(),
            what: e.to_string(),
        },
        _ => DiskError::Io {
            path: path.into(),
            op,
            source: e,
        },
    }
}

fn open_layer(
    path: &Path,
    file: StdFile,
    format: Format,
    writable: bool,
    backing: Option<FormatAccess<ImagoFile>>,
) -> Result<FormatAccess<ImagoFile>, DiskError> {
    // We open the file ourselves: `DenyImplicitOpenGate` lets imago open nothing by name.
    let opts = StorageOpenOptions::new().write(writable).filename(path);
    let file = ImagoFile::from_open_file(file, opts).map_err(imago_err(path, "open"))?;
    let opts = StorageOpenOptions::new().write(writable);
    match format {
        Format::Raw => {
            let raw = Raw::<ImagoFile>::builder(file)
                .storage_open_options(opts)
                .write(writable)
                .open(DenyImplicitOpenGate::default())
                .map_err(imago_err(path, "open raw"))?;
            Ok(FormatAccess::new(raw))
        }
        Format::Qcow2 => {
            let q = Qcow2::<ImagoFile>::builder(file)
                .storage_open_options(opts)
                .write(writable)
                .backing(backing)
                .open(DenyImplicitOpenGate::default())
                .map_err(imago_err(path, "open qcow2"))?;
            Ok(FormatAccess::new(q))
        }
    }
}

/// Opens walked `layers` through imago, bottom-up, lending each its file.
fn open_chain(layers: &mut [Layer], writable: bool) -> Result<FormatAccess<ImagoFile>, DiskError> {
    let mut below: Option<FormatAccess<ImagoFile>> = None;
    for (i, l) in layers.iter_mut().enumerate().rev() {
        let w = writable && i == 0;
        let Some(file) = l.lend() else {
            return Err(DiskError::Unsupported {
                path: l.path.clone(),
                what: "layer opened twice".into(),
            });
        };
        below = Some(open_layer(&l.path, file, l.format, w, below.take())?);
    }
    below.ok_or_else(|| DiskError::Missing {
        path: PathBuf::new(),
        referenced_by: None,
    })
}

impl Disk {
    /// Open the chain whose top layer is `path`. With `writable`, the top layer is opened
    /// for writing and every layer below it read-only; nothing below the top is ever
    /// written. The whole chain is validated before anything is opened for writing, so a
    /// failed open changes nothing on disk.
    pub fn open(path: &Path, writable: bool) -> Result<Disk, DiskError> {
        // 1. Walk down the chain, validating and locking each layer (only a writable
        //    top is opened for writing).
        let mut layers = walk_chain(path, writable, true)?;

        // 2. Open bottom-up through imago, each layer handed to the one above explicitly,
        //    on the file the walk opened (one fd per layer).
        let top = open_chain(&mut layers, writable)?;
        let size = top.size();
        Ok(Disk {
            top,
            layers,
            writable,
            size,
        })
    }

    /// Virtual size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether the top layer is open for writing.
    pub fn writable(&self) -> bool {
        self.writable
    }

    /// Path of the top layer.
    pub fn path(&self) -> &Path {
        &self.layers[0].path
    }

    fn check_range(&self, offset: u64, len: u64) -> Result<(), DiskError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(DiskError::OutOfRange {
                path: self.path().into(),
                offset,
                len,
                size: self.size,
            }),
        }
    }

    fn check_writable(&self) -> Result<(), DiskError> {
        if self.writable {
            Ok(())
        } else {
            Err(DiskError::NotWritable {
                path: self.path().into(),
            })
        }
    }

    /// Read `buf.len()` bytes at `offset`. The range must lie within [`Disk::size`].
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DiskError> {
        self.check_range(offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.top
            .read(buf, offset)
            .map_err(imago_err(&self.layers[0].path, "read"))
    }

    /// Write `buf` at `offset` into the top layer. Durable only after [`Disk::flush`].
    pub fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DiskError> {
        self.check_writable()?;
        self.check_range(offset, buf.len() as u64)?;
        if buf.is_empty() {
            return Ok(());
        }
        self.top
            .write(buf, offset)
            .map_err(imago_err(&self.layers[0].path, "write"))
    }

    /// Write back cached qcow2 metadata (L2 tables, refcounts) and fsync the top layer:
    /// every write completed before this call survives a crash once it returns.
    pub fn flush(&self) -> Result<(), DiskError> {
        if !self.writable {
            return Ok(());
        }
        let p = &self.layers[0].path;
        self.top.flush().map_err(imago_err(p, "flush"))?;
        self.top.sync().map_err(imago_err(p, "fsync"))
    }

    /// Discard a range: afterwards it reads as zeroes or as the data below (unspecified,
    /// as virtio-blk DISCARD allows). Whole clusters are freed where the format can;
    /// a no-op where it cannot do so cheaply.
    pub fn discard(&mut self, offset: u64, len: u64) -> Result<(), DiskError> {
        self.check_writable()?;
        self.check_range(offset, len)?;
        match self.top.discard_to_any(offset, len) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Unsupported => Ok(()),
            Err(e) => Err(imago_err(&self.layers[0].path, "discard")(e)),
        }
    }

    /// Make a range read as zeroes (virtio-blk WRITE_ZEROES), using zero clusters where
    /// the format has them.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), DiskError> {
        self.check_writable()?;
        self.check_range(offset, len)?;
        self.top
            .write_zeroes(offset, len)
            .map_err(imago_err(&self.layers[0].path, "write zeroes"))
    }

    /// Freeze this open disk's top layer in place for a fork: flush it,
    /// move it to `frozen` (same filesystem), make it read-only, and trade
    /// the exclusive lock for a shared one so the layers stacked on it can
    /// be opened while this process still holds it. From now on this disk
    /// refuses writes; every continuation opens its own overlay on `frozen`.
    /// [`Disk::thaw`] undoes it if the fork fails.
    ///
    /// Cached qcow2 metadata is written, but nothing is fsynced here: that
    /// would put a disk flush on the path the guest waits on. Call
    /// [`Disk::sync_top`] once the vm runs on.
    pub fn freeze_to(&mut self, frozen: &Path) -> Result<(), DiskError> {
        if !self.writable {
            return Err(DiskError::NotWritable {
                path: self.path().into(),
            });
        }
        let top = self.layers[0].path.clone();
        self.top.flush().map_err(imago_err(&top, "flush"))?;
        if frozen.symlink_metadata().is_ok() {
            return Err(DiskError::Exists {
                path: frozen.into(),
            });
        }
        fs::rename(&top, frozen).map_err(io_err(&top, "rename"))?;
        let file = &*self.layers[0].file();
        // Either frozen whole or not at all: a failure below moves it back.
        let res = file
            .metadata()
            .map_err(io_err(frozen, "stat"))
            .and_then(|meta| {
                let mode = meta.permissions().mode();
                fs::set_permissions(frozen, fs::Permissions::from_mode(mode & !0o222))
                    .map_err(io_err(frozen, "chmod a-w"))?;
                try_flock(frozen, file, false).inspect_err(|_| {
                    let _ = fs::set_permissions(frozen, fs::Permissions::from_mode(mode));
                })
            });
        if let Err(e) = res {
            let _ = fs::rename(frozen, &top);
            return Err(e);
        }
        self.layers[0].path = frozen.into();
        self.writable = false;
        Ok(())
    }

    /// Makes the top layer and its directory entry durable (after
    /// [`Disk::freeze_to`], off the pause path).
    pub fn sync_top(&self) -> Result<(), DiskError> {
        let p = &self.layers[0].path;
        self.layers[0]
            .file()
            .sync_all()
            .map_err(io_err(p, "fsync"))?;
        if let Ok(dir) = StdFile::open(p.parent().unwrap_or(Path::new("."))) {
            dir.sync_all()
                .map_err(io_err(p, "fsync of its directory"))?;
        }
        Ok(())
    }

    /// Undoes [`Disk::freeze_to`]: the layer moves back to `top`, writable
    /// and exclusively locked again. Only valid while nothing was stacked
    /// on the frozen layer.
    pub fn thaw(&mut self, top: &Path) -> Result<(), DiskError> {
        let frozen = self.layers[0].path.clone();
        fs::rename(&frozen, top).map_err(io_err(&frozen, "rename"))?;
        let meta = self.layers[0]
            .file()
            .metadata()
            .map_err(io_err(top, "stat"))?;
        let mode = meta.permissions().mode();
        fs::set_permissions(top, fs::Permissions::from_mode(mode | 0o200))
            .map_err(io_err(top, "chmod u+w"))?;
        try_flock(top, &self.layers[0].file(), true)?;
        self.layers[0].path = top.into();
        self.writable = true;
        Ok(())
    }

    /// The byte ranges (sorted, disjoint, not adjacent) where a read of this disk does not
    /// fall through to layer `layer` of [`Disk::chain`] (top = 0) at the same offset: every
    /// range some layer above it maps itself, as data, zeroes or compressed data, and every
    /// range a discard above it changed. Outside these ranges the disk reads exactly as
    /// `layer` does, so a copy of `layer` plus these ranges is the whole disk.
    ///
    /// Resolved with imago's per-layer mapping ([`FormatAccess::get_shallow_mapping`]) down
    /// the chain, whole runs of clusters at a time (up to one L2 table each), so nothing but
    /// metadata is read. Anything this cannot prove to fall through (a mapping kind imago
    /// adds later, a backing offset that moved) counts as changed: a range wrongly left out
    /// would lose data, one wrongly included only costs a read.
    pub fn changed_above(&self, layer: usize) -> Result<Vec<Range<u64>>, DiskError> {
        if layer >= self.layers.len() {
            return Err(DiskError::NoSuchLayer {
                path: self.path().into(),
                layer,
                depth: self.layers.len(),
            });
        }
        let mut out: Vec<Range<u64>> = Vec::new();
        let mut offset = 0u64;
        while offset < self.size {
            let (changed, len) = self.resolve_above(layer, offset, self.size - offset)?;
            let end = offset + len;
            if changed {
                match out.last_mut() {
                    Some(r) if r.end == offset => r.end = end,
                    _ => out.push(offset..end),
                }
            }
            offset = end;
        }
        Ok(out)
    }

    /// Whether the run at `offset` (at most `max` bytes) differs from layer `layer`, and
    /// its length (> 0).
    fn resolve_above(&self, layer: usize, offset: u64, max: u64) -> Result<(bool, u64), DiskError> {
        let mut fa = &self.top;
        let mut max = max;
        for l in &self.layers[..layer] {
            let (m, len) = fa
                .get_shallow_mapping(offset, max)
                .map_err(imago_err(&l.path, "map"))?;
            if len == 0 {
                // EOF inside the disk size: not a fall-through, so changed.
                return Ok((true, max));
            }
            match m {
                ShallowMapping::Indirect {
                    layer, offset: o, ..
                } if o == offset => {
                    fa = layer;
                    max = len;
                }
                _ => return Ok((true, len)),
            }
        }
        Ok((false, max))
    }

    /// Layers in the chain, top included.
    pub fn depth(&self) -> usize {
        self.layers.len()
    }

    /// Paths of the chain's layers, top first.
    pub fn layer_paths(&self) -> Vec<PathBuf> {
        self.layers.iter().map(|l| l.path.clone()).collect()
    }

    /// The chain, top layer first, with current on-host sizes.
    pub fn chain(&self) -> Vec<LayerInfo> {
        self.layers
            .iter()
            .map(|l| LayerInfo {
                path: l.path.clone(),
                format: l.format,
                virtual_size: l.virtual_size,
                allocated_bytes: l.allocated_bytes(),
            })
            .collect()
    }
}

/// The chain of an image without opening it for I/O or locking it, so a
/// running vm's layers can be shown (for `tine disk layers`).
pub fn chain(path: &Path) -> Result<Vec<LayerInfo>, DiskError> {
    Ok(walk_chain(path, false, false)?
        .iter()
        .map(|l| LayerInfo {
            path: l.path.clone(),
            format: l.format,
            virtual_size: l.virtual_size,
            allocated_bytes: l.allocated_bytes(),
        })
        .collect())
}

/// Walks the chain from `path` down, read-only, checking every layer
/// (existence, cycles, depth, sizes, formats, write permission of the top
/// when `writable`). With `lock`, each layer gets its advisory lock
/// (exclusive on a writable top, shared below), held by the returned files.
fn walk_chain(path: &Path, writable: bool, lock: bool) -> Result<Vec<Layer>, DiskError> {
    let mut layers: Vec<Layer> = Vec::new();
    let mut seen: HashSet<FileId> = HashSet::new();
    let mut next: Option<(PathBuf, Option<Format>, Option<PathBuf>)> =
        Some((path.to_path_buf(), None, None));
    while let Some((lpath, lformat, referenced_by)) = next.take() {
        if layers.len() >= MAX_CHAIN_DEPTH {
            return Err(DiskError::TooDeep {
                path: path.into(),
                max: MAX_CHAIN_DEPTH,
            });
        }
        // The writable top of an open disk is opened read-write here: its
        // one fd serves the lock and, lent to imago, the I/O.
        let file = if layers.is_empty() && writable && lock {
            open_rw(&lpath)?
        } else {
            open_ro(&lpath, referenced_by.as_deref())?
        };
        let meta = file.metadata().map_err(io_err(&lpath, "stat"))?;
        if !meta.is_file() && !meta.file_type().is_block_device() {
            return Err(DiskError::Unsupported {
                path: lpath,
                what: "not a regular file or block device".into(),
            });
        }
        if !seen.insert(file_id(&meta)) {
            let mut chain: Vec<PathBuf> = layers.iter().map(|l| l.path.clone()).collect();
            chain.push(lpath.clone());
            return Err(DiskError::Cycle { path: lpath, chain });
        }
        let p = probe(&lpath, &file, lformat)?;
        if let Some(above) = layers.last() {
            if above.virtual_size != p.virtual_size {
                return Err(DiskError::SizeMismatch {
                    path: above.path.clone(),
                    size: above.virtual_size,
                    backing: lpath,
                    backing_size: p.virtual_size,
                });
            }
        }
        if let Some((name, fmt)) = &p.backing {
            let bformat = match fmt.as_deref() {
                None => None,
                Some("qcow2") => Some(Format::Qcow2),
                Some("raw") | Some("file") => Some(Format::Raw),
                Some(other) => {
                    return Err(DiskError::Unsupported {
                        path: lpath,
                        what: format!("backing format {other:?} (only qcow2 and raw)"),
                    })
                }
            };
            next = Some((resolve_backing(&lpath, name), bformat, Some(lpath.clone())));
        }
        let is_top = layers.is_empty();
        if is_top
            && writable
            && (meta.permissions().mode() & 0o222 == 0 || is_frozen(file_id(&meta), &lpath))
        {
            return Err(DiskError::ReadOnly { path: lpath });
        }
        if lock {
            try_flock(&lpath, &file, is_top && writable)?;
        }
        layers.push(Layer {
            path: lpath,
            format: p.format,
            virtual_size: p.virtual_size,
            fd: LayerFd::Own(file),
        });
    }
    Ok(layers)
}

/// Freeze `top` and branch it: `top` becomes read-only (mode bits cleared, and recorded in
/// this process so even root never opens it for writing again), and `n` new, empty qcow2
/// overlays backed by it are created in `dir`, named `<top stem>.<i>.qcow2`.
///
/// The caller must have drained guest I/O and flushed and dropped any writable [`Disk`] on
/// `top` first; a writer still holding it makes this fail with [`DiskError::Busy`] before
/// anything changes. Returns the overlay paths in order.
pub fn freeze(top: &Path, n: usize, dir: &Path) -> Result<Vec<PathBuf>, DiskError> {
    let file = open_ro(top, None)?;
    let meta = file.metadata().map_err(io_err(top, "stat"))?;
    // Shared lock: fails if a writer holds the exclusive one; kept until we are done.
    try_flock(top, &file, false)?;
    let p = probe(top, &file, None)?;
    let stem = top
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "layer".into());
    let paths: Vec<PathBuf> = (0..n)
        .map(|i| dir.join(format!("{stem}.{i}.qcow2")))
        .collect();
    for q in &paths {
        if q.symlink_metadata().is_ok() {
            return Err(DiskError::Exists { path: q.clone() });
        }
    }
    // Data of the top was flushed by the caller; make sure it is on stable storage before
    // anything depends on it.
    file.sync_all().map_err(io_err(top, "fsync"))?;
    let mode = meta.permissions().mode();
    if mode & 0o222 != 0 {
        fs::set_permissions(top, fs::Permissions::from_mode(mode & !0o222))
            .map_err(io_err(top, "chmod a-w"))?;
    }
    let backing = fs::canonicalize(top).map_err(io_err(top, "canonicalize"))?;
    if let Ok(mut s) = frozen().lock() {
        s.insert(file_id(&meta), backing.clone());
    }
    let mut made = Vec::with_capacity(n);
    for q in &paths {
        if let Err(e) = overlay::write_overlay(&backing, p.format, p.virtual_size, q) {
            for m in &made {
                let _ = fs::remove_file(m);
            }
            return Err(e);
        }
        made.push(q.clone());
    }
    // One directory fsync makes all new names durable.
    if let Ok(d) = StdFile::open(dir) {
        d.sync_all().map_err(io_err(dir, "fsync directory"))?;
    }
    Ok(made)
}
