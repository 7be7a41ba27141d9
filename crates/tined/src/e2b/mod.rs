//! E2B's API over tine, so the unmodified `e2b` SDK (2.x) works against
//! tined (docs/design/sdk.md: what the wire is, how each resource maps,
//! and why envd is served here and not in the guest).
//!
//! Two parts on tined's listeners:
//! - the control API (`E2B_API_URL`), [`control`]: sandboxes are vms (or
//!   their sleeping branches while paused), templates are tine images or
//!   snapshots, pause/connect are sleep/wake, fork is tine's fork,
//!   snapshots are sleeping branches, kill is rm, a timeout puts a sandbox
//!   to sleep or removes it; the handlers call tined's own, so locks,
//!   idempotency, events and metrics are the same as through `/v1`;
//! - envd (`E2B_SANDBOX_URL`), [`envd`], the sandbox named by the
//!   `E2b-Sandbox-Id` header: Connect RPC with the JSON codec
//!   ([`connect`]) and REST `/files`, `/health`, each translated to the
//!   guest agent's protocol (commands the agent keeps, files).
//!
//! What is not here answers in E2B's error shape (`{code, message}`, or a
//! Connect error for RPCs) naming the missing feature, never a hang.

mod connect;
mod control;
mod envd;
pub mod records;

/// E2B's request bodies as its routes parse them, and Connect envelopes
/// (the fuzz harness in `crate::fuzz`; these modules are private).
#[cfg(any(test, feature = "fuzzing"))]
pub(crate) fn fuzz_body(data: &[u8]) {
    use crate::state::parse_json;
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    match pick % 10 {
        0 => drop(parse_json::<control::NewSandbox>(body)),
        1 => drop(serde_json::from_slice::<control::PauseRequest>(body)),
        2 => drop(serde_json::from_slice::<control::ConnectRequest>(body)),
        3 => drop(parse_json::<control::TimeoutRequest>(body)),
        4 => drop(serde_json::from_slice::<control::RefreshRequest>(body)),
        5 => drop(serde_json::from_slice::<control::ForkRequest>(body)),
        6 => drop(serde_json::from_slice::<control::SnapshotRequest>(body)),
        7 => drop(connect::stream_request(body)),
        8 => drop(connect::unary_request(body)),
        _ => {
            // A stream arriving in pieces of any size; an error ends it
            // (an over-long envelope stays in the buffer).
            let mut e = connect::Envelopes::default();
            'stream: for piece in body.chunks(usize::from(pick % 7) + 1) {
                e.push(piece);
                while let Some(m) = e.next() {
                    if m.is_err() {
                        break 'stream;
                    }
                }
            }
            let _ = e.rest();
        }
    }
}

use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, delete, get, post, put};
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::error::{ApiError, ApiResult};
use crate::state::Shared;

pub use control::expire;

/// The envd version tined claims: the SDK turns features on by it
/// (e2b/envd/versions.py): 0.5.7 is the first with octet-stream uploads,
/// and every feature up to it is served here (file metadata, 0.6.2, and
/// watch events, 0.6.3, are not).
const ENVD_VERSION: &str = "0.5.7";
/// The template a sandbox gets when none is named.
const DEFAULT_TEMPLATE: &str = "base";

/// The routes, merged into tined's router.
pub fn routes() -> Router<Shared> {
    use control::*;
    Router::new()
        .route("/sandboxes", post(create).get(list))
        .route("/v2/sandboxes", post(create).get(list))
        .route("/sandboxes/{id}", get(detail).delete(kill))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/snapshots", post(create_snapshot))
        .route("/snapshots", get(list_snapshots))
        .route("/templates/{id}", delete(delete_template).get(missing))
        .route("/sandboxes/{id}/metrics", get(missing))
        .route("/sandboxes/metrics", get(missing))
        .route("/sandboxes/{id}/logs", get(missing))
        .route("/v2/sandboxes/{id}/logs", get(missing))
        .route("/sandboxes/{id}/network", put(missing))
        .route("/health", get(envd::health))
        .route("/files", get(envd::download).post(envd::upload))
        .route("/process.Process/{method}", post(envd::process))
        .route("/filesystem.Filesystem/{method}", post(envd::filesystem))
        .route("/envs", any(missing))
}

/// Whether `path` is one of envd's (a sandbox's own access token opens
/// these, and only these, for that sandbox).
pub fn is_envd_path(path: &str) -> bool {
    matches!(path, "/health" | "/files")
        || path.starts_with("/process.Process/")
        || path.starts_with("/filesystem.Filesystem/")
}

/// Whether tined's fallback should answer `path` in E2B's shape (it is
/// not tined's own API).
pub fn is_e2b_path(path: &str) -> bool {
    !(path.starts_with("/v1/") || path == "/v1" || path == "/metrics")
}

/// An error answer on an E2B path, in the shape its clients read: a
/// Connect error on envd's RPC paths, `{code: <status>, message}`
/// elsewhere. `code` is what the answer had (kept when it is already
/// that shape).
pub fn error_answer(path: &str, status: StatusCode, code: Value, message: String) -> Response {
    if path.starts_with("/process.Process/") || path.starts_with("/filesystem.Filesystem/") {
        let code = connect::Code::parse(code.as_str().unwrap_or_default())
            .unwrap_or_else(|| connect::Code::of(status));
        return connect::RpcError(code, message).into_response();
    }
    E2bError(status, message).into_response()
}

/// An error in E2B's control-API shape: `{code: <HTTP status>, message}`.
#[derive(Debug)]
pub struct E2bError(pub StatusCode, pub String);

impl IntoResponse for E2bError {
    fn into_response(self) -> Response {
        let body = json!({"code": self.0.as_u16(), "message": self.1});
        (self.0, Json(body)).into_response()
    }
}

impl From<ApiError> for E2bError {
    fn from(e: ApiError) -> E2bError {
        E2bError(e.status, e.body.message)
    }
}

type E2bResult<T> = Result<T, E2bError>;

/// A feature of E2B's that tine does not serve.
fn unsupported(what: &str) -> E2bError {
    E2bError(
        StatusCode::NOT_IMPLEMENTED,
        format!("tine's E2B compatibility does not support {what}"),
    )
}

fn not_found(id: &str) -> E2bError {
    E2bError(
        StatusCode::NOT_FOUND,
        format!("sandbox {id:?} was not found"),
    )
}

/// What known E2B routes that tine does not serve answer, and the
/// fallback for every other path that is not tined's own.
pub async fn missing(method: Method, uri: Uri) -> E2bError {
    let path = uri.path();
    let what = if path.starts_with("/templates")
        || path.starts_with("/v2/templates")
        || path.starts_with("/v3/templates")
        || path.starts_with("/default-templates")
    {
        "template builds (a template is a tine image, `tine image build`, or a snapshot)"
            .to_string()
    } else if path.ends_with("/metrics") {
        "sandbox metrics (tined's own are at GET /metrics)".to_string()
    } else if path.ends_with("/logs") {
        "sandbox logs (the vm's console is at GET /v1/vms/{id}/console)".to_string()
    } else if path.ends_with("/network") {
        "changing a sandbox's network".to_string()
    } else if path.starts_with("/volumes") {
        "volumes".to_string()
    } else if path.starts_with("/secrets") {
        "secrets (tine's are per vm: PUT /v1/vms/{name}/secrets/{secret})".to_string()
    } else if path == "/envs" {
        "envd's /envs".to_string()
    } else {
        return E2bError(
            StatusCode::NOT_FOUND,
            format!("tined serves no {method} {path} (tine's API is under /v1; see GET /v1/openapi.json)"),
        );
    };
    unsupported(&what)
}

/// The JSON answer of one of tined's own handlers.
async fn answer(res: ApiResult<Response>) -> E2bResult<Value> {
    let res = res?;
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

/// Where a sandbox is now.
#[derive(Debug, PartialEq, Eq)]
enum Place {
    Running,
    Paused,
    /// A vm that no longer runs (crashed or stopped): why.
    Ended(String),
    Gone,
}

fn place(h: &host::Host, id: &str) -> Place {
    if host::state::validate_name(id).is_err() {
        return Place::Gone;
    }
    match host::vm::info(h, id) {
        Ok(v) if v.state == host::state::VmState::Running => Place::Running,
        Ok(v) => Place::Ended(v.exit.unwrap_or_else(|| format!("its vm is {}", v.state))),
        Err(_) if host::tree::is_sleeping(h, id) => Place::Paused,
        Err(_) => Place::Gone,
    }
}

/// A sandbox id (and the name of its vm): E2B's are short lowercase tokens.
fn new_id(prefix: &str) -> E2bResult<String> {
    crate::keys::random_hex(6)
        .map(|h| format!("{prefix}-{h}"))
        .map_err(|e| {
            E2bError(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("no randomness: {e}"),
            )
        })
}

/// RFC 3339 UTC of Unix milliseconds (days to a civil date: Howard
/// Hinnant's algorithm; no date crate for one timestamp format).
fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
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
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        ms % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_733_356_800_005), "2024-12-05T00:00:00.005Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn test_paths() {
        assert!(is_envd_path("/process.Process/Start"));
        assert!(is_envd_path("/files"));
        assert!(!is_envd_path("/sandboxes"));
        assert!(!is_envd_path("/v1/vms"));
        assert!(is_e2b_path("/sandboxes/x"));
        assert!(!is_e2b_path("/v1/nothing"));
    }
}
