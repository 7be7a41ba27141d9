//! envd, E2B's in-guest daemon, served by tined: the sandbox is named by
//! the `E2b-Sandbox-Id` header, and each call is translated to the guest
//! agent's protocol. Commands are the agent's kept ones (they outlive the
//! request, a pause and a fork, as envd's do), followed again by pid or
//! tag; output nobody follows is dropped, as envd drops it.
//!
//! Errors: a sandbox that does not run answers 502 (REST) or
//! `unavailable` (RPC) with "... was not found", which the SDK turns into
//! its SandboxNotRunningException.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use super::connect::{self, Code, RpcError};
use super::{place, E2bError, Place};
use crate::agent_io::{ExecEvent, ExecSpec};
use crate::state::{blocking, Shared};

/// The sandbox a request is for: its id and default environment.
struct Target {
    id: String,
    env: BTreeMap<String, String>,
}

fn not_running(id: &str, why: &str) -> RpcError {
    RpcError(
        Code::Unavailable,
        format!("sandbox {id:?} was not found running ({why}); connect to it (or create it) first"),
    )
}

/// Resolves the sandbox of `headers`; a paused one with autoResume is
/// woken first.
async fn target(s: &Shared, headers: &HeaderMap) -> Result<Target, RpcError> {
    let id = headers
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .ok_or_else(|| {
            RpcError::invalid(
                "envd requests need the E2b-Sandbox-Id header (the e2b SDK sends it; set E2B_SANDBOX_URL to this tined)",
            )
        })?;
    let record = s.e2b.sandbox(&id);
    if let Some(r) = record.as_ref().filter(|r| r.auto_resume) {
        super::control::wake_if_paused(s, &id, r.timeout_s)
            .await
            .map_err(|E2bError(_, m)| {
                not_running(&id, &format!("its automatic resume failed: {m}"))
            })?;
    }
    Ok(Target {
        id,
        env: record.map(|r| r.env_vars).unwrap_or_default(),
    })
}

/// One of tined's errors on an envd path: a vm that is not there or does
/// not run is a sandbox not found.
fn rpc_error(id: &str, e: crate::error::ApiError) -> RpcError {
    let m = &e.body.message;
    match e.status {
        // The engine's words for a vm that is not there (a path or a
        // process the agent cannot find is a plain not_found).
        StatusCode::NOT_FOUND if m.starts_with("no vm named") => not_running(id, m),
        StatusCode::CONFLICT => not_running(id, m),
        _ if m.contains("cannot reach the agent of vm") => RpcError(Code::Unavailable, m.clone()),
        _ => RpcError::from(e),
    }
}

/// An RPC error as a REST answer (envd's /files and /health).
fn rest_error(e: RpcError) -> Response {
    let status = match e.0 {
        Code::Unavailable => StatusCode::BAD_GATEWAY,
        Code::InvalidArgument | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    E2bError(status, e.1).into_response()
}

/// The guest user a request names (`Authorization: Basic base64(user:)`,
/// as the SDK sends it), or envd's default, which here is root.
fn user_of(headers: &HeaderMap) -> String {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| {
            base64::engine::general_purpose::STANDARD
                .decode(b.trim())
                .ok()
        })
        .and_then(|b| String::from_utf8(b).ok())
        .and_then(|u| u.split(':').next().map(str::to_string))
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "root".into())
}

/// A guest path as the SDK gives it: absolute, or relative to the
/// user's home.
fn guest_path(p: Option<&str>, user: &str) -> Result<String, RpcError> {
    let p = p
        .filter(|p| !p.is_empty())
        .ok_or_else(|| RpcError::invalid("the path is missing"))?;
    Ok(if p.starts_with('/') {
        p.to_string()
    } else if user == "root" {
        format!("/root/{p}")
    } else {
        format!("/home/{user}/{p}")
    })
}

pub async fn health(State(s): State<Shared>, headers: HeaderMap) -> Response {
    let t = match target(&s, &headers).await {
        Ok(t) => t,
        Err(e) => return rest_error(e),
    };
    let st = s.clone();
    let id = t.id.clone();
    match blocking(move || Ok(place(&st.host, &id))).await {
        Ok(Place::Running) => StatusCode::NO_CONTENT.into_response(),
        Ok(Place::Paused) => rest_error(not_running(&t.id, "it is paused")),
        Ok(Place::Ended(why)) => rest_error(not_running(&t.id, &why)),
        Ok(Place::Gone) => rest_error(not_running(&t.id, "no such vm")),
        Err(e) => rest_error(RpcError::from(e)),
    }
}

#[derive(Deserialize)]
pub struct FileQuery {
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    username: Option<String>,
}

pub async fn download(
    State(s): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
) -> Response {
    let t = match target(&s, &headers).await {
        Ok(t) => t,
        Err(e) => return rest_error(e),
    };
    let user = q.username.clone().unwrap_or_else(|| user_of(&headers));
    let path = match guest_path(q.path.as_deref(), &user) {
        Ok(p) => p,
        Err(e) => return rest_error(e),
    };
    let q = Query(crate::agent_io::FileQuery { path, mode: None });
    match crate::agent_io::read_file(State(s), Path(t.id.clone()), q).await {
        Ok(r) => r,
        Err(e) => rest_error(rpc_error(&t.id, e)),
    }
}

/// An upload: the body itself (octet-stream) or multipart parts, each a file.
pub async fn upload(
    State(s): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
    req: Request,
) -> Response {
    let t = match target(&s, &headers).await {
        Ok(t) => t,
        Err(e) => return rest_error(e),
    };
    let user = q.username.clone().unwrap_or_else(|| user_of(&headers));
    match upload_files(&s, &t.id, &user, &q, req).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => rest_error(e),
    }
}

async fn upload_files(
    s: &Shared,
    id: &str,
    user: &str,
    q: &FileQuery,
    req: Request,
) -> Result<Value, RpcError> {
    let multipart = req
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.starts_with("multipart/form-data"));
    let mut files: Vec<(String, Bytes)> = Vec::new();
    if multipart {
        let mut mp = axum::extract::Multipart::from_request(req, &())
            .await
            .map_err(|e| RpcError::invalid(e.body_text()))?;
        while let Some(field) = mp
            .next_field()
            .await
            .map_err(|e| RpcError::invalid(e.body_text()))?
        {
            let fname = field.file_name().map(str::to_string);
            let data = field
                .bytes()
                .await
                .map_err(|e| RpcError::invalid(e.body_text()))?;
            let path = q.path.as_deref().or(fname.as_deref());
            files.push((guest_path(path, user)?, data));
        }
    } else {
        let data = crate::state::read_limited(req, &(), 1 << 30).await?;
        files.push((guest_path(q.path.as_deref(), user)?, data));
    }
    let mut out = Vec::new();
    for (path, data) in files {
        if let Some(parent) = std::path::Path::new(&path).parent() {
            let q = Query(crate::agent_io::ListQuery {
                path: parent.to_string_lossy().into_owned(),
                depth: None,
            });
            let _made = crate::agent_io::make_dir(State(s.clone()), Path(id.to_string()), q)
                .await
                .map_err(|e| rpc_error(id, e))?;
        }
        let q = Query(crate::agent_io::FileQuery {
            path: path.clone(),
            mode: None,
        });
        crate::agent_io::write_file(
            State(s.clone()),
            Path(id.to_string()),
            q,
            Request::new(Body::from(data)),
        )
        .await
        .map_err(|e| rpc_error(id, e))?;
        let name = path.rsplit('/').next().unwrap_or_default().to_string();
        out.push(json!({"name": name, "type": "file", "path": path}));
    }
    Ok(Value::Array(out))
}

/// A guest entry as envd's EntryInfo (proto3 JSON).
fn entry_info(e: &protocol::Entry) -> Value {
    let kind = match e.kind {
        protocol::EntryKind::File => "FILE_TYPE_FILE",
        protocol::EntryKind::Dir => "FILE_TYPE_DIRECTORY",
        protocol::EntryKind::Symlink => "FILE_TYPE_SYMLINK",
        protocol::EntryKind::Other => "FILE_TYPE_UNSPECIFIED",
    };
    json!({
        "name": e.name,
        "type": kind,
        "path": e.path,
        "size": e.size.to_string(),
        "mode": e.mode,
        "permissions": perms(e.mode, e.kind),
        "owner": e.owner,
        "group": e.group,
        "modifiedTime": super::rfc3339(e.mtime_ms),
        "symlinkTarget": e.target,
    })
}

/// `drwxr-xr-x`, as envd writes permissions.
fn perms(mode: u32, kind: protocol::EntryKind) -> String {
    let mut s = String::from(match kind {
        protocol::EntryKind::Dir => "d",
        protocol::EntryKind::Symlink => "l",
        _ => "-",
    });
    for shift in [6, 3, 0] {
        let b = (mode >> shift) & 7;
        s.push(if b & 4 != 0 { 'r' } else { '-' });
        s.push(if b & 2 != 0 { 'w' } else { '-' });
        s.push(if b & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// filesystem.Filesystem's unary RPCs.
pub async fn filesystem(
    State(s): State<Shared>,
    headers: HeaderMap,
    Path(method): Path<String>,
    body: Bytes,
) -> Response {
    match filesystem_call(&s, &headers, &method, &body).await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn filesystem_call(
    s: &Shared,
    headers: &HeaderMap,
    method: &str,
    body: &[u8],
) -> Result<Value, RpcError> {
    use crate::agent_io::{list_files, make_dir, move_file, remove_file, stat_file, ListQuery};
    if matches!(
        method,
        "WatchDir" | "CreateWatcher" | "GetWatcherEvents" | "RemoveWatcher"
    ) {
        return Err(RpcError::unimplemented(
            "watching directories (files.watch_dir)",
        ));
    }
    if !matches!(method, "Stat" | "ListDir" | "MakeDir" | "Remove" | "Move") {
        return Err(RpcError::unimplemented(&format!(
            "filesystem.Filesystem/{method}"
        )));
    }
    let req = connect::unary_request(body)?;
    let t = target(s, headers).await?;
    let user = user_of(headers);
    let n = || Path(t.id.clone());
    let q = |path: String, depth| Query(ListQuery { path, depth });
    let err = |e| rpc_error(&t.id, e);
    let st = || State(s.clone());
    Ok(match method {
        "Move" => {
            let from = guest_path(req["source"].as_str(), &user)?;
            let to = guest_path(req["destination"].as_str(), &user)?;
            let spec = crate::agent_io::MoveSpec { from, to };
            let e = move_file(st(), n(), crate::state::JsonBody(spec))
                .await
                .map_err(err)?;
            json!({"entry": entry_info(&e.0)})
        }
        _ => {
            let path = guest_path(req["path"].as_str(), &user)?;
            match method {
                "Stat" => {
                    let e = stat_file(st(), n(), q(path, None)).await.map_err(err)?;
                    json!({"entry": entry_info(&e.0)})
                }
                "ListDir" => {
                    let depth = req["depth"].as_u64().map(|d| d.clamp(1, 32) as u32);
                    let es = list_files(st(), n(), q(path, depth)).await.map_err(err)?;
                    json!({"entries": es.0.iter().map(entry_info).collect::<Vec<_>>()})
                }
                "MakeDir" => {
                    let c = make_dir(st(), n(), q(path.clone(), None))
                        .await
                        .map_err(err)?;
                    if !c.0.changed {
                        return Err(RpcError(
                            Code::AlreadyExists,
                            format!("{path} exists already"),
                        ));
                    }
                    let e = stat_file(st(), n(), q(path, None)).await.map_err(err)?;
                    json!({"entry": entry_info(&e.0)})
                }
                _ => {
                    let _removed = remove_file(st(), n(), q(path, None)).await.map_err(err)?;
                    json!({})
                }
            }
        }
    })
}

/// The process a request selects (`{"process": {"pid": N}}` or `{"tag": T}`).
fn selector(req: &Value) -> Result<protocol::ProcessRef, RpcError> {
    let p = &req["process"];
    if let Some(pid) = p["pid"].as_u64().and_then(|p| u32::try_from(p).ok()) {
        return Ok(protocol::ProcessRef::Pid(pid));
    }
    if let Some(tag) = p["tag"].as_str() {
        return Ok(protocol::ProcessRef::Tag(tag.to_string()));
    }
    Err(RpcError::invalid(
        "the request names no process (process.pid or process.tag)",
    ))
}

/// process.Process's RPCs.
pub async fn process(
    State(s): State<Shared>,
    headers: HeaderMap,
    Path(method): Path<String>,
    req: Request,
) -> Response {
    match method.as_str() {
        "Start" | "Connect" => {
            let body = match crate::state::read_limited(req, &(), connect_body_limit()).await {
                Ok(b) => b,
                Err(e) => return connect::stream_error(RpcError::from(e)),
            };
            match stream_call(&s, &headers, &method, &body).await {
                Ok(r) => r,
                Err(e) => connect::stream_error(e),
            }
        }
        "StreamInput" => match stream_input(&s, &headers, req).await {
            Ok(()) => connect::stream(Body::from(
                [connect::envelope(0, &json!({})), connect::end(None)].concat(),
            )),
            Err(e) => connect::stream_error(e),
        },
        _ => {
            let body = match crate::state::read_limited(req, &(), connect_body_limit()).await {
                Ok(b) => b,
                Err(e) => return RpcError::from(e).into_response(),
            };
            match unary_call(&s, &headers, &method, &body).await {
                Ok(v) => Json(v).into_response(),
                Err(e) => e.into_response(),
            }
        }
    }
}

fn connect_body_limit() -> usize {
    crate::state::MAX_JSON
}

async fn unary_call(
    s: &Shared,
    headers: &HeaderMap,
    method: &str,
    body: &[u8],
) -> Result<Value, RpcError> {
    let req = connect::unary_request(body)?;
    match method {
        "List" => {
            let t = target(s, headers).await?;
            let list = crate::agent_io::list_processes(State(s.clone()), Path(t.id.clone()))
                .await
                .map_err(|e| rpc_error(&t.id, e))?;
            let processes: Vec<Value> = list
                .0
                .iter()
                .map(|p| {
                    let envs: BTreeMap<&str, &str> = p
                        .env
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    json!({
                        "config": {
                            "cmd": p.argv.first(),
                            "args": p.argv.get(1..).unwrap_or_default(),
                            "envs": envs,
                            "cwd": p.cwd,
                        },
                        "pid": p.pid,
                        "tag": p.tag,
                    })
                })
                .collect();
            Ok(json!({"processes": processes}))
        }
        "SendSignal" => {
            let process = selector(&req)?;
            let sig = match &req["signal"] {
                Value::String(n) => match n.as_str() {
                    "SIGNAL_SIGKILL" => 9,
                    "SIGNAL_SIGTERM" => 15,
                    other => {
                        return Err(RpcError::invalid(format!(
                            "signal {other:?} is not SIGNAL_SIGKILL or SIGNAL_SIGTERM"
                        )))
                    }
                },
                Value::Number(n) => n
                    .as_i64()
                    .and_then(|n| i32::try_from(n).ok())
                    .filter(|n| *n == 9 || *n == 15)
                    .ok_or_else(|| RpcError::invalid(format!("signal {n} is not 9 or 15")))?,
                _ => return Err(RpcError::invalid("the request names no signal")),
            };
            let t = target(s, headers).await?;
            crate::agent_io::signal_in(s, t.id.clone(), process, sig)
                .await
                .map_err(|e| rpc_error(&t.id, e))?;
            Ok(json!({}))
        }
        "SendInput" => {
            let process = selector(&req)?;
            let input = &req["input"];
            if input.get("pty").is_some() {
                return Err(RpcError::unimplemented("PTYs (Sandbox.pty)"));
            }
            let data = input["stdin"].as_str().unwrap_or_default();
            let data = base64::engine::general_purpose::STANDARD
                .decode(data)
                .map_err(|e| RpcError::invalid(format!("input.stdin is not base64: {e}")))?;
            let t = target(s, headers).await?;
            crate::agent_io::input_to(s, t.id.clone(), process, Bytes::from(data), false)
                .await
                .map_err(|e| rpc_error(&t.id, e))?;
            Ok(json!({}))
        }
        "CloseStdin" => {
            let process = selector(&req)?;
            let t = target(s, headers).await?;
            crate::agent_io::input_to(s, t.id.clone(), process, Bytes::new(), true)
                .await
                .map_err(|e| rpc_error(&t.id, e))?;
            Ok(json!({}))
        }
        "Update" => Err(RpcError::unimplemented(
            "PTYs (resizing one: Sandbox.pty.resize)",
        )),
        other => Err(RpcError::unimplemented(&format!("process.Process/{other}"))),
    }
}

/// Start and Connect: a server stream of a command's events.
async fn stream_call(
    s: &Shared,
    headers: &HeaderMap,
    method: &str,
    body: &[u8],
) -> Result<Response, RpcError> {
    let req = connect::stream_request(body)?;
    let t = target(s, headers).await?;
    let rx = if method == "Start" {
        if req["pty"].is_object() {
            return Err(RpcError::unimplemented("PTYs (Sandbox.pty)"));
        }
        let p = &req["process"];
        let cmd = p["cmd"]
            .as_str()
            .filter(|c| !c.is_empty())
            .ok_or_else(|| RpcError::invalid("process.cmd is missing"))?;
        let mut argv = vec![cmd.to_string()];
        argv.extend(
            p["args"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|a| a.as_str().map(str::to_string)),
        );
        let mut env = t.env.clone();
        for (k, v) in p["envs"].as_object().into_iter().flatten() {
            if let Some(v) = v.as_str() {
                env.insert(k.clone(), v.to_string());
            }
        }
        // Connect's deadline bounds the command, as envd does it.
        let timeout_s = headers
            .get("connect-timeout-ms")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|ms| *ms > 0)
            .map(|ms| ms as f64 / 1000.0);
        let user = user_of(headers);
        let cwd = match p["cwd"].as_str() {
            Some(c) if !c.is_empty() => Some(guest_path(Some(c), &user)?),
            _ => None,
        };
        let spec = ExecSpec {
            argv,
            env,
            cwd,
            timeout_s,
            stdin_b64: None,
            open_stdin: req["stdin"].as_bool() == Some(true),
            keep: true,
            tag: req["tag"].as_str().map(str::to_string),
            user: Some(user),
        };
        crate::agent_io::exec_events(s, t.id.clone(), &spec)
            .await
            .map_err(|e| rpc_error(&t.id, e))?
    } else {
        let process = selector(&req)?;
        crate::agent_io::follow_events(s, t.id.clone(), process)
            .await
            .map_err(|e| rpc_error(&t.id, e))?
    };
    let keepalive = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|s| *s > 0);
    Ok(connect::stream(events_body(rx, keepalive, t.id)))
}

/// Go's names for the signals a command is likely to die of (envd
/// reports `status` as Go's ProcessState prints it).
fn signal_name(sig: i32) -> String {
    match sig {
        1 => "hangup".into(),
        2 => "interrupt".into(),
        3 => "quit".into(),
        6 => "aborted".into(),
        9 => "killed".into(),
        13 => "broken pipe".into(),
        15 => "terminated".into(),
        n => format!("signal {n}"),
    }
}

/// A command's events as Connect envelopes, with keepalives every
/// `keepalive` seconds while nothing else is sent.
fn events_body(
    rx: tokio::sync::mpsc::Receiver<ExecEvent>,
    keepalive: Option<u64>,
    id: String,
) -> Body {
    let events = tokio_stream::wrappers::ReceiverStream::new(rx);
    let mut started = false;
    let frames = events.map(move |ev| -> Vec<Bytes> {
        match ev {
            ExecEvent::Started { pid } => {
                started = true;
                vec![connect::envelope(
                    0,
                    &json!({"event": {"start": {"pid": pid}}}),
                )]
            }
            ExecEvent::Stdout { data_b64 } => vec![connect::envelope(
                0,
                &json!({"event": {"data": {"stdout": data_b64}}}),
            )],
            ExecEvent::Stderr { data_b64 } => vec![connect::envelope(
                0,
                &json!({"event": {"data": {"stderr": data_b64}}}),
            )],
            ExecEvent::Exit {
                exit_code,
                signal,
                timed_out,
            } => {
                let (code, status) = match signal {
                    Some(sig) => (-1, format!("signal: {}", signal_name(sig))),
                    None => (exit_code, format!("exit status {exit_code}")),
                };
                let end = json!({"event": {"end": {
                    "exitCode": code,
                    "exited": signal.is_none(),
                    "status": status,
                    "error": timed_out.then_some("the command's timeout passed; it was killed"),
                }}});
                vec![connect::envelope(0, &end), connect::end(None)]
            }
            ExecEvent::Error { error } => {
                // Before the start: the command could not be run; after:
                // the connection to the guest ended (a pause, a kill).
                let code = if started {
                    Code::Unavailable
                } else {
                    Code::InvalidArgument
                };
                let msg = if started {
                    format!(
                        "{} (the connection to sandbox {id:?} ended before the command did)",
                        error.message
                    )
                } else {
                    error.message
                };
                vec![connect::end(Some(RpcError(code, msg)))]
            }
        }
    });
    let frames = frames.flat_map(futures::stream::iter);
    let body = match keepalive {
        None => frames.boxed(),
        Some(secs) => {
            let ping = connect::envelope(0, &json!({"event": {"keepalive": {}}}));
            let pings = tokio_stream::wrappers::IntervalStream::new(tokio::time::interval_at(
                tokio::time::Instant::now() + Duration::from_secs(secs),
                Duration::from_secs(secs),
            ))
            .map(move |_| ping.clone());
            // The stream ends with the command's events, pings or not.
            let frames = frames
                .map(Some)
                .chain(futures::stream::once(async { None }));
            futures::stream::select(frames, pings.map(Some))
                .take_while(|f| futures::future::ready(f.is_some()))
                .filter_map(futures::future::ready)
                .boxed()
        }
    };
    Body::from_stream(body.map(Ok::<_, std::convert::Infallible>))
}

/// process.Process/StreamInput: a client stream (a start naming the
/// process, then data), each data message written to its stdin.
async fn stream_input(s: &Shared, headers: &HeaderMap, req: Request) -> Result<(), RpcError> {
    use http_body_util::BodyExt;
    let t = target(s, headers).await?;
    let mut body = req.into_body();
    let mut env = connect::Envelopes::default();
    let mut process = None;
    loop {
        while let Some(next) = env.next() {
            let (flags, msg) = next?;
            if flags & connect::END_STREAM != 0 {
                return Ok(());
            }
            if let Some(start) = msg.get("start") {
                process = Some(selector(start)?);
            } else if let Some(data) = msg.get("data") {
                let p = process.clone().ok_or_else(|| {
                    RpcError::invalid("input came before the start naming its process")
                })?;
                let input = &data["input"];
                if input.get("pty").is_some() {
                    return Err(RpcError::unimplemented("PTYs (Sandbox.pty)"));
                }
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(input["stdin"].as_str().unwrap_or_default())
                    .map_err(|e| RpcError::invalid(format!("input.stdin is not base64: {e}")))?;
                crate::agent_io::input_to(s, t.id.clone(), p, Bytes::from(bytes), false)
                    .await
                    .map_err(|e| rpc_error(&t.id, e))?;
            }
        }
        match body.frame().await {
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    env.push(&d);
                }
            }
            Some(Err(e)) => return Err(RpcError::invalid(format!("the input stream failed: {e}"))),
            None if env.rest() == 0 => return Ok(()),
            None => return Err(RpcError::invalid("the input stream ended inside a message")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_perms_user_and_paths() {
        assert_eq!(perms(0o755, protocol::EntryKind::Dir), "drwxr-xr-x");
        assert_eq!(perms(0o640, protocol::EntryKind::File), "-rw-r-----");
        let mut h = HeaderMap::new();
        assert_eq!(user_of(&h), "root");
        h.insert("authorization", "Basic dXNlcjo=".parse().expect("header"));
        assert_eq!(user_of(&h), "user");
        assert_eq!(
            guest_path(Some("a/b"), "root").ok().as_deref(),
            Some("/root/a/b")
        );
        assert_eq!(
            guest_path(Some("a"), "user").ok().as_deref(),
            Some("/home/user/a")
        );
        assert_eq!(guest_path(Some("/x"), "user").ok().as_deref(), Some("/x"));
        assert!(guest_path(None, "root").is_err());
        assert!(selector(&json!({"process": {"pid": 7}})).is_ok());
        assert!(selector(&json!({"process": {}})).is_err());
    }
}
