//! The router: every route of the API, and the middleware that counts
//! requests and refuses new ones while tined drains.

use std::sync::atomic::Ordering;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router;

use crate::app::*;
use crate::error::ApiError;
use crate::state::Shared;

/// The router.
pub fn app(state: Shared) -> Router {
    Router::new()
        .route("/v1/health", get(health))
        .route("/v1/shutdown", post(shutdown))
        .route("/v1/vms", get(list_vms).post(run_vm))
        .route("/v1/vms/{name}", get(get_vm).delete(remove_vm))
        .route("/v1/vms/{name}/stop", post(stop_vm))
        .route("/v1/vms/{name}/kill", post(kill_vm))
        .route("/v1/vms/{name}/fork", post(fork_vm))
        .route(
            "/v1/vms/{name}/checkpoints",
            get(list_checkpoints).post(create_checkpoint),
        )
        .route(
            "/v1/vms/{name}/checkpoints/{tag}",
            delete(delete_checkpoint),
        )
        .route("/v1/vms/{name}/rollback", post(rollback_vm))
        .route("/v1/vms/{name}/snapshot", post(snapshot_vm))
        .route("/v1/vms/{name}/sleep", post(sleep_vm))
        .route(
            "/v1/vms/{name}/keep",
            get(crate::keep::get_keep)
                .put(crate::keep::put_keep)
                .delete(crate::keep::delete_keep),
        )
        .route("/v1/vms/{name}/disks", get(disk_layers))
        .route(
            "/v1/vms/{name}/contract",
            get(get_contract).put(set_contract),
        )
        .route("/v1/vms/{name}/secrets", get(list_secrets))
        .route(
            "/v1/vms/{name}/secrets/{secret}",
            axum::routing::put(add_secret),
        )
        .route("/v1/vms/{name}/effects", get(vm_effects))
        .route("/v1/vms/{name}/effects/resolve", post(resolve_effect))
        .route("/v1/vms/{name}/exec", post(crate::agent_io::exec))
        .route("/v1/vms/{name}/attach", post(crate::agent_io::attach))
        .route(
            "/v1/vms/{name}/files",
            get(crate::agent_io::read_file)
                .put(crate::agent_io::write_file)
                .delete(crate::agent_io::remove_file),
        )
        .route("/v1/vms/{name}/files/stat", get(crate::agent_io::stat_file))
        .route(
            "/v1/vms/{name}/files/list",
            get(crate::agent_io::list_files),
        )
        .route("/v1/vms/{name}/files/dir", post(crate::agent_io::make_dir))
        .route(
            "/v1/vms/{name}/files/move",
            post(crate::agent_io::move_file),
        )
        .route(
            "/v1/vms/{name}/processes",
            get(crate::agent_io::list_processes),
        )
        .route(
            "/v1/vms/{name}/processes/{pid}/output",
            get(crate::agent_io::process_output),
        )
        .route(
            "/v1/vms/{name}/processes/{pid}/signal",
            post(crate::agent_io::signal_process),
        )
        .route(
            "/v1/vms/{name}/processes/{pid}/stdin",
            post(crate::agent_io::process_stdin),
        )
        .route("/v1/keys", get(list_keys).post(create_key))
        .route("/v1/keys/{id}", delete(delete_key))
        .route(
            "/v1/vms/{name}/console",
            get(crate::agent_io::console).post(crate::agent_io::console_send),
        )
        .route("/v1/branches", get(list_branches))
        .route("/v1/branches/{name}", delete(remove_branch))
        .route("/v1/branches/{name}/wake", post(wake_branch))
        .route("/v1/snapshots", get(list_snapshots))
        .route("/v1/tree", get(lineage))
        .route("/v1/tree/store", get(store_tree))
        .route("/v1/gc", post(gc))
        .route("/v1/store/verify", post(verify))
        .route("/v1/store/prefetch", post(crate::app::prefetch))
        .route("/v1/hosts", get(list_hosts))
        .route("/v1/branches/{name}/placement", get(branch_placement))
        .route("/v1/vms/{name}/move", post(move_vm))
        .route("/v1/hosts/self/offer", get(host_offer))
        .route("/v1/hosts/{id}", delete(forget_host))
        .route("/v1/images", get(list_images).post(build_image))
        .route("/v1/gateway", get(gateway_status).post(gateway_control))
        .route("/v1/operations", get(list_operations))
        .route("/v1/operations/{id}", get(get_operation))
        .route(
            "/v1/operations/{id}/events",
            get(crate::stream::operation_events),
        )
        .route("/v1/events", get(crate::stream::events))
        .route("/v1/openapi.json", get(crate::openapi::serve))
        .route("/metrics", get(metrics))
        .merge(crate::e2b::routes())
        .fallback(not_found)
        .layer(axum::middleware::from_fn(json_errors))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            count_requests,
        ))
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(state)
}

async fn count_requests(
    State(s): State<Shared>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let t0 = std::time::Instant::now();
    s.last_request
        .store(host::state::now_ms(), Ordering::Relaxed);
    // A label of a bounded set: a client may send any method name.
    let method = match req.method().as_str() {
        m @ ("GET" | "POST" | "PUT" | "DELETE" | "HEAD" | "PATCH" | "OPTIONS") => m.to_string(),
        _ => "other".to_string(),
    };
    let path = req.uri().path().to_string();
    if s.draining.load(Ordering::Relaxed) && path != "/v1/health" {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "restarting",
            "tined is shutting down; try again in a moment",
        )
        .into_response();
    }
    // Streams (attach, events, console) may last forever: a shutdown
    // does not wait for them.
    let streaming =
        path.ends_with("/attach") || path.ends_with("/events") || path.ends_with("/console");
    // Counted down on drop: hyper drops the handler of a request whose
    // client went away, and that one is no longer in flight either.
    let counted = (!streaming).then(|| InFlight::new(&s.in_flight));
    let (mut res, engine_us) = crate::state::ENGINE_US
        .scope(std::cell::Cell::new(0), async move {
            let res = next.run(req).await;
            (res, crate::state::ENGINE_US.with(std::cell::Cell::get))
        })
        .await;
    drop(counted);
    // Where the time went: in the engine, and in tined as a whole (until
    // the answer's head is ready); the rest of a client's wait is the
    // connection and HTTP. bench/api reads it.
    let timing = format!(
        "engine;dur={:.3}, handler;dur={:.3}",
        engine_us as f64 / 1000.0,
        t0.elapsed().as_secs_f64() * 1000.0
    );
    if let Ok(v) = axum::http::HeaderValue::from_str(&timing) {
        res.headers_mut().insert("server-timing", v);
    }
    s.metrics
        .requests
        .get_or_create(&crate::metrics::RequestLabels {
            method,
            status: res.status().as_u16(),
        })
        .inc();
    res
}

/// One request counted in flight until dropped.
struct InFlight<'a>(&'a std::sync::atomic::AtomicUsize);

impl<'a> InFlight<'a> {
    fn new(n: &'a std::sync::atomic::AtomicUsize) -> InFlight<'a> {
        n.fetch_add(1, Ordering::Relaxed);
        InFlight(n)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Answers a request for a path no route has (in E2B's shape outside
/// tined's own API).
async fn not_found(req: Request) -> Response {
    if crate::e2b::is_e2b_path(req.uri().path()) {
        let (method, uri) = (req.method().clone(), req.uri().clone());
        return crate::e2b::missing(method, uri).await.into_response();
    }
    ApiError::not_found(format!(
        "no such endpoint: {} {} (see /v1/openapi.json)",
        req.method(),
        req.uri().path()
    ))
    .into_response()
}

/// Every error is answered as JSON `{code, message}`: the ones axum makes
/// itself (a method a path does not take, a query string or path segment
/// that does not parse) come as plain text and are rewritten here, with
/// their status and headers (`Allow`) kept.
async fn json_errors(req: Request, next: axum::middleware::Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let res = next.run(req).await;
    let status = res.status();
    let is_json = res
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) {
        return res;
    }
    let e2b = crate::e2b::is_e2b_path(&path);
    if is_json && !e2b {
        return res;
    }
    let (mut parts, body) = res.into_parts();
    let text = axum::body::to_bytes(body, 64 << 10)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    if e2b {
        // E2B's clients read `{code: <status>, message}` (a Connect error
        // on envd's RPC paths): an answer already in that shape passes,
        // one of tined's `{code: "name", message}` or plain text is
        // rewritten.
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        let message = v["message"].as_str().map(str::to_string).unwrap_or(text);
        parts.headers.remove(axum::http::header::CONTENT_LENGTH);
        parts.headers.remove(axum::http::header::CONTENT_TYPE);
        let mut out = crate::e2b::error_answer(&path, status, v["code"].clone(), message);
        for (k, v) in parts.headers.iter() {
            out.headers_mut().insert(k.clone(), v.clone());
        }
        return out;
    }
    let (code, message) = match status {
        StatusCode::METHOD_NOT_ALLOWED => {
            let allow = parts
                .headers
                .get(axum::http::header::ALLOW)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_string();
            (
                "method_not_allowed",
                format!("{path} does not take {method} (it takes {allow}; see /v1/openapi.json)"),
            )
        }
        StatusCode::NOT_FOUND => ("not_found", text),
        StatusCode::PAYLOAD_TOO_LARGE => ("too_large", text),
        StatusCode::UNAUTHORIZED => ("unauthorized", text),
        s if s.is_client_error() => ("invalid_input", text),
        _ => ("internal", text),
    };
    let message = if message.is_empty() {
        format!("{method} {path}: {status}")
    } else {
        message
    };
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    let mut out = ApiError::new(status, code, message).into_response();
    for (k, v) in parts.headers.iter() {
        if k != axum::http::header::CONTENT_TYPE {
            out.headers_mut().insert(k.clone(), v.clone());
        }
    }
    out
}
