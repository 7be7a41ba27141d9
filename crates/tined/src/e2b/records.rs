//! What E2B's API knows of a sandbox and tine does not: its template,
//! metadata, default environment, lifetime and envd access token; and
//! which sleeping branches are E2B snapshots. One JSON file each under
//! `$TINE_HOME/e2b/` (written whole, atomically), so a restarted tined
//! knows them, kept in memory meanwhile.
//!
//! The vm or the sleeping branch itself is tine's: a record whose vm and
//! branch are both gone (removed through tine's own API) is dropped the
//! next time it is looked at.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};

/// What happens when a running sandbox's time is up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnTimeout {
    /// Removed (E2B's default).
    #[default]
    Kill,
    /// Put to sleep: its branch waits in the store for a connect.
    Pause,
}

fn default_timeout_s() -> u64 {
    300
}

/// One sandbox (a vm, or its sleeping branch while paused).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sandbox {
    pub id: String,
    /// The template it was created from, as the client named it.
    pub template: String,
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Environment every command gets (the request's own override it).
    #[serde(default)]
    pub env_vars: BTreeMap<String, String>,
    pub started_ms: u64,
    /// When a running sandbox's time is up (Unix ms).
    pub end_ms: u64,
    /// The lifetime it was given (seconds), which an automatic resume
    /// gives it again.
    #[serde(default = "default_timeout_s")]
    pub timeout_s: u64,
    #[serde(default)]
    pub on_timeout: OnTimeout,
    /// A paused sandbox wakes when an envd request comes for it.
    #[serde(default)]
    pub auto_resume: bool,
    /// What envd requests must carry as `X-Access-Token` over TCP.
    pub envd_token: String,
    #[serde(default)]
    pub cpu_count: u32,
    #[serde(default)]
    pub memory_mb: u64,
}

/// An E2B snapshot: a sleeping branch, made from a running sandbox.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Snapshot {
    /// The branch's name, which is the snapshot's id.
    pub id: String,
    pub sandbox: String,
    pub created_ms: u64,
}

/// The records, on disk and in memory.
pub struct Records {
    dir: PathBuf,
    sandboxes: Mutex<BTreeMap<String, Sandbox>>,
    snapshots: Mutex<BTreeMap<String, Snapshot>>,
    /// Ids being made (created, forked, snapshotted) or acted on by their
    /// timeout: a record without its vm yet is not a gone one.
    busy: Mutex<BTreeSet<String>>,
}

/// An id held busy until this is dropped.
pub struct Held<'a> {
    records: &'a Records,
    id: String,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        lock(&self.records.busy).remove(&self.id);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Every record of one kind in `dir` (a file that does not parse is
/// skipped with a warning: it names no sandbox we could serve).
fn load<T: for<'de> Deserialize<'de>>(dir: &Path) -> BTreeMap<String, T> {
    let mut out = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        let Some(id) = p
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".json"))
        else {
            continue;
        };
        match std::fs::read(&p).map(|b| serde_json::from_slice::<T>(&b)) {
            Ok(Ok(r)) => {
                out.insert(id.to_string(), r);
            }
            Ok(Err(e)) => tracing::warn!("e2b: skipping {}: {e}", p.display()),
            Err(e) => tracing::warn!("e2b: cannot read {}: {e}", p.display()),
        }
    }
    out
}

impl Records {
    /// The records of the tine home `home`.
    pub fn open(home: &Path) -> Records {
        let dir = home.join("e2b");
        Records {
            sandboxes: Mutex::new(load(&dir.join("sandboxes"))),
            snapshots: Mutex::new(load(&dir.join("snapshots"))),
            busy: Mutex::default(),
            dir,
        }
    }

    /// Marks `id` busy; None when it already is.
    pub fn hold(&self, id: &str) -> Option<Held<'_>> {
        lock(&self.busy).insert(id.to_string()).then(|| Held {
            records: self,
            id: id.to_string(),
        })
    }

    pub fn is_busy(&self, id: &str) -> bool {
        lock(&self.busy).contains(id)
    }

    /// Writes a record: 0600 in a 0700 directory (a sandbox's holds its
    /// envd token).
    fn write<T: Serialize>(&self, kind: &str, id: &str, r: &T) -> host::Result<()> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = self.dir.join(kind);
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| host::Error::failed(format!("cannot create {}: {e}", dir.display())))?;
        let bytes = serde_json::to_vec_pretty(r)
            .map_err(|e| host::Error::failed(format!("cannot encode the {kind} record: {e}")))?;
        let path = dir.join(format!("{id}.json"));
        crate::state::write_private(&path, &bytes)
            .map_err(|e| host::Error::failed(format!("cannot write {}: {e}", path.display())))
    }

    fn erase(&self, kind: &str, id: &str) {
        let _ = std::fs::remove_file(self.dir.join(kind).join(format!("{id}.json")));
    }

    pub fn sandbox(&self, id: &str) -> Option<Sandbox> {
        lock(&self.sandboxes).get(id).cloned()
    }

    pub fn sandboxes(&self) -> Vec<Sandbox> {
        lock(&self.sandboxes).values().cloned().collect()
    }

    /// Writes a sandbox's record (on disk first).
    pub fn put_sandbox(&self, r: Sandbox) -> host::Result<()> {
        let mut all = lock(&self.sandboxes);
        self.write("sandboxes", &r.id, &r)?;
        all.insert(r.id.clone(), r);
        Ok(())
    }

    /// Changes a sandbox's record; false when there is none.
    pub fn update_sandbox(&self, id: &str, f: impl FnOnce(&mut Sandbox)) -> host::Result<bool> {
        let mut all = lock(&self.sandboxes);
        let Some(r) = all.get_mut(id) else {
            return Ok(false);
        };
        let mut new = r.clone();
        f(&mut new);
        self.write("sandboxes", id, &new)?;
        *r = new;
        Ok(true)
    }

    pub fn drop_sandbox(&self, id: &str) {
        let mut all = lock(&self.sandboxes);
        self.erase("sandboxes", id);
        all.remove(id);
    }

    /// Whether `token` is the envd access token of sandbox `id`
    /// (compared in constant time).
    pub fn envd_token_is(&self, id: &str, token: &str) -> bool {
        lock(&self.sandboxes)
            .get(id)
            .is_some_and(|r| crate::keys::same(r.envd_token.as_bytes(), token.as_bytes()))
    }

    pub fn snapshot(&self, id: &str) -> Option<Snapshot> {
        lock(&self.snapshots).get(id).cloned()
    }

    pub fn snapshots(&self) -> Vec<Snapshot> {
        lock(&self.snapshots).values().cloned().collect()
    }

    pub fn put_snapshot(&self, r: Snapshot) -> host::Result<()> {
        let mut all = lock(&self.snapshots);
        self.write("snapshots", &r.id, &r)?;
        all.insert(r.id.clone(), r);
        Ok(())
    }

    pub fn drop_snapshot(&self, id: &str) {
        let mut all = lock(&self.snapshots);
        self.erase("snapshots", id);
        all.remove(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(id: &str) -> Sandbox {
        Sandbox {
            id: id.into(),
            template: "base".into(),
            metadata: BTreeMap::from([("k".into(), "v".into())]),
            env_vars: BTreeMap::new(),
            started_ms: 1,
            end_ms: 2,
            timeout_s: 300,
            on_timeout: OnTimeout::Pause,
            auto_resume: false,
            envd_token: "secret".into(),
            cpu_count: 1,
            memory_mb: 256,
        }
    }

    #[test]
    fn test_records_survive_a_reopen_and_bad_files_are_skipped() {
        let home = std::env::temp_dir().join(format!("tine-e2b-records-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&home);
        let r = Records::open(&home);
        r.put_sandbox(sandbox("sbx-a")).expect("put");
        r.put_sandbox(sandbox("sbx-b")).expect("put");
        assert!(r
            .update_sandbox("sbx-a", |s| s.end_ms = 99)
            .expect("update"));
        assert!(!r.update_sandbox("sbx-none", |_| {}).expect("update"));
        r.drop_sandbox("sbx-b");
        r.put_snapshot(Snapshot {
            id: "snap-1".into(),
            sandbox: "sbx-a".into(),
            created_ms: 3,
        })
        .expect("snapshot");
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &str| {
            std::fs::metadata(home.join(p))
                .expect("exists")
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(mode("e2b/sandboxes/sbx-a.json"), 0o600);
        assert_eq!(mode("e2b/sandboxes"), 0o700);
        std::fs::write(home.join("e2b/sandboxes/junk.json"), b"{not json").expect("junk");
        let again = Records::open(&home);
        let ids: Vec<_> = again.sandboxes().into_iter().map(|s| s.id).collect();
        assert_eq!(ids, ["sbx-a"]);
        let a = again.sandbox("sbx-a").expect("a");
        assert_eq!((a.end_ms, a.on_timeout), (99, OnTimeout::Pause));
        assert!(again.envd_token_is("sbx-a", "secret"));
        assert!(!again.envd_token_is("sbx-a", "secreT"));
        assert!(!again.envd_token_is("sbx-b", "secret"));
        let held = again.hold("sbx-a").expect("not busy");
        assert!(again.is_busy("sbx-a") && again.hold("sbx-a").is_none());
        drop(held);
        assert!(!again.is_busy("sbx-a"));
        assert_eq!(
            again.snapshot("snap-1").map(|s| s.sandbox).as_deref(),
            Some("sbx-a")
        );
        let _ = std::fs::remove_dir_all(&home);
    }
}
