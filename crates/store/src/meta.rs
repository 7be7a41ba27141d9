//! Tree metadata: snapshots, layers, windows → chunks, chunk rows,
//! branches. [`Meta`] is what the store needs from a database; [`SqliteMeta`]
//! implements it over one SQLite file (`tree.db`), and
//! [`crate::meta_pg::PgMeta`] over PostgreSQL (several hosts sharing one
//! database) with the same schema and the same calls.
//!
//! # The commit and gc protocol (the part a new implementation must keep)
//!
//! - A snapshot row starts `pending` with a lease (owner, expiry). Before
//!   a writer puts a chunk it *pins* it: in one transaction it records
//!   the window → chunk rows of its pending layer (so the chunk is
//!   referenced) and learns whether the chunk is already known stored.
//!   Only after the backend acknowledged a put does it mark the chunk
//!   `stored`. Commit flips `pending` → `committed` in one transaction that
//!   first checks every chunk the snapshot references is `stored`.
//! - gc reaps pending snapshots whose lease is gone, then, in one
//!   transaction, marks every chunk that no window references `deleting`
//!   (with a gc lease), deletes those objects, and forgets their rows.
//! - A pin that meets a `deleting` chunk of a live gc waits (`Pin::Busy`);
//!   of a dead gc, it takes the row back (`live`, not stored: put again).
//!
//! So a chunk referenced by a committed snapshot, or by a pending one
//! whose writer lives, is never deleted, and a snapshot cannot commit
//! while a chunk it needs is not durable.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rusqlite::{params, OptionalExtension, TransactionBehavior};
use serde::Serialize;

use crate::chunk::ChunkId;

/// A snapshot's id (a node of the tree).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
pub struct SnapshotId(pub i64);

impl std::fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A layer's id.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
pub struct LayerId(pub i64);

/// A branch's id.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
pub struct BranchId(pub i64);

impl std::fmt::Display for BranchId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Which part of a snapshot a layer holds.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum LayerKind {
    /// Guest RAM, its regions laid end to end (the layout of the
    /// snapshot directory's `memory` file).
    Memory,
    /// The guest's disk at this index (its virtual size in bytes).
    Disk(u32),
}

impl LayerKind {
    pub(crate) fn to_db(self) -> (&'static str, i64) {
        match self {
            LayerKind::Memory => ("memory", 0),
            LayerKind::Disk(i) => ("disk", i64::from(i)),
        }
    }
    pub(crate) fn from_db(kind: &str, disk: i64) -> Option<LayerKind> {
        match kind {
            "memory" => Some(LayerKind::Memory),
            "disk" => u32::try_from(disk).ok().map(LayerKind::Disk),
            _ => None,
        }
    }
}

impl std::fmt::Display for LayerKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayerKind::Memory => f.write_str("memory"),
            LayerKind::Disk(i) => write!(f, "disk {i}"),
        }
    }
}

/// A snapshot's state in the tree.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotState {
    /// Being written; invisible to readers; reaped by gc once its
    /// writer's lease is gone.
    Pending,
    /// Visible, immutable.
    Committed,
}

/// A branch's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BranchState {
    /// A vm runs it (it started from its snapshot).
    Running,
    /// Stored, no process; its snapshot holds all of it.
    Sleeping,
    /// Ended; it no longer keeps its snapshot alive.
    Gone,
}

impl BranchState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            BranchState::Running => "running",
            BranchState::Sleeping => "sleeping",
            BranchState::Gone => "gone",
        }
    }
    pub(crate) fn parse(s: &str) -> Option<BranchState> {
        match s {
            "running" => Some(BranchState::Running),
            "sleeping" => Some(BranchState::Sleeping),
            "gone" => Some(BranchState::Gone),
            _ => None,
        }
    }
}

impl std::fmt::Display for BranchState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One window of a layer as recorded: all zero, or a chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    Zero,
    Chunk(ChunkId),
}

/// A window to record in a pending layer, with the chunk's sizes.
#[derive(Clone, Copy, Debug)]
pub struct NewWindow {
    pub index: u64,
    pub entry: Entry,
    /// Bytes of the stored (compressed) chunk; 0 for a zero window.
    pub stored_len: u64,
    /// Bytes of the chunk uncompressed; 0 for a zero window.
    pub raw_len: u64,
}

/// A lease: who holds something, until when (see [`crate::lease`]).
#[derive(Clone, Debug)]
pub struct Lease {
    pub owner: String,
    pub expires_ms: i64,
}

/// A snapshot row.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct SnapshotRow {
    pub id: SnapshotId,
    pub parent: Option<SnapshotId>,
    pub created_ms: i64,
    pub state: SnapshotState,
    /// The manifest, JSON text (the caller's).
    pub manifest: String,
    #[serde(skip)]
    pub working_set: Vec<u64>,
    /// The working-set pack (object id, bytes), if one was stored.
    #[serde(skip)]
    pub pack: Option<(ChunkId, u64)>,
    #[serde(skip)]
    pub lease: Option<Lease>,
}

/// A layer row.
#[derive(Clone, Copy, Debug, Serialize, serde::Deserialize)]
pub struct LayerRow {
    pub id: LayerId,
    pub snapshot: SnapshotId,
    pub kind: LayerKind,
    /// The same kind's layer of the parent snapshot, where absent
    /// windows are looked up.
    pub parent: Option<LayerId>,
    /// Bytes of address space (memory) or disk.
    pub size: u64,
    pub window_size: u64,
}

/// A branch row.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct BranchRow {
    pub id: BranchId,
    pub name: String,
    /// The snapshot it starts from (running) or sleeps in (sleeping).
    pub snapshot: SnapshotId,
    pub state: BranchState,
    pub created_ms: i64,
    pub updated_ms: i64,
}

/// A branch change applied in a snapshot's commit transaction.
#[derive(Clone, Debug)]
pub enum BranchChange {
    /// A new branch starting from the committed snapshot.
    Create { name: String, state: BranchState },
    /// An existing branch now starts from (or sleeps in) the committed
    /// snapshot.
    Update { id: BranchId, state: BranchState },
}

/// A chunk row.
#[derive(Clone, Copy, Debug)]
pub struct ChunkRow {
    pub id: ChunkId,
    pub stored_len: u64,
    pub raw_len: u64,
    /// The backend acknowledged a put of it.
    pub stored: bool,
    /// A gc is deleting it.
    pub deleting: bool,
}

/// The answer to a pin.
#[derive(Debug)]
pub enum Pin {
    /// Recorded. For each window given, whether its chunk must be put
    /// (false for zero windows and chunks already stored).
    Pinned(Vec<bool>),
    /// A live gc is deleting one of these chunks: nothing was recorded;
    /// try again shortly.
    Busy(ChunkId),
}

/// Bytes a snapshot references: its own (no other committed snapshot
/// references the chunk) and shared, stored (compressed) and logical.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Sizes {
    pub own_stored: u64,
    pub own_logical: u64,
    pub shared_stored: u64,
    pub shared_logical: u64,
    pub own_chunks: u64,
    pub shared_chunks: u64,
}

/// Totals over committed snapshots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct Totals {
    /// Distinct chunks committed snapshots reference.
    pub chunks: u64,
    /// Their stored (compressed) bytes, each counted once.
    pub stored_bytes: u64,
    /// Their uncompressed bytes, each counted once.
    pub logical_bytes: u64,
    /// Window → chunk references (a shared chunk counts once per use).
    pub references: u64,
}

/// An error of the metadata database.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    #[error("{path}: {what}: {source}")]
    Sqlite {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: rusqlite::Error,
    },
    /// `db` is the database as [`Meta::describe`] shows it (no password).
    #[error("{db}: {what}: {source}")]
    Postgres {
        db: String,
        what: &'static str,
        #[source]
        source: postgres::Error,
    },
    #[error("cannot connect to {db}: {source}; is the server running? TINE_META selects it")]
    PgConnect {
        db: String,
        #[source]
        source: postgres::Error,
    },
    /// The metadata database's settings are not usable (e.g. TLS asked).
    #[error("{0}")]
    Config(String),
    #[error(
        "{path} has schema version {found}, newer than this tine knows ({known}); use a newer tine"
    )]
    SchemaTooNew {
        path: PathBuf,
        found: i64,
        known: i64,
    },
    #[error("snapshot {0} is no longer pending: its lease was lost (a gc reaped it) or it was committed")]
    NotPending(SnapshotId),
    #[error("snapshot {snapshot} cannot commit: {count} of its chunks are not durable yet")]
    Unstored { snapshot: SnapshotId, count: u64 },
    #[error("no snapshot {0}")]
    NoSnapshot(SnapshotId),
    #[error("no branch {0}")]
    NoBranch(String),
    #[error("a branch named {0:?} exists (running or sleeping)")]
    NameTaken(String),
    #[error("snapshot {0} has children or live branches and cannot be removed")]
    InUse(SnapshotId),
    #[error("corrupt tree metadata: {0}")]
    Corrupt(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// What the store needs from its metadata database. Implementations are
/// shared between threads; every method is one transaction.
pub trait Meta: Send + Sync + std::fmt::Debug {
    /// Where it is, for messages.
    fn describe(&self) -> String;

    // --- writing a snapshot ---

    /// A new pending snapshot under `lease`.
    fn begin_snapshot(
        &self,
        parent: Option<SnapshotId>,
        manifest: &str,
        lease: &Lease,
    ) -> Result<SnapshotId, MetaError>;
    /// A layer of a pending snapshot.
    fn add_layer(
        &self,
        snapshot: SnapshotId,
        kind: LayerKind,
        parent: Option<LayerId>,
        size: u64,
        window_size: u64,
    ) -> Result<LayerId, MetaError>;
    /// Records `windows` in a pending layer and renews the lease (see the
    /// module's protocol). `gone` tells whether a gc lease is gone.
    fn pin(
        &self,
        snapshot: SnapshotId,
        layer: LayerId,
        windows: &[NewWindow],
        lease_expires_ms: i64,
        gone: &dyn Fn(&str, i64) -> bool,
    ) -> Result<Pin, MetaError>;
    /// The backend acknowledged these chunks (id, stored bytes).
    fn mark_stored(&self, chunks: &[(ChunkId, u64)]) -> Result<(), MetaError>;
    /// A named blob of a pending snapshot (e.g. vCPU and device state).
    fn put_blob(&self, snapshot: SnapshotId, name: &str, data: &[u8]) -> Result<(), MetaError>;
    /// Makes a pending snapshot visible, with its working set and an
    /// optional branch change, in one transaction.
    fn commit_snapshot(
        &self,
        snapshot: SnapshotId,
        working_set: &[u64],
        branch: Option<&BranchChange>,
    ) -> Result<Option<BranchId>, MetaError>;
    /// Drops a pending snapshot's rows (its chunks are left to gc).
    fn abort_snapshot(&self, snapshot: SnapshotId) -> Result<(), MetaError>;
    /// Records (or clears) pending snapshot `snapshot`'s working-set pack
    /// (object id, bytes). Called BEFORE the object is put, so a gc that
    /// lists it sees it named (see [`Meta::gc_mark`]).
    fn set_pack(&self, snapshot: SnapshotId, pack: Option<(ChunkId, u64)>)
        -> Result<(), MetaError>;

    // --- reading ---

    /// A snapshot, pending or committed.
    fn snapshot(&self, id: SnapshotId) -> Result<Option<SnapshotRow>, MetaError>;
    /// Every snapshot in `state`, oldest first.
    fn snapshots(&self, state: SnapshotState) -> Result<Vec<SnapshotRow>, MetaError>;
    /// A blob of a snapshot.
    fn blob(&self, snapshot: SnapshotId, name: &str) -> Result<Option<Vec<u8>>, MetaError>;
    /// The layers of a snapshot.
    fn layers(&self, snapshot: SnapshotId) -> Result<Vec<LayerRow>, MetaError>;
    /// One layer.
    fn layer(&self, id: LayerId) -> Result<Option<LayerRow>, MetaError>;
    /// The recorded windows of a layer, by index.
    fn windows(&self, layer: LayerId) -> Result<Vec<(u64, Entry)>, MetaError>;
    /// Whether a chunk is known stored (a hint: a pin decides).
    fn chunk_stored(&self, id: &ChunkId) -> Result<bool, MetaError>;
    /// Every chunk row.
    fn chunks(&self) -> Result<Vec<ChunkRow>, MetaError>;
    /// Committed snapshots that reference a chunk.
    fn chunk_users(&self, id: &ChunkId) -> Result<Vec<SnapshotId>, MetaError>;
    /// Own and shared bytes of every committed snapshot.
    fn sizes(&self) -> Result<Vec<(SnapshotId, Sizes)>, MetaError>;
    /// Totals over committed snapshots.
    fn totals(&self) -> Result<Totals, MetaError>;
    /// Bytes the metadata itself takes (the database file).
    fn metadata_bytes(&self) -> Result<u64, MetaError>;
    /// This database's identity: the same for every host that shares it,
    /// different for another database (a remote bucket is claimed by
    /// one, see [`crate::claim`]).
    fn identity(&self) -> Result<String, MetaError>;

    // --- branches ---

    fn create_branch(
        &self,
        name: &str,
        snapshot: SnapshotId,
        state: BranchState,
    ) -> Result<BranchId, MetaError>;
    /// Sets a branch's state, and its snapshot when given.
    fn update_branch(
        &self,
        id: BranchId,
        snapshot: Option<SnapshotId>,
        state: BranchState,
    ) -> Result<(), MetaError>;
    /// Every branch, gone ones included.
    fn branches(&self) -> Result<Vec<BranchRow>, MetaError>;
    /// The running or sleeping branch called `name`.
    fn branch(&self, name: &str) -> Result<Option<BranchRow>, MetaError>;

    // --- gc ---

    /// Deletes pending snapshots whose lease `gone` says is gone; returns
    /// their ids.
    fn reap_pending(&self, gone: &dyn Fn(&str, i64) -> bool) -> Result<Vec<SnapshotId>, MetaError>;
    /// Deletes committed snapshots with no child and no running or
    /// sleeping branch, repeatedly; returns their ids.
    fn prune_snapshots(&self) -> Result<Vec<SnapshotId>, MetaError>;
    /// Marks `deleting` under `lease`, and returns, every chunk that no
    /// window references, plus each of `objects` (ids the backend holds)
    /// that has no row and is no snapshot's working-set pack (pending or
    /// committed), plus rows a gone gc left `deleting`; with their stored
    /// bytes.
    fn gc_mark(
        &self,
        lease: &Lease,
        objects: &[ChunkId],
        gone: &dyn Fn(&str, i64) -> bool,
    ) -> Result<Vec<(ChunkId, u64)>, MetaError>;
    /// Forgets rows still `deleting` under `owner` (their objects are gone).
    fn gc_forget(&self, owner: &str, ids: &[ChunkId]) -> Result<(), MetaError>;
}

/// Schema migrations, in order; `schema_version` holds how many ran. Never
/// edit a step that shipped: add one.
const MIGRATIONS: &[&str] = &[
    // 1: the tree.
    r#"
    CREATE TABLE snapshots (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        parent INTEGER REFERENCES snapshots(id),
        created_ms INTEGER NOT NULL,
        state TEXT NOT NULL CHECK (state IN ('pending', 'committed')),
        manifest TEXT NOT NULL,
        working_set BLOB,
        lease_owner TEXT,
        lease_expires_ms INTEGER
    );
    CREATE INDEX snapshots_parent ON snapshots(parent);
    CREATE TABLE blobs (
        snapshot INTEGER NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
        name TEXT NOT NULL,
        data BLOB NOT NULL,
        PRIMARY KEY (snapshot, name)
    );
    CREATE TABLE layers (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        snapshot INTEGER NOT NULL REFERENCES snapshots(id) ON DELETE CASCADE,
        kind TEXT NOT NULL CHECK (kind IN ('memory', 'disk')),
        disk INTEGER NOT NULL DEFAULT 0,
        parent INTEGER REFERENCES layers(id),
        size INTEGER NOT NULL,
        window_size INTEGER NOT NULL,
        UNIQUE (snapshot, kind, disk)
    );
    CREATE INDEX layers_parent ON layers(parent);
    CREATE TABLE chunks (
        id INTEGER PRIMARY KEY,
        hash BLOB NOT NULL UNIQUE,
        stored_len INTEGER NOT NULL,
        raw_len INTEGER NOT NULL,
        stored INTEGER NOT NULL DEFAULT 0,
        state TEXT NOT NULL DEFAULT 'live' CHECK (state IN ('live', 'deleting')),
        gc_owner TEXT,
        gc_expires_ms INTEGER
    );
    CREATE TABLE windows (
        layer INTEGER NOT NULL REFERENCES layers(id) ON DELETE CASCADE,
        idx INTEGER NOT NULL,
        chunk INTEGER REFERENCES chunks(id),
        PRIMARY KEY (layer, idx)
    ) WITHOUT ROWID;
    CREATE INDEX windows_chunk ON windows(chunk);
    CREATE TABLE branches (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL,
        snapshot INTEGER NOT NULL REFERENCES snapshots(id),
        state TEXT NOT NULL CHECK (state IN ('running', 'sleeping', 'gone')),
        created_ms INTEGER NOT NULL,
        updated_ms INTEGER NOT NULL
    );
    CREATE UNIQUE INDEX branches_live_name ON branches(name) WHERE state != 'gone';
    CREATE INDEX branches_snapshot ON branches(snapshot);
    "#,
    // 2: working-set packs (one backend object holding the chunks a
    // snapshot's working set needs; NULL: none, as for older snapshots).
    r#"
    ALTER TABLE snapshots ADD COLUMN pack BLOB;
    ALTER TABLE snapshots ADD COLUMN pack_len INTEGER;
    CREATE INDEX snapshots_pack ON snapshots(pack) WHERE pack IS NOT NULL;
    "#,
];

/// The schema version this code writes.
pub const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// [`Meta`] over one SQLite file, shared by every process on the host
/// (WAL journal, a busy timeout, write transactions taken IMMEDIATE).
#[derive(Debug)]
pub struct SqliteMeta {
    path: PathBuf,
    conn: Mutex<rusqlite::Connection>,
}

fn sq<'a>(path: &'a Path, what: &'static str) -> impl FnOnce(rusqlite::Error) -> MetaError + 'a {
    move |source| MetaError::Sqlite {
        path: path.into(),
        what,
        source,
    }
}

pub(crate) fn encode_pages(pages: &[u64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(pages.len() * 8);
    for p in pages {
        out.extend_from_slice(&p.to_le_bytes());
    }
    out
}

pub(crate) fn decode_pages(b: &[u8]) -> Vec<u64> {
    b.chunks_exact(8)
        .map(|c| {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            u64::from_le_bytes(a)
        })
        .collect()
}

pub(crate) fn hash_of(b: Vec<u8>) -> Result<ChunkId, MetaError> {
    let arr: [u8; 32] = b
        .try_into()
        .map_err(|b: Vec<u8>| MetaError::Corrupt(format!("chunk hash of {} bytes", b.len())))?;
    Ok(ChunkId(arr))
}

/// Every row `sql` returns, mapped by `f`; `what` names the read in errors.
/// Statements are cached on the connection: these queries run again and
/// again (every layer read, every gc).
fn query_all<T, P: rusqlite::Params>(
    conn: &rusqlite::Connection,
    p: &Path,
    what: &'static str,
    sql: &str,
    params: P,
    f: impl FnMut(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> Result<Vec<T>, MetaError> {
    let mut st = conn.prepare_cached(sql).map_err(sq(p, "prepare"))?;
    let rows = st.query_map(params, f).map_err(sq(p, what))?;
    rows.collect::<Result<_, _>>().map_err(sq(p, what))
}

/// Whether the holder of a lease (`owner`, `expires_ms`) is gone; a row
/// with no lease has no holder.
pub(crate) fn lease_gone(
    gone: &dyn Fn(&str, i64) -> bool,
    owner: Option<String>,
    expires_ms: Option<i64>,
) -> bool {
    match (owner, expires_ms) {
        (Some(o), Some(e)) => gone(&o, e),
        _ => true,
    }
}

impl SqliteMeta {
    /// Opens (creating it and running migrations as needed) `path`.
    pub fn open(path: &Path) -> Result<SqliteMeta, MetaError> {
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let conn = rusqlite::Connection::open(path).map_err(sq(path, "open"))?;
        conn.busy_timeout(std::time::Duration::from_secs(30))
            .map_err(sq(path, "busy_timeout"))?;
        // WAL: readers never block the writer; FULL: a commit that
        // returned survives power loss (a snapshot's commit must).
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(sq(path, "journal_mode"))?;
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(sq(path, "synchronous"))?;
        conn.pragma_update(None, "foreign_keys", "ON")
            .map_err(sq(path, "foreign_keys"))?;
        let meta = SqliteMeta {
            path: path.into(),
            conn: Mutex::new(conn),
        };
        meta.migrate()?;
        Ok(meta)
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, rusqlite::Connection> {
        // A panic while holding the lock leaves the connection usable
        // (every transaction rolls back on drop).
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` in one IMMEDIATE write transaction (it takes the write
    /// lock up front, so it never fails midway on another writer) and
    /// commits when `f` returns Ok; an error rolls everything back.
    fn write<T>(
        &self,
        f: impl FnOnce(&rusqlite::Transaction<'_>, &Path) -> Result<T, MetaError>,
    ) -> Result<T, MetaError> {
        let p = &self.path;
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sq(p, "begin"))?;
        let out = f(&tx, p)?;
        tx.commit().map_err(sq(p, "commit"))?;
        Ok(out)
    }

    fn migrate(&self) -> Result<(), MetaError> {
        let p = &self.path;
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sq(p, "begin migration"))?;
        tx.execute_batch("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            .map_err(sq(p, "schema_version"))?;
        let found: Option<i64> = tx
            .query_row("SELECT version FROM schema_version", [], |r| r.get(0))
            .optional()
            .map_err(sq(p, "read schema_version"))?;
        let found = match found {
            Some(v) => v,
            None => {
                tx.execute("INSERT INTO schema_version (version) VALUES (0)", [])
                    .map_err(sq(p, "init schema_version"))?;
                0
            }
        };
        if found > SCHEMA_VERSION {
            return Err(MetaError::SchemaTooNew {
                path: p.clone(),
                found,
                known: SCHEMA_VERSION,
            });
        }
        for (i, step) in MIGRATIONS.iter().enumerate().skip(found as usize) {
            tx.execute_batch(step).map_err(sq(p, "migration"))?;
            tx.execute("UPDATE schema_version SET version = ?1", [i as i64 + 1])
                .map_err(sq(p, "bump schema_version"))?;
        }
        tx.commit().map_err(sq(p, "commit migration"))
    }

    /// The schema version of the open database.
    pub fn schema_version(&self) -> Result<i64, MetaError> {
        self.conn()
            .query_row("SELECT version FROM schema_version", [], |r| r.get(0))
            .map_err(sq(&self.path, "read schema_version"))
    }

    fn snapshot_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SnapshotRow> {
        let state: String = r.get(3)?;
        let ws: Option<Vec<u8>> = r.get(5)?;
        let owner: Option<String> = r.get(6)?;
        let exp: Option<i64> = r.get(7)?;
        let pack: Option<Vec<u8>> = r.get(8)?;
        let pack_len: Option<i64> = r.get(9)?;
        Ok(SnapshotRow {
            id: SnapshotId(r.get(0)?),
            parent: r.get::<_, Option<i64>>(1)?.map(SnapshotId),
            created_ms: r.get(2)?,
            state: if state == "committed" {
                SnapshotState::Committed
            } else {
                SnapshotState::Pending
            },
            manifest: r.get(4)?,
            working_set: ws.map(|b| decode_pages(&b)).unwrap_or_default(),
            // A malformed pack column reads as no pack: the wake falls back
            // to fetching chunks one by one.
            pack: pack
                .and_then(|b| <[u8; 32]>::try_from(b.as_slice()).ok())
                .zip(pack_len.and_then(|n| u64::try_from(n).ok()))
                .map(|(h, n)| (ChunkId(h), n)),
            lease: owner
                .zip(exp)
                .map(|(owner, expires_ms)| Lease { owner, expires_ms }),
        })
    }

    fn layer_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<(LayerRow, String, i64)> {
        let kind: String = r.get(2)?;
        let disk: i64 = r.get(3)?;
        Ok((
            LayerRow {
                id: LayerId(r.get(0)?),
                snapshot: SnapshotId(r.get(1)?),
                kind: LayerKind::Memory,
                parent: r.get::<_, Option<i64>>(4)?.map(LayerId),
                size: r.get::<_, i64>(5)? as u64,
                window_size: r.get::<_, i64>(6)? as u64,
            },
            kind,
            disk,
        ))
    }

    fn fix_kind((mut row, kind, disk): (LayerRow, String, i64)) -> Result<LayerRow, MetaError> {
        row.kind = LayerKind::from_db(&kind, disk)
            .ok_or_else(|| MetaError::Corrupt(format!("layer {} has kind {kind:?}", row.id.0)))?;
        Ok(row)
    }

    fn branch_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<(BranchRow, String)> {
        Ok((
            BranchRow {
                id: BranchId(r.get(0)?),
                name: r.get(1)?,
                snapshot: SnapshotId(r.get(2)?),
                state: BranchState::Gone,
                created_ms: r.get(4)?,
                updated_ms: r.get(5)?,
            },
            r.get(3)?,
        ))
    }

    fn fix_state((mut b, s): (BranchRow, String)) -> Result<BranchRow, MetaError> {
        b.state = BranchState::parse(&s)
            .ok_or_else(|| MetaError::Corrupt(format!("branch {} has state {s:?}", b.id)))?;
        Ok(b)
    }
}

fn is_unique_violation(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _)
        if f.code == rusqlite::ErrorCode::ConstraintViolation
            && f.extended_code == rusqlite::ffi::SQLITE_CONSTRAINT_UNIQUE)
}

/// The error of a branch write: a unique violation means a live branch
/// is already called `name`; anything else is the database's.
fn name_taken_or<'a>(
    p: &'a Path,
    what: &'static str,
    name: &'a str,
) -> impl FnOnce(rusqlite::Error) -> MetaError + 'a {
    move |e| {
        if is_unique_violation(&e) {
            MetaError::NameTaken(name.into())
        } else {
            sq(p, what)(e)
        }
    }
}

pub(crate) const SNAPSHOT_COLS: &str =
    "id, parent, created_ms, state, manifest, working_set, lease_owner, lease_expires_ms, pack, pack_len";
pub(crate) const LAYER_COLS: &str = "id, snapshot, kind, disk, parent, size, window_size";
pub(crate) const BRANCH_COLS: &str = "id, name, snapshot, state, created_ms, updated_ms";

impl Meta for SqliteMeta {
    fn describe(&self) -> String {
        self.path.display().to_string()
    }

    fn begin_snapshot(
        &self,
        parent: Option<SnapshotId>,
        manifest: &str,
        lease: &Lease,
    ) -> Result<SnapshotId, MetaError> {
        self.write(|tx, p| {
            if let Some(parent) = parent {
                if snapshot_state(tx, p, parent, "find parent")?.as_deref() != Some("committed") {
                    return Err(MetaError::NoSnapshot(parent));
                }
            }
            tx.execute(
                "INSERT INTO snapshots (parent, created_ms, state, manifest, lease_owner, lease_expires_ms)
                 VALUES (?1, ?2, 'pending', ?3, ?4, ?5)",
                params![
                    parent.map(|s| s.0),
                    crate::lease::now_ms(),
                    manifest,
                    lease.owner,
                    lease.expires_ms
                ],
            )
            .map_err(sq(p, "insert snapshot"))?;
            let id = tx.last_insert_rowid();
            Ok(SnapshotId(id))
        })
    }

    fn add_layer(
        &self,
        snapshot: SnapshotId,
        kind: LayerKind,
        parent: Option<LayerId>,
        size: u64,
        window_size: u64,
    ) -> Result<LayerId, MetaError> {
        self.write(|tx, p| {
            if snapshot_state(tx, p, snapshot, "find snapshot")?.as_deref() != Some("pending") {
                return Err(MetaError::NotPending(snapshot));
            }
            let (k, d) = kind.to_db();
            tx.execute(
                "INSERT INTO layers (snapshot, kind, disk, parent, size, window_size)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                params![
                    snapshot.0,
                    k,
                    d,
                    parent.map(|l| l.0),
                    size as i64,
                    window_size as i64
                ],
            )
            .map_err(sq(p, "insert layer"))?;
            let id = tx.last_insert_rowid();
            Ok(LayerId(id))
        })
    }

    fn pin(
        &self,
        snapshot: SnapshotId,
        layer: LayerId,
        windows: &[NewWindow],
        lease_expires_ms: i64,
        gone: &dyn Fn(&str, i64) -> bool,
    ) -> Result<Pin, MetaError> {
        let p = &self.path;
        let mut conn = self.conn();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(sq(p, "begin"))?;
        let n = tx
            .execute(
                "UPDATE snapshots SET lease_expires_ms = ?2 WHERE id = ?1 AND state = 'pending'",
                params![snapshot.0, lease_expires_ms],
            )
            .map_err(sq(p, "renew lease"))?;
        if n != 1 {
            return Err(MetaError::NotPending(snapshot));
        }
        let mut need = Vec::with_capacity(windows.len());
        {
            let mut ins_chunk = tx
                .prepare_cached(
                    "INSERT INTO chunks (hash, stored_len, raw_len) VALUES (?1, ?2, ?3)
                     ON CONFLICT (hash) DO NOTHING",
                )
                .map_err(sq(p, "prepare"))?;
            let mut get_chunk = tx
                .prepare_cached(
                    "SELECT id, stored, state, gc_owner, gc_expires_ms FROM chunks WHERE hash = ?1",
                )
                .map_err(sq(p, "prepare"))?;
            let mut take_back = tx
                .prepare_cached(
                    "UPDATE chunks SET state = 'live', stored = 0, gc_owner = NULL,
                     gc_expires_ms = NULL, stored_len = ?2, raw_len = ?3 WHERE id = ?1",
                )
                .map_err(sq(p, "prepare"))?;
            let mut ins_window = tx
                .prepare_cached(
                    "INSERT INTO windows (layer, idx, chunk) VALUES (?1, ?2, ?3)
                     ON CONFLICT (layer, idx) DO UPDATE SET chunk = excluded.chunk",
                )
                .map_err(sq(p, "prepare"))?;
            for w in windows {
                let chunk_row = match w.entry {
                    Entry::Zero => {
                        need.push(false);
                        None
                    }
                    Entry::Chunk(id) => {
                        ins_chunk
                            .execute(params![&id.0[..], w.stored_len as i64, w.raw_len as i64])
                            .map_err(sq(p, "insert chunk"))?;
                        let (row, stored, state, owner, exp): (
                            i64,
                            bool,
                            String,
                            Option<String>,
                            Option<i64>,
                        ) = get_chunk
                            .query_row([&id.0[..]], |r| {
                                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
                            })
                            .map_err(sq(p, "read chunk"))?;
                        if state == "deleting" {
                            if !lease_gone(gone, owner, exp) {
                                // Drop the transaction: nothing recorded.
                                return Ok(Pin::Busy(id));
                            }
                            take_back
                                .execute(params![row, w.stored_len as i64, w.raw_len as i64])
                                .map_err(sq(p, "take back chunk"))?;
                            need.push(true);
                        } else {
                            need.push(!stored);
                        }
                        Some(row)
                    }
                };
                ins_window
                    .execute(params![layer.0, w.index as i64, chunk_row])
                    .map_err(sq(p, "insert window"))?;
            }
        }
        tx.commit().map_err(sq(p, "commit"))?;
        Ok(Pin::Pinned(need))
    }

    fn mark_stored(&self, chunks: &[(ChunkId, u64)]) -> Result<(), MetaError> {
        self.write(|tx, p| {
            let mut st = tx
                .prepare_cached(
                    "UPDATE chunks SET stored = 1, stored_len = ?2 WHERE hash = ?1 AND state = 'live'",
                )
                .map_err(sq(p, "prepare"))?;
            for (c, len) in chunks {
                st.execute(params![&c.0[..], *len as i64])
                    .map_err(sq(p, "mark stored"))?;
            }
            Ok(())
        })
    }

    fn put_blob(&self, snapshot: SnapshotId, name: &str, data: &[u8]) -> Result<(), MetaError> {
        let p = &self.path;
        let conn = self.conn();
        let n = conn
            .execute(
                "INSERT INTO blobs (snapshot, name, data)
                 SELECT id, ?2, ?3 FROM snapshots WHERE id = ?1 AND state = 'pending'
                 ON CONFLICT (snapshot, name) DO UPDATE SET data = excluded.data",
                params![snapshot.0, name, data],
            )
            .map_err(sq(p, "put blob"))?;
        if n != 1 {
            return Err(MetaError::NotPending(snapshot));
        }
        Ok(())
    }

    fn commit_snapshot(
        &self,
        snapshot: SnapshotId,
        working_set: &[u64],
        branch: Option<&BranchChange>,
    ) -> Result<Option<BranchId>, MetaError> {
        self.write(|tx, p| {
            let unstored: i64 = tx
                .query_row(
                    "SELECT COUNT(*) FROM windows w JOIN layers l ON w.layer = l.id
                     JOIN chunks c ON c.id = w.chunk
                     WHERE l.snapshot = ?1 AND (c.stored = 0 OR c.state != 'live')",
                    [snapshot.0],
                    |r| r.get(0),
                )
                .map_err(sq(p, "check chunks"))?;
            if unstored != 0 {
                return Err(MetaError::Unstored {
                    snapshot,
                    count: unstored as u64,
                });
            }
            let n = tx
                .execute(
                    "UPDATE snapshots SET state = 'committed', working_set = ?2,
                     lease_owner = NULL, lease_expires_ms = NULL
                     WHERE id = ?1 AND state = 'pending'",
                    params![snapshot.0, encode_pages(working_set)],
                )
                .map_err(sq(p, "commit snapshot"))?;
            if n != 1 {
                return Err(MetaError::NotPending(snapshot));
            }
            let now = crate::lease::now_ms();
            let bid = match branch {
                None => None,
                Some(BranchChange::Create { name, state }) => {
                    tx.execute(
                        "INSERT INTO branches (name, snapshot, state, created_ms, updated_ms)
                         VALUES (?1, ?2, ?3, ?4, ?4)",
                        params![name, snapshot.0, state.as_str(), now],
                    )
                    .map_err(name_taken_or(p, "insert branch", name))?;
                    Some(BranchId(tx.last_insert_rowid()))
                }
                Some(BranchChange::Update { id, state }) => {
                    let n = tx
                        .execute(
                            "UPDATE branches SET snapshot = ?2, state = ?3, updated_ms = ?4 WHERE id = ?1",
                            params![id.0, snapshot.0, state.as_str(), now],
                        )
                        .map_err(sq(p, "update branch"))?;
                    if n != 1 {
                        return Err(MetaError::NoBranch(id.to_string()));
                    }
                    Some(*id)
                }
            };
            Ok(bid)
        })
    }

    fn abort_snapshot(&self, snapshot: SnapshotId) -> Result<(), MetaError> {
        self.write(|tx, p| delete_pending(tx, p, snapshot))
    }

    fn set_pack(
        &self,
        snapshot: SnapshotId,
        pack: Option<(ChunkId, u64)>,
    ) -> Result<(), MetaError> {
        self.write(|tx, p| {
            let n = tx
                .execute(
                    "UPDATE snapshots SET pack = ?2, pack_len = ?3 WHERE id = ?1 AND state = 'pending'",
                    params![
                        snapshot.0,
                        pack.map(|(id, _)| id.0.to_vec()),
                        pack.map(|(_, n)| n as i64)
                    ],
                )
                .map_err(sq(p, "record pack"))?;
            if n != 1 {
                return Err(MetaError::NotPending(snapshot));
            }
            Ok(())
        })
    }

    fn snapshot(&self, id: SnapshotId) -> Result<Option<SnapshotRow>, MetaError> {
        self.conn()
            .query_row(
                &format!("SELECT {SNAPSHOT_COLS} FROM snapshots WHERE id = ?1"),
                [id.0],
                Self::snapshot_from_row,
            )
            .optional()
            .map_err(sq(&self.path, "read snapshot"))
    }

    fn snapshots(&self, state: SnapshotState) -> Result<Vec<SnapshotRow>, MetaError> {
        let s = match state {
            SnapshotState::Pending => "pending",
            SnapshotState::Committed => "committed",
        };
        query_all(
            &self.conn(),
            &self.path,
            "read snapshots",
            &format!("SELECT {SNAPSHOT_COLS} FROM snapshots WHERE state = ?1 ORDER BY id"),
            [s],
            Self::snapshot_from_row,
        )
    }

    fn blob(&self, snapshot: SnapshotId, name: &str) -> Result<Option<Vec<u8>>, MetaError> {
        self.conn()
            .query_row(
                "SELECT data FROM blobs WHERE snapshot = ?1 AND name = ?2",
                params![snapshot.0, name],
                |r| r.get(0),
            )
            .optional()
            .map_err(sq(&self.path, "read blob"))
    }

    fn layers(&self, snapshot: SnapshotId) -> Result<Vec<LayerRow>, MetaError> {
        let rows = query_all(
            &self.conn(),
            &self.path,
            "read layers",
            &format!(
                "SELECT {LAYER_COLS} FROM layers WHERE snapshot = ?1 ORDER BY kind DESC, disk"
            ),
            [snapshot.0],
            Self::layer_from_row,
        )?;
        rows.into_iter().map(Self::fix_kind).collect()
    }

    fn layer(&self, id: LayerId) -> Result<Option<LayerRow>, MetaError> {
        let row = self
            .conn()
            .query_row(
                &format!("SELECT {LAYER_COLS} FROM layers WHERE id = ?1"),
                [id.0],
                Self::layer_from_row,
            )
            .optional()
            .map_err(sq(&self.path, "read layer"))?;
        row.map(Self::fix_kind).transpose()
    }

    fn windows(&self, layer: LayerId) -> Result<Vec<(u64, Entry)>, MetaError> {
        let rows: Vec<(i64, Option<Vec<u8>>)> = query_all(
            &self.conn(),
            &self.path,
            "read windows",
            "SELECT w.idx, c.hash FROM windows w LEFT JOIN chunks c ON c.id = w.chunk
             WHERE w.layer = ?1 ORDER BY w.idx",
            [layer.0],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        rows.into_iter()
            .map(|(i, h)| {
                Ok((
                    i as u64,
                    match h {
                        None => Entry::Zero,
                        Some(h) => Entry::Chunk(hash_of(h)?),
                    },
                ))
            })
            .collect()
    }

    fn chunk_stored(&self, id: &ChunkId) -> Result<bool, MetaError> {
        let v: Option<bool> = self
            .conn()
            .query_row(
                "SELECT stored FROM chunks WHERE hash = ?1 AND state = 'live'",
                [&id.0[..]],
                |r| r.get(0),
            )
            .optional()
            .map_err(sq(&self.path, "read chunk"))?;
        Ok(v.unwrap_or(false))
    }

    fn chunks(&self) -> Result<Vec<ChunkRow>, MetaError> {
        let rows: Vec<(Vec<u8>, i64, i64, bool, String)> = query_all(
            &self.conn(),
            &self.path,
            "read chunks",
            "SELECT hash, stored_len, raw_len, stored, state FROM chunks ORDER BY id",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
        )?;
        rows.into_iter()
            .map(|(h, s, r, stored, state)| {
                Ok(ChunkRow {
                    id: hash_of(h)?,
                    stored_len: s as u64,
                    raw_len: r as u64,
                    stored,
                    deleting: state == "deleting",
                })
            })
            .collect()
    }

    fn chunk_users(&self, id: &ChunkId) -> Result<Vec<SnapshotId>, MetaError> {
        query_all(
            &self.conn(),
            &self.path,
            "read users",
            "SELECT DISTINCT l.snapshot FROM chunks c JOIN windows w ON w.chunk = c.id
             JOIN layers l ON l.id = w.layer JOIN snapshots s ON s.id = l.snapshot
             WHERE c.hash = ?1 AND s.state = 'committed' ORDER BY l.snapshot",
            [&id.0[..]],
            |r| Ok(SnapshotId(r.get(0)?)),
        )
    }

    fn sizes(&self) -> Result<Vec<(SnapshotId, Sizes)>, MetaError> {
        query_all(
            &self.conn(),
            &self.path,
            "read sizes",
            "WITH refs AS (
                SELECT DISTINCT l.snapshot AS s, w.chunk AS c
                FROM windows w JOIN layers l ON l.id = w.layer
                JOIN snapshots sn ON sn.id = l.snapshot
                WHERE sn.state = 'committed' AND w.chunk IS NOT NULL
             ), users AS (SELECT c, COUNT(*) AS n FROM refs GROUP BY c)
             SELECT r.s,
                SUM(CASE WHEN u.n = 1 THEN ch.stored_len ELSE 0 END),
                SUM(CASE WHEN u.n = 1 THEN ch.raw_len ELSE 0 END),
                SUM(CASE WHEN u.n > 1 THEN ch.stored_len ELSE 0 END),
                SUM(CASE WHEN u.n > 1 THEN ch.raw_len ELSE 0 END),
                SUM(u.n = 1), SUM(u.n > 1)
             FROM refs r JOIN users u ON u.c = r.c JOIN chunks ch ON ch.id = r.c
             GROUP BY r.s ORDER BY r.s",
            [],
            |r| {
                Ok((
                    SnapshotId(r.get(0)?),
                    Sizes {
                        own_stored: r.get::<_, i64>(1)? as u64,
                        own_logical: r.get::<_, i64>(2)? as u64,
                        shared_stored: r.get::<_, i64>(3)? as u64,
                        shared_logical: r.get::<_, i64>(4)? as u64,
                        own_chunks: r.get::<_, i64>(5)? as u64,
                        shared_chunks: r.get::<_, i64>(6)? as u64,
                    },
                ))
            },
        )
    }

    fn totals(&self) -> Result<Totals, MetaError> {
        let p = &self.path;
        let conn = self.conn();
        let (chunks, stored, logical): (i64, Option<i64>, Option<i64>) = conn
            .query_row(
                "SELECT COUNT(*), SUM(stored_len), SUM(raw_len) FROM chunks c
                 WHERE EXISTS (SELECT 1 FROM windows w JOIN layers l ON l.id = w.layer
                   JOIN snapshots s ON s.id = l.snapshot
                   WHERE w.chunk = c.id AND s.state = 'committed')",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .map_err(sq(p, "totals"))?;
        let refs: i64 = conn
            .query_row(
                "SELECT COUNT(*) FROM windows w JOIN layers l ON l.id = w.layer
                 JOIN snapshots s ON s.id = l.snapshot
                 WHERE w.chunk IS NOT NULL AND s.state = 'committed'",
                [],
                |r| r.get(0),
            )
            .map_err(sq(p, "totals"))?;
        Ok(Totals {
            chunks: chunks as u64,
            stored_bytes: stored.unwrap_or(0) as u64,
            logical_bytes: logical.unwrap_or(0) as u64,
            references: refs as u64,
        })
    }

    fn metadata_bytes(&self) -> Result<u64, MetaError> {
        let p = &self.path;
        let conn = self.conn();
        // Checkpoint first so the WAL's pages are counted in the file.
        let _ = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()));
        let pages: i64 = conn
            .query_row("PRAGMA page_count", [], |r| r.get(0))
            .map_err(sq(p, "page_count"))?;
        let size: i64 = conn
            .query_row("PRAGMA page_size", [], |r| r.get(0))
            .map_err(sq(p, "page_size"))?;
        Ok((pages * size) as u64)
    }

    fn identity(&self) -> Result<String, MetaError> {
        // A random id made once, in a file beside the database (no
        // migration: older databases get one on first use).
        let file = self.path.with_extension("id");
        let io = |source: std::io::Error| MetaError::Io {
            path: file.clone(),
            source,
        };
        match std::fs::read_to_string(&file) {
            Ok(s) if !s.trim().is_empty() => return Ok(format!("sqlite:{}", s.trim())),
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io(e)),
        }
        let seed = format!(
            "{}:{}:{}",
            crate::lease::owner(),
            crate::lease::now_ms(),
            self.path.display()
        );
        let id = blake3::hash(seed.as_bytes()).to_hex()[..32].to_string();
        let tmp = file.with_extension(format!("id.tmp.{}", std::process::id()));
        std::fs::write(&tmp, &id).map_err(io)?;
        // The first one made wins (a hard link does not replace).
        let res = std::fs::hard_link(&tmp, &file);
        let _ = std::fs::remove_file(&tmp);
        match res {
            Ok(()) => Ok(format!("sqlite:{id}")),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let s = std::fs::read_to_string(&file).map_err(io)?;
                Ok(format!("sqlite:{}", s.trim()))
            }
            Err(e) => Err(io(e)),
        }
    }

    fn create_branch(
        &self,
        name: &str,
        snapshot: SnapshotId,
        state: BranchState,
    ) -> Result<BranchId, MetaError> {
        let p = &self.path;
        let conn = self.conn();
        let now = crate::lease::now_ms();
        let n = conn
            .execute(
                "INSERT INTO branches (name, snapshot, state, created_ms, updated_ms)
                 SELECT ?1, id, ?3, ?4, ?4 FROM snapshots WHERE id = ?2 AND state = 'committed'",
                params![name, snapshot.0, state.as_str(), now],
            )
            .map_err(name_taken_or(p, "insert branch", name))?;
        if n != 1 {
            return Err(MetaError::NoSnapshot(snapshot));
        }
        Ok(BranchId(conn.last_insert_rowid()))
    }

    fn update_branch(
        &self,
        id: BranchId,
        snapshot: Option<SnapshotId>,
        state: BranchState,
    ) -> Result<(), MetaError> {
        let p = &self.path;
        let conn = self.conn();
        let now = crate::lease::now_ms();
        let n = conn
            .execute(
                "UPDATE branches SET snapshot = COALESCE(?2, snapshot), state = ?3, updated_ms = ?4
                 WHERE id = ?1",
                params![id.0, snapshot.map(|s| s.0), state.as_str(), now],
            )
            .map_err(name_taken_or(p, "update branch", &format!("branch {id}")))?;
        if n != 1 {
            return Err(MetaError::NoBranch(id.to_string()));
        }
        Ok(())
    }

    fn branches(&self) -> Result<Vec<BranchRow>, MetaError> {
        let rows = query_all(
            &self.conn(),
            &self.path,
            "read branches",
            &format!("SELECT {BRANCH_COLS} FROM branches ORDER BY id"),
            [],
            Self::branch_from_row,
        )?;
        rows.into_iter().map(Self::fix_state).collect()
    }

    fn branch(&self, name: &str) -> Result<Option<BranchRow>, MetaError> {
        let row = self
            .conn()
            .query_row(
                &format!("SELECT {BRANCH_COLS} FROM branches WHERE name = ?1 AND state != 'gone'"),
                [name],
                Self::branch_from_row,
            )
            .optional()
            .map_err(sq(&self.path, "read branch"))?;
        row.map(Self::fix_state).transpose()
    }

    fn reap_pending(&self, gone: &dyn Fn(&str, i64) -> bool) -> Result<Vec<SnapshotId>, MetaError> {
        self.write(|tx, p| {
            let pending: Vec<(i64, Option<String>, Option<i64>)> = query_all(
                tx,
                p,
                "read pending",
                "SELECT id, lease_owner, lease_expires_ms FROM snapshots WHERE state = 'pending'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )?;
            let mut reaped = Vec::new();
            for (id, owner, exp) in pending {
                if lease_gone(gone, owner, exp) {
                    delete_pending(tx, p, SnapshotId(id))?;
                    reaped.push(SnapshotId(id));
                }
            }
            Ok(reaped)
        })
    }

    fn prune_snapshots(&self) -> Result<Vec<SnapshotId>, MetaError> {
        self.write(|tx, p| {
            let mut pruned = Vec::new();
            loop {
                let leaves: Vec<i64> = query_all(
                    tx,
                    p,
                    "read leaves",
                    "SELECT s.id FROM snapshots s WHERE s.state = 'committed'
                     AND NOT EXISTS (SELECT 1 FROM snapshots c WHERE c.parent = s.id)
                     AND NOT EXISTS (SELECT 1 FROM branches b WHERE b.snapshot = s.id
                                     AND b.state != 'gone')",
                    [],
                    |r| r.get(0),
                )?;
                if leaves.is_empty() {
                    break;
                }
                for id in leaves {
                    // Gone branches of this snapshot go with it.
                    tx.execute("DELETE FROM branches WHERE snapshot = ?1", [id])
                        .map_err(sq(p, "delete branches"))?;
                    delete_snapshot_rows(tx, p, SnapshotId(id))?;
                    pruned.push(SnapshotId(id));
                }
            }
            Ok(pruned)
        })
    }

    fn gc_mark(
        &self,
        lease: &Lease,
        objects: &[ChunkId],
        gone: &dyn Fn(&str, i64) -> bool,
    ) -> Result<Vec<(ChunkId, u64)>, MetaError> {
        let ids = self.write(|tx, p| {
            // Working-set packs some snapshot row names are not chunks and
            // not garbage: a writer names its pack before putting it, so an
            // object listed before this transaction is either named here or
            // its snapshot is gone (reaped, pruned, aborted).
            let packs: HashSet<Vec<u8>> = query_all(
                tx,
                p,
                "read packs",
                "SELECT pack FROM snapshots WHERE pack IS NOT NULL",
                [],
                |r| r.get(0),
            )?
            .into_iter()
            .collect();
            // Objects with no row: adopt them as 'deleting' rows, so a writer
            // that wants one waits for this gc instead of trusting a doomed
            // object.
            {
                let mut ins = tx
                    .prepare_cached(
                        "INSERT INTO chunks (hash, stored_len, raw_len, stored, state)
                         VALUES (?1, 0, 0, 0, 'deleting') ON CONFLICT (hash) DO NOTHING",
                    )
                    .map_err(sq(p, "prepare"))?;
                for o in objects.iter().filter(|o| !packs.contains(&o.0[..])) {
                    ins.execute([&o.0[..]]).map_err(sq(p, "adopt orphan"))?;
                }
            }
            // Rows a gone gc left 'deleting': take them over.
            let stale: Vec<(i64, Option<String>, Option<i64>)> = query_all(
                tx,
                p,
                "read deleting",
                "SELECT id, gc_owner, gc_expires_ms FROM chunks WHERE state = 'deleting'",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )?;
            {
                let mut own = tx
                    .prepare_cached("UPDATE chunks SET gc_owner = ?2, gc_expires_ms = ?3 WHERE id = ?1")
                    .map_err(sq(p, "prepare"))?;
                for (id, owner, exp) in stale {
                    if lease_gone(gone, owner, exp) {
                        own.execute(params![id, lease.owner, lease.expires_ms])
                            .map_err(sq(p, "own deleting"))?;
                    }
                }
            }
            tx.execute(
                "UPDATE chunks SET state = 'deleting', gc_owner = ?1, gc_expires_ms = ?2
                 WHERE state = 'live' AND NOT EXISTS (SELECT 1 FROM windows w WHERE w.chunk = chunks.id)",
                params![lease.owner, lease.expires_ms],
            )
            .map_err(sq(p, "mark"))?;
            let ids: Vec<(Vec<u8>, i64)> = query_all(
                tx,
                p,
                "read marked",
                "SELECT hash, stored_len FROM chunks WHERE state = 'deleting' AND gc_owner = ?1",
                [&lease.owner],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )?;
            Ok(ids)
        })?;
        ids.into_iter()
            .map(|(h, len)| Ok((hash_of(h)?, len as u64)))
            .collect()
    }

    fn gc_forget(&self, owner: &str, ids: &[ChunkId]) -> Result<(), MetaError> {
        self.write(|tx, p| {
            let mut st = tx
                .prepare_cached(
                    "DELETE FROM chunks WHERE hash = ?1 AND state = 'deleting' AND gc_owner = ?2",
                )
                .map_err(sq(p, "prepare"))?;
            for id in ids {
                st.execute(params![&id.0[..], owner])
                    .map_err(sq(p, "forget chunk"))?;
            }
            Ok(())
        })
    }
}

/// A snapshot's state (`pending`, `committed`), None when there is no such
/// snapshot; `what` names the read in errors.
fn snapshot_state(
    tx: &rusqlite::Transaction<'_>,
    p: &Path,
    snapshot: SnapshotId,
    what: &'static str,
) -> Result<Option<String>, MetaError> {
    tx.query_row(
        "SELECT state FROM snapshots WHERE id = ?1",
        [snapshot.0],
        |r| r.get(0),
    )
    .optional()
    .map_err(sq(p, what))
}

/// Deletes a pending snapshot's rows (layers, windows, blobs cascade).
fn delete_pending(
    tx: &rusqlite::Transaction<'_>,
    p: &Path,
    snapshot: SnapshotId,
) -> Result<(), MetaError> {
    match snapshot_state(tx, p, snapshot, "read snapshot")?.as_deref() {
        None => Ok(()),
        Some("pending") => delete_snapshot_rows(tx, p, snapshot),
        Some(_) => Err(MetaError::NotPending(snapshot)),
    }
}

fn delete_snapshot_rows(
    tx: &rusqlite::Transaction<'_>,
    p: &Path,
    snapshot: SnapshotId,
) -> Result<(), MetaError> {
    let children: i64 = tx
        .query_row(
            "SELECT COUNT(*) FROM snapshots WHERE parent = ?1",
            [snapshot.0],
            |r| r.get(0),
        )
        .map_err(sq(p, "count children"))?;
    let live_branches: i64 = tx
        .query_row(
            "SELECT COUNT(*) FROM branches WHERE snapshot = ?1",
            [snapshot.0],
            |r| r.get(0),
        )
        .map_err(sq(p, "count branches"))?;
    if children != 0 || live_branches != 0 {
        return Err(MetaError::InUse(snapshot));
    }
    // Layers of this snapshot are parents only of its children's layers,
    // and it has none; windows and blobs cascade.
    tx.execute("DELETE FROM layers WHERE snapshot = ?1", [snapshot.0])
        .map_err(sq(p, "delete layers"))?;
    tx.execute("DELETE FROM snapshots WHERE id = ?1", [snapshot.0])
        .map_err(sq(p, "delete snapshot"))?;
    Ok(())
}
