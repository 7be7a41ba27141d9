//! The CLI as a client of tined: HTTP/1.1 over `$TINE_HOME/tined.sock`.
//!
//! If no tined answers, the CLI starts one (the rule in
//! docs/design/tined.md): `tined --home HOME --idle-exit 600`, beside this
//! executable (or `TINED_BIN`), detached, logging to `HOME/tined.log`;
//! `TINE_AUTOSTART=0` turns that off. A tined of another build (the
//! binary was rebuilt since it started) is asked to exit and started again:
//! its vms keep running and the new one adopts them.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// An error answer of tined (its JSON body).
#[derive(Debug, Deserialize)]
pub struct ApiError {
    pub code: String,
    pub message: String,
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)?;
        if self.code == "internal" {
            // A fault of the host, not of the request: where to look.
            f.write_str(" (see tined.log in tine's home)")?;
        }
        Ok(())
    }
}
impl std::error::Error for ApiError {}

/// tined's health answer (the part the CLI reads).
#[derive(Debug, Deserialize)]
struct Health {
    build: String,
    #[serde(default)]
    config: String,
    pid: u32,
}

/// A connection to one home's tined.
pub struct Client {
    home: PathBuf,
    sock: PathBuf,
    rt: tokio::runtime::Runtime,
}

/// How long a started tined may take to answer (it reconciles first).
const START_WAIT: Duration = Duration::from_secs(30);

impl Client {
    /// The tined of `home`, started if none answers.
    pub fn connect(home: &Path) -> anyhow::Result<Client> {
        std::fs::create_dir_all(home)
            .with_context(|| format!("cannot create {}", home.display()))?;
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let c = Client {
            home: home.to_path_buf(),
            sock: home.join("tined.sock"),
            rt,
        };
        c.ensure(home)?;
        Ok(c)
    }

    /// Makes sure a tined of this build and this configuration answers.
    fn ensure(&self, home: &Path) -> anyhow::Result<()> {
        let want = expected_build()?;
        let config = host::config_fingerprint();
        match self.get::<Health>("/v1/health") {
            Ok(h) if h.build == want.1 && h.config == config => return Ok(()),
            Ok(h) => {
                if h.build != want.1 {
                    tracing::info!("tined pid {} is of another build; restarting it", h.pid);
                } else {
                    tracing::info!(
                        "tined pid {} runs with another configuration ({}); restarting it with this command's",
                        h.pid,
                        host::CONFIG_ENV.join(", ")
                    );
                }
                let _ = self.request(Method::POST, "/v1/shutdown", None, &[]);
                self.wait_gone(h.pid);
            }
            Err(_) => {}
        }
        self.start(home, &want.0)
    }

    fn wait_gone(&self, pid: u32) {
        // A draining tined finishes its operations first.
        let deadline = Instant::now() + Duration::from_secs(310);
        while Instant::now() < deadline && Path::new(&format!("/proc/{pid}")).exists() {
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Starts tined for `home` (once, however many CLIs try at the same
    /// time) and waits until it answers.
    fn start(&self, home: &Path, tined: &Path) -> anyhow::Result<()> {
        if std::env::var("TINE_AUTOSTART").is_ok_and(|v| v == "0") {
            bail!(
                "tined is not running for {} (start it with `tine daemon start`, or unset TINE_AUTOSTART)",
                home.display()
            );
        }
        let lock_path = home.join("tined.start.lock");
        let lock = std::fs::File::create(&lock_path)
            .with_context(|| format!("cannot create {}", lock_path.display()))?;
        // SAFETY: flock(2) on a file this function owns; released on drop.
        unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
        if self.get::<Health>("/v1/health").is_ok() {
            return Ok(());
        }
        let log_path = home.join("tined.log");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("cannot open {}", log_path.display()))?;
        let mut cmd = std::process::Command::new(tined);
        cmd.arg("--home")
            .arg(home)
            .arg("--idle-exit")
            .arg("600")
            .env("TINE_HOME", home)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        // SAFETY: setsid(2) before exec is async-signal-safe: tined gets
        // its own session, so it outlives this command and its terminal.
        unsafe {
            cmd.pre_exec(|| {
                libc::setsid();
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", tined.display()))?;
        let deadline = Instant::now() + START_WAIT;
        loop {
            if self.get::<Health>("/v1/health").is_ok() {
                // tined is not ours to wait for: it is reparented when we exit.
                std::mem::forget(child);
                return Ok(());
            }
            if let Ok(Some(st)) = child.try_wait() {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                let last = log
                    .lines()
                    .rev()
                    .find(|l| l.starts_with("tined: "))
                    .unwrap_or("");
                bail!(
                    "tined ended at start ({st}): {}; see {}",
                    last.trim_start_matches("tined: "),
                    log_path.display()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "tined did not answer within {}s; see {}",
                    START_WAIT.as_secs(),
                    log_path.display()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// One request; the status and the whole body.
    pub fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<(StatusCode, Bytes)> {
        self.rt.block_on(async {
            let res = self.send(method, path, body, headers, None).await?;
            let status = res.status();
            let body = res
                .into_body()
                .collect()
                .await
                .context("tined's answer broke off")?
                .to_bytes();
            Ok((status, body))
        })
    }

    async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        headers: &[(&str, &str)],
        accept: Option<&str>,
    ) -> anyhow::Result<hyper::Response<hyper::body::Incoming>> {
        let stream = tokio::net::UnixStream::connect(&self.sock)
            .await
            .with_context(|| format!("cannot reach tined at {}", self.sock.display()))?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .context("cannot talk HTTP to tined")?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut req = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "tined");
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        if let Some(a) = accept {
            req = req.header("accept", a);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(Bytes::from(body.unwrap_or_default())))?;
        sender
            .send_request(req)
            .await
            .context("tined did not answer")
    }

    /// A JSON call: the answer parsed, or tined's error.
    pub fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<&impl Serialize>,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<T> {
        let body = body.map(serde_json::to_vec).transpose()?;
        let mut tries = 0;
        loop {
            let (status, bytes) = self.request(method.clone(), path, body.clone(), headers)?;
            // Another command is restarting tined: wait for the new one.
            if status == StatusCode::SERVICE_UNAVAILABLE && tries < 3 {
                tries += 1;
                std::thread::sleep(Duration::from_millis(200));
                let deadline = Instant::now() + Duration::from_secs(310);
                while Instant::now() < deadline
                    && self
                        .get_once::<Health>("/v1/health")
                        .is_ok_and(|_| self.draining())
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
                self.ensure(&self.home)?;
                continue;
            }
            return decode(status, &bytes);
        }
    }

    /// Whether the tined answering refuses requests because it is shutting down.
    fn draining(&self) -> bool {
        self.request(Method::GET, "/v1/vms", None, &[])
            .is_ok_and(|(s, _)| s == StatusCode::SERVICE_UNAVAILABLE)
    }

    fn get_once<T: DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        let (status, bytes) = self.request(Method::GET, path, None, &[])?;
        decode(status, &bytes)
    }

    pub fn get<T: DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        if path == "/v1/health" {
            return self.get_once(path);
        }
        self.call(Method::GET, path, None::<&()>, &[])
    }

    pub fn post<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &impl Serialize,
    ) -> anyhow::Result<T> {
        self.call(Method::POST, path, Some(body), &[])
    }

    /// Streams a response body to `sink` as it comes (console --follow).
    pub fn stream(
        &self,
        path: &str,
        accept: Option<&str>,
        mut sink: impl FnMut(&[u8]) -> anyhow::Result<()>,
    ) -> anyhow::Result<()> {
        self.rt.block_on(async {
            let res = self.send(Method::GET, path, None, &[], accept).await?;
            let status = res.status();
            let mut body = res.into_body();
            if !status.is_success() {
                let bytes = body.collect().await?.to_bytes();
                return decode::<serde_json::Value>(status, &bytes).map(|_| ());
            }
            while let Some(frame) = body.frame().await {
                let frame = frame.context("tined's stream broke off")?;
                if let Some(d) = frame.data_ref() {
                    sink(d)?;
                }
            }
            Ok(())
        })
    }

    /// Follows operation `id` (SSE), telling `progress` of each step,
    /// until it is done; its result, or its error.
    pub fn wait_operation(
        &self,
        id: &str,
        mut progress: impl FnMut(&OpProgress),
    ) -> anyhow::Result<serde_json::Value> {
        let mut buf = Vec::new();
        let mut done: Option<Operation> = None;
        self.stream(
            &format!("/v1/operations/{id}/events"),
            Some("text/event-stream"),
            |chunk| {
                buf.extend_from_slice(chunk);
                while let Some(end) = find(&buf, b"\n\n") {
                    let ev: Vec<u8> = buf.drain(..end + 2).collect();
                    let text = String::from_utf8_lossy(&ev);
                    let mut kind = "";
                    let mut data = String::new();
                    for line in text.lines() {
                        if let Some(k) = line.strip_prefix("event:") {
                            kind = k.trim();
                        } else if let Some(d) = line.strip_prefix("data:") {
                            data.push_str(d.trim_start());
                        }
                    }
                    match kind {
                        "progress" => {
                            if let Ok(p) = serde_json::from_str::<OpProgress>(&data) {
                                progress(&p);
                            }
                        }
                        "done" => done = serde_json::from_str(&data).ok(),
                        _ => {}
                    }
                }
                Ok(())
            },
        )?;
        // The stream may end before the last event reached us: ask.
        let op = match done {
            Some(op) => op,
            None => self.get::<Operation>(&format!("/v1/operations/{id}?wait=600"))?,
        };
        match (op.result, op.error) {
            (Some(v), _) => Ok(v),
            (None, Some(e)) => Err(e.into()),
            (None, None) => bail!("operation {id} ended without a result"),
        }
    }

    /// Starts a long operation (202) and follows it to its result.
    pub fn operation<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &impl Serialize,
        progress: impl FnMut(&OpProgress),
    ) -> anyhow::Result<T> {
        let op: Operation = self.post(path, body)?;
        let v = self.wait_operation(&op.id, progress)?;
        serde_json::from_value(v).context("tined's report is not what this tine expects")
    }

    /// `attach`: an HTTP upgrade after which the connection speaks the
    /// agent's protocol to vm `name` (its Hello done by tined). Written
    /// out by hand because it needs a blocking stream, which is what the
    /// protocol's client takes.
    pub fn attach(&self, name: &str) -> anyhow::Result<UnixStream> {
        let mut s = UnixStream::connect(&self.sock)
            .with_context(|| format!("cannot reach tined at {}", self.sock.display()))?;
        write!(
            s,
            "POST /v1/vms/{name}/attach HTTP/1.1\r\nhost: tined\r\nconnection: upgrade\r\nupgrade: tine-agent\r\ncontent-length: 0\r\n\r\n"
        )?;
        let mut r = BufReader::new(s.try_clone()?);
        let mut status = String::new();
        r.read_line(&mut status)?;
        let code: u16 = status
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .with_context(|| format!("tined sent a bad status line {status:?}"))?;
        let mut len = 0usize;
        loop {
            let mut line = String::new();
            r.read_line(&mut line)?;
            if line == "\r\n" || line.is_empty() {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
        if code != 101 {
            let mut body = vec![0u8; len.min(1 << 20)];
            std::io::Read::read_exact(&mut r, &mut body)?;
            let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            decode::<serde_json::Value>(status, &body)?;
            bail!("tined answered {code} to attach");
        }
        // Nothing is buffered past the headers: the agent speaks only
        // when spoken to.
        Ok(s)
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A successful answer parsed, or the error tined sent.
fn decode<T: DeserializeOwned>(status: StatusCode, bytes: &[u8]) -> anyhow::Result<T> {
    if !status.is_success() {
        return match serde_json::from_slice::<ApiError>(bytes) {
            Ok(e) => Err(e.into()),
            Err(_) => bail!(
                "tined answered {status}: {}",
                String::from_utf8_lossy(bytes).trim()
            ),
        };
    }
    let bytes: &[u8] = if bytes.is_empty() { b"null" } else { bytes };
    serde_json::from_slice(bytes).with_context(|| {
        format!(
            "tined's answer is not what this tine expects: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        )
    })
}

/// An operation as tined shows it (the part the CLI reads).
#[derive(Debug, Deserialize)]
pub struct Operation {
    pub id: String,
    pub result: Option<serde_json::Value>,
    pub error: Option<ApiError>,
}

/// An operation's progress.
#[derive(Debug, Deserialize)]
pub struct OpProgress {
    pub what: String,
    pub done: u64,
    pub total: u64,
}

/// The tined binary beside this one (or `TINED_BIN`) and its build id,
/// as tined computes it for itself.
fn expected_build() -> anyhow::Result<(PathBuf, String)> {
    let path = match std::env::var_os("TINED_BIN") {
        Some(p) => PathBuf::from(p),
        None => std::env::current_exe()?
            .parent()
            .map(|d| d.join("tined"))
            .context("cannot find the tine executable's directory")?,
    };
    let path = std::fs::canonicalize(&path).with_context(|| {
        format!(
            "{} not found: build the workspace (cargo build --workspace) or set TINED_BIN",
            path.display()
        )
    })?;
    let meta = std::fs::metadata(&path)?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let id = format!("{}:{}:{mtime}", path.display(), meta.len());
    Ok((path, id))
}
