//! API keys for clients on tined's TCP listener (what E2B's SDK sends as
//! `E2B_API_KEY`): tined issues them (`tine keys create`, `POST
//! /v1/keys`), shows a key once, and keeps only its BLAKE3 hash in
//! `$TINE_HOME/keys.json` (mode 0600). A key opens every API but key
//! management, which only the host's owner does (the Unix socket, or the
//! token tined was started with).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};

/// What a client sees of a key (never the key itself, after creation).
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct KeyInfo {
    pub id: String,
    pub name: String,
    pub created_ms: u64,
    /// The key's first characters, to tell keys apart.
    pub prefix: String,
}

/// A key just made: the only time its secret is shown.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct NewKey {
    #[serde(flatten)]
    pub info: KeyInfo,
    pub key: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct Stored {
    #[serde(flatten)]
    info: KeyInfo,
    /// BLAKE3 of the key, hex.
    hash: String,
}

/// The issued keys.
pub struct Keys {
    path: PathBuf,
    keys: Mutex<Vec<Stored>>,
}

/// Compares in time independent of where the first difference is.
pub fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `n` random bytes as hex, from the kernel's CSPRNG.
pub fn random_hex(n: usize) -> std::io::Result<String> {
    let mut b = vec![0u8; n];
    getrandom::fill(&mut b).map_err(std::io::Error::other)?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

fn hash(key: &str) -> String {
    blake3::hash(key.as_bytes()).to_hex().to_string()
}

impl Keys {
    /// The keys of the tine home `home` (none when the file is absent; a
    /// file that does not parse is an error: keys must not vanish).
    pub fn open(home: &Path) -> anyhow::Result<Keys> {
        let path = home.join("keys.json");
        let keys = match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|e| {
                anyhow::anyhow!(
                    "{} is not a key list ({e}); fix or remove it",
                    path.display()
                )
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(anyhow::anyhow!("cannot read {}: {e}", path.display())),
        };
        Ok(Keys {
            path,
            keys: Mutex::new(keys),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Stored>> {
        self.keys.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Writes the list (0600, whole or not at all).
    fn save(&self, keys: &[Stored]) -> host::Result<()> {
        let bytes = serde_json::to_vec_pretty(keys)
            .map_err(|e| host::Error::failed(format!("cannot encode the keys: {e}")))?;
        crate::state::write_private(&self.path, &bytes)
            .map_err(|e| host::Error::failed(format!("cannot write {}: {e}", self.path.display())))
    }

    /// Issues a key named `name`.
    pub fn create(&self, name: &str) -> host::Result<NewKey> {
        if name.is_empty() || name.len() > 64 || name.chars().any(char::is_control) {
            return Err(host::Error::invalid(format!(
                "a key's name is 1-64 printable characters, not {name:?}"
            )));
        }
        let rand = |n| {
            random_hex(n).map_err(|e| host::Error::failed(format!("no randomness for a key: {e}")))
        };
        let key = format!("tine_{}", rand(20)?);
        let info = KeyInfo {
            id: format!("key-{}", rand(4)?),
            name: name.to_string(),
            created_ms: host::state::now_ms(),
            prefix: key[..9].to_string(),
        };
        let mut keys = self.lock();
        let mut next = keys.clone();
        next.push(Stored {
            info: info.clone(),
            hash: hash(&key),
        });
        self.save(&next)?;
        *keys = next;
        Ok(NewKey { info, key })
    }

    pub fn list(&self) -> Vec<KeyInfo> {
        self.lock().iter().map(|k| k.info.clone()).collect()
    }

    /// Revokes a key by id or name; false when there is none.
    pub fn remove(&self, id: &str) -> host::Result<bool> {
        let mut keys = self.lock();
        let next: Vec<Stored> = keys
            .iter()
            .filter(|k| k.info.id != id && k.info.name != id)
            .cloned()
            .collect();
        if next.len() == keys.len() {
            return Ok(false);
        }
        self.save(&next)?;
        *keys = next;
        Ok(true)
    }

    /// The id of the key `presented` is, if it is one.
    pub fn check(&self, presented: &str) -> Option<String> {
        let h = hash(presented);
        self.lock()
            .iter()
            .find(|k| same(k.hash.as_bytes(), h.as_bytes()))
            .map(|k| k.info.id.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn test_keys_are_issued_checked_revoked_and_kept_hashed() {
        let home = tempfile::tempdir().expect("tempdir");
        let keys = Keys::open(home.path()).expect("open");
        let k = keys.create("ci").expect("create");
        assert!(k.key.starts_with("tine_") && k.key.len() == 45);
        assert_eq!(keys.check(&k.key), Some(k.info.id.clone()));
        assert_eq!(keys.check(&format!("{}x", k.key)), None);
        let text = std::fs::read_to_string(home.path().join("keys.json")).expect("file");
        assert!(!text.contains(&k.key), "the key itself is never stored");
        let mode = std::fs::metadata(home.path().join("keys.json"))
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // A new tined sees the same keys.
        let again = Keys::open(home.path()).expect("reopen");
        assert_eq!(again.check(&k.key), Some(k.info.id.clone()));
        assert!(again.remove("ci").expect("remove"));
        assert!(!again.remove("ci").expect("remove twice"));
        assert_eq!(again.check(&k.key), None);
        assert!(keys.create("").is_err());
        std::fs::write(home.path().join("keys.json"), b"[{").expect("corrupt");
        assert!(Keys::open(home.path()).is_err());
    }
}
