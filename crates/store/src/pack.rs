//! Working-set packs: the stored (compressed) bytes of the chunks a
//! snapshot's working set needs, laid end to end in ONE backend object,
//! so a cold wake fetches them with a few (ranged) GETs instead of one
//! GET per 256 KiB chunk. On S3 per-request cost dominates such small
//! objects (docs/design/store.md, "working-set packs").
//!
//! Layout (integers little-endian):
//!
//! ```text
//! "TINEPK01" | snapshot: u64 | count: u32 | count × (id: 32 bytes, stored_len: u32, raw_len: u32) | stored bytes…
//! ```
//!
//! The pack's object id is the BLAKE3 of all its bytes, so it lives in
//! the backend's chunk namespace and put/get/exists/delete need nothing
//! new. The snapshot id in the header makes every snapshot's pack its
//! own object (ids are never reused): two snapshots never share a pack,
//! so gc deleting one snapshot's pack can never race another's commit of
//! the same bytes, and a pack named by the wrong row is detected. The index is not trusted: every entry is decoded and hashed
//! exactly as a chunk read is ([`crate::chunk::decode`]).

use crate::chunk::{self, ChunkId, DecodeError};

const MAGIC: &[u8; 8] = b"TINEPK01";
const ENTRY: usize = 32 + 4 + 4;
const HEADER: usize = MAGIC.len() + 8 + 4;

/// Why a pack's bytes cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error("not a working-set pack (bad magic or shorter than its header)")]
    NotAPack,
    #[error("it is the pack of snapshot {0}")]
    OtherSnapshot(u64),
    #[error("its index says {want} bytes, the object has {have}")]
    Length { want: u64, have: u64 },
    #[error("entry {index}: chunk {chunk}: {reason}")]
    Chunk {
        index: usize,
        chunk: ChunkId,
        #[source]
        reason: DecodeError,
    },
    #[error("entry {index}: chunk {chunk} claims {raw_len} bytes, has {found}")]
    RawLen {
        index: usize,
        chunk: ChunkId,
        raw_len: u32,
        found: u64,
    },
    #[error(
        "entry {index}: chunk {chunk} claims {raw_len} bytes, more than the {limit}-byte window"
    )]
    TooLarge {
        index: usize,
        chunk: ChunkId,
        raw_len: u32,
        limit: u64,
    },
}

/// One chunk of a pack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackEntry {
    pub id: ChunkId,
    pub stored_len: u32,
    pub raw_len: u32,
}

/// Builds snapshot `snapshot`'s pack of `(id, raw_len, stored bytes)`.
pub fn build(snapshot: u64, entries: &[(ChunkId, u32, Vec<u8>)]) -> Vec<u8> {
    let data: usize = entries.iter().map(|(_, _, s)| s.len()).sum();
    let mut out = Vec::with_capacity(HEADER + entries.len() * ENTRY + data);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&snapshot.to_le_bytes());
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    for (id, raw_len, stored) in entries {
        out.extend_from_slice(&id.0);
        out.extend_from_slice(&(stored.len() as u32).to_le_bytes());
        out.extend_from_slice(&raw_len.to_le_bytes());
    }
    for (_, _, stored) in entries {
        out.extend_from_slice(stored);
    }
    out
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    let s: [u8; 4] = b.get(at..at + 4)?.try_into().ok()?;
    Some(u32::from_le_bytes(s))
}

/// The index of snapshot `snapshot`'s pack and where its data starts;
/// checks the header names that snapshot and the lengths add up to the
/// object's size.
pub fn index(pack: &[u8], snapshot: u64) -> Result<(Vec<PackEntry>, usize), PackError> {
    index_of_prefix(pack, snapshot, pack.len() as u64)
}

/// Bytes of a pack's start that hold its header and the index of up to
/// this many entries' worth: a first ranged read (see [`index_len`]).
pub const PROBE: u64 = (HEADER + 2048 * ENTRY) as u64;

/// How many bytes of a pack's start hold its whole index, from a prefix
/// of at least the header; None if `prefix` is not a pack's.
pub fn index_len(prefix: &[u8]) -> Option<u64> {
    if prefix.get(..MAGIC.len()) != Some(&MAGIC[..]) {
        return None;
    }
    let count = u64::from(u32_at(prefix, MAGIC.len() + 8)?);
    Some(HEADER as u64 + count * ENTRY as u64)
}

/// [`index`] from the first bytes of a pack of `total` bytes (at least
/// its header and index).
pub fn index_of_prefix(
    pack: &[u8],
    snapshot: u64,
    total: u64,
) -> Result<(Vec<PackEntry>, usize), PackError> {
    if pack.get(..MAGIC.len()) != Some(&MAGIC[..]) {
        return Err(PackError::NotAPack);
    }
    let owner = pack
        .get(MAGIC.len()..MAGIC.len() + 8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .map(u64::from_le_bytes)
        .ok_or(PackError::NotAPack)?;
    if owner != snapshot {
        return Err(PackError::OtherSnapshot(owner));
    }
    let count = u32_at(pack, MAGIC.len() + 8).ok_or(PackError::NotAPack)? as usize;
    let data_at = count
        .checked_mul(ENTRY)
        .and_then(|n| n.checked_add(HEADER))
        .ok_or(PackError::NotAPack)?;
    if data_at > pack.len() {
        return Err(PackError::Length {
            want: data_at as u64,
            have: pack.len().min(total as usize) as u64,
        });
    }
    let mut entries = Vec::with_capacity(count);
    let mut sum = data_at as u64;
    for i in 0..count {
        let at = HEADER + i * ENTRY;
        let mut id = [0u8; 32];
        id.copy_from_slice(&pack[at..at + 32]);
        let stored_len = u32_at(pack, at + 32).ok_or(PackError::NotAPack)?;
        let raw_len = u32_at(pack, at + 36).ok_or(PackError::NotAPack)?;
        sum += u64::from(stored_len);
        entries.push(PackEntry {
            id: ChunkId(id),
            stored_len,
            raw_len,
        });
    }
    if sum != total {
        return Err(PackError::Length {
            want: sum,
            have: total,
        });
    }
    Ok((entries, data_at))
}

/// Checks entry `index` of a pack (its stored bytes `stored`) exactly as
/// a chunk read does: decoded with its size bounded by `limit`, hashed,
/// and its length matching the index.
pub fn check_entry(
    index: usize,
    e: &PackEntry,
    stored: &[u8],
    limit: u64,
) -> Result<(), PackError> {
    if u64::from(e.raw_len) > limit {
        return Err(PackError::TooLarge {
            index,
            chunk: e.id,
            raw_len: e.raw_len,
            limit,
        });
    }
    let data =
        chunk::decode(&e.id, stored, e.raw_len as usize).map_err(|reason| PackError::Chunk {
            index,
            chunk: e.id,
            reason,
        })?;
    if data.len() != e.raw_len as usize {
        return Err(PackError::RawLen {
            index,
            chunk: e.id,
            raw_len: e.raw_len,
            found: data.len() as u64,
        });
    }
    Ok(())
}

/// Every chunk of `pack`, each checked ([`check_entry`]); returns (entry,
/// its stored bytes). The first bad entry is the error.
pub fn verified(
    pack: &[u8],
    snapshot: u64,
    limit: u64,
) -> Result<Vec<(PackEntry, &[u8])>, PackError> {
    let (entries, mut at) = index(pack, snapshot)?;
    let mut out = Vec::with_capacity(entries.len());
    for (i, e) in entries.into_iter().enumerate() {
        let stored = &pack[at..at + e.stored_len as usize];
        at += e.stored_len as usize;
        check_entry(i, &e, stored, limit)?;
        out.push((e, stored));
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn entry(data: &[u8]) -> (ChunkId, u32, Vec<u8>) {
        (
            ChunkId::of(data),
            data.len() as u32,
            chunk::encode(data, 1).unwrap(),
        )
    }

    #[test]
    fn round_trip_and_every_flipped_byte_is_caught() {
        let a = vec![7u8; 4096];
        let b: Vec<u8> = (0..8192u32).map(|i| (i * 31 % 251) as u8).collect();
        let pack = build(5, &[entry(&a), entry(&b)]);
        let got = verified(&pack, 5, 1 << 20).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].0.id, ChunkId::of(&a));
        assert_eq!(got[1].0.id, ChunkId::of(&b));
        assert_eq!(verified(&build(5, &[]), 5, 1 << 20).unwrap().len(), 0);
        for i in 0..pack.len() {
            let mut bad = pack.clone();
            bad[i] ^= 0x40;
            assert!(
                verified(&bad, 5, 1 << 20).is_err(),
                "byte {i} flipped went unnoticed"
            );
        }
        assert!(verified(&pack[..pack.len() - 1], 5, 1 << 20).is_err());
        assert!(matches!(
            verified(&pack, 6, 1 << 20),
            Err(PackError::OtherSnapshot(5))
        ));
        assert!(matches!(
            verified(&pack, 5, 4096),
            Err(PackError::TooLarge { index: 1, .. })
        ));
    }
}
