//! Fault injection for crash tests: `TINE_STORE_FAULT` names a point at
//! which the process calls abort(3) (as sudden as SIGKILL for the store:
//! no destructor, no flush, no rollback).
//!
//! | value | where |
//! | --- | --- |
//! | `chunk-temp:N` | the Nth chunk file is written to its temporary name, not yet renamed (local backend) |
//! | `mid-chunks:N` | right after the Nth chunk put of this process is acknowledged, before the tree records it as stored |
//! | `after-chunks` | a snapshot's layers are all durable, its blobs and working set not yet written |
//! | `pack-put` | the working-set pack is durable and named by the pending row, not yet committed |
//! | `before-commit` | everything is written, the commit transaction not yet run |
//! | `after-commit` | the snapshot has committed, the call has not returned |
//! | `gc-mid:N` | gc has deleted N chunk objects but not yet forgotten their rows |

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Where a fault can be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    ChunkTemp,
    MidChunks,
    AfterChunks,
    PackPut,
    BeforeCommit,
    AfterCommit,
    GcMid,
}

impl Point {
    fn name(self) -> &'static str {
        match self {
            Point::ChunkTemp => "chunk-temp",
            Point::MidChunks => "mid-chunks",
            Point::AfterChunks => "after-chunks",
            Point::PackPut => "pack-put",
            Point::BeforeCommit => "before-commit",
            Point::AfterCommit => "after-commit",
            Point::GcMid => "gc-mid",
        }
    }
}

/// The environment variable.
pub const ENV: &str = "TINE_STORE_FAULT";

struct Armed {
    point: &'static str,
    after: u64,
    seen: AtomicU64,
}

fn armed() -> Option<&'static Armed> {
    static ARMED: OnceLock<Option<Armed>> = OnceLock::new();
    ARMED
        .get_or_init(|| {
            let v = std::env::var(ENV).ok()?;
            let (name, n) = match v.split_once(':') {
                Some((a, b)) => (a.to_owned(), b.trim().parse().ok()?),
                None => (v.clone(), 1),
            };
            let all = [
                Point::ChunkTemp,
                Point::MidChunks,
                Point::AfterChunks,
                Point::PackPut,
                Point::BeforeCommit,
                Point::AfterCommit,
                Point::GcMid,
            ];
            let point = all.iter().find(|p| p.name() == name)?.name();
            Some(Armed {
                point,
                after: n,
                seen: AtomicU64::new(0),
            })
        })
        .as_ref()
}

/// Aborts the process if `TINE_STORE_FAULT` names `p` and this is its
/// Nth passage (N = 1 when not given).
pub fn point(p: Point) {
    let Some(a) = armed() else { return };
    if a.point != p.name() {
        return;
    }
    let n = a.seen.fetch_add(1, Ordering::SeqCst) + 1;
    if n == a.after {
        eprintln!("tine-store: {ENV}={}:{n}: aborting here", a.point);
        std::process::abort();
    }
}
