//! The agent's request server: one thread per connection, one request per
//! connection, after a Hello exchange (see the protocol crate).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::{quiesce, wake};
use protocol::{
    read_frame, send, write_frame, Connection, ErrorKind, Frame, Hello, Message, ProtocolError,
    Stream, MAX_CHUNK, PROTOCOL_VERSION,
};

/// This agent's version, sent in Hello and Pong.
pub const AGENT_VERSION: &str = concat!("tine-agent ", env!("CARGO_PKG_VERSION"));

/// What `Shutdown` does after replying.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnShutdown {
    /// sync, then reboot(RB_POWER_OFF): the guest powers off.
    PowerOff,
    /// sync, then exit the agent (for running it on a host, in tests).
    Exit,
}

/// How this agent runs.
#[derive(Clone, Debug)]
pub struct Settings {
    pub on_shutdown: OnShutdown,
    /// `--root`: Wake's file paths live under this directory and its
    /// system-wide steps (and Quiesce's freezing) are skipped.
    pub root: Option<PathBuf>,
}

/// Serves one connection to its end; errors are logged, never fatal.
pub fn handle<C: Connection>(mut conn: C, settings: &Settings) {
    if let Err(e) = serve(&mut conn, settings) {
        match e {
            ProtocolError::Closed => {}
            ProtocolError::Io(e) => eprintln!("tine-agent: connection failed: {e}"),
            e => eprintln!("tine-agent: connection: {e}"),
        }
    }
    let _ = conn.shutdown(Shutdown::Both);
}

fn reply_error<C: Write>(
    conn: &mut C,
    kind: ErrorKind,
    message: String,
) -> Result<(), ProtocolError> {
    send(conn, Message::Error { kind, message })
}

/// Answers a frame that could not be read. Returns Err when the connection
/// itself failed (nothing to answer on).
fn bad_frame<C: Write>(conn: &mut C, e: ProtocolError) -> Result<(), ProtocolError> {
    match e {
        ProtocolError::Io(_) | ProtocolError::Closed => Err(e),
        e => reply_error(conn, ErrorKind::BadRequest, e.to_string()),
    }
}

fn serve<C: Connection>(conn: &mut C, settings: &Settings) -> Result<(), ProtocolError> {
    match read_frame(conn) {
        Ok(Frame::Message(Message::Hello(h))) if h.protocol == PROTOCOL_VERSION => send(
            conn,
            Message::Hello(Hello {
                protocol: PROTOCOL_VERSION,
                software: AGENT_VERSION.into(),
            }),
        )?,
        Ok(Frame::Message(Message::Hello(h))) => {
            return reply_error(
                conn,
                ErrorKind::Version,
                format!(
                    "{} speaks protocol version {}; {} sent version {}",
                    AGENT_VERSION, PROTOCOL_VERSION, h.software, h.protocol
                ),
            )
        }
        Ok(f) => {
            return reply_error(
                conn,
                ErrorKind::BadRequest,
                format!("expected hello, got {}", describe(&f)),
            )
        }
        Err(e) => return bad_frame(conn, e),
    }
    let req = match read_frame(conn) {
        Ok(Frame::Message(m)) => m,
        Ok(f) => {
            return reply_error(
                conn,
                ErrorKind::BadRequest,
                format!("expected a request, got {}", describe(&f)),
            )
        }
        // Every host caller sends a request after its hello: a connection
        // that ends here is the one `tine exec` sometimes sees closed
        // after a fork (docs/design/fork.md). Said on the console, so the
        // next one shows which side ended it.
        Err(ProtocolError::Closed) => {
            eprintln!("tine-agent: a connection ended after its hello, before any request (EOF)");
            return Err(ProtocolError::Closed);
        }
        Err(e) => return bad_frame(conn, e),
    };
    match req {
        Message::Ping => send(
            conn,
            Message::Pong {
                agent_version: AGENT_VERSION.into(),
                boot_id: boot_id(),
                uptime_ms: uptime_ms(),
            },
        ),
        Message::Exec {
            argv,
            env,
            cwd,
            stdin,
            timeout_ms,
        } => exec(conn, argv, env, cwd, stdin, timeout_ms),
        Message::ReadFile { path } => read_file(conn, Path::new(&path)),
        Message::WriteFile { path, mode } => write_file(conn, Path::new(&path), mode),
        Message::Stat { path } => {
            fs_answer(conn, &path, crate::fs::stat(Path::new(&path)), entries)
        }
        Message::ListDir { path, depth } => fs_answer(
            conn,
            &path,
            crate::fs::list_dir(Path::new(&path), depth),
            entries,
        ),
        Message::Remove { path } => {
            fs_answer(conn, &path, crate::fs::remove(Path::new(&path)), done)
        }
        Message::MakeDir { path } => {
            fs_answer(conn, &path, crate::fs::make_dir(Path::new(&path)), done)
        }
        Message::Shutdown => {
            send(conn, Message::ShuttingDown)?;
            // Give the reply time to leave the guest before it powers off:
            // wait (briefly) for the host to close its end.
            let _ = conn.shutdown(Shutdown::Write);
            wait_for_close(conn, Duration::from_secs(1));
            shutdown(settings.on_shutdown);
            Ok(())
        }
        Message::Quiesce { timeout_ms } => {
            let report = {
                let _serial = quiesce::SERIAL
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                quiesce::quiesce(timeout_ms, settings.root.is_some())
            };
            send(conn, Message::Quiesced(report))
        }
        Message::Wake(w) => {
            let report = {
                let _serial = quiesce::SERIAL
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                let ctx = wake::Ctx {
                    root: settings.root.clone(),
                };
                wake::wake(&w, &ctx)
            };
            send(conn, Message::Woke(Box::new(report)))
        }
        m => reply_error(
            conn,
            ErrorKind::BadRequest,
            format!("{} is not a request", describe(&Frame::Message(m))),
        ),
    }
}

fn entries(entries: Vec<protocol::Entry>) -> Message {
    Message::Entries { entries }
}

fn done(changed: bool) -> Message {
    Message::Done { changed }
}

/// Sends a file operation's answer, or its error naming the path.
fn fs_answer<C: Write, T>(
    conn: &mut C,
    path: &str,
    r: io::Result<T>,
    answer: fn(T) -> Message,
) -> Result<(), ProtocolError> {
    match r {
        Ok(v) => send(conn, answer(v)),
        Err(e) => reply_error(conn, io_kind(&e), format!("{path}: {e}")),
    }
}

fn describe(f: &Frame) -> String {
    match f {
        Frame::Data(s, _) => format!("data on stream {s:?}"),
        Frame::Message(m) => {
            let s = format!("{m:?}");
            let name = s.split([' ', '(', '{']).next().unwrap_or("message");
            format!("message {name}")
        }
    }
}

fn boot_id() -> String {
    fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn uptime_ms() -> u64 {
    fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map(|secs| (secs * 1000.0) as u64)
        .unwrap_or(0)
}

/// Waits until the peer closes the connection, at most `limit`.
fn wait_for_close<C: Connection>(conn: &C, limit: Duration) {
    let Ok(mut r) = conn.try_clone() else { return };
    let (tx, rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut buf = [0u8; 512];
        while let Ok(1..) = r.read(&mut buf) {}
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(limit);
}

fn shutdown(on_shutdown: OnShutdown) {
    match on_shutdown {
        OnShutdown::Exit => {
            // No sync: exiting loses nothing, and on a host (where the agent
            // runs with --exit-on-shutdown) sync(2) would flush every
            // filesystem of the machine first.
            eprintln!("tine-agent: shutdown requested, exiting");
            std::process::exit(0);
        }
        OnShutdown::PowerOff => {
            // SAFETY: sync(2) takes no arguments and cannot fail.
            unsafe { libc::sync() };
            eprintln!("tine-agent: shutdown requested, powering off");
            // SAFETY: reboot(2) with a valid command; on success it does not
            // return, on failure we only log.
            if unsafe { libc::reboot(libc::RB_POWER_OFF) } < 0 {
                eprintln!("tine-agent: poweroff: {}", io::Error::last_os_error());
            }
        }
    }
}

fn io_kind(e: &io::Error) -> ErrorKind {
    match e.kind() {
        io::ErrorKind::NotFound => ErrorKind::NotFound,
        io::ErrorKind::PermissionDenied => ErrorKind::Permission,
        _ => ErrorKind::Io,
    }
}

/// Kills a command's process group while its exec is in progress.
struct Killer {
    pgid: libc::pid_t,
    /// False once the exec finished: the group may be gone and its id reused.
    live: Mutex<bool>,
}

impl Killer {
    fn kill(&self) {
        let live = self.live.lock().unwrap_or_else(PoisonError::into_inner);
        if *live {
            // SAFETY: killpg(2) on the group this exec created; `live`
            // guarantees we have not finished with it.
            unsafe { libc::killpg(self.pgid, libc::SIGKILL) };
        }
    }

    fn finish(&self) {
        *self.live.lock().unwrap_or_else(PoisonError::into_inner) = false;
    }
}

fn exec<C: Connection>(
    conn: &mut C,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    cwd: Option<String>,
    stdin: bool,
    timeout_ms: Option<u64>,
) -> Result<(), ProtocolError> {
    let Some((prog, args)) = argv.split_first() else {
        return reply_error(conn, ErrorKind::BadRequest, "exec: empty argv".into());
    };
    let mut cmd = Command::new(prog);
    cmd.args(args)
        .envs(env)
        .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so a timeout or a lost host kills
        // everything it started.
        .process_group(0);
    if let Some(procs) = quiesce::workload_procs() {
        // Join the workload cgroup, so a command started while the guest
        // is quiesced waits for the thaw like everything else.
        // SAFETY: the closure only calls open/write/close (async-signal
        // safe) on a path made before the fork; it allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd >= 0 {
                    // Failing leaves it where the agent is: not frozen, but
                    // running, which beats not running it at all.
                    let _ = libc::write(fd, b"0".as_ptr().cast(), 1);
                    libc::close(fd);
                }
                Ok(())
            })
        };
    }
    if let Some(cwd) = &cwd {
        cmd.current_dir(cwd);
    }
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
    let killer = Arc::new(Killer {
        pgid: pid as libc::pid_t,
        live: Mutex::new(true),
    });
    let clones = (|| Ok::<_, io::Error>((conn.try_clone()?, conn.try_clone()?)))();
    let (writer, reader) = match clones {
        Ok(c) => c,
        Err(e) => {
            killer.kill();
            let _ = child.wait();
            return Err(e.into());
        }
    };
    let writer = Arc::new(Mutex::new(writer));
    let started = send(
        &mut *writer.lock().unwrap_or_else(PoisonError::into_inner),
        Message::Started { pid },
    );
    if let Err(e) = started {
        killer.kill();
        let _ = child.wait();
        return Err(e);
    }

    let mut pumps = Vec::new();
    for (out, stream) in [
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
    ] {
        if let Some(out) = out {
            let (w, k) = (writer.clone(), killer.clone());
            pumps.push(std::thread::spawn(move || pump_output(out, stream, &w, &k)));
        }
    }
    {
        let (w, k, input) = (writer.clone(), killer.clone(), child.stdin.take());
        std::thread::spawn(move || pump_input(reader, input, &w, &k));
    }
    let timed_out = Arc::new(AtomicBool::new(false));
    let (cancel, cancelled) = mpsc::channel::<()>();
    if let Some(ms) = timeout_ms {
        let (k, t) = (killer.clone(), timed_out.clone());
        std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) =
                cancelled.recv_timeout(Duration::from_millis(ms))
            {
                t.store(true, Ordering::SeqCst);
                k.kill();
            }
        });
    }

    let status = child.wait();
    // Output ends when every process holding the pipes is gone (ssh's
    // semantics for background children); a timeout or a lost host still
    // kills the whole group meanwhile.
    for p in pumps {
        let _ = p.join();
    }
    killer.finish();
    drop(cancel);
    let status = status?;
    let timed_out = timed_out.load(Ordering::SeqCst);
    let mut w = writer.lock().unwrap_or_else(PoisonError::into_inner);
    send(
        &mut *w,
        Message::Exited {
            code: status.code(),
            signal: status.signal(),
            timed_out,
        },
    )
}

/// Streams one output pipe of the command as Data frames.
fn pump_output<C: Write>(
    mut out: Box<dyn Read + Send>,
    stream: Stream,
    writer: &Mutex<C>,
    killer: &Killer,
) {
    let mut buf = vec![0u8; MAX_CHUNK];
    loop {
        let n = match out.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        let mut w = writer.lock().unwrap_or_else(PoisonError::into_inner);
        if write_frame(&mut *w, &Frame::Data(stream, buf[..n].to_vec())).is_err() {
            // The host is gone: no orphans.
            drop(w);
            killer.kill();
            return;
        }
    }
}

/// Reads the host's side of an exec: stdin data, or the connection going
/// away (which kills the command).
fn pump_input<C: Connection>(
    mut reader: C,
    mut stdin: Option<std::process::ChildStdin>,
    writer: &Mutex<C>,
    killer: &Killer,
) {
    loop {
        match read_frame(&mut reader) {
            Ok(Frame::Data(Stream::Stdin, bytes)) => {
                if let Some(s) = &mut stdin {
                    if s.write_all(&bytes).is_err() {
                        // The command closed its stdin; drop the rest.
                        stdin = None;
                    }
                }
            }
            Ok(Frame::Message(Message::Eof {
                stream: Stream::Stdin,
            })) => stdin = None,
            Err(ProtocolError::Io(_) | ProtocolError::Closed) => {
                killer.kill();
                return;
            }
            Ok(f) => {
                let mut w = writer.lock().unwrap_or_else(PoisonError::into_inner);
                let msg = format!("unexpected {} during exec", describe(&f));
                let _ = reply_error(&mut *w, ErrorKind::BadRequest, msg);
                let _ = w.shutdown(Shutdown::Both);
                drop(w);
                killer.kill();
                return;
            }
            Err(e) => {
                let mut w = writer.lock().unwrap_or_else(PoisonError::into_inner);
                let _ = bad_frame(&mut *w, e);
                let _ = w.shutdown(Shutdown::Both);
                drop(w);
                killer.kill();
                return;
            }
        }
    }
}

fn read_file<C: Write>(conn: &mut C, path: &Path) -> Result<(), ProtocolError> {
    let opened = File::open(path).and_then(|f| {
        let meta = f.metadata()?;
        if meta.is_dir() {
            return Err(io::Error::other("is a directory"));
        }
        Ok((f, meta))
    });
    let (mut f, meta) = match opened {
        Ok(v) => v,
        Err(e) => {
            return reply_error(
                conn,
                io_kind(&e),
                format!("cannot read {}: {e}", path.display()),
            )
        }
    };
    send(
        conn,
        Message::FileInfo {
            size: meta.len(),
            mode: meta.permissions().mode() & 0o7777,
        },
    )?;
    let mut buf = vec![0u8; MAX_CHUNK];
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return reply_error(
                    conn,
                    io_kind(&e),
                    format!("reading {}: {e}", path.display()),
                )
            }
        };
        write_frame(conn, &Frame::Data(Stream::File, buf[..n].to_vec()))?;
    }
    send(
        conn,
        Message::Eof {
            stream: Stream::File,
        },
    )
}

/// A temporary file next to the target; removed unless renamed into place.
struct TempFile {
    path: PathBuf,
    file: Option<File>,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if self.file.is_some() {
            let _ = fs::remove_file(&self.path);
        }
    }
}

fn create_temp(target: &Path) -> io::Result<TempFile> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let name = target
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "not a file name"))?;
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let path = dir.join(format!(
        ".{}.tine-{}-{}",
        name.to_string_lossy(),
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    Ok(TempFile {
        path,
        file: Some(file),
    })
}

fn write_file<C: Read + Write>(conn: &mut C, path: &Path, mode: u32) -> Result<(), ProtocolError> {
    let mut tmp = create_temp(path);
    let mut failure: Option<io::Error> = None;
    let mut bytes = 0u64;
    // Take the whole upload even after a failure, so the host reads the
    // error instead of a reset connection.
    loop {
        match read_frame(conn) {
            Ok(Frame::Data(Stream::File, data)) => {
                if let (Ok(t), None) = (&mut tmp, &failure) {
                    if let Some(f) = &mut t.file {
                        match f.write_all(&data) {
                            Ok(()) => bytes += data.len() as u64,
                            Err(e) => failure = Some(e),
                        }
                    }
                }
            }
            Ok(Frame::Message(Message::Eof {
                stream: Stream::File,
            })) => break,
            Ok(f) => {
                let msg = format!("unexpected {} during write_file", describe(&f));
                return reply_error(conn, ErrorKind::BadRequest, msg);
            }
            Err(e) => return bad_frame(conn, e),
        }
    }
    let mut tmp = match tmp {
        Ok(t) => t,
        Err(e) => {
            return reply_error(
                conn,
                io_kind(&e),
                format!("cannot write {}: {e}", path.display()),
            )
        }
    };
    let done = match failure {
        Some(e) => Err(e),
        None => (|| {
            if let Some(f) = &tmp.file {
                f.set_permissions(fs::Permissions::from_mode(mode & 0o7777))?;
                f.sync_all()?;
            }
            fs::rename(&tmp.path, path)?;
            tmp.file = None;
            Ok(())
        })(),
    };
    match done {
        Ok(()) => send(conn, Message::Written { bytes }),
        Err(e) => reply_error(
            conn,
            io_kind(&e),
            format!("cannot write {}: {e}", path.display()),
        ),
    }
}
