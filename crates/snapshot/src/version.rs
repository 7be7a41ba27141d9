//! Format versions: `major.minor`, read by Firecracker's rule (same major,
//! minor no newer than the reader's).

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A `major.minor` format version; written as the string "3.0".
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version {
    pub major: u16,
    pub minor: u16,
}

/// A version string that is not `major.minor`.
#[derive(Debug, thiserror::Error)]
#[error("format version {0:?} is not MAJOR.MINOR")]
pub struct VersionError(String);

impl Version {
    pub const fn new(major: u16, minor: u16) -> Version {
        Version { major, minor }
    }

    /// Whether a reader of version `self` reads data of version `v`.
    pub fn reads(self, v: Version) -> bool {
        v.major == self.major && v.minor <= self.minor
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

impl std::str::FromStr for Version {
    type Err = VersionError;
    fn from_str(s: &str) -> Result<Version, VersionError> {
        let bad = || VersionError(s.to_string());
        let (a, b) = s.split_once('.').ok_or_else(bad)?;
        Ok(Version::new(
            a.parse().map_err(|_| bad())?,
            b.parse().map_err(|_| bad())?,
        ))
    }
}

impl Serialize for Version {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Reads "3.0", and a bare number `N` as `N.0` (manifests before 3.0
/// wrote the version as an integer), so that an old file is refused by
/// its version and not by a type error.
impl<'de> Deserialize<'de> for Version {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Version, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Text(String),
            Number(u16),
        }
        match Raw::deserialize(d)? {
            Raw::Text(t) => t.parse().map_err(serde::de::Error::custom),
            Raw::Number(n) => Ok(Version::new(n, 0)),
        }
    }
}
