//! Work inside a vm through its agent: exec (buffered JSON, or streamed as
//! NDJSON lines as the output comes), file download and upload, the
//! console, and `attach`: an HTTP upgrade after which the connection *is*
//! the agent's protocol (crates/protocol), for the CLI's `exec` and `cp`
//! with stdin and stdout passed through as they come.

use std::io::Write;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use futures::StreamExt;
use serde::{Deserialize, Serialize};

use crate::error::{ApiError, ApiResult, ErrorBody};
use crate::state::{blocking, JsonBody, Shared};

/// A command to run in the guest.
#[derive(Clone, Debug, Deserialize, Serialize, utoipa::ToSchema)]
pub struct ExecSpec {
    /// The command and its arguments.
    pub argv: Vec<String>,
    /// Environment added for it.
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
    /// Working directory in the guest.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Kill it (its whole process group) after this many seconds.
    #[serde(default)]
    pub timeout_s: Option<f64>,
    /// Its stdin, base64 (closed after; none: empty).
    #[serde(default)]
    pub stdin_b64: Option<String>,
    /// Its stdin stays open for `POST .../processes/{pid}/stdin` (instead
    /// of `stdin_b64`).
    #[serde(default)]
    pub open_stdin: bool,
    /// The command is the guest agent's, not this request's: it runs on
    /// when the client leaves, the vm sleeps or forks (each copy has it),
    /// and `GET .../processes/{pid}/output` follows it again. The
    /// streamed form then starts with a `started` event carrying its pid.
    #[serde(default)]
    pub keep: bool,
    /// A name for it, unique among the vm's running commands.
    #[serde(default)]
    pub tag: Option<String>,
    /// The guest user it runs as (default root); its home is the default
    /// working directory.
    #[serde(default)]
    pub user: Option<String>,
}

/// How a command ended, with its output (the buffered form).
#[derive(Clone, Debug, Deserialize, Serialize, utoipa::ToSchema)]
pub struct ExecResult {
    /// The exit code, or 128 + the signal.
    pub exit_code: i32,
    pub signal: Option<i32>,
    pub timed_out: bool,
    /// Output as UTF-8 (invalid bytes replaced); `*_b64` hold the bytes.
    pub stdout: String,
    pub stderr: String,
    pub stdout_b64: String,
    pub stderr_b64: String,
}

/// One line of the streamed form (`Accept: application/x-ndjson`).
#[derive(Clone, Debug, Deserialize, Serialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExecEvent {
    /// The command's pid in the guest (first, for kept commands and
    /// followed ones).
    Started {
        pid: u32,
    },
    Stdout {
        data_b64: String,
    },
    Stderr {
        data_b64: String,
    },
    Exit {
        exit_code: i32,
        signal: Option<i32>,
        timed_out: bool,
    },
    Error {
        error: ErrorBody,
    },
}

fn request(spec: &ExecSpec) -> ApiResult<(protocol::client::ExecRequest, Option<Vec<u8>>)> {
    if spec.argv.is_empty() {
        return Err(ApiError::invalid("argv is empty: say what to run"));
    }
    if spec.open_stdin && spec.stdin_b64.is_some() {
        return Err(ApiError::invalid(
            "give either stdin_b64 (the whole input) or open_stdin (input later), not both",
        ));
    }
    let timeout = match spec.timeout_s {
        Some(t) if t > 0.0 && t.is_finite() && t < 1e7 => Some(Duration::from_secs_f64(t)),
        Some(t) => {
            return Err(ApiError::invalid(format!(
                "timeout_s {t} must be a positive number of seconds"
            )))
        }
        None => None,
    };
    let stdin = match &spec.stdin_b64 {
        Some(b) => Some(
            base64::engine::general_purpose::STANDARD
                .decode(b.as_bytes())
                .map_err(|e| ApiError::invalid(format!("stdin_b64 is not base64: {e}")))?,
        ),
        // A command with no input reads EOF, unless its stdin stays open.
        None => (!spec.open_stdin).then(Vec::new),
    };
    Ok((
        protocol::client::ExecRequest {
            argv: spec.argv.clone(),
            env: spec
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            cwd: spec.cwd.clone(),
            timeout,
            keep: spec.keep,
            tag: spec.tag.clone(),
            user: spec.user.clone(),
            open_stdin: spec.open_stdin,
        },
        stdin,
    ))
}

/// Output going to a channel, chunk by chunk (the streamed form).
struct ChanWriter {
    tx: tokio::sync::mpsc::Sender<ExecEvent>,
    stderr: bool,
}

impl Write for ChanWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let data_b64 = base64::engine::general_purpose::STANDARD.encode(buf);
        let ev = if self.stderr {
            ExecEvent::Stderr { data_b64 }
        } else {
            ExecEvent::Stdout { data_b64 }
        };
        self.tx
            .blocking_send(ev)
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "client gone"))?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn chan_writers(tx: &tokio::sync::mpsc::Sender<ExecEvent>) -> (ChanWriter, ChanWriter) {
    let w = |stderr| ChanWriter {
        tx: tx.clone(),
        stderr,
    };
    (w(false), w(true))
}

/// The last event of a command's stream: its exit, or what failed.
fn last_event(
    res: Result<protocol::ExitInfo, protocol::client::ClientError>,
    what: String,
) -> ExecEvent {
    match res {
        Ok(info) => ExecEvent::Exit {
            exit_code: info.exit_code(),
            signal: info.signal,
            timed_out: info.timed_out,
        },
        Err(e) => ExecEvent::Error {
            error: ErrorBody {
                code: "failed".into(),
                message: format!("{what} failed: {e}"),
            },
        },
    }
}

/// Runs a command and sends its output as events as it comes, the exit
/// (or the failure) last: the streamed exec, and E2B's Process.Start.
pub(crate) async fn exec_events(
    s: &Shared,
    name: String,
    spec: &ExecSpec,
) -> ApiResult<tokio::sync::mpsc::Receiver<ExecEvent>> {
    let (req, stdin) = request(spec)?;
    let st = s.clone();
    let n = name.clone();
    let conn = blocking(move || host::exec::connect(&st.host, &n)).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<ExecEvent>(64);
    let announce = req.keep;
    tokio::task::spawn_blocking(move || {
        let mut conn = conn;
        let (out, err) = chan_writers(&tx);
        let started = tx.clone();
        let on_start = move |pid| {
            if announce {
                let _ = started.blocking_send(ExecEvent::Started { pid });
            }
        };
        let res = protocol::client::exec_with(
            &mut conn,
            req,
            stdin.map(std::io::Cursor::new),
            on_start,
            out,
            err,
        );
        let _ = tx.blocking_send(last_event(res, format!("exec in vm {name:?}")));
    });
    Ok(rx)
}

/// Follows a running command: `started`, its output from now on, and its
/// exit, as events (GET .../processes/{pid}/output, E2B's Process.Connect).
pub(crate) async fn follow_events(
    s: &Shared,
    name: String,
    process: protocol::ProcessRef,
) -> ApiResult<tokio::sync::mpsc::Receiver<ExecEvent>> {
    let st = s.clone();
    let n = name.clone();
    let mut conn = blocking(move || host::exec::connect(&st.host, &n)).await?;
    // The first answer says whether there is such a command: an error
    // before it is the request's, not the stream's.
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<Result<u32, host::Error>>();
    let (tx, rx) = tokio::sync::mpsc::channel::<ExecEvent>(64);
    tokio::task::spawn_blocking(move || {
        let (out, err) = chan_writers(&tx);
        let mut first = Some(first_tx);
        let started = tx.clone();
        let on_start = |pid| {
            if let Some(f) = first.take() {
                let _ = f.send(Ok(pid));
            }
            let _ = started.blocking_send(ExecEvent::Started { pid });
        };
        let what = format!("following {process} in vm {name:?}");
        let res = protocol::client::attach(&mut conn, process.clone(), on_start, out, err);
        match (res, first.take()) {
            (Err(e), Some(f)) => {
                let _ = f.send(Err(process_error(&name, &process, e)));
            }
            (res, _) => {
                let _ = tx.blocking_send(last_event(res, what));
            }
        }
    });
    match first_rx.await {
        Ok(Ok(_)) => Ok(rx),
        Ok(Err(e)) => Err(ApiError::from(e)),
        Err(_) => Err(ApiError::internal("the follower ended before it started")),
    }
}

/// The agent's answer about a running command, as the API's error.
fn process_error(
    name: &str,
    process: &protocol::ProcessRef,
    e: protocol::client::ClientError,
) -> host::Error {
    use protocol::{client::ClientError, ErrorKind};
    match e {
        ClientError::Agent {
            kind: ErrorKind::NotFound,
            message,
        } => host::Error::not_found(format!("vm {name:?}: {message}")),
        ClientError::Agent {
            kind: ErrorKind::BadRequest | ErrorKind::Io,
            message,
        } => host::Error::invalid(format!("vm {name:?}: {message}")),
        e => host::Error::failed(format!("vm {name:?}, {process}: {e}")),
    }
}

/// NDJSON lines of a command's events.
fn ndjson(rx: tokio::sync::mpsc::Receiver<ExecEvent>) -> Response {
    let body = tokio_stream::wrappers::ReceiverStream::new(rx).map(|ev| {
        let mut line = serde_json::to_vec(&ev).unwrap_or_default();
        line.push(b'\n');
        Ok::<_, std::convert::Infallible>(Bytes::from(line))
    });
    (
        [(axum::http::header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(body),
    )
        .into_response()
}

/// The guest pid of a path segment.
fn pid_of(pid: &str) -> ApiResult<protocol::ProcessRef> {
    pid.parse::<u32>()
        .ok()
        .filter(|p| *p > 0)
        .map(protocol::ProcessRef::Pid)
        .ok_or_else(|| ApiError::invalid(format!("{pid:?} is not a guest pid")))
}

#[utoipa::path(get, path = "/v1/vms/{name}/processes", tag = "agent",
    params(("name" = String, Path)),
    responses((status = 200, body = Vec<protocol::ProcessInfo>), (status = 409, body = ErrorBody)))]
pub async fn list_processes(
    State(s): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<Vec<protocol::ProcessInfo>>> {
    let st = s.clone();
    let list = blocking(move || {
        let mut conn = host::exec::connect(&st.host, &name)?;
        protocol::client::list_processes(&mut conn)
            .map_err(|e| host::Error::failed(format!("cannot list the commands of {name:?}: {e}")))
    })
    .await?;
    Ok(Json(list))
}

#[utoipa::path(get, path = "/v1/vms/{name}/processes/{pid}/output", tag = "agent",
    params(("name" = String, Path), ("pid" = u32, Path)),
    responses((status = 200, description = "NDJSON ExecEvents: started, output from now on, exit"),
        (status = 404, body = ErrorBody)))]
pub async fn process_output(
    State(s): State<Shared>,
    Path((name, pid)): Path<(String, String)>,
) -> ApiResult<Response> {
    let rx = follow_events(&s, name, pid_of(&pid)?).await?;
    Ok(ndjson(rx))
}

/// A signal for a running command.
#[derive(Deserialize, Serialize, utoipa::ToSchema)]
pub struct SignalSpec {
    /// A number (9) or a name (`KILL`, `SIGTERM`).
    pub signal: serde_json::Value,
}

/// A signal's number from its number or name.
pub(crate) fn signal_number(v: &serde_json::Value) -> ApiResult<i32> {
    const NAMES: [(&str, i32); 10] = [
        ("HUP", 1),
        ("INT", 2),
        ("QUIT", 3),
        ("KILL", 9),
        ("USR1", 10),
        ("USR2", 12),
        ("TERM", 15),
        ("CONT", 18),
        ("STOP", 19),
        ("TSTP", 20),
    ];
    let n = match v {
        serde_json::Value::Number(n) => n.as_i64().and_then(|n| i32::try_from(n).ok()),
        serde_json::Value::String(s) => {
            let name = s.trim_start_matches("SIG");
            NAMES.iter().find(|(n, _)| *n == name).map(|(_, v)| *v)
        }
        _ => None,
    };
    n.filter(|n| (1..=64).contains(n)).ok_or_else(|| {
        ApiError::invalid(format!(
            "signal {v} is not a signal number (1-64) or name (TERM, KILL, INT, HUP, ...)"
        ))
    })
}

/// Whether a signal reached a running command.
#[derive(Serialize, utoipa::ToSchema)]
pub struct Signalled {
    /// False when the command had just ended.
    pub delivered: bool,
}

#[utoipa::path(post, path = "/v1/vms/{name}/processes/{pid}/signal", tag = "agent",
    request_body = SignalSpec, params(("name" = String, Path), ("pid" = u32, Path)),
    responses((status = 200, body = Signalled), (status = 404, body = ErrorBody)))]
pub async fn signal_process(
    State(s): State<Shared>,
    Path((name, pid)): Path<(String, String)>,
    JsonBody(spec): JsonBody<SignalSpec>,
) -> ApiResult<Json<Signalled>> {
    let process = pid_of(&pid)?;
    let sig = signal_number(&spec.signal)?;
    let delivered = signal_in(&s, name, process, sig).await?;
    Ok(Json(Signalled { delivered }))
}

/// Sends a signal to a running command of a vm.
pub(crate) async fn signal_in(
    s: &Shared,
    name: String,
    process: protocol::ProcessRef,
    sig: i32,
) -> ApiResult<bool> {
    let st = s.clone();
    blocking(move || {
        let mut conn = host::exec::connect(&st.host, &name)?;
        protocol::client::signal(&mut conn, process.clone(), sig)
            .map_err(|e| process_error(&name, &process, e))
    })
    .await
}

/// Writes to a running command's stdin.
pub(crate) async fn input_to(
    s: &Shared,
    name: String,
    process: protocol::ProcessRef,
    data: Bytes,
    close: bool,
) -> ApiResult<()> {
    let st = s.clone();
    blocking(move || {
        let mut conn = host::exec::connect(&st.host, &name)?;
        protocol::client::input(&mut conn, process.clone(), &data, close)
            .map_err(|e| process_error(&name, &process, e))
    })
    .await
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StdinQuery {
    /// Close the command's stdin after this input (EOF).
    #[serde(default)]
    pub close: bool,
}

#[utoipa::path(post, path = "/v1/vms/{name}/processes/{pid}/stdin", tag = "agent",
    params(("name" = String, Path), ("pid" = u32, Path), StdinQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 204, description = "Written"), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub async fn process_stdin(
    State(s): State<Shared>,
    Path((name, pid)): Path<(String, String)>,
    Query(q): Query<StdinQuery>,
    req: Request,
) -> ApiResult<StatusCode> {
    let process = pid_of(&pid)?;
    let body = crate::state::read_limited(req, &(), MAX_UPLOAD).await?;
    input_to(&s, name, process, body, q.close).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[utoipa::path(post, path = "/v1/vms/{name}/exec", tag = "agent", request_body = ExecSpec,
    params(("name" = String, Path)),
    responses((status = 200, body = ExecResult,
        description = "Buffered; with `Accept: application/x-ndjson` one ExecEvent per line as output comes"),
        (status = 409, body = ErrorBody)))]
pub async fn exec(
    State(s): State<Shared>,
    Path(name): Path<String>,
    headers: HeaderMap,
    JsonBody(spec): JsonBody<ExecSpec>,
) -> ApiResult<Response> {
    let streamed = headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/x-ndjson"));
    if streamed {
        let rx = exec_events(&s, name, &spec).await?;
        return Ok(ndjson(rx));
    }
    let (req, stdin) = request(&spec)?;
    let st = s.clone();
    let conn = blocking(move || host::exec::connect(&st.host, &name)).await?;
    let res = tokio::task::spawn_blocking(move || {
        let mut conn = conn;
        let mut out = Vec::new();
        let mut err = Vec::new();
        let info = protocol::client::exec(
            &mut conn,
            req,
            stdin.map(std::io::Cursor::new),
            &mut out,
            &mut err,
        );
        info.map(|i| (i, out, err))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?;
    let (info, out, err) =
        res.map_err(|e| ApiError::from(host::Error::from(e).context("exec failed")))?;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    Ok(Json(ExecResult {
        exit_code: info.exit_code(),
        signal: info.signal,
        timed_out: info.timed_out,
        stdout: String::from_utf8_lossy(&out).into_owned(),
        stderr: String::from_utf8_lossy(&err).into_owned(),
        stdout_b64: b64(&out),
        stderr_b64: b64(&err),
    })
    .into_response())
}

/// The upgrade protocol `attach` speaks.
pub const ATTACH_PROTOCOL: &str = "tine-agent";

#[utoipa::path(post, path = "/v1/vms/{name}/attach", tag = "agent",
    params(("name" = String, Path)),
    responses((status = 101, description = "Upgrade: tine-agent; the connection speaks the agent protocol (Hello done)"),
        (status = 409, body = ErrorBody)))]
pub async fn attach(
    State(s): State<Shared>,
    Path(name): Path<String>,
    req: Request,
) -> ApiResult<Response> {
    let wants = req
        .headers()
        .get(axum::http::header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(ATTACH_PROTOCOL));
    if !wants {
        return Err(ApiError::invalid(format!(
            "attach needs `Connection: upgrade` and `Upgrade: {ATTACH_PROTOCOL}`"
        )));
    }
    let st = s.clone();
    let conn = blocking(move || host::exec::connect(&st.host, &name)).await?;
    conn.set_nonblocking(true)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let agent =
        tokio::net::UnixStream::from_std(conn).map_err(|e| ApiError::internal(e.to_string()))?;
    tokio::spawn(async move {
        match hyper::upgrade::on(req).await {
            Ok(up) => {
                let up = hyper_util::rt::TokioIo::new(up);
                relay(up, agent).await;
            }
            Err(e) => tracing::warn!("attach: the upgrade failed: {e}"),
        }
    });
    Ok((
        StatusCode::SWITCHING_PROTOCOLS,
        [
            (axum::http::header::CONNECTION, "upgrade"),
            (axum::http::header::UPGRADE, ATTACH_PROTOCOL),
        ],
    )
        .into_response())
}

/// Copies both ways between the client and the agent until each side has
/// ended, each direction on its own: the agent's answer is written to the
/// client in full, and then its write side is shut, whatever the other
/// direction met. (`copy_bidirectional` returns at the first error of
/// either direction and drops both ends, so a client whose write toward
/// the agent failed, e.g. EPIPE once the VMM closed its end, could lose
/// the end of the agent's answer: `tine exec` then saw the connection
/// closed before the command's exit.)
async fn relay<C>(client: C, agent: tokio::net::UnixStream)
where
    C: tokio::io::AsyncRead + tokio::io::AsyncWrite,
{
    use tokio::io::AsyncWriteExt;
    let (mut cr, mut cw) = tokio::io::split(client);
    let (mut ar, mut aw) = agent.into_split();
    let to_client = async {
        let r = tokio::io::copy(&mut ar, &mut cw).await;
        let _ = cw.shutdown().await;
        r
    };
    let to_agent = async {
        let r = tokio::io::copy(&mut cr, &mut aw).await;
        let _ = aw.shutdown().await;
        r
    };
    let (down, up) = tokio::join!(to_client, to_agent);
    // The VMM closes its end as soon as the guest shuts the connection,
    // so a reset here is common and harmless: what was read was written.
    if let Err(e) = &down {
        tracing::debug!("attach: the agent's side ended with {e}");
    }
    if let Err(e) = &up {
        tracing::debug!("attach: the client's input to the agent ended: {e}");
    }
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct FileQuery {
    /// Absolute path in the guest.
    pub path: String,
    /// Permission bits for an upload (octal text, default 644).
    #[serde(default)]
    pub mode: Option<String>,
}

fn guest_path(p: &str) -> ApiResult<()> {
    if !p.starts_with('/') || p.contains('\0') || p.split('/').any(|c| c == "..") {
        return Err(ApiError::invalid(format!(
            "{p:?} is not an absolute guest path without `..`"
        )));
    }
    Ok(())
}

#[utoipa::path(get, path = "/v1/vms/{name}/files", tag = "agent",
    params(("name" = String, Path), FileQuery),
    responses((status = 200, description = "The file's bytes", content_type = "application/octet-stream"),
        (status = 404, body = ErrorBody)))]
pub async fn read_file(
    State(s): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<FileQuery>,
) -> ApiResult<Response> {
    guest_path(&q.path)?;
    let st = s.clone();
    let path = q.path.clone();
    let (info, bytes) = blocking(move || {
        let mut conn = host::exec::connect(&st.host, &name)?;
        let mut out = Vec::new();
        let info = protocol::client::read_file(&mut conn, &path, &mut out)
            .map_err(|e| host::Error::not_found(format!("cannot read {name}:{path}: {e}")))?;
        Ok((info, out))
    })
    .await?;
    Ok((
        [
            (
                axum::http::header::CONTENT_TYPE,
                "application/octet-stream".to_string(),
            ),
            (
                axum::http::HeaderName::from_static("x-file-mode"),
                format!("{:o}", info.mode),
            ),
        ],
        bytes,
    )
        .into_response())
}

/// A path and how deep to list under it.
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ListQuery {
    /// Absolute path in the guest.
    pub path: String,
    /// Levels below `path` (1: its children; at most 32).
    #[serde(default)]
    pub depth: Option<u32>,
}

/// What a Remove or MakeDir changed.
#[derive(Serialize, utoipa::ToSchema)]
pub struct FsChange {
    pub path: String,
    /// False when there was nothing to do (the path was absent, or the
    /// directory existed).
    pub changed: bool,
}

/// The agent's answer to a file operation, as the API's error: a missing
/// path is 404, one the guest refuses (permission, not a directory) 400.
fn fs_error(name: &str, path: &str, e: protocol::client::ClientError) -> host::Error {
    use protocol::{client::ClientError, ErrorKind};
    match e {
        ClientError::Agent {
            kind: ErrorKind::NotFound,
            message,
        } => host::Error::not_found(format!("{name}:{path}: {message}")),
        ClientError::Agent {
            kind: ErrorKind::Permission | ErrorKind::BadRequest | ErrorKind::Io,
            message,
        } => host::Error::invalid(format!("{name}:{path}: {message}")),
        e => host::Error::failed(format!("{name}:{path}: {e}")),
    }
}

/// Runs one file operation on a fresh agent connection.
async fn fs_op<T: Send + 'static>(
    s: &Shared,
    name: String,
    path: String,
    op: impl FnOnce(
            &mut std::os::unix::net::UnixStream,
            &str,
        ) -> Result<T, protocol::client::ClientError>
        + Send
        + 'static,
) -> ApiResult<T> {
    guest_path(&path)?;
    let st = s.clone();
    blocking(move || {
        let mut conn = host::exec::connect(&st.host, &name)?;
        op(&mut conn, &path).map_err(|e| fs_error(&name, &path, e))
    })
    .await
}

#[utoipa::path(get, path = "/v1/vms/{name}/files/stat", tag = "agent",
    params(("name" = String, Path), ListQuery),
    responses((status = 200, body = protocol::Entry), (status = 404, body = ErrorBody)))]
pub async fn stat_file(
    State(s): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<ListQuery>,
) -> ApiResult<Json<protocol::Entry>> {
    let e = fs_op(&s, name, q.path, protocol::client::stat).await?;
    Ok(Json(e))
}

#[utoipa::path(get, path = "/v1/vms/{name}/files/list", tag = "agent",
    params(("name" = String, Path), ListQuery),
    responses((status = 200, body = Vec<protocol::Entry>), (status = 404, body = ErrorBody)))]
pub async fn list_files(
    State(s): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<ListQuery>,
) -> ApiResult<Json<Vec<protocol::Entry>>> {
    let depth = q.depth.unwrap_or(1);
    if !(1..=32).contains(&depth) {
        return Err(ApiError::invalid(format!(
            "depth {depth} is not between 1 and 32"
        )));
    }
    let e = fs_op(&s, name, q.path, move |c, p| {
        protocol::client::list_dir(c, p, depth)
    })
    .await?;
    Ok(Json(e))
}

#[utoipa::path(delete, path = "/v1/vms/{name}/files", tag = "agent",
    params(("name" = String, Path), ListQuery),
    responses((status = 200, body = FsChange), (status = 400, body = ErrorBody)))]
pub async fn remove_file(
    State(s): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<ListQuery>,
) -> ApiResult<Json<FsChange>> {
    if q.path.trim_end_matches('/').is_empty() {
        return Err(ApiError::invalid("refusing to remove the guest's /"));
    }
    let path = q.path.clone();
    let changed = fs_op(&s, name, q.path, protocol::client::remove).await?;
    Ok(Json(FsChange { path, changed }))
}

#[utoipa::path(post, path = "/v1/vms/{name}/files/dir", tag = "agent",
    params(("name" = String, Path), ListQuery),
    responses((status = 200, body = FsChange), (status = 400, body = ErrorBody)))]
pub async fn make_dir(
    State(s): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<ListQuery>,
) -> ApiResult<Json<FsChange>> {
    let path = q.path.clone();
    let changed = fs_op(&s, name, q.path, protocol::client::make_dir).await?;
    Ok(Json(FsChange { path, changed }))
}

/// A move inside the guest.
#[derive(Deserialize, Serialize, utoipa::ToSchema)]
pub struct MoveSpec {
    /// Absolute guest path that exists.
    pub from: String,
    /// Absolute guest path it becomes (its missing parents are made).
    pub to: String,
}

#[utoipa::path(post, path = "/v1/vms/{name}/files/move", tag = "agent",
    request_body = MoveSpec, params(("name" = String, Path)),
    responses((status = 200, body = protocol::Entry, description = "The moved path"),
        (status = 404, body = ErrorBody)))]
pub async fn move_file(
    State(s): State<Shared>,
    Path(name): Path<String>,
    JsonBody(spec): JsonBody<MoveSpec>,
) -> ApiResult<Json<protocol::Entry>> {
    guest_path(&spec.to)?;
    let to = spec.to.clone();
    fs_op(&s, name.clone(), spec.from, move |c, from| {
        protocol::client::rename(c, from, &to)
    })
    .await?;
    // One request per agent connection: the new path's entry is a second.
    let e = fs_op(&s, name, spec.to, protocol::client::stat).await?;
    Ok(Json(e))
}

/// Largest upload accepted in one request.
const MAX_UPLOAD: usize = 1 << 30;

#[utoipa::path(put, path = "/v1/vms/{name}/files", tag = "agent",
    params(("name" = String, Path), FileQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses((status = 204, description = "Written"), (status = 400, body = ErrorBody)))]
pub async fn write_file(
    State(s): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<FileQuery>,
    req: Request,
) -> ApiResult<StatusCode> {
    guest_path(&q.path)?;
    let mode = match &q.mode {
        Some(m) => u32::from_str_radix(m, 8)
            .ok()
            .filter(|m| *m <= 0o7777)
            .ok_or_else(|| ApiError::invalid(format!("mode {m:?} is not octal permission bits")))?,
        None => 0o644,
    };
    let body = crate::state::read_limited(req, &(), MAX_UPLOAD).await?;
    let st = s.clone();
    let path = q.path.clone();
    blocking(move || {
        let mut conn = host::exec::connect(&st.host, &name)?;
        protocol::client::write_file(&mut conn, &path, mode, &body[..])
            .map_err(|e| host::Error::failed(format!("cannot write {name}:{path}: {e}")))?;
        Ok(())
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, utoipa::IntoParams)]
pub struct ConsoleQuery {
    /// Keep sending new output until the vm ends.
    #[serde(default)]
    pub follow: bool,
}

#[utoipa::path(get, path = "/v1/vms/{name}/console", tag = "vms",
    params(("name" = String, Path), ConsoleQuery),
    responses((status = 200, description = "The console log (streamed with follow)", content_type = "text/plain")))]
pub async fn console(
    State(s): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<ConsoleQuery>,
) -> ApiResult<Response> {
    let st = s.clone();
    let n = name.clone();
    let (path, _) = blocking(move || host::vm::console_log(&st.host, &n)).await?;
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
    let st = s.clone();
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let Ok(mut f) = std::fs::File::open(&path) else {
            return;
        };
        // Watched before the first read, so nothing written after it is missed.
        let changes = q.follow.then(|| Changes::watch(&path));
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match f.read(&mut buf) {
                Ok(0) | Err(_) => {
                    let running = host::vm::console_log(&st.host, &name)
                        .map(|(_, r)| r)
                        .unwrap_or(false);
                    // The VMM emptied the log at its cap (its content
                    // moved to console.log.1): go on from its start.
                    if q.follow && shrank(&mut f) {
                        use std::io::Seek;
                        if f.seek(std::io::SeekFrom::Start(0)).is_err() {
                            return;
                        }
                        continue;
                    }
                    if !q.follow || !running || tx.is_closed() {
                        // One more read catches what was written just before the end.
                        if let Ok(n) = f.read(&mut buf) {
                            let _ = tx.blocking_send(Bytes::copy_from_slice(&buf[..n]));
                        }
                        return;
                    }
                    // Until the VMM writes to the log (or, to notice the vm
                    // ending and the client leaving, 100 ms).
                    match &changes {
                        Some(c) => c.wait(Duration::from_millis(100)),
                        None => std::thread::sleep(Duration::from_millis(100)),
                    }
                }
                Ok(n) => {
                    if tx.blocking_send(Bytes::copy_from_slice(&buf[..n])).is_err() {
                        return;
                    }
                }
            }
        }
    });
    let body =
        tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok::<_, std::convert::Infallible>);
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; charset=utf-8",
        )],
        Body::from_stream(body),
    )
        .into_response())
}

/// Whether `f` is now shorter than where its reader is (a log emptied at
/// its cap).
fn shrank(f: &mut std::fs::File) -> bool {
    use std::io::Seek;
    match (f.metadata(), f.stream_position()) {
        (Ok(m), Ok(pos)) => m.len() < pos,
        _ => false,
    }
}

/// Writes to a file, seen through inotify: a follower of a console log
/// wakes when the VMM writes, not at its next poll (polling every 100 ms
/// put ~50 ms into every console round trip; bench/api).
struct Changes(Option<std::os::fd::OwnedFd>);

/// How long a follower waits after a write before it reads.
const COALESCE: Duration = Duration::from_millis(2);

impl Changes {
    /// Watches `path` (without inotify: `wait` just sleeps).
    fn watch(path: &std::path::Path) -> Changes {
        use std::os::fd::FromRawFd;
        use std::os::unix::ffi::OsStrExt;
        let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
            return Changes(None);
        };
        // SAFETY: inotify_init1(2) takes flags and returns a new fd or -1.
        let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
        if fd < 0 {
            return Changes(None);
        }
        // SAFETY: `fd` is the new inotify fd, owned from here on.
        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
        // SAFETY: a valid inotify fd and a NUL-terminated path.
        let wd = unsafe {
            libc::inotify_add_watch(
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                c.as_ptr(),
                libc::IN_MODIFY | libc::IN_CLOSE_WRITE,
            )
        };
        Changes((wd >= 0).then_some(fd))
    }

    /// Returns when the file was written since the last call, or after `timeout`.
    fn wait(&self, timeout: Duration) {
        use std::os::fd::AsRawFd;
        let Some(fd) = &self.0 else {
            std::thread::sleep(timeout);
            return;
        };
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: polls one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, ms) } == 1 {
            // A guest writes its serial port a byte at a time: let a burst
            // (a line) arrive, so it goes out as one chunk, not a chunk
            // and a wake-up per byte.
            std::thread::sleep(COALESCE);
        }
        // Drain the events: what they say is only "read again".
        let mut buf = [0u8; 4096];
        loop {
            // SAFETY: reads into a buffer of its length from an fd we own.
            let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n <= 0 {
                break;
            }
        }
    }
}

#[derive(Deserialize, Serialize, utoipa::ToSchema)]
pub struct ConsoleLine {
    /// Typed into COM1, followed by a newline.
    pub line: String,
}

#[utoipa::path(post, path = "/v1/vms/{name}/console", tag = "vms", request_body = ConsoleLine,
    params(("name" = String, Path)),
    responses((status = 204, description = "Sent"), (status = 409, body = ErrorBody)))]
pub async fn console_send(
    State(s): State<Shared>,
    Path(name): Path<String>,
    JsonBody(l): JsonBody<ConsoleLine>,
) -> ApiResult<StatusCode> {
    let st = s.clone();
    blocking(move || host::vm::console_send(&st.host, &name, &l.line)).await?;
    Ok(StatusCode::NO_CONTENT)
}
