//! The PID namespace of a VMM process tree (docs/design/isolation.md,
//! "The jail").
//!
//! A `run` or a wake starts a tree: its VMM, and every process forked
//! from it (fork children, continuations, checkpoint templates, snapshot
//! writers). They share one PID namespace, so a VMM sees no process of
//! the host or of another tree, and its pids mean nothing outside. The
//! namespace's first process (its pid 1, the *tree init*) must outlive
//! every VMM in it, since the kernel ends a namespace with its pid 1 and
//! a fork child outlives its parent: so it is not a VMM but this small
//! loop, which reaps every process of the tree (the host's subreaper
//! cannot: orphans of a namespace go to its pid 1) and reports each wait
//! status to tined on `$TINE_HOME/reaped.sock` (`vmm::jail::REAPED_SOCKET`), with the process's pid
//! as the host sees it. It ends when the tree's last process has.
//!
//! Started as `tine-vmm --pid-report FD ...`:
//!
//! ```text
//! tined ── tine-vmm (host pid X) ─ unshare(CLONE_NEWPID), fork, exit
//!            └─ tree init (pid 1 inside; reparented to tined) ─ fork
//!                 └─ the VMM (pid 2 inside) ─ jail, run ...
//! ```
//!
//! The init writes the VMM's host pid to FD (a socket; tined records that
//! pid), and
//! closes every other fd it inherited (a tap must live exactly as long as
//! its VMM holds it). Host pids come from the host's procfs, which the
//! init still sees: a pidfd's fdinfo shows its process's pid in the pid
//! namespace of the procfs instance that shows it.
//!
//! Hand-written with libc: the few syscalls here (unshare, fork, waitid,
//! pidfd_open) have no crate made for this that does less.

use std::io::Write;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixDatagram;
use std::path::Path;

/// Enters a new PID namespace as its VMM: returns in the VMM (pid 2
/// inside) only; the process that called it and the tree init never
/// return. `report` is the fd the VMM's host pid is written to; `home`
/// the tine home (for tined's socket); `tree` names the tree in `ps`. Call before any other thread
/// exists.
pub fn enter(report: RawFd, home: &Path, tree: &str) -> anyhow::Result<()> {
    // SAFETY: `report` is the fd the host passed for this; owned here.
    let report = unsafe { OwnedFd::from_raw_fd(report) };
    // SAFETY: unshare(2) with a flag; it changes what later forks make.
    if unsafe { libc::unshare(libc::CLONE_NEWPID) } != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EPERM) {
            // Unprivileged: no namespace; the host keeps the pid it
            // started (the report closes empty).
            tracing::warn!("no PID namespace for this tree: {e}");
            return Ok(());
        }
        return Err(anyhow::Error::from(e)
            .context("cannot make the tree's PID namespace (unshare CLONE_NEWPID)"));
    }
    // SAFETY: this process is single-threaded (the caller's contract).
    match unsafe { libc::fork() } {
        -1 => Err(anyhow::Error::from(std::io::Error::last_os_error())
            .context("cannot start the tree init")),
        // The tree init goes on reparented to tined (a subreaper); this
        // process's work is done. `_exit`: nothing of it is flushed twice.
        // SAFETY: _exit(2) ends this process.
        pid if pid > 0 => unsafe { libc::_exit(0) },
        _ => init(report, home, tree),
    }
}

/// The tree init's body: forks the VMM (which returns), then reaps.
fn init(report: OwnedFd, home: &Path, tree: &str) -> anyhow::Result<()> {
    // SAFETY: still single-threaded.
    let vmm = unsafe { libc::fork() };
    if vmm < 0 {
        return Err(anyhow::Error::from(std::io::Error::last_os_error())
            .context("cannot start the VMM in its PID namespace"));
    }
    if vmm == 0 {
        drop(report);
        return Ok(());
    }
    vmm::title::set_tree_init(tree);
    let host = host_pid(vmm);
    {
        let mut f = std::fs::File::from(report);
        let _ = writeln!(f, "{}", host.unwrap_or(0));
    }
    // Nothing inherited stays open here but stdio (the VMM's log).
    // SAFETY: close_range(2) closes this process's fds from 3 up.
    unsafe {
        libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32);
    }
    let socket = home.join(vmm::jail::REAPED_SOCKET);
    reap_forever(&socket)
}

/// Reaps every process of the namespace, reporting each, until none is
/// left; then exits.
fn reap_forever(socket: &Path) -> ! {
    let out = UnixDatagram::unbound().ok();
    loop {
        // SAFETY: siginfo_t is plain data; waitid(2) fills it.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // Looked at first (WNOWAIT), so its pidfd can still be opened.
        // SAFETY: waitid(2) with a valid siginfo_t out-pointer.
        let r = unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) };
        if r != 0 {
            match std::io::Error::last_os_error().raw_os_error() {
                Some(libc::EINTR) => continue,
                // No process left in the tree.
                // SAFETY: _exit(2) ends this process.
                _ => unsafe { libc::_exit(0) },
            }
        }
        // SAFETY: si_pid of a siginfo that waitid filled for a child.
        let pid = unsafe { info.si_pid() };
        let host = host_pid(pid);
        let mut status = 0;
        // SAFETY: waitpid(2) of the child waitid just reported.
        unsafe {
            libc::waitpid(pid, &mut status, 0);
        }
        if let (Some(out), Some(host)) = (&out, host) {
            let line = format!("{host} {status}");
            // tined may be down: the status is then lost, as it would be
            // for a process that tined's absence left to the host's init.
            let _ = out.send_to(line.as_bytes(), socket);
        }
    }
}

/// The host's pid of process `pid` of this namespace.
fn host_pid(pid: libc::pid_t) -> Option<u32> {
    // SAFETY: pidfd_open(2) returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh fd nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
    let info = std::fs::read_to_string(format!(
        "/proc/self/fdinfo/{}",
        std::os::fd::AsRawFd::as_raw_fd(&fd)
    ))
    .ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|p| p.trim().parse::<i64>().ok())
        .and_then(|p| u32::try_from(p).ok())
        .filter(|&p| p > 0)
}
