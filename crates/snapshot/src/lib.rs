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
mod version;

use serde::de::DeserializeOwned;
use serde::Serialize;

pub use version::{Version, VersionError};

/// Identifies a tine state blob.
pub const MAGIC: [u8; 8] = *b"TINESTAT";
/// Version of the state format written by this build. A loader reads a
/// state of the same major version and a minor version no newer than its
/// own (Firecracker's rule): a minor bump adds only fields with defaults,
/// anything else is a major bump. `crates/vmm/tests/format.rs` fails when
/// the state's schema changes without a bump.
///
/// - 2: each virtio device's own state is typed (`MmioState::device`).
/// - 3.0: the envelope is sealed (BLAKE3, keyed by a host key when one is
///   configured) and binds the snapshot's manifest; state structs refuse
///   unknown fields.
pub const FORMAT_VERSION: Version = Version::new(3, 0);
/// Largest payload a loader accepts (guards against corrupt lengths).
pub const MAX_PAYLOAD: u64 = 64 << 20;
/// Environment variable naming a file holding this host's snapshot key
/// (64 hex digits). With a key, every state is sealed with a keyed BLAKE3
/// MAC and a state sealed without it (or with another key) is refused.
pub const KEY_ENV: &str = "TINE_SNAPSHOT_KEY_FILE";

const DIGEST_LEN: usize = 32;
/// Magic, major, minor, flags, payload length, manifest digest.
const HEADER_LEN: usize = 8 + 2 + 2 + 4 + 8 + DIGEST_LEN;
const TAG_LEN: usize = 32;
/// Header flag: the tag is keyed with the host key.
const FLAG_KEYED: u32 = 1;

/// Why a state blob was refused.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("Not a tine state file (bad magic)")]
    BadMagic,
    #[error("State format {found} cannot be read by this tine, which reads {FORMAT_VERSION} and older minor versions of {}.x; use a tine that reads it", FORMAT_VERSION.major)]
    Version { found: Version },
    #[error("State file is truncated ({0} bytes)")]
    Truncated(usize),
    #[error("State payload of {0} bytes exceeds the {MAX_PAYLOAD}-byte limit")]
    TooLarge(u64),
    #[error("State file is corrupt or was altered (its checksum does not match)")]
    Checksum,
    #[error("The state was written for another manifest: manifest.json was altered or comes from another snapshot")]
    ManifestMismatch,
    #[error("The state is sealed with a host key, and this host has none ({KEY_ENV} is not set); configure the key of the host that wrote it")]
    KeyMissing,
    #[error("The state is not sealed with this host's key ({KEY_ENV}): it was written by a host without the key, or altered")]
    Unsealed,
    #[error("Unknown flags {0:#x} in the state header")]
    Flags(u32),
    #[error("Cannot read the snapshot key {path}: {reason}")]
    Key { path: String, reason: String },
    #[error("Cannot encode state")]
    Encode(#[source] serde_json::Error),
    #[error("Cannot decode state")]
    Decode(#[source] serde_json::Error),
}

/// How a state is sealed: the manifest it belongs with, and the host key.
#[derive(Clone, Copy, Debug, Default)]
pub struct Seal<'a> {
    /// BLAKE3 of the manifest's bytes (zero for a state with no manifest).
    pub manifest: [u8; DIGEST_LEN],
    pub key: Option<&'a Key>,
}

impl Seal<'_> {
    /// The seal binding `manifest`'s bytes.
    pub fn of_manifest<'k>(manifest: &[u8], key: Option<&'k Key>) -> Seal<'k> {
        Seal {
            manifest: *blake3::hash(manifest).as_bytes(),
            key,
        }
    }
}

/// A host's snapshot key (32 bytes).
#[derive(Clone)]
pub struct Key([u8; 32]);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

impl Key {
    pub fn from_bytes(b: [u8; 32]) -> Key {
        Key(b)
    }

    /// The key named by [`KEY_ENV`], if it is set.
    pub fn from_env() -> Result<Option<Key>, StateError> {
        match std::env::var_os(KEY_ENV) {
            Some(p) if !p.is_empty() => Key::read(std::path::Path::new(&p)).map(Some),
            _ => Ok(None),
        }
    }

    /// Reads a key file: 64 hex digits (whitespace around them ignored).
    pub fn read(path: &std::path::Path) -> Result<Key, StateError> {
        let bad = |reason: String| StateError::Key {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        let hex = text.trim();
        if hex.len() != 64 {
            return Err(bad(format!(
                "it holds {} characters; a key is 64 hex digits",
                hex.len()
            )));
        }
        let mut out = [0u8; 32];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                .map_err(|_| bad("not hex digits".into()))?;
        }
        Ok(Key(out))
    }

    fn tag(&self, bytes: &[u8]) -> [u8; TAG_LEN] {
        *blake3::keyed_hash(&self.0, bytes).as_bytes()
    }
}

/// Frames `state` in the versioned envelope, unbound to any manifest and
/// unkeyed (a state that never leaves this host's processes).
pub fn encode<T: Serialize>(state: &T) -> Result<Vec<u8>, StateError> {
    encode_sealed(state, &Seal::default())
}

/// Frames `state` in the versioned envelope, sealed with `seal`.
pub fn encode_sealed<T: Serialize>(state: &T, seal: &Seal) -> Result<Vec<u8>, StateError> {
    let payload = serde_json::to_vec(state).map_err(StateError::Encode)?;
    Ok(encode_raw(&payload, seal))
}

/// Frames `payload` (a state's JSON, unchecked) in the envelope, sealed
/// with `seal`: for [`encode_sealed`], and for fuzzers that need valid
/// envelopes around arbitrary payloads.
pub fn encode_raw(payload: &[u8], seal: &Seal) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len() + TAG_LEN);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.major.to_le_bytes());
    out.extend_from_slice(&FORMAT_VERSION.minor.to_le_bytes());
    let flags = if seal.key.is_some() { FLAG_KEYED } else { 0 };
    out.extend_from_slice(&flags.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&seal.manifest);
    out.extend_from_slice(payload);
    let tag = match seal.key {
        Some(k) => k.tag(&out),
        None => *blake3::hash(&out).as_bytes(),
    };
    out.extend_from_slice(&tag);
    out
}

/// The format version in a state's header, read before anything else.
pub fn peek_version(bytes: &[u8]) -> Result<Version, StateError> {
    if bytes.len() < 12 {
        return Err(StateError::Truncated(bytes.len()));
    }
    if bytes[..8] != MAGIC {
        return Err(StateError::BadMagic);
    }
    let major = u16::from_le_bytes([bytes[8], bytes[9]]);
    let minor = u16::from_le_bytes([bytes[10], bytes[11]]);
    Ok(Version::new(major, minor))
}

/// Checks an unbound, unkeyed envelope (see [`encode`]) and decodes it.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, StateError> {
    decode_sealed(bytes, &Seal::default())
}

/// Checks the envelope against `seal` (version, length, checksum or MAC,
/// manifest binding) and decodes the state inside.
pub fn decode_sealed<T: DeserializeOwned>(bytes: &[u8], seal: &Seal) -> Result<T, StateError> {
    let version = peek_version(bytes)?;
    if !FORMAT_VERSION.reads(version) {
        return Err(StateError::Version { found: version });
    }
    if bytes.len() < HEADER_LEN + TAG_LEN {
        return Err(StateError::Truncated(bytes.len()));
    }
    let word =
        |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    let flags = word(12);
    if flags & !FLAG_KEYED != 0 {
        return Err(StateError::Flags(flags));
    }
    let mut l = [0u8; 8];
    l.copy_from_slice(&bytes[16..24]);
    let len = u64::from_le_bytes(l);
    if len > MAX_PAYLOAD {
        return Err(StateError::TooLarge(len));
    }
    let end = HEADER_LEN + len as usize;
    if bytes.len() != end + TAG_LEN {
        return Err(StateError::Truncated(bytes.len()));
    }
    let tag = &bytes[end..];
    let keyed = flags & FLAG_KEYED != 0;
    let good = match (keyed, seal.key) {
        (true, None) => return Err(StateError::KeyMissing),
        (false, Some(_)) => return Err(StateError::Unsealed),
        (true, Some(k)) => {
            // A keyed tag that does not verify is either altered or
            // sealed by another host's key: the same refusal.
            if !constant_time_eq(&k.tag(&bytes[..end]), tag) {
                return Err(StateError::Unsealed);
            }
            true
        }
        (false, None) => blake3::hash(&bytes[..end]).as_bytes() == tag,
    };
    if !good {
        return Err(StateError::Checksum);
    }
    if bytes[24..24 + DIGEST_LEN] != seal.manifest {
        return Err(StateError::ManifestMismatch);
    }
    serde_json::from_slice(&bytes[HEADER_LEN..end]).map_err(StateError::Decode)
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
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
            Err(StateError::Version { found }) if found == Version::new(99, 0)
        ));
        // A newer minor version is refused; an older one is read.
        let mut newer = bytes.clone();
        newer[10..12].copy_from_slice(&(FORMAT_VERSION.minor + 1).to_le_bytes());
        assert!(matches!(
            decode::<S>(&newer),
            Err(StateError::Version { .. })
        ));
        // A state of format 2 (a u32 version, CRC32) is refused by name.
        let mut old = bytes.clone();
        old[8..12].copy_from_slice(&2u32.to_le_bytes());
        let e = decode::<S>(&old).expect_err("format 2");
        assert!(matches!(e, StateError::Version { found } if found == Version::new(2, 0)));
        assert!(
            e.to_string().contains("State format 2.0 cannot be read"),
            "{e}"
        );
        let n = bytes.len();
        bytes[n - 40] ^= 0xff;
        assert!(matches!(decode::<S>(&bytes), Err(StateError::Checksum)));
    }

    #[test]
    fn test_seal_binds_the_manifest_and_the_key() {
        let s = S { a: 3, b: vec![9] };
        let key = Key::from_bytes([7; 32]);
        let other = Key::from_bytes([8; 32]);
        let seal = Seal::of_manifest(b"manifest", Some(&key));
        let bytes = encode_sealed(&s, &seal).expect("encode");
        assert_eq!(decode_sealed::<S>(&bytes, &seal).expect("decode"), s);
        let e = decode_sealed::<S>(&bytes, &Seal::of_manifest(b"manifesT", Some(&key)));
        assert!(matches!(e, Err(StateError::ManifestMismatch)));
        let e = decode_sealed::<S>(&bytes, &Seal::of_manifest(b"manifest", Some(&other)));
        assert!(matches!(e, Err(StateError::Unsealed)));
        let e = decode_sealed::<S>(&bytes, &Seal::of_manifest(b"manifest", None));
        assert!(matches!(e, Err(StateError::KeyMissing)));
        // Unkeyed states are refused where a key is configured, and a
        // payload edited with its checksum recomputed still fails the MAC.
        let plain = encode_sealed(&s, &Seal::of_manifest(b"manifest", None)).expect("encode");
        let e = decode_sealed::<S>(&plain, &seal);
        assert!(matches!(e, Err(StateError::Unsealed)));
    }
}
