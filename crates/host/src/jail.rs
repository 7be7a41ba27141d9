//! The host's side of a VMM's jail (`vmm::jail`): the uid each VMM
//! process tree runs as, and its mount namespace: a jailed VMM sees `$TINE_HOME` and the files its command line named; a
//! directory the host names later outside the home (`tine snapshot --to
//! DIR`) is mounted into its namespace here, at the same path, before the
//! request that writes there.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::error::Context;

/// First of the uids VMMs run as: 0x7A000000, in the range systemd's
/// uid table leaves unused (0x70000000..0x7FFE0000), far from users,
/// system accounts and container ranges.
pub const UID_BASE: u32 = 0x7A00_0000;
/// How many uids VMM trees spread over.
pub const UID_SPAN: u32 = 1 << 24;

/// The uid (and gid) of the VMM process tree a `run` or `wake` of `vm`
/// starts in `home`; its fork children keep it. Two trees share one only
/// by a hash collision (about 3 in 10^4 for 100 live trees), which
/// costs them only the uid's separation, never their files'.
pub fn uid_for(home: &Path, vm: &str) -> u32 {
    let mut h = blake3::Hasher::new();
    h.update(home.as_os_str().as_bytes());
    h.update(&[0]);
    h.update(vm.as_bytes());
    let d = h.finalize();
    let b = d.as_bytes();
    UID_BASE + u32::from_le_bytes([b[0], b[1], b[2], b[3]]) % UID_SPAN
}

/// Makes host directory `dir` visible at the same path to VMM `pid`
/// (and the processes sharing its mount namespace: its tree). Nothing to
/// do when the VMM shares the host's namespace or sees `dir` already.
pub fn expose(pid: u32, dir: &Path) -> crate::Result<()> {
    expose_all(pid, &[dir])
}

/// [`expose`] for several directories (a fork's children), with one
/// helper process.
pub fn expose_all(pid: u32, dirs: &[&Path]) -> crate::Result<()> {
    let ns = format!("/proc/{pid}/ns/mnt");
    let theirs = std::fs::metadata(&ns).with_context(|| format!("cannot read {ns}"))?;
    let ours = std::fs::metadata("/proc/self/ns/mnt").context("cannot read /proc/self/ns/mnt")?;
    if theirs.ino() == ours.ino() && theirs.dev() == ours.dev() {
        return Ok(());
    }
    // (a detached copy of the host's mount of the directory, its path)
    let mut moves: Vec<(OwnedFd, CString)> = Vec::new();
    for dir in dirs {
        let host =
            std::fs::metadata(dir).with_context(|| format!("cannot read {}", dir.display()))?;
        // Through /proc/PID/root, the path as the VMM sees it.
        let seen =
            Path::new(&format!("/proc/{pid}/root")).join(dir.strip_prefix("/").unwrap_or(dir));
        if let Ok(m) = std::fs::metadata(&seen) {
            if m.ino() == host.ino() && m.dev() == host.dev() {
                continue;
            }
        }
        std::fs::create_dir_all(&seen)
            .with_context(|| format!("cannot make the mount point {}", seen.display()))?;
        let path = CString::new(dir.as_os_str().as_bytes())
            .map_err(|_| crate::Error::invalid(format!("{} holds a NUL byte", dir.display())))?;
        // SAFETY: open_tree reads a NUL-terminated path and returns a new
        // fd or -1.
        let tree = unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                libc::AT_FDCWD,
                path.as_ptr(),
                OPEN_TREE_CLONE | libc::O_CLOEXEC as u32,
            )
        };
        if tree < 0 {
            return Err(
                crate::Error::from(std::io::Error::last_os_error()).context(format!(
                    "cannot take a copy of the mount of {}",
                    dir.display()
                )),
            );
        }
        // SAFETY: a fresh fd nobody else owns.
        moves.push((unsafe { OwnedFd::from_raw_fd(tree as i32) }, path));
    }
    if moves.is_empty() {
        return Ok(());
    }
    let ns = std::fs::File::open(&ns).with_context(|| format!("cannot open {ns}"))?;
    let ns_fd = ns.as_raw_fd();
    let plan: Vec<(i32, CString)> = moves
        .iter()
        .map(|(fd, path)| (fd.as_raw_fd(), path.clone()))
        .collect();
    let empty = CString::default();
    // Moved into the VMM's namespace by a helper process: setns into a
    // mount namespace needs a single-threaded process, which tined is
    // not. The work happens between fork and exec, and the child exits.
    // The program is never run (the child ends in pre_exec): any path
    // that exists does, with no PATH lookup.
    let program = std::env::current_exe().unwrap_or_else(|_| "/bin/true".into());
    let mut cmd = Command::new(program);
    // SAFETY: only async-signal-safe syscalls run in the child, on
    // buffers made before the fork (`moves` outlives the command).
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(ns_fd, libc::CLONE_NEWNS) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            for (tree_fd, path) in &plan {
                // A mount left there before (a staging directory of the
                // same name, removed since on the host) goes first:
                // nothing mounts over a deleted directory (ENOENT). Not
                // a mount point: EINVAL, nothing done.
                libc::umount2(path.as_ptr(), libc::MNT_DETACH);
                let rc = libc::syscall(
                    libc::SYS_move_mount,
                    *tree_fd,
                    empty.as_ptr(),
                    libc::AT_FDCWD,
                    path.as_ptr(),
                    MOVE_MOUNT_F_EMPTY_PATH,
                );
                if rc != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // Done: no exec (the program is not in the jail's root). spawn
            // sees the exec pipe close, the waiter status 0.
            libc::_exit(0)
        });
    }
    let shown = || {
        dirs.iter()
            .map(|d| d.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let out = crate::proc::output(&mut cmd, &[], Duration::from_secs(10)).map_err(|e| {
        crate::Error::failed(format!(
            "cannot mount {} into the jail of VMM {pid}: {e}",
            shown()
        ))
    })?;
    drop(cmd);
    drop(moves);
    if !out.status.success() {
        return Err(crate::Error::failed(format!(
            "cannot mount {} into the jail of VMM {pid}: the helper exited with {}",
            shown(),
            out.status
        )));
    }
    Ok(())
}

/// open_tree(2): a detached copy of the mount.
const OPEN_TREE_CLONE: u32 = 1;
/// move_mount(2): the source is the fd itself.
const MOVE_MOUNT_F_EMPTY_PATH: u32 = 0x4;
