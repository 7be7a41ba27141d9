//! Processes the engine starts and watches: VMMs (long-lived, watched by
//! pid and start time), and the short helpers it runs and waits for
//! (`nft`, `ip`, rotate providers).
//!
//! In tined, which is the subreaper of every VMM (ARCHITECTURE.md, "The
//! control plane"), one [`Reaper`] thread is the only caller of
//! `waitpid(-1)`: exited VMMs, orphaned fork children and helpers are all
//! reaped there, and a helper's waiter gets its status from the reaper
//! instead of waiting itself (which would race with it and see ECHILD).
//! Outside tined no reaper is installed and helpers are waited normally.

use std::collections::HashMap;
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The few fields of /proc/PID/stat that tine checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcStat {
    /// Command name (field 2).
    pub comm: String,
    /// State letter (field 3): R, S, D, Z, X, ...
    pub state: char,
    /// The parent's pid (field 4).
    pub ppid: u32,
    /// Start time in clock ticks since boot (field 22).
    pub start: u64,
}

impl ProcStat {
    /// Reads /proc/PID/stat; None when the process is gone.
    pub fn read(pid: u32) -> Option<Self> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // "pid (comm) state ...": comm may hold spaces and ')', so split at
        // the first '(' and the last ')'.
        let open = stat.find('(')?;
        let close = stat.rfind(')')?;
        let comm = stat.get(open + 1..close)?.to_string();
        let mut rest = stat.get(close + 1..)?.split_whitespace();
        let state = rest.next()?.chars().next()?;
        let ppid = rest.next()?.parse().ok()?;
        let start = rest.nth(17)?.parse().ok()?;
        Some(Self {
            comm,
            state,
            ppid,
            start,
        })
    }

    /// A zombie or dead process has exited; only its entry remains.
    pub fn is_exited(&self) -> bool {
        matches!(self.state, 'Z' | 'X')
    }
}

/// Start time of a process (field 22 of /proc/PID/stat), if it exists.
pub fn process_start(pid: u32) -> Option<u64> {
    ProcStat::read(pid).map(|s| s.start)
}

/// Whether `pid` is alive and is the same process that started at `start`
/// (a zombie counts as gone).
pub fn process_alive(pid: u32, start: u64) -> bool {
    // Pid 0 is no process (a record whose process is unknown); kill(0)
    // would signal our own process group.
    pid != 0 && ProcStat::read(pid).is_some_and(|s| !s.is_exited() && s.start == start)
}

/// Resident memory of a process in KiB.
pub fn process_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The reaper of a subreaper process (tined), once installed.
static REAPER: OnceLock<Arc<Reaper>> = OnceLock::new();

/// What the reaper knows of exited children.
#[derive(Default)]
struct Waiters {
    /// Statuses nobody asked for yet (a helper that exited before its
    /// waiter registered), with when they were reaped.
    unclaimed: HashMap<u32, (ExitStatus, Instant)>,
    /// Waiters of helpers, by pid.
    waiting: HashMap<u32, mpsc::Sender<ExitStatus>>,
}

/// Reaps every child of this process and hands helpers' statuses to
/// their waiters. Exits of other children (VMMs) go to `on_exit`.
pub struct Reaper {
    waiters: Mutex<Waiters>,
    on_exit: Box<dyn Fn(u32, ExitStatus) + Send + Sync>,
}

/// Statuses unclaimed for this long belong to no helper (a VMM's).
const UNCLAIMED_TTL: Duration = Duration::from_secs(60);

impl Reaper {
    /// Makes this process the subreaper of its descendants and starts the
    /// reaper thread. `on_exit` hears of every child that no helper waiter
    /// claims (an exited VMM, an orphan reparented to us). Once per process.
    pub fn install(on_exit: impl Fn(u32, ExitStatus) + Send + Sync + 'static) -> crate::Result<()> {
        // SAFETY: prctl(PR_SET_CHILD_SUBREAPER, 1) takes no pointers.
        let rc = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        if rc != 0 {
            return Err(crate::Error::from(std::io::Error::last_os_error())
                .context("cannot become the subreaper of the VMMs"));
        }
        let reaper = Arc::new(Reaper {
            waiters: Mutex::new(Waiters::default()),
            on_exit: Box::new(on_exit),
        });
        if REAPER.set(reaper.clone()).is_err() {
            return Err(crate::Error::internal("the reaper is installed already"));
        }
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || reaper.run())
            .map_err(|e| crate::Error::from(e).context("cannot start the reaper thread"))?;
        Ok(())
    }

    /// Hears the wait statuses that the inits of VMM process trees reap
    /// (`vmm::jail::REAPED_SOCKET` in `home`; a tree's orphans go to its
    /// PID namespace's init, not to this subreaper) and hands each to
    /// `on_exit` as if reaped here. A report of a process that still runs
    /// is dropped.
    pub fn serve_reports(home: &std::path::Path) -> crate::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let Some(reaper) = REAPER.get().cloned() else {
            return Err(crate::Error::internal("no reaper to report to"));
        };
        let path = home.join(vmm::jail::REAPED_SOCKET);
        let _ = std::fs::remove_file(&path);
        let sock = std::os::unix::net::UnixDatagram::bind(&path).map_err(|e| {
            crate::Error::from(e).context(format!("cannot bind {}", path.display()))
        })?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(|e| {
            crate::Error::from(e).context(format!("cannot chmod {}", path.display()))
        })?;
        std::thread::Builder::new()
            .name("tree-reports".into())
            .spawn(move || {
                let mut buf = [0u8; 64];
                loop {
                    let Ok(n) = sock.recv(&mut buf) else {
                        continue;
                    };
                    let text = String::from_utf8_lossy(&buf[..n]);
                    let mut f = text.split_whitespace();
                    let (Some(Ok(pid)), Some(Ok(raw))) = (
                        f.next().map(str::parse::<u32>),
                        f.next().map(str::parse::<i32>),
                    ) else {
                        tracing::warn!("a bad report on {}: {text:?}", path.display());
                        continue;
                    };
                    if ProcStat::read(pid).is_some_and(|s| !s.is_exited()) {
                        continue;
                    }
                    let st = <ExitStatus as std::os::unix::process::ExitStatusExt>::from_raw(raw);
                    reaper.deliver(pid, st);
                }
            })
            .map_err(|e| crate::Error::from(e).context("cannot start the tree reports thread"))?;
        Ok(())
    }

    /// Whether a reaper runs in this process.
    pub fn installed() -> bool {
        REAPER.get().is_some()
    }

    fn run(&self) {
        loop {
            let mut reaped = false;
            loop {
                let mut status: libc::c_int = 0;
                // SAFETY: waitpid writes one int into `status`.
                let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
                if pid <= 0 {
                    break;
                }
                reaped = true;
                let st = <ExitStatus as std::os::unix::process::ExitStatusExt>::from_raw(status);
                self.deliver(pid as u32, st);
            }
            // No SIGCHLD plumbing: a short poll keeps zombies to a few ms
            // and costs nothing measurable.
            std::thread::sleep(Duration::from_millis(if reaped { 1 } else { 20 }));
        }
    }

    fn deliver(&self, pid: u32, st: ExitStatus) {
        let mut w = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = w.waiting.remove(&pid) {
            let _ = tx.send(st);
            return;
        }
        let now = Instant::now();
        w.unclaimed
            .retain(|_, (_, t)| now.duration_since(*t) < UNCLAIMED_TTL);
        w.unclaimed.insert(pid, (st, now));
        drop(w);
        (self.on_exit)(pid, st);
    }

    /// A channel that gets `pid`'s status (at once if it was reaped).
    fn claim(&self, pid: u32) -> mpsc::Receiver<ExitStatus> {
        let (tx, rx) = mpsc::channel();
        let mut w = self.waiters.lock().unwrap_or_else(|e| e.into_inner());
        match w.unclaimed.remove(&pid) {
            Some((st, _)) => {
                let _ = tx.send(st);
            }
            None => {
                w.waiting.insert(pid, tx);
            }
        }
        rx
    }
}

/// Waits for a helper child at most `timeout` (None: it was killed after
/// the timeout and reaped).
fn wait_child(child: &mut Child, timeout: Duration) -> std::io::Result<Option<ExitStatus>> {
    if let Some(r) = REAPER.get() {
        let rx = r.claim(child.id());
        return match rx.recv_timeout(timeout) {
            Ok(st) => Ok(Some(st)),
            Err(_) => {
                let _ = child.kill();
                let _ = rx.recv_timeout(Duration::from_secs(5));
                Ok(None)
            }
        };
    }
    let t0 = Instant::now();
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(Some(s));
        }
        if t0.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// What a helper printed and how it ended.
#[derive(Debug)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

/// Errors running a helper.
#[derive(Debug, thiserror::Error)]
pub enum HelperError {
    #[error("cannot run {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{program} ran longer than {secs}s and was killed")]
    Timeout { program: String, secs: u64 },
    #[error("{program} failed: {source}")]
    Io {
        program: String,
        #[source]
        source: std::io::Error,
    },
}

impl From<HelperError> for crate::Error {
    fn from(e: HelperError) -> Self {
        crate::Error::failed(e.to_string())
    }
}

/// Runs a helper with `input` on its stdin and returns what it printed,
/// killing it after `timeout`.
pub fn output(cmd: &mut Command, input: &[u8], timeout: Duration) -> Result<Output, HelperError> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let mut child = cmd
        .stdin(if input.is_empty() {
            Stdio::null()
        } else {
            Stdio::piped()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| HelperError::Spawn {
            program: program.clone(),
            source,
        })?;
    let io = |source| HelperError::Io {
        program: program.clone(),
        source,
    };
    let feed = child.stdin.take().map(|mut stdin| {
        let input = input.to_vec();
        std::thread::spawn(move || std::io::Write::write_all(&mut stdin, &input))
    });
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut v);
            }
            v
        })
    };
    let out_t = drain(
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    );
    let err_t = drain(
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    );
    let status = wait_child(&mut child, timeout).map_err(io)?;
    let stdout = out_t.join().unwrap_or_default();
    let stderr = err_t.join().unwrap_or_default();
    if let Some(f) = feed {
        let _ = f.join();
    }
    match status {
        Some(status) => Ok(Output {
            status,
            stdout,
            stderr,
        }),
        None => Err(HelperError::Timeout {
            program,
            secs: timeout.as_secs(),
        }),
    }
}

/// A process the engine watches: pid and start time (so a reused pid is
/// never mistaken for it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pid {
    pub pid: u32,
    pub start: u64,
}

impl Pid {
    /// The process listening on Unix socket `path`, as this host sees it:
    /// the kernel's peer credentials, which it translates into our PID
    /// namespace. A VMM's own report of its pid is a pid in its tree's
    /// namespace, and would name another process here (and a VMM is not
    /// trusted to say who it is). Each process that serves a socket binds
    /// and listens itself, so the credentials are its own.
    pub fn listening_on(path: &std::path::Path) -> crate::Result<Pid> {
        let s = std::os::unix::net::UnixStream::connect(path).map_err(|e| {
            crate::Error::from(e).context(format!("cannot connect to {}", path.display()))
        })?;
        // SAFETY: ucred is plain data that getsockopt fills.
        let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
        let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
        // SAFETY: getsockopt(2) with a buffer of `len` bytes.
        let rc = unsafe {
            libc::getsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERCRED,
                (&mut cred as *mut libc::ucred).cast(),
                &mut len,
            )
        };
        if rc != 0 || cred.pid <= 0 {
            return Err(crate::Error::from(std::io::Error::last_os_error())
                .context(format!("cannot tell who listens on {}", path.display())));
        }
        Pid::of(cred.pid as u32).ok_or_else(|| {
            crate::Error::failed(format!(
                "the process listening on {} is gone",
                path.display()
            ))
        })
    }

    /// [`Pid::listening_on`] for a socket its VMM just reported ready:
    /// no process (pid 0, which is never alive: `ls` then shows the vm
    /// ended) when nothing listens there any more. It died right after;
    /// the operation itself is done, and its record must say what is.
    pub fn listening_on_or_gone(path: &std::path::Path) -> Pid {
        Pid::listening_on(path).unwrap_or_else(|e| {
            tracing::warn!("{e}");
            Pid { pid: 0, start: 0 }
        })
    }

    /// `pid` as it is now, if it exists.
    pub fn of(pid: u32) -> Option<Pid> {
        process_start(pid).map(|start| Pid { pid, start })
    }
    pub fn alive(&self) -> bool {
        process_alive(self.pid, self.start)
    }
    /// Sends `sig` if the process is still this one.
    pub fn signal(&self, sig: libc::c_int) {
        if self.alive() {
            // SAFETY: kill(2) of a pid checked to be this process (pid +
            // start time).
            unsafe {
                libc::kill(self.pid as libc::pid_t, sig);
            }
        }
    }

    /// Waits until the whole thread group has exited. A pidfd becomes
    /// readable exactly then (a zombie leader whose other threads still
    /// tear down the vm is not gone yet: its sockets still accept);
    /// without one, polls /proc.
    pub fn wait_gone(&self, timeout: Duration) -> bool {
        if !self.alive() {
            return true;
        }
        // SAFETY: pidfd_open(2) takes a pid and flags and returns a new fd.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, self.pid as libc::pid_t, 0) };
        if let Ok(fd) = i32::try_from(fd) {
            if fd >= 0 {
                // SAFETY: `fd` is the new pidfd, owned here.
                let pidfd = unsafe { OwnedFd::from_raw_fd(fd) };
                // The pid may have been reused between the check and the open.
                if !self.alive() {
                    return true;
                }
                let mut pfd = libc::pollfd {
                    fd: pidfd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
                // SAFETY: polls one valid pollfd.
                return unsafe { libc::poll(&mut pfd, 1, ms) } == 1;
            }
        }
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if !self.alive() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        !self.alive()
    }

    /// SIGKILL, then wait until it is gone.
    pub fn kill(&self, timeout: Duration) -> crate::Result<()> {
        self.signal(libc::SIGKILL);
        if !self.wait_gone(timeout) {
            crate::bail!("process {} survived SIGKILL", self.pid);
        }
        Ok(())
    }
}

/// The `TINE_HOME` in a process's environment (which home a VMM belongs to).
pub fn home_of(pid: u32) -> Option<std::path::PathBuf> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|b| *b == 0).find_map(|kv| {
        kv.strip_prefix(b"TINE_HOME=")
            .map(|v| std::path::PathBuf::from(String::from_utf8_lossy(v).into_owned()))
    })
}

/// Whether `pid` is the pid 1 of a PID namespace below ours (a VMM
/// tree's init, which runs `tine-vmm` but is no VMM). Its
/// `/proc/PID/status` says so (NSpid's last field), which no process can
/// change about itself.
pub fn is_namespace_init(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|st| {
        st.lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .is_some_and(|f| {
                let f: Vec<&str> = f.split_whitespace().collect();
                f.len() > 1 && f.last() == Some(&"1")
            })
    })
}

/// Every live VMM process of `home`: its executable is named `exe_name`
/// (also after the binary was rebuilt under it, when /proc shows it
/// "(deleted)") and its environment names `home` as TINE_HOME.
pub fn vmm_processes(exe_name: &str, home: &std::path::Path) -> Vec<Pid> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.trim_end_matches(" (deleted)") == exe_name)
            })
        })
        .filter(|pid| home_of(*pid).is_some_and(|h| h == home))
        .filter(|pid| !is_namespace_init(*pid))
        .filter_map(|pid| {
            let st = ProcStat::read(pid)?;
            (!st.is_exited()).then_some(Pid {
                pid,
                start: st.start,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_proc_stat_reads_own_process() {
        let me = ProcStat::read(std::process::id()).expect("own stat");
        assert!(!me.comm.is_empty());
        assert!(!me.is_exited());
        assert!(me.start > 0);
        // SAFETY: getppid(2) has no preconditions.
        let parent = unsafe { libc::getppid() };
        assert_eq!(i64::from(me.ppid), i64::from(parent));
    }

    #[test]
    fn test_process_alive_checks_start_time() {
        let me = std::process::id();
        let start = process_start(me).expect("own stat");
        assert!(process_alive(me, start));
        assert!(!process_alive(me, start + 1));
        assert!(!process_alive(u32::MAX - 1, start));
    }
}
