//! Moments of a running vm: fork, checkpoint, rollback, snapshot. Each is
//! one request to the vm's VMM over its control socket (`api.sock`); the
//! VMM freezes the vm and starts the processes that continue from it
//! (crates/vmm/src/fork.rs), then the engine records who is who.
//!
//! The order is the same for all: everything that can fail on bad input
//! (names, contract, rotate providers, addresses, isolation rules) before
//! the vm is touched; the vm's lock and an intent; the quiesce and the
//! effects barrier; the VMM's answer recorded before the connection that
//! holds the old VMM is let go; then the wake-up of every copy.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use effects::MomentKind;
use protocol::wake::Role;
use protocol::QuiesceReport;
use serde::{Deserialize, Serialize};
use vmm::api::{self, Identity, NetIdentity, Request};

use crate::checkpoints::{checkpoint_paths, drop_checkpoint_files, read_checkpoint};
pub use crate::checkpoints::{list_checkpoints, CheckpointRecord};
use crate::error::Context;
use crate::gateway::{self, Moment};
use crate::intent::{Intent, Op, Phase};
use crate::proc::Pid;
use crate::state::{self, VmDir, VmRecord, VmState};
use crate::vm::{kill_quietly, running, tap_name};
use crate::{lock, net, wake, Error, Host};

/// How long a fork may take before the engine gives up waiting.
const FORK_TIMEOUT: Duration = Duration::from_secs(120);
/// At most this many children per fork.
pub const MAX_CHILDREN: usize = 100;

/// A vm's own host side, as its records say.
pub(crate) fn identity(vm: &VmDir, r: &VmRecord) -> Identity {
    Identity {
        name: vm.name.clone(),
        start_paused: false,
        console_log: vm.console_log(),
        console_socket: Some(vm.console_socket()),
        log: vm.vmm_log(),
        disks: (0..r.disks).map(|i| vm.disk_layer(i)).collect(),
        nets: r
            .mac
            .map(|mac| {
                vec![NetIdentity {
                    tap: tap_name(&vm.name),
                    mac,
                    fd_index: None,
                    fd: None,
                }]
            })
            .unwrap_or_default(),
        vsock: r.vsock.then(|| vm.vsock()),
        api_socket: vm.api_socket(),
        exit_file: vm.exit_path(),
    }
}

/// A locally administered MAC derived from the vm's name.
fn mac_for(name: &str) -> [u8; 6] {
    let h = blake3::hash(name.as_bytes());
    let b = h.as_bytes();
    [0x52, 0x54, 0x00, b[0], b[1], b[2]]
}

fn call(socket: &Path, req: &Request) -> crate::Result<api::Call> {
    call_with_fds(socket, req, &[])
}

fn call_with_fds(
    socket: &Path,
    req: &Request,
    fds: &[std::os::fd::RawFd],
) -> crate::Result<api::Call> {
    let call = api::call_with_fds(socket, req, fds, FORK_TIMEOUT)?;
    if let Some(e) = &call.reply.error {
        return Err(Error::failed(e.clone()));
    }
    Ok(call)
}

/// Points the vm's record at the process it continues in (the one that
/// listens on its control socket now: the pid the VMM reports is one of
/// its tree's PID namespace); returns that process's pid.
fn moved(vm: &VmDir, r: &mut VmRecord) -> crate::Result<u32> {
    let p = Pid::listening_on_or_gone(&vm.api_socket());
    r.pid = p.pid;
    r.pid_start = p.start;
    vm.write_record(r)?;
    Ok(p.pid)
}

/// What to fork into (`tine fork`, `POST /v1/vms/{name}/fork`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ForkSpec {
    /// Number of children (named NAME-1, NAME-2, ... unless `names`).
    #[serde(default)]
    pub count: Option<usize>,
    /// The children's names.
    #[serde(default)]
    pub names: Option<Vec<String>>,
    /// A fork contract (TOML text) over the vm's own for this fork.
    #[serde(default)]
    pub contract: Option<String>,
}

/// One child of a fork.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ChildResult {
    pub name: String,
    /// Its VMM (None: it never ran).
    pub pid: Option<u32>,
    /// Running and woken (or an exact copy, for a vm without an agent).
    pub ok: bool,
    /// Why not.
    pub error: Option<String>,
}

/// What a fork did.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ForkReport {
    pub name: String,
    /// The children's names, in order.
    pub names: Vec<String>,
    /// Their pids, in order.
    pub children: Vec<u32>,
    /// One result per child.
    pub results: Vec<ChildResult>,
    /// The pid the vm continues in.
    pub continuation_pid: Option<u32>,
    /// How long the guest was paused.
    pub pause_ms: Option<f64>,
    /// Request to the VMM → each child running.
    pub child_running_ms: Vec<f64>,
    /// Request to the VMM → all children running.
    pub all_children_ms: Option<f64>,
    /// The agent's quiesce.
    pub quiesce_ms: f64,
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub quiesce: Option<QuiesceReport>,
    /// Start → recorded (before the wake-up).
    pub forked_ms: f64,
    /// The slowest copy's wake.
    pub wake_ms: f64,
    /// Start → every copy woken.
    pub total_ms: f64,
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Object>))]
    pub wake: Vec<wake::Woken>,
    /// Failed wake steps and other trouble (the fork itself happened).
    pub problems: Vec<String>,
    /// The host each child runs on, in order, when a fleet's fork of a
    /// sleeping branch spread them (empty: all on this host).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
}

/// The children's names of `spec` for vm `name`, checked.
pub fn child_names(h: &Host, name: &str, spec: &ForkSpec) -> crate::Result<Vec<String>> {
    let names: Vec<String> = match (&spec.names, spec.count) {
        (Some(list), n) => {
            let v: Vec<String> = list.iter().map(|s| s.trim().to_string()).collect();
            if let Some(n) = n {
                crate::ensure!(
                    n == v.len(),
                    "{n} children (count, -n) but {} names given; give one name per child",
                    v.len()
                );
            }
            v
        }
        (None, Some(n)) => {
            crate::ensure!(
                n <= MAX_CHILDREN,
                "at most {MAX_CHILDREN} children per fork, not {n}"
            );
            free_names(h, name, n)
        }
        (None, None) => {
            return Err(Error::invalid(
                "say how many children (count) or name them (names)",
            ))
        }
    };
    crate::ensure!(!names.is_empty(), "a fork needs at least one child");
    crate::ensure!(
        names.len() <= MAX_CHILDREN,
        "at most {MAX_CHILDREN} children per fork, not {}",
        names.len()
    );
    let mut seen = std::collections::HashSet::new();
    for n in &names {
        state::validate_name(n)?;
        crate::ensure!(seen.insert(n.as_str()), "the name {n:?} is given twice");
        if VmDir::new(&h.home, n).exists() {
            return Err(Error::conflict(format!(
                "a vm named {n:?} exists; choose other names (or `tine rm {n}`)"
            )));
        }
        if crate::branches::is_sleeping(h, n) {
            return Err(Error::conflict(format!(
                "a sleeping branch named {n:?} exists; choose other names"
            )));
        }
    }
    Ok(names)
}

/// Forks a running vm: `spec`'s children continue from this moment, each
/// with its own disk layer, console, vsock socket and MAC; the vm goes on.
/// (A sleeping branch is forked by [`crate::tree::fork`].)
pub fn fork(h: &Host, name: &str, spec: &ForkSpec) -> crate::Result<ForkReport> {
    state::validate_name(name)?;
    let _lock = lock::acquire(&h.home, name, lock::DEFAULT_WAIT)?;
    let (vm, mut r) = running(h, name)?;
    let _layers = crate::layers::shared(h)?;
    let names = child_names(h, name, spec)?;
    let _names = lock::reserve(&h.home, &names)?;
    let contract = effective_contract(&vm, spec.contract.as_deref())?;
    gateway::ensure_branch(&vm, &mut r)?;
    let mut moment = Moment::new(&r, MomentKind::Fork)?;
    let keeper = &contract.network.keep_connections;
    crate::ensure!(
        keeper == "parent" || keeper == "none" || names.contains(keeper),
        "the contract's network.keep_connections = {keeper:?} is neither `parent`, `none` nor a child of this fork ({})",
        names.join(", ")
    );
    let egress = match contract.network.children_egress {
        contract::Egress::Allow => None,
        contract::Egress::Deny => Some(contract.allow_rules()?),
    };
    // Children are in their parent's tree: its VMM's jail shows them.
    let dirs: Vec<VmDir> = names.iter().map(|n| vm.sibling(n)).collect();
    for d in &dirs {
        d.check_socket_paths()?;
    }
    crate::providers::check(&h.home, &contract)?;
    let rotated = names
        .iter()
        .map(|n| wake::rotate_values(&contract, n, name))
        .collect::<crate::Result<Vec<_>>>()?;
    let round = wake::Round::new(&contract)?;

    let t0 = Instant::now();
    let mut intent = Intent::begin(
        &h.home,
        Op::Fork {
            vm: name.into(),
            children: names.clone(),
        },
    )?;
    // From here on, undo what was made if the fork does not happen.
    let undo = |intent: Intent| {
        for d in &dirs {
            crate::vm::undo_start(h, d);
        }
        intent.done();
    };
    let res = (|| -> crate::Result<Vec<VmRecord>> {
        let mut recs = Vec::with_capacity(dirs.len());
        for d in &dirs {
            d.create()?;
            let lease = match r.lease {
                Some(parent) => {
                    let l = net::lease_in_tree(&h.home, &parent, &d.name)?;
                    state::write_atomic(&d.dir.join("lease.json"), &serde_json::to_vec(&l)?)?;
                    net::isolate(&tap_name(&d.name), &l, egress.as_deref())?;
                    Some(l)
                }
                None => None,
            };
            d.write_contract(&contract)?;
            recs.push(VmRecord {
                name: d.name.clone(),
                parent: Some(name.to_string()),
                mac: r.mac.map(|_| mac_for(&d.name)),
                lease,
                created_ms: state::now_ms(),
                branch: gateway::new_id()?,
                lineage: moment.lineage_after(&r),
                ..r.clone()
            });
        }
        Ok(recs)
    })();
    let mut recs = match res {
        Ok(recs) => recs,
        Err(e) => {
            undo(intent);
            return Err(e.context(format!("cannot fork {name:?}; nothing was paused")));
        }
    };
    // Children to be woken stay parked until their wake: none of them runs
    // on the parent's identity meanwhile (nor ages its CRNG seed).
    let mut children: Vec<Identity> = dirs
        .iter()
        .zip(&recs)
        .map(|(d, c)| Identity {
            start_paused: r.agent,
            ..identity(d, c)
        })
        .collect();
    // Each child's tap is made here, in the host's network namespace, and
    // passed with the request: the VMM has neither CAP_NET_ADMIN nor the
    // host's network. A tap lives while its child holds it.
    let mut taps = Vec::new();
    for net in children.iter_mut().flat_map(|c| c.nets.iter_mut()) {
        match crate::vm::open_tap(&net.tap) {
            Ok(fd) => {
                net.fd_index = Some(taps.len());
                taps.push(fd);
            }
            Err(e) => {
                undo(intent);
                return Err(e.context(format!("cannot fork {name:?}; nothing was paused")));
            }
        }
    }
    // The tree's group grows by the children's limits before they exist
    // (a failure pauses nothing); they are born in it. A vm from before
    // trees has children with groups of their own, made here and joined
    // once the fork has answered. (The jailed VMM sees no cgroup
    // filesystem, so it cannot change its limits.)
    let size = crate::cgroup::Limits::of(r.mem_mib, r.vcpus);
    let groups: crate::Result<Vec<Vec<PathBuf>>> = match vm.tree() {
        Some(tree) => {
            let members = crate::state::vms_in_tree(tree).len().max(1 + dirs.len());
            crate::cgroup::prepare(&h.home, &crate::cgroup::group_of(&vm), size.times(members))
                .map(|_| Vec::new())
        }
        None => dirs
            .iter()
            .map(|d| crate::cgroup::prepare(&h.home, &d.name, size))
            .collect(),
    };
    let groups = match groups {
        Ok(g) => g,
        Err(e) => {
            undo(intent);
            return Err(e.context(format!("cannot fork {name:?}; nothing was paused")));
        }
    };

    let quiesce_t = Instant::now();
    let quiesced = match wake::quiesce(&vm, &r) {
        Ok(q) => q,
        Err(e) => {
            undo(intent);
            return Err(e);
        }
    };
    let quiesce_ms = quiesce_t.elapsed().as_secs_f64() * 1000.0;
    let wake_parent = |r: &VmRecord| {
        if quiesced.is_some() {
            if let Ok(w) = round.message(Role::Parent, r, &[]) {
                let _ = wake::wake_one(&vm, w);
            }
        }
    };
    // The effects barrier: what the gateway released to the parent so far
    // is before this moment (its responses are held until the fork is done).
    if let Err(e) = moment.begin(h, &vm, &r) {
        undo(intent);
        wake_parent(&r);
        return Err(e.context(format!("cannot fork {name:?}; nothing was paused")));
    }
    let spawning = crate::settle::spawning();
    intent.phase(Phase::Asked)?;
    crate::fault::point("fork:prepared");
    let res = call_with_fds(
        &vm.api_socket(),
        &Request::Fork {
            children: children.clone(),
            layers_dir: vm.layers_dir(),
        },
        &taps.iter().map(|t| t.as_raw_fd()).collect::<Vec<_>>(),
    );
    // The children hold their taps now (or the fork failed): ours close.
    drop(taps);
    let call = match res {
        Ok(c) => c,
        Err(e) => {
            // The VMM may have started some children before it failed (or
            // died): they are ended first, then their directories go (a
            // child still starting could put a file in a directory being
            // removed, which then stays).
            drop(spawning);
            crate::settle::sweep(h);
            undo(intent);
            let _ = moment.end(h, false, &[]);
            crate::settle::sweep(h);
            if let Ok(r) = vm.read_record() {
                wake_parent(&r);
            }
            return Err(e.context(format!("cannot fork {name:?}")));
        }
    };
    let mut reply = call.reply.clone();
    crate::fault::point("fork:answered");
    let mut problems = Vec::new();
    // The pids in the reply are of the tree's PID namespace: each child
    // is the process listening on its control socket.
    let started = reply.children.len().min(dirs.len());
    reply.children.clear();
    for (d, rec) in dirs.iter().zip(recs.iter_mut()).take(started) {
        let p = Pid::listening_on_or_gone(&d.api_socket());
        rec.pid = p.pid;
        rec.pid_start = p.start;
        d.write_record(rec)?;
        reply.children.push(p.pid);
    }
    // Children of a vm from before trees join their own groups.
    for (group, &pid) in groups.iter().zip(&reply.children) {
        if let Err(e) = crate::cgroup::enter(group, pid) {
            problems.push(e.to_string());
        }
    }
    if reply.continuation_pid.is_some() {
        reply.continuation_pid = Some(moved(&vm, &mut r)?);
    }
    reply.pid = r.pid;
    intent.phase(Phase::Recorded)?;
    crate::fault::point("fork:recorded");
    drop(spawning);
    // Recorded: the old VMM may go.
    drop(call);
    let copies: Vec<(&VmDir, &VmRecord)> = dirs.iter().zip(recs.iter()).collect();
    problems.extend(moment.end(h, true, &copies));
    let forked_ms = t0.elapsed().as_secs_f64() * 1000.0;

    // Wake-up: the parent and every child, at once.
    let child_dirs: Vec<&VmDir> = dirs.iter().collect();
    problems.extend(crate::branches::link_children(h, &vm, &child_dirs));
    let taps: Vec<(String, net::Lease)> = recs
        .iter()
        .filter_map(|rec| rec.lease.map(|l| (tap_name(&rec.name), l)))
        .collect();
    if let Err(e) = net::configure_taps(&taps) {
        problems.push(format!("host network: {e}"));
    }
    let woken = if quiesced.is_some() {
        let mut copies = vec![(vm.clone(), round.message(Role::Parent, &r, &[])?)];
        for ((d, rec), rot) in dirs.iter().zip(&recs).zip(&rotated) {
            copies.push((d.clone(), round.message(Role::Child, rec, rot)?));
        }
        wake::wake_all(copies)
    } else {
        Vec::new()
    };
    let total_ms = t0.elapsed().as_secs_f64() * 1000.0;
    let mut results: Vec<ChildResult> = recs
        .iter()
        .map(|rec| ChildResult {
            name: rec.name.clone(),
            pid: Some(rec.pid),
            ok: true,
            error: None,
        })
        .collect();
    for w in &woken {
        problems.extend(w.failures());
        if !w.ready() && w.role == Role::Child {
            if let Some(i) = dirs.iter().position(|d| d.name == w.name) {
                let why = w.error.as_deref().unwrap_or("wake failed");
                results[i].ok = false;
                results[i].error = Some(fail_closed(&dirs[i], &recs[i], why, recs[i].created_ms));
            }
        }
    }
    intent.done();
    crate::fault::point("fork:done");
    let wake_ms = woken.iter().map(|w| w.wake_ms).fold(0.0f64, f64::max);
    Ok(ForkReport {
        name: name.into(),
        names,
        children: reply.children.clone(),
        results,
        continuation_pid: reply.continuation_pid,
        pause_ms: reply.pause_ms,
        child_running_ms: reply.child_running_ms.clone(),
        all_children_ms: reply.all_children_ms,
        quiesce_ms,
        quiesce: quiesced,
        forked_ms,
        wake_ms,
        total_ms,
        wake: woken,
        problems,
        hosts: vec![],
    })
}

/// A copy whose randomness was not renewed must not run on: it is killed
/// and its record says why (`ls` shows it stopped). Returns the error to
/// report: `why`, and how the VMM ended if it had ended on its own since
/// `since_ms` (its guest crashed during the wake: its exit record is kept).
fn fail_closed(d: &VmDir, rec: &VmRecord, why: &str, since_ms: u64) -> String {
    let _ = kill_quietly(rec);
    if let Some(own) = d.read_exit().filter(|e| e.ended_ms >= since_ms) {
        return format!("{why} (its VMM had ended: {})", own.reason);
    }
    let exit = state::ExitRecord {
        reason: format!("killed: {why}"),
        ended_ms: state::now_ms(),
    };
    if let Ok(bytes) = serde_json::to_vec_pretty(&exit) {
        let _ = state::write_atomic(&d.exit_path(), &bytes);
    }
    why.to_string()
}

/// The vm's contract, or `over` (TOML text) over it (secrets merge).
pub fn effective_contract(vm: &VmDir, over: Option<&str>) -> crate::Result<contract::Contract> {
    let own = vm.read_contract()?;
    match over {
        None => Ok(own),
        Some(text) => Ok(own.overridden_by(&contract::Contract::parse(text)?)),
    }
}

/// `NAME-1`, `NAME-2`, ... skipping names in use (by a vm, or by a branch
/// of the store, which a wake could not take).
fn free_names(h: &Host, name: &str, n: usize) -> Vec<String> {
    let mut out = Vec::with_capacity(n);
    let mut i = 1;
    while out.len() < n {
        let cand = format!("{name}-{i}");
        if !VmDir::new(&h.home, &cand).dir.exists()
            && !crate::branches::has_branch_in(&h.home, &cand)
        {
            out.push(cand);
        }
        i += 1;
    }
    out
}

/// What a checkpoint, rollback or snapshot did.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MomentReport {
    pub name: String,
    /// The checkpoint's tag (checkpoint, rollback).
    pub tag: Option<String>,
    /// The snapshot directory (snapshot).
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub dir: Option<PathBuf>,
    pub pid: u32,
    pub continuation_pid: Option<u32>,
    pub template_pid: Option<u32>,
    pub pause_ms: Option<f64>,
    /// Snapshot: request → files complete.
    pub snapshot_ms: Option<f64>,
    /// Snapshot: bytes of memory written.
    pub memory_bytes: Option<u64>,
    pub total_ms: f64,
    /// Failed wake steps and other trouble.
    pub problems: Vec<String>,
}

impl MomentReport {
    fn of(name: &str, reply: &api::Reply, t0: Instant) -> MomentReport {
        MomentReport {
            name: name.into(),
            pid: reply.pid,
            continuation_pid: reply.continuation_pid,
            template_pid: reply.template_pid,
            pause_ms: reply.pause_ms,
            snapshot_ms: reply.snapshot_ms,
            memory_bytes: reply.memory_bytes,
            total_ms: t0.elapsed().as_secs_f64() * 1000.0,
            ..MomentReport::default()
        }
    }
}

/// Keeps this moment of a vm to roll back to, as `tag` (default cp1,
/// cp2, ...). It costs the pages that later diverge.
pub fn checkpoint(h: &Host, name: &str, tag: Option<String>) -> crate::Result<MomentReport> {
    state::validate_name(name)?;
    let _lock = lock::acquire(&h.home, name, lock::DEFAULT_WAIT)?;
    let (vm, mut r) = running(h, name)?;
    let _layers = crate::layers::shared(h)?;
    let dir = vm.checkpoints();
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let tag = match tag {
        Some(t) => t,
        None => (1..)
            .map(|i| format!("cp{i}"))
            .find(|t| !dir.join(format!("{t}.json")).exists())
            .unwrap_or_else(|| "cp".into()),
    };
    state::validate_name(&tag).context("invalid checkpoint tag")?;
    let (record, socket) = checkpoint_paths(&vm, &tag);
    state::check_socket_path(&socket, &format!("checkpoint {tag:?}"))?;
    if let Ok(old) = read_checkpoint(&record) {
        if crate::proc::process_alive(old.pid, old.pid_start) {
            return Err(Error::conflict(format!(
                "vm {name:?} has a checkpoint {tag:?}; choose another tag"
            )));
        }
    }
    let t0 = Instant::now();
    gateway::ensure_branch(&vm, &mut r)?;
    let mut intent = Intent::begin(
        &h.home,
        Op::Checkpoint {
            vm: name.into(),
            tag: tag.clone(),
        },
    )?;
    let spawning = crate::settle::spawning();
    let res = moment_of(
        h,
        &vm,
        &r,
        MomentKind::Checkpoint,
        &Request::Checkpoint {
            tag: tag.clone(),
            socket: socket.clone(),
            layers_dir: vm.layers_dir(),
        },
        &mut intent,
    );
    let (res, woken, moment, mut problems) = match res {
        Ok(x) => x,
        Err(e) => {
            intent.done();
            return Err(e);
        }
    };
    let call = match res {
        Ok(c) => c,
        Err(e) => {
            drop(spawning);
            drop_checkpoint_files(&vm, &tag);
            crate::settle::sweep(h);
            intent.done();
            return Err(e.context(format!("cannot checkpoint {name:?}")));
        }
    };
    let mut reply = call.reply.clone();
    crate::fault::point("checkpoint:answered");
    reply.pid = r.pid;
    if reply.continuation_pid.is_some() {
        reply.continuation_pid = Some(moved(&vm, &mut r)?);
    }
    if reply.template_pid.is_some() {
        // The template listens on the checkpoint's socket.
        let t = Pid::listening_on_or_gone(&checkpoint_paths(&vm, &tag).1);
        reply.template_pid = Some(t.pid);
        let rec = CheckpointRecord {
            tag: tag.clone(),
            pid: t.pid,
            pid_start: t.start,
            created_ms: state::now_ms(),
            moment: moment.id.clone(),
            branch: r.branch.clone(),
            lineage: r.lineage.clone(),
            layers: frozen_under_tops(&vm, &r),
        };
        state::write_atomic(&record, &serde_json::to_vec_pretty(&rec)?)?;
    }
    intent.phase(Phase::Recorded)?;
    drop(spawning);
    drop(call);
    intent.done();
    problems.extend(woken.map(|w| w.failures()).unwrap_or_default());
    Ok(MomentReport {
        tag: Some(tag),
        problems,
        ..MomentReport::of(name, &reply, t0)
    })
}

/// The layer directly under each of the vm's tops: what a moment froze.
fn frozen_under_tops(vm: &VmDir, r: &VmRecord) -> Vec<PathBuf> {
    (0..r.disks)
        .filter_map(|i| {
            let chain = disk::chain(&vm.disk_layer(i)).ok()?;
            chain.get(1).map(|l| l.path.clone())
        })
        .collect()
}

/// What [`moment_of`] returns: the VMM's answer, the vm's wake, the
/// effects moment, and the gateway's problems.
type MomentOf = (
    crate::Result<api::Call>,
    Option<wake::Woken>,
    Moment,
    Vec<String>,
);

/// Quiesces the vm, records the effects barrier, asks its VMM for a moment
/// (`req`: a checkpoint or a snapshot), and wakes the vm going on, whether
/// the moment was taken or not.
fn moment_of(
    h: &Host,
    vm: &VmDir,
    r: &VmRecord,
    kind: MomentKind,
    req: &Request,
    intent: &mut Intent,
) -> crate::Result<MomentOf> {
    let contract = vm.read_contract()?;
    let round = wake::Round::new(&contract)?;
    let mut moment = Moment::new(r, kind)?;
    let quiesced = wake::quiesce(vm, r)?;
    if let Err(e) = moment.begin(h, vm, r) {
        if quiesced.is_some() {
            let _ = wake::wake_one(vm, round.message(Role::Parent, r, &[])?);
        }
        return Err(e);
    }
    intent.phase(Phase::Asked)?;
    let res = call(&vm.api_socket(), req);
    let problems = moment.end(h, res.is_ok(), &[]);
    let woken = match quiesced {
        Some(_) => Some(wake::wake_one(vm, round.message(Role::Parent, r, &[])?)),
        None => None,
    };
    Ok((res, woken, moment, problems))
}

/// Returns a vm to its checkpoint `tag`: memory, CPU, devices and disk.
pub fn rollback(h: &Host, name: &str, tag: &str) -> crate::Result<MomentReport> {
    state::validate_name(name)?;
    state::validate_name(tag).context("invalid checkpoint tag")?;
    let _lock = lock::acquire(&h.home, name, lock::DEFAULT_WAIT)?;
    let vm = VmDir::new(&h.home, name);
    let mut r = vm.read_record()?;
    let (record, socket) = checkpoint_paths(&vm, tag);
    let cp = read_checkpoint(&record).map_err(|_| {
        Error::not_found(format!(
            "vm {name:?} has no checkpoint {tag:?} (see `tine checkpoints {name}`)"
        ))
    })?;
    if !crate::proc::process_alive(cp.pid, cp.pid_start) {
        return Err(Error::failed(format!(
            "checkpoint {tag:?} of vm {name:?} is gone (its template process ended)"
        )));
    }
    let _layers = crate::layers::shared(h)?;
    let t0 = Instant::now();
    let mut intent = Intent::begin(
        &h.home,
        Op::Rollback {
            vm: name.into(),
            tag: tag.into(),
        },
    )?;
    if vm.state(&r) == VmState::Running {
        crate::vm::kill_stopped(&r)?;
    }
    let _ = std::fs::remove_file(vm.exit_path());
    crate::fault::point("rollback:killed");
    let spawning = crate::settle::spawning();
    intent.phase(Phase::Asked)?;
    let call = match call(
        &socket,
        &Request::Rollback {
            vm: identity(&vm, &r),
        },
    ) {
        Ok(c) => c,
        Err(e) => {
            drop(spawning);
            crate::settle::settle_pid(&vm);
            intent.done();
            return Err(e.context(format!("cannot roll {name:?} back to {tag:?}")));
        }
    };
    let mut reply = call.reply.clone();
    // A new branch continues from the checkpoint's moment.
    if !cp.moment.is_empty() {
        r.branch = gateway::new_id()?;
        r.lineage = cp.lineage.clone();
        r.lineage.push(effects::Step {
            branch: cp.branch.clone(),
            moment: cp.moment.clone(),
            kind: MomentKind::Checkpoint,
        });
    }
    reply.pid = cp.pid;
    if reply.continuation_pid.is_some() {
        reply.continuation_pid = Some(moved(&vm, &mut r)?);
    }
    intent.phase(Phase::Recorded)?;
    drop(spawning);
    drop(call);
    // The vm is back at a quiesced moment with stale time and connections.
    let mut problems: Vec<String> = gateway::register(h, &vm, &r).into_iter().collect();
    if r.agent {
        let contract = vm.read_contract()?;
        let w = wake::Round::new(&contract)?.message(Role::Rollback, &r, &[])?;
        let woken = wake::wake_one(&vm, w);
        problems.extend(woken.failures());
        if !woken.ready() {
            // The old process's exit record may be in the directory: the
            // new one's is not told apart, so none is taken as its own.
            let why = woken.error.as_deref().unwrap_or("wake failed");
            fail_closed(&vm, &r, why, u64::MAX);
        }
    }
    intent.done();
    Ok(MomentReport {
        tag: Some(tag.into()),
        problems,
        ..MomentReport::of(name, &reply, t0)
    })
}

/// Drops checkpoint `tag` of vm `name`: its template ends and the frozen
/// layers only it held are freed.
pub fn delete_checkpoint(h: &Host, name: &str, tag: &str) -> crate::Result<crate::vm::Removed> {
    state::validate_name(name)?;
    state::validate_name(tag).context("invalid checkpoint tag")?;
    let lock = lock::acquire(&h.home, name, lock::DEFAULT_WAIT)?;
    let vm = VmDir::new(&h.home, name);
    vm.read_record()?;
    let (record, _) = checkpoint_paths(&vm, tag);
    if !record.is_file() {
        return Err(Error::not_found(format!(
            "vm {name:?} has no checkpoint {tag:?} (see `tine checkpoints {name}`)"
        )));
    }
    drop_checkpoint_files(&vm, tag);
    drop(lock);
    let (freed, problems) = crate::layers::after_removal(h);
    Ok(crate::vm::Removed {
        name: format!("{name}@{tag}"),
        what: "checkpoint".into(),
        processes: 1,
        layers_freed: freed,
        problems,
    })
}

/// Writes a running vm to snapshot directory `to` (memory, state,
/// manifest) while it runs on; `run` with `from` restores it.
pub fn snapshot(h: &Host, name: &str, to: &Path) -> crate::Result<MomentReport> {
    state::validate_name(name)?;
    crate::ensure!(
        to.is_absolute(),
        "the snapshot directory must be an absolute path, not {}",
        to.display()
    );
    let _lock = lock::acquire(&h.home, name, lock::DEFAULT_WAIT)?;
    let (vm, mut r) = running(h, name)?;
    let _layers = crate::layers::shared(h)?;
    let dir = to.to_path_buf();
    if dir.join(vmm::snapshot_dir::MANIFEST).exists() {
        return Err(Error::conflict(format!(
            "{} already holds a snapshot; choose a new directory",
            dir.display()
        )));
    }
    let t0 = Instant::now();
    gateway::ensure_branch(&vm, &mut r)?;
    let mut intent = Intent::begin(
        &h.home,
        Op::Snapshot {
            vm: name.into(),
            dir: dir.clone(),
            created: !dir.exists(),
        },
    )?;
    // The VMM writes the directory; a jailed one sees it only once it is
    // mounted into its namespace.
    let shown = std::fs::create_dir_all(&dir)
        .with_context(|| format!("cannot create {}", dir.display()))
        .and_then(|()| crate::jail::expose(r.pid, &dir));
    if let Err(e) = shown {
        crate::settle::undo_snapshot_dir(intent.record());
        intent.done();
        return Err(e.context(format!("cannot snapshot {name:?}")));
    }
    let spawning = crate::settle::spawning();
    let res = moment_of(
        h,
        &vm,
        &r,
        MomentKind::Snapshot,
        &Request::Snapshot {
            dir: dir.clone(),
            layers_dir: vm.layers_dir(),
            contract: Some(vm.read_contract()?.to_toml()),
        },
        &mut intent,
    );
    let (res, woken, moment, mut problems) = match res {
        Ok(x) => x,
        Err(e) => {
            intent.done();
            return Err(e);
        }
    };
    let call = match res {
        Ok(c) => c,
        Err(e) => {
            drop(spawning);
            // A writer the VMM started may still run (the VMM died): it
            // ends before its directory is undone.
            crate::settle::sweep(h);
            crate::settle::undo_snapshot_dir(intent.record());
            crate::settle::settle_pid(&vm);
            intent.done();
            return Err(e.context(format!("cannot snapshot {name:?}")));
        }
    };
    let mut reply = call.reply.clone();
    crate::fault::point("snapshot:answered");
    reply.pid = r.pid;
    if reply.continuation_pid.is_some() {
        reply.continuation_pid = Some(moved(&vm, &mut r)?);
    }
    gateway::write_snapshot_lineage(&dir, &r, &moment)?;
    crate::layers::register_snapshot_dir(h, &dir)?;
    intent.phase(Phase::Recorded)?;
    drop(spawning);
    drop(call);
    intent.done();
    problems.extend(woken.map(|w| w.failures()).unwrap_or_default());
    Ok(MomentReport {
        dir: Some(dir),
        problems,
        ..MomentReport::of(name, &reply, t0)
    })
}
