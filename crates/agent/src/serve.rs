//! The agent's request server: one thread per connection, one request per
//! connection, after a Hello exchange (see the protocol crate).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, PoisonError};
use std::time::Duration;

use crate::{jobs, quiesce, wake};
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

pub(crate) fn reply_error<C: Write>(
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
            keep,
            tag,
            user,
        } => jobs::exec(
            conn,
            jobs::Spec {
                argv,
                env,
                cwd,
                stdin,
                timeout_ms,
                keep,
                tag,
                user,
            },
        ),
        Message::Attach { process } => jobs::attach(conn, &process),
        Message::Signal { process, signal } => jobs::signal(conn, &process, signal),
        Message::Input { process, close } => jobs::input(conn, &process, close),
        Message::ListProcesses => jobs::list(conn),
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
        Message::Rename { from, to } => fs_answer(
            conn,
            &from,
            crate::fs::rename(Path::new(&from), Path::new(&to)),
            done,
        ),
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

pub(crate) fn describe(f: &Frame) -> String {
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
