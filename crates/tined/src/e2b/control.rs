//! E2B's control API: sandboxes, their lifetime, forks and snapshots.
//!
//! A sandbox's record (records.rs) is written before its vm is made and
//! removed after it is gone, so a crash in between leaves a record whose
//! vm never came, which the next look drops; never a vm no record names.

use std::collections::BTreeMap;
use std::time::Duration;

use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::records::{OnTimeout, Sandbox, Snapshot};
use super::{
    answer, finished, new_id, not_found, place, rfc3339, unsupported, E2bError, E2bResult, Place,
    DEFAULT_TEMPLATE, ENVD_VERSION,
};
use crate::state::{blocking, JsonBody, Shared};

/// E2B's default lifetime of a sandbox, and its longest.
const DEFAULT_TIMEOUT_S: u64 = 300;
const MAX_TIMEOUT_S: u64 = 86_400;
/// E2B's default lifetime of a fork's children (SandboxForkRequest).
const FORK_TIMEOUT_S: u64 = 15;
/// Most children of one fork (E2B's bound).
const MAX_FORK: usize = 20;
/// How long a timeout that could not be acted on waits to be tried again.
const RETRY_EXPIRY_MS: u64 = 60_000;

fn now_ms() -> u64 {
    host::state::now_ms()
}

/// A lifetime in seconds, checked.
fn lifetime(t: Option<u64>, default: u64) -> E2bResult<u64> {
    let t = t.unwrap_or(default);
    if !(1..=MAX_TIMEOUT_S).contains(&t) {
        return Err(E2bError(
            StatusCode::BAD_REQUEST,
            format!("timeout {t} s is not between 1 s and {MAX_TIMEOUT_S} s (24 h)"),
        ));
    }
    Ok(t)
}

/// What POST /sandboxes, connect and fork answer for a sandbox.
fn sandbox_json(r: &Sandbox) -> Value {
    json!({
        "templateID": r.template,
        "sandboxID": r.id,
        "clientID": "tine",
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": r.envd_token,
        "trafficAccessToken": null,
        "domain": null,
    })
}

/// A listed sandbox (ListedSandbox, and SandboxDetail's fields).
fn listed_json(r: &Sandbox, paused: bool) -> Value {
    let mut v = json!({
        "templateID": r.template,
        "sandboxID": r.id,
        "clientID": "tine",
        "startedAt": rfc3339(r.started_ms),
        "endAt": rfc3339(r.end_ms),
        "cpuCount": r.cpu_count,
        "memoryMB": r.memory_mb,
        "diskSizeMB": 0,
        "state": if paused { "paused" } else { "running" },
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": r.envd_token,
        "metadata": r.metadata,
        "lifecycle": {
            "autoResume": r.auto_resume,
            "onTimeout": match r.on_timeout { OnTimeout::Kill => "kill", OnTimeout::Pause => "pause" },
        },
        "domain": null,
    });
    if paused {
        v["pauseMode"] = json!("full");
    }
    v
}

/// A sandbox's record, or 404.
fn record(s: &Shared, id: &str) -> E2bResult<Sandbox> {
    s.e2b.sandbox(id).ok_or_else(|| not_found(id))
}

/// How long a request waits for another one's change to a sandbox (a
/// pause, a wake, a removal) before it answers from wherever it stands.
const SETTLE_MAX: Duration = Duration::from_secs(300);

/// Waits while `id` is held by a change in flight: between a pause's
/// start and its end the vm is neither running nor sleeping, and a
/// reader must not answer 404 for a sandbox that is on its way.
async fn settle(s: &Shared, id: &str) {
    let t0 = std::time::Instant::now();
    while s.e2b.is_busy(id) && t0.elapsed() < SETTLE_MAX {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Holds `id` for a change of this request's own, once no other change
/// holds it (after SETTLE_MAX: 409, try again).
async fn hold<'a>(s: &'a Shared, id: &str) -> E2bResult<super::records::Held<'a>> {
    let t0 = std::time::Instant::now();
    loop {
        if let Some(h) = s.e2b.hold(id) {
            return Ok(h);
        }
        if t0.elapsed() >= SETTLE_MAX {
            return Err(E2bError(
                StatusCode::CONFLICT,
                format!("sandbox {id:?} is being changed by another request; try again"),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Where sandbox `id` is once no change to it is in flight.
async fn where_is(s: &Shared, id: &str) -> E2bResult<Place> {
    settle(s, id).await;
    place_now(s, id).await
}

/// Where sandbox `id` is now, from the engine (for a request that holds it).
async fn place_now(s: &Shared, id: &str) -> E2bResult<Place> {
    let st = s.clone();
    let id = id.to_string();
    Ok(blocking(move || Ok(place(&st.host, &id))).await?)
}

/// Sets a sandbox's end; a record that cannot be written is a 500.
fn set_end(s: &Shared, id: &str, f: impl FnOnce(&mut Sandbox)) -> E2bResult<()> {
    match s.e2b.update_sandbox(id, f) {
        Ok(true) => Ok(()),
        Ok(false) => Err(not_found(id)),
        Err(e) => Err(crate::error::ApiError::from(e).into()),
    }
}

#[derive(Deserialize, Default)]
struct AutoResume {
    #[serde(default)]
    enabled: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID", default)]
    template_id: Option<String>,
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    auto_pause: Option<bool>,
    #[serde(default)]
    auto_pause_memory: Option<bool>,
    #[serde(default)]
    auto_resume: Option<AutoResume>,
    // E2B's own document spells this one in snake case.
    #[serde(default, alias = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    #[serde(default)]
    network: Option<Value>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    #[serde(default)]
    mcp: Option<Value>,
    #[serde(default)]
    iam: Option<Value>,
    #[serde(default)]
    volume_mounts: Option<Value>,
}

/// Whether a request field is set to something (not absent, null, {} or []).
fn given(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => !o.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(_) => true,
    }
}

/// The sandbox id an `Idempotency-Key` names (so a retry finds the
/// sandbox its first try made), or a new one.
fn id_for(headers: &HeaderMap) -> E2bResult<String> {
    let Some(key) = headers.get("idempotency-key") else {
        return new_id("sbx");
    };
    let key = key
        .to_str()
        .ok()
        .filter(|k| (1..=255).contains(&k.len()))
        .ok_or_else(|| {
            E2bError(
                StatusCode::BAD_REQUEST,
                "the Idempotency-Key header must be 1-255 visible characters".into(),
            )
        })?;
    Ok(format!(
        "sbx-{}",
        &blake3::hash(key.as_bytes()).to_hex()[..12]
    ))
}

/// A template's tine image: E2B's commands run under /bin/bash, so its
/// `base` is tine's `debian` image (`minimal` has only busybox's sh).
fn image_of(template: &str) -> &str {
    match template {
        "" | "base" => "debian",
        other => other,
    }
}

pub async fn create(
    State(s): State<Shared>,
    headers: HeaderMap,
    JsonBody(spec): JsonBody<NewSandbox>,
) -> E2bResult<Response> {
    for (set, what) in [
        (given(&spec.volume_mounts), "volume mounts"),
        (given(&spec.network), "network rules (a sandbox's network is tine's: its contract)"),
        (given(&spec.mcp), "MCP servers"),
        (given(&spec.iam), "workload identity (iam)"),
        (
            spec.allow_internet_access == Some(false),
            "allowInternetAccess false (a tine vm reaches out only through the effects gateway; its contract's [effects] section denies what it must not do)",
        ),
        (
            spec.auto_pause_memory == Some(false),
            "filesystem-only pauses (autoPauseMemory false): a pause keeps the memory",
        ),
    ] {
        if set {
            return Err(unsupported(what));
        }
    }
    let timeout_s = lifetime(spec.timeout, DEFAULT_TIMEOUT_S)?;
    let on_timeout = match spec.auto_pause {
        Some(true) => OnTimeout::Pause,
        _ => OnTimeout::Kill,
    };
    let auto_resume = spec.auto_resume.unwrap_or_default().enabled;
    if auto_resume && on_timeout != OnTimeout::Pause {
        return Err(E2bError(
            StatusCode::BAD_REQUEST,
            "autoResume needs autoPause: only a paused sandbox resumes".into(),
        ));
    }
    let template = spec
        .template_id
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| DEFAULT_TEMPLATE.to_string());
    let id = id_for(&headers)?;
    if let Some(existing) = s.e2b.sandbox(&id) {
        if s.e2b.is_busy(&id) {
            return Err(E2bError(
                StatusCode::CONFLICT,
                "a create with this Idempotency-Key is still in progress; retry in a moment".into(),
            ));
        }
        if existing.template != template {
            return Err(E2bError(
                StatusCode::UNPROCESSABLE_ENTITY,
                "this Idempotency-Key was used to create another sandbox; use a new key".into(),
            ));
        }
        let mut res = (StatusCode::CREATED, Json(sandbox_json(&existing))).into_response();
        res.headers_mut()
            .insert("idempotent-replay", HeaderValue::from_static("true"));
        return Ok(res);
    }
    let Some(_held) = s.e2b.hold(&id) else {
        return Err(E2bError(
            StatusCode::CONFLICT,
            "a create with this Idempotency-Key is still in progress; retry in a moment".into(),
        ));
    };
    let token = crate::keys::random_hex(16).map_err(|e| {
        E2bError(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("no randomness: {e}"),
        )
    })?;
    let now = now_ms();
    let mut r = Sandbox {
        id: id.clone(),
        template: template.clone(),
        metadata: spec.metadata.unwrap_or_default(),
        env_vars: spec.env_vars.unwrap_or_default(),
        started_ms: now,
        end_ms: now + timeout_s * 1000,
        timeout_s,
        on_timeout,
        auto_resume,
        envd_token: token,
        cpu_count: 0,
        memory_mb: 0,
    };
    s.e2b
        .put_sandbox(r.clone())
        .map_err(|e| E2bError::from(crate::error::ApiError::from(e)))?;
    if let Err(e) = start(&s, &id, &template).await {
        s.e2b.drop_sandbox(&id);
        return Err(e);
    }
    let st = s.clone();
    let n = id.clone();
    if let Ok(info) = blocking(move || host::vm::info(&st.host, &n)).await {
        r.cpu_count = u32::from(info.vcpus);
        r.memory_mb = info.mem_mib;
        let _ = s.e2b.update_sandbox(&id, |x| {
            x.cpu_count = r.cpu_count;
            x.memory_mb = r.memory_mb;
        });
    }
    // Its lifetime counts from when it is ready.
    let _ = s
        .e2b
        .update_sandbox(&id, |x| x.end_ms = now_ms() + timeout_s * 1000);
    Ok((StatusCode::CREATED, Json(sandbox_json(&r))).into_response())
}

/// Starts sandbox `id` from `template`: a wake of the sleeping branch of
/// that name (a snapshot), or a vm booted from the image.
async fn start(s: &Shared, id: &str, template: &str) -> E2bResult<()> {
    let st = s.clone();
    let t = template.to_string();
    let snapshot = blocking(move || {
        Ok(host::state::validate_name(&t).is_ok() && host::tree::is_sleeping(&st.host, &t))
    })
    .await?;
    if snapshot {
        let op = answer(
            crate::app::wake_branch(
                State(s.clone()),
                Path(template.to_string()),
                JsonBody(host::tree::WakeSpec {
                    name: Some(id.to_string()),
                    ..Default::default()
                }),
            )
            .await,
        )
        .await?;
        finished(s, op).await?;
        return Ok(());
    }
    let spec: host::vm::RunSpec =
        serde_json::from_value(json!({"name": id, "image": image_of(template)}))
            .map_err(|e| E2bError(StatusCode::BAD_REQUEST, e.to_string()))?;
    // The template comes from an E2B client: confined like a key's run.
    let caller = Some(axum::Extension(crate::serve::Caller::Key));
    let res = crate::app::run_vm(State(s.clone()), caller, HeaderMap::new(), JsonBody(spec)).await;
    match answer(res).await {
        Ok(_) => Ok(()),
        Err(E2bError(status, msg))
            if status == StatusCode::BAD_REQUEST && msg.contains("image") =>
        {
            Err(E2bError(
                StatusCode::NOT_FOUND,
                format!("template {template:?} is neither a snapshot nor a tine image: {msg}"),
            ))
        }
        Err(e) => Err(e),
    }
}

#[derive(Deserialize, Default)]
pub struct ListQuery {
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    metadata: Option<String>,
    #[serde(default)]
    template: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default, rename = "nextToken")]
    next_token: Option<String>,
}

/// Every sandbox now, with whether it is paused; records whose vm and
/// branch are gone are dropped.
async fn all(s: &Shared) -> Vec<(Sandbox, bool)> {
    let mut recs = s.e2b.sandboxes();
    recs.sort_by(|a, b| (a.started_ms, &a.id).cmp(&(b.started_ms, &b.id)));
    let st = s.clone();
    let places = blocking(move || {
        Ok(recs
            .into_iter()
            .map(|r| {
                let p = place(&st.host, &r.id);
                (r, p)
            })
            .collect::<Vec<_>>())
    })
    .await
    .unwrap_or_default();
    let mut out = Vec::new();
    for (r, p) in places {
        match p {
            Place::Running => out.push((r, false)),
            Place::Paused => out.push((r, true)),
            Place::Gone if !s.e2b.is_busy(&r.id) => s.e2b.drop_sandbox(&r.id),
            Place::Gone | Place::Ended(_) => {}
        }
    }
    out
}

pub async fn list(State(s): State<Shared>, Query(q): Query<ListQuery>) -> E2bResult<Response> {
    let states: Vec<String> = q
        .state
        .as_deref()
        .map(|st| st.split(',').map(|x| x.trim().to_string()).collect())
        .unwrap_or_else(|| vec!["running".into(), "paused".into()]);
    if let Some(bad) = states
        .iter()
        .find(|x| !matches!(x.as_str(), "running" | "paused"))
    {
        return Err(E2bError(
            StatusCode::BAD_REQUEST,
            format!("state {bad:?} is not running or paused"),
        ));
    }
    let wanted: Vec<(String, String)> = match &q.metadata {
        Some(m) => serde_urlencoded::from_str(m).map_err(|e| {
            E2bError(
                StatusCode::BAD_REQUEST,
                format!("metadata {m:?} is not key=value pairs: {e}"),
            )
        })?,
        None => Vec::new(),
    };
    let offset: usize = match &q.next_token {
        Some(t) => t.parse().map_err(|_| {
            E2bError(
                StatusCode::BAD_REQUEST,
                format!("nextToken {t:?} is not one tined gave"),
            )
        })?,
        None => 0,
    };
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let matching: Vec<Value> = all(&s)
        .await
        .into_iter()
        .filter(|(r, paused)| {
            states.iter().any(|x| (x == "paused") == *paused)
                && wanted
                    .iter()
                    .all(|(k, v)| r.metadata.get(k).is_some_and(|x| x == v))
                && q.template.as_ref().is_none_or(|t| &r.template == t)
        })
        .map(|(r, paused)| listed_json(&r, paused))
        .collect();
    let page: Vec<Value> = matching.iter().skip(offset).take(limit).cloned().collect();
    let mut res = Json(Value::Array(page)).into_response();
    if offset + limit < matching.len() {
        if let Ok(v) = HeaderValue::from_str(&(offset + limit).to_string()) {
            res.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(res)
}

pub async fn detail(State(s): State<Shared>, Path(id): Path<String>) -> E2bResult<Json<Value>> {
    let r = record(&s, &id)?;
    match where_is(&s, &id).await? {
        Place::Running => Ok(Json(listed_json(&r, false))),
        Place::Paused => Ok(Json(listed_json(&r, true))),
        Place::Ended(why) => Err(E2bError(
            StatusCode::NOT_FOUND,
            format!("sandbox {id:?} was not found running: {why} (tine ls; remove it with kill)"),
        )),
        Place::Gone => Err(not_found(&id)),
    }
}

/// Removes a sandbox wherever it is (kill, and a timeout's kill); the
/// caller holds `id`.
async fn remove(s: &Shared, id: &str) -> E2bResult<()> {
    let res = match place_now(s, id).await? {
        Place::Running | Place::Ended(_) => {
            let q = Query(crate::app::ForceQuery { force: true });
            crate::app::remove_vm(State(s.clone()), Path(id.to_string()), q)
                .await
                .map(drop)
        }
        Place::Paused => crate::app::remove_branch(State(s.clone()), Path(id.to_string()))
            .await
            .map(drop),
        Place::Gone => {
            let known = s.e2b.sandbox(id).is_some();
            s.e2b.drop_sandbox(id);
            return if known { Ok(()) } else { Err(not_found(id)) };
        }
    };
    res?;
    s.e2b.drop_sandbox(id);
    Ok(())
}

pub async fn kill(State(s): State<Shared>, Path(id): Path<String>) -> E2bResult<StatusCode> {
    let _held = hold(&s, &id).await?;
    remove(&s, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct PauseRequest {
    #[serde(default)]
    memory: Option<bool>,
    #[allow(dead_code)]
    #[serde(default)]
    require_healthy_guest: Option<bool>,
}

/// Puts a running sandbox to sleep (pause, and a timeout's pause).
async fn sleep(s: &Shared, id: &str) -> E2bResult<()> {
    let op = answer(crate::app::sleep_vm(State(s.clone()), Path(id.to_string())).await).await?;
    finished(s, op).await?;
    Ok(())
}

pub async fn pause(
    State(s): State<Shared>,
    Path(id): Path<String>,
    body: Option<Json<PauseRequest>>,
) -> E2bResult<StatusCode> {
    let req = body.map(|b| b.0).unwrap_or_default();
    if req.memory == Some(false) {
        return Err(unsupported(
            "filesystem-only pauses (memory false): a pause keeps the memory",
        ));
    }
    let _held = hold(&s, &id).await?;
    match place_now(&s, &id).await? {
        Place::Running => {}
        Place::Paused => {
            return Err(E2bError(
                StatusCode::CONFLICT,
                format!("sandbox {id:?} is already paused"),
            ))
        }
        _ => return Err(not_found(&id)),
    }
    sleep(&s, &id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Wakes sandbox `id` if it is paused (envd's automatic resume); a
/// concurrent pause or wake is waited for, so two requests wake it once.
pub(super) async fn wake_if_paused(s: &Shared, id: &str, timeout_s: u64) -> E2bResult<()> {
    let _held = hold(s, id).await?;
    if place_now(s, id).await? == Place::Paused {
        wake(s, id, timeout_s).await?;
    }
    Ok(())
}

/// Wakes a paused sandbox and gives it `timeout_s` from now; the caller
/// holds `id`.
async fn wake(s: &Shared, id: &str, timeout_s: u64) -> E2bResult<()> {
    let op = answer(
        crate::app::wake_branch(
            State(s.clone()),
            Path(id.to_string()),
            JsonBody(Default::default()),
        )
        .await,
    )
    .await?;
    finished(s, op).await?;
    set_end(s, id, |r| r.end_ms = now_ms() + timeout_s * 1000)
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ConnectRequest {
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    memory: Option<bool>,
    #[serde(default)]
    auto_pause: Option<bool>,
}

/// Connects to a running sandbox (200; its end moves later if this asks
/// for more), or resumes a paused one (201).
pub async fn connect(
    State(s): State<Shared>,
    Path(id): Path<String>,
    body: Option<Json<ConnectRequest>>,
) -> E2bResult<Response> {
    let req = body.map(|b| b.0).unwrap_or_default();
    if req.memory == Some(false) {
        return Err(unsupported(
            "resuming without memory (a cold boot from the disk)",
        ));
    }
    let timeout_s = lifetime(req.timeout, DEFAULT_TIMEOUT_S)?;
    let r = record(&s, &id)?;
    let _held = hold(&s, &id).await?;
    let status = match place_now(&s, &id).await? {
        Place::Running => {
            set_end(&s, &id, |r| {
                r.end_ms = r.end_ms.max(now_ms() + timeout_s * 1000)
            })?;
            StatusCode::OK
        }
        Place::Paused => {
            wake(&s, &id, timeout_s).await?;
            StatusCode::CREATED
        }
        _ => return Err(not_found(&id)),
    };
    Ok((status, Json(sandbox_json(&r))).into_response())
}

/// The older resume: a paused sandbox only (409 when it runs).
pub async fn resume(
    State(s): State<Shared>,
    Path(id): Path<String>,
    body: Option<Json<ConnectRequest>>,
) -> E2bResult<Response> {
    let req = body.map(|b| b.0).unwrap_or_default();
    let timeout_s = lifetime(req.timeout, DEFAULT_TIMEOUT_S)?;
    let r = record(&s, &id)?;
    let _held = hold(&s, &id).await?;
    match place_now(&s, &id).await? {
        Place::Paused => {}
        Place::Running => {
            return Err(E2bError(
                StatusCode::CONFLICT,
                format!("sandbox {id:?} is already running"),
            ))
        }
        _ => return Err(not_found(&id)),
    }
    if let Some(p) = req.auto_pause {
        set_end(&s, &id, |r| {
            r.on_timeout = if p { OnTimeout::Pause } else { OnTimeout::Kill }
        })?;
    }
    wake(&s, &id, timeout_s).await?;
    Ok((StatusCode::CREATED, Json(sandbox_json(&r))).into_response())
}

#[derive(Deserialize)]
pub struct TimeoutRequest {
    timeout: u64,
}

pub async fn set_timeout(
    State(s): State<Shared>,
    Path(id): Path<String>,
    JsonBody(req): JsonBody<TimeoutRequest>,
) -> E2bResult<StatusCode> {
    let t = lifetime(Some(req.timeout), DEFAULT_TIMEOUT_S)?;
    if matches!(where_is(&s, &id).await?, Place::Gone | Place::Ended(_)) {
        return Err(not_found(&id));
    }
    set_end(&s, &id, |r| {
        r.end_ms = now_ms() + t * 1000;
        r.timeout_s = t;
    })?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
pub struct RefreshRequest {
    #[serde(default)]
    duration: Option<u64>,
}

pub async fn refresh(
    State(s): State<Shared>,
    Path(id): Path<String>,
    body: Option<Json<RefreshRequest>>,
) -> E2bResult<StatusCode> {
    let r = record(&s, &id)?;
    let t = lifetime(body.and_then(|b| b.0.duration), r.timeout_s)?;
    set_end(&s, &id, |r| r.end_ms = r.end_ms.max(now_ms() + t * 1000))?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize, Default)]
pub struct ForkRequest {
    #[serde(default)]
    timeout: Option<u64>,
    #[serde(default)]
    count: Option<usize>,
}

/// E2B's fork: the sandbox is forked in place (tine's fork: it pauses
/// for the moment only) into `count` new sandboxes; one result per child,
/// a sandbox or an error. A paused sandbox forks too (its children wake
/// from its snapshot).
pub async fn fork(
    State(s): State<Shared>,
    Path(id): Path<String>,
    body: Option<Json<ForkRequest>>,
) -> E2bResult<Response> {
    let req = body.map(|b| b.0).unwrap_or_default();
    let count = req.count.unwrap_or(1);
    if !(1..=MAX_FORK).contains(&count) {
        return Err(E2bError(
            StatusCode::BAD_REQUEST,
            format!("count {count} is not between 1 and {MAX_FORK}"),
        ));
    }
    let timeout_s = lifetime(req.timeout, FORK_TIMEOUT_S)?;
    let parent = record(&s, &id)?;
    if !matches!(where_is(&s, &id).await?, Place::Running | Place::Paused) {
        return Err(not_found(&id));
    }
    let now = now_ms();
    let mut kids = Vec::new();
    for _ in 0..count {
        let token = crate::keys::random_hex(16).map_err(|e| {
            E2bError(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("no randomness: {e}"),
            )
        })?;
        kids.push(Sandbox {
            id: new_id("sbx")?,
            started_ms: now,
            end_ms: now + timeout_s * 1000,
            timeout_s,
            envd_token: token,
            ..parent.clone()
        });
    }
    let held: Vec<_> = kids.iter().filter_map(|k| s.e2b.hold(&k.id)).collect();
    for k in &kids {
        s.e2b
            .put_sandbox(k.clone())
            .map_err(|e| E2bError::from(crate::error::ApiError::from(e)))?;
    }
    let spec = host::fork::ForkSpec {
        names: Some(kids.iter().map(|k| k.id.clone()).collect()),
        ..Default::default()
    };
    let report = answer(
        crate::app::fork_vm(
            State(s.clone()),
            Path(id.clone()),
            HeaderMap::new(),
            JsonBody(spec),
        )
        .await,
    )
    .await;
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            for k in &kids {
                s.e2b.drop_sandbox(&k.id);
            }
            return Err(e);
        }
    };
    let results: Vec<Value> = report["results"].as_array().cloned().unwrap_or_default();
    let mut out = Vec::new();
    for k in &kids {
        let r = results.iter().find(|r| r["name"] == k.id.as_str());
        match r {
            Some(r) if r["ok"] == true => {
                let _ = s
                    .e2b
                    .update_sandbox(&k.id, |x| x.end_ms = now_ms() + timeout_s * 1000);
                out.push(json!({"sandbox": sandbox_json(k)}));
            }
            other => {
                let msg = other
                    .and_then(|r| r["error"].as_str())
                    .unwrap_or("the fork did not start this child")
                    .to_string();
                // No half-made sandbox is left behind.
                let _ = remove(&s, &k.id).await;
                s.e2b.drop_sandbox(&k.id);
                out.push(json!({"error": {"code": 500, "message": msg}}));
            }
        }
    }
    drop(held);
    Ok((StatusCode::CREATED, Json(Value::Array(out))).into_response())
}

#[derive(Deserialize, Default)]
pub struct SnapshotRequest {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    memory: Option<bool>,
}

fn snapshot_json(r: &Snapshot) -> Value {
    json!({"snapshotID": r.id, "names": [r.id]})
}

/// A snapshot of a running sandbox that keeps running: a fork into one
/// child named after the snapshot, put to sleep at once (its branch in
/// the store is the snapshot; `Sandbox.create(snapshot_id)` wakes it).
pub async fn create_snapshot(
    State(s): State<Shared>,
    Path(id): Path<String>,
    body: Option<Json<SnapshotRequest>>,
) -> E2bResult<Response> {
    let req = body.map(|b| b.0).unwrap_or_default();
    if req.memory == Some(false) {
        return Err(unsupported(
            "filesystem-only snapshots (memory false): a snapshot keeps the memory",
        ));
    }
    record(&s, &id)?;
    match where_is(&s, &id).await? {
        Place::Running => {}
        Place::Paused => {
            return Err(E2bError(
                StatusCode::CONFLICT,
                format!("sandbox {id:?} is paused: connect to it, then snapshot it"),
            ))
        }
        _ => return Err(not_found(&id)),
    }
    let snap = match req.name {
        Some(n) => {
            host::state::validate_name(&n)
                .map_err(|e| E2bError(StatusCode::BAD_REQUEST, e.to_string()))?;
            n
        }
        None => new_id("snap")?,
    };
    let st = s.clone();
    let n = snap.clone();
    let taken = blocking(move || {
        Ok(host::tree::has_branch_in(&st.host.home, &n)
            || host::state::VmDir::new(&st.host.home, &n).exists())
    })
    .await?;
    let Some(_held) = s
        .e2b
        .hold(&snap)
        .filter(|_| !taken && s.e2b.snapshot(&snap).is_none())
    else {
        return Err(E2bError(
            StatusCode::CONFLICT,
            format!("the name {snap:?} is taken: delete that snapshot first (Sandbox.delete_snapshot), or pick another name"),
        ));
    };
    let r = Snapshot {
        id: snap.clone(),
        sandbox: id.clone(),
        created_ms: now_ms(),
    };
    s.e2b
        .put_snapshot(r.clone())
        .map_err(|e| E2bError::from(crate::error::ApiError::from(e)))?;
    let made = async {
        let spec = host::fork::ForkSpec {
            names: Some(vec![snap.clone()]),
            ..Default::default()
        };
        let report = answer(
            crate::app::fork_vm(
                State(s.clone()),
                Path(id.clone()),
                HeaderMap::new(),
                JsonBody(spec),
            )
            .await,
        )
        .await?;
        if report["results"][0]["ok"] != true {
            let why = report["results"][0]["error"]
                .as_str()
                .unwrap_or("it did not start");
            return Err(E2bError(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the snapshot's copy of {id:?} failed: {why}"),
            ));
        }
        sleep(&s, &snap).await
    }
    .await;
    if let Err(e) = made {
        if s.e2b.sandbox(&snap).is_none() {
            let q = Query(crate::app::ForceQuery { force: true });
            let _ = crate::app::remove_vm(State(s.clone()), Path(snap.clone()), q).await;
        }
        s.e2b.drop_snapshot(&snap);
        return Err(e);
    }
    Ok((StatusCode::CREATED, Json(snapshot_json(&r))).into_response())
}

#[derive(Deserialize, Default)]
pub struct SnapshotQuery {
    #[serde(default, rename = "sandboxID")]
    sandbox_id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default, rename = "nextToken")]
    next_token: Option<String>,
}

pub async fn list_snapshots(
    State(s): State<Shared>,
    Query(q): Query<SnapshotQuery>,
) -> E2bResult<Response> {
    let mut recs = s.e2b.snapshots();
    recs.sort_by(|a, b| (a.created_ms, &a.id).cmp(&(b.created_ms, &b.id)));
    let st = s.clone();
    let ids: Vec<String> = recs.iter().map(|r| r.id.clone()).collect();
    let sleeping = blocking(move || {
        Ok(ids
            .iter()
            .map(|i| host::tree::is_sleeping(&st.host, i))
            .collect::<Vec<_>>())
    })
    .await?;
    let mut live = Vec::new();
    for (r, asleep) in recs.into_iter().zip(sleeping) {
        if asleep {
            live.push(r);
        } else if !s.e2b.is_busy(&r.id) {
            s.e2b.drop_snapshot(&r.id);
        }
    }
    let offset: usize = q
        .next_token
        .as_deref()
        .map(|t| t.parse().unwrap_or(usize::MAX))
        .unwrap_or(0);
    let limit = q.limit.unwrap_or(100).clamp(1, 1000);
    let matching: Vec<Value> = live
        .iter()
        .filter(|r| q.sandbox_id.as_ref().is_none_or(|x| &r.sandbox == x))
        .filter(|r| {
            q.name
                .as_ref()
                .is_none_or(|n| r.id == n.split(':').next().unwrap_or(n))
        })
        .map(snapshot_json)
        .collect();
    let page: Vec<Value> = matching.iter().skip(offset).take(limit).cloned().collect();
    let mut res = Json(Value::Array(page)).into_response();
    if offset.saturating_add(limit) < matching.len() {
        if let Ok(v) = HeaderValue::from_str(&(offset + limit).to_string()) {
            res.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(res)
}

/// `Sandbox.delete_snapshot`: DELETE /templates/{id} of a snapshot.
pub async fn delete_template(
    State(s): State<Shared>,
    Path(id): Path<String>,
) -> E2bResult<StatusCode> {
    let name = id.split(':').next().unwrap_or(&id).to_string();
    if s.e2b.snapshot(&name).is_none() {
        return Err(E2bError(
            StatusCode::NOT_FOUND,
            format!("no snapshot {name:?} (templates that are tine images are not deleted through E2B's API)"),
        ));
    }
    let res = crate::app::remove_branch(State(s.clone()), Path(name.clone())).await;
    match res {
        Ok(_) => {}
        Err(e) if e.status == StatusCode::NOT_FOUND => {}
        Err(e) => return Err(e.into()),
    }
    s.e2b.drop_snapshot(&name);
    Ok(StatusCode::NO_CONTENT)
}

/// Acts on every running sandbox whose time is up, as its lifecycle says
/// (sleep or remove), once a second, for as long as tined runs. A
/// timeout that cannot be acted on is tried again a minute later.
pub async fn expire(s: Shared) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let now = now_ms();
        for r in s.e2b.sandboxes() {
            if r.end_ms > now {
                continue;
            }
            let Some(_held) = s.e2b.hold(&r.id) else {
                continue;
            };
            match place_now(&s, &r.id).await {
                Ok(Place::Running) => {}
                _ => continue,
            }
            let done = match r.on_timeout {
                OnTimeout::Kill => remove(&s, &r.id).await,
                OnTimeout::Pause => sleep(&s, &r.id).await,
            };
            match done {
                Ok(()) => tracing::info!(sandbox = %r.id, action = ?r.on_timeout, "e2b: timeout"),
                Err(E2bError(_, e)) => {
                    tracing::warn!(sandbox = %r.id, "e2b: cannot act on the timeout: {e}");
                    let _ = s
                        .e2b
                        .update_sandbox(&r.id, |x| x.end_ms = now_ms() + RETRY_EXPIRY_MS);
                }
            }
        }
    }
}
