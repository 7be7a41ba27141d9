//! The real agent binary, serving on a Unix socket on the host, driven by
//! the real protocol client. `TINE_AGENT_BIN` runs them against another
//! build (e.g. the static one from scripts/build-agent).

mod common;

use std::io::{self, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use protocol::{
    read_frame, send, ClientError, ErrorKind, ExecRequest, Frame, Message, PROTOCOL_VERSION,
};

/// A temporary directory removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "tine-agent-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("mkdir");
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `tine-agent serve --unix`; killed on drop.
struct Agent {
    child: Child,
    sock: PathBuf,
    dir: TempDir,
}

impl Agent {
    fn start() -> Self {
        let dir = TempDir::new();
        let sock = dir.0.join("agent.sock");
        let child = common::serve(&sock, &[]);
        Self { child, sock, dir }
    }

    /// A connection after a successful Hello.
    fn conn(&self) -> UnixStream {
        let mut s = UnixStream::connect(&self.sock).expect("connect");
        let h = protocol::hello(&mut s).expect("hello");
        assert_eq!(h.protocol, PROTOCOL_VERSION);
        s
    }

    fn child_kill(&mut self) -> io::Result<()> {
        self.child.kill()?;
        self.child.wait().map(drop)
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().expect("try_wait").is_none()
    }

    fn exec(
        &self,
        req: ExecRequest,
        stdin: Option<Vec<u8>>,
    ) -> (protocol::ExitInfo, Vec<u8>, Vec<u8>) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let exit = protocol::exec(
            &mut self.conn(),
            req,
            stdin.map(io::Cursor::new),
            &mut out,
            &mut err,
        )
        .expect("exec");
        (exit, out, err)
    }

    fn sh(&self, script: &str) -> protocol::ExitInfo {
        self.exec(ExecRequest::new(["sh", "-c", script]), None).0
    }

    fn assert_serving(&mut self) {
        assert!(self.alive(), "agent died");
        let pong = protocol::ping(&mut self.conn()).expect("ping");
        assert!(pong.agent_version.starts_with("tine-agent"));
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn pid_alive(pid: u32) -> bool {
    // A zombie is gone for our purposes: it no longer runs.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => !s
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z'),
        Err(_) => false,
    }
}

fn hash(data: &[u8]) -> u64 {
    // FNV-1a is enough to compare two buffers in a test.
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn pattern(len: usize) -> Vec<u8> {
    let mut x = 0x1234_5678u32;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x as u8
        })
        .collect()
}

#[test]
fn test_ping() {
    let a = Agent::start();
    let pong = protocol::ping(&mut a.conn()).expect("ping");
    assert_eq!(
        pong.agent_version,
        concat!("tine-agent ", env!("CARGO_PKG_VERSION"))
    );
    let host_boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").expect("boot_id");
    assert_eq!(pong.boot_id, host_boot.trim());
    assert!(pong.uptime_ms > 0);
}

#[test]
fn test_exec_exit_codes_and_signal() {
    let a = Agent::start();
    for (script, code) in [("exit 42", 42), ("exit 0", 0), ("exit 1", 1), ("true", 0)] {
        let e = a.sh(script);
        assert_eq!(
            (e.code, e.signal, e.timed_out),
            (Some(code), None, false),
            "{script}"
        );
    }
    let e = a.sh("kill -9 $$");
    assert_eq!((e.code, e.signal, e.timed_out), (None, Some(9), false));
    assert_eq!(e.exit_code(), 137);
}

#[test]
fn test_exec_stdin_roundtrip_1mib() {
    let a = Agent::start();
    let data = pattern(1 << 20);
    let (e, out, err) = a.exec(ExecRequest::new(["cat"]), Some(data.clone()));
    assert_eq!(e.code, Some(0));
    assert_eq!(out.len(), data.len());
    assert!(out == data, "stdout differs from stdin");
    assert!(err.is_empty());
}

#[test]
fn test_exec_stdout_stderr_env_cwd() {
    let a = Agent::start();
    let mut req = ExecRequest::new(["sh", "-c", "echo out-$TINE_X; echo err-$TINE_X >&2; pwd"]);
    req.env.push(("TINE_X".into(), "y z".into()));
    req.cwd = Some(a.dir.0.display().to_string());
    let (e, out, err) = a.exec(req, None);
    assert_eq!(e.code, Some(0));
    let dir = std::fs::canonicalize(&a.dir.0).expect("canonicalize");
    assert_eq!(
        String::from_utf8_lossy(&out),
        format!("out-y z\n{}\n", dir.display())
    );
    assert_eq!(String::from_utf8_lossy(&err), "err-y z\n");
    // Without stdin the command reads /dev/null.
    let (e, out, _) = a.exec(ExecRequest::new(["cat"]), None);
    assert_eq!((e.code, out.len()), (Some(0), 0));
}

#[test]
fn test_exec_timeout_kills() {
    let a = Agent::start();
    let mut req = ExecRequest::new(["sh", "-c", "sleep 30; echo late"]);
    req.timeout = Some(Duration::from_millis(300));
    let t = Instant::now();
    let (e, out, _) = a.exec(req, None);
    assert!(
        t.elapsed() < Duration::from_millis(1500),
        "took {:?}",
        t.elapsed()
    );
    assert!(e.timed_out);
    assert_eq!((e.code, e.signal), (None, Some(9)));
    assert!(out.is_empty());
    // A command that ends in time is not reported as timed out.
    let mut req = ExecRequest::new(["true"]);
    req.timeout = Some(Duration::from_secs(10));
    let (e, _, _) = a.exec(req, None);
    assert_eq!((e.code, e.timed_out), (Some(0), false));
}

#[test]
fn test_exec_missing_program_and_cwd() {
    let mut a = Agent::start();
    let e = protocol::exec(
        &mut a.conn(),
        ExecRequest::new(["/no/such/program"]),
        None::<io::Empty>,
        io::sink(),
        io::sink(),
    );
    match e {
        Err(ClientError::Agent {
            kind: ErrorKind::Spawn,
            message,
        }) => assert!(message.contains("/no/such/program"), "{message}"),
        e => panic!("{e:?}"),
    }
    let mut req = ExecRequest::new(["true"]);
    req.cwd = Some("/no/such/dir".into());
    let e = protocol::exec(
        &mut a.conn(),
        req,
        None::<io::Empty>,
        io::sink(),
        io::sink(),
    );
    assert!(
        matches!(&e, Err(ClientError::Agent { kind: ErrorKind::Spawn, message }) if message.contains("/no/such/dir")),
        "{e:?}"
    );
    let e = protocol::exec(
        &mut a.conn(),
        ExecRequest::default(),
        None::<io::Empty>,
        io::sink(),
        io::sink(),
    );
    assert!(
        matches!(
            e,
            Err(ClientError::Agent {
                kind: ErrorKind::BadRequest,
                ..
            })
        ),
        "{e:?}"
    );
    a.assert_serving();
}

#[test]
fn test_files_10mib_roundtrip() {
    let a = Agent::start();
    let data = pattern(10 << 20);
    let path = a.dir.0.join("big.bin");
    let p = path.to_str().expect("utf-8 path");
    let n = protocol::write_file(&mut a.conn(), p, 0o640, &data[..]).expect("write_file");
    assert_eq!(n, data.len() as u64);
    let meta = std::fs::metadata(&path).expect("stat");
    assert_eq!(meta.permissions().mode() & 0o7777, 0o640);
    assert_eq!(hash(&std::fs::read(&path).expect("read")), hash(&data));
    // No temporary file left behind.
    let names: Vec<_> = std::fs::read_dir(&a.dir.0)
        .expect("readdir")
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    assert_eq!(names.len(), 2, "{names:?}"); // agent.sock, big.bin

    let mut back = Vec::new();
    let info = protocol::read_file(&mut a.conn(), p, &mut back).expect("read_file");
    assert_eq!((info.size, info.mode), (data.len() as u64, 0o640));
    assert_eq!(hash(&back), hash(&data));
    assert!(back == data);

    // Overwrite in place with another mode; empty file.
    let n = protocol::write_file(&mut a.conn(), p, 0o755, io::empty()).expect("write_file");
    assert_eq!(n, 0);
    let mut back = Vec::new();
    let info = protocol::read_file(&mut a.conn(), p, &mut back).expect("read_file");
    assert_eq!((info.size, info.mode, back.len()), (0, 0o755, 0));
}

#[test]
fn test_files_missing() {
    let mut a = Agent::start();
    let missing = a.dir.0.join("nope");
    let e = protocol::read_file(&mut a.conn(), missing.to_str().expect("utf-8"), io::sink());
    assert!(
        matches!(
            e,
            Err(ClientError::Agent {
                kind: ErrorKind::NotFound,
                ..
            })
        ),
        "{e:?}"
    );
    let in_missing_dir = a.dir.0.join("nodir/file");
    let e = protocol::write_file(
        &mut a.conn(),
        in_missing_dir.to_str().expect("utf-8"),
        0o644,
        &pattern(3 << 20)[..],
    );
    assert!(
        matches!(
            e,
            Err(ClientError::Agent {
                kind: ErrorKind::NotFound,
                ..
            })
        ),
        "{e:?}"
    );
    let dir = a.dir.0.to_str().expect("utf-8").to_owned();
    let e = protocol::read_file(&mut a.conn(), &dir, io::sink());
    assert!(
        matches!(
            e,
            Err(ClientError::Agent {
                kind: ErrorKind::Io,
                ..
            })
        ),
        "{e:?}"
    );
    a.assert_serving();
}

#[test]
fn test_version_mismatch() {
    let mut a = Agent::start();
    let mut s = UnixStream::connect(&a.sock).expect("connect");
    match protocol::hello_as(&mut s, 999, "tine-from-the-future") {
        Err(ClientError::Agent {
            kind: ErrorKind::Version,
            message,
        }) => {
            assert!(message.contains("999"), "{message}");
            assert!(message.contains(&PROTOCOL_VERSION.to_string()), "{message}");
        }
        e => panic!("{e:?}"),
    }
    // The agent closed the connection.
    assert!(matches!(
        read_frame(&mut s),
        Err(protocol::ProtocolError::Closed)
    ));
    a.assert_serving();
}

/// Sends raw bytes after (optionally) a good Hello; expects BadRequest.
fn expect_bad_request(a: &mut Agent, hello_first: bool, raw: &[u8]) {
    let mut s = if hello_first {
        a.conn()
    } else {
        UnixStream::connect(&a.sock).expect("connect")
    };
    s.write_all(raw).expect("write");
    match read_frame(&mut s) {
        Ok(Frame::Message(Message::Error {
            kind: ErrorKind::BadRequest,
            ..
        })) => {}
        r => panic!("raw {raw:?}: {r:?}"),
    }
    a.assert_serving();
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut v = (body.len() as u32).to_le_bytes().to_vec();
    v.extend_from_slice(body);
    v
}

#[test]
fn test_garbage_and_unknown_messages() {
    let mut a = Agent::start();
    // HTTP at the agent: the "length" is far too large.
    expect_bad_request(&mut a, false, b"GET / HTTP/1.1\r\n\r\n");
    // Unknown frame type, unknown data stream, empty frame.
    expect_bad_request(&mut a, false, &frame(&[9, 1, 2, 3]));
    expect_bad_request(&mut a, true, &frame(&[1, 7, 0]));
    expect_bad_request(&mut a, true, &frame(&[]));
    // JSON that is not a message, and an unknown message type.
    expect_bad_request(&mut a, false, &frame(b"\0not json"));
    expect_bad_request(
        &mut a,
        true,
        &frame(b"\0{\"type\":\"teleport\",\"to\":\"mars\"}"),
    );
    // A known message that is not a request, and a request before Hello.
    let mut s = a.conn();
    send(&mut s, Message::Written { bytes: 1 }).expect("send");
    assert!(matches!(
        read_frame(&mut s),
        Ok(Frame::Message(Message::Error {
            kind: ErrorKind::BadRequest,
            ..
        }))
    ));
    let mut s = UnixStream::connect(&a.sock).expect("connect");
    send(&mut s, Message::Ping).expect("send");
    assert!(matches!(
        read_frame(&mut s),
        Ok(Frame::Message(Message::Error {
            kind: ErrorKind::BadRequest,
            ..
        }))
    ));
    // Connections that just hang up.
    drop(UnixStream::connect(&a.sock).expect("connect"));
    drop(a.conn());
    a.assert_serving();
}

#[test]
fn test_concurrent_execs() {
    let a = Agent::start();
    let t = Instant::now();
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..4)
            .map(|i| {
                let a = &a;
                sc.spawn(move || {
                    let script = format!("sleep 1; echo job-{i}; exit {i}");
                    let (e, out, _) = a.exec(ExecRequest::new(["sh", "-c", &script]), None);
                    assert_eq!(e.code, Some(i));
                    assert_eq!(String::from_utf8_lossy(&out), format!("job-{i}\n"));
                })
            })
            .collect();
        for h in hs {
            h.join().expect("job");
        }
    });
    // They ran at once, not one after another.
    assert!(
        t.elapsed() < Duration::from_millis(1900),
        "took {:?}",
        t.elapsed()
    );
}

/// Starts `script` with a connection that the caller drops; returns the
/// pid of the command and of a grandchild it reports.
fn start_and_drop(a: &Agent, script: &str, with_stdin: bool) -> (u32, u32) {
    let mut s = a.conn();
    send(
        &mut s,
        Message::Exec {
            argv: vec!["sh".into(), "-c".into(), script.into()],
            env: vec![],
            cwd: None,
            stdin: with_stdin,
            timeout_ms: None,
            keep: false,
            tag: None,
            user: None,
        },
    )
    .expect("send");
    let pid = match read_frame(&mut s) {
        Ok(Frame::Message(Message::Started { pid })) => pid,
        r => panic!("{r:?}"),
    };
    let mut line = Vec::new();
    while !line.ends_with(b"\n") {
        match read_frame(&mut s) {
            Ok(Frame::Data(protocol::Stream::Stdout, b)) => line.extend_from_slice(&b),
            r => panic!("{r:?}"),
        }
    }
    let grandchild: u32 = String::from_utf8_lossy(&line).trim().parse().expect("pid");
    assert!(pid_alive(pid) && pid_alive(grandchild));
    drop(s);
    (pid, grandchild)
}

fn wait_gone(pids: &[u32]) {
    let t = Instant::now();
    while pids.iter().any(|&p| pid_alive(p)) {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{pids:?} still running"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts a kept command and returns its connection once it printed its
/// first line.
fn start_kept(a: &Agent, script: &str, tag: &str, stdin: bool) -> (UnixStream, u32) {
    let mut s = a.conn();
    send(
        &mut s,
        Message::Exec {
            argv: vec!["sh".into(), "-c".into(), script.into()],
            env: vec![],
            cwd: None,
            stdin,
            timeout_ms: None,
            keep: true,
            tag: Some(tag.into()),
            user: None,
        },
    )
    .expect("send");
    let pid = match read_frame(&mut s) {
        Ok(Frame::Message(Message::Started { pid })) => pid,
        r => panic!("{r:?}"),
    };
    (s, pid)
}

/// Reads stdout frames until `want` appeared.
fn read_until(s: &mut UnixStream, want: &str) -> String {
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains(want) {
        match read_frame(s) {
            Ok(Frame::Data(protocol::Stream::Stdout, b)) => got.extend_from_slice(&b),
            r => panic!("{r:?} after {:?}", String::from_utf8_lossy(&got)),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

#[test]
fn test_kept_command_outlives_its_connection_and_is_driven_later() {
    let mut a = Agent::start();
    let (mut s, pid) = start_kept(
        &a,
        "echo up; while read l; do echo got:$l; done; echo bye",
        "worker",
        true,
    );
    read_until(&mut s, "up");
    drop(s);
    // Still running, listed, and followed again by tag.
    std::thread::sleep(Duration::from_millis(100));
    assert!(pid_alive(pid));
    let procs = protocol::list_processes(&mut a.conn()).expect("list");
    let p = procs.iter().find(|p| p.pid == pid).expect("listed");
    assert_eq!(p.tag.as_deref(), Some("worker"));
    assert!(p.keep && p.stdin);
    // A second command with the same tag is refused while it runs.
    let mut s2 = a.conn();
    let dup = protocol::exec(
        &mut s2,
        ExecRequest {
            keep: true,
            tag: Some("worker".into()),
            ..ExecRequest::new(["true"])
        },
        None::<io::Empty>,
        io::sink(),
        io::sink(),
    );
    assert!(
        matches!(&dup, Err(ClientError::Agent { kind: ErrorKind::BadRequest, message }) if message.contains("worker")),
        "{dup:?}"
    );
    // Input goes in once the follower is there (it sees output from then on).
    let (ready, attached) = std::sync::mpsc::channel();
    let follower = {
        let sock = a.sock.clone();
        std::thread::spawn(move || {
            let mut c = UnixStream::connect(&sock).expect("connect");
            protocol::hello(&mut c).expect("hello");
            let mut out = Vec::new();
            let mut seen = 0;
            let exit = protocol::attach(
                &mut c,
                protocol::ProcessRef::Tag("worker".into()),
                |p| {
                    seen = p;
                    let _ = ready.send(());
                },
                &mut out,
                io::sink(),
            )
            .expect("attach");
            (seen, exit, String::from_utf8_lossy(&out).into_owned())
        })
    };
    attached
        .recv_timeout(Duration::from_secs(5))
        .expect("attached");
    protocol::input(
        &mut a.conn(),
        protocol::ProcessRef::Pid(pid),
        b"one\ntwo\n",
        true,
    )
    .expect("input");
    let (seen, exit, out) = follower.join().expect("follower");
    assert_eq!(seen, pid);
    assert_eq!(exit.code, Some(0));
    assert_eq!(out, "got:one\ngot:two\nbye\n");
    // Gone from the table; driving it now says so.
    assert!(protocol::list_processes(&mut a.conn())
        .expect("list")
        .iter()
        .all(|p| p.pid != pid));
    let gone = protocol::signal(&mut a.conn(), protocol::ProcessRef::Pid(pid), 15);
    assert!(
        matches!(
            gone,
            Err(ClientError::Agent {
                kind: ErrorKind::NotFound,
                ..
            })
        ),
        "{gone:?}"
    );
    let gone = protocol::input(&mut a.conn(), protocol::ProcessRef::Pid(pid), b"x", false);
    assert!(
        matches!(
            gone,
            Err(ClientError::Agent {
                kind: ErrorKind::NotFound,
                ..
            })
        ),
        "{gone:?}"
    );
    a.assert_serving();
}

#[test]
fn test_kept_command_signalled_and_input_refused_without_stdin() {
    let mut a = Agent::start();
    let (mut s, pid) = start_kept(&a, "echo up; sleep 30 & wait", "sleeper", false);
    read_until(&mut s, "up");
    let no = protocol::input(
        &mut a.conn(),
        protocol::ProcessRef::Tag("sleeper".into()),
        b"x",
        false,
    );
    assert!(
        matches!(&no, Err(ClientError::Agent { kind: ErrorKind::BadRequest, message }) if message.contains("without stdin")),
        "{no:?}"
    );
    let bad = protocol::signal(&mut a.conn(), protocol::ProcessRef::Pid(pid), 99);
    assert!(
        matches!(
            bad,
            Err(ClientError::Agent {
                kind: ErrorKind::BadRequest,
                ..
            })
        ),
        "{bad:?}"
    );
    assert!(protocol::signal(&mut a.conn(), protocol::ProcessRef::Pid(pid), 9).expect("kill"));
    // The connection that started it sees the end.
    let end = loop {
        match read_frame(&mut s) {
            Ok(Frame::Message(m @ Message::Exited { .. })) => break m,
            Ok(Frame::Data(..)) => {}
            r => panic!("{r:?}"),
        }
    };
    assert!(
        matches!(
            end,
            Message::Exited {
                signal: Some(9),
                ..
            }
        ),
        "{end:?}"
    );
    wait_gone(&[pid]);
    // Attach to a command that is not there.
    let none = protocol::attach(
        &mut a.conn(),
        protocol::ProcessRef::Pid(pid),
        |_| {},
        io::sink(),
        io::sink(),
    );
    assert!(
        matches!(
            none,
            Err(ClientError::Agent {
                kind: ErrorKind::NotFound,
                ..
            })
        ),
        "{none:?}"
    );
    a.assert_serving();
}

#[test]
fn test_exec_as_user() {
    let a = Agent::start();
    let (exit, out, _) = a.exec(
        ExecRequest {
            user: Some("nobody".into()),
            ..ExecRequest::new(["sh", "-c", "id -u; echo $USER"])
        },
        None,
    );
    assert_eq!(exit.code, Some(0));
    assert_eq!(String::from_utf8_lossy(&out), "65534\nnobody\n");
    let mut c = a.conn();
    let e = protocol::exec(
        &mut c,
        ExecRequest {
            user: Some("no-such-user".into()),
            ..ExecRequest::new(["true"])
        },
        None::<io::Empty>,
        io::sink(),
        io::sink(),
    );
    assert!(
        matches!(&e, Err(ClientError::Agent { kind: ErrorKind::Spawn, message }) if message.contains("no-such-user")),
        "{e:?}"
    );
}

#[test]
fn test_dropped_connection_kills_command() {
    let mut a = Agent::start();
    // sleep in the background so the shell and the sleep are both checked.
    let (sh, sleep) = start_and_drop(&a, "sleep 30 & echo $!; wait", false);
    wait_gone(&[sh, sleep]);
    let (sh, sleep) = start_and_drop(&a, "sleep 30 & echo $!; wait", true);
    wait_gone(&[sh, sleep]);
    a.assert_serving();
}

#[test]
fn test_shutdown_exits_when_told() {
    let mut a = Agent::start();
    let t = Instant::now();
    protocol::shutdown(a.conn()).expect("shutdown");
    while a.alive() {
        assert!(t.elapsed() < Duration::from_secs(5), "agent did not exit");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The closed connection let it go at once, without the grace period.
    assert!(
        t.elapsed() < Duration::from_millis(900),
        "took {:?}",
        t.elapsed()
    );
}

#[test]
fn test_stale_socket_is_replaced() {
    let mut a = Agent::start();
    let sock = a.sock.clone();
    a.child_kill().expect("kill");
    // The socket file is still there; a new agent takes it over.
    assert!(sock.exists());
    let mut child = Command::new(common::agent_bin())
        .args(["serve", "--unix"])
        .arg(&sock)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn");
    let t = Instant::now();
    let ok = loop {
        if let Ok(mut s) = UnixStream::connect(&sock) {
            break protocol::hello(&mut s)
                .and_then(|_| protocol::ping(&mut s))
                .is_ok();
        }
        if t.elapsed() > Duration::from_secs(10) {
            break false;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert!(ok);
}

#[test]
fn test_write_file_is_atomic_rename() {
    let a = Agent::start();
    let path = a.dir.0.join("f");
    std::fs::write(&path, b"old").expect("write");
    let p = path.to_str().expect("utf-8");
    // A reader that fails midway: the old content must stay.
    struct Failing(usize);
    impl Read for Failing {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            if self.0 == 0 {
                return Err(io::Error::other("disk on fire"));
            }
            let n = buf.len().min(self.0);
            buf[..n].fill(b'x');
            self.0 -= n;
            Ok(n)
        }
    }
    let e = protocol::write_file(&mut a.conn(), p, 0o644, Failing(1000));
    assert!(matches!(e, Err(ClientError::Local(_))), "{e:?}");
    assert_eq!(std::fs::read(&path).expect("read"), b"old");
    protocol::write_file(&mut a.conn(), p, 0o600, &b"new"[..]).expect("write_file");
    assert_eq!(std::fs::read(&path).expect("read"), b"new");
}

#[test]
fn test_stdin_not_read_does_not_hang() {
    let a = Agent::start();
    let t = Instant::now();
    let (e, out, _) = a.exec(ExecRequest::new(["true"]), Some(pattern(4 << 20)));
    assert_eq!((e.code, out.len()), (Some(0), 0));
    let (e, out, _) = a.exec(
        ExecRequest::new(["head", "-c", "10"]),
        Some(pattern(4 << 20)),
    );
    assert_eq!((e.code, out.len()), (Some(0), 10));
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn test_tcp_listener() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = Command::new(common::agent_bin())
        .args(["serve", "--tcp", &addr])
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn");
    let t = Instant::now();
    let result = loop {
        if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
            break protocol::hello(&mut s).and_then(|_| {
                protocol::exec(
                    &mut s,
                    ExecRequest::new(["echo", "over tcp"]),
                    None::<io::Empty>,
                    Vec::new(),
                    io::sink(),
                )
            });
        }
        if t.elapsed() > Duration::from_secs(10) {
            break Err(ClientError::Unexpected("agent did not listen".into()));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(result.expect("exec").code, Some(0));
}
