//! The gateway's control protocol (one JSON object per line over
//! `$TINE_HOME/effects/control.sock`) and the client the CLI and the tests
//! use to start, call and stop the gateway.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::{Error, MomentKind, Paths, Registration};

/// A request to the gateway.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Ping,
    /// Listen for `reg.branch` at `reg.socket` (replacing whatever branch
    /// listened there), now and after every gateway restart.
    Register {
        reg: Registration,
    },
    /// Stop listening for a branch (its vm was removed or replaced).
    Unregister {
        branch: String,
    },
    /// A moment of `branch` is about to be taken (its guest is quiesced):
    /// hold its responses, record the barrier.
    Moment {
        branch: String,
        moment: String,
        kind: MomentKind,
    },
    /// The moment was taken (`ok`; every connection of the branch belongs
    /// to the process that was, and is cut) or not (the barrier goes);
    /// then register the copies that continue from it.
    MomentDone {
        branch: String,
        moment: String,
        ok: bool,
        #[serde(default)]
        register: Vec<Registration>,
    },
    Status,
    Shutdown,
}

/// The gateway's answer.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<Status>,
}

/// `tine gateway status`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Status {
    pub pid: u32,
    /// Registered vms (name and branch).
    pub branches: Vec<(String, String)>,
    pub journal: String,
    pub schema_version: i64,
    /// Effect rows per state.
    pub effects: Vec<(String, i64)>,
}

/// Sends one request and reads its reply.
pub fn call(socket: &Path, req: &Request, timeout: Duration) -> Result<Reply, Error> {
    let io = |e| Error::Io(socket.display().to_string(), e);
    let mut s = UnixStream::connect(socket).map_err(io)?;
    s.set_read_timeout(Some(timeout)).map_err(io)?;
    s.set_write_timeout(Some(timeout)).map_err(io)?;
    let mut line = serde_json::to_vec(req).map_err(|e| Error::Control(e.to_string()))?;
    line.push(b'\n');
    // A gateway that refuses the caller answers and closes at once: its
    // answer is read even when the request could not all be written.
    let sent = s.write_all(&line);
    let mut reply = String::new();
    let read = BufReader::new(&s).read_line(&mut reply);
    if reply.is_empty() {
        sent.map_err(io)?;
    }
    read.map_err(io)?;
    if reply.is_empty() {
        return Err(Error::Control(format!(
            "{} closed the connection without an answer",
            socket.display()
        )));
    }
    let r: Reply = serde_json::from_str(&reply)
        .map_err(|e| Error::Control(format!("bad reply {reply:?}: {e}")))?;
    match (&r.ok, &r.error) {
        (false, e) => Err(Error::Control(
            e.clone().unwrap_or_else(|| "request refused".into()),
        )),
        _ => Ok(r),
    }
}

/// The gateway's status, if it answers.
pub fn status(paths: &Paths) -> Option<Status> {
    call(&paths.control(), &Request::Status, Duration::from_secs(5))
        .ok()
        .and_then(|r| r.status)
}

/// Whether a gateway answers on the control socket.
pub fn answers(paths: &Paths) -> bool {
    call(&paths.control(), &Request::Ping, Duration::from_secs(2)).is_ok()
}

/// Starts `serve` (a command that runs the gateway in the foreground, e.g.
/// `tine gateway serve`) detached, unless a gateway answers already; waits
/// until it answers. Several callers at once start one gateway.
pub fn start(paths: &Paths, mut serve: Command) -> Result<u32, Error> {
    std::fs::create_dir_all(&paths.dir)
        .map_err(|e| Error::Io(paths.dir.display().to_string(), e))?;
    let lock = std::fs::File::create(paths.start_lock())
        .map_err(|e| Error::Io(paths.start_lock().display().to_string(), e))?;
    // SAFETY: flock(2) on a file this function owns; released on drop.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(Error::Io("flock".into(), std::io::Error::last_os_error()));
    }
    if let Some(s) = status(paths) {
        return Ok(s.pid);
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(paths.log())
        .map_err(|e| Error::Io(paths.log().display().to_string(), e))?;
    let log2 = log
        .try_clone()
        .map_err(|e| Error::Io(paths.log().display().to_string(), e))?;
    serve.stdin(Stdio::null()).stdout(log).stderr(log2);
    // SAFETY: setsid(2) in the child before exec: async-signal-safe, and
    // makes the gateway outlive the caller's session and terminal.
    unsafe {
        serve.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = serve
        .spawn()
        .map_err(|e| Error::Gateway(format!("cannot start the gateway: {e}")))?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(s) = status(paths) {
            // Reaped by init once this process exits; not waited for here.
            std::mem::forget(child);
            return Ok(s.pid);
        }
        if let Ok(Some(st)) = child.try_wait() {
            let log = std::fs::read_to_string(paths.log()).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            return Err(Error::Gateway(format!(
                "the gateway ended at start ({st}): {}",
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            )));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::Gateway(format!(
                "the gateway did not answer within 20 s (see {})",
                paths.log().display()
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Asks the gateway to end, and waits until its pid is gone (SIGKILL
/// after `timeout`). Returns whether one ran.
pub fn stop(paths: &Paths, timeout: Duration) -> Result<bool, Error> {
    let Some(st) = status(paths) else {
        return Ok(false);
    };
    let _ = call(&paths.control(), &Request::Shutdown, Duration::from_secs(5));
    let deadline = Instant::now() + timeout;
    while pid_alive(st.pid) {
        if Instant::now() > deadline {
            // SAFETY: kill(2) of the pid the gateway itself reported.
            unsafe {
                libc::kill(st.pid as libc::pid_t, libc::SIGKILL);
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(true)
}

fn pid_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}
