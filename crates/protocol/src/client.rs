//! The host side of the protocol: synchronous, std only.
//!
//! One request per connection, as the protocol says. A typical exchange:
//!
//! ```no_run
//! # fn main() -> Result<(), protocol::ClientError> {
//! use std::path::Path;
//! use std::time::Duration;
//! let mut s = protocol::connect_vsock_uds(Path::new("vm/vsock.sock"), protocol::AGENT_PORT,
//!                                         Duration::from_secs(1))?;
//! protocol::hello(&mut s)?;
//! let req = protocol::ExecRequest::new(["uname", "-r"]);
//! let exit = protocol::exec(&mut s, req, None::<std::io::Empty>,
//!                           std::io::stdout(), std::io::stderr())?;
//! std::process::exit(exit.exit_code());
//! # }
//! ```

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{
    read_frame, send, write_frame, ErrorKind, Frame, Hello, Message, ProtocolError, Stream,
    MAX_CHUNK, PROTOCOL_VERSION,
};

/// Longest reply line accepted in the vsock `CONNECT` handshake.
const MAX_HANDSHAKE_LINE: usize = 64;

/// A connected byte stream that can be split between two threads (exec
/// pumps stdin from a second thread) and shut down.
pub trait Connection: Read + Write + Send + Sized + 'static {
    /// A second handle on the same connection.
    fn try_clone(&self) -> io::Result<Self>;
    /// Shuts down one or both directions of the connection.
    fn shutdown(&self, how: std::net::Shutdown) -> io::Result<()>;
}

impl Connection for UnixStream {
    fn try_clone(&self) -> io::Result<Self> {
        UnixStream::try_clone(self)
    }
    fn shutdown(&self, how: std::net::Shutdown) -> io::Result<()> {
        UnixStream::shutdown(self, how)
    }
}

impl Connection for TcpStream {
    fn try_clone(&self) -> io::Result<Self> {
        TcpStream::try_clone(self)
    }
    fn shutdown(&self, how: std::net::Shutdown) -> io::Result<()> {
        TcpStream::shutdown(self, how)
    }
}

/// Errors of the host-side client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The vsock socket of the VMM could not be reached.
    #[error("Cannot connect to {}", path.display())]
    Connect {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Firecracker-style `CONNECT <port>` handshake failed.
    #[error("vsock handshake for port {port} failed: {reason}")]
    Handshake { port: u32, reason: String },
    /// The VMM took the `CONNECT` but no `OK` came back in time: the
    /// guest did not answer (busy, or its vsock is stuck).
    #[error("vsock handshake for port {port} failed: no answer before the timeout")]
    HandshakeTimeout { port: u32 },
    /// The connection or framing failed.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The agent answered with an error.
    #[error("Agent error ({kind:?}): {message}")]
    Agent { kind: ErrorKind, message: String },
    /// The agent answered Hello with a protocol version we do not speak.
    #[error("The agent speaks protocol version {agent}, this tine speaks {ours}")]
    Version { ours: u32, agent: u32 },
    /// The agent sent something the exchange does not allow.
    #[error("Unexpected reply from the agent: {0}")]
    Unexpected(String),
    /// The connection ended after an exec request was sent, before the
    /// agent said the command started: it may or may not have run.
    #[error(
        "the connection to the agent closed after the command was sent and before it started \
         (it may not have run; the guest's vsock may have reset the connection)"
    )]
    ClosedBeforeStart,
    /// The connection ended while the command ran: its exit is unknown.
    #[error("the connection to the agent closed while the command ran (pid {pid} in the guest); its exit is unknown")]
    ClosedWhileRunning { pid: u32 },
    /// Reading local input or writing local output failed.
    #[error("Local I/O failed")]
    Local(#[source] io::Error),
}

/// The agent's answer to `ping`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pong {
    pub agent_version: String,
    pub boot_id: String,
    pub uptime_ms: u64,
}

/// A command to run in the guest.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExecRequest {
    pub argv: Vec<String>,
    /// Added to (or overriding) the agent's environment.
    pub env: Vec<(String, String)>,
    pub cwd: Option<String>,
    /// SIGKILL the command (its whole process group) after this long.
    pub timeout: Option<Duration>,
    /// The command outlives this connection (`Message::Exec`'s `keep`).
    pub keep: bool,
    /// A name to find it by later.
    pub tag: Option<String>,
    /// The guest user it runs as (default: the agent's, root).
    pub user: Option<String>,
    /// Give the command a stdin pipe even when `exec` is given no input:
    /// it stays open for [`input`] requests (a kept command's).
    pub open_stdin: bool,
}

impl ExecRequest {
    /// A request for `argv` with no extra env, cwd or timeout.
    pub fn new<I, A>(argv: I) -> Self
    where
        I: IntoIterator<Item = A>,
        A: Into<String>,
    {
        Self {
            argv: argv.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }
}

/// How a command ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExitInfo {
    /// Its pid in the guest.
    pub pid: u32,
    /// Exit code, when it exited.
    pub code: Option<i32>,
    /// Signal number, when a signal killed it.
    pub signal: Option<i32>,
    /// It outlived its timeout and was killed.
    pub timed_out: bool,
}

impl ExitInfo {
    /// The shell convention: the exit code, or 128 + the signal number.
    pub fn exit_code(&self) -> i32 {
        match (self.code, self.signal) {
            (Some(c), _) => c,
            (None, Some(s)) => 128 + s,
            (None, None) => 255,
        }
    }
}

/// A file's size and permission bits, as read from the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileInfo {
    /// Bytes actually transferred.
    pub size: u64,
    /// Permission bits (`st_mode & 0o7777`).
    pub mode: u32,
}

/// Connects to a guest vsock port through the VMM's Unix socket, with the
/// Firecracker hybrid-vsock handshake (`CONNECT <port>\n` → `OK <n>\n`).
/// `timeout` bounds the handshake; the returned stream has no timeouts.
pub fn connect_vsock_uds(
    uds_path: &Path,
    port: u32,
    timeout: Duration,
) -> Result<UnixStream, ClientError> {
    let mut s = UnixStream::connect(uds_path).map_err(|source| ClientError::Connect {
        path: uds_path.to_owned(),
        source,
    })?;
    let set = |s: &UnixStream, t: Option<Duration>| -> io::Result<()> {
        s.set_read_timeout(t)?;
        s.set_write_timeout(t)
    };
    let local = |e: io::Error| ClientError::Connect {
        path: uds_path.to_owned(),
        source: e,
    };
    // A zero timeout is an error for set_read_timeout; treat it as 1 ms.
    set(&s, Some(timeout.max(Duration::from_millis(1)))).map_err(local)?;
    vsock_handshake(&mut s, port)?;
    set(&s, None).map_err(local)?;
    Ok(s)
}

/// The client half of the hybrid-vsock handshake on an already connected
/// stream: writes `CONNECT <port>\n` and reads the reply one byte at a
/// time, so no payload after it is consumed. Returns the host-side port
/// number from `OK <n>`.
pub fn vsock_handshake<S: Read + Write>(s: &mut S, port: u32) -> Result<u32, ClientError> {
    let fail = |reason: String| ClientError::Handshake { port, reason };
    let io_fail = |e: io::Error| match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            ClientError::HandshakeTimeout { port }
        }
        _ => fail(e.to_string()),
    };
    s.write_all(format!("CONNECT {port}\n").as_bytes())
        .and_then(|()| s.flush())
        .map_err(io_fail)?;
    let mut line = Vec::with_capacity(16);
    loop {
        let mut b = [0u8; 1];
        match s.read(&mut b) {
            Ok(0) => {
                return Err(fail(
                    "connection closed (is anything listening on that port in the guest?)".into(),
                ))
            }
            Ok(_) if b[0] == b'\n' => break,
            Ok(_) => {
                line.push(b[0]);
                if line.len() > MAX_HANDSHAKE_LINE {
                    return Err(fail("reply line too long".into()));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_fail(e)),
        }
    }
    let line = String::from_utf8_lossy(&line);
    line.strip_prefix("OK ")
        .and_then(|n| n.trim().parse::<u32>().ok())
        .ok_or_else(|| fail(format!("unexpected reply {line:?}")))
}

/// Sends our Hello and reads the agent's. Every connection starts with it.
pub fn hello<S: Read + Write>(s: &mut S) -> Result<Hello, ClientError> {
    hello_as(
        s,
        PROTOCOL_VERSION,
        concat!("tine ", env!("CARGO_PKG_VERSION")),
    )
}

/// `hello` claiming another protocol version (for tests of version checks).
pub fn hello_as<S: Read + Write>(
    s: &mut S,
    protocol: u32,
    software: &str,
) -> Result<Hello, ClientError> {
    send(
        s,
        Message::Hello(Hello {
            protocol,
            software: software.to_owned(),
        }),
    )?;
    match read_message(s)? {
        Message::Hello(h) if h.protocol == protocol => Ok(h),
        Message::Hello(h) => Err(ClientError::Version {
            ours: protocol,
            agent: h.protocol,
        }),
        m => Err(unexpected(m)),
    }
}

/// `Ping` → agent version, boot id and uptime.
pub fn ping<S: Read + Write>(s: &mut S) -> Result<Pong, ClientError> {
    send(s, Message::Ping)?;
    match read_message(s)? {
        Message::Pong {
            agent_version,
            boot_id,
            uptime_ms,
        } => Ok(Pong {
            agent_version,
            boot_id,
            uptime_ms,
        }),
        m => Err(unexpected(m)),
    }
}

/// Runs a command in the guest. Its stdout and stderr are written to
/// `stdout` and `stderr` as they arrive (each chunk flushed). When `stdin`
/// is given it is pumped to the command from a second thread until EOF;
/// pass `None::<std::io::Empty>` for none (the command's stdin is then
/// /dev/null). That thread is not joined: if the command exits before
/// `stdin` ends, it stops at its next write (the agent closes the
/// connection) or when the process exits.
pub fn exec<S, R>(
    s: &mut S,
    req: ExecRequest,
    stdin: Option<R>,
    stdout: impl Write,
    stderr: impl Write,
) -> Result<ExitInfo, ClientError>
where
    S: Connection,
    R: Read + Send + 'static,
{
    exec_with(s, req, stdin, |_| {}, stdout, stderr)
}

/// [`exec`], telling `on_start` the command's pid in the guest once it
/// started (before any output).
pub fn exec_with<S, R>(
    s: &mut S,
    req: ExecRequest,
    stdin: Option<R>,
    on_start: impl FnOnce(u32),
    stdout: impl Write,
    stderr: impl Write,
) -> Result<ExitInfo, ClientError>
where
    S: Connection,
    R: Read + Send + 'static,
{
    let timeout_ms = req
        .timeout
        .map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
    send(
        s,
        Message::Exec {
            argv: req.argv,
            env: req.env,
            cwd: req.cwd,
            stdin: stdin.is_some() || req.open_stdin,
            timeout_ms,
            keep: req.keep,
            tag: req.tag,
            user: req.user,
        },
    )?;
    let pid = started(s)?;
    on_start(pid);
    if let Some(input) = stdin {
        let tx = Connection::try_clone(s).map_err(ProtocolError::Io)?;
        std::thread::Builder::new()
            .name("tine-exec-stdin".into())
            .spawn(move || pump_stdin(input, tx))
            .map_err(ClientError::Local)?;
    }
    follow(s, pid, stdout, stderr)
}

/// Follows a running command (one started with `keep`, or any other while
/// its own connection lasts): its output from now on goes to `stdout` and
/// `stderr` until it ends. `on_start` gets its pid first. Closing the
/// connection stops following and leaves the command running.
pub fn attach<S: Read + Write>(
    s: &mut S,
    process: crate::ProcessRef,
    on_start: impl FnOnce(u32),
    stdout: impl Write,
    stderr: impl Write,
) -> Result<ExitInfo, ClientError> {
    send(s, Message::Attach { process })?;
    let pid = started(s)?;
    on_start(pid);
    follow(s, pid, stdout, stderr)
}

/// Reads the `Started` that opens a command's stream.
fn started<S: Read>(s: &mut S) -> Result<u32, ClientError> {
    match read_message(s) {
        Ok(Message::Started { pid }) => Ok(pid),
        Ok(m) => Err(unexpected(m)),
        Err(ClientError::Protocol(ProtocolError::Closed)) => Err(ClientError::ClosedBeforeStart),
        Err(e) => Err(e),
    }
}

/// A command's output frames up to its `Exited`.
fn follow<S: Read>(
    s: &mut S,
    pid: u32,
    mut stdout: impl Write,
    mut stderr: impl Write,
) -> Result<ExitInfo, ClientError> {
    loop {
        let frame = match read_frame(s) {
            Ok(f) => f,
            Err(ProtocolError::Closed) => return Err(ClientError::ClosedWhileRunning { pid }),
            Err(e) => return Err(e.into()),
        };
        match frame {
            Frame::Data(Stream::Stdout, b) => {
                stdout
                    .write_all(&b)
                    .and_then(|()| stdout.flush())
                    .map_err(ClientError::Local)?;
            }
            Frame::Data(Stream::Stderr, b) => {
                stderr
                    .write_all(&b)
                    .and_then(|()| stderr.flush())
                    .map_err(ClientError::Local)?;
            }
            Frame::Message(Message::Exited {
                code,
                signal,
                timed_out,
            }) => {
                return Ok(ExitInfo {
                    pid,
                    code,
                    signal,
                    timed_out,
                })
            }
            Frame::Message(m) => return Err(unexpected(m)),
            Frame::Data(stream, _) => {
                return Err(ClientError::Unexpected(format!(
                    "data on stream {stream:?}"
                )))
            }
        }
    }
}

/// Sends `signal` to a running command's process group; false when it had
/// ended already.
pub fn signal<S: Read + Write>(
    s: &mut S,
    process: crate::ProcessRef,
    signal: i32,
) -> Result<bool, ClientError> {
    done(s, Message::Signal { process, signal })
}

/// Writes `data` to a running command's stdin (it must have been started
/// with stdin); `close` then closes its stdin (EOF for the command).
pub fn input<S: Read + Write>(
    s: &mut S,
    process: crate::ProcessRef,
    data: &[u8],
    close: bool,
) -> Result<(), ClientError> {
    let sent = (|| -> Result<(), ProtocolError> {
        send(s, Message::Input { process, close })?;
        for chunk in data.chunks(MAX_CHUNK) {
            write_frame(s, &Frame::Data(Stream::Stdin, chunk.to_vec()))?;
        }
        send(
            s,
            Message::Eof {
                stream: Stream::Stdin,
            },
        )
    })();
    if let Err(e) = sent {
        // The agent may have refused at once (no such command) and closed.
        return match read_message(s) {
            Err(agent @ ClientError::Agent { .. }) => Err(agent),
            _ => Err(e.into()),
        };
    }
    match read_message(s)? {
        Message::Done { .. } => Ok(()),
        m => Err(unexpected(m)),
    }
}

/// The commands the agent runs.
pub fn list_processes<S: Read + Write>(s: &mut S) -> Result<Vec<crate::ProcessInfo>, ClientError> {
    send(s, Message::ListProcesses)?;
    match read_message(s)? {
        Message::Processes { processes } => Ok(processes),
        m => Err(unexpected(m)),
    }
}

fn pump_stdin<R: Read, S: Write>(mut input: R, mut tx: S) {
    let mut buf = vec![0u8; MAX_CHUNK];
    loop {
        match input.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if write_frame(&mut tx, &Frame::Data(Stream::Stdin, buf[..n].to_vec())).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            // The command sees EOF; the error is local and has no channel.
            Err(_) => break,
        }
    }
    let _ = send(
        &mut tx,
        Message::Eof {
            stream: Stream::Stdin,
        },
    );
}

/// Copies a guest file into `out`. Returns the bytes copied and the
/// file's permission bits.
pub fn read_file<S: Read + Write>(
    s: &mut S,
    path: &str,
    mut out: impl Write,
) -> Result<FileInfo, ClientError> {
    send(
        s,
        Message::ReadFile {
            path: path.to_owned(),
        },
    )?;
    let mode = match read_message(s)? {
        Message::FileInfo { mode, .. } => mode,
        m => return Err(unexpected(m)),
    };
    let mut size = 0u64;
    loop {
        match read_frame(s)? {
            Frame::Data(Stream::File, b) => {
                out.write_all(&b).map_err(ClientError::Local)?;
                size += b.len() as u64;
            }
            Frame::Message(Message::Eof {
                stream: Stream::File,
            }) => break,
            Frame::Message(m) => return Err(unexpected(m)),
            Frame::Data(stream, _) => {
                return Err(ClientError::Unexpected(format!(
                    "data on stream {stream:?}"
                )))
            }
        }
    }
    out.flush().map_err(ClientError::Local)?;
    Ok(FileInfo { size, mode })
}

/// Writes `input` to a guest file with permission bits `mode`. The agent
/// writes a temporary file next to it and renames it into place, so the
/// file appears whole or not at all. Returns the bytes written.
pub fn write_file<S: Read + Write>(
    s: &mut S,
    path: &str,
    mode: u32,
    mut input: impl Read,
) -> Result<u64, ClientError> {
    let sent = (|| -> Result<(), ClientError> {
        send(
            s,
            Message::WriteFile {
                path: path.to_owned(),
                mode,
            },
        )?;
        let mut buf = vec![0u8; MAX_CHUNK];
        loop {
            let n = match input.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(ClientError::Local(e)),
            };
            write_frame(s, &Frame::Data(Stream::File, buf[..n].to_vec()))?;
        }
        send(
            s,
            Message::Eof {
                stream: Stream::File,
            },
        )?;
        Ok(())
    })();
    match sent {
        Ok(()) => {}
        // The agent may have answered (and closed) early; prefer its error.
        Err(ClientError::Protocol(e)) => {
            return match read_message(s) {
                Err(agent @ ClientError::Agent { .. }) => Err(agent),
                _ => Err(e.into()),
            }
        }
        Err(e) => return Err(e),
    }
    match read_message(s)? {
        Message::Written { bytes } => Ok(bytes),
        m => Err(unexpected(m)),
    }
}

/// Asks the guest to power off. Returns once the agent confirms; the VMM
/// exits shortly after. Pass the stream by value: closing it tells the
/// agent its reply arrived, so the guest powers off at once (otherwise
/// after a 1 s grace period).
pub fn shutdown<S: Read + Write>(mut s: S) -> Result<(), ClientError> {
    send(&mut s, Message::Shutdown)?;
    match read_message(&mut s)? {
        Message::ShuttingDown => Ok(()),
        m => Err(unexpected(m)),
    }
}

/// Freezes every guest process but the agent until a [`wake`] (or
/// `timeout_ms`), so nothing uses the state a fork is about to copy.
pub fn quiesce<S: Read + Write>(
    s: &mut S,
    timeout_ms: u64,
) -> Result<crate::wake::QuiesceReport, ClientError> {
    send(s, Message::Quiesce { timeout_ms })?;
    match read_message(s)? {
        Message::Quiesced(r) => Ok(r),
        m => Err(unexpected(m)),
    }
}

/// The wake-up step: the agent applies `w` and reports each step.
pub fn wake<S: Read + Write>(
    s: &mut S,
    w: crate::wake::Wake,
) -> Result<crate::wake::WakeReport, ClientError> {
    send(s, Message::Wake(Box::new(w)))?;
    match read_message(s)? {
        Message::Woke(r) => Ok(*r),
        m => Err(unexpected(m)),
    }
}

/// Reads one message frame; an `Error` reply becomes `ClientError::Agent`.
/// Stat: one path, not followed.
pub fn stat<S: Read + Write>(s: &mut S, path: &str) -> Result<crate::Entry, ClientError> {
    let path = path.to_owned();
    match entries(s, Message::Stat { path })?.pop() {
        Some(e) => Ok(e),
        None => Err(ClientError::Unexpected("Stat answered no entry".into())),
    }
}

/// ListDir: the entries under `path`, `depth` levels down.
pub fn list_dir<S: Read + Write>(
    s: &mut S,
    path: &str,
    depth: u32,
) -> Result<Vec<crate::Entry>, ClientError> {
    let path = path.to_owned();
    entries(s, Message::ListDir { path, depth })
}

fn entries<S: Read + Write>(s: &mut S, ask: Message) -> Result<Vec<crate::Entry>, ClientError> {
    send(s, ask)?;
    match read_message(s)? {
        Message::Entries { entries } => Ok(entries),
        m => Err(unexpected(m)),
    }
}

/// Remove a path (a directory with everything under it); false when it
/// did not exist.
pub fn remove<S: Read + Write>(s: &mut S, path: &str) -> Result<bool, ClientError> {
    done(
        s,
        Message::Remove {
            path: path.to_owned(),
        },
    )
}

/// Create a directory and its parents; false when it already existed.
pub fn make_dir<S: Read + Write>(s: &mut S, path: &str) -> Result<bool, ClientError> {
    done(
        s,
        Message::MakeDir {
            path: path.to_owned(),
        },
    )
}

/// Move a path (its new parents are made).
pub fn rename<S: Read + Write>(s: &mut S, from: &str, to: &str) -> Result<bool, ClientError> {
    done(
        s,
        Message::Rename {
            from: from.to_owned(),
            to: to.to_owned(),
        },
    )
}

fn done<S: Read + Write>(s: &mut S, ask: Message) -> Result<bool, ClientError> {
    send(s, ask)?;
    match read_message(s)? {
        Message::Done { changed } => Ok(changed),
        m => Err(unexpected(m)),
    }
}

fn read_message<S: Read>(s: &mut S) -> Result<Message, ClientError> {
    match read_frame(s)? {
        Frame::Message(Message::Error { kind, message }) => {
            Err(ClientError::Agent { kind, message })
        }
        Frame::Message(m) => Ok(m),
        Frame::Data(stream, _) => Err(ClientError::Unexpected(format!(
            "data on stream {stream:?}"
        ))),
    }
}

fn unexpected(m: Message) -> ClientError {
    match m {
        Message::Error { kind, message } => ClientError::Agent { kind, message },
        m => ClientError::Unexpected(format!("{m:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufRead;
    use std::os::unix::net::UnixListener;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Instant;

    fn sock_path() -> PathBuf {
        static N: AtomicU32 = AtomicU32::new(0);
        std::env::temp_dir().join(format!(
            "tine-proto-{}-{}.sock",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ))
    }

    /// A fake VMM socket: accepts one connection, checks the CONNECT line,
    /// then writes `reply` verbatim.
    fn fake_vmm(reply: &'static [u8]) -> (PathBuf, std::thread::JoinHandle<String>) {
        let path = sock_path();
        let l = UnixListener::bind(&path).expect("bind");
        let h = std::thread::spawn(move || {
            let (s, _) = l.accept().expect("accept");
            let mut r = io::BufReader::new(s.try_clone().expect("clone"));
            let mut line = String::new();
            r.read_line(&mut line).expect("read line");
            (&s).write_all(reply).expect("reply");
            // Keep the connection open until the client is done.
            let mut rest = Vec::new();
            let _ = r.read_to_end(&mut rest);
            line
        });
        (path, h)
    }

    #[test]
    fn test_handshake_ok_keeps_payload() {
        let (path, h) = fake_vmm(b"OK 1073741824\nPAYLOAD");
        let mut s = connect_vsock_uds(&path, 10_000, Duration::from_secs(5)).expect("connect");
        let mut buf = [0u8; 7];
        s.read_exact(&mut buf).expect("payload");
        assert_eq!(&buf, b"PAYLOAD");
        assert_eq!(s.read_timeout().expect("timeout"), None);
        drop(s);
        assert_eq!(h.join().expect("peer"), "CONNECT 10000\n");
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn test_handshake_pair() {
        let (mut a, b) = UnixStream::pair().expect("pair");
        let peer = std::thread::spawn(move || {
            let mut b = b;
            let mut got = [0u8; 11];
            b.read_exact(&mut got).expect("read");
            b.write_all(b"OK 52\n").expect("write");
            got
        });
        assert_eq!(vsock_handshake(&mut a, 52).expect("handshake"), 52);
        assert_eq!(&peer.join().expect("peer"), b"CONNECT 52\n");
    }

    #[test]
    fn test_handshake_refused_and_garbage() {
        // Firecracker closes the connection when nothing listens.
        let path = sock_path();
        let l = UnixListener::bind(&path).expect("bind");
        let peer = std::thread::spawn(move || {
            let (s, _) = l.accept().expect("accept");
            let mut line = String::new();
            io::BufReader::new(s)
                .read_line(&mut line)
                .expect("read line");
        });
        let e = connect_vsock_uds(&path, 7, Duration::from_secs(5));
        assert!(
            matches!(e, Err(ClientError::Handshake { port: 7, .. })),
            "{e:?}"
        );
        peer.join().expect("peer");
        let _ = std::fs::remove_file(path);

        for reply in [&b"NO\n"[..], b"OK x\n", &[b'A'; 100]] {
            let (mut a, mut b) = UnixStream::pair().expect("pair");
            b.write_all(reply).expect("write");
            let e = vsock_handshake(&mut a, 9);
            assert!(
                matches!(e, Err(ClientError::Handshake { port: 9, .. })),
                "{e:?}"
            );
        }
        let (mut a, b) = UnixStream::pair().expect("pair");
        drop(b);
        let e = vsock_handshake(&mut a, 9);
        assert!(matches!(e, Err(ClientError::Handshake { .. })), "{e:?}");
    }

    #[test]
    fn test_handshake_timeout() {
        let path = sock_path();
        let l = UnixListener::bind(&path).expect("bind");
        let t = Instant::now();
        let e = connect_vsock_uds(&path, 3, Duration::from_millis(200));
        assert!(
            matches!(e, Err(ClientError::HandshakeTimeout { port: 3 })),
            "{e:?}"
        );
        assert!(t.elapsed() < Duration::from_secs(3));
        drop(l);
        let _ = std::fs::remove_file(&path);
        let e = connect_vsock_uds(&path, 3, Duration::from_millis(200));
        assert!(matches!(e, Err(ClientError::Connect { .. })), "{e:?}");
    }

    #[test]
    fn test_agent_error_reply_is_typed() {
        let (mut a, mut b) = UnixStream::pair().expect("pair");
        send(
            &mut b,
            Message::Error {
                kind: ErrorKind::Version,
                message: "no".into(),
            },
        )
        .expect("send");
        let e = hello(&mut a);
        assert!(
            matches!(
                e,
                Err(ClientError::Agent {
                    kind: ErrorKind::Version,
                    ..
                })
            ),
            "{e:?}"
        );
    }
}
