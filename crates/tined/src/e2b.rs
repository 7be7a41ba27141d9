//! E2B's API over tine, so the unmodified `e2b` SDK (2.x) works against
//! tined (docs/design/sdk.md says what its wire is and why envd is served
//! here and not in the guest).
//!
//! Two parts on one listener:
//! - the control API (`E2B_API_URL`): `/sandboxes...` → run, ls, rm,
//!   sleep, wake, fork, by calling tined's own handlers, so idempotency,
//!   events and metrics are the same as through `/v1`;
//! - envd (`E2B_SANDBOX_URL`), the sandbox named by the `E2b-Sandbox-Id`
//!   header: Connect RPC with the JSON codec (`/process.Process/Start`
//!   streamed, `/filesystem.Filesystem/*` unary) and REST `/files`,
//!   `/health`, each translated to the agent protocol.
//!
//! What is not here answers in E2B's error shape (`{code, message}`, or a
//! Connect error for RPCs) naming the missing feature.

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::agent_io::{ExecEvent, ExecSpec};
use crate::error::ApiResult;
use crate::state::{JsonBody, Shared};

/// The envd version tined claims: the SDK turns features on by it
/// (e2b/envd/versions.py); 0.5.7 is the first with octet-stream uploads,
/// and every feature up to it is served here.
const ENVD_VERSION: &str = "0.5.7";
/// The template a sandbox gets when none is named.
const DEFAULT_TEMPLATE: &str = "base";

/// The routes, merged into tined's router.
pub fn routes() -> Router<Shared> {
    Router::new()
        .route("/sandboxes", post(create).get(list))
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/resume", post(connect))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(set_timeout))
        .route("/health", get(health))
        .route("/files", get(download).post(upload))
        .route("/process.Process/Start", post(process_start))
        .route("/filesystem.Filesystem/{method}", post(filesystem))
        .route("/process.Process/{method}", post(process_other))
}

/// An error in E2B's control-API shape.
struct E2bError(StatusCode, String);

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let body = json!({"code": self.0.as_u16(), "message": self.1});
        (self.0, Json(body)).into_response()
    }
}

type E2bResult<T> = Result<T, E2bError>;

/// The JSON answer of one of tined's own handlers, or its error re-shaped.
async fn answer(res: ApiResult<Response>) -> E2bResult<Value> {
    let res = res.map_err(|e| E2bError(e.status, e.body.message))?;
    let status = res.status();
    let bytes = axum::body::to_bytes(res.into_body(), 64 << 20)
        .await
        .map_err(|e| E2bError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    if status.is_client_error() || status.is_server_error() {
        let msg = v["message"].as_str().unwrap_or("failed").to_string();
        return Err(E2bError(status, msg));
    }
    Ok(v)
}

/// Waits for an operation tined started (sleep, wake) and gives its result.
async fn finished(s: &Shared, op: Value) -> E2bResult<Value> {
    let id = op["id"].as_str().unwrap_or_default().to_string();
    let handle = s.ops.get(&id).ok_or_else(|| {
        E2bError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("operation {id:?} vanished"),
        )
    })?;
    let mut rx = handle.subscribe();
    loop {
        let cur = rx.borrow_and_update().clone();
        if cur.state != crate::ops::OpState::Running {
            let v = serde_json::to_value(&cur).unwrap_or(Value::Null);
            if cur.state == crate::ops::OpState::Succeeded {
                return Ok(v["result"].clone());
            }
            let status = v["status"]
                .as_u64()
                .and_then(|s| StatusCode::from_u16(s as u16).ok())
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let msg = v["error"]["message"]
                .as_str()
                .unwrap_or("failed")
                .to_string();
            return Err(E2bError(status, msg));
        }
        if rx.changed().await.is_err() {
            return Err(E2bError(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("operation {id:?} ended without a result"),
            ));
        }
    }
}

/// A new sandbox's name: E2B ids are short lowercase tokens.
fn new_id() -> String {
    use std::io::Read;
    let mut b = [0u8; 6];
    let random = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b));
    if random.is_err() {
        // Unique enough within one tined: the clock's nanoseconds.
        let ns = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        b.copy_from_slice(&ns.to_le_bytes()[..6]);
    }
    format!(
        "sbx-{}",
        b.iter().map(|x| format!("{x:02x}")).collect::<String>()
    )
}

/// What POST /sandboxes, /connect and /fork answer for a sandbox.
fn sandbox(id: &str, template: &str, token: &Option<String>) -> Value {
    json!({
        "templateID": template,
        "sandboxID": id,
        "clientID": "tine",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token,
        "domain": null,
    })
}

/// The TCP token (what the SDK must send to envd as `X-Access-Token`).
fn token(headers: &HeaderMap) -> Option<String> {
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID", default)]
    template_id: Option<String>,
    #[serde(default)]
    env_vars: std::collections::BTreeMap<String, String>,
    #[serde(default)]
    auto_pause: bool,
    #[serde(default)]
    volume_mounts: Option<Value>,
}

/// A template is a tine image (`base` is `debian`), or the name of a
/// sleeping branch: a sandbox created from it is a wake of its snapshot.
async fn create(
    State(s): State<Shared>,
    headers: HeaderMap,
    JsonBody(spec): JsonBody<NewSandbox>,
) -> E2bResult<Response> {
    if spec.volume_mounts.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(unsupported("volume mounts"));
    }
    if spec.auto_pause {
        return Err(unsupported("autoPause (pause on timeout)"));
    }
    if !spec.env_vars.is_empty() {
        return Err(unsupported("envVars at create (pass envs to each command)"));
    }
    let template = spec
        .template_id
        .unwrap_or_else(|| DEFAULT_TEMPLATE.to_string());
    let id = new_id();
    let st = s.clone();
    let t = template.clone();
    let is_branch =
        tokio::task::spawn_blocking(move || host::tree::has_branch_in(&st.host.home, &t))
            .await
            .unwrap_or(false);
    if is_branch {
        let op = answer(
            crate::app::wake_branch(
                State(s.clone()),
                Path(template.clone()),
                JsonBody(host::tree::WakeSpec {
                    name: Some(id.clone()),
                    ..Default::default()
                }),
            )
            .await,
        )
        .await?;
        finished(&s, op).await?;
    } else {
        // E2B's commands run under /bin/bash: its `base` is tine's
        // `debian` image (the `minimal` one has only busybox's sh).
        let image = match template.as_str() {
            "base" | "" => "debian".to_string(),
            other => other.to_string(),
        };
        let spec: host::vm::RunSpec =
            serde_json::from_value(json!({"name": id, "image": image}))
                .map_err(|e| E2bError(StatusCode::BAD_REQUEST, e.to_string()))?;
        answer(crate::app::run_vm(State(s.clone()), HeaderMap::new(), JsonBody(spec)).await)
            .await?;
    }
    Ok((
        StatusCode::CREATED,
        Json(sandbox(&id, &template, &token(&headers))),
    )
        .into_response())
}

fn unsupported(what: &str) -> E2bError {
    E2bError(
        StatusCode::NOT_IMPLEMENTED,
        format!("tine's E2B compatibility does not support {what} yet"),
    )
}

/// One listed sandbox from tine's vm (or sleeping branch) record.
fn listed(v: &Value, state: &str) -> Value {
    json!({
        "templateID": v["image"].as_str().unwrap_or(DEFAULT_TEMPLATE),
        "sandboxID": v["name"],
        "clientID": "tine",
        "startedAt": "1970-01-01T00:00:00Z",
        "endAt": "2100-01-01T00:00:00Z",
        "cpuCount": v["vcpus"].as_u64().unwrap_or(1),
        "memoryMB": v["mem_mib"].as_u64().unwrap_or(0),
        "diskSizeMB": 0,
        "state": state,
        "envdVersion": ENVD_VERSION,
        "metadata": {},
    })
}

async fn list(State(s): State<Shared>) -> E2bResult<Json<Value>> {
    let vms = crate::app::list_vms(State(s.clone()))
        .await
        .map_err(|e| E2bError(e.status, e.body.message))?
        .0;
    let mut out: Vec<Value> = vms
        .iter()
        .filter_map(|v| serde_json::to_value(v).ok())
        .filter(|v| v["state"] == "running")
        .map(|v| listed(&v, "running"))
        .collect();
    let branches = answer(
        crate::app::list_branches(State(s.clone()))
            .await
            .map(IntoResponse::into_response),
    )
    .await?;
    for b in branches.as_array().into_iter().flatten() {
        if b["state"] == "sleeping" {
            out.push(listed(b, "paused"));
        }
    }
    Ok(Json(Value::Array(out)))
}

async fn detail(State(s): State<Shared>, Path(id): Path<String>) -> E2bResult<Json<Value>> {
    let all = list(State(s)).await?.0;
    all.as_array()
        .into_iter()
        .flatten()
        .find(|v| v["sandboxID"] == id.as_str())
        .cloned()
        .map(Json)
        .ok_or_else(|| E2bError(StatusCode::NOT_FOUND, format!("sandbox {id:?} not found")))
}

async fn kill(State(s): State<Shared>, Path(id): Path<String>) -> E2bResult<StatusCode> {
    let q = Query(crate::app::ForceQuery { force: true });
    let vm = crate::app::remove_vm(State(s.clone()), Path(id.clone()), q).await;
    match vm {
        Ok(_) => Ok(StatusCode::NO_CONTENT),
        Err(e) if e.status == StatusCode::NOT_FOUND => {
            // A paused sandbox is a sleeping branch.
            answer(
                crate::app::remove_branch(State(s), Path(id))
                    .await
                    .map(IntoResponse::into_response),
            )
            .await?;
            Ok(StatusCode::NO_CONTENT)
        }
        Err(e) => Err(E2bError(e.status, e.body.message)),
    }
}

async fn pause(State(s): State<Shared>, Path(id): Path<String>) -> E2bResult<StatusCode> {
    let op = answer(crate::app::sleep_vm(State(s.clone()), Path(id)).await).await?;
    finished(&s, op).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Connect to a running sandbox (200), or resume a paused one (201).
async fn connect(
    State(s): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> E2bResult<Response> {
    let found = detail(State(s.clone()), Path(id.clone())).await?.0;
    let template = found["templateID"]
        .as_str()
        .unwrap_or(DEFAULT_TEMPLATE)
        .to_string();
    if found["state"] == "running" {
        return Ok((
            StatusCode::OK,
            Json(sandbox(&id, &template, &token(&headers))),
        )
            .into_response());
    }
    let op = answer(
        crate::app::wake_branch(
            State(s.clone()),
            Path(id.clone()),
            JsonBody(Default::default()),
        )
        .await,
    )
    .await?;
    finished(&s, op).await?;
    Ok((
        StatusCode::CREATED,
        Json(sandbox(&id, &template, &token(&headers))),
    )
        .into_response())
}

#[derive(Deserialize)]
struct ForkRequest {
    #[serde(default)]
    count: Option<usize>,
}

/// E2B's fork: one result per child, a sandbox or an error.
async fn fork(
    State(s): State<Shared>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Option<Json<ForkRequest>>,
) -> E2bResult<Response> {
    let count = body.and_then(|b| b.0.count).unwrap_or(1);
    let spec = host::fork::ForkSpec {
        count: Some(count),
        ..Default::default()
    };
    let fwd = headers.clone();
    let report =
        answer(crate::app::fork_vm(State(s.clone()), Path(id.clone()), fwd, JsonBody(spec)).await)
            .await?;
    let template = detail(State(s), Path(id)).await.ok().map_or_else(
        || DEFAULT_TEMPLATE.to_string(),
        |d| {
            d.0["templateID"]
                .as_str()
                .unwrap_or(DEFAULT_TEMPLATE)
                .to_string()
        },
    );
    let out: Vec<Value> = report["results"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            if r["ok"] == true {
                let name = r["name"].as_str().unwrap_or_default();
                json!({"sandbox": sandbox(name, &template, &token(&headers))})
            } else {
                json!({"error": {"code": 500, "message": r["error"]}})
            }
        })
        .collect();
    Ok((StatusCode::CREATED, Json(Value::Array(out))).into_response())
}

async fn set_timeout(Path(_id): Path<String>) -> E2bError {
    unsupported("sandbox timeouts (tine's sandboxes live until killed or paused)")
}

// -- envd ----------------------------------------------------------------

/// The sandbox an envd request is for.
fn sandbox_of(headers: &HeaderMap) -> Result<String, NoSandbox> {
    headers
        .get("e2b-sandbox-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .ok_or(NoSandbox)
}

/// An envd request without `E2b-Sandbox-Id`.
struct NoSandbox;

impl IntoResponse for NoSandbox {
    fn into_response(self) -> Response {
        connect_error(
            "invalid_argument",
            "envd requests need the E2b-Sandbox-Id header (the e2b SDK sends it; set E2B_SANDBOX_URL to this tined)",
        )
    }
}

/// A Connect unary error: HTTP status by code, JSON `{code, message}`.
fn connect_error(code: &str, message: &str) -> Response {
    let status = match code {
        "invalid_argument" => StatusCode::BAD_REQUEST,
        "not_found" => StatusCode::NOT_FOUND,
        "unimplemented" => StatusCode::NOT_IMPLEMENTED,
        "permission_denied" => StatusCode::FORBIDDEN,
        "failed_precondition" => StatusCode::PRECONDITION_FAILED,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    (status, Json(json!({"code": code, "message": message}))).into_response()
}

/// tined's error code as a Connect code.
fn connect_code(status: StatusCode) -> &'static str {
    match status {
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => "invalid_argument",
        StatusCode::CONFLICT => "failed_precondition",
        StatusCode::SERVICE_UNAVAILABLE => "unavailable",
        _ => "internal",
    }
}

async fn health() -> StatusCode {
    StatusCode::NO_CONTENT
}

#[derive(Deserialize)]
struct FileQuery {
    #[serde(default)]
    path: Option<String>,
}

/// The guest path of a request: absolute as given, relative to /root
/// (E2B resolves relative paths against the user's home).
fn guest_path(p: Option<String>) -> Result<String, E2bError> {
    let p = p.ok_or_else(|| {
        E2bError(
            StatusCode::BAD_REQUEST,
            "the path parameter is missing".into(),
        )
    })?;
    Ok(if p.starts_with('/') {
        p
    } else {
        format!("/root/{p}")
    })
}

async fn download(
    State(s): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
) -> Result<Response, Response> {
    let name = sandbox_of(&headers).map_err(IntoResponse::into_response)?;
    let path = guest_path(q.path).map_err(IntoResponse::into_response)?;
    let q = Query(crate::agent_io::FileQuery { path, mode: None });
    crate::agent_io::read_file(State(s), Path(name), q)
        .await
        .map_err(|e| E2bError(e.status, e.body.message).into_response())
}

/// An upload: the body itself (octet-stream) or multipart parts, each a file.
async fn upload(
    State(s): State<Shared>,
    headers: HeaderMap,
    Query(q): Query<FileQuery>,
    req: Request,
) -> Result<Json<Value>, Response> {
    let name = sandbox_of(&headers).map_err(IntoResponse::into_response)?;
    let ctype = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let mut files: Vec<(String, Bytes)> = Vec::new();
    if ctype.starts_with("multipart/form-data") {
        let mut mp = axum::extract::Multipart::from_request(req, &())
            .await
            .map_err(IntoResponse::into_response)?;
        while let Some(field) = mp
            .next_field()
            .await
            .map_err(|e| E2bError(StatusCode::BAD_REQUEST, e.to_string()).into_response())?
        {
            let fname = field.file_name().map(str::to_string);
            let data = field
                .bytes()
                .await
                .map_err(|e| E2bError(StatusCode::BAD_REQUEST, e.to_string()).into_response())?;
            let path = q.path.clone().or(fname);
            files.push((guest_path(path).map_err(IntoResponse::into_response)?, data));
        }
    } else {
        let data = axum::body::to_bytes(req.into_body(), 1 << 30)
            .await
            .map_err(|e| E2bError(StatusCode::BAD_REQUEST, e.to_string()).into_response())?;
        files.push((
            guest_path(q.path.clone()).map_err(IntoResponse::into_response)?,
            data,
        ));
    }
    let mut out = Vec::new();
    for (path, data) in files {
        if let Some(parent) = std::path::Path::new(&path).parent() {
            let p = parent.to_string_lossy().into_owned();
            let q = Query(crate::agent_io::ListQuery {
                path: p,
                depth: None,
            });
            let _ = crate::agent_io::make_dir(State(s.clone()), Path(name.clone()), q).await;
        }
        let q = Query(crate::agent_io::FileQuery {
            path: path.clone(),
            mode: None,
        });
        let req = Request::new(Body::from(data));
        crate::agent_io::write_file(State(s.clone()), Path(name.clone()), q, req)
            .await
            .map_err(|e| E2bError(e.status, e.body.message).into_response())?;
        let fname = path.rsplit('/').next().unwrap_or_default().to_string();
        out.push(json!({"name": fname, "type": "file", "path": path}));
    }
    Ok(Json(Value::Array(out)))
}

/// A guest entry in envd's EntryInfo JSON.
fn entry_info(e: &protocol::Entry) -> Value {
    let kind = match e.kind {
        protocol::EntryKind::File => "FILE_TYPE_FILE",
        protocol::EntryKind::Dir => "FILE_TYPE_DIRECTORY",
        protocol::EntryKind::Symlink => "FILE_TYPE_SYMLINK",
        protocol::EntryKind::Other => "FILE_TYPE_UNSPECIFIED",
    };
    let secs = e.mtime_ms / 1000;
    let nanos = (e.mtime_ms % 1000) * 1_000_000;
    let modified = chrono_rfc3339(secs, nanos);
    json!({
        "name": e.name,
        "type": kind,
        "path": e.path,
        "size": e.size.to_string(),
        "mode": e.mode,
        "permissions": perms(e.mode, e.kind),
        "owner": e.owner,
        "group": e.group,
        "modifiedTime": modified,
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

/// RFC 3339 UTC from seconds since the epoch (days to civil date:
/// Howard Hinnant's algorithm; no date crate for one timestamp).
fn chrono_rfc3339(secs: u64, nanos: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = if m <= 2 { y + 1 } else { y };
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        nanos
    )
}

/// filesystem.Filesystem unary RPCs (Connect, JSON codec).
async fn filesystem(
    State(s): State<Shared>,
    headers: HeaderMap,
    Path(method): Path<String>,
    body: Bytes,
) -> Response {
    let name = match sandbox_of(&headers) {
        Ok(n) => n,
        Err(r) => return r.into_response(),
    };
    let req: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let path = match guest_path(req["path"].as_str().map(str::to_string)) {
        Ok(p) => p,
        Err(e) => return connect_error("invalid_argument", &e.1),
    };
    let n = name.clone();
    let q = |depth| {
        Query(crate::agent_io::ListQuery {
            path: path.clone(),
            depth,
        })
    };
    let res: Result<Value, crate::error::ApiError> = match method.as_str() {
        "Stat" => crate::agent_io::stat_file(State(s), Path(n), q(None))
            .await
            .map(|e| json!({"entry": entry_info(&e.0)})),
        "ListDir" => {
            let depth = req["depth"].as_u64().map(|d| d.clamp(1, 32) as u32);
            crate::agent_io::list_files(State(s), Path(n), q(depth))
                .await
                .map(|es| json!({"entries": es.0.iter().map(entry_info).collect::<Vec<_>>()}))
        }
        "MakeDir" => {
            match crate::agent_io::make_dir(State(s.clone()), Path(n.clone()), q(None)).await {
                Ok(c) if !c.0.changed => {
                    return connect_error("already_exists", &format!("{path} exists already"))
                }
                Ok(_) => crate::agent_io::stat_file(State(s), Path(n), q(None))
                    .await
                    .map(|e| json!({"entry": entry_info(&e.0)})),
                Err(e) => Err(e),
            }
        }
        "Remove" => crate::agent_io::remove_file(State(s), Path(n), q(None))
            .await
            .map(|_| json!({})),
        other => {
            return connect_error(
                "unimplemented",
                &format!("tine's envd does not serve filesystem.Filesystem/{other} yet"),
            )
        }
    };
    match res {
        Ok(v) => Json(v).into_response(),
        Err(e) => connect_error(connect_code(e.status), &e.body.message),
    }
}

async fn process_other(Path(method): Path<String>) -> Response {
    connect_error(
        "unimplemented",
        &format!("tine's envd does not serve process.Process/{method} yet (background processes cannot be signalled, listed or given input)"),
    )
}

/// One Connect streaming envelope: flags, big-endian length, JSON.
fn envelope(flags: u8, v: &Value) -> Bytes {
    let data = serde_json::to_vec(v).unwrap_or_default();
    let mut out = Vec::with_capacity(5 + data.len());
    out.push(flags);
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(&data);
    Bytes::from(out)
}

/// process.Process/Start: a server stream of start, data and end events.
async fn process_start(State(s): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let name = match sandbox_of(&headers) {
        Ok(n) => n,
        Err(r) => return r.into_response(),
    };
    // The request is one envelope (a bare JSON body is taken too).
    let json_part = if body.len() >= 5 && body[0] & 0x02 == 0 {
        let n = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        body.get(5..5 + n).unwrap_or(&body[..])
    } else {
        &body[..]
    };
    let req: Value = serde_json::from_slice(json_part).unwrap_or(Value::Null);
    let p = &req["process"];
    let cmd = p["cmd"].as_str().unwrap_or_default().to_string();
    let mut argv = vec![cmd];
    argv.extend(
        p["args"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str().map(str::to_string)),
    );
    if req["pty"].is_object() {
        return stream_error("unimplemented", "tine's envd does not serve PTYs yet");
    }
    let env = p["envs"]
        .as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
        .collect();
    let spec = ExecSpec {
        argv,
        env,
        cwd: p["cwd"].as_str().map(str::to_string),
        timeout_s: None,
        stdin_b64: None,
    };
    let rx = match crate::agent_io::exec_events(&s, name, &spec).await {
        Ok(rx) => rx,
        Err(e) => return stream_error(connect_code(e.status), &e.body.message),
    };
    let start =
        futures::stream::once(async { envelope(0, &json!({"event": {"start": {"pid": 1}}})) });
    let events = tokio_stream::wrappers::ReceiverStream::new(rx).flat_map(|ev| {
        let out: Vec<Bytes> = match ev {
            ExecEvent::Stdout { data_b64 } => {
                vec![envelope(
                    0,
                    &json!({"event": {"data": {"stdout": data_b64}}}),
                )]
            }
            ExecEvent::Stderr { data_b64 } => {
                vec![envelope(
                    0,
                    &json!({"event": {"data": {"stderr": data_b64}}}),
                )]
            }
            ExecEvent::Exit {
                exit_code,
                signal,
                timed_out,
            } => {
                let status = match signal {
                    Some(sig) => format!("signal: {sig}"),
                    None => format!("exit status {exit_code}"),
                };
                let end = json!({"event": {"end": {
                    "exitCode": exit_code, "exited": signal.is_none(), "status": status,
                    "error": timed_out.then_some("timed out"),
                }}});
                vec![envelope(0, &end), envelope(2, &json!({}))]
            }
            ExecEvent::Error { error } => vec![envelope(
                2,
                &json!({"error": {"code": "internal", "message": error.message}}),
            )],
        };
        futures::stream::iter(out)
    });
    let body = start.chain(events).map(Ok::<_, std::convert::Infallible>);
    (
        [(axum::http::header::CONTENT_TYPE, "application/connect+json")],
        Body::from_stream(body),
    )
        .into_response()
}

/// A stream that is only its end, with an error.
fn stream_error(code: &str, message: &str) -> Response {
    let end = envelope(2, &json!({"error": {"code": code, "message": message}}));
    (
        [(axum::http::header::CONTENT_TYPE, "application/connect+json")],
        Body::from(end),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_rfc3339_and_perms() {
        assert_eq!(chrono_rfc3339(0, 0), "1970-01-01T00:00:00.000000000Z");
        assert_eq!(
            chrono_rfc3339(1_733_356_800, 5_000_000),
            "2024-12-05T00:00:00.005000000Z"
        );
        assert_eq!(perms(0o755, protocol::EntryKind::Dir), "drwxr-xr-x");
        assert_eq!(perms(0o640, protocol::EntryKind::File), "-rw-r-----");
    }

    #[test]
    fn test_envelope() {
        let e = envelope(2, &json!({}));
        assert_eq!(&e[..], &[2, 0, 0, 0, 2, b'{', b'}']);
    }
}
