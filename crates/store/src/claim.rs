//! A remote bucket belongs to one tree: the claim object.
//!
//! gc deletes every chunk no window of *its* metadata references, and
//! every object its metadata has no row for. Two hosts with separate
//! metadata (each its own SQLite file) on one bucket would therefore
//! delete each other's chunks: host B's gc once deleted all 67 chunks of
//! host A's snapshots. So the first write or gc on a remote backend puts
//! a claim object naming the metadata database's identity
//! ([`Meta::identity`]), and every later write and gc checks it: a store
//! whose metadata is not the claimant's is refused, before anything is
//! written or deleted, with what to do (share the metadata, PostgreSQL,
//! or take another prefix). Hosts on one PostgreSQL database share its
//! identity, so they share the bucket.
//!
//! The claim is an object under a reserved id (all zero bytes: no chunk's
//! BLAKE3 hash), so it needs nothing the backend does not already do;
//! gc and verify pass over it. Two first writers racing on an empty
//! bucket could both put a claim; the later one wins, and the earlier
//! host's next write or gc is refused (it re-reads the claim each time
//! it starts one), before its gc could delete anything.

use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::chunk::ChunkId;
use crate::meta::Meta;
use crate::store::StoreError;

/// The claim object's id.
pub const CLAIM_ID: ChunkId = ChunkId([0; 32]);

#[derive(Debug, Serialize, Deserialize)]
struct Claim {
    /// The metadata database's identity.
    meta: String,
    /// Where it was, for the message (no password).
    described: String,
    created_ms: i64,
}

/// Claims `backend` for `meta` if it is unclaimed; fails if another
/// metadata database holds it.
pub fn ensure(backend: &dyn Backend, meta: &dyn Meta) -> Result<(), StoreError> {
    let mine = meta.identity()?;
    let read = |b: &dyn Backend| -> Result<Option<Claim>, StoreError> {
        match b.get(&CLAIM_ID)? {
            None => Ok(None),
            Some(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
                StoreError::Invalid(format!(
                    "{}: its claim object ({}) is not a tine claim: {e}; remove it only if no other tine tree uses this bucket",
                    b.describe(),
                    CLAIM_ID
                ))
            }),
        }
    };
    let claim = match read(backend)? {
        Some(c) => c,
        None => {
            let c = Claim {
                meta: mine.clone(),
                described: meta.describe(),
                created_ms: crate::lease::now_ms(),
            };
            let bytes = serde_json::to_vec(&c)
                .map_err(|e| StoreError::Invalid(format!("the claim: {e}")))?;
            backend.put(&CLAIM_ID, &bytes)?;
            // A racing first writer may have put its own: read back.
            read(backend)?.unwrap_or(c)
        }
    };
    if claim.meta != mine {
        return Err(StoreError::ForeignBucket {
            bucket: backend.describe(),
            owner: claim.described,
            ours: meta.describe(),
        });
    }
    Ok(())
}
