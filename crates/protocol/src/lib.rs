//! The protocol between tine on the host and tine-agent in the guest.
//!
//! One request per connection (the host opens as many connections as it
//! has requests in flight). Every connection starts with a [`Hello`]
//! exchange that fixes the protocol version; a peer that speaks a version we
//! do not gets an [`ErrorKind::Version`] error, never a hang.
//!
//! Wire format: frames of `len: u32 LE` (of what follows, at most
//! [`MAX_FRAME`]) | `type: u8` | body. Type [`FRAME_MESSAGE`] carries one
//! [`Message`] as JSON (typed, readable, easy to extend); type
//! [`FRAME_DATA`] carries raw bytes of one stream (`stream: u8` | bytes), so
//! file contents and process output are not inflated by JSON.
//!
//! Exchanges after Hello:
//! - `Ping` → `Pong`.
//! - `Exec` → `Started`, then `Data(stdout|stderr)` frames, and finally
//!   `Exited`. When `Exec.stdin` is true the host sends `Data(stdin)` frames
//!   and then `Eof(stdin)`. A command ends with its connection unless
//!   `Exec.keep`: then it is the agent's (it outlives a client that left, a
//!   sleep, a fork) and later connections follow and drive it:
//! - `Attach` → `Started`, the command's output from now on, `Exited`.
//! - `Signal` → `Done` (a signal to the command's process group).
//! - `Input` → the host sends `Data(stdin)` frames and `Eof(stdin)` → `Done`.
//! - `ListProcesses` → `Processes`: every command the agent runs.
//! - `Stat`, `ListDir` → `Entries`; `Remove`, `MakeDir`, `Rename` → `Done`.
//! - `ReadFile` → `FileInfo`, `Data(file)` frames, `Eof(file)`.
//! - `WriteFile` → host sends `Data(file)` frames and `Eof(file)` → `Written`.
//! - `Shutdown` → `ShuttingDown`, then the guest powers off.
//! - `Quiesce` → `Quiesced`: every guest process but the agent is frozen
//!   until a `Wake` (or the timeout); see [`wake`].
//! - `Wake` → `Woke`: the wake-up step after a fork, restore or rollback.
//!
//! Any request may instead be answered by `Error`.
//!
//! The host side (connect through the VMM's vsock socket, then one call per
//! request) is in [`client`]'s functions, re-exported here.

use std::io::{self, Read, Write};

pub mod client;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzz;
pub mod wake;
pub use client::{
    attach, connect_vsock_uds, exec, exec_with, hello, hello_as, input, list_processes, ping,
    quiesce, read_file, shutdown, signal, vsock_handshake, wake, write_file, ClientError,
    Connection, ExecRequest, ExitInfo, FileInfo, Pong,
};
pub use wake::{QuiesceReport, Wake, WakeReport};

use serde::{Deserialize, Serialize};

/// Protocol version spoken by this build.
pub const PROTOCOL_VERSION: u32 = 1;
/// vsock port the agent listens on in the guest.
pub const AGENT_PORT: u32 = 10_000;
/// Largest frame accepted (type byte and body).
pub const MAX_FRAME: u32 = 1 << 20;
/// Largest data chunk a sender puts in one frame.
pub const MAX_CHUNK: usize = 256 * 1024;
/// Frame type: a JSON [`Message`].
pub const FRAME_MESSAGE: u8 = 0;
/// Frame type: raw bytes of one [`Stream`].
pub const FRAME_DATA: u8 = 1;

/// Byte streams multiplexed on a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum Stream {
    Stdin = 0,
    Stdout = 1,
    Stderr = 2,
    File = 3,
}

impl Stream {
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Stream::Stdin),
            1 => Some(Stream::Stdout),
            2 => Some(Stream::Stderr),
            3 => Some(Stream::File),
            _ => None,
        }
    }
}

/// First message each way.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    pub protocol: u32,
    /// Version of the program (tine or tine-agent) that sends it.
    pub software: String,
}

/// What went wrong, for programs; the message is for people.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The peer speaks another protocol version.
    Version,
    /// A message this side does not know or did not expect.
    BadRequest,
    /// A file or directory does not exist.
    NotFound,
    /// Permission denied.
    Permission,
    /// The command could not be started.
    Spawn,
    /// Any other I/O failure.
    Io,
}

/// Every typed message. Unknown `type` tags decode as an error, which the
/// receiver answers with `Error { kind: BadRequest }`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Message {
    Hello(Hello),
    Ping,
    Pong {
        agent_version: String,
        /// The guest kernel's boot id (/proc/sys/kernel/random/boot_id).
        boot_id: String,
        uptime_ms: u64,
    },
    Exec {
        argv: Vec<String>,
        #[serde(default)]
        env: Vec<(String, String)>,
        #[serde(default)]
        cwd: Option<String>,
        /// The host will send stdin as Data(stdin) frames and Eof(stdin).
        #[serde(default)]
        stdin: bool,
        /// Kill the command (SIGKILL) after this long.
        #[serde(default)]
        timeout_ms: Option<u64>,
        /// The command is the agent's, not this connection's: it goes on
        /// when the connection ends, and `Attach` follows it again.
        #[serde(default)]
        keep: bool,
        /// A name to find the command by (unique among running ones).
        #[serde(default)]
        tag: Option<String>,
        /// Run as this guest user (from /etc/passwd; its home is the
        /// default working directory), not as the agent's (root).
        #[serde(default)]
        user: Option<String>,
    },
    /// Follow a running command: `Started`, its output from now on, and
    /// `Exited` (at once if it has just ended).
    Attach {
        process: ProcessRef,
    },
    /// Send a signal to a running command's process group → `Done`
    /// (`changed`: it was still running).
    Signal {
        process: ProcessRef,
        signal: i32,
    },
    /// Input for a running command started with `stdin`: `Data(stdin)`
    /// frames follow, then `Eof(stdin)`; with `close` its stdin is closed
    /// after them → `Done`.
    Input {
        process: ProcessRef,
        #[serde(default)]
        close: bool,
    },
    /// The commands the agent runs → `Processes`.
    ListProcesses,
    Processes {
        processes: Vec<ProcessInfo>,
    },
    Started {
        pid: u32,
    },
    Exited {
        /// Exit code, when the command exited.
        code: Option<i32>,
        /// Signal number, when a signal killed it.
        signal: Option<i32>,
        /// The command outlived its timeout and was killed.
        timed_out: bool,
    },
    Eof {
        stream: Stream,
    },
    ReadFile {
        path: String,
    },
    FileInfo {
        size: u64,
        mode: u32,
    },
    WriteFile {
        path: String,
        mode: u32,
    },
    Written {
        bytes: u64,
    },
    /// Describe one path (not followed if it is a symlink).
    Stat {
        path: String,
    },
    /// The entries under a directory, `depth` levels down (1: its children).
    ListDir {
        path: String,
        depth: u32,
    },
    /// Remove a file, a symlink or a directory with everything under it.
    Remove {
        path: String,
    },
    /// Create a directory and its missing parents.
    MakeDir {
        path: String,
    },
    /// Move a path (rename(2); `to`'s missing parents are made) → `Done`.
    Rename {
        from: String,
        to: String,
    },
    /// The answer to Stat (one entry) and ListDir.
    Entries {
        entries: Vec<Entry>,
    },
    /// The answer to Remove and MakeDir: `changed` is false when there was
    /// nothing to do (MakeDir of an existing directory).
    Done {
        changed: bool,
    },
    Shutdown,
    ShuttingDown,
    Quiesce {
        /// Thaw on its own after this long without a Wake.
        timeout_ms: u64,
    },
    Quiesced(wake::QuiesceReport),
    Wake(Box<wake::Wake>),
    Woke(Box<wake::WakeReport>),
    Error {
        kind: ErrorKind,
        message: String,
    },
}

/// Which running command a request is about.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProcessRef {
    Pid(u32),
    Tag(String),
}

impl std::fmt::Display for ProcessRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProcessRef::Pid(p) => write!(f, "pid {p}"),
            ProcessRef::Tag(t) => write!(f, "tag {t:?}"),
        }
    }
}

/// A command the agent runs, as `Exec` started it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ProcessInfo {
    pub pid: u32,
    #[serde(default)]
    pub tag: Option<String>,
    pub argv: Vec<String>,
    /// The environment `Exec` added.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    #[serde(default)]
    pub cwd: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    /// It outlives its connection (`Exec.keep`).
    pub keep: bool,
    /// It takes input (`Exec.stdin`).
    pub stdin: bool,
}

/// A path in the guest, as Stat and ListDir describe it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Entry {
    /// The last component of the path.
    pub name: String,
    /// The absolute path.
    pub path: String,
    pub kind: EntryKind,
    pub size: u64,
    /// Permission bits (`mode & 0o7777`).
    pub mode: u32,
    /// Last modification, milliseconds since the epoch.
    pub mtime_ms: u64,
    pub owner: String,
    pub group: String,
    /// Where a symlink points.
    #[serde(default)]
    pub target: Option<String>,
}

/// What kind of file an [`Entry`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// One frame.
#[derive(Clone, Debug, PartialEq)]
pub enum Frame {
    Message(Message),
    Data(Stream, Vec<u8>),
}

/// Errors reading or writing frames.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("Connection failed: {}", io_reason(.0))]
    Io(#[from] io::Error),
    #[error("Connection closed by the peer")]
    Closed,
    #[error("Frame of {0} bytes is larger than the {MAX_FRAME}-byte limit")]
    TooLarge(u32),
    #[error("Empty frame")]
    Empty,
    #[error("Unknown frame type {0}")]
    FrameType(u8),
    #[error("Unknown data stream {0}")]
    BadStream(u8),
    #[error("Malformed message: {0}")]
    Decode(String),
}

/// An I/O error as a reader should see it: a socket's read timeout
/// surfaces as EAGAIN ("Resource temporarily unavailable").
fn io_reason(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
            format!("no answer in time (the read timed out: {e})")
        }
        _ => e.to_string(),
    }
}

/// Writes one frame.
pub fn write_frame(w: &mut impl Write, frame: &Frame) -> Result<(), ProtocolError> {
    let mut buf = Vec::new();
    match frame {
        Frame::Message(m) => {
            buf.push(FRAME_MESSAGE);
            serde_json::to_writer(&mut buf, m).map_err(|e| ProtocolError::Decode(e.to_string()))?;
        }
        Frame::Data(stream, bytes) => {
            buf.reserve(2 + bytes.len());
            buf.push(FRAME_DATA);
            buf.push(*stream as u8);
            buf.extend_from_slice(bytes);
        }
    }
    let len = u32::try_from(buf.len()).map_err(|_| ProtocolError::TooLarge(u32::MAX))?;
    if len > MAX_FRAME {
        return Err(ProtocolError::TooLarge(len));
    }
    w.write_all(&len.to_le_bytes())?;
    w.write_all(&buf)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame. A message that does not decode (unknown type, newer
/// fields of the wrong shape) is `ProtocolError::Decode`; the connection
/// stays usable, so the caller can answer with an error.
pub fn read_frame(r: &mut impl Read) -> Result<Frame, ProtocolError> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Err(ProtocolError::Closed),
        Err(e) => return Err(e.into()),
    }
    let len = u32::from_le_bytes(len);
    if len > MAX_FRAME {
        return Err(ProtocolError::TooLarge(len));
    }
    if len == 0 {
        return Err(ProtocolError::Empty);
    }
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf)?;
    match buf[0] {
        FRAME_MESSAGE => serde_json::from_slice(&buf[1..])
            .map(Frame::Message)
            .map_err(|e| ProtocolError::Decode(e.to_string())),
        FRAME_DATA => {
            let stream = *buf.get(1).ok_or(ProtocolError::Empty)?;
            let stream = Stream::from_u8(stream).ok_or(ProtocolError::BadStream(stream))?;
            buf.drain(..2);
            Ok(Frame::Data(stream, buf))
        }
        t => Err(ProtocolError::FrameType(t)),
    }
}

/// Shorthand: writes a message frame.
pub fn send(w: &mut impl Write, m: Message) -> Result<(), ProtocolError> {
    write_frame(w, &Frame::Message(m))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_connection_errors_say_what_failed() {
        let reset = ProtocolError::from(io::Error::from(io::ErrorKind::ConnectionReset));
        assert!(reset.to_string().contains("reset"), "{reset}");
        let slow = ProtocolError::from(io::Error::from(io::ErrorKind::WouldBlock));
        assert!(slow.to_string().contains("timed out"), "{slow}");
    }

    #[test]
    fn test_frames_roundtrip() {
        let frames = vec![
            Frame::Message(Message::Hello(Hello {
                protocol: PROTOCOL_VERSION,
                software: "t".into(),
            })),
            Frame::Message(Message::Exec {
                argv: vec!["uname".into(), "-r".into()],
                env: vec![("A".into(), "b".into())],
                cwd: Some("/".into()),
                stdin: true,
                timeout_ms: Some(5),
                keep: true,
                tag: Some("t".into()),
                user: None,
            }),
            Frame::Message(Message::Attach {
                process: ProcessRef::Tag("t".into()),
            }),
            Frame::Message(Message::Signal {
                process: ProcessRef::Pid(7),
                signal: 15,
            }),
            Frame::Message(Message::Input {
                process: ProcessRef::Pid(7),
                close: true,
            }),
            Frame::Message(Message::Processes {
                processes: vec![ProcessInfo {
                    pid: 7,
                    tag: None,
                    argv: vec!["sleep".into(), "9".into()],
                    env: vec![],
                    cwd: None,
                    user: Some("root".into()),
                    keep: true,
                    stdin: false,
                }],
            }),
            Frame::Data(Stream::Stdout, b"hello\0world".to_vec()),
            Frame::Data(Stream::File, Vec::new()),
            Frame::Message(Message::ListDir {
                path: "/tmp".into(),
                depth: 2,
            }),
            Frame::Message(Message::Entries {
                entries: vec![Entry {
                    name: "l".into(),
                    path: "/tmp/l".into(),
                    kind: EntryKind::Symlink,
                    size: 1,
                    mode: 0o777,
                    mtime_ms: 5,
                    owner: "root".into(),
                    group: "0".into(),
                    target: Some("f".into()),
                }],
            }),
            Frame::Message(Message::Done { changed: false }),
        ];
        let mut wire = Vec::new();
        for f in &frames {
            write_frame(&mut wire, f).expect("write");
        }
        let mut r = &wire[..];
        for f in &frames {
            assert_eq!(&read_frame(&mut r).expect("read"), f);
        }
        assert!(matches!(read_frame(&mut r), Err(ProtocolError::Closed)));
    }

    #[test]
    fn test_bad_frames_are_errors() {
        let mut r: &[u8] = &(MAX_FRAME + 1).to_le_bytes();
        assert!(matches!(
            read_frame(&mut r),
            Err(ProtocolError::TooLarge(_))
        ));
        let wire = [3u8, 0, 0, 0, 9, 1, 2];
        assert!(matches!(
            read_frame(&mut &wire[..]),
            Err(ProtocolError::FrameType(9))
        ));
        let body = br#"{"type":"teleport"}"#;
        let mut wire = ((body.len() + 1) as u32).to_le_bytes().to_vec();
        wire.push(FRAME_MESSAGE);
        wire.extend_from_slice(body);
        assert!(matches!(
            read_frame(&mut &wire[..]),
            Err(ProtocolError::Decode(_))
        ));
        let wire = [2u8, 0, 0, 0, FRAME_DATA, 7];
        assert!(matches!(
            read_frame(&mut &wire[..]),
            Err(ProtocolError::BadStream(7))
        ));
    }
}
