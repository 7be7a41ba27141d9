//! The store: chunks in a backend, the tree in a [`Meta`] database, and
//! the operations the CLI and VMM call (write a snapshot, read a layer,
//! branches, tree, gc, verify).

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;

use crate::backend::{Backend, BackendError, LocalBackend};
use crate::chunk::ChunkId;
use crate::chunks::{ChunkCounters, ChunkError, Chunks};
use crate::fault::{self, Point};
use crate::lease;
use crate::meta::{
    BranchId, BranchRow, BranchState, LayerKind, LayerRow, Lease, Meta, MetaError, Sizes,
    SnapshotId, SnapshotRow, SnapshotState, SqliteMeta, Totals,
};
use crate::meta_pg::PgMeta;
use crate::pack;
use crate::progress::Progress;
use crate::s3::{S3Backend, S3Config};

/// The window (chunk) size of new layers, chosen by measurement
/// (docs/design/store.md): dedup of sibling memory vs put/get throughput
/// vs metadata rows.
pub const DEFAULT_WINDOW_SIZE: u64 = 256 << 10;

/// zstd level of stored chunks (docs/design/store.md).
pub const DEFAULT_ZSTD_LEVEL: i32 = 1;

/// The largest window a store accepts.
pub const MAX_WINDOW_SIZE: u64 = 64 << 20;

/// Where chunks go.
#[derive(Clone, Debug)]
pub enum BackendConfig {
    /// `DIR/chunks/ab/cdef…`.
    Local,
    /// An S3 bucket, with a local cache at `DIR/cache`.
    S3(S3Config),
    /// Any backend; `remote` puts a cache at `DIR/cache` in front of it.
    Custom {
        backend: Arc<dyn Backend>,
        remote: bool,
    },
}

/// Where the tree's metadata goes.
#[derive(Clone, PartialEq, Eq)]
pub enum MetaConfig {
    /// `DIR/tree.db`: one host's processes.
    Sqlite,
    /// A PostgreSQL database shared by a fleet
    /// (`postgres://user[:password]@host[:port]/db`, no TLS).
    Postgres(String),
}

impl std::fmt::Debug for MetaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MetaConfig::Sqlite => f.write_str("Sqlite"),
            // Never the password.
            MetaConfig::Postgres(url) => write!(f, "Postgres({})", crate::meta_pg::redact(url)),
        }
    }
}

/// The environment variable that selects the metadata database: unset,
/// empty or `sqlite` (`$TINE_HOME/store/tree.db`), or `postgres://…`.
pub const META_ENV: &str = "TINE_META";

impl MetaConfig {
    /// The value of [`META_ENV`].
    pub fn parse(v: &str) -> Result<MetaConfig, StoreError> {
        if v.is_empty() || v == "sqlite" {
            return Ok(MetaConfig::Sqlite);
        }
        if v.starts_with("postgres://") || v.starts_with("postgresql://") {
            return Ok(MetaConfig::Postgres(v.to_owned()));
        }
        // Only the scheme: the rest may hold a password.
        let scheme = v.split_once("://").map_or("(none)", |(s, _)| s);
        Err(StoreError::Invalid(format!(
            "{META_ENV} has an unknown scheme {scheme:?}: use sqlite (the default, \
             $TINE_HOME/store/tree.db) or postgres://user@host:port/db"
        )))
    }
}

/// How to open a store.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// `$TINE_HOME/store`: `tree.db`, and `chunks/` or `cache/`.
    pub dir: PathBuf,
    pub backend: BackendConfig,
    /// The tree's database (`TINE_META`).
    pub meta: MetaConfig,
    /// Window size of new layers (a diff layer keeps its parent's).
    pub window_size: u64,
    pub zstd_level: i32,
    /// Worker threads for puts, restores, verify (0: one per CPU, at
    /// least 4, or 8 for a remote backend).
    pub threads: usize,
    /// How long a writer's or gc's lease lasts without renewal. A writer
    /// renews it with every batch of chunks.
    pub lease_ttl: Duration,
}

/// The environment variable that selects the backend: unset or `local`,
/// or `s3://bucket[/prefix]` (endpoint and keys from `AWS_*`).
pub const BACKEND_ENV: &str = "TINE_STORE";

impl StoreConfig {
    /// A local store in `dir`, default settings.
    pub fn local(dir: &Path) -> StoreConfig {
        StoreConfig {
            dir: dir.into(),
            backend: BackendConfig::Local,
            meta: MetaConfig::Sqlite,
            window_size: DEFAULT_WINDOW_SIZE,
            zstd_level: DEFAULT_ZSTD_LEVEL,
            threads: 0,
            lease_ttl: Duration::from_secs(600),
        }
    }

    /// The store of `tine_home` (`$TINE_HOME/store`), backend from
    /// `TINE_STORE`, metadata from `TINE_META`.
    pub fn from_env(tine_home: &Path) -> Result<StoreConfig, StoreError> {
        let mut cfg = StoreConfig::local(&tine_home.join("store"));
        match std::env::var(BACKEND_ENV) {
            Ok(v) if !v.is_empty() && v != "local" => {
                cfg.backend = BackendConfig::S3(S3Config::from_url(&v)?);
            }
            _ => {}
        }
        match std::env::var(META_ENV) {
            Ok(v) => cfg.meta = MetaConfig::parse(&v)?,
            Err(std::env::VarError::NotPresent) => {}
            Err(std::env::VarError::NotUnicode(_)) => {
                return Err(StoreError::Invalid(format!("{META_ENV} is not UTF-8")))
            }
        }
        Ok(cfg)
    }
}

/// An error of the store. Chunk errors name the chunk and, where the
/// caller reads a layer, the snapshot, layer and window.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Meta(#[from] MetaError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("{context}: {source}")]
    Chunk {
        context: String,
        #[source]
        source: Box<ChunkError>,
    },
    #[error("snapshot {snapshot} has no {kind} layer")]
    NoLayer {
        snapshot: SnapshotId,
        kind: LayerKind,
    },
    #[error("reading the {kind} layer's source at byte {offset}: {source}")]
    Source {
        kind: LayerKind,
        offset: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("the {kind} layer's source changed while it was being stored (window {window})")]
    SourceChanged { kind: LayerKind, window: u64 },
    #[error("{context}: writing: {source}")]
    Sink {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error("compressing a chunk: {0}")]
    Compress(#[source] std::io::Error),
    #[error("{bucket} belongs to another tree's metadata ({owner}), not this one's ({ours}): writing or collecting garbage here would delete the other tree's chunks or lose ours. Hosts that share a bucket must share metadata (TINE_META=postgres://... on each); otherwise give this one its own prefix (TINE_STORE=s3://bucket/another-prefix)")]
    ForeignBucket {
        bucket: String,
        owner: String,
        ours: String,
    },
    #[error("gave up waiting for a gc to finish deleting chunk {0}")]
    GcBusy(ChunkId),
    #[error("{0}")]
    Invalid(String),
    #[error("snapshot {snapshot}: working-set pack {pack}: {problem}")]
    Pack {
        snapshot: SnapshotId,
        pack: ChunkId,
        problem: String,
    },
}

pub(crate) struct Inner {
    pub(crate) dir: PathBuf,
    pub(crate) meta: Box<dyn Meta>,
    pub(crate) chunks: Chunks,
    pub(crate) window_size: u64,
    pub(crate) threads: usize,
    pub(crate) lease_ttl: Duration,
    /// Whether a commit with a working set also stores a working-set pack
    /// (default: with a remote backend, where a wake fetches chunks one
    /// GET each; a local store reads them from disk anyway).
    pub(crate) packs: AtomicBool,
    /// Whether the backend is remote (shared: it carries a claim).
    pub(crate) remote: bool,
}

/// A snapshot tree store. Cheap to clone and share between threads; do
/// not carry one across fork(2) into a child that uses it (open it again:
/// SQLite connections must not cross fork(2); a PostgreSQL one is
/// replaced by a new connection in the child).
#[derive(Clone)]
pub struct Store {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Store({}, {})",
            self.inner.meta.describe(),
            self.inner.chunks.backend().describe()
        )
    }
}

/// `verify` reads a working-set pack whole in this many parallel ranged
/// reads (when it has at least [`PACK_RANGE_MIN`] bytes; a wake streams
/// it instead, see [`PACK_STREAMS`]). Measured (docs/design/
/// store.md, "working-set packs"): moto serves one 64 MiB GET in ~0.15 s
/// but slows with more ranges (4: ~0.4 s), s3s-fs gains up to 4 ranges
/// (0.38 s against 0.6-0.9 s for one); both beat 260 GETs (1.0 / 0.65 s).
pub const PACK_RANGES: u64 = 4;
/// Below this a pack is fetched with one GET.
pub const PACK_RANGE_MIN: u64 = 8 << 20;
/// A wake streams a pack in up to this many ranged reads, one per
/// [`PACK_STREAM_MIN`] bytes: each stream delivers its chunks in
/// working-set order, and the fewer streams, the sooner the first chunks
/// arrive (a single server shares its bandwidth among them; moto serves
/// one 64 MiB GET in 0.15 s, two ranges in 0.35 s).
pub const PACK_STREAMS: u64 = 4;
pub const PACK_STREAM_MIN: u64 = 32 << 20;

/// What [`Store::fetch_pack`] brought into the cache: the pack's chunks
/// (all of them are in the cache after it) and the pack's bytes, less
/// the ranges not read because their chunks were all cached already.
#[derive(Clone, Copy, Debug, Serialize, serde::Deserialize)]
pub struct PackFetch {
    pub chunks: u64,
    pub stored_bytes: u64,
}

/// A working-set pack `verify` found missing or corrupt.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct PackProblem {
    pub pack: ChunkId,
    /// Committed snapshots that name it.
    pub snapshots: Vec<SnapshotId>,
    pub problem: String,
}

/// A snapshot as readers see it.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct SnapshotInfo {
    pub id: SnapshotId,
    pub parent: Option<SnapshotId>,
    pub created_ms: i64,
    /// The caller's manifest (JSON text).
    pub manifest: String,
    /// Pages touched soon after the last wake (page numbers in the memory
    /// layer, 4 KiB pages), to prefetch on the next one.
    pub working_set: Vec<u64>,
    /// The working-set pack (object id, bytes), if one was stored.
    pub pack: Option<(ChunkId, u64)>,
    pub layers: Vec<LayerRow>,
}

/// What storing one layer did.
#[derive(Clone, Copy, Debug, Default, Serialize, serde::Deserialize)]
pub struct LayerStats {
    pub windows: u64,
    /// Windows read and hashed.
    pub examined: u64,
    /// Windows recorded in this layer (the rest come from the parent, or
    /// are zero in a first layer).
    pub recorded: u64,
    pub zero: u64,
    /// Examined windows identical to the parent's.
    pub unchanged: u64,
    /// Chunks put to the backend.
    pub chunks_put: u64,
    pub stored_bytes_put: u64,
    /// Recorded chunks the store already held (deduplicated).
    pub deduplicated: u64,
    pub logical_bytes: u64,
}

/// One snapshot of the tree with its sizes.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct TreeSnapshot {
    pub id: SnapshotId,
    pub parent: Option<SnapshotId>,
    pub created_ms: i64,
    pub manifest: serde_json::Value,
    pub layers: Vec<LayerRow>,
    pub sizes: Sizes,
}

/// The whole tree: committed snapshots (oldest first), branches, totals.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Tree {
    pub snapshots: Vec<TreeSnapshot>,
    pub branches: Vec<BranchRow>,
    pub totals: Totals,
    pub metadata_bytes: u64,
}

/// A chunk `verify` found missing or corrupt.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct ChunkProblem {
    pub chunk: ChunkId,
    /// Committed snapshots that reference it.
    pub snapshots: Vec<SnapshotId>,
    pub problem: String,
}

/// What `verify` found.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct VerifyReport {
    pub chunks_checked: u64,
    pub stored_bytes_checked: u64,
    pub missing: Vec<ChunkProblem>,
    pub corrupt: Vec<ChunkProblem>,
    /// Committed snapshots referencing a chunk not marked durable (never
    /// expected).
    pub not_durable: Vec<ChunkProblem>,
    /// Working-set packs of committed snapshots checked.
    pub packs_checked: u64,
    /// Packs missing or corrupt (a wake would fall back to fetching their
    /// chunks one by one; still reported, naming the snapshots).
    pub bad_packs: Vec<PackProblem>,
    /// Backend objects no row knows (leftovers for gc; not a problem).
    pub orphans: u64,
    /// Snapshots still pending (being written, or leftovers for gc).
    pub pending: u64,
}

impl VerifyReport {
    /// No missing, corrupt or non-durable chunk.
    pub fn is_ok(&self) -> bool {
        self.missing.is_empty()
            && self.corrupt.is_empty()
            && self.not_durable.is_empty()
            && self.bad_packs.is_empty()
    }
}

impl std::fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} chunks checked ({} stored bytes): {} missing, {} corrupt, {} not durable; {} orphan objects, {} pending snapshots; {} working-set packs checked, {} bad",
            self.chunks_checked,
            self.stored_bytes_checked,
            self.missing.len(),
            self.corrupt.len(),
            self.not_durable.len(),
            self.orphans,
            self.pending,
            self.packs_checked,
            self.bad_packs.len()
        )?;
        for p in self
            .missing
            .iter()
            .chain(&self.corrupt)
            .chain(&self.not_durable)
        {
            let users: Vec<String> = p.snapshots.iter().map(|s| s.to_string()).collect();
            writeln!(
                f,
                "  chunk {} (snapshots {}): {}",
                p.chunk,
                if users.is_empty() {
                    "none".into()
                } else {
                    users.join(", ")
                },
                p.problem
            )?;
        }
        for p in &self.bad_packs {
            let users: Vec<String> = p.snapshots.iter().map(|s| s.to_string()).collect();
            writeln!(
                f,
                "  working-set pack {} (snapshots {}): {}",
                p.pack,
                users.join(", "),
                p.problem
            )?;
        }
        Ok(())
    }
}

/// What gc may remove besides unreferenced chunks.
#[derive(Clone, Debug)]
pub struct GcOptions {
    /// Also remove committed snapshots with no child and no running or
    /// sleeping branch (repeatedly, up the tree).
    pub prune_snapshots: bool,
    /// Temporary files of interrupted puts are removed when their writer
    /// is gone, or when older than this.
    pub leftover_age: Duration,
}

impl Default for GcOptions {
    fn default() -> GcOptions {
        GcOptions {
            prune_snapshots: false,
            leftover_age: Duration::from_secs(3600),
        }
    }
}

/// What gc did.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct GcReport {
    /// Pending snapshots whose writer was gone.
    pub pending_reaped: Vec<SnapshotId>,
    pub snapshots_pruned: Vec<SnapshotId>,
    pub chunks_deleted: u64,
    pub stored_bytes_freed: u64,
    /// Temporary files of interrupted puts.
    pub leftovers_removed: u64,
}

/// Runs `f` on every item with `threads` threads; the first error stops
/// the rest and is returned.
pub(crate) fn parallel<T: Sync>(
    threads: usize,
    items: &[T],
    f: impl Fn(&T) -> Result<(), StoreError> + Sync,
) -> Result<(), StoreError> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first: Mutex<Option<StoreError>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, items.len().max(1)) {
            s.spawn(|| loop {
                if failed.load(Ordering::Relaxed) {
                    return;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { return };
                if let Err(e) = f(item) {
                    failed.store(true, Ordering::Relaxed);
                    let mut g = first.lock().unwrap_or_else(|e| e.into_inner());
                    if g.is_none() {
                        *g = Some(e);
                    }
                    return;
                }
            });
        }
    });
    match first.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

impl Store {
    /// Opens (creating it if needed) the store `cfg` describes.
    pub fn open(cfg: StoreConfig) -> Result<Store, StoreError> {
        if cfg.window_size == 0
            || cfg.window_size > MAX_WINDOW_SIZE
            || !cfg.window_size.is_power_of_two()
            || cfg.window_size < 4096
        {
            return Err(StoreError::Invalid(format!(
                "window size {} is not a power of two from 4 KiB to {} MiB",
                cfg.window_size,
                MAX_WINDOW_SIZE >> 20
            )));
        }
        std::fs::create_dir_all(&cfg.dir).map_err(|source| BackendError::Io {
            path: cfg.dir.clone(),
            source,
        })?;
        let meta: Box<dyn Meta> = match &cfg.meta {
            MetaConfig::Sqlite => Box::new(SqliteMeta::open(&cfg.dir.join("tree.db"))?),
            MetaConfig::Postgres(url) => Box::new(PgMeta::open(url)?),
        };
        let (backend, remote): (Arc<dyn Backend>, bool) = match &cfg.backend {
            BackendConfig::Local => (Arc::new(LocalBackend::new(&cfg.dir.join("chunks"))?), false),
            BackendConfig::S3(s3) => (Arc::new(S3Backend::new(s3.clone())?), true),
            BackendConfig::Custom { backend, remote } => (backend.clone(), *remote),
        };
        let cache = if remote {
            Some(LocalBackend::cache(&cfg.dir.join("cache"))?)
        } else {
            None
        };
        let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
        let threads = match cfg.threads {
            0 if remote => cpus.max(8),
            // Local puts wait on fsync as much as they compute: more
            // threads than CPUs overlap the waits (measured, store.md).
            0 => cpus.max(4),
            n => n,
        };
        Ok(Store {
            inner: Arc::new(Inner {
                dir: cfg.dir,
                meta,
                chunks: Chunks::new(backend, cache, cfg.zstd_level),
                window_size: cfg.window_size,
                threads,
                lease_ttl: cfg.lease_ttl,
                packs: AtomicBool::new(remote),
                remote,
            }),
        })
    }

    /// The store of `tine_home` as `TINE_STORE` selects.
    pub fn open_home(tine_home: &Path) -> Result<Store, StoreError> {
        Store::open(StoreConfig::from_env(tine_home)?)
    }

    /// Checks (and on first use makes) the remote backend's claim for
    /// this metadata (see [`crate::claim`]); a local backend is this
    /// store's own.
    pub fn claim(&self) -> Result<(), StoreError> {
        if !self.inner.remote {
            return Ok(());
        }
        crate::claim::ensure(
            self.inner.chunks.backend().as_ref(),
            self.inner.meta.as_ref(),
        )
    }

    /// The store's directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// The metadata database (for what this API does not wrap).
    pub fn meta(&self) -> &dyn Meta {
        self.inner.meta.as_ref()
    }

    /// The chunk layer (backend, cache, counters).
    pub fn chunks(&self) -> &Chunks {
        &self.inner.chunks
    }

    /// Chunk traffic since open (cache hits, backend reads, puts).
    pub fn counters(&self) -> ChunkCounters {
        self.inner.chunks.counters()
    }

    /// Shrinks the local chunk cache (remote backends only) to at most
    /// `max_bytes`, least recently used first; returns (files, bytes)
    /// removed. Without a cache: (0, 0).
    pub fn trim_cache(&self, max_bytes: u64) -> Result<(u64, u64), StoreError> {
        match self.inner.chunks.cache() {
            Some(c) => Ok(c.trim(max_bytes)?),
            None => Ok((0, 0)),
        }
    }

    /// Bytes the local chunk cache holds (0 without one).
    pub fn cache_bytes(&self) -> Result<u64, StoreError> {
        match self.inner.chunks.cache() {
            Some(c) => Ok(c.disk_bytes()?),
            None => Ok(0),
        }
    }

    pub(crate) fn threads(&self) -> usize {
        self.inner.threads
    }

    pub(crate) fn lease(&self) -> Lease {
        Lease {
            owner: lease::owner(),
            expires_ms: self.lease_expiry(),
        }
    }

    pub(crate) fn lease_expiry(&self) -> i64 {
        lease::now_ms() + self.inner.lease_ttl.as_millis() as i64
    }

    // --- reading ---

    /// A committed snapshot.
    pub fn snapshot(&self, id: SnapshotId) -> Result<SnapshotInfo, StoreError> {
        let row = self.committed_row(id)?;
        self.info(row)
    }

    /// The row of committed snapshot `id` (a pending one is not there yet).
    fn committed_row(&self, id: SnapshotId) -> Result<SnapshotRow, StoreError> {
        Ok(self
            .inner
            .meta
            .snapshot(id)?
            .filter(|r| r.state == SnapshotState::Committed)
            .ok_or(MetaError::NoSnapshot(id))?)
    }

    fn info(&self, row: SnapshotRow) -> Result<SnapshotInfo, StoreError> {
        Ok(SnapshotInfo {
            layers: self.inner.meta.layers(row.id)?,
            id: row.id,
            parent: row.parent,
            created_ms: row.created_ms,
            manifest: row.manifest,
            working_set: row.working_set,
            pack: row.pack,
        })
    }

    /// Every committed snapshot, oldest first.
    pub fn snapshots(&self) -> Result<Vec<SnapshotInfo>, StoreError> {
        self.inner
            .meta
            .snapshots(SnapshotState::Committed)?
            .into_iter()
            .map(|r| self.info(r))
            .collect()
    }

    /// A blob a snapshot was written with (see [`SnapshotWriter::put_blob`]).
    pub fn blob(&self, id: SnapshotId, name: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.snapshot(id)?;
        Ok(self.inner.meta.blob(id, name)?)
    }

    /// A new branch starting from committed snapshot `snapshot`.
    pub fn create_branch(
        &self,
        name: &str,
        snapshot: SnapshotId,
        state: BranchState,
    ) -> Result<BranchId, StoreError> {
        Ok(self.inner.meta.create_branch(name, snapshot, state)?)
    }

    /// Sets a branch's state (and its snapshot, when given).
    pub fn set_branch(
        &self,
        id: BranchId,
        snapshot: Option<SnapshotId>,
        state: BranchState,
    ) -> Result<(), StoreError> {
        Ok(self.inner.meta.update_branch(id, snapshot, state)?)
    }

    /// The running or sleeping branch called `name`.
    pub fn branch(&self, name: &str) -> Result<Option<BranchRow>, StoreError> {
        Ok(self.inner.meta.branch(name)?)
    }

    /// Every branch, gone ones included.
    pub fn branches(&self) -> Result<Vec<BranchRow>, StoreError> {
        Ok(self.inner.meta.branches()?)
    }

    // --- the tree ---

    /// Committed snapshots with own/shared sizes, branches, totals.
    pub fn tree(&self) -> Result<Tree, StoreError> {
        let sizes: BTreeMap<SnapshotId, Sizes> = self.inner.meta.sizes()?.into_iter().collect();
        let snapshots = self
            .snapshots()?
            .into_iter()
            .map(|s| TreeSnapshot {
                id: s.id,
                parent: s.parent,
                created_ms: s.created_ms,
                manifest: serde_json::from_str(&s.manifest).unwrap_or(serde_json::Value::Null),
                layers: s.layers,
                sizes: sizes.get(&s.id).copied().unwrap_or_default(),
            })
            .collect();
        Ok(Tree {
            snapshots,
            branches: self.inner.meta.branches()?,
            totals: self.inner.meta.totals()?,
            metadata_bytes: self.inner.meta.metadata_bytes()?,
        })
    }

    /// Totals over committed snapshots.
    pub fn totals(&self) -> Result<Totals, StoreError> {
        Ok(self.inner.meta.totals()?)
    }

    // --- verify ---

    /// Checks every chunk the tree knows as stored: present in the
    /// backend, decompresses, hashes to its id. Reads the backend, never
    /// the cache.
    pub fn verify(&self, progress: &dyn Progress) -> Result<VerifyReport, StoreError> {
        let meta = &self.inner.meta;
        let rows: Vec<_> = meta.chunks()?.into_iter().filter(|r| !r.deleting).collect();
        let objects: HashSet<ChunkId> = self
            .inner
            .chunks
            .backend()
            .list()?
            .into_iter()
            .filter(|o| *o != crate::claim::CLAIM_ID)
            .collect();
        let mut known: HashSet<ChunkId> = rows.iter().map(|r| r.id).collect();
        // Working-set packs: named by snapshot rows, not chunk rows.
        let mut packs: BTreeMap<ChunkId, (u64, Vec<SnapshotId>)> = BTreeMap::new();
        for state in [SnapshotState::Pending, SnapshotState::Committed] {
            for s in meta.snapshots(state)? {
                if let Some((id, len)) = s.pack {
                    known.insert(id);
                    if state == SnapshotState::Committed {
                        packs.entry(id).or_insert((len, Vec::new())).1.push(s.id);
                    }
                }
            }
        }
        let mut report = VerifyReport {
            orphans: objects.iter().filter(|o| !known.contains(o)).count() as u64,
            pending: meta.snapshots(SnapshotState::Pending)?.len() as u64,
            ..VerifyReport::default()
        };
        for r in rows.iter().filter(|r| !r.stored) {
            let users = meta.chunk_users(&r.id)?;
            if !users.is_empty() {
                report.not_durable.push(ChunkProblem {
                    chunk: r.id,
                    snapshots: users,
                    problem: "referenced by a committed snapshot but never marked durable".into(),
                });
            }
        }
        let stored: Vec<_> = rows.into_iter().filter(|r| r.stored).collect();
        progress.start("verify", stored.iter().map(|r| r.stored_len).sum());
        let checked = AtomicU64::new(0);
        let bytes = AtomicU64::new(0);
        let bad: Mutex<Vec<(ChunkId, bool, String)>> = Mutex::new(Vec::new());
        let res = parallel(self.threads(), &stored, |r| {
            let limit = if r.raw_len > 0 {
                r.raw_len
            } else {
                MAX_WINDOW_SIZE
            } as usize;
            match self.inner.chunks.verify_backend(&r.id, limit) {
                Ok(n) => {
                    bytes.fetch_add(n, Ordering::Relaxed);
                }
                Err(e @ ChunkError::Missing { .. }) => {
                    bad.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((r.id, true, e.to_string()));
                }
                Err(e @ ChunkError::Corrupt { .. }) => {
                    bad.lock().unwrap_or_else(|e| e.into_inner()).push((
                        r.id,
                        false,
                        e.to_string(),
                    ));
                }
                Err(ChunkError::Backend(e)) => return Err(e.into()),
            }
            checked.fetch_add(1, Ordering::Relaxed);
            progress.advance(r.stored_len);
            Ok(())
        });
        progress.finish();
        res?;
        for (id, (len, snapshots)) in packs {
            // A pack is its one snapshot's (the id is in its header).
            let owner = snapshots.first().map_or(0, |s| s.0 as u64);
            let problem = match self.get_pack(&id, len) {
                Ok(b) => pack::verified(&b, owner, MAX_WINDOW_SIZE)
                    .err()
                    .map(|e| e.to_string()),
                Err(e) => Some(e),
            };
            report.packs_checked += 1;
            if let Some(problem) = problem {
                report.bad_packs.push(PackProblem {
                    pack: id,
                    snapshots,
                    problem,
                });
            }
        }
        report.chunks_checked = checked.into_inner();
        report.stored_bytes_checked = bytes.into_inner();
        for (id, missing, problem) in bad.into_inner().unwrap_or_else(|e| e.into_inner()) {
            let p = ChunkProblem {
                chunk: id,
                snapshots: meta.chunk_users(&id)?,
                problem,
            };
            if missing {
                report.missing.push(p);
            } else {
                report.corrupt.push(p);
            }
        }
        Ok(report)
    }

    // --- working-set packs ---

    /// Whether commits with a working set store a working-set pack
    /// (default: only with a remote backend).
    pub fn set_packs(&self, on: bool) {
        self.inner.packs.store(on, Ordering::Relaxed);
    }

    /// The whole pack object `pack` of `len` bytes from the backend (never
    /// the cache), fetched as up to [`PACK_RANGES`] ranged reads in
    /// parallel when it is large.
    fn get_pack(&self, pack: &ChunkId, len: u64) -> Result<Vec<u8>, String> {
        let backend = self.inner.chunks.backend();
        let n = if len >= PACK_RANGE_MIN {
            PACK_RANGES
        } else {
            1
        };
        let step = len.div_ceil(n).max(1);
        let ranges: Vec<std::ops::Range<u64>> = (0..len)
            .step_by(step as usize)
            .map(|a| a..(a + step).min(len))
            .collect();
        let parts: Vec<Result<Option<Vec<u8>>, BackendError>> = if ranges.len() <= 1 {
            vec![backend.get(pack)]
        } else {
            std::thread::scope(|sc| {
                let hs: Vec<_> = ranges
                    .iter()
                    .map(|r| sc.spawn(|| backend.get_range(pack, r.clone())))
                    .collect();
                hs.into_iter()
                    .map(|h| {
                        h.join().unwrap_or_else(|_| {
                            Err(BackendError::S3Config(
                                "a pack fetch thread panicked".into(),
                            ))
                        })
                    })
                    .collect()
            })
        };
        let mut out = Vec::with_capacity(len as usize);
        for p in parts {
            match p {
                Ok(Some(b)) => out.extend_from_slice(&b),
                Ok(None) => return Err(format!("missing from {}", backend.describe())),
                Err(e) => return Err(e.to_string()),
            }
        }
        if out.len() as u64 != len {
            return Err(format!(
                "{} bytes in {}, the snapshot recorded {len}",
                out.len(),
                backend.describe()
            ));
        }
        Ok(out)
    }

    /// Fetches committed snapshot `id`'s working-set pack and puts its
    /// chunks into the local chunk cache, each checked as any chunk read
    /// is (bounded decompression, BLAKE3 of the bytes = its id), so the
    /// page-in finds them there. None when there is nothing to do: the
    /// snapshot has no pack (older, no working set, a local store at
    /// sleep) or this store has no cache (a local backend). An error
    /// (missing, corrupt) names the snapshot and pack; chunks already
    /// checked stay cached, and the caller fetches the rest one by one.
    pub fn fetch_pack(&self, id: SnapshotId) -> Result<Option<PackFetch>, StoreError> {
        self.fetch_pack_with(id, &|_| {})
    }

    /// [`Store::fetch_pack`], streamed: the pack's data arrives in up to
    /// [`PACK_STREAMS`] ranged reads, each consumed as its bytes come in,
    /// and `ready` is called with each chunk as soon as it is checked and
    /// cached, in working-set order per stream, so a page-in waiting for
    /// one goes on while the rest is in flight.
    pub fn fetch_pack_with(
        &self,
        id: SnapshotId,
        ready: &(dyn Fn(&ChunkId) + Sync),
    ) -> Result<Option<PackFetch>, StoreError> {
        let row = self.committed_row(id)?;
        let (Some((pack, len)), Some(cache)) = (row.pack, self.inner.chunks.cache()) else {
            return Ok(None);
        };
        let err = |problem: String| StoreError::Pack {
            snapshot: id,
            pack,
            problem,
        };
        let backend = self.inner.chunks.backend();
        let missing = || format!("missing from {}", backend.describe());
        let get = |n: u64| -> Result<Vec<u8>, StoreError> {
            backend
                .get_range(&pack, 0..n.min(len))
                .map_err(|e| err(e.to_string()))?
                .ok_or_else(|| err(missing()))
        };
        let mut head = get(pack::PROBE)?;
        let need =
            pack::index_len(&head).ok_or_else(|| err(pack::PackError::NotAPack.to_string()))?;
        if need > head.len() as u64 {
            head = get(need)?;
        }
        let (entries, data_at) =
            pack::index_of_prefix(&head, id.0 as u64, len).map_err(|e| err(e.to_string()))?;
        let data = len - data_at as u64;
        let streams = (len / PACK_STREAM_MIN).clamp(1, PACK_STREAMS);
        let per = data.div_ceil(streams).max(1);
        let mut groups: Vec<Vec<(usize, pack::PackEntry, u64)>> =
            (0..streams).map(|_| Vec::new()).collect();
        let mut at = data_at as u64;
        for (i, e) in entries.iter().enumerate() {
            let g = (((at - data_at as u64) / per) as usize).min(groups.len() - 1);
            groups[g].push((i, *e, at));
            at += u64::from(e.stored_len);
        }
        // A range whose chunks are all cached already (a move's target
        // prefetched them, an earlier wake fetched this pack) is not read
        // again: its chunks are ready now.
        let mut skipped = 0u64;
        groups.retain(|g| {
            let (Some(a), Some(b)) = (g.first(), g.last()) else {
                return false;
            };
            let cached = g
                .iter()
                .all(|(_, e, _)| cache.exists(&e.id).unwrap_or(false));
            if cached {
                for (_, e, _) in g {
                    cache.touch(&e.id);
                    ready(&e.id);
                }
                skipped += b.2 + u64::from(b.1.stored_len) - a.2;
            }
            !cached
        });
        let first: Mutex<Option<String>> = Mutex::new(None);
        std::thread::scope(|sc| {
            for g in &groups {
                let first = &first;
                sc.spawn(move || {
                    let problem = self.stream_pack_part(&pack, g, cache, ready);
                    if let Some(p) = problem {
                        first
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .get_or_insert(p);
                    }
                });
            }
        });
        if let Some(p) = first.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(err(p));
        }
        Ok(Some(PackFetch {
            chunks: entries.len() as u64,
            stored_bytes: len - skipped,
        }))
    }

    /// One stream of [`Store::fetch_pack_with`]: the entries `part`
    /// (consecutive, with their offsets) read in one ranged request and
    /// checked and cached one by one as their bytes arrive; the problem,
    /// if any.
    fn stream_pack_part(
        &self,
        pack: &ChunkId,
        part: &[(usize, pack::PackEntry, u64)],
        cache: &LocalBackend,
        ready: &(dyn Fn(&ChunkId) + Sync),
    ) -> Option<String> {
        let (Some(first), Some(last)) = (part.first(), part.last()) else {
            return None;
        };
        let range = first.2..last.2 + u64::from(last.1.stored_len);
        let mut buf: Vec<u8> = Vec::new();
        let mut next = 0usize;
        let mut failed: Option<String> = None;
        let r = {
            let mut sink = |b: &[u8]| -> bool {
                buf.extend_from_slice(b);
                let mut used = 0usize;
                while let Some((i, e, _)) = part.get(next) {
                    let n = e.stored_len as usize;
                    if buf.len() - used < n {
                        break;
                    }
                    let stored = &buf[used..used + n];
                    if let Err(x) = pack::check_entry(*i, e, stored, MAX_WINDOW_SIZE) {
                        failed = Some(x.to_string());
                        return false;
                    }
                    if let Err(x) = cache.put(&e.id, stored) {
                        failed = Some(x.to_string());
                        return false;
                    }
                    ready(&e.id);
                    used += n;
                    next += 1;
                }
                buf.drain(..used);
                true
            };
            self.inner
                .chunks
                .backend()
                .get_range_streamed(pack, range, &mut sink)
        };
        match r {
            Err(e) => Some(e.to_string()),
            Ok(false) => Some(format!(
                "missing from {}",
                self.inner.chunks.backend().describe()
            )),
            Ok(true) => failed.or_else(|| {
                (next < part.len()).then(|| {
                    format!(
                        "the object ended early ({next} of {} entries of a range)",
                        part.len()
                    )
                })
            }),
        }
    }

    // --- gc ---

    /// Removes pending snapshots whose writer is gone, optionally prunes
    /// unreferenced snapshots, then deletes every chunk no window
    /// references (and backend objects no row knows), and leftovers of
    /// interrupted puts. Never deletes a chunk a committed snapshot or a
    /// live writer references (see the protocol in [`crate::meta`]).
    pub fn gc(&self, opts: &GcOptions, progress: &dyn Progress) -> Result<GcReport, StoreError> {
        // Before anything is deleted: the bucket is this tree's.
        self.claim()?;
        let meta = &self.inner.meta;
        let mut report = GcReport {
            pending_reaped: meta.reap_pending(&lease::gone)?,
            ..GcReport::default()
        };
        if opts.prune_snapshots {
            report.snapshots_pruned = meta.prune_snapshots()?;
        }
        let mut objects = self.inner.chunks.backend().list()?;
        objects.retain(|o| *o != crate::claim::CLAIM_ID);
        // Each pass its own owner (`BOOT:PID:START:gcN`; liveness is still
        // the process's): gc_mark returns every row `deleting` under its
        // owner, so two passes of one process (stores of several hosts in
        // one test, concurrent gc calls) sharing one would each delete the
        // other's chunks, and a pass could delete a chunk the other had
        // already forgotten and a writer had put again since.
        static PASS: AtomicU64 = AtomicU64::new(0);
        let lease = Lease {
            owner: format!(
                "{}:gc{}",
                lease::owner(),
                PASS.fetch_add(1, Ordering::Relaxed)
            ),
            expires_ms: self.lease_expiry(),
        };
        let doomed = meta.gc_mark(&lease, &objects, &lease::gone)?;
        progress.start("gc", doomed.len() as u64);
        let deleted = AtomicU64::new(0);
        let res = parallel(self.threads(), &doomed, |(id, _)| {
            self.inner.chunks.delete(id)?;
            fault::point(Point::GcMid);
            deleted.fetch_add(1, Ordering::Relaxed);
            progress.advance(1);
            Ok(())
        });
        progress.finish();
        res?;
        meta.gc_forget(
            &lease.owner,
            &doomed.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        )?;
        report.chunks_deleted = deleted.into_inner();
        report.stored_bytes_freed = doomed.iter().map(|(_, n)| n).sum();
        report.leftovers_removed = self
            .inner
            .chunks
            .backend()
            .clean_leftovers(opts.leftover_age)?;
        if let Some(c) = self.inner.chunks.cache() {
            report.leftovers_removed += c.clean_leftovers(opts.leftover_age)?;
        }
        Ok(report)
    }
}

fn human(n: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

impl Tree {
    /// A terminal picture: one line per snapshot, children indented under
    /// their parent, with own and shared stored bytes and the branches
    /// that start from it.
    pub fn render(&self) -> String {
        let mut children: BTreeMap<Option<SnapshotId>, Vec<&TreeSnapshot>> = BTreeMap::new();
        for s in &self.snapshots {
            children.entry(s.parent).or_default().push(s);
        }
        let mut out = String::new();
        fn walk(
            t: &Tree,
            children: &BTreeMap<Option<SnapshotId>, Vec<&TreeSnapshot>>,
            s: &TreeSnapshot,
            prefix: &str,
            last: bool,
            root: bool,
            out: &mut String,
        ) {
            let branches: Vec<String> = t
                .branches
                .iter()
                .filter(|b| b.snapshot == s.id && b.state != BranchState::Gone)
                .map(|b| format!("{} ({})", b.name, b.state))
                .collect();
            let name = s
                .manifest
                .get("name")
                .and_then(|v| v.as_str())
                .map(|n| format!(" {n}"))
                .unwrap_or_default();
            let head = if root {
                String::new()
            } else if last {
                "└─ ".into()
            } else {
                "├─ ".into()
            };
            out.push_str(&format!(
                "{prefix}{head}{}{name}  own {} shared {}{}\n",
                s.id,
                human(s.sizes.own_stored),
                human(s.sizes.shared_stored),
                if branches.is_empty() {
                    String::new()
                } else {
                    format!("  ← {}", branches.join(", "))
                }
            ));
            let kids = children
                .get(&Some(s.id))
                .map(|v| v.as_slice())
                .unwrap_or(&[]);
            let next = if root {
                prefix.to_owned()
            } else if last {
                format!("{prefix}   ")
            } else {
                format!("{prefix}│  ")
            };
            for (i, k) in kids.iter().enumerate() {
                walk(t, children, k, &next, i + 1 == kids.len(), false, out);
            }
        }
        for r in children.get(&None).map(|v| v.as_slice()).unwrap_or(&[]) {
            walk(self, &children, r, "", true, true, &mut out);
        }
        out.push_str(&format!(
            "{} snapshots, {} chunks: {} stored ({} logical), metadata {}\n",
            self.snapshots.len(),
            self.totals.chunks,
            human(self.totals.stored_bytes),
            human(self.totals.logical_bytes),
            human(self.metadata_bytes)
        ));
        out
    }
}
