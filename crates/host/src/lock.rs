//! Serialization: one operation at a time per vm (and per name being
//! created), across threads and processes, by `flock` on
//! `$TINE_HOME/locks/NAME.lock`. A lock dies with its holder, so a killed
//! process never leaves a vm locked.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::error::Context;

/// How long an operation waits for another one on the same vm by default.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(120);

/// A held lock; released on drop.
#[derive(Debug)]
pub struct Lock {
    _file: File,
    pub name: String,
}

fn locks_dir(home: &Path) -> PathBuf {
    home.join("locks")
}

fn open(home: &Path, key: &str) -> crate::Result<File> {
    // A key names a file in the locks directory and nothing else: a vm
    // name from a request must not reach `locks/../../x.lock`.
    if key.is_empty() || key == "." || key == ".." || key.contains(['/', '\0']) || key.len() > 200 {
        return Err(crate::Error::invalid(format!(
            "invalid name {key:?}: use 1-48 letters, digits, '-', '_' or '.', starting with a letter or digit"
        )));
    }
    let dir = locks_dir(home);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join(format!("{key}.lock"));
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))
}

fn try_flock(f: &File) -> std::io::Result<bool> {
    // SAFETY: flock(2) on an fd we own.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EWOULDBLOCK) => Ok(false),
        _ => Err(e),
    }
}

/// Takes the lock of `key` (a vm name, or a `.name` of the engine's own),
/// waiting at most `wait`; after that the operation is refused as busy.
pub fn acquire(home: &Path, key: &str, wait: Duration) -> crate::Result<Lock> {
    let f = open(home, key)?;
    let deadline = Instant::now() + wait;
    let mut nap = Duration::from_micros(200);
    loop {
        if try_flock(&f).context("flock failed")? {
            return Ok(Lock {
                _file: f,
                name: key.into(),
            });
        }
        if Instant::now() >= deadline {
            return Err(crate::Error::busy(format!(
                "another operation on {key:?} is still running after {}s; try again when it is done",
                wait.as_secs()
            )));
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(20));
    }
}

/// A lock held shared (many holders, no exclusive one); released on drop.
#[derive(Debug)]
pub struct SharedLock {
    _file: File,
}

/// Takes `key` shared, waiting at most `wait` for an exclusive holder.
pub fn acquire_shared(home: &Path, key: &str, wait: Duration) -> crate::Result<SharedLock> {
    let f = open(home, key)?;
    let deadline = Instant::now() + wait;
    loop {
        // SAFETY: flock(2) on an fd we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) } == 0 {
            return Ok(SharedLock { _file: f });
        }
        if Instant::now() >= deadline {
            return Err(crate::Error::busy(format!(
                "{key:?} is held exclusively for more than {}s",
                wait.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Takes the lock of `key` only if nobody holds it.
pub fn try_acquire(home: &Path, key: &str) -> crate::Result<Option<Lock>> {
    let f = open(home, key)?;
    Ok(try_flock(&f).context("flock failed")?.then(|| Lock {
        _file: f,
        name: key.into(),
    }))
}

/// How long a name's lock may be held by someone else before a reserve
/// calls it a conflict: tined's note of a VMM's exit takes a vm's lock
/// for an instant (after `rm`, a new vm of the same name must not be
/// refused for that).
const RESERVE_GRACE: Duration = Duration::from_millis(100);

/// The locks of names a new vm (or several, a fork's children) will take:
/// refused as a conflict when one of them is being created or changed
/// right now.
pub fn reserve(home: &Path, names: &[String]) -> crate::Result<Vec<Lock>> {
    let mut held = Vec::with_capacity(names.len());
    for n in names {
        match acquire(home, n, RESERVE_GRACE) {
            Ok(l) => held.push(l),
            Err(e) if matches!(e.code(), crate::error::Code::Busy) => {
                return Err(crate::Error::conflict(format!(
                    "the name {n:?} is being used by another operation right now; choose another"
                )))
            }
            Err(e) => return Err(e),
        }
    }
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_a_key_stays_in_the_locks_directory() {
        let home = tempfile::tempdir().expect("tempdir");
        for key in ["../x", "a/b", "..", ".", "", "/abs", "a\0b"] {
            let e = acquire(home.path(), key, Duration::ZERO).expect_err(key);
            assert_eq!(e.code(), crate::Code::InvalidInput, "{key:?}");
            assert!(try_acquire(home.path(), key).is_err(), "{key:?}");
        }
        assert!(!home.path().join("x.lock").exists());
        assert!(acquire(home.path(), ".branch-a", Duration::ZERO).is_ok());
    }

    #[test]
    fn test_lock_is_exclusive_and_released_on_drop() {
        let home = tempfile::tempdir().expect("tempdir");
        let a = acquire(home.path(), "vm1", Duration::from_millis(10)).expect("first");
        let e = acquire(home.path(), "vm1", Duration::from_millis(30)).expect_err("busy");
        assert_eq!(e.code(), crate::Code::Busy);
        assert!(try_acquire(home.path(), "vm1").expect("try").is_none());
        drop(a);
        assert!(try_acquire(home.path(), "vm1").expect("try").is_some());
    }

    #[test]
    fn test_reserve_refuses_a_name_in_use() {
        let home = tempfile::tempdir().expect("tempdir");
        let _held = acquire(home.path(), "b", Duration::from_millis(10)).expect("b");
        let e = reserve(home.path(), &["a".into(), "b".into()]).expect_err("b busy");
        assert_eq!(e.code(), crate::Code::Conflict);
        // "a" was let go again.
        assert!(try_acquire(home.path(), "a").expect("try").is_some());
    }
}
