//! A real `tined` for tests: the binary of this package, started in the
//! foreground with a temporary home, and an HTTP client (hyper over its
//! Unix socket, or TCP) to talk to it.
//!
//! Dropping a [`Tined`] removes every vm it has (`DELETE ?force=true`),
//! stops tined, ends any VMM process of its home that is still there and
//! then fails the test if there was one: no test leaves a VMM behind, and
//! one that leaks fails.
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// The limit of one request (a hung tined fails the call, not the binary).
pub const CALL_LIMIT: Duration = Duration::from_secs(120);

/// Writes a progress line to stderr at once (not captured by the harness).
pub fn progress(msg: &str) {
    let _ = std::io::stderr().write_all(format!("[api] {msg}\n").as_bytes());
}

/// The runtime every request of this test binary runs on.
fn rt() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("a tokio runtime")
    })
}

/// `tined` starts `tine-vmm` from beside itself: a binary of another
/// package, which `cargo test -p tined` does not rebuild. One older than
/// its sources would test old code: say so.
fn vmm_is_fresh(tined: &Path) {
    static CHECKED: OnceLock<Result<(), String>> = OnceLock::new();
    let res = CHECKED.get_or_init(|| {
        let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut newest = std::time::SystemTime::UNIX_EPOCH;
        let mut stack: Vec<PathBuf> = ["tine-vmm", "vmm", "store", "disk", "snapshot", "image"]
            .iter()
            .map(|d| crates.join(d).join("src"))
            .collect();
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if let Ok(m) = e.metadata().and_then(|m| m.modified()) {
                    newest = newest.max(m);
                }
            }
        }
        for name in ["tine-vmm", "tine-gateway"] {
            let p = tined.with_file_name(name);
            let built = std::fs::metadata(&p).and_then(|m| m.modified()).ok();
            let stale = name == "tine-vmm" && built.is_some_and(|b| b < newest);
            if built.is_none() || stale {
                return Err(format!(
                    "{} is missing or older than its sources: run `cargo build --workspace` first (scripts/test does)",
                    p.display()
                ));
            }
        }
        Ok(())
    });
    if let Err(e) = res {
        panic!("{e}");
    }
}

/// Fails loudly in CI when /dev/kvm is missing; elsewhere lets the caller skip.
pub fn kvm_available() -> bool {
    let ok = Path::new("/dev/kvm").exists();
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "/dev/kvm is missing in CI: KVM tests must run"
        );
        eprintln!("skipping: /dev/kvm is missing");
    }
    ok
}

/// An answer: status, headers, the whole body.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: hyper::HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    /// The body as JSON; panics (with the body) when it is not.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "the answer ({}) is not JSON: {e}: {:?}",
                self.status,
                self.text()
            )
        })
    }
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    }
    /// Asserts the status, showing the body otherwise; returns the JSON.
    #[track_caller]
    pub fn expect(&self, status: u16) -> Value {
        assert_eq!(
            self.status,
            status,
            "expected {status}, got {}: {}",
            self.status,
            self.text()
        );
        if self.body.is_empty() {
            Value::Null
        } else {
            self.json()
        }
    }
    /// Asserts an error answer: this status, a JSON body with exactly the
    /// fields `code` (this one) and `message` (not empty). Returns the message.
    #[track_caller]
    pub fn expect_error(&self, status: u16, code: &str) -> String {
        let v = self.expect(status);
        let obj = v
            .as_object()
            .unwrap_or_else(|| panic!("an error body is an object: {v}"));
        let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["code", "message"], "error body fields: {v}");
        assert_eq!(v["code"], code, "error code: {v}");
        let msg = v["message"].as_str().unwrap_or_default().to_string();
        assert!(!msg.trim().is_empty(), "an error says what went wrong: {v}");
        assert_eq!(
            self.header("content-type").as_deref(),
            Some("application/json"),
            "error content type"
        );
        msg
    }
}

/// Where a request goes.
#[derive(Clone, Debug)]
pub enum Addr {
    Unix(PathBuf),
    Tcp(std::net::SocketAddr),
}

/// Sends one request on a new connection and returns the response with
/// its body still streaming.
async fn send_raw(
    addr: &Addr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Result<hyper::Response<Incoming>, String> {
    let mut b = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", "tined");
    let mut has_type = false;
    for (k, v) in headers {
        has_type |= k.eq_ignore_ascii_case("content-type");
        b = b.header(*k, *v);
    }
    if !body.is_empty() && !has_type {
        b = b.header("content-type", "application/json");
    }
    let req = b
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| format!("bad request: {e}"))?;
    macro_rules! go {
        ($stream:expr) => {{
            let io = TokioIo::new($stream);
            let (mut tx, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| format!("handshake: {e}"))?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            tx.send_request(req)
                .await
                .map_err(|e| format!("{method} {path}: {e}"))
        }};
    }
    match addr {
        Addr::Unix(p) => go!(tokio::net::UnixStream::connect(p)
            .await
            .map_err(|e| format!("connect {}: {e}", p.display()))?),
        Addr::Tcp(a) => go!(tokio::net::TcpStream::connect(a)
            .await
            .map_err(|e| format!("connect {a}: {e}"))?),
    }
}

/// One request and its whole answer, within [`CALL_LIMIT`].
pub fn call(
    addr: &Addr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Result<Resp, String> {
    rt().block_on(async {
        tokio::time::timeout(CALL_LIMIT, async {
            let res = send_raw(addr, method, path, headers, body).await?;
            let status = res.status().as_u16();
            let headers = res.headers().clone();
            let body = res
                .into_body()
                .collect()
                .await
                .map_err(|e| format!("{method} {path}: reading the body: {e}"))?
                .to_bytes();
            Ok(Resp {
                status,
                headers,
                body,
            })
        })
        .await
        .map_err(|_| format!("{method} {path}: no answer within {CALL_LIMIT:?}"))?
    })
}

/// A server-sent event stream being read in the background.
pub struct Sse {
    pub status: u16,
    pub content_type: Option<String>,
    rx: std::sync::mpsc::Receiver<(String, String)>,
    task: tokio::task::JoinHandle<()>,
}

impl Sse {
    /// The next event (its `event:` and `data:`), or None after `limit`
    /// or at the end of the stream.
    pub fn next(&self, limit: Duration) -> Option<(String, String)> {
        self.rx.recv_timeout(limit).ok()
    }

    /// Events until one for which `stop` is true (included), within `limit`;
    /// panics with what came otherwise.
    pub fn until(
        &self,
        limit: Duration,
        stop: impl Fn(&str, &Value) -> bool,
    ) -> Vec<(String, Value)> {
        let deadline = Instant::now() + limit;
        let mut seen = Vec::new();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let Some((ev, data)) = self.next(left) else {
                break;
            };
            let v: Value = serde_json::from_str(&data)
                .unwrap_or_else(|e| panic!("event {ev:?}: data is not JSON ({e}): {data:?}"));
            let done = stop(&ev, &v);
            seen.push((ev, v));
            if done {
                return seen;
            }
        }
        panic!("the awaited event did not come within {limit:?}; got {seen:#?}");
    }
}

impl Drop for Sse {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Opens an SSE stream at `path`.
pub fn sse(addr: &Addr, path: &str) -> Sse {
    let (tx, rx) = std::sync::mpsc::channel();
    let (addr, path) = (addr.clone(), path.to_string());
    let (head_tx, head_rx) = std::sync::mpsc::channel();
    let task = rt().spawn(async move {
        let res = match send_raw(
            &addr,
            "GET",
            &path,
            &[("accept", "text/event-stream")],
            Vec::new(),
        )
        .await
        {
            Ok(r) => r,
            Err(e) => {
                let _ = head_tx.send(Err(e));
                return;
            }
        };
        let ct = res
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let _ = head_tx.send(Ok((res.status().as_u16(), ct)));
        let mut body = res.into_body();
        let mut buf = String::new();
        while let Some(frame) = body.frame().await {
            let Ok(frame) = frame else { break };
            let Some(data) = frame.data_ref() else {
                continue;
            };
            buf.push_str(&String::from_utf8_lossy(data));
            // Events end with a blank line.
            while let Some(end) = buf.find("\n\n") {
                let block: String = buf.drain(..end + 2).collect();
                let mut event = String::from("message");
                let mut data = Vec::new();
                for line in block.lines() {
                    if let Some(v) = line.strip_prefix("event:") {
                        event = v.trim_start().to_string();
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push(v.strip_prefix(' ').unwrap_or(v).to_string());
                    }
                }
                // Comments (keep-alives) have neither.
                if !data.is_empty() && tx.send((event, data.join("\n"))).is_err() {
                    return;
                }
            }
        }
    });
    let (status, content_type) = head_rx
        .recv_timeout(CALL_LIMIT)
        .unwrap_or_else(|_| Err(format!("GET {}: no answer", "stream")))
        .unwrap_or_else(|e| panic!("{e}"));
    Sse {
        status,
        content_type,
        rx,
        task,
    }
}

/// A response body read as it comes (console `?follow=true`, NDJSON).
pub struct Chunks {
    pub status: u16,
    /// Each chunk; `None` once the body ended.
    rx: std::sync::mpsc::Receiver<Option<Bytes>>,
    task: tokio::task::JoinHandle<()>,
    /// Everything received so far.
    pub text: String,
    pub ended: bool,
}

impl Chunks {
    /// Reads until `pred` holds for the text so far, or the body ends, or
    /// `limit` passes; returns whether `pred` held.
    pub fn until(&mut self, limit: Duration, pred: impl Fn(&str) -> bool) -> bool {
        let deadline = Instant::now() + limit;
        while !pred(&self.text) {
            if self.ended {
                return false;
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                return false;
            };
            match self.rx.recv_timeout(left) {
                Ok(Some(b)) => self.text.push_str(&String::from_utf8_lossy(&b)),
                Ok(None) => self.ended = true,
                Err(_) => return false,
            }
        }
        true
    }
}

impl Drop for Chunks {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// GETs `path` and reads its body in the background.
pub fn chunks(addr: &Addr, path: &str) -> Chunks {
    let (tx, rx) = std::sync::mpsc::channel();
    let (head_tx, head_rx) = std::sync::mpsc::channel();
    let (addr, path) = (addr.clone(), path.to_string());
    let task = rt().spawn(async move {
        let res = match send_raw(&addr, "GET", &path, &[], Vec::new()).await {
            Ok(r) => r,
            Err(e) => {
                let _ = head_tx.send(Err(e));
                return;
            }
        };
        let _ = head_tx.send(Ok(res.status().as_u16()));
        let mut body = res.into_body();
        while let Some(Ok(frame)) = body.frame().await {
            if let Ok(data) = frame.into_data() {
                if tx.send(Some(data)).is_err() {
                    return;
                }
            }
        }
        let _ = tx.send(None);
    });
    let status = head_rx
        .recv_timeout(CALL_LIMIT)
        .unwrap_or_else(|_| Err("no answer".into()))
        .unwrap_or_else(|e| panic!("GET: {e}"));
    Chunks {
        status,
        rx,
        task,
        text: String::new(),
        ended: false,
    }
}

/// A `tined` of a temporary home, in the foreground.
pub struct Tined {
    pub home: PathBuf,
    _dir: tempfile::TempDir,
    child: Option<Child>,
    pub addr: Addr,
    /// `(address, token)` of the TCP listener, when started with one.
    pub tcp: Option<(std::net::SocketAddr, String)>,
}

/// The tined binary under test.
pub fn tined_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_tined"))
}

/// A new temporary home whose `images` points at the real image cache,
/// as the CLI's tests do (micro guests are written there on first use).
pub fn temp_home(tag: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::Builder::new()
        .prefix(&format!("tined-{tag}-"))
        .tempdir()
        .expect("a temporary home");
    let home = std::fs::canonicalize(dir.path()).expect("canonical home");
    let cache = std::env::var_os("TINE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cache/tine"));
    let images = cache.join("images");
    std::fs::create_dir_all(&images).expect("the image cache");
    std::os::unix::fs::symlink(&images, home.join("images")).expect("link images");
    (dir, home)
}

/// A free TCP port on 127.0.0.1 (free when asked; tined binds it next).
pub fn free_port() -> std::net::SocketAddr {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr")
}

impl Tined {
    /// tined for a new home.
    pub fn start(tag: &str) -> Tined {
        Self::start_with(tag, None)
    }

    /// tined for a new home, with a TCP listener and this token.
    pub fn start_tcp(tag: &str, token: &str) -> Tined {
        Self::start_with(tag, Some(token))
    }

    /// tined for a new home with extra environment and arguments.
    pub fn start_env(tag: &str, env: &[(String, String)], args: &[String]) -> Tined {
        Self::start_env_in(tag, env, args, None)
    }

    /// [`Self::start_env`] in network namespace `netns` (`ip netns`): a
    /// fleet's host of its own.
    pub fn start_env_in(
        tag: &str,
        env: &[(String, String)],
        args: &[String],
        netns: Option<&str>,
    ) -> Tined {
        let (dir, home) = temp_home(tag);
        let child = spawn_in(&home, args, env, netns);
        let mut t = Tined {
            addr: Addr::Unix(home.join("tined.sock")),
            home,
            _dir: dir,
            child: Some(child),
            tcp: None,
        };
        t.wait_healthy();
        t
    }

    /// tined with a TCP listener and no token: only API keys open it.
    pub fn start_tcp_keys(tag: &str) -> Tined {
        let (dir, home) = temp_home(tag);
        let a = free_port();
        let child = spawn(&home, &["--tcp".to_string(), a.to_string()]);
        let mut t = Tined {
            addr: Addr::Unix(home.join("tined.sock")),
            home,
            _dir: dir,
            child: Some(child),
            tcp: Some((a, String::new())),
        };
        t.wait_healthy();
        t
    }

    fn start_with(tag: &str, token: Option<&str>) -> Tined {
        let (dir, home) = temp_home(tag);
        let mut args: Vec<String> = Vec::new();
        let mut tcp = None;
        if let Some(t) = token {
            let f = home.join("token");
            std::fs::write(&f, format!("{t}\n")).expect("token file");
            let a = free_port();
            args.extend([
                "--tcp".into(),
                a.to_string(),
                "--token-file".into(),
                f.display().to_string(),
            ]);
            tcp = Some((a, t.to_string()));
        }
        let child = spawn(&home, &args);
        let mut t = Tined {
            addr: Addr::Unix(home.join("tined.sock")),
            home,
            _dir: dir,
            child: Some(child),
            tcp,
        };
        t.wait_healthy();
        t
    }

    fn wait_healthy(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(r) = call(&self.addr, "GET", "/v1/health", &[], Vec::new()) {
                if r.status == 200 {
                    return;
                }
            }
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(st)) = c.try_wait() {
                    panic!("tined ended at start ({st}):\n{}", self.log());
                }
            }
            assert!(
                Instant::now() < deadline,
                "tined did not answer within 30 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// tined's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.home.join("tined.log")).unwrap_or_default()
    }

    /// tined's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// One request; panics when there is no answer.
    pub fn req(&self, method: &str, path: &str, headers: &[(&str, &str)], body: Vec<u8>) -> Resp {
        call(&self.addr, method, path, headers, body)
            .unwrap_or_else(|e| panic!("{e}\n--- tined.log ---\n{}", self.log()))
    }
    pub fn get(&self, path: &str) -> Resp {
        self.req("GET", path, &[], Vec::new())
    }
    pub fn delete(&self, path: &str) -> Resp {
        self.req("DELETE", path, &[], Vec::new())
    }
    pub fn post(&self, path: &str, body: Value) -> Resp {
        self.req("POST", path, &[], body.to_string().into_bytes())
    }
    pub fn put(&self, path: &str, body: Value) -> Resp {
        self.req("PUT", path, &[], body.to_string().into_bytes())
    }
    pub fn sse(&self, path: &str) -> Sse {
        sse(&self.addr, path)
    }
    pub fn chunks(&self, path: &str) -> Chunks {
        chunks(&self.addr, path)
    }

    /// Waits (up to 10 s) for tined to exit on its own; its exit status.
    pub fn wait_exit(&mut self) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(st) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    /// Starts a new tined on this home (after the old one exited).
    pub fn start_again(&mut self) {
        assert!(self.child.is_none(), "tined still runs");
        self.child = Some(spawn(&self.home, &[]));
        self.wait_healthy();
    }

    /// [`Self::start_again`] with extra environment (a fleet member's), in
    /// network namespace `netns`.
    pub fn start_again_env_in(&mut self, env: &[(String, String)], netns: Option<&str>) {
        assert!(self.child.is_none(), "tined still runs");
        self.child = Some(spawn_in(&self.home, &[], env, netns));
        self.wait_healthy();
    }

    /// Starts micro guest `image` (no agent, 64 MiB) as `name`.
    #[track_caller]
    pub fn run(&self, name: &str, image: &str) -> Value {
        self.post(
            "/v1/vms",
            serde_json::json!({"name": name, "image": image, "mem_mib": 64, "no_agent": true}),
        )
        .expect(201)
    }

    /// The vms, sorted by name, as (name, state).
    pub fn states(&self) -> Vec<(String, String)> {
        let v = self.get("/v1/vms").expect(200);
        let mut out: Vec<(String, String)> = v
            .as_array()
            .expect("a list")
            .iter()
            .map(|r| {
                (
                    r["name"].as_str().unwrap_or_default().to_string(),
                    r["state"].as_str().unwrap_or_default().to_string(),
                )
            })
            .collect();
        out.sort();
        out
    }

    /// Everything the home holds that a request could change: the vms
    /// (name, state, pid, checkpoints) and the store's branches.
    pub fn snapshot_state(&self) -> Value {
        let mut vms = self.get("/v1/vms").expect(200);
        if let Some(a) = vms.as_array_mut() {
            for v in a.iter_mut() {
                // These change on their own.
                if let Some(o) = v.as_object_mut() {
                    o.remove("uptime_s");
                    o.remove("rss_mib");
                }
            }
        }
        let branches = self.get("/v1/branches").expect(200);
        serde_json::json!({"vms": vms, "branches": branches})
    }

    /// The console of `vm` so far (GET /v1/vms/NAME/console).
    pub fn console(&self, vm: &str) -> String {
        self.get(&format!("/v1/vms/{vm}/console")).expect_text(200)
    }

    /// Waits until the console of `vm` after byte `from` has a complete
    /// line for which `pred` holds; returns it.
    #[track_caller]
    pub fn wait_line(&self, vm: &str, from: usize, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let text = self.console(vm);
            let done = text.rfind('\n').map(|i| i + 1).unwrap_or(0);
            if let Some(l) = text
                .get(from..done)
                .unwrap_or("")
                .lines()
                .find(|l| pred(l.trim_end()))
            {
                return l.trim_end().to_string();
            }
            assert!(
                Instant::now() < deadline,
                "no matching console line from {vm}; after byte {from}:\n{}",
                text.get(from..).unwrap_or("")
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Types `line` into memtouch `vm`'s console and returns its reply,
    /// the next line starting with `reply`.
    #[track_caller]
    pub fn ask(&self, vm: &str, line: &str, reply: &str) -> String {
        let from = self.console(vm).len();
        self.post(
            &format!("/v1/vms/{vm}/console"),
            serde_json::json!({ "line": line }),
        )
        .expect(204);
        self.wait_line(vm, from, |l| l.starts_with(reply))
    }

    /// Waits for operation `id` to finish (long-polling) and returns it.
    #[track_caller]
    pub fn wait_op(&self, id: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let op = self
                .get(&format!("/v1/operations/{id}?wait=30"))
                .expect(200);
            if op["state"] != "running" {
                return op;
            }
            assert!(
                Instant::now() < deadline,
                "operation {id} still running: {op}"
            );
        }
    }

    /// Starts a long operation (expects 202 with a Location) and waits for it.
    #[track_caller]
    pub fn operation(&self, path: &str, body: Value) -> Value {
        let r = self.post(path, body);
        let op = r.expect(202);
        let id = op["id"].as_str().expect("an operation id").to_string();
        assert_eq!(
            r.header("location").as_deref(),
            Some(format!("/v1/operations/{id}").as_str()),
            "202 says where the operation is"
        );
        self.wait_op(&id)
    }

    /// Like [`Self::operation`], and asserts that it succeeded; returns its result.
    #[track_caller]
    pub fn operation_ok(&self, path: &str, body: Value) -> Value {
        let op = self.operation(path, body);
        assert_eq!(op["state"], "succeeded", "operation {path}: {op}");
        op["result"].clone()
    }

    /// Kills tined and starts a new one on the same home (which adopts
    /// the vms that kept running).
    pub fn restart(&mut self) {
        self.kill();
        let args: Vec<String> = match &self.tcp {
            Some((a, _)) => vec![
                "--tcp".into(),
                a.to_string(),
                "--token-file".into(),
                self.home.join("token").display().to_string(),
            ],
            None => Vec::new(),
        };
        self.child = Some(spawn(&self.home, &args));
        self.wait_healthy();
    }

    /// Ends tined (SIGKILL) and waits for it; the vms keep running.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Starts tined for `home` with `args`, logging to `home/tined.log`.
pub fn spawn(home: &Path, args: &[String]) -> Child {
    spawn_env(home, args, &[])
}

/// [`spawn`] with extra environment (a fleet member's TINE_META, ...).
pub fn spawn_env(home: &Path, args: &[String], env: &[(String, String)]) -> Child {
    spawn_in(home, args, env, None)
}

/// [`spawn_env`] in network namespace `netns` (`ip netns exec` execs
/// tined, so the child is tined itself).
pub fn spawn_in(
    home: &Path,
    args: &[String],
    env: &[(String, String)],
    netns: Option<&str>,
) -> Child {
    let tined = tined_bin();
    vmm_is_fresh(&tined);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(home.join("tined.log"))
        .expect("tined.log");
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(&tined);
            c
        }
        None => Command::new(&tined),
    };
    cmd.arg("--home")
        .arg(home)
        .args(args)
        .env("TINE_HOME", home)
        .env_remove("TINED_TOKEN")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start tined")
}

impl Resp {
    /// Asserts the status; returns the body as text.
    #[track_caller]
    pub fn expect_text(&self, status: u16) -> String {
        assert_eq!(self.status, status, "expected {status}: {}", self.text());
        self.text()
    }
}

/// A live VMM process of a home.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vmm {
    pub pid: u32,
    /// Its title (`/proc/PID/cmdline`): the vm's name, and for a
    /// checkpoint template `(checkpoint TAG)`.
    pub title: String,
}

/// Every live `tine-vmm` process whose environment names `home`
/// (TINE_HOME), found in /proc.
pub fn vmm_processes(home: &Path) -> Vec<Vmm> {
    let want = format!("TINE_HOME={}", home.display());
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
        let is_vmm = exe
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.trim_end_matches(" (deleted)") == "tine-vmm");
        if !is_vmm {
            continue;
        }
        let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        if !env.split(|b| *b == 0).any(|kv| kv == want.as_bytes()) {
            continue;
        }
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let state = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .unwrap_or("?");
        if state == "Z" || state == "X" {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let title = String::from_utf8_lossy(&cmdline)
            .replace('\0', " ")
            .trim()
            .to_string();
        // A tree's init (its PID namespace's pid 1) runs tine-vmm but is
        // not a VMM.
        if title.starts_with("tine-init") {
            continue;
        }
        out.push(Vmm { pid, title });
    }
    out.sort_by_key(|v| v.pid);
    out
}

/// Whether process `pid` is alive (not a zombie).
pub fn alive(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rfind(')')
            .and_then(|i| s[i + 1..].split_whitespace().next())
            .is_some_and(|st| st != "Z" && st != "X")
    })
}

/// Waits up to 10 s until none of `pids` is alive; returns those still alive.
pub fn wait_gone(pids: &[u64]) -> Vec<u64> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left: Vec<u64> = pids.iter().copied().filter(|p| alive(*p)).collect();
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Drop for Tined {
    fn drop(&mut self) {
        // Remove every vm through the API (also the ones a failed test left).
        if self.child.is_some() {
            if let Ok(r) = call(&self.addr, "GET", "/v1/vms", &[], Vec::new()) {
                let names: Vec<String> = serde_json::from_slice::<Value>(&r.body)
                    .ok()
                    .and_then(|v| v.as_array().cloned())
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|v| v["name"].as_str().map(str::to_string))
                    .collect();
                for n in names {
                    let path = format!("/v1/vms/{n}?force=true");
                    if let Err(e) = call(&self.addr, "DELETE", &path, &[], Vec::new()) {
                        progress(&format!("cleanup: DELETE {path}: {e}"));
                    }
                }
            }
        }
        self.kill();
        // Whatever is left was leaked: end it, and fail the test.
        let mut left = vmm_processes(&self.home);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !left.is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
            left = vmm_processes(&self.home);
        }
        for v in &left {
            if let Ok(pid) = libc::pid_t::try_from(v.pid) {
                // SAFETY: kill(2) takes plain integers; the pid is a tine-vmm
                // of this test's own temporary home, found just now.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
        if !left.is_empty() && !std::thread::panicking() {
            panic!(
                "VMM processes of {} were left after every vm was removed: {left:?}\n--- tined.log ---\n{}",
                self.home.display(),
                self.log()
            );
        }
    }
}
