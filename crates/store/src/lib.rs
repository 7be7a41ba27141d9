//! tine's snapshot tree store.
//!
//! A snapshot is stored as layers (guest memory, each disk), a layer as
//! fixed-size windows, and a window as nothing (look in the parent
//! layer), zero, or a chunk: zstd-compressed bytes named by the BLAKE3
//! hash of their uncompressed form, so siblings and re-snapshots share
//! every identical window automatically. Chunks live in a [`Backend`]
//! (a local directory by default, or S3, with a local cache in front);
//! the tree — snapshots, layers, window → chunk references, branches —
//! lives in a [`Meta`] database (SQLite at `$TINE_HOME/store/tree.db`, or
//! PostgreSQL shared by a fleet: `TINE_META=postgres://…`, [`PgMeta`]).
//!
//! The calls a caller makes:
//!
//! ```no_run
//! # fn main() -> Result<(), store::StoreError> {
//! use store::{BranchChange, BranchState, Dirty, LayerKind, NoProgress, Store};
//! let store = Store::open_home(std::path::Path::new("/root/.cache/tine"))?;
//! let memory = std::fs::File::open("snap/memory").expect("memory file");
//! // Sleep: write a snapshot, commit it with the branch's new state.
//! let mut w = store.begin(None, r#"{"name":"a"}"#)?;
//! w.put_layer(LayerKind::Memory, &memory, &Dirty::All, &NoProgress)?;
//! w.put_blob("state", b"vcpu and device state".to_vec());
//! let (snap, _branch) = w.commit_branch(BranchChange::Create {
//!     name: "a".into(),
//!     state: BranchState::Sleeping,
//! })?;
//! // Wake: read the memory layer window by window (or restore it whole).
//! let view = store.layer(snap, LayerKind::Memory)?;
//! let mut buf = vec![0u8; view.window_size() as usize];
//! view.read_window(0, &mut buf)?;
//! # Ok(()) }
//! ```
//!
//! Crash safety: a snapshot is visible only once its row commits, which
//! happens after every chunk it references is durable; gc never deletes
//! a chunk a committed snapshot (or a live writer) references. See
//! [`meta`] for the protocol and docs/design/store.md for the choices and
//! measurements.

pub mod backend;
pub mod chunk;
pub mod chunks;
pub mod claim;
pub mod fault;
pub mod layer;
pub mod lease;
pub mod meta;
pub mod meta_pg;
pub mod pack;
pub mod progress;
pub mod s3;
mod store;
mod writer;

pub use backend::{Backend, BackendError, LocalBackend};
pub use chunk::ChunkId;
pub use chunks::{ChunkCounters, ChunkError};
pub use layer::{Dirty, FnSink, FnSource, LayerView, RestoreStats, Sink, Source, Window};
pub use meta::{
    BranchChange, BranchId, BranchRow, BranchState, LayerId, LayerKind, LayerRow, Meta, MetaError,
    Sizes, SnapshotId, SnapshotState, SqliteMeta, Totals,
};
pub use meta_pg::PgMeta;
pub use progress::{FnProgress, NoProgress, Progress};
pub use s3::{S3Backend, S3Config};
pub use store::{
    BackendConfig, ChunkProblem, GcOptions, GcReport, LayerStats, MetaConfig, PackFetch,
    PackProblem, SnapshotInfo, Store, StoreConfig, StoreError, Tree, TreeSnapshot, VerifyReport,
    BACKEND_ENV, DEFAULT_WINDOW_SIZE, DEFAULT_ZSTD_LEVEL, MAX_WINDOW_SIZE, META_ENV,
};
pub use writer::SnapshotWriter;

#[cfg(test)]
mod tests {
    /// What the CLI and the VMM move between threads and into anyhow.
    #[test]
    fn public_types_are_send_and_sync() {
        fn check<T: Send + Sync + 'static>() {}
        check::<crate::Store>();
        check::<crate::LayerView>();
        check::<crate::SnapshotWriter>();
        check::<crate::StoreError>();
        check::<crate::Tree>();
        check::<crate::VerifyReport>();
    }
}
