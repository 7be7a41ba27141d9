//! The commands the agent runs, and the requests that follow and drive
//! them: `Exec` starts one, `Attach` follows it, `Signal` and `Input` drive
//! it, `ListProcesses` lists them (see the protocol crate).
//!
//! Every command is a job in one table. Its output goes to every
//! connection following it (the one that started it first); output nobody
//! follows is dropped, as E2B's envd drops it. A command ends with the
//! connection that started it, unless it was started with `keep`: then it
//! is the agent's, and goes on through a client that left, a sleep or a
//! fork (whose copies each have it) until it exits or is signalled.

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use protocol::{
    read_frame, send, write_frame, Connection, ErrorKind, Frame, Message, ProcessInfo, ProcessRef,
    ProtocolError, Stream, MAX_CHUNK,
};

use crate::quiesce;
use crate::serve::{describe, reply_error};

/// What `Exec` asked for.
pub struct Spec {
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: Option<String>,
    pub stdin: bool,
    pub timeout_ms: Option<u64>,
    pub keep: bool,
    pub tag: Option<String>,
    pub user: Option<String>,
}

/// Every running command.
static JOBS: Mutex<Vec<Arc<Job>>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A connection following a command, seen only as where its frames go.
trait Follower: Send {
    fn send(&mut self, frame: &Frame) -> Result<(), ProtocolError>;
    fn close(&self);
}

struct Conn<C>(C);

impl<C: Connection> Follower for Conn<C> {
    fn send(&mut self, frame: &Frame) -> Result<(), ProtocolError> {
        write_frame(&mut self.0, frame)
    }
    fn close(&self) {
        let _ = self.0.shutdown(Shutdown::Both);
    }
}

#[derive(Default)]
struct Followers {
    next: u64,
    list: Vec<(u64, Box<dyn Follower>)>,
    /// The command's `Exited`, once it ended.
    ended: Option<Message>,
}

struct Job {
    info: ProcessInfo,
    pgid: libc::pid_t,
    /// False once the command ended: its group may be gone and its id reused.
    live: Mutex<bool>,
    stdin: Mutex<Option<ChildStdin>>,
    followers: Mutex<Followers>,
}

impl Job {
    /// Signals the command's process group; false when it had ended.
    fn signal(&self, sig: libc::c_int) -> bool {
        let live = lock(&self.live);
        if *live {
            // SAFETY: killpg(2) on the group this job created; `live`
            // guarantees it has not been reaped.
            unsafe { libc::killpg(self.pgid, sig) };
        }
        *live
    }

    /// Adds a follower: it gets `Started` now, then the output. None when
    /// the command has ended (the follower got `Exited` too) or the
    /// follower failed at once.
    fn follow(&self, mut f: Box<dyn Follower>) -> Option<u64> {
        let mut fs = lock(&self.followers);
        let started = Frame::Message(Message::Started { pid: self.info.pid });
        if f.send(&started).is_err() {
            return None;
        }
        if let Some(end) = &fs.ended {
            let _ = f.send(&Frame::Message(end.clone()));
            f.close();
            return None;
        }
        fs.next += 1;
        let id = fs.next;
        fs.list.push((id, f));
        Some(id)
    }

    fn unfollow(&self, id: u64) -> Option<Box<dyn Follower>> {
        let mut fs = lock(&self.followers);
        let at = fs.list.iter().position(|(i, _)| *i == id)?;
        Some(fs.list.swap_remove(at).1)
    }

    /// Sends a frame to every follower; one that fails stops following
    /// (its own connection thread notices the connection ending).
    fn broadcast(&self, frame: &Frame) {
        lock(&self.followers)
            .list
            .retain_mut(|(_, f)| f.send(frame).is_ok());
    }

    /// The command ended: every follower gets `Exited` and is let go.
    fn end(&self, exited: Message) {
        let mut fs = lock(&self.followers);
        let frame = Frame::Message(exited.clone());
        for (_, mut f) in fs.list.drain(..) {
            let _ = f.send(&frame);
            f.close();
        }
        fs.ended = Some(exited);
    }
}

fn find(r: &ProcessRef) -> Option<Arc<Job>> {
    lock(&JOBS)
        .iter()
        .find(|j| match r {
            ProcessRef::Pid(p) => j.info.pid == *p,
            ProcessRef::Tag(t) => j.info.tag.as_deref() == Some(t.as_str()),
        })
        .cloned()
}

fn not_running(r: &ProcessRef) -> String {
    format!("no running command has {r} (it ended, or the agent did not start it)")
}

/// A guest user, from /etc/passwd and /etc/group. Read by hand: the agent
/// is a static binary, where glibc's getpwnam needs NSS modules it lacks.
struct User {
    uid: libc::uid_t,
    gid: libc::gid_t,
    groups: Vec<libc::gid_t>,
    home: String,
}

fn lookup_user(name: &str) -> io::Result<User> {
    let passwd = std::fs::read_to_string("/etc/passwd").map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("cannot look up user {name:?}: the guest's /etc/passwd: {e}"),
        )
    })?;
    let fields = passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() >= 7 && f[0] == name)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("there is no user {name:?} in the guest's /etc/passwd"),
            )
        })?;
    let bad = || io::Error::other(format!("/etc/passwd has a malformed line for {name:?}"));
    let uid = fields[2].parse().map_err(|_| bad())?;
    let gid = fields[3].parse().map_err(|_| bad())?;
    let mut groups = vec![gid];
    if let Ok(group) = std::fs::read_to_string("/etc/group") {
        for f in group.lines().map(|l| l.split(':').collect::<Vec<_>>()) {
            if f.len() >= 4 && f[3].split(',').any(|m| m == name) {
                if let Ok(g) = f[2].parse() {
                    groups.push(g);
                }
            }
        }
    }
    Ok(User {
        uid,
        gid,
        groups,
        home: fields[5].to_string(),
    })
}

/// `Exec`: starts the command and serves this connection (its first
/// follower, and its stdin) until it ends.
pub fn exec<C: Connection>(conn: &mut C, spec: Spec) -> Result<(), ProtocolError> {
    let Some((prog, args)) = spec.argv.split_first() else {
        return reply_error(conn, ErrorKind::BadRequest, "exec: empty argv".into());
    };
    if let Some(t) = &spec.tag {
        if find(&ProcessRef::Tag(t.clone())).is_some() {
            let msg = format!("a running command already has tag {t:?}; pick another");
            return reply_error(conn, ErrorKind::BadRequest, msg);
        }
    }
    let user = match spec.user.as_deref().map(lookup_user).transpose() {
        Ok(u) => u,
        Err(e) => return reply_error(conn, ErrorKind::Spawn, format!("cannot run {prog}: {e}")),
    };
    let mut cmd = Command::new(prog);
    cmd.args(args);
    if let (Some(u), Some(name)) = (&user, &spec.user) {
        cmd.env("HOME", &u.home)
            .env("USER", name)
            .env("LOGNAME", name);
    }
    cmd.envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(if spec.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so a timeout, a signal or a lost host
        // reaches everything it started.
        .process_group(0);
    let cwd = spec.cwd.clone().or_else(|| {
        user.as_ref()
            .map(|u| u.home.clone())
            .filter(|h| std::path::Path::new(h).is_dir())
    });
    if let Some(cwd) = &cwd {
        cmd.current_dir(cwd);
    }
    let procs = quiesce::workload_procs();
    let ids = user.as_ref().map(|u| (u.uid, u.gid, u.groups.clone()));
    // SAFETY: the closure only makes system calls (open, write, close,
    // setgroups, setgid, setuid: async-signal-safe) on data prepared
    // before the fork; it allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            // The workload cgroup first (as root: its cgroup.procs is
            // root's), so a command started while the guest is quiesced
            // waits for the thaw like everything else. Failing leaves it
            // where the agent is: not frozen, but running.
            if let Some(procs) = procs {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd >= 0 {
                    let _ = libc::write(fd, b"0".as_ptr().cast(), 1);
                    libc::close(fd);
                }
            }
            if let Some((uid, gid, groups)) = &ids {
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setgid(*gid) != 0
                    || libc::setuid(*uid) != 0
                {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        })
    };
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let where_ = cwd.map(|d| format!(" in {d}")).unwrap_or_default();
            return reply_error(
                conn,
                ErrorKind::Spawn,
                format!("cannot run {prog}{where_}: {e}"),
            );
        }
    };
    let pid = child.id();
    let job = Arc::new(Job {
        info: ProcessInfo {
            pid,
            tag: spec.tag,
            argv: spec.argv.clone(),
            env: spec.env,
            cwd,
            user: spec.user,
            keep: spec.keep,
            stdin: spec.stdin,
        },
        pgid: pid as libc::pid_t,
        live: Mutex::new(true),
        stdin: Mutex::new(child.stdin.take()),
        followers: Mutex::default(),
    });
    let follower = match conn.try_clone() {
        Ok(c) => Box::new(Conn(c)),
        Err(e) => {
            job.signal(libc::SIGKILL);
            let _ = child.wait();
            return Err(e.into());
        }
    };
    lock(&JOBS).push(job.clone());
    let me = job.follow(follower);

    let mut pumps = Vec::new();
    let outs: [(Option<Box<dyn Read + Send>>, Stream); 2] = [
        (
            child
                .stdout
                .take()
                .map(|o| Box::new(o) as Box<dyn Read + Send>),
            Stream::Stdout,
        ),
        (
            child
                .stderr
                .take()
                .map(|o| Box::new(o) as Box<dyn Read + Send>),
            Stream::Stderr,
        ),
    ];
    for (out, stream) in outs {
        if let Some(out) = out {
            let j = job.clone();
            pumps.push(std::thread::spawn(move || pump_output(out, stream, &j)));
        }
    }
    let timed_out = Arc::new(AtomicBool::new(false));
    let (cancel, cancelled) = mpsc::channel::<()>();
    if let Some(ms) = spec.timeout_ms {
        let (j, t) = (job.clone(), timed_out.clone());
        std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) =
                cancelled.recv_timeout(Duration::from_millis(ms))
            {
                t.store(true, Ordering::SeqCst);
                j.signal(libc::SIGKILL);
            }
        });
    }
    let reaper = job.clone();
    std::thread::spawn(move || {
        let status = child.wait();
        // Output ends when every process holding the pipes is gone (ssh's
        // semantics for background children); a timeout, a signal or a
        // lost host still reaches the whole group meanwhile.
        for p in pumps {
            let _ = p.join();
        }
        *lock(&reaper.live) = false;
        drop(cancel);
        lock(&JOBS).retain(|j| !Arc::ptr_eq(j, &reaper));
        *lock(&reaper.stdin) = None;
        let exited = match status {
            Ok(s) => Message::Exited {
                code: s.code(),
                signal: s.signal(),
                timed_out: timed_out.load(Ordering::SeqCst),
            },
            Err(e) => Message::Error {
                kind: ErrorKind::Io,
                message: format!("waiting for pid {}: {e}", reaper.info.pid),
            },
        };
        reaper.end(exited);
    });
    match me {
        Some(id) => serve_follower(conn, &job, id, true),
        None => {
            // The host left before it heard the command start.
            if !job.info.keep {
                job.signal(libc::SIGKILL);
            }
            Ok(())
        }
    }
}

/// Streams one output pipe of the command to its followers.
fn pump_output(mut out: Box<dyn Read + Send>, stream: Stream, job: &Job) {
    let mut buf = vec![0u8; MAX_CHUNK];
    loop {
        match out.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => job.broadcast(&Frame::Data(stream, buf[..n].to_vec())),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Reads a follower's connection until it ends: stdin for the command
/// (from the connection that started it), or the connection going away,
/// which ends a command not started with `keep`.
fn serve_follower<C: Connection>(
    conn: &mut C,
    job: &Job,
    id: u64,
    takes_input: bool,
) -> Result<(), ProtocolError> {
    loop {
        match read_frame(conn) {
            Ok(Frame::Data(Stream::Stdin, bytes)) if takes_input => {
                let mut stdin = lock(&job.stdin);
                if let Some(s) = stdin.as_mut() {
                    if s.write_all(&bytes).is_err() {
                        // The command closed its stdin; drop the rest.
                        *stdin = None;
                    }
                }
            }
            Ok(Frame::Message(Message::Eof {
                stream: Stream::Stdin,
            })) if takes_input => *lock(&job.stdin) = None,
            Err(ProtocolError::Io(_) | ProtocolError::Closed) => {
                job.unfollow(id);
                if takes_input && !job.info.keep {
                    job.signal(libc::SIGKILL);
                }
                return Ok(());
            }
            other => {
                // Answered on the follower's own handle, taken out of the
                // table first, so the error does not interleave with output.
                let msg = match other {
                    Ok(f) => format!("unexpected {} while following a command", describe(&f)),
                    Err(e) => e.to_string(),
                };
                if let Some(mut f) = job.unfollow(id) {
                    let _ = f.send(&Frame::Message(Message::Error {
                        kind: ErrorKind::BadRequest,
                        message: msg,
                    }));
                    f.close();
                }
                if takes_input && !job.info.keep {
                    job.signal(libc::SIGKILL);
                }
                return Ok(());
            }
        }
    }
}

/// `Attach`: follows a running command until it ends or the host leaves.
pub fn attach<C: Connection>(conn: &mut C, process: &ProcessRef) -> Result<(), ProtocolError> {
    let Some(job) = find(process) else {
        return reply_error(conn, ErrorKind::NotFound, not_running(process));
    };
    let follower = Box::new(Conn(conn.try_clone()?));
    match job.follow(follower) {
        Some(id) => serve_follower(conn, &job, id, false),
        None => Ok(()),
    }
}

/// `Signal`: a signal to a running command's process group.
pub fn signal<C: Connection>(
    conn: &mut C,
    process: &ProcessRef,
    sig: i32,
) -> Result<(), ProtocolError> {
    if !(1..=64).contains(&sig) {
        return reply_error(
            conn,
            ErrorKind::BadRequest,
            format!("{sig} is not a signal number (1-64)"),
        );
    }
    match find(process) {
        Some(job) => send(
            conn,
            Message::Done {
                changed: job.signal(sig),
            },
        ),
        None => reply_error(conn, ErrorKind::NotFound, not_running(process)),
    }
}

/// `Input`: the frames up to `Eof(stdin)` go to a running command's stdin.
pub fn input<C: Connection>(
    conn: &mut C,
    process: &ProcessRef,
    close: bool,
) -> Result<(), ProtocolError> {
    let job = find(process);
    let mut failure: Option<(ErrorKind, String)> = match &job {
        None => Some((ErrorKind::NotFound, not_running(process))),
        Some(j) if !j.info.stdin => Some((
            ErrorKind::BadRequest,
            format!("{process} was started without stdin: it takes no input"),
        )),
        Some(_) => None,
    };
    // The whole input is read even after a failure, so the host reads the
    // answer instead of a reset connection.
    loop {
        match read_frame(conn) {
            Ok(Frame::Data(Stream::Stdin, bytes)) => {
                if let (Some(j), None) = (&job, &failure) {
                    let mut stdin = lock(&j.stdin);
                    let written = match stdin.as_mut() {
                        Some(s) => s.write_all(&bytes).map_err(|e| e.to_string()),
                        None => Err("its stdin is closed".into()),
                    };
                    if let Err(e) = written {
                        *stdin = None;
                        failure = Some((ErrorKind::Io, format!("cannot write to {process}: {e}")));
                    }
                }
            }
            Ok(Frame::Message(Message::Eof {
                stream: Stream::Stdin,
            })) => break,
            Ok(f) => {
                let msg = format!("unexpected {} during input", describe(&f));
                return reply_error(conn, ErrorKind::BadRequest, msg);
            }
            Err(e @ (ProtocolError::Io(_) | ProtocolError::Closed)) => return Err(e),
            Err(e) => return reply_error(conn, ErrorKind::BadRequest, e.to_string()),
        }
    }
    if let Some((kind, message)) = failure {
        return reply_error(conn, kind, message);
    }
    if let (Some(j), true) = (&job, close) {
        *lock(&j.stdin) = None;
    }
    send(conn, Message::Done { changed: true })
}

/// `ListProcesses`: every running command.
pub fn list<C: Connection>(conn: &mut C) -> Result<(), ProtocolError> {
    let processes = lock(&JOBS).iter().map(|j| j.info.clone()).collect();
    send(conn, Message::Processes { processes })
}
