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

/// A stored answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Answer {
    /// What the request was (method, path, body hash).
    pub fingerprint: String,
    pub status: u16,
    pub body: serde_json::Value,
    pub stored_ms: u64,
}

pub struct Idempotency {
    dir: PathBuf,
    /// One lock per key in flight, so repeats wait for the first.
    inflight: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// When old answers were last expired.
    expired_ms: std::sync::atomic::AtomicU64,
}

/// A request's hold on its key's lock entry ([`Idempotency::lock`]).
pub struct InFlight<'a> {
    idem: &'a Idempotency,
    key: String,
    lock: Arc<tokio::sync::Mutex<()>>,
}

impl InFlight<'_> {
    pub async fn lock(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.lock.lock().await
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut m = self.idem.inflight.lock().unwrap_or_else(|e| e.into_inner());
        // Clones are made only under the map's lock: the map's and ours
        // left means nobody else waits.
        if Arc::strong_count(&self.lock) == 2
            && m.get(&self.key).is_some_and(|a| Arc::ptr_eq(a, &self.lock))
        {
            m.remove(&self.key);
        }
    }
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

    /// The lock of `key`: held while its request runs. The entry goes
    /// when the last request that holds it is done (every key once in a
    /// map that never shrank was a leak, one entry per fork for an SDK that
    /// sends a key with each).
    pub fn lock(&self, key: &str) -> InFlight<'_> {
        let mut m = self.inflight.lock().unwrap_or_else(|e| e.into_inner());
        InFlight {
            idem: self,
            key: key.to_string(),
            lock: m.entry(key.to_string()).or_default().clone(),
        }
    }

    /// Keys with a request running or waiting.
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

    #[tokio::test]
    async fn test_a_done_key_leaves_no_entry_and_repeats_still_wait() {
        let dir = tempfile::tempdir().expect("tempdir");
        let idem = Idempotency::new(dir.path());
        {
            let a = idem.lock("k");
            let held = a.lock().await;
            // A repeat of the same key shares the entry and waits.
            let b = idem.lock("k");
            assert!(b.lock.try_lock().is_err());
            drop(held);
            drop(a);
            assert_eq!(idem.in_flight(), 1, "b still holds it");
            drop(b);
        }
        assert_eq!(idem.in_flight(), 0);
        for i in 0..100 {
            let l = idem.lock(&format!("key-{i}"));
            let _g = l.lock().await;
        }
        assert_eq!(idem.in_flight(), 0);
    }
}
