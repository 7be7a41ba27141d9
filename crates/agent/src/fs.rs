//! Stat, ListDir, Remove and MakeDir: the file operations beyond reading
//! and writing one file (E2B's filesystem service and the SDKs' `files`).

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::UNIX_EPOCH;

use protocol::{Entry, EntryKind};

/// Most entries one ListDir answers: the answer is one frame.
const MAX_ENTRIES: usize = 10_000;

/// uid/gid → name, read once per request from /etc/passwd and /etc/group.
struct Names {
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
}

impl Names {
    fn load() -> Names {
        let table = |path: &str| -> HashMap<u32, String> {
            fs::read_to_string(path)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| {
                    let mut f = l.split(':');
                    let name = f.next()?;
                    let id = f.nth(1)?.parse().ok()?;
                    Some((id, name.to_string()))
                })
                .collect()
        };
        Names {
            users: table("/etc/passwd"),
            groups: table("/etc/group"),
        }
    }

    fn user(&self, id: u32) -> String {
        self.users
            .get(&id)
            .cloned()
            .unwrap_or_else(|| id.to_string())
    }

    fn group(&self, id: u32) -> String {
        self.groups
            .get(&id)
            .cloned()
            .unwrap_or_else(|| id.to_string())
    }
}

fn entry(path: &Path, names: &Names) -> io::Result<Entry> {
    let meta = fs::symlink_metadata(path)?;
    let ft = meta.file_type();
    let kind = if ft.is_dir() {
        EntryKind::Dir
    } else if ft.is_file() {
        EntryKind::File
    } else if ft.is_symlink() {
        EntryKind::Symlink
    } else {
        EntryKind::Other
    };
    let target = ft
        .is_symlink()
        .then(|| fs::read_link(path).ok())
        .flatten()
        .map(|t| t.to_string_lossy().into_owned());
    let mtime_ms = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_millis() as u64);
    Ok(Entry {
        name: path
            .file_name()
            .map_or_else(|| "/".into(), |n| n.to_string_lossy().into_owned()),
        path: path.to_string_lossy().into_owned(),
        kind,
        size: meta.len(),
        mode: meta.permissions().mode() & 0o7777,
        mtime_ms,
        owner: names.user(meta.uid()),
        group: names.group(meta.gid()),
        target,
    })
}

/// Stat of one path, not followed.
pub fn stat(path: &Path) -> io::Result<Vec<Entry>> {
    Ok(vec![entry(path, &Names::load())?])
}

/// The entries under `dir`, `depth` levels down (breadth first, sorted by
/// name per directory; symlinks to directories are not followed).
pub fn list_dir(dir: &Path, depth: u32) -> io::Result<Vec<Entry>> {
    if !fs::metadata(dir)?.is_dir() {
        return Err(io::Error::other(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    let names = Names::load();
    let mut out = Vec::new();
    let mut level = vec![dir.to_path_buf()];
    for _ in 0..depth.max(1) {
        let mut next = Vec::new();
        for d in &level {
            let mut children: Vec<_> = match fs::read_dir(d) {
                Ok(rd) => rd.filter_map(|e| e.ok().map(|e| e.path())).collect(),
                // Below the first level an unreadable directory is listed
                // but not entered.
                Err(e) if d == dir => return Err(e),
                Err(_) => continue,
            };
            children.sort();
            for c in children {
                let Ok(e) = entry(&c, &names) else { continue };
                if e.kind == EntryKind::Dir {
                    next.push(c);
                }
                out.push(e);
                if out.len() >= MAX_ENTRIES {
                    return Err(io::Error::other(format!(
                        "{} holds more than {MAX_ENTRIES} entries at depth {depth}; list less deep",
                        dir.display()
                    )));
                }
            }
        }
        level = next;
    }
    Ok(out)
}

/// Removes a path and everything under it; false when it did not exist.
pub fn remove(path: &Path) -> io::Result<bool> {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if meta.is_dir() {
        fs::remove_dir_all(path)?;
    } else {
        fs::remove_file(path)?;
    }
    Ok(true)
}

/// Moves `from` to `to` (within one filesystem, as rename(2); `to`'s
/// parent directories are made). Always a change.
pub fn rename(from: &Path, to: &Path) -> io::Result<bool> {
    fs::symlink_metadata(from)?;
    if let Some(parent) = to.parent() {
        fs::create_dir_all(parent)?;
    }
    fs::rename(from, to)?;
    Ok(true)
}

/// Creates a directory and its parents; false when it already existed.
pub fn make_dir(path: &Path) -> io::Result<bool> {
    match fs::metadata(path) {
        Ok(m) if m.is_dir() => return Ok(false),
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a directory", path.display()),
            ))
        }
        Err(_) => {}
    }
    fs::create_dir_all(path)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_remove_make() {
        let d = std::env::temp_dir().join(format!("tine-agent-fs-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        assert!(make_dir(&d.join("a/b")).expect("fs op"));
        assert!(!make_dir(&d.join("a/b")).expect("fs op"));
        fs::write(d.join("a/m"), b"m").expect("fs op");
        assert!(rename(&d.join("a/m"), &d.join("c/d/m")).expect("rename"));
        assert_eq!(fs::read(d.join("c/d/m")).expect("moved"), b"m");
        assert!(rename(&d.join("a/m"), &d.join("x")).is_err());
        fs::remove_dir_all(d.join("c")).expect("fs op");
        fs::write(d.join("a/f"), b"xyz").expect("fs op");
        std::os::unix::fs::symlink("f", d.join("a/l")).expect("fs op");
        let one = list_dir(&d.join("a"), 1).expect("fs op");
        let names: Vec<_> = one.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["b", "f", "l"]);
        assert_eq!(one[1].size, 3);
        assert_eq!(one[2].kind, EntryKind::Symlink);
        assert_eq!(one[2].target.as_deref(), Some("f"));
        assert_eq!(list_dir(&d, 2).expect("fs op").len(), 1 + 3);
        assert!(list_dir(&d.join("a/f"), 1).is_err());
        assert!(make_dir(&d.join("a/f")).is_err());
        assert!(remove(&d.join("a")).expect("fs op"));
        assert!(!remove(&d.join("a")).expect("fs op"));
        assert!(stat(&d.join("a")).is_err());
        fs::remove_dir_all(&d).expect("fs op");
    }
}
