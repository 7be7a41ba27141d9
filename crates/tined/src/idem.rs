//! Idempotency keys for create and fork (`Idempotency-Key` header): the
//! first request with a key runs; a repeat gets the first one's answer
//! (status and body), waiting for it if it is still running; a repeat with
//! a different request is refused. Answers are kept in
//! `$TINE_HOME/idempotency/` for a day, so a client that retries after a
//! restart of tined does not fork twice either.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

/// How long an answer is kept.
const TTL_MS: u64 = 24 * 3600 * 1000;
/// Longest key accepted.
pub const MAX_KEY: usize = 256;

/// A request's hold on its key's lock (see [`Idempotency::lock`]).
pub struct KeyLock<'a> {
    idem: &'a Idempotency,
    key: String,
    mutex: Option<Arc<tokio::sync::Mutex<()>>>,
}

impl KeyLock<'_> {
    /// Waits until no other request of this key runs.
    pub async fn hold(&self) -> Option<tokio::sync::MutexGuard<'_, ()>> {
        match &self.mutex {
            Some(m) => Some(m.lock().await),
            None => None,
        }
    }
}

impl Drop for KeyLock<'_> {
    fn drop(&mut self) {
        // Every clone is taken under the map's lock, so the count seen
        // under it is exact: 1 is the map's own.
        let mut m = self.idem.inflight.lock().unwrap_or_else(|e| e.into_inner());
        drop(self.mutex.take());
        if m.get(&self.key).is_some_and(|a| Arc::strong_count(a) == 1) {
            m.remove(&self.key);
        }
    }
}

/// A stored answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Answer {
    /// What the request was (method, path, body hash).
    pub fingerprint: String,
    pub status: u16,
    /// The answer's JSON as sent (kept as text: it is only ever sent again).
    pub body: Box<serde_json::value::RawValue>,
    pub stored_ms: u64,
}

pub struct Idempotency {
    dir: PathBuf,
    /// One lock per key in flight, so repeats wait for the first.
    inflight: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// When old answers were last expired.
    expired_ms: std::sync::atomic::AtomicU64,
}

impl Idempotency {
    pub fn new(home: &std::path::Path) -> Self {
        Idempotency {
            dir: home.join("idempotency"),
            inflight: Mutex::new(HashMap::new()),
            expired_ms: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn path(&self, key: &str) -> PathBuf {
        self.dir.join(format!(
            "{}.json",
            &blake3::hash(key.as_bytes()).to_hex()[..32]
        ))
    }

    /// The lock of `key`, held while its request runs. The entry is
    /// forgotten when the last request of that key is done (every key a
    /// client ever sent would stay in memory otherwise).
    pub fn lock(&self, key: &str) -> KeyLock<'_> {
        let mut m = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        KeyLock {
            idem: self,
            key: key.to_string(),
            mutex: Some(m.entry(key.to_string()).or_default().clone()),
        }
    }

    /// Keys with a request in flight (or waiting).
    pub fn in_flight(&self) -> usize {
        self.inflight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// The stored answer for `key`, if a fresh one exists.
    pub fn get(&self, key: &str) -> Option<Answer> {
        let text = std::fs::read(self.path(key)).ok()?;
        let a: Answer = serde_json::from_slice(&text).ok()?;
        (host::state::now_ms().saturating_sub(a.stored_ms) < TTL_MS).then_some(a)
    }

    /// Keeps `answer` for `key`.
    pub fn put(&self, key: &str, answer: &Answer) {
        if std::fs::create_dir_all(&self.dir).is_err() {
            return;
        }
        if let Ok(bytes) = serde_json::to_vec(answer) {
            let _ = host::state::write_atomic(&self.path(key), &bytes);
        }
        self.expire();
    }

    /// Forgets answers older than the TTL, at most once a minute.
    fn expire(&self) {
        let now_ms = host::state::now_ms();
        let last = self.expired_ms.load(std::sync::atomic::Ordering::Relaxed);
        if now_ms.saturating_sub(last) < 60_000 {
            return;
        }
        self.expired_ms
            .store(now_ms, std::sync::atomic::Ordering::Relaxed);
        let Ok(rd) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let now = std::time::SystemTime::now();
        for e in rd.flatten() {
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| now.duration_since(t).ok())
                .is_some_and(|d| d.as_millis() as u64 > TTL_MS);
            if old {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_a_key_is_forgotten_when_its_last_request_is_done() {
        let dir = tempfile::tempdir().expect("a directory");
        let idem = Idempotency::new(dir.path());
        let a = idem.lock("k");
        let b = idem.lock("k");
        let c = idem.lock("other");
        assert_eq!(idem.in_flight(), 2);
        drop(a);
        assert_eq!(idem.in_flight(), 2, "b still holds k");
        drop(b);
        assert_eq!(idem.in_flight(), 1);
        drop(c);
        assert_eq!(idem.in_flight(), 0);
    }
}
