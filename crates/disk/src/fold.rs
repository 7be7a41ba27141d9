//! Folding layers into the top: `top <- L1 <- ... <- Lk <- rest` becomes
//! `top <- rest`, while the top stays open and writable.
//!
//! QEMU's block-stream idea, done copy-on-read style: every range some
//! layer of L1..Lk maps (and the top does not) is read through the chain
//! and written into the top. A guest write only ever allocates in the top,
//! and a copy only fills what the top lacks, checked and written in one
//! step under whatever lock serialises the disk's I/O (the caller's: a
//! step takes `&Disk`, so the device thread that owns the disk does guest
//! I/O and steps in turn). Then the top is synced, its header switched to
//! `rest` in one write of its first sector, and the chain reopened under
//! the open top: L1..Lk's fds and locks are released and the caller may
//! delete the files.
//!
//! Crash safety: until the header switch the top still names L1 and
//! every range it copied reads the same either way; the switch is one
//! sector write after an fsync of everything copied, so a crash leaves
//! either the old chain or the new one, both reading the same disk.

use std::fs::File as StdFile;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use imago::file::File as ImagoFile;
use imago::{FormatAccess, ShallowMapping};

use crate::{
    be32, imago_err, io_err, open_chain, open_layer, read_full_at, walk_chain, Disk, DiskError,
    Format, Layer, LayerFd, QCOW2_MAGIC,
};

/// Bytes one [`Disk::fold_step`] copies at most by default: the guest's
/// I/O waits for at most this much copying at a time.
pub const FOLD_STEP: u64 = 1 << 20;

const EXT_BACKING_FORMAT: u32 = 0xE279_2ACA;

/// A fold in progress (see [`Disk::fold_start`]).
pub struct Fold {
    /// How many layers below the top are folded.
    k: usize,
    folded: Vec<PathBuf>,
    /// First layer of what stays below.
    rest: PathBuf,
    rest_format: Format,
    /// Where the next step starts.
    offset: u64,
    copied: u64,
    started: Instant,
    /// The rest of the chain, opened before the switch ([`Fold::open_rest`]).
    rest_chain: Option<(Vec<Layer>, FormatAccess<ImagoFile>)>,
}

/// What a finished fold did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FoldDone {
    /// The layers folded into the top (now unused by this disk).
    pub folded: Vec<PathBuf>,
    /// Bytes copied into the top.
    pub bytes_copied: u64,
    /// Layers in the chain now (top included).
    pub depth: usize,
    pub elapsed: Duration,
}

impl std::fmt::Debug for Fold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fold")
            .field("folded", &self.folded)
            .field("rest", &self.rest)
            .field("offset", &self.offset)
            .field("copied", &self.copied)
            .field("rest_open", &self.rest_chain.is_some())
            .finish()
    }
}

impl Fold {
    /// The layers being folded, top-most first.
    pub fn folded(&self) -> &[PathBuf] {
        &self.folded
    }

    /// Bytes copied so far.
    pub fn bytes_copied(&self) -> u64 {
        self.copied
    }

    /// Opens what stays below (read-only, shared locks), so the switch
    /// itself needs no new file: done without the disk, off its lock.
    pub fn open_rest(&mut self) -> Result<(), DiskError> {
        if self.rest_chain.is_none() {
            let mut layers = walk_chain(&self.rest, false, true)?;
            let fa = open_chain(&mut layers, false)?;
            self.rest_chain = Some((layers, fa));
        }
        Ok(())
    }
}

/// How one run at an offset resolves for the fold.
enum Run {
    /// The top maps it, or nothing of L1..Lk does: nothing to copy.
    Skip,
    /// Some layer of L1..Lk maps it as data.
    Copy,
    /// Some layer of L1..Lk maps it as zeroes.
    Zero,
}

impl Disk {
    /// Starts folding the `k` layers directly below the top into it. The
    /// disk must be writable and keep at least one layer below them.
    pub fn fold_start(&self, k: usize) -> Result<Fold, DiskError> {
        self.check_writable()?;
        if k == 0 || k + 1 >= self.layers.len() {
            return Err(DiskError::Unsupported {
                path: self.path().into(),
                what: format!(
                    "folding {k} layer(s) of a chain of {}: at least one, and never the bottom layer",
                    self.layers.len()
                ),
            });
        }
        if self.layers[0].format != Format::Qcow2 {
            return Err(DiskError::Unsupported {
                path: self.path().into(),
                what: "folding into a top that is not qcow2".into(),
            });
        }
        let below = &self.layers[k + 1];
        let rest =
            std::fs::canonicalize(&below.path).map_err(io_err(&below.path, "canonicalize"))?;
        Ok(Fold {
            k,
            folded: self.layers[1..=k].iter().map(|l| l.path.clone()).collect(),
            rest,
            rest_format: below.format,
            offset: 0,
            copied: 0,
            started: Instant::now(),
            rest_chain: None,
        })
    }

    /// Copies the next run (at most `max_bytes`) that L1..Lk map and the
    /// top does not. Returns whether anything is left. The caller holds
    /// the disk's I/O lock for the step.
    pub fn fold_step(&self, fold: &mut Fold, max_bytes: u64) -> Result<bool, DiskError> {
        let max_bytes = max_bytes.max(1 << 16);
        while fold.offset < self.size {
            let max = (self.size - fold.offset).min(max_bytes);
            let (run, len) = self.fold_run(fold.k, fold.offset, max)?;
            let at = fold.offset;
            fold.offset += len;
            let p = &self.layers[0].path;
            match run {
                Run::Skip => continue,
                Run::Zero => {
                    self.top
                        .write_zeroes(at, len)
                        .map_err(imago_err(p, "fold: write zeroes"))?;
                }
                Run::Copy => {
                    let mut buf = vec![0u8; len as usize];
                    self.top
                        .read(&mut buf[..], at)
                        .map_err(imago_err(p, "fold: read"))?;
                    self.top
                        .write(&buf[..], at)
                        .map_err(imago_err(p, "fold: write"))?;
                }
            }
            fold.copied += len;
            return Ok(fold.offset < self.size);
        }
        Ok(false)
    }

    /// Resolves the run at `offset`: the top's own mapping, then L1..Lk's.
    fn fold_run(&self, k: usize, offset: u64, max: u64) -> Result<(Run, u64), DiskError> {
        let mut fa = &self.top;
        let mut max = max;
        for (i, l) in self.layers[..=k].iter().enumerate() {
            let (m, len) = fa
                .get_shallow_mapping(offset, max)
                .map_err(imago_err(&l.path, "map"))?;
            if len == 0 {
                // EOF inside the disk size: what reads there is zeroes.
                return Ok((if i == 0 { Run::Skip } else { Run::Zero }, max));
            }
            match m {
                ShallowMapping::Indirect {
                    layer, offset: o, ..
                } if o == offset => {
                    fa = layer;
                    max = len;
                }
                // The top has it: a guest write, or an earlier step.
                _ if i == 0 => return Ok((Run::Skip, len)),
                ShallowMapping::Zero { .. } => return Ok((Run::Zero, len)),
                // Data, or anything this cannot prove reads through.
                _ => return Ok((Run::Copy, len)),
            }
        }
        Ok((Run::Skip, max))
    }

    /// Ends a fold whose steps are done: syncs the top, switches its
    /// header to the rest of the chain and reopens it there. On error the
    /// disk is as before the call (its old chain open, the header as it
    /// was) and the fold may be retried.
    pub fn fold_finish(&mut self, mut fold: Fold) -> Result<FoldDone, DiskError> {
        // A guest write since the last step only allocated in the top, but
        // nothing may be left that only L1..Lk hold.
        while self.fold_step(&mut fold, FOLD_STEP)? {}
        fold.open_rest()?;
        let top_path = self.layers[0].path.clone();
        let top_file = self.layers[0].file();
        // The new driver's own fd: the same open file, so the same lock.
        let dup = top_file.try_clone().map_err(io_err(&top_path, "dup"))?;
        self.flush()?;
        let old = read_header(&top_path, &top_file)?;
        let new = switched_header(&top_path, &old, &fold.rest, fold.rest_format)?;
        write_header(&top_path, &top_file, &new)?;
        let Some((rest_layers, rest_fa)) = fold.rest_chain.take() else {
            return Err(DiskError::Corrupt {
                path: top_path,
                detail: "fold: the rest of the chain is not open".into(),
            });
        };
        let dup_fd = std::os::fd::AsRawFd::as_raw_fd(&dup);
        match open_layer(&top_path, dup, Format::Qcow2, true, Some(rest_fa)) {
            Ok(fa) => {
                let old_top = std::mem::replace(&mut self.top, fa);
                let mut top = self.layers.remove(0);
                top.fd = LayerFd::Lent(dup_fd);
                let old_layers = std::mem::take(&mut self.layers);
                self.layers.push(top);
                self.layers.extend(rest_layers);
                // Closes the old driver's fds (the old top's, L1..Lk's and the
                // old rest's): their locks go with them.
                drop(old_top);
                drop(old_layers);
                Ok(FoldDone {
                    folded: fold.folded,
                    bytes_copied: fold.copied,
                    depth: self.layers.len(),
                    elapsed: fold.started.elapsed(),
                })
            }
            Err(e) => {
                // The old driver still reads the old chain: name it again.
                let _ = write_header(&top_path, &top_file, &old);
                Err(e)
            }
        }
    }

    /// Folds the `k` layers below the top in one go (no other I/O on the
    /// disk meanwhile: it is borrowed mutably).
    pub fn fold(&mut self, k: usize) -> Result<FoldDone, DiskError> {
        let mut f = self.fold_start(k)?;
        while self.fold_step(&mut f, FOLD_STEP)? {}
        self.fold_finish(f)
    }
}

/// The header cluster's head: the fixed header, its extensions and the
/// backing name (at most 4 KiB, all a top this crate writes needs).
fn read_header(p: &Path, f: &StdFile) -> Result<Vec<u8>, DiskError> {
    let mut h = vec![0u8; 4096];
    let n = read_full_at(f, &mut h, 0).map_err(io_err(p, "read header"))?;
    h.truncate(n);
    // The rewritten head stays inside cluster 0 (the header's own).
    if n < 104 || h[0..4] != QCOW2_MAGIC || be32(&h, 4) != 3 || be32(&h, 20) < 12 {
        return Err(DiskError::Unsupported {
            path: p.into(),
            what: "folding into a top that is not a qcow2 v3 image of 4 KiB clusters or more"
                .into(),
        });
    }
    Ok(h)
}

/// `old` with its backing file set to `rest` (format `format`): the
/// fixed header, every extension but the backing format, the new backing
/// format, the end marker, the name.
fn switched_header(
    p: &Path,
    old: &[u8],
    rest: &Path,
    format: Format,
) -> Result<Vec<u8>, DiskError> {
    let corrupt = |detail: &str| DiskError::Corrupt {
        path: p.into(),
        detail: format!("fold: {detail}"),
    };
    let header_len = be32(old, 100) as usize;
    if header_len < 104 || header_len > old.len() {
        return Err(corrupt("header length"));
    }
    let mut out = old[..header_len].to_vec();
    let mut at = header_len;
    loop {
        if at + 8 > old.len() {
            return Err(corrupt("header extensions run past 4 KiB"));
        }
        let (ty, len) = (be32(old, at), be32(old, at + 4) as usize);
        if ty == 0 {
            break;
        }
        let end = at + 8 + len.div_ceil(8) * 8;
        if end > old.len() {
            return Err(corrupt("header extension runs past 4 KiB"));
        }
        if ty != EXT_BACKING_FORMAT {
            out.extend_from_slice(&old[at..end]);
        }
        at = end;
    }
    let fmt = format.as_str().as_bytes();
    out.extend_from_slice(&EXT_BACKING_FORMAT.to_be_bytes());
    out.extend_from_slice(&(fmt.len() as u32).to_be_bytes());
    out.extend_from_slice(fmt);
    out.resize(out.len().div_ceil(8) * 8, 0);
    out.extend_from_slice(&[0u8; 8]);
    let name = rest.to_str().ok_or_else(|| DiskError::Unsupported {
        path: rest.into(),
        what: "backing path is not UTF-8".into(),
    })?;
    let name_off = out.len() as u64;
    out.extend_from_slice(name.as_bytes());
    if name.len() > 1023 || out.len() > 4096 {
        return Err(DiskError::Unsupported {
            path: rest.into(),
            what: "backing path too long for the header".into(),
        });
    }
    out[8..16].copy_from_slice(&name_off.to_be_bytes());
    out[16..20].copy_from_slice(&(name.len() as u32).to_be_bytes());
    Ok(out)
}

/// One write of the header's head, then fsync: under 512 bytes (a top
/// whose backing path is short enough) it is one sector, written whole or
/// not at all.
fn write_header(p: &Path, f: &StdFile, h: &[u8]) -> Result<(), DiskError> {
    f.write_all_at(h, 0).map_err(io_err(p, "write header"))?;
    f.sync_all().map_err(io_err(p, "fsync header"))
}
