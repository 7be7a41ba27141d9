//! This tined as a member of the fleet (crates/fleet): it registers its
//! host at start, renews a heartbeat lease with its capacity and vms, and
//! sends a wake it is asked for to the host placement picks, where it
//! runs as an operation of that host's tined; this one's operation
//! follows it, so a client sees one operation wherever the vm lands.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;

use crate::state::Shared;

/// This host in the fleet.
#[derive(Debug)]
pub struct Member {
    pub fleet: fleet::Fleet,
    pub id: String,
    /// The registering process, `BOOT_ID:PID:START`.
    pub owner: String,
    /// How other tineds reach this one.
    pub address: String,
    pub interval: Duration,
    pub lease_ms: i64,
}

/// The heartbeat's period (`TINE_HEARTBEAT_MS`, default 2 s); a host
/// misses three before it is lost.
fn interval() -> Duration {
    let ms = std::env::var("TINE_HEARTBEAT_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .filter(|&ms| (50..=60_000).contains(&ms))
        .unwrap_or(2000);
    Duration::from_millis(ms)
}

/// This host's id: `--host-id`, else `TINE_HOST_ID`, else the one kept
/// in `$TINE_HOME/host-id` (made once from the hostname and a random
/// suffix, so two homes on one machine differ).
fn host_id(home: &Path, given: Option<String>) -> anyhow::Result<String> {
    let id = match given.or_else(|| std::env::var("TINE_HOST_ID").ok()) {
        Some(id) => id,
        None => {
            let file = home.join("host-id");
            match std::fs::read_to_string(&file) {
                Ok(s) if !s.trim().is_empty() => s.trim().to_string(),
                _ => {
                    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
                        .unwrap_or_else(|_| "host".into());
                    let suffix =
                        effects::random_id().unwrap_or_else(|_| host::state::now_ms().to_string());
                    let id = format!("{}-{}", name.trim(), &suffix[..suffix.len().min(6)]);
                    host::state::write_atomic(&file, id.as_bytes())?;
                    id
                }
            }
        }
    };
    host::state::validate_name(&id).map_err(|e| anyhow::anyhow!("host id {id:?}: {e}"))?;
    Ok(id)
}

/// What this host offers a snapshot: probed from /dev/kvm, or read from
/// `TINE_HOST_OFFER` (a JSON file: tests and operators narrow a host's
/// offer with it, e.g. to hold a fleet to a common CPU baseline).
fn offer() -> anyhow::Result<snapshot::compat::HostCompat> {
    if let Ok(path) = std::env::var("TINE_HOST_OFFER") {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("TINE_HOST_OFFER: cannot read {path}"))?;
        return serde_json::from_str(&text)
            .with_context(|| format!("TINE_HOST_OFFER: {path} is not a host offer (JSON as `GET /v1/hosts/self/offer` prints)"));
    }
    Ok(vmm::compat::host_compat(Path::new("/dev/kvm"))?)
}

/// The vms this host runs, and its capacity with them.
fn census(h: &host::Host) -> (Vec<fleet::VmRow>, fleet::Capacity) {
    let mut rows = Vec::new();
    let mut mem = 0;
    for vm in host::state::list(&h.home).unwrap_or_default() {
        let Ok(r) = vm.read_record() else { continue };
        let state = vm.state(&r);
        if state == host::state::VmState::Running {
            mem += r.mem_mib;
        }
        rows.push(fleet::VmRow {
            name: r.name.clone(),
            host: String::new(),
            state: state.to_string(),
            mem_mib: r.mem_mib,
            vcpus: u64::from(r.vcpus),
            // Its last keep, if it has one, is newer than its wake.
            snapshot: crate::keep::last_snapshot(&vm).or_else(|| host::branches::vm_snapshot(&vm)),
            updated_ms: 0,
        });
    }
    let running = rows.iter().filter(|r| r.state == "running").count() as u64;
    (rows, fleet::Capacity::probe(running, mem))
}

/// Registers this host (`TINE_META` picks the database).
pub fn join(
    h: &host::Host,
    given_id: Option<String>,
    advertise: Option<String>,
) -> anyhow::Result<Member> {
    let url = fleet::MetaUrl::parse(
        std::env::var("TINE_META").ok().as_deref(),
        // Not in store/: its existence means "this home has a store".
        h.home.join("fleet.db"),
    )?;
    let fleet = fleet::Fleet::open(&url)?;
    let id = host_id(&h.home, given_id)?;
    let address =
        advertise.unwrap_or_else(|| format!("unix:{}", h.home.join("tined.sock").display()));
    if !(address.starts_with("unix:/") || address.starts_with("http://")) {
        anyhow::bail!("--advertise {address:?}: say unix:/path/to/tined.sock or http://host:port");
    }
    let interval = interval();
    let lease_ms = 3 * interval.as_millis() as i64;
    let owner = store::lease::owner();
    let (_, capacity) = census(h);
    fleet.register(&fleet::Registration {
        id: id.clone(),
        address: address.clone(),
        owner: owner.clone(),
        offer: offer()?,
        capacity,
        lease_ms,
        owner_gone: store::lease::gone,
    })?;
    Ok(Member {
        fleet,
        id,
        owner,
        address,
        interval,
        lease_ms,
    })
}

/// Renews the lease until the process ends.
pub async fn heartbeat(state: Shared, m: Arc<Member>) {
    loop {
        tokio::time::sleep(m.interval).await;
        let (st, m2) = (state.clone(), m.clone());
        let res = tokio::task::spawn_blocking(move || {
            let (vms, cap) = census(&st.host);
            m2.fleet
                .heartbeat(&m2.id, &m2.owner, &cap, &vms, m2.lease_ms)
        })
        .await;
        match res {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!("fleet heartbeat: {e}"),
            Err(e) => tracing::warn!("fleet heartbeat: {e}"),
        }
    }
}

/// Where a wake of `branch` goes: `None` here, else the host chosen.
pub fn decide_wake(
    st: &Shared,
    branch: &str,
    pinned: Option<&str>,
) -> host::Result<Option<fleet::Placement>> {
    let Some(m) = st.fleet.get() else {
        return match pinned {
            Some(p) => Err(host::Error::invalid(format!(
                "host {p:?}: this tined is in no fleet (it failed to register; see tined.log)"
            ))),
            None => Ok(None),
        };
    };
    if pinned == Some(m.id.as_str()) || (pinned.is_none() && !m.fleet.shared()) {
        return Ok(None);
    }
    let needs = host::tree::branch_needs(&st.host, branch)?;
    let hosts = m.fleet.hosts().map_err(fleet_err)?;
    let need = fleet::Need {
        mem_mib: needs.mem_mib,
        vcpus: needs.vcpus as u64,
        compat: Some(needs.compat),
    };
    let candidates: Vec<fleet::HostRow> = match pinned {
        Some(p) => {
            let h: Vec<_> = hosts.into_iter().filter(|h| h.id == p).collect();
            if h.is_empty() {
                return Err(host::Error::not_found(format!(
                    "no host {p:?} in the fleet (see `tine hosts`)"
                )));
            }
            h
        }
        None => hosts,
    };
    let p = fleet::place(&candidates, &need, Some(&m.id))
        .map_err(|r| host::Error::conflict(format!("cannot wake {branch:?}: {r}")))?;
    Ok((p.host != m.id).then_some(p))
}

/// A fork of a sleeping branch in a shared fleet: each child wakes on the
/// host placement picks for it (they spread once a host fills). `None`:
/// not this case (no shared fleet, or `branch` is not sleeping), the
/// engine forks it here.
pub fn fork_sleeping(
    st: &Shared,
    branch: &str,
    spec: &host::fork::ForkSpec,
) -> host::Result<Option<host::fork::ForkReport>> {
    let Some(m) = st.fleet.get() else {
        return Ok(None);
    };
    if !m.fleet.shared() || !host::branches::is_sleeping(&st.host, branch) {
        return Ok(None);
    }
    let h = &st.host;
    let names = host::fork::child_names(h, branch, spec)?;
    let needs = host::tree::branch_needs(h, branch)?;
    let hosts = m.fleet.hosts().map_err(fleet_err)?;
    let need = fleet::Need {
        mem_mib: needs.mem_mib,
        vcpus: needs.vcpus as u64,
        compat: Some(needs.compat),
    };
    let placed = fleet::place_many(&hosts, &need, names.len(), Some(&m.id))
        .map_err(|r| host::Error::conflict(format!("cannot fork {branch:?}: {r}")))?;
    let by_name: std::collections::HashMap<&str, &fleet::Placement> = names
        .iter()
        .map(String::as_str)
        .zip(placed.iter())
        .collect();
    let path = format!("/v1/branches/{branch}/wake");
    let mut report = host::tree::fork_sleeping_by(h, branch, spec, &names, &|n, w| {
        let p = by_name
            .get(n)
            .ok_or_else(|| host::Error::internal(format!("no placement for {n:?}")))?;
        if p.host == m.id {
            return host::tree::wake(h, branch, w, &store::NoProgress)
                .map_err(|e| e.context(format!("cannot wake {n:?} from {branch:?}")));
        }
        let mut w = w.clone();
        w.host = Some(p.host.clone());
        let v = remote_operation(&p.address, &path, &serde_json::to_value(&w)?)?;
        Ok(serde_json::from_value(v)?)
    })?;
    report.hosts = placed.iter().map(|p| p.host.clone()).collect();
    Ok(Some(report))
}

/// What a move did.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct MoveReport {
    pub name: String,
    pub from: String,
    pub to: String,
    /// The pre-copy round, if there was one: the vm ran on meanwhile.
    pub precopy: Option<PrecopyRound>,
    /// The sleep on this host (after a pre-copy round, a diff: the pages
    /// written since).
    #[schema(value_type = Object)]
    pub sleep: host::tree::SleepReport,
    /// The wake on the other one.
    #[schema(value_type = Object)]
    pub wake: serde_json::Value,
    /// From the start of the sleep until the vm ran on `to`: the most the
    /// guest was stopped (its own pause is part of it).
    pub downtime_ms: f64,
}

/// A move's pre-copy round, while the vm ran.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct PrecopyRound {
    /// The snapshot the move's sleep stores its diff over.
    pub snapshot: i64,
    /// The vm's pause to take the round's moment.
    pub pause_ms: f64,
    /// Storing it (the vm running).
    pub store_ms: f64,
    /// Bytes new in the backend.
    pub new_stored: u64,
    /// Stored bytes the target fetched into its cache meanwhile (None:
    /// its prefetch failed, and the wake fetches what it needs).
    pub prefetched: Option<u64>,
    /// The whole round, the target's prefetch included.
    pub total_ms: f64,
}

/// Moves running vm `name` to host `to` (or the one placement picks
/// among the others). With `precopy`, its memory is first stored while it
/// runs and the target fetches those chunks; then it sleeps here into the
/// shared store (after a pre-copy, only the pages written since) and
/// wakes there (the working-set pack fetched first). A wake that fails
/// leaves the branch sleeping, and says so.
pub fn move_vm(
    st: &Shared,
    name: &str,
    to: Option<&str>,
    precopy: bool,
    bar: &dyn store::Progress,
) -> host::Result<MoveReport> {
    let m = st.fleet.get().filter(|m| m.fleet.shared()).ok_or_else(|| {
        host::Error::invalid(
            "moving needs a fleet: hosts sharing TINE_META=postgres://... and TINE_STORE=s3://...",
        )
    })?;
    if to == Some(m.id.as_str()) {
        return Err(host::Error::invalid(format!(
            "{name:?} runs on {} already",
            m.id
        )));
    }
    let info = host::vm::info(&st.host, name)?;
    // Known before anything stops: the target is up and has room.
    let hosts: Vec<fleet::HostRow> = m
        .fleet
        .hosts()
        .map_err(fleet_err)?
        .into_iter()
        .filter(|h| h.id != m.id && to.is_none_or(|t| t == h.id))
        .collect();
    if let Some(t) = to {
        if hosts.is_empty() {
            return Err(host::Error::not_found(format!(
                "no host {t:?} in the fleet (see `tine hosts`)"
            )));
        }
    }
    let need = fleet::Need {
        mem_mib: info.mem_mib,
        vcpus: u64::from(info.vcpus),
        compat: None,
    };
    let target = fleet::place(&hosts, &need, None)
        .map_err(|r| host::Error::conflict(format!("cannot move {name:?}: {r}")))?;
    let precopy = if precopy {
        let t = std::time::Instant::now();
        let round = host::tree::precopy(&st.host, name, bar)?;
        bar.start(&format!("prefetch on {}", target.host), 0);
        let fetched = remote_operation(
            &target.address,
            "/v1/store/prefetch",
            &serde_json::json!({ "snapshot": round.snapshot }),
        );
        bar.finish();
        let prefetched = match fetched {
            Ok(v) => v.get("fetched").and_then(|f| f.as_u64()),
            Err(e) => {
                tracing::warn!(vm = %name, "move: the target's prefetch failed: {e}");
                None
            }
        };
        Some(PrecopyRound {
            snapshot: round.snapshot,
            pause_ms: round.pause_ms,
            store_ms: round.store_ms,
            new_stored: round.new_stored,
            prefetched,
            total_ms: t.elapsed().as_secs_f64() * 1000.0,
        })
    } else {
        None
    };
    let t0 = std::time::Instant::now();
    let sleep = host::tree::sleep(&st.host, name, bar)?;
    let spec = host::tree::WakeSpec {
        host: Some(target.host.clone()),
        // A network of the target's: a new lease there.
        net: info.address.is_some(),
        ..Default::default()
    };
    let wake = remote_operation(
        &target.address,
        &format!("/v1/branches/{}/wake", sleep.branch),
        &serde_json::to_value(&spec)?,
    )
    .map_err(|e| {
        e.context(format!(
            "{name:?} sleeps as branch {:?} (snapshot {}), but waking it on {} failed; wake it with `tine wake {}`",
            sleep.branch, sleep.snapshot, target.host, sleep.branch
        ))
    })?;
    Ok(MoveReport {
        name: name.into(),
        from: m.id.clone(),
        to: target.host,
        precopy,
        sleep,
        wake,
        downtime_ms: t0.elapsed().as_secs_f64() * 1000.0,
    })
}

/// Where a wake of `branch` would go now, and how long deciding took
/// (reading every host's row and scoring them).
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct PlacementView {
    pub branch: String,
    pub host: String,
    pub address: String,
    pub score: f64,
    /// Hosts considered.
    pub hosts: usize,
    pub decision_ms: f64,
}

pub fn placement_of(st: &Shared, branch: &str) -> host::Result<PlacementView> {
    let m = st
        .fleet
        .get()
        .ok_or_else(|| host::Error::invalid("this tined is in no fleet"))?;
    let needs = host::tree::branch_needs(&st.host, branch)?;
    let t0 = std::time::Instant::now();
    let hosts = m.fleet.hosts().map_err(fleet_err)?;
    let need = fleet::Need {
        mem_mib: needs.mem_mib,
        vcpus: needs.vcpus as u64,
        compat: Some(needs.compat),
    };
    let p = fleet::place(&hosts, &need, Some(&m.id))
        .map_err(|r| host::Error::conflict(format!("cannot wake {branch:?}: {r}")))?;
    Ok(PlacementView {
        branch: branch.into(),
        host: p.host,
        address: p.address,
        score: p.score,
        hosts: hosts.len(),
        decision_ms: t0.elapsed().as_secs_f64() * 1000.0,
    })
}

fn fleet_err(e: fleet::FleetError) -> host::Error {
    host::Error::internal(e.to_string())
}

/// Runs `method path body` on another host's tined as an operation there
/// and waits for it: its result, or its error with its code.
pub fn remote_operation(
    address: &str,
    path: &str,
    body: &serde_json::Value,
) -> host::Result<serde_json::Value> {
    let rt = tokio::runtime::Handle::current();
    rt.block_on(async {
        let (status, op) = call(address, Method::POST, path, Some(body)).await?;
        if status >= 300 {
            return Err(remote_error(address, &op));
        }
        let id = op
            .get("id")
            .and_then(|v| v.as_str())
            .ok_or_else(|| host::Error::failed(format!("{address} answered no operation: {op}")))?
            .to_string();
        loop {
            let (_, op) = call(
                address,
                Method::GET,
                &format!("/v1/operations/{id}?wait=60"),
                None,
            )
            .await?;
            match op.get("state").and_then(|v| v.as_str()) {
                Some("running") => continue,
                Some("succeeded") => {
                    return Ok(op.get("result").cloned().unwrap_or_default());
                }
                _ => {
                    let err = op.get("error").cloned().unwrap_or_default();
                    return Err(remote_error(address, &err));
                }
            }
        }
    })
}

fn remote_error(address: &str, body: &serde_json::Value) -> host::Error {
    let code = body
        .get("code")
        .cloned()
        .and_then(|c| serde_json::from_value::<host::Code>(c).ok())
        .unwrap_or(host::Code::Failed);
    let message = body
        .get("message")
        .and_then(|m| m.as_str())
        .unwrap_or("no message");
    host::Error::new(code, format!("on {address}: {message}"))
}

/// One HTTP/1.1 exchange with a tined at `address` (`unix:/path` or
/// `http://host:port`; `TINE_FLEET_TOKEN` is sent as the bearer token).
async fn call(
    address: &str,
    method: Method,
    path: &str,
    body: Option<&serde_json::Value>,
) -> host::Result<(u16, serde_json::Value)> {
    let unreachable = |e: &dyn std::fmt::Display| {
        host::Error::failed(format!("cannot reach the tined at {address}: {e}"))
    };
    let bytes = body
        .map(serde_json::to_vec)
        .transpose()?
        .unwrap_or_default();
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "tined")
        .header("content-type", "application/json");
    if let Ok(t) = std::env::var("TINE_FLEET_TOKEN") {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let req = req
        .body(Full::new(Bytes::from(bytes)))
        .map_err(|e| unreachable(&e))?;
    let resp = if let Some(sock) = address.strip_prefix("unix:") {
        let s = tokio::net::UnixStream::connect(sock)
            .await
            .map_err(|e| unreachable(&e))?;
        send(TokioIo::new(s), req).await
    } else if let Some(hostport) = address.strip_prefix("http://") {
        let s = tokio::net::TcpStream::connect(hostport.trim_end_matches('/'))
            .await
            .map_err(|e| unreachable(&e))?;
        send(TokioIo::new(s), req).await
    } else {
        return Err(host::Error::invalid(format!(
            "host address {address:?} is neither unix:/path nor http://host:port"
        )));
    };
    let (status, body) = resp.map_err(|e| unreachable(&e))?;
    let v = serde_json::from_slice(&body).unwrap_or_else(
        |_| serde_json::json!({ "code": "failed", "message": String::from_utf8_lossy(&body) }),
    );
    Ok((status, v))
}

async fn send<I>(io: I, req: Request<Full<Bytes>>) -> Result<(u16, Bytes), hyper::Error>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut tx, conn) = hyper::client::conn::http1::handshake(io).await?;
    tokio::spawn(conn);
    let resp = tx.send_request(req).await?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes();
    Ok((status, body))
}
