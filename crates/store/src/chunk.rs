//! Chunks: the unit that is stored, deduplicated and moved between hosts.
//!
//! A chunk's id is the BLAKE3 hash of its uncompressed bytes; what a
//! backend holds under that id is one zstd frame of those bytes. Every
//! read decompresses and hashes again ([`decode`]), so a corrupted or
//! swapped object is never handed out as data.

use std::fmt;
use std::str::FromStr;

/// The BLAKE3 hash of a chunk's uncompressed bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub [u8; 32]);

impl ChunkId {
    /// The id of `data`.
    pub fn of(data: &[u8]) -> ChunkId {
        ChunkId(*blake3::hash(data).as_bytes())
    }

    /// 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(char::from(HEX[usize::from(b >> 4)]));
            s.push(char::from(HEX[usize::from(b & 15)]));
        }
        s
    }

    /// The first 12 hex digits, for messages.
    pub fn short(&self) -> String {
        self.to_hex()[..12].to_owned()
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkId({})", self.short())
    }
}

/// A string that is not 64 hex digits.
#[derive(Debug, thiserror::Error)]
#[error("{0:?} is not a chunk id (64 hex digits)")]
pub struct BadChunkId(pub String);

impl FromStr for ChunkId {
    type Err = BadChunkId;
    fn from_str(s: &str) -> Result<ChunkId, BadChunkId> {
        let b = s.as_bytes();
        if b.len() != 64 {
            return Err(BadChunkId(s.into()));
        }
        let nib = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        };
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            match (nib(b[2 * i]), nib(b[2 * i + 1])) {
                (Some(h), Some(l)) => *o = h << 4 | l,
                _ => return Err(BadChunkId(s.into())),
            }
        }
        Ok(ChunkId(out))
    }
}

impl serde::Serialize for ChunkId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> serde::Deserialize<'de> for ChunkId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ChunkId, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Why stored bytes are not the chunk they claim to be.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    #[error("not a valid zstd frame: {0}")]
    Zstd(std::io::Error),
    #[error("decompresses to {found} bytes, more than the {limit}-byte limit")]
    TooLarge { found: u64, limit: u64 },
    #[error("its bytes hash to {0}")]
    HashMismatch(ChunkId),
}

/// Compresses `data` (the stored form of a chunk). `level` is zstd's.
pub fn encode(data: &[u8], level: i32) -> std::io::Result<Vec<u8>> {
    zstd::bulk::compress(data, level)
}

/// Decompresses stored bytes and checks they hash to `id`. `limit` bounds
/// the decompressed size (a chunk is at most one window), so a hostile
/// object cannot make us allocate without bound.
pub fn decode(id: &ChunkId, stored: &[u8], limit: usize) -> Result<Vec<u8>, DecodeError> {
    let mut out = Vec::with_capacity(limit.min(stored.len().saturating_mul(8)));
    let dec = zstd::stream::Decoder::new(stored).map_err(DecodeError::Zstd)?;
    let mut dec = std::io::Read::take(dec, limit as u64 + 1);
    std::io::Read::read_to_end(&mut dec, &mut out).map_err(DecodeError::Zstd)?;
    if out.len() > limit {
        return Err(DecodeError::TooLarge {
            found: out.len() as u64,
            limit: limit as u64,
        });
    }
    let got = ChunkId::of(&out);
    if got != *id {
        return Err(DecodeError::HashMismatch(got));
    }
    Ok(out)
}

/// True when every byte of `data` is zero (a window that needs no chunk).
pub fn is_zero(data: &[u8]) -> bool {
    // Compare eight bytes at a time: this runs on every window of every layer.
    let (pre, mid, post) = {
        // SAFETY: any byte pattern is a valid u64; align_to only hands out
        // the aligned middle part as u64s.
        unsafe { data.align_to::<u64>() }
    };
    pre.iter().all(|&b| b == 0) && mid.iter().all(|&w| w == 0) && post.iter().all(|&b| b == 0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let id = ChunkId::of(b"hello");
        let s = id.to_hex();
        assert_eq!(s, blake3::hash(b"hello").to_hex().as_str());
        assert_eq!(s.parse::<ChunkId>().unwrap(), id);
        assert!("xyz".parse::<ChunkId>().is_err());
        assert!(s.to_uppercase().parse::<ChunkId>().is_err());
    }

    #[test]
    fn encode_decode_verifies() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let id = ChunkId::of(&data);
        let enc = encode(&data, 3).unwrap();
        assert!(enc.len() < data.len() / 10);
        assert_eq!(decode(&id, &enc, data.len()).unwrap(), data);
        // Another chunk's bytes under this id.
        let other = encode(b"other", 3).unwrap();
        assert!(matches!(
            decode(&id, &other, data.len()),
            Err(DecodeError::HashMismatch(_))
        ));
        // Garbage.
        assert!(matches!(
            decode(&id, b"garbage", data.len()),
            Err(DecodeError::Zstd(_))
        ));
        // Over the limit.
        assert!(matches!(
            decode(&id, &enc, 1000),
            Err(DecodeError::TooLarge { .. })
        ));
    }

    #[test]
    fn zero_detection() {
        let mut v = vec![0u8; 4099];
        assert!(is_zero(&v));
        assert!(is_zero(&v[1..]));
        v[4098] = 1;
        assert!(!is_zero(&v));
        v[4098] = 0;
        v[0] = 1;
        assert!(!is_zero(&v));
        assert!(is_zero(&[]));
    }
}
