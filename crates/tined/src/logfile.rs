//! Keeps tined's log file bounded. The CLI starts tined with its stdout
//! and stderr appending to `$TINE_HOME/tined.log`, and a tined that serves
//! vms never exits on its own: every event is a line, so the file would
//! grow with every fork for as long as the host runs. Once it passes its
//! limit it is copied to `tined.log.1` (replacing the previous one) and
//! emptied in place; the fds keep appending to it. At most twice the limit
//! is kept.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::{Path, PathBuf};

/// The limit of the log file, unless `TINED_LOG_MAX_MIB` says otherwise.
pub const DEFAULT_MAX: u64 = 16 << 20;

/// The limit: `TINED_LOG_MAX_MIB` (MiB, at least 1), else [`DEFAULT_MAX`].
pub fn max_bytes() -> u64 {
    std::env::var("TINED_LOG_MAX_MIB")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .filter(|&m| m > 0)
        .map(|m| m << 20)
        .unwrap_or(DEFAULT_MAX)
}

/// The file `fd` writes to, if it is a regular file opened for appending
/// (not a terminal, pipe or journal).
fn appended_file(fd: BorrowedFd<'_>) -> Option<(PathBuf, u64)> {
    // SAFETY: fcntl(F_GETFL) on a borrowed, open fd.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags < 0 || flags & libc::O_APPEND == 0 {
        return None;
    }
    let path = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).ok()?;
    let meta = std::fs::metadata(&path).ok()?;
    meta.is_file().then_some((path, meta.len()))
}

/// If `fd` appends to a regular file longer than `max`, moves its content
/// to `FILE.1` and empties it. Returns whether it did.
pub fn bound(fd: BorrowedFd<'_>, max: u64) -> bool {
    let Some((path, len)) = appended_file(fd) else {
        return false;
    };
    if len <= max {
        return false;
    }
    let old = rotated(&path);
    if std::fs::copy(&path, &old).is_err() {
        return false;
    }
    // SAFETY: ftruncate(2) of a borrowed, open fd; appends go on at the
    // new end.
    unsafe { libc::ftruncate(fd.as_raw_fd(), 0) == 0 }
}

fn rotated(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".1");
    PathBuf::from(p)
}

/// [`bound`] for this process's stdout and stderr (one file when both go
/// to it, as the CLI starts tined).
pub fn bound_stdio(max: u64) {
    // SAFETY: fds 1 and 2 stay open for the life of the process.
    let (out, err) = unsafe { (BorrowedFd::borrow_raw(1), BorrowedFd::borrow_raw(2)) };
    if !bound(err, max) {
        bound(out, max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;

    #[test]
    fn test_a_log_past_its_limit_moves_to_dot_1_and_goes_on_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tined.log");
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .expect("open");
        f.write_all(&[b'x'; 100]).expect("write");
        assert!(!bound(f.as_fd(), 100), "not past the limit yet");
        f.write_all(b"yz").expect("write");
        assert!(bound(f.as_fd(), 100));
        assert_eq!(std::fs::metadata(&path).expect("log").len(), 0);
        assert_eq!(
            std::fs::metadata(dir.path().join("tined.log.1"))
                .expect("rotated")
                .len(),
            102
        );
        f.write_all(b"next\n").expect("write");
        assert_eq!(std::fs::read(&path).expect("log"), b"next\n");
        // A file not opened for appending is left alone.
        let plain = std::fs::File::create(dir.path().join("plain")).expect("plain");
        assert!(!bound(plain.as_fd(), 0));
    }
}
