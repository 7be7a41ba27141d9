//! Where chunks live: the [`Backend`] trait and the local-directory
//! backend. A backend stores opaque bytes (a chunk's stored form) under a
//! [`ChunkId`]; it knows nothing of hashes, layers or snapshots.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::chunk::ChunkId;

/// An error of a backend, naming the object or path it concerns.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{url}: {source}")]
    S3 {
        url: String,
        #[source]
        source: object_store::Error,
    },
    #[error("S3 backend: {0}")]
    S3Config(String),
}

/// A place that holds chunks. Implementations are shared between threads
/// (puts and gets run in parallel).
pub trait Backend: Send + Sync + std::fmt::Debug {
    /// Where it is, for messages: a directory or `s3://bucket/prefix`.
    fn describe(&self) -> String;

    /// Stores `data` under `id`: atomically (a reader sees all of it or
    /// nothing, never a torn object) and durably (once this returns Ok,
    /// the object survives a crash of this process or host). Putting an
    /// id that exists replaces it (same id, same bytes).
    fn put(&self, id: &ChunkId, data: &[u8]) -> Result<(), BackendError>;

    /// The stored bytes of `id`, or None if there is no such object.
    fn get(&self, id: &ChunkId) -> Result<Option<Vec<u8>>, BackendError>;

    /// Bytes `range` of object `id` (a large object, a working-set pack,
    /// is fetched as a few ranges in parallel), or None if there is no
    /// such object. A range past the end is an error or short, as the
    /// backend does it; callers check lengths.
    fn get_range(
        &self,
        id: &ChunkId,
        range: std::ops::Range<u64>,
    ) -> Result<Option<Vec<u8>>, BackendError> {
        Ok(self.get(id)?.map(|b| {
            let start = (range.start as usize).min(b.len());
            let end = (range.end as usize).clamp(start, b.len());
            b[start..end].to_vec()
        }))
    }

    /// Bytes `range` of object `id` handed to `sink` in pieces as they
    /// arrive (a consumer can start on the first bytes while the rest are
    /// in flight); `sink` returns false to stop early. Ok(false) if there
    /// is no such object. By default one [`Backend::get_range`].
    fn get_range_streamed(
        &self,
        id: &ChunkId,
        range: std::ops::Range<u64>,
        sink: &mut dyn FnMut(&[u8]) -> bool,
    ) -> Result<bool, BackendError> {
        match self.get_range(id, range)? {
            Some(b) => {
                sink(&b);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Whether an object `id` exists.
    fn exists(&self, id: &ChunkId) -> Result<bool, BackendError>;

    /// Removes `id`; removing an absent object is not an error.
    fn delete(&self, id: &ChunkId) -> Result<(), BackendError>;

    /// Every object's id (order unspecified).
    fn list(&self) -> Result<Vec<ChunkId>, BackendError>;

    /// Removes leftovers of interrupted puts (temporary files) whose
    /// writer is gone or that are older than `older_than`; returns how
    /// many. Backends whose puts are atomic by themselves (S3) have none.
    fn clean_leftovers(&self, _older_than: Duration) -> Result<u64, BackendError> {
        Ok(0)
    }
}

/// Chunks as files in a directory: `ROOT/ab/cdef…` (the first two hex
/// digits name a subdirectory, so no directory grows past 1/256 of the
/// store).
///
/// A put writes `ROOT/ab/.cdef….tmp.PID.N`, fsyncs it, renames it into
/// place and fsyncs the directory, so a crash at any point leaves either
/// the whole object or no object (plus perhaps a temporary file that
/// [`Backend::clean_leftovers`] removes once PID is gone). As a cache in
/// front of a remote backend ([`LocalBackend::cache`]) the fsyncs are
/// skipped: a torn cache file fails its hash check on read and is fetched
/// again.
#[derive(Debug)]
pub struct LocalBackend {
    root: PathBuf,
    durable: bool,
    seq: AtomicU64,
}

impl LocalBackend {
    /// A durable chunk directory at `root` (created if missing).
    pub fn new(root: &Path) -> Result<LocalBackend, BackendError> {
        fs::create_dir_all(root).map_err(io_err(root))?;
        Ok(LocalBackend {
            root: root.into(),
            durable: true,
            seq: AtomicU64::new(0),
        })
    }

    /// A cache directory at `root`: atomic puts, no fsync.
    pub fn cache(root: &Path) -> Result<LocalBackend, BackendError> {
        let mut b = LocalBackend::new(root)?;
        b.durable = false;
        Ok(b)
    }

    /// The directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The file of `id`.
    pub fn path_of(&self, id: &ChunkId) -> PathBuf {
        let hex = id.to_hex();
        self.root.join(&hex[..2]).join(&hex[2..])
    }

    /// Total bytes of the chunk files (for cache sizes).
    pub fn disk_bytes(&self) -> Result<u64, BackendError> {
        let mut total = 0;
        self.walk(|_, meta| total += meta.len())?;
        Ok(total)
    }

    /// Removes chunk files, least recently used first (by mtime: a
    /// cache hit touches it), until at most `max_bytes` remain; returns
    /// (files, bytes) removed. For a cache: the backend still has them.
    pub fn trim(&self, max_bytes: u64) -> Result<(u64, u64), BackendError> {
        let mut files: Vec<(SystemTime, u64, PathBuf)> = Vec::new();
        let mut total = 0;
        self.walk(|path, meta| {
            let is_chunk = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| !n.starts_with('.'));
            if is_chunk && meta.is_file() {
                total += meta.len();
                let t = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                files.push((t, meta.len(), path.to_path_buf()));
            }
        })?;
        files.sort();
        let (mut n, mut bytes) = (0, 0);
        for (_, len, path) in files {
            if total <= max_bytes {
                break;
            }
            match fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(&path)(e)),
            }
            total -= len;
            n += 1;
            bytes += len;
        }
        Ok((n, bytes))
    }

    /// Marks `id` as just used (for [`LocalBackend::trim`]); best effort.
    pub fn touch(&self, id: &ChunkId) {
        if let Ok(f) = File::options().write(true).open(self.path_of(id)) {
            let _ = f.set_modified(SystemTime::now());
        }
    }

    fn walk(&self, mut f: impl FnMut(&Path, &fs::Metadata)) -> Result<(), BackendError> {
        for dir in read_dir(&self.root)? {
            let dir = dir.map_err(io_err(&self.root))?;
            let name = dir.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.len() != 2 || !dir.path().is_dir() {
                continue;
            }
            let dpath = dir.path();
            for e in read_dir(&dpath)? {
                let e = e.map_err(io_err(&dpath))?;
                if let Ok(meta) = e.metadata() {
                    f(&e.path(), &meta);
                }
            }
        }
        Ok(())
    }
}

fn read_dir(p: &Path) -> Result<fs::ReadDir, BackendError> {
    fs::read_dir(p).map_err(io_err(p))
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> BackendError + '_ {
    move |source| BackendError::Io {
        path: path.into(),
        source,
    }
}

/// Fsyncs a directory (makes a rename in it durable).
fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

impl Backend for LocalBackend {
    fn describe(&self) -> String {
        self.root.display().to_string()
    }

    fn put(&self, id: &ChunkId, data: &[u8]) -> Result<(), BackendError> {
        let path = self.path_of(id);
        let dir = path.parent().unwrap_or(&self.root).to_path_buf();
        let hex = id.to_hex();
        let tmp = dir.join(format!(
            ".{}.tmp.{}.{}",
            &hex[2..],
            std::process::id(),
            self.seq.fetch_add(1, Ordering::Relaxed)
        ));
        let mut f = match File::create(&tmp) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                fs::create_dir_all(&dir).map_err(io_err(&dir))?;
                if self.durable {
                    sync_dir(&self.root).map_err(io_err(&self.root))?;
                }
                File::create(&tmp).map_err(io_err(&tmp))?
            }
            Err(e) => return Err(io_err(&tmp)(e)),
        };
        let written = f
            .write_all(data)
            .and_then(|()| if self.durable { f.sync_data() } else { Ok(()) });
        drop(f);
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            return Err(io_err(&tmp)(e));
        }
        crate::fault::point(crate::fault::Point::ChunkTemp);
        if let Err(e) = fs::rename(&tmp, &path) {
            let _ = fs::remove_file(&tmp);
            return Err(io_err(&path)(e));
        }
        if self.durable {
            sync_dir(&dir).map_err(io_err(&dir))?;
        }
        Ok(())
    }

    fn get(&self, id: &ChunkId) -> Result<Option<Vec<u8>>, BackendError> {
        let path = self.path_of(id);
        match fs::read(&path) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io_err(&path)(e)),
        }
    }

    fn get_range(
        &self,
        id: &ChunkId,
        range: std::ops::Range<u64>,
    ) -> Result<Option<Vec<u8>>, BackendError> {
        use std::os::unix::fs::FileExt;
        let path = self.path_of(id);
        let f = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err(&path)(e)),
        };
        let len = f.metadata().map_err(io_err(&path))?.len();
        let start = range.start.min(len);
        let end = range.end.clamp(start, len);
        let mut buf = vec![0u8; (end - start) as usize];
        f.read_exact_at(&mut buf, start).map_err(io_err(&path))?;
        Ok(Some(buf))
    }

    fn exists(&self, id: &ChunkId) -> Result<bool, BackendError> {
        let path = self.path_of(id);
        match fs::symlink_metadata(&path) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(io_err(&path)(e)),
        }
    }

    fn delete(&self, id: &ChunkId) -> Result<(), BackendError> {
        let path = self.path_of(id);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(&path)(e)),
        }
    }

    fn list(&self) -> Result<Vec<ChunkId>, BackendError> {
        let mut out = Vec::new();
        self.walk(|path, _| {
            let (Some(name), Some(dir)) = (
                path.file_name().and_then(|n| n.to_str()),
                path.parent()
                    .and_then(|d| d.file_name())
                    .and_then(|n| n.to_str()),
            ) else {
                return;
            };
            if let Ok(id) = format!("{dir}{name}").parse::<ChunkId>() {
                out.push(id);
            }
        })?;
        Ok(out)
    }

    fn clean_leftovers(&self, older_than: Duration) -> Result<u64, BackendError> {
        let now = SystemTime::now();
        let mut stale = Vec::new();
        self.walk(|path, meta| {
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                return;
            };
            let Some(rest) = name.strip_prefix('.') else {
                return;
            };
            let mut parts = rest.rsplitn(3, '.');
            let (_seq, pid, head) = (parts.next(), parts.next(), parts.next());
            if !head.is_some_and(|h| h.ends_with(".tmp")) {
                return;
            }
            let writer_gone = pid
                .and_then(|p| p.parse::<i32>().ok())
                .is_none_or(|p| !crate::lease::pid_alive(p));
            let old = meta
                .modified()
                .ok()
                .and_then(|m| now.duration_since(m).ok())
                .is_some_and(|age| age > older_than);
            if writer_gone || old {
                stale.push(path.to_path_buf());
            }
        })?;
        let mut n = 0;
        for p in stale {
            match fs::remove_file(&p) {
                Ok(()) => n += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(&p)(e)),
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn local_put_get_list_delete() {
        let dir = tempfile::tempdir().unwrap();
        let b = LocalBackend::new(dir.path()).unwrap();
        let a = ChunkId::of(b"a");
        let c = ChunkId::of(b"c");
        assert!(!b.exists(&a).unwrap());
        assert_eq!(b.get(&a).unwrap(), None);
        b.put(&a, b"stored a").unwrap();
        b.put(&c, b"stored c").unwrap();
        b.put(&c, b"stored c").unwrap();
        assert!(b.exists(&a).unwrap());
        assert_eq!(b.get(&a).unwrap().unwrap(), b"stored a");
        let mut l = b.list().unwrap();
        l.sort();
        let mut want = vec![a, c];
        want.sort();
        assert_eq!(l, want);
        assert!(b.path_of(&a).starts_with(dir.path()));
        b.delete(&a).unwrap();
        b.delete(&a).unwrap();
        assert_eq!(b.list().unwrap(), vec![c]);
    }

    #[test]
    fn leftovers_of_dead_writers_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let b = LocalBackend::new(dir.path()).unwrap();
        let a = ChunkId::of(b"a");
        b.put(&a, b"x").unwrap();
        let sub = b.path_of(&a).parent().unwrap().to_path_buf();
        // A dead writer's temp file (pid far above pid_max), and a live one's.
        let dead = sub.join(".0123.tmp.999999999.0");
        let live = sub.join(format!(".4567.tmp.{}.0", std::process::id()));
        fs::write(&dead, b"torn").unwrap();
        fs::write(&live, b"in flight").unwrap();
        assert_eq!(b.clean_leftovers(Duration::from_secs(3600)).unwrap(), 1);
        assert!(!dead.exists());
        assert!(live.exists());
        // Temp files are never listed as chunks.
        assert_eq!(b.list().unwrap(), vec![a]);
        assert_eq!(b.clean_leftovers(Duration::ZERO).unwrap(), 1);
        assert!(!live.exists());
    }
}
