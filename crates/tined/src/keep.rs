//! Keep: an opt-in policy that snapshots a running vm into the store
//! every N seconds, so a host loss costs at most N seconds of its work.
//! A keep is the engine's fork into one child put to sleep at once (the
//! vm pauses only for the fork); the child's sleeping branch
//! `NAME.keep-SEQ` is the keep. The previous keep branch is removed only
//! after the new one is committed and recorded: one keep branch per vm,
//! and never none once there was one.
//!
//! The policy and the last keep live in `vms/NAME/keep.json` (written
//! whole or not at all), so a restarted tined resumes it and the fleet
//! heartbeat reports the last keep's snapshot as the vm's.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::state::Shared;

/// The shortest period: each keep pauses the vm for a fork and writes a
/// snapshot to the store; more often than this the keeps would queue
/// behind each other and the store's churn outweigh the work saved.
pub const MIN_EVERY_S: u64 = 5;

/// A vm's keep policy and its last keep.
#[derive(Clone, Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Keep {
    /// The period in seconds (`None`: no policy; the last keep stays).
    #[serde(default)]
    pub every_s: Option<u64>,
    /// The store snapshot of the last keep.
    #[serde(default)]
    pub last_snapshot: Option<i64>,
    /// The sleeping branch that holds it (wake it to resume the vm).
    #[serde(default)]
    pub last_branch: Option<String>,
    /// When it was taken (unix ms).
    #[serde(default)]
    pub last_ms: Option<u64>,
    /// Why the last attempt failed, if it did (cleared by a keep).
    #[serde(default)]
    pub last_error: Option<String>,
    /// The number of the last keep branch made.
    #[serde(default)]
    pub seq: u64,
}

/// `PUT /v1/vms/{name}/keep`.
#[derive(Debug, Deserialize, Serialize, utoipa::ToSchema)]
pub struct KeepSpec {
    /// Snapshot the vm this often (seconds, at least 5).
    pub every_s: u64,
}

/// Read-modify-writes of keep.json (the API's and the task's) go one at
/// a time, so a policy cleared during a keep stays cleared. Held only
/// around the file, never across the engine's calls.
static FILE: Mutex<()> = Mutex::new(());

fn path(vm: &host::state::VmDir) -> std::path::PathBuf {
    vm.dir.join("keep.json")
}

/// The keep record of `vm` (`None`: it never had a policy).
pub fn read(vm: &host::state::VmDir) -> Option<Keep> {
    let text = std::fs::read_to_string(path(vm)).ok()?;
    serde_json::from_str(&text).ok()
}

/// Changes the keep record of `vm` in one step.
fn update(vm: &host::state::VmDir, f: impl FnOnce(&mut Keep)) -> host::Result<Keep> {
    let _g = FILE.lock().unwrap_or_else(|e| e.into_inner());
    if !vm.exists() {
        return Err(host::Error::not_found(format!("no vm named {:?}", vm.name)));
    }
    let mut k = read(vm).unwrap_or_default();
    f(&mut k);
    let bytes = serde_json::to_vec_pretty(&k)
        .map_err(|e| host::Error::invalid(format!("keep record: {e}")))?;
    host::state::write_atomic(&path(vm), &bytes)?;
    Ok(k)
}

/// The snapshot of `vm`'s last keep: what a surviving host should wake
/// it from.
pub fn last_snapshot(vm: &host::state::VmDir) -> Option<i64> {
    read(vm).and_then(|k| k.last_snapshot)
}

/// Whether vm `name` may keep every `every_s` seconds.
pub fn check(name: &str, every_s: u64) -> host::Result<()> {
    host::state::validate_name(name)?;
    if every_s < MIN_EVERY_S {
        return Err(host::Error::invalid(format!(
            "keep every {every_s} s: at least {MIN_EVERY_S} s"
        )));
    }
    // The keep branch is NAME.keep-SEQ: refuse a name too long for it
    // now rather than fail every period.
    host::state::validate_name(&branch_name(name, u64::from(u32::MAX))).map_err(|_| {
        host::Error::invalid(format!(
            "vm name {name:?} is too long for keep branches ({name}.keep-N must fit in 48 characters)"
        ))
    })
}

/// Sets (`Some`) or clears `name`'s policy.
pub fn set(h: &host::Host, name: &str, every_s: Option<u64>) -> host::Result<Keep> {
    host::state::validate_name(name)?;
    if let Some(s) = every_s {
        check(name, s)?;
    }
    let vm = host::state::VmDir::new(&h.home, name);
    update(&vm, |k| k.every_s = every_s)
}

fn branch_name(name: &str, seq: u64) -> String {
    format!("{name}.keep-{seq}")
}

/// One keep of running vm `name`: fork into one child, sleep the child,
/// record it, then remove the previous keep branch.
fn keep_one(h: &host::Host, name: &str) -> host::Result<Keep> {
    let vm = host::state::VmDir::new(&h.home, name);
    // The number is taken before the attempt, so a failed one that left a
    // branch behind never blocks the next.
    let seq = update(&vm, |k| k.seq += 1)?.seq;
    let child = branch_name(name, seq);
    let spec = host::fork::ForkSpec {
        names: Some(vec![child.clone()]),
        ..Default::default()
    };
    let report = host::tree::fork(h, name, &spec)?;
    let started = report.results.first().is_some_and(|r| r.ok);
    let slept = if started {
        host::tree::sleep(h, &child, &store::NoProgress)
    } else {
        let why = report
            .results
            .first()
            .and_then(|r| r.error.clone())
            .unwrap_or_else(|| "the fork made no child".into());
        Err(host::Error::conflict(format!("fork into {child}: {why}")))
    };
    let slept = match slept {
        Ok(s) => s,
        Err(e) => {
            // Nothing half-made stays: the child vm (or a branch it left).
            let _ = host::tree::remove(h, &child, true);
            return Err(e);
        }
    };
    let mut previous = None;
    let recorded = update(&vm, |k| {
        previous = k.last_branch.take();
        k.last_snapshot = Some(slept.snapshot);
        k.last_branch = Some(child.clone());
        k.last_ms = Some(host::state::now_ms());
        k.last_error = None;
    });
    let k = match recorded {
        Ok(k) => k,
        Err(e) => {
            // The vm went away during the keep: nothing records this
            // branch, so it would only leak.
            let _ = host::tree::remove(h, &child, false);
            return Err(e);
        }
    };
    if let Some(old) = previous.filter(|o| *o != child) {
        if let Err(e) = host::tree::remove(h, &old, false) {
            tracing::warn!(vm = %name, branch = %old, "keep: cannot remove the previous keep branch: {e}");
        }
    }
    Ok(k)
}

/// The running vms whose last keep (or attempt) is a period old.
fn due(h: &host::Host, tried: &HashMap<String, u64>) -> Vec<String> {
    let now = host::state::now_ms();
    let mut out = Vec::new();
    for vm in host::state::list(&h.home).unwrap_or_default() {
        let Some(k) = read(&vm) else { continue };
        let Some(every) = k.every_s else { continue };
        let Ok(r) = vm.read_record() else { continue };
        if vm.state(&r) != host::state::VmState::Running {
            continue;
        }
        // Never kept (nor tried since this tined started): keep it now.
        let last = k
            .last_ms
            .into_iter()
            .chain(tried.get(&vm.name).copied())
            .max();
        match last {
            Some(t) if now.saturating_sub(t) < every * 1000 => {}
            _ => out.push(vm.name.clone()),
        }
    }
    out
}

/// Keeps the vms with a policy, checking once a second, for as long as
/// tined runs. Keeps go one at a time; a failed one is logged, emitted
/// as `vm.keep_failed`, and retried a period later; the vm runs on.
pub async fn run(s: Shared) {
    let mut tried: HashMap<String, u64> = HashMap::new();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let st = s.clone();
        let t = tried.clone();
        let names = tokio::task::spawn_blocking(move || due(&st.host, &t))
            .await
            .unwrap_or_default();
        for name in names {
            tried.insert(name.clone(), host::state::now_ms());
            let st = s.clone();
            let n = name.clone();
            let res = tokio::task::spawn_blocking(move || {
                let res = keep_one(&st.host, &n);
                if let Err(e) = &res {
                    let vm = host::state::VmDir::new(&st.host.home, &n);
                    let msg = e.to_string();
                    let _ = update(&vm, |k| k.last_error = Some(msg));
                }
                res
            })
            .await;
            match res {
                Ok(Ok(k)) => s.events.emit(
                    "vm.kept",
                    &name,
                    serde_json::json!({"branch": k.last_branch, "snapshot": k.last_snapshot}),
                ),
                Ok(Err(e)) => {
                    tracing::warn!(vm = %name, "keep failed (retried next period): {e}");
                    s.events.emit(
                        "vm.keep_failed",
                        &name,
                        serde_json::json!({"error": e.to_string()}),
                    );
                }
                Err(e) => tracing::warn!(vm = %name, "keep task: {e}"),
            }
        }
        // Forget vms that are gone.
        let home = s.host.home.clone();
        tried.retain(|n, _| host::state::VmDir::new(&home, n).exists());
    }
}

// --- API ---

use axum::extract::{Path, State};
use axum::Json;

use crate::error::{ApiResult, ErrorBody};
use crate::state::{blocking, JsonBody};

#[utoipa::path(get, path = "/v1/vms/{name}/keep", tag = "vms",
    params(("name" = String, Path)),
    responses((status = 200, body = Keep, description = "The policy and the last keep (all empty: never kept)"),
        (status = 404, body = ErrorBody)))]
pub async fn get_keep(State(s): State<Shared>, Path(name): Path<String>) -> ApiResult<Json<Keep>> {
    Ok(Json(
        blocking(move || {
            host::state::validate_name(&name)?;
            let vm = host::state::VmDir::new(&s.host.home, &name);
            if !vm.exists() {
                return Err(host::Error::not_found(format!("no vm named {name:?}")));
            }
            Ok(read(&vm).unwrap_or_default())
        })
        .await?,
    ))
}

#[utoipa::path(put, path = "/v1/vms/{name}/keep", tag = "vms",
    request_body = KeepSpec, params(("name" = String, Path)),
    responses((status = 200, body = Keep), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)))]
pub async fn put_keep(
    State(s): State<Shared>,
    Path(name): Path<String>,
    JsonBody(spec): JsonBody<KeepSpec>,
) -> ApiResult<Json<Keep>> {
    let k = blocking(move || set(&s.host, &name, Some(spec.every_s))).await?;
    Ok(Json(k))
}

#[utoipa::path(delete, path = "/v1/vms/{name}/keep", tag = "vms",
    params(("name" = String, Path)),
    responses((status = 200, body = Keep, description = "No more keeps; the last keep branch stays"),
        (status = 404, body = ErrorBody)))]
pub async fn delete_keep(
    State(s): State<Shared>,
    Path(name): Path<String>,
) -> ApiResult<Json<Keep>> {
    Ok(Json(blocking(move || set(&s.host, &name, None)).await?))
}
