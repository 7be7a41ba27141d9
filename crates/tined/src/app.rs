//! The API's handlers over the engine (crates/host), except work inside a
//! vm (agent_io) and streams (stream); the router is in router.rs. Every
//! handler parses and checks its input, runs the engine's call on
//! the blocking pool (the engine is synchronous: it talks to VMMs over
//! Unix sockets and waits on processes) and answers JSON. A client that
//! goes away does not cancel the operation: the blocking task runs to its
//! end and records what it did.

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};

use crate::error::{ApiError, ApiResult, ErrorBody};
use crate::idem::Answer;
use crate::ops::Operation;
use crate::state::{blocking, JsonBody, Shared};

fn json<T: Serialize>(v: &T) -> ApiResult<serde_json::Value> {
    serde_json::to_value(v).map_err(|e| ApiError::internal(e.to_string()))
}

/// An answer's JSON text, written once (no `Value` tree in between: run
/// and fork answers are the API's hot path).
fn raw<T: Serialize>(v: &T) -> ApiResult<Box<serde_json::value::RawValue>> {
    serde_json::value::to_raw_value(v).map_err(|e| ApiError::internal(e.to_string()))
}

/// Runs `f` once per `Idempotency-Key` (when the request has one): a
/// repeat gets the stored answer.
async fn idempotent<F, Fut>(
    s: &Shared,
    headers: &HeaderMap,
    fingerprint: String,
    f: F,
) -> ApiResult<Response>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = ApiResult<(StatusCode, Box<serde_json::value::RawValue>)>>,
{
    let key = match headers.get("idempotency-key") {
        None => {
            let (status, v) = f().await?;
            return Ok((status, Json(v)).into_response());
        }
        Some(k) => k
            .to_str()
            .ok()
            .filter(|k| !k.is_empty() && k.len() <= crate::idem::MAX_KEY)
            .ok_or_else(|| {
                ApiError::invalid(format!(
                    "the Idempotency-Key header must be 1-{} visible characters",
                    crate::idem::MAX_KEY
                ))
            })?
            .to_string(),
    };
    let lock = s.idem.lock(&key);
    let _held = lock.hold().await;
    let replay = |a: Answer| -> ApiResult<Response> {
        if a.fingerprint != fingerprint {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "conflict",
                "this Idempotency-Key was used for a different request; use a new key",
            ));
        }
        let status = StatusCode::from_u16(a.status).unwrap_or(StatusCode::OK);
        let mut r = (status, Json(a.body)).into_response();
        r.headers_mut().insert(
            "idempotent-replay",
            axum::http::HeaderValue::from_static("true"),
        );
        Ok(r)
    };
    if let Some(a) = s.idem.get(&key) {
        return replay(a);
    }
    let (status, body) = match f().await {
        Ok(x) => x,
        // Refused before anything was done (a bad request, a name in use,
        // a vm that is busy): not kept, so a retry with the same key, once
        // the cause is fixed, runs.
        Err(e) if e.status.is_client_error() => return Ok(e.into_response()),
        Err(e) => (e.status, raw(&e.body)?),
    };
    let answer = Answer {
        fingerprint,
        status: status.as_u16(),
        body,
        stored_ms: host::state::now_ms(),
    };
    s.idem.put(&key, &answer);
    Ok((status, Json(answer.body)).into_response())
}

/// What a request was, for comparing a repeat of its Idempotency-Key
/// (empty for a request without one: nothing compares it).
fn fingerprint(headers: &HeaderMap, method: &str, path: &str, body: &impl Serialize) -> String {
    if !headers.contains_key("idempotency-key") {
        return String::new();
    }
    let b = serde_json::to_vec(body).unwrap_or_default();
    format!("{method} {path} {}", blake3::hash(&b).to_hex())
}

// --- meta ---

/// tined's version and state.
#[derive(Serialize, Deserialize, utoipa::ToSchema)]
pub struct Health {
    pub ok: bool,
    pub version: String,
    /// Identifies the build (executable path and time).
    pub build: String,
    /// The fingerprint of the environment that configures the engine
    /// (host::CONFIG_ENV).
    pub config: String,
    pub pid: u32,
    pub home: String,
    pub uptime_s: u64,
    pub operations_running: usize,
    /// Engine calls running (fork, checkpoint, rm, ...), those whose
    /// client went away included.
    #[serde(default)]
    pub engine_calls_running: usize,
}

#[utoipa::path(get, path = "/v1/health", tag = "meta", responses((status = 200, body = Health)))]
pub async fn health(State(s): State<Shared>) -> Json<Health> {
    Json(Health {
        ok: true,
        version: env!("CARGO_PKG_VERSION").into(),
        build: s.build.clone(),
        config: host::config_fingerprint(),
        pid: std::process::id(),
        home: s.host.home.display().to_string(),
        uptime_s: s.started.elapsed().as_secs(),
        operations_running: s.ops.running(),
        engine_calls_running: crate::state::engine_calls(),
    })
}

#[utoipa::path(post, path = "/v1/shutdown", tag = "meta",
    responses((status = 202, description = "tined exits; vms keep running and the next tined adopts them")))]
pub async fn shutdown(State(s): State<Shared>) -> StatusCode {
    s.shutdown.notify_one();
    StatusCode::ACCEPTED
}

#[utoipa::path(get, path = "/metrics", tag = "meta",
    responses((status = 200, description = "Prometheus text exposition", content_type = "text/plain")))]
pub async fn metrics(State(s): State<Shared>) -> ApiResult<Response> {
    let st = s.clone();
    let sample = blocking(move || Ok(crate::metrics_sample(&st.host))).await?;
    Ok((
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(&sample),
    )
        .into_response())
}

// --- vms ---

#[utoipa::path(get, path = "/v1/vms", tag = "vms",
    responses((status = 200, body = Vec<host::vm::VmInfo>)))]
pub async fn list_vms(State(s): State<Shared>) -> ApiResult<Json<Vec<host::vm::VmInfo>>> {
    let st = s.clone();
    Ok(Json(blocking(move || host::vm::list(&st.host)).await?))
}

#[utoipa::path(get, path = "/v1/vms/{name}", tag = "vms",
    params(("name" = String, Path, description = "The vm")),
    responses((status = 200, body = VmView), (status = 404, body = ErrorBody)))]
pub async fn get_vm(State(s): State<Shared>, Path(name): Path<String>) -> ApiResult<Json<VmView>> {
    let st = s.clone();
    Ok(Json(
        blocking(move || {
            let info = host::vm::info(&st.host, &name)?;
            let keep = crate::keep::read(&host::state::VmDir::new(&st.host.home, &name));
            Ok(VmView { info, keep })
        })
        .await?,
    ))
}

/// A vm, with its keep policy and last keep if it has one.
#[derive(Serialize, utoipa::ToSchema)]
pub struct VmView {
    #[serde(flatten)]
    pub info: host::vm::VmInfo,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keep: Option<crate::keep::Keep>,
}

#[utoipa::path(post, path = "/v1/vms", tag = "vms", request_body = host::vm::RunSpec,
    params(("Idempotency-Key" = Option<String>, Header, description = "Run once per key")),
    responses((status = 201, body = host::vm::RunReport), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "No such image, kernel or snapshot"),
        (status = 409, body = ErrorBody),
        (status = 422, body = ErrorBody, description = "The Idempotency-Key was used for another request")))]
pub async fn run_vm(
    State(s): State<Shared>,
    caller: Option<axum::Extension<crate::serve::Caller>>,
    headers: HeaderMap,
    JsonBody(spec): JsonBody<host::vm::RunSpec>,
) -> ApiResult<Response> {
    absolute_paths(&spec)?;
    let mut named: Vec<&std::path::Path> = spec.disks.iter().map(|d| d.as_path()).collect();
    named.extend(spec.kernel.as_deref());
    named.extend(spec.from.as_deref());
    if spec.image.contains('/') {
        named.push(std::path::Path::new(&spec.image));
    }
    if let Some(t) = spec.cpu_template.as_deref().filter(|t| t.starts_with('/')) {
        named.push(std::path::Path::new(t));
    }
    within_home(&s, caller, &named)?;
    if let Some(every) = spec.keep_every_s {
        crate::keep::check(&spec.name, every)?;
    }
    let fp = fingerprint(&headers, "POST", "/v1/vms", &spec);
    idempotent(&s, &headers, fp, || async {
        let st = s.clone();
        let name = spec.name.clone();
        let kind = if spec.from.is_some() {
            "restored"
        } else {
            "boot"
        };
        let keep = spec.keep_every_s;
        let report = blocking(move || host::vm::start(&st.host, spec)).await?;
        if let Some(every) = keep {
            // Checked above; the vm runs, so only a vanished vm fails here.
            let (st, n) = (s.clone(), name.clone());
            if let Err(e) = blocking(move || crate::keep::set(&st.host, &n, Some(every))).await {
                tracing::warn!(vm = %name, "keep policy not set: {}", e.body.message);
            }
        }
        s.metrics
            .wakes
            .get_or_create(&crate::metrics::KindLabel { kind: kind.into() })
            .inc();
        s.events.emit(
            "vm.started",
            &name,
            serde_json::json!({ "pid": report.pid }),
        );
        Ok((StatusCode::CREATED, raw(&report)?))
    })
    .await
}

/// A client with an API key (or a sandbox token) is not the host's
/// owner: the host files its request names (disks, kernel, snapshot
/// directories, images, CPU templates) must lie in tine's home, or a key
/// would read `/etc/shadow` as a disk or write a snapshot anywhere root
/// can. The owner (Unix socket, `--token-file` token) may name any file,
/// as the CLI does.
fn within_home(
    s: &Shared,
    caller: Option<axum::Extension<crate::serve::Caller>>,
    paths: &[&std::path::Path],
) -> ApiResult<()> {
    if matches!(
        caller.map(|c| c.0),
        None | Some(crate::serve::Caller::Owner)
    ) {
        return Ok(());
    }
    let home = s
        .host
        .home
        .canonicalize()
        .unwrap_or_else(|_| s.host.home.clone());
    for p in paths {
        // A directory still to be made: its nearest existing ancestor.
        let resolved = p
            .ancestors()
            .find_map(|a| a.canonicalize().ok().map(|c| (a, c)))
            .map(|(a, c)| c.join(p.strip_prefix(a).unwrap_or(std::path::Path::new(""))));
        let inside = resolved.is_some_and(|r| {
            r.starts_with(&home) && !r.components().any(|c| c == std::path::Component::ParentDir)
        });
        if !inside {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                format!(
                    "{} is outside tine's home ({}): a client with an API key may name only files there; the host's owner may name any",
                    p.display(),
                    s.host.home.display()
                ),
            ));
        }
    }
    Ok(())
}

/// Every path in a run request is absolute: tined's working directory
/// means nothing to a client (the CLI sends absolute paths).
fn absolute_paths(spec: &host::vm::RunSpec) -> ApiResult<()> {
    let relative = |what: &str, p: &std::path::Path| -> ApiResult<()> {
        if p.is_absolute() {
            Ok(())
        } else {
            Err(ApiError::invalid(format!(
                "{what} must be an absolute path, not {:?}",
                p.display().to_string()
            )))
        }
    };
    if let Some(k) = &spec.kernel {
        relative("kernel", k)?;
    }
    if let Some(f) = &spec.from {
        relative("from (a snapshot directory)", f)?;
    }
    for d in &spec.disks {
        relative("every disk", d)?;
    }
    if spec.image.contains('/') {
        relative("an image directory", std::path::Path::new(&spec.image))?;
    }
    Ok(())
}

/// Vm `name` exists and runs: a long operation on a vm that is not there
/// (404) or does not run (409) is refused at once rather than answered
/// 202 and failed (the operation checks again, under the vm's lock).
async fn vm_runs(s: &Shared, name: &str, doing: &'static str) -> ApiResult<host::vm::VmInfo> {
    let st = s.clone();
    let n = name.to_string();
    blocking(move || {
        host::vm::running_for(&st.host, &n, doing)?;
        host::vm::info(&st.host, &n)
    })
    .await
}

#[derive(Deserialize, utoipa::IntoParams)]
pub struct ForceQuery {
    /// Kill it first if it runs.
    #[serde(default)]
    pub force: bool,
}

#[utoipa::path(delete, path = "/v1/vms/{name}", tag = "vms",
    params(("name" = String, Path), ForceQuery),
    responses((status = 200, body = host::vm::Removed), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub async fn remove_vm(
    State(s): State<Shared>,
    Path(name): Path<String>,
    Query(q): Query<ForceQuery>,
) -> ApiResult<Json<host::vm::Removed>> {
    let st = s.clone();
    let n = name.clone();
    let r = blocking(move || host::tree::remove(&st.host, &n, q.force)).await?;
    s.events.emit(
        if r.what == "branch" {
            "branch.removed"
        } else {
            "vm.removed"
        },
        &name,
        json(&r)?,
    );
    Ok(Json(r))
}

#[derive(Deserialize, Serialize, utoipa::ToSchema)]
pub struct StopSpec {
    /// Seconds to wait for a clean shutdown (default 60).
    #[serde(default)]
    pub timeout_s: Option<u64>,
}

/// How a stop or kill went.
#[derive(Serialize, Deserialize, utoipa::ToSchema)]
pub struct StopReport {
    pub name: String,
    pub stopped: host::vm::Stopped,
}

#[utoipa::path(post, path = "/v1/vms/{name}/stop", tag = "vms", request_body = StopSpec,
    params(("name" = String, Path)), responses((status = 200, body = StopReport)))]
pub async fn stop_vm(
    State(s): State<Shared>,
    Path(name): Path<String>,
    JsonBody(spec): JsonBody<StopSpec>,
) -> ApiResult<Json<StopReport>> {
    let st = s.clone();
    let n = name.clone();
    let timeout = std::time::Duration::from_secs(spec.timeout_s.unwrap_or(60));
    let stopped = blocking(move || host::vm::stop(&st.host, &n, timeout)).await?;
    s.events
        .emit("vm.stopped", &name, serde_json::json!({ "how": stopped }));
    Ok(Json(StopReport { name, stopped }))
}

#[utoipa::path(post, path = "/v1/vms/{name}/kill", tag = "vms",
    params(("name" = String, Path)), responses((status = 200, body = StopReport)))]
pub async fn kill_vm(
    State(s): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<StopReport>> {
    let st = s.clone();
    let n = name.clone();
    let stopped = blocking(move || host::vm::kill(&st.host, &n)).await?;
    s.events
        .emit("vm.stopped", &name, serde_json::json!({ "how": stopped }));
    Ok(Json(StopReport { name, stopped }))
}

#[utoipa::path(post, path = "/v1/vms/{name}/fork", tag = "moments", request_body = host::fork::ForkSpec,
    params(("name" = String, Path),
        ("Idempotency-Key" = Option<String>, Header, description = "Fork once per key")),
    responses((status = 200, body = host::fork::ForkReport), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
        (status = 422, body = ErrorBody, description = "The Idempotency-Key was used for another request")))]
pub async fn fork_vm(
    State(s): State<Shared>,
    Path(name): Path<String>,
    headers: HeaderMap,
    JsonBody(spec): JsonBody<host::fork::ForkSpec>,
) -> ApiResult<Response> {
    let fp = fingerprint(&headers, "POST", &format!("/v1/vms/{name}/fork"), &spec);
    idempotent(&s, &headers, fp, || async {
        let st = s.clone();
        let n = name.clone();
        let report = blocking(move || match crate::fleet::fork_sleeping(&st, &n, &spec)? {
            Some(r) => Ok(r),
            None => host::tree::fork(&st.host, &n, &spec),
        })
        .await?;
        s.metrics.forks.inc();
        if let Some(p) = report.pause_ms {
            s.metrics.fork_pause.observe(p / 1000.0);
        }
        for c in &report.child_running_ms {
            s.metrics.fork_child_running.observe(c / 1000.0);
        }
        s.metrics.fork_total.observe(report.total_ms / 1000.0);
        s.metrics
            .wakes
            .get_or_create(&crate::metrics::KindLabel {
                kind: "child".into(),
            })
            .inc_by(report.children.len() as u64);
        s.events.emit(
            "vm.forked",
            &name,
            serde_json::json!({ "children": report.names, "pause_ms": report.pause_ms }),
        );
        Ok((StatusCode::OK, raw(&report)?))
    })
    .await
}

#[utoipa::path(get, path = "/v1/vms/{name}/checkpoints", tag = "moments",
    params(("name" = String, Path)),
    responses((status = 200, body = Vec<host::fork::CheckpointRecord>)))]
pub async fn list_checkpoints(
    State(s): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<Vec<host::fork::CheckpointRecord>>> {
    let st = s.clone();
    Ok(Json(
        blocking(move || {
            host::vm::info(&st.host, &name)?;
            host::fork::list_checkpoints(&st.host, &name)
        })
        .await?,
    ))
}

#[derive(Deserialize, Serialize, utoipa::ToSchema)]
pub struct CheckpointSpec {
    /// The checkpoint's name (default cp1, cp2, ...).
    #[serde(default)]
    pub tag: Option<String>,
}

#[utoipa::path(post, path = "/v1/vms/{name}/checkpoints", tag = "moments",
    request_body = CheckpointSpec, params(("name" = String, Path)),
    responses((status = 201, body = host::fork::MomentReport), (status = 409, body = ErrorBody)))]
pub async fn create_checkpoint(
    State(s): State<Shared>,
    Path(name): Path<String>,
    JsonBody(spec): JsonBody<CheckpointSpec>,
) -> ApiResult<(StatusCode, Json<host::fork::MomentReport>)> {
    let st = s.clone();
    let n = name.clone();
    let r = blocking(move || host::fork::checkpoint(&st.host, &n, spec.tag)).await?;
    s.events.emit(
        "vm.checkpointed",
        &name,
        serde_json::json!({ "tag": r.tag, "pause_ms": r.pause_ms }),
    );
    Ok((StatusCode::CREATED, Json(r)))
}

#[utoipa::path(delete, path = "/v1/vms/{name}/checkpoints/{tag}", tag = "moments",
    params(("name" = String, Path), ("tag" = String, Path)),
    responses((status = 200, body = host::vm::Removed), (status = 404, body = ErrorBody)))]
pub async fn delete_checkpoint(
    State(s): State<Shared>,
    Path((name, tag)): Path<(String, String)>,
) -> ApiResult<Json<host::vm::Removed>> {
    let st = s.clone();
    let (n, t) = (name.clone(), tag.clone());
    let r = blocking(move || host::fork::delete_checkpoint(&st.host, &n, &t)).await?;
    s.events
        .emit("checkpoint.removed", &format!("{name}@{tag}"), json(&r)?);
    Ok(Json(r))
}

#[derive(Deserialize, Serialize, utoipa::ToSchema)]
pub struct RollbackSpec {
    pub tag: String,
}

#[utoipa::path(post, path = "/v1/vms/{name}/rollback", tag = "moments",
    request_body = RollbackSpec, params(("name" = String, Path)),
    responses((status = 200, body = host::fork::MomentReport), (status = 404, body = ErrorBody)))]
pub async fn rollback_vm(
    State(s): State<Shared>,
    Path(name): Path<String>,
    JsonBody(spec): JsonBody<RollbackSpec>,
) -> ApiResult<Json<host::fork::MomentReport>> {
    let st = s.clone();
    let n = name.clone();
    let r = blocking(move || host::fork::rollback(&st.host, &n, &spec.tag)).await?;
    s.metrics
        .wakes
        .get_or_create(&crate::metrics::KindLabel {
            kind: "rollback".into(),
        })
        .inc();
    s.events
        .emit("vm.rolled_back", &name, serde_json::json!({ "tag": r.tag }));
    Ok(Json(r))
}

/// Starts a long operation on the blocking pool and answers 202 with it.
fn start_operation<T: Serialize + 'static>(
    s: &Shared,
    kind: &'static str,
    target: String,
    event: &'static str,
    f: impl FnOnce(&host::Host, &dyn store::Progress) -> host::Result<T> + Send + 'static,
) -> Response {
    let op = s.ops.start(kind, &target);
    let first = op.get();
    let st = s.clone();
    let h = op.clone();
    tokio::task::spawn_blocking(move || {
        let res = f(&st.host, &*h);
        let res = match res {
            Ok(v) => serde_json::to_value(&v)
                .map_err(|e| ApiError::internal(e.to_string()))
                .map_err(|e| (e.status.as_u16(), e.body)),
            Err(e) => {
                let e = ApiError::from(e);
                Err((e.status.as_u16(), e.body))
            }
        };
        let ok = res.is_ok();
        if let Ok(v) = &res {
            st.events.emit(event, &target, v.clone());
            if kind == "wake" {
                st.metrics
                    .wakes
                    .get_or_create(&crate::metrics::KindLabel {
                        kind: "branch".into(),
                    })
                    .inc();
            }
        }
        h.finish(res);
        st.metrics
            .operations
            .get_or_create(&crate::metrics::KindLabel {
                kind: format!("{kind}.{}", if ok { "ok" } else { "failed" }),
            })
            .inc();
        st.events.emit(
            "operation.finished",
            &h.get().id,
            serde_json::json!({ "kind": kind, "ok": ok }),
        );
    });
    let location = format!("/v1/operations/{}", first.id);
    (
        StatusCode::ACCEPTED,
        [(axum::http::header::LOCATION, location)],
        Json(first),
    )
        .into_response()
}

#[derive(Deserialize, Serialize, utoipa::ToSchema)]
pub struct SnapshotSpec {
    /// The directory to write (absolute; must not hold a snapshot).
    pub dir: String,
}

#[utoipa::path(post, path = "/v1/vms/{name}/snapshot", tag = "moments",
    request_body = SnapshotSpec, params(("name" = String, Path)),
    responses((status = 202, body = Operation, description = "result: MomentReport"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "The vm does not run")))]
pub async fn snapshot_vm(
    State(s): State<Shared>,
    caller: Option<axum::Extension<crate::serve::Caller>>,
    Path(name): Path<String>,
    JsonBody(spec): JsonBody<SnapshotSpec>,
) -> ApiResult<Response> {
    host::state::validate_name(&name).map_err(ApiError::from)?;
    let dir = std::path::PathBuf::from(&spec.dir);
    if !dir.is_absolute() {
        return Err(ApiError::invalid(format!(
            "the snapshot directory must be an absolute path, not {:?}",
            spec.dir
        )));
    }
    within_home(&s, caller, &[&dir])?;
    vm_runs(&s, &name, "be snapshotted").await?;
    Ok(start_operation(
        &s,
        "snapshot",
        name.clone(),
        "vm.snapshotted",
        move |h, _| host::fork::snapshot(h, &name, &dir),
    ))
}

#[utoipa::path(post, path = "/v1/vms/{name}/sleep", tag = "tree",
    params(("name" = String, Path)),
    responses((status = 202, body = Operation, description = "result: SleepReport"),
        (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "The vm does not run")))]
pub async fn sleep_vm(State(s): State<Shared>, Path(name): Path<String>) -> ApiResult<Response> {
    let info = vm_runs(&s, &name, "be put to sleep").await?;
    if let Some(tag) = info.checkpoints.first() {
        return Err(ApiError::from(host::Error::conflict(format!(
            "vm {name:?} has checkpoints ({}); they live in processes and cannot sleep with it: delete them (DELETE /v1/vms/{name}/checkpoints/{tag}) or roll back first",
            info.checkpoints.join(", ")
        ))));
    }
    Ok(start_operation(
        &s,
        "sleep",
        name.clone(),
        "vm.slept",
        move |h, p| host::tree::sleep(h, &name, p),
    ))
}

/// Where to move a vm.
#[derive(Deserialize, Serialize, utoipa::ToSchema)]
pub struct MoveSpec {
    /// The host (default: the one placement picks among the others).
    #[serde(default)]
    pub to: Option<String>,
    /// First store the vm's memory while it runs (a pre-copy round, its
    /// chunks fetched by the target meanwhile), so the downtime pays only
    /// for what it writes after (default true); false: sleep, then wake.
    #[serde(default)]
    pub precopy: Option<bool>,
}

#[utoipa::path(post, path = "/v1/vms/{name}/move", tag = "fleet",
    request_body = MoveSpec, params(("name" = String, Path)),
    responses((status = 202, body = Operation, description = "result: MoveReport"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub async fn move_vm(
    State(s): State<Shared>,
    Path(name): Path<String>,
    JsonBody(spec): JsonBody<MoveSpec>,
) -> ApiResult<Response> {
    vm_runs(&s, &name, "be moved").await?;
    let st = s.clone();
    Ok(start_operation(
        &s,
        "move",
        name.clone(),
        "vm.moved",
        move |_h, p| {
            crate::fleet::move_vm(
                &st,
                &name,
                spec.to.as_deref(),
                spec.precopy.unwrap_or(true),
                p,
            )
        },
    ))
}

#[utoipa::path(get, path = "/v1/vms/{name}/disks", tag = "vms",
    params(("name" = String, Path)),
    responses((status = 200, description = "Each disk's layers, top first")))]
pub async fn disk_layers(
    State(s): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    let st = s.clone();
    let disks = blocking(move || host::vm::disk_layers(&st.host, &name)).await?;
    let v: Vec<Vec<serde_json::Value>> = disks
        .iter()
        .map(|chain| {
            chain
                .iter()
                .map(|l| {
                    serde_json::json!({
                        "path": l.path,
                        "format": format!("{:?}", l.format).to_lowercase(),
                        "virtual_size": l.virtual_size,
                        "allocated_bytes": l.allocated_bytes,
                    })
                })
                .collect()
        })
        .collect();
    Ok(Json(serde_json::json!(v)))
}

/// A contract as TOML text.
#[derive(Deserialize, Serialize, utoipa::ToSchema)]
pub struct ContractBody {
    pub toml: String,
}

#[utoipa::path(get, path = "/v1/vms/{name}/contract", tag = "contract",
    params(("name" = String, Path)), responses((status = 200, body = ContractBody)))]
pub async fn get_contract(
    State(s): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<ContractBody>> {
    let st = s.clone();
    let toml = blocking(move || host::contract::show(&st.host, &name)).await?;
    Ok(Json(ContractBody { toml }))
}

#[utoipa::path(put, path = "/v1/vms/{name}/contract", tag = "contract",
    request_body = ContractBody, params(("name" = String, Path)),
    responses((status = 200, body = ContractBody), (status = 400, body = ErrorBody)))]
pub async fn set_contract(
    State(s): State<Shared>,
    Path(name): Path<String>,
    JsonBody(body): JsonBody<ContractBody>,
) -> ApiResult<Json<ContractBody>> {
    let st = s.clone();
    let toml = blocking(move || host::contract::set(&st.host, &name, &body.toml)).await?;
    Ok(Json(ContractBody { toml }))
}

#[utoipa::path(get, path = "/v1/vms/{name}/secrets", tag = "contract",
    params(("name" = String, Path)),
    responses((status = 200, body = Vec<host::contract::SecretInfo>)))]
pub async fn list_secrets(
    State(s): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<Vec<host::contract::SecretInfo>>> {
    let st = s.clone();
    Ok(Json(
        blocking(move || host::contract::secrets(&st.host, &name)).await?,
    ))
}

/// A secret to write into a vm.
#[derive(Deserialize, Serialize, utoipa::ToSchema)]
pub struct SecretBody {
    #[serde(flatten)]
    pub spec: host::contract::SecretSpec,
    /// The value, base64.
    pub value_b64: String,
}

#[utoipa::path(put, path = "/v1/vms/{name}/secrets/{secret}", tag = "contract",
    request_body = SecretBody, params(("name" = String, Path), ("secret" = String, Path)),
    responses((status = 200, body = host::contract::SecretInfo), (status = 400, body = ErrorBody)))]
pub async fn add_secret(
    State(s): State<Shared>,
    Path((name, secret)): Path<(String, String)>,
    JsonBody(body): JsonBody<SecretBody>,
) -> ApiResult<Json<host::contract::SecretInfo>> {
    use base64::Engine;
    let value = base64::engine::general_purpose::STANDARD
        .decode(body.value_b64.as_bytes())
        .map_err(|e| ApiError::invalid(format!("value_b64 is not base64: {e}")))?;
    let st = s.clone();
    Ok(Json(
        blocking(move || host::contract::add_secret(&st.host, &name, &secret, &body.spec, &value))
            .await?,
    ))
}

#[utoipa::path(get, path = "/v1/vms/{name}/effects", tag = "effects",
    params(("name" = String, Path)),
    responses((status = 200, body = host::gateway::LineageEffects), (status = 404, body = ErrorBody)))]
pub async fn vm_effects(
    State(s): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<host::gateway::LineageEffects>> {
    host::state::validate_name(&name).map_err(ApiError::from)?;
    let st = s.clone();
    Ok(Json(
        blocking(move || host::gateway::lineage_effects(&st.host, &name)).await?,
    ))
}

#[derive(Deserialize, Serialize, utoipa::ToSchema)]
pub struct ResolveSpec {
    pub key: String,
    /// Send it again on the next request (else: treat it as failed).
    pub resend: bool,
}

#[derive(Deserialize, Serialize, utoipa::ToSchema)]
pub struct Resolved {
    pub effect: i64,
    pub resend: bool,
}

#[utoipa::path(post, path = "/v1/vms/{name}/effects/resolve", tag = "effects",
    request_body = ResolveSpec, params(("name" = String, Path)),
    responses((status = 200, body = Resolved), (status = 404, body = ErrorBody)))]
pub async fn resolve_effect(
    State(s): State<Shared>,
    Path(name): Path<String>,
    JsonBody(spec): JsonBody<ResolveSpec>,
) -> ApiResult<Json<Resolved>> {
    host::state::validate_name(&name).map_err(ApiError::from)?;
    let st = s.clone();
    let resend = spec.resend;
    let effect =
        blocking(move || host::gateway::resolve(&st.host, &name, &spec.key, spec.resend)).await?;
    Ok(Json(Resolved { effect, resend }))
}

// --- the tree ---

#[utoipa::path(get, path = "/v1/branches", tag = "tree",
    responses((status = 200, description = "Every branch of the store (running, sleeping, gone)")))]
pub async fn list_branches(State(s): State<Shared>) -> ApiResult<Json<serde_json::Value>> {
    let st = s.clone();
    let t = blocking(move || host::tree::store_tree(&st.host)).await?;
    Ok(Json(json(&t.branches)?))
}

#[utoipa::path(delete, path = "/v1/branches/{name}", tag = "tree",
    params(("name" = String, Path)),
    responses((status = 200, body = host::vm::Removed), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "The name is a vm's")))]
pub async fn remove_branch(
    State(s): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<host::vm::Removed>> {
    let st = s.clone();
    let n = name.clone();
    blocking(move || {
        host::state::validate_name(&n)?;
        if host::state::VmDir::new(&st.host.home, &n).exists() {
            return Err(host::Error::conflict(format!(
                "{n:?} is a vm, not a sleeping branch: remove it with DELETE /v1/vms/{n}"
            )));
        }
        Ok(())
    })
    .await?;
    remove_vm(State(s), Path(name), Query(ForceQuery { force: false })).await
}

#[utoipa::path(post, path = "/v1/branches/{name}/wake", tag = "tree",
    request_body = host::tree::WakeSpec, params(("name" = String, Path)),
    responses((status = 202, body = Operation, description = "result: RunReport"),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub async fn wake_branch(
    State(s): State<Shared>,
    Path(name): Path<String>,
    JsonBody(spec): JsonBody<host::tree::WakeSpec>,
) -> ApiResult<Response> {
    // In a fleet the wake may belong on another host: there it runs as
    // that host's operation, which this one follows.
    let st = s.clone();
    let (b, pinned) = (name.clone(), spec.host.clone());
    let remote = blocking(move || crate::fleet::decide_wake(&st, &b, pinned.as_deref())).await?;
    if let Some(p) = remote {
        let mut spec = spec;
        spec.host = Some(p.host.clone());
        let path = format!("/v1/branches/{name}/wake");
        return Ok(start_operation(
            &s,
            "wake",
            name.clone(),
            "branch.woken",
            move |_h, _p| {
                let body = serde_json::to_value(&spec)?;
                crate::fleet::remote_operation(&p.address, &path, &body)
            },
        ));
    }
    // What can be told at once is (the wake checks again, under its locks).
    let st = s.clone();
    let (branch, new) = (name.clone(), spec.name.clone());
    blocking(move || {
        let home = &st.host.home;
        host::state::validate_name(&branch)?;
        let target = new.unwrap_or_else(|| branch.clone());
        host::state::validate_name(&target)?;
        if !host::tree::has_branch_in(home, &branch) {
            return Err(host::Error::not_found(format!(
                "no branch named {branch:?} in the store (see GET /v1/branches)"
            )));
        }
        if host::state::VmDir::new(home, &target).exists() {
            return Err(host::Error::conflict(format!(
                "a vm named {target:?} exists already; wake the branch under another name (`name` in the request; `tine wake {branch} --name NEW`)"
            )));
        }
        Ok(())
    })
    .await?;
    Ok(start_operation(
        &s,
        "wake",
        name.clone(),
        "branch.woken",
        move |h, p| host::tree::wake(h, &name, &spec, p),
    ))
}

#[utoipa::path(get, path = "/v1/snapshots", tag = "tree",
    responses((status = 200, description = "The store's committed snapshots with own and shared bytes")))]
pub async fn list_snapshots(State(s): State<Shared>) -> ApiResult<Json<serde_json::Value>> {
    let st = s.clone();
    let t = blocking(move || host::tree::store_tree(&st.host)).await?;
    Ok(Json(json(&t.snapshots)?))
}

#[utoipa::path(get, path = "/v1/tree", tag = "tree",
    responses((status = 200, body = host::tree::Lineage)))]
pub async fn lineage(State(s): State<Shared>) -> ApiResult<Json<host::tree::Lineage>> {
    let st = s.clone();
    Ok(Json(blocking(move || host::tree::lineage(&st.host)).await?))
}

#[utoipa::path(get, path = "/v1/tree/store", tag = "tree",
    responses((status = 200, description = "The store's tree: snapshots, branches, totals")))]
pub async fn store_tree(State(s): State<Shared>) -> ApiResult<Json<serde_json::Value>> {
    let st = s.clone();
    let t = blocking(move || host::tree::store_tree(&st.host)).await?;
    Ok(Json(json(&t)?))
}

#[utoipa::path(post, path = "/v1/gc", tag = "tree",
    responses((status = 202, body = Operation, description = "result: GcReport")))]
pub async fn gc(State(s): State<Shared>) -> Response {
    start_operation(&s, "gc", "store".into(), "gc.done", |h, p| {
        host::tree::gc(h, p)
    })
}

/// A snapshot to bring into this host's chunk cache.
#[derive(Deserialize, Serialize, utoipa::ToSchema)]
pub struct PrefetchSpec {
    /// A committed snapshot of the (shared) tree.
    pub snapshot: i64,
}

#[utoipa::path(post, path = "/v1/store/prefetch", tag = "fleet",
    request_body = PrefetchSpec,
    responses((status = 202, body = Operation, description = "result: PrefetchReport (a move's target fetches the pre-copied snapshot)"),
        (status = 400, body = ErrorBody)))]
pub async fn prefetch(State(s): State<Shared>, JsonBody(spec): JsonBody<PrefetchSpec>) -> Response {
    start_operation(
        &s,
        "prefetch",
        "store".into(),
        "store.prefetched",
        move |h, p| host::tree::prefetch(h, spec.snapshot, p),
    )
}

#[utoipa::path(post, path = "/v1/store/verify", tag = "tree",
    responses((status = 202, body = Operation, description = "result: the store's VerifyReport")))]
pub async fn verify(State(s): State<Shared>) -> Response {
    start_operation(&s, "verify", "store".into(), "verify.done", |h, p| {
        host::tree::verify(h, p)
    })
}

// --- images ---

#[utoipa::path(get, path = "/v1/images", tag = "images",
    responses((status = 200, description = "Built images")))]
pub async fn list_images(State(s): State<Shared>) -> ApiResult<Json<serde_json::Value>> {
    let st = s.clone();
    let v = blocking(move || Ok(crate::images::list(&st.host.home))).await?;
    Ok(Json(v))
}

#[utoipa::path(post, path = "/v1/images", tag = "images",
    request_body = crate::images::BuildSpec,
    responses((status = 202, body = Operation, description = "result: the image manifest"),
        (status = 400, body = ErrorBody)))]
pub async fn build_image(
    State(s): State<Shared>,
    JsonBody(spec): JsonBody<crate::images::BuildSpec>,
) -> ApiResult<Response> {
    crate::images::check(&spec)?;
    let target = spec.kind.clone();
    Ok(start_operation(
        &s,
        "image_build",
        target,
        "image.built",
        move |h, p| crate::images::build(&h.home, &spec, p),
    ))
}

// --- the effects gateway ---

/// The gateway's status.
#[derive(Serialize, Deserialize, utoipa::ToSchema)]
pub struct GatewayStatus {
    pub running: bool,
    #[schema(value_type = Option<Object>)]
    pub status: Option<effects::control::Status>,
}

#[utoipa::path(get, path = "/v1/gateway", tag = "effects",
    responses((status = 200, body = GatewayStatus)))]
pub async fn gateway_status(State(s): State<Shared>) -> ApiResult<Json<GatewayStatus>> {
    let st = s.clone();
    let status = blocking(move || Ok(host::gateway::status(&st.host))).await?;
    Ok(Json(GatewayStatus {
        running: status.is_some(),
        status,
    }))
}

#[derive(Deserialize, Serialize, utoipa::ToSchema)]
pub struct GatewayControl {
    /// `start` or `stop`.
    pub action: String,
}

#[utoipa::path(post, path = "/v1/gateway", tag = "effects", request_body = GatewayControl,
    responses((status = 200, body = GatewayStatus)))]
pub async fn gateway_control(
    State(s): State<Shared>,
    JsonBody(c): JsonBody<GatewayControl>,
) -> ApiResult<Json<GatewayStatus>> {
    let st = s.clone();
    let status = match c.action.as_str() {
        "start" => Some(blocking(move || host::gateway::start(&st.host)).await?),
        "stop" => {
            blocking(move || host::gateway::stop(&st.host)).await?;
            None
        }
        other => {
            return Err(ApiError::invalid(format!(
                "action {other:?}: say start or stop"
            )))
        }
    };
    Ok(Json(GatewayStatus {
        running: status.is_some(),
        status,
    }))
}

// --- operations ---

#[utoipa::path(get, path = "/v1/operations", tag = "operations",
    responses((status = 200, body = Vec<Operation>)))]
pub async fn list_operations(State(s): State<Shared>) -> Json<Vec<Operation>> {
    Json(s.ops.all())
}

#[derive(Deserialize, utoipa::IntoParams)]
pub struct WaitQuery {
    /// Wait up to this many seconds for it to finish.
    #[serde(default)]
    pub wait: Option<u64>,
}

#[utoipa::path(get, path = "/v1/operations/{id}", tag = "operations",
    params(("id" = String, Path), WaitQuery),
    responses((status = 200, body = Operation), (status = 404, body = ErrorBody)))]
pub async fn get_operation(
    State(s): State<Shared>,
    Path(id): Path<String>,
    Query(q): Query<WaitQuery>,
) -> ApiResult<Json<Operation>> {
    let op = s
        .ops
        .get(&id)
        .ok_or_else(|| ApiError::not_found(format!("no operation {id:?} (see /v1/operations)")))?;
    if let Some(secs) = q.wait {
        let mut rx = op.subscribe();
        let deadline = std::time::Duration::from_secs(secs.min(600));
        let _ = tokio::time::timeout(deadline, async {
            while rx.borrow().state == crate::ops::OpState::Running {
                if rx.changed().await.is_err() {
                    break;
                }
            }
        })
        .await;
    }
    Ok(Json(op.get()))
}

// --- API keys ---

/// Key management is the host owner's alone: over the Unix socket, or with
/// the token tined was started with; never with a key.
fn owner_only(caller: Option<axum::Extension<crate::serve::Caller>>) -> ApiResult<()> {
    match caller.map(|c| c.0) {
        None | Some(crate::serve::Caller::Owner) => Ok(()),
        Some(_) => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "API keys are managed by the host's owner only (tined's Unix socket, `tine keys`, or its --token-file token)",
        )),
    }
}

/// A key to make.
#[derive(Deserialize, utoipa::ToSchema)]
pub struct NewKeySpec {
    /// What the key is for (1-64 printable characters).
    pub name: String,
}

#[utoipa::path(get, path = "/v1/keys", tag = "meta",
    responses((status = 200, body = Vec<crate::keys::KeyInfo>), (status = 403, body = ErrorBody)))]
pub async fn list_keys(
    State(s): State<Shared>,
    caller: Option<axum::Extension<crate::serve::Caller>>,
) -> ApiResult<Json<Vec<crate::keys::KeyInfo>>> {
    owner_only(caller)?;
    Ok(Json(s.keys.list()))
}

#[utoipa::path(post, path = "/v1/keys", tag = "meta", request_body = NewKeySpec,
    responses((status = 201, body = crate::keys::NewKey, description = "The key: shown this once"),
        (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)))]
pub async fn create_key(
    State(s): State<Shared>,
    caller: Option<axum::Extension<crate::serve::Caller>>,
    JsonBody(spec): JsonBody<NewKeySpec>,
) -> ApiResult<(StatusCode, Json<crate::keys::NewKey>)> {
    owner_only(caller)?;
    let k = s.keys.create(&spec.name)?;
    s.events.emit(
        "key.created",
        &k.info.id,
        serde_json::json!({ "name": k.info.name }),
    );
    Ok((StatusCode::CREATED, Json(k)))
}

#[utoipa::path(delete, path = "/v1/keys/{id}", tag = "meta",
    params(("id" = String, Path, description = "The key's id or name")),
    responses((status = 200, description = "Revoked: `{\"revoked\": ID}`"), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub async fn delete_key(
    State(s): State<Shared>,
    caller: Option<axum::Extension<crate::serve::Caller>>,
    Path(id): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    owner_only(caller)?;
    if !s.keys.remove(&id)? {
        return Err(ApiError::not_found(format!(
            "no API key {id:?} (see GET /v1/keys)"
        )));
    }
    s.events.emit("key.revoked", &id, serde_json::json!({}));
    Ok(Json(serde_json::json!({ "revoked": id })))
}

// --- the fleet ---

/// The fleet's hosts, and the vms of lost hosts (each with the snapshot
/// it started from, if it was a woken branch).
#[derive(Serialize, utoipa::ToSchema)]
pub struct HostsView {
    /// This host's id (absent when it is in no fleet).
    pub this: Option<String>,
    /// The metadata database (password hidden).
    pub meta: Option<String>,
    #[schema(value_type = Vec<Object>)]
    pub hosts: Vec<fleet::HostRow>,
    /// vms their hosts listed last before they were lost.
    #[schema(value_type = Vec<Object>)]
    pub lost_vms: Vec<fleet::VmRow>,
}

#[utoipa::path(get, path = "/v1/hosts", tag = "fleet",
    responses((status = 200, body = HostsView)))]
pub async fn list_hosts(State(s): State<Shared>) -> ApiResult<Json<HostsView>> {
    let st = s.clone();
    let view = blocking(move || {
        let Some(m) = st.fleet.get() else {
            return Ok(HostsView {
                this: None,
                meta: None,
                hosts: vec![],
                lost_vms: vec![],
            });
        };
        let err = |e: fleet::FleetError| host::Error::internal(e.to_string());
        let hosts = m.fleet.hosts().map_err(err)?;
        let lost: std::collections::HashSet<&str> = hosts
            .iter()
            .filter(|h| h.state == fleet::HostState::Lost)
            .map(|h| h.id.as_str())
            .collect();
        let lost_vms = m
            .fleet
            .vms()
            .map_err(err)?
            .into_iter()
            .filter(|v| lost.contains(v.host.as_str()))
            .collect();
        Ok(HostsView {
            this: Some(m.id.clone()),
            meta: Some(m.fleet.describe()),
            hosts,
            lost_vms,
        })
    })
    .await?;
    Ok(Json(view))
}

#[utoipa::path(delete, path = "/v1/hosts/{id}", tag = "fleet", params(("id" = String, Path)),
    responses((status = 200, description = "{\"removed\": id}"), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub async fn forget_host(
    State(s): State<Shared>,
    Path(id): Path<String>,
) -> ApiResult<Json<serde_json::Value>> {
    let st = s.clone();
    blocking(move || {
        let m = st
            .fleet
            .get()
            .ok_or_else(|| host::Error::not_found("this tined is in no fleet"))?;
        let err = |e: fleet::FleetError| host::Error::internal(e.to_string());
        let h =
            m.fleet.host(&id).map_err(err)?.ok_or_else(|| {
                host::Error::not_found(format!("no host {id:?} (see `tine hosts`)"))
            })?;
        if h.state == fleet::HostState::Up {
            return Err(host::Error::conflict(format!(
                "host {id:?} is up (heartbeat {} ms ago); stop its tined first",
                host::state::now_ms() as i64 - h.heartbeat_ms
            )));
        }
        m.fleet.forget(&id).map_err(err)?;
        Ok(serde_json::json!({ "removed": id }))
    })
    .await
    .map(Json)
}

#[utoipa::path(get, path = "/v1/branches/{name}/placement", tag = "fleet", params(("name" = String, Path)),
    responses((status = 200, body = crate::fleet::PlacementView, description = "Where a wake would go now (nothing is woken)"),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody, description = "No host can take it: each host's reasons")))]
pub async fn branch_placement(
    State(s): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<crate::fleet::PlacementView>> {
    let st = s.clone();
    Ok(Json(
        blocking(move || crate::fleet::placement_of(&st, &name)).await?,
    ))
}

#[utoipa::path(get, path = "/v1/hosts/self/offer", tag = "fleet",
    responses((status = 200, description = "What this host offers a snapshot (the JSON TINE_HOST_OFFER reads)")))]
pub async fn host_offer(State(s): State<Shared>) -> ApiResult<Json<serde_json::Value>> {
    let st = s.clone();
    blocking(move || {
        let m = st
            .fleet
            .get()
            .ok_or_else(|| host::Error::not_found("this tined is in no fleet"))?;
        let h = m
            .fleet
            .host(&m.id)
            .map_err(|e| host::Error::internal(e.to_string()))?
            .ok_or_else(|| host::Error::not_found("this host has no row"))?;
        Ok(serde_json::to_value(&h.offer)?)
    })
    .await
    .map(Json)
}
