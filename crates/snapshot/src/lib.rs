//! The snapshot state format: one envelope for every saved state, with the
//! magic, format version and CRC in one place.
//!
//! Layout of an encoded state: `MAGIC` (8 bytes) | format version (u32 LE) |
//! payload length (u64 LE) | payload (JSON of the state struct) | CRC32 of
//! everything before it (u32 LE). Device and vCPU state structs are plain
//! serde data defined next to their owners; only this crate knows how they
//! are framed and which versions a loader accepts.

pub mod compat;
pub mod template;

use serde::de::DeserializeOwned;
use serde::Serialize;

/// Identifies a tine state blob.
pub const MAGIC: [u8; 8] = *b"TINESTAT";
/// Version of the state format written by this build. 2: each virtio
/// device's own state is typed (`MmioState::device`), where 1 had untyped
/// JSON or nothing.
pub const FORMAT_VERSION: u32 = 2;
/// Largest payload a loader accepts (guards against corrupt lengths).
pub const MAX_PAYLOAD: u64 = 64 << 20;

const HEADER_LEN: usize = 8 + 4 + 8;

/// Why a state blob was refused.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("Not a tine state file (bad magic)")]
    BadMagic,
    #[error("State format version {found} is not supported by this tine (reads version {FORMAT_VERSION}); use the tine that wrote it")]
    Version { found: u32 },
    #[error("State file is truncated ({0} bytes)")]
    Truncated(usize),
    #[error("State payload of {0} bytes exceeds the {MAX_PAYLOAD}-byte limit")]
    TooLarge(u64),
    #[error("State file is corrupt (CRC mismatch)")]
    Crc,
    #[error("Cannot encode state")]
    Encode(#[source] serde_json::Error),
    #[error("Cannot decode state")]
    Decode(#[source] serde_json::Error),
}

/// Frames `state` in the versioned envelope.
pub fn encode<T: Serialize>(state: &T) -> Result<Vec<u8>, StateError> {
    let payload = serde_json::to_vec(state).map_err(StateError::Encode)?;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len() + 4);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&payload);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// Checks the envelope and decodes the state inside.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, StateError> {
    if bytes.len() < HEADER_LEN + 4 {
        return Err(StateError::Truncated(bytes.len()));
    }
    if bytes[..8] != MAGIC {
        return Err(StateError::BadMagic);
    }
    let mut v = [0u8; 4];
    v.copy_from_slice(&bytes[8..12]);
    let version = u32::from_le_bytes(v);
    if version != FORMAT_VERSION {
        return Err(StateError::Version { found: version });
    }
    let mut l = [0u8; 8];
    l.copy_from_slice(&bytes[12..20]);
    let len = u64::from_le_bytes(l);
    if len > MAX_PAYLOAD {
        return Err(StateError::TooLarge(len));
    }
    let end = HEADER_LEN + len as usize;
    if bytes.len() != end + 4 {
        return Err(StateError::Truncated(bytes.len()));
    }
    let mut c = [0u8; 4];
    c.copy_from_slice(&bytes[end..]);
    if crc32fast::hash(&bytes[..end]) != u32::from_le_bytes(c) {
        return Err(StateError::Crc);
    }
    serde_json::from_slice(&bytes[HEADER_LEN..end]).map_err(StateError::Decode)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct S {
        a: u64,
        b: Vec<u8>,
    }

    #[test]
    fn test_encode_decode_roundtrip() {
        let s = S {
            a: 7,
            b: vec![1, 2, 3],
        };
        let bytes = encode(&s).expect("encode");
        let back: S = decode(&bytes).expect("decode");
        assert_eq!(back, s);
        assert_eq!(encode(&back).expect("encode"), bytes);
    }

    #[test]
    fn test_decode_refuses_corruption_and_other_versions() {
        let mut bytes = encode(&S { a: 1, b: vec![] }).expect("encode");
        assert!(matches!(
            decode::<S>(&bytes[..10]),
            Err(StateError::Truncated(_))
        ));
        let mut bad = bytes.clone();
        bad[0] = b'X';
        assert!(matches!(decode::<S>(&bad), Err(StateError::BadMagic)));
        let mut bad = bytes.clone();
        bad[8] = 99;
        assert!(matches!(
            decode::<S>(&bad),
            Err(StateError::Version { found: 99 })
        ));
        // A state of the previous format is refused by name, not misread.
        let mut old = bytes.clone();
        old[8..12].copy_from_slice(&1u32.to_le_bytes());
        let e = decode::<S>(&old).expect_err("format 1");
        assert!(matches!(e, StateError::Version { found: 1 }));
        assert_eq!(
            e.to_string(),
            format!(
                "State format version 1 is not supported by this tine (reads version {FORMAT_VERSION}); use the tine that wrote it"
            )
        );
        let n = bytes.len();
        bytes[n - 6] ^= 0xff;
        assert!(matches!(decode::<S>(&bytes), Err(StateError::Crc)));
    }
}
