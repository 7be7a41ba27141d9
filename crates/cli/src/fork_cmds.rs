//! The fork verbs: fork, checkpoint, rollback, snapshot. Each is one
//! request to the vm's VMM over its control socket (`vms/NAME/api.sock`);
//! the VMM freezes the vm and starts the processes that continue from it
//! (crates/vmm/src/fork.rs), then the CLI records who is who.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use vmm::api::{self, Identity, NetIdentity, Reply, Request};

use crate::effects_cmds::{self, Moment};
use crate::state::{self, VmDir, VmRecord, VmState};
use crate::vm_cmds::tap_name;
use crate::{net, wake};
use effects::MomentKind;
use protocol::wake::Role;

/// The MAC `tine run --net` gives a vm.
pub const DEFAULT_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];

/// How long a fork may take before the CLI gives up waiting.
const FORK_TIMEOUT: Duration = Duration::from_secs(120);

/// A checkpoint of a vm: a template process holding the frozen moment.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CheckpointRecord {
    pub tag: String,
    pub pid: u32,
    pub pid_start: u64,
    pub created_ms: u64,
    /// The effects gateway's moment, and the branch and lineage it was
    /// taken of (a rollback continues from them as a new branch).
    #[serde(default)]
    pub moment: String,
    #[serde(default)]
    pub branch: String,
    #[serde(default)]
    pub lineage: Vec<effects::Step>,
}

/// A running vm's record, or a clear error.
fn running(home: &Path, name: &str) -> anyhow::Result<(VmDir, VmRecord)> {
    state::validate_name(name)?;
    let vm = VmDir::new(home, name);
    let r = vm.read_record()?;
    match vm.state(&r) {
        VmState::Running => Ok((vm, r)),
        s => bail!(
            "vm {name:?} is {s}: only a running vm can be forked, checkpointed or snapshotted"
        ),
    }
}

/// A vm's own host side, as its records say.
fn identity(vm: &VmDir, r: &VmRecord) -> Identity {
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

fn call(socket: &Path, req: &Request) -> anyhow::Result<api::Call> {
    let call = api::call(socket, req, FORK_TIMEOUT)?;
    if let Some(e) = &call.reply.error {
        bail!("{e}");
    }
    Ok(call)
}

/// Points the vm's record at the process it continues in.
fn moved(vm: &VmDir, r: &mut VmRecord, pid: u32) -> anyhow::Result<()> {
    r.pid = pid;
    r.pid_start = state::process_start(pid).unwrap_or(0);
    vm.write_record(r)
}

/// `tine fork NAME -n K [--names a,b] [--contract FILE]`.
///
/// In order: everything that can fail on bad input (names, contract,
/// rotate providers, addresses, isolation rules) before the vm is touched;
/// then quiesce, fork, and wake the parent and every child.
pub fn fork(
    home: &Path,
    name: &str,
    count: Option<usize>,
    names: Option<String>,
    contract_file: Option<&Path>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let (vm, mut r) = running(home, name)?;
    let names: Vec<String> = match (names, count) {
        (Some(list), n) => {
            let v: Vec<String> = list.split(',').map(|s| s.trim().to_string()).collect();
            if let Some(n) = n {
                anyhow::ensure!(
                    n == v.len(),
                    "-n {n} but {} names given; give one name per child",
                    v.len()
                );
            }
            v
        }
        (None, Some(n)) => free_names(home, name, n),
        (None, None) => bail!("say how many children: -n K, or name them: --names a,b,c"),
    };
    anyhow::ensure!(!names.is_empty(), "a fork needs at least one child");
    anyhow::ensure!(names.len() <= 1000, "at most 1000 children per fork");
    let contract = effective_contract(&vm, contract_file)?;
    effects_cmds::ensure_branch(&vm, &mut r)?;
    let mut moment = Moment::new(&r, MomentKind::Fork)?;
    let keeper = &contract.network.keep_connections;
    anyhow::ensure!(
        keeper == "parent" || keeper == "none" || names.contains(keeper),
        "the contract's network.keep_connections = {keeper:?} is neither `parent`, `none` nor a child of this fork ({})",
        names.join(", ")
    );
    let egress = match contract.network.children_egress {
        contract::Egress::Allow => None,
        contract::Egress::Deny => Some(contract.allow_rules()?),
    };
    let mut dirs = Vec::with_capacity(names.len());
    for n in &names {
        state::validate_name(n)?;
        let d = VmDir::new(home, n);
        if d.exists() {
            bail!("a vm named {n:?} exists; choose other names (or `tine rm {n}`)");
        }
        dirs.push(d);
    }
    let rotated = names
        .iter()
        .map(|n| wake::rotate_values(&contract, n, name))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let round = wake::Round::new(&contract)?;

    // From here on, undo what was made if the fork does not happen.
    let mut made = Made::default();
    let res = (|| -> anyhow::Result<Vec<VmRecord>> {
        let mut recs = Vec::with_capacity(dirs.len());
        for d in &dirs {
            let _ = std::fs::remove_dir_all(&d.dir);
            std::fs::create_dir_all(&d.dir)
                .with_context(|| format!("cannot create {}", d.dir.display()))?;
            made.dirs.push(d.dir.clone());
            let lease = match r.lease {
                Some(parent) => {
                    let l = net::lease_in_tree(home, &parent, &d.name)?;
                    made.leases.push(l);
                    let tap = tap_name(&d.name);
                    net::isolate(&tap, &l, egress.as_deref())?;
                    made.taps.push(tap);
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
                branch: effects_cmds::new_id()?,
                lineage: moment.lineage_after(&r),
                ..r.clone()
            });
        }
        Ok(recs)
    })();
    let mut recs = match res {
        Ok(recs) => recs,
        Err(e) => {
            made.undo(home);
            return Err(e.context(format!("cannot fork {name:?}; nothing was paused")));
        }
    };
    // Children to be woken stay parked until their wake: none of them runs
    // on the parent's identity meanwhile (nor ages its CRNG seed).
    let children: Vec<Identity> = dirs
        .iter()
        .zip(&recs)
        .map(|(d, c)| Identity {
            start_paused: r.agent,
            ..identity(d, c)
        })
        .collect();

    let t0 = Instant::now();
    let quiesce_t = Instant::now();
    let quiesced = match wake::quiesce(&vm, &r) {
        Ok(q) => q,
        Err(e) => {
            made.undo(home);
            return Err(e);
        }
    };
    let quiesce_ms = quiesce_t.elapsed().as_secs_f64() * 1000.0;
    // The effects barrier: what the gateway released to the parent so far
    // is before this moment (its responses are held until the fork is done).
    if let Err(e) = moment.begin(home, &vm, &r) {
        made.undo(home);
        if quiesced.is_some() {
            let w = round.message(Role::Parent, &r, &[])?;
            let _ = wake::wake_one(&vm, w);
        }
        return Err(e.context(format!("cannot fork {name:?}; nothing was paused")));
    }
    let res = call(
        &vm.api_socket(),
        &Request::Fork {
            children: children.clone(),
            layers_dir: state::layers_dir(home),
        },
    );
    let call = match res {
        Ok(c) => c,
        Err(e) => {
            made.undo(home);
            let _ = moment.end(home, false, &[]);
            // The parent was quiesced: let it go on as it was.
            if quiesced.is_some() {
                let w = round.message(Role::Parent, &r, &[])?;
                let _ = wake::wake_one(&vm, w);
            }
            return Err(e.context(format!("cannot fork {name:?}")));
        }
    };
    let reply = call.reply.clone();
    for ((d, rec), &pid) in dirs.iter().zip(recs.iter_mut()).zip(&reply.children) {
        rec.pid = pid;
        rec.pid_start = state::process_start(pid).unwrap_or(0);
        d.write_record(rec)?;
    }
    if let Some(pid) = reply.continuation_pid {
        moved(&vm, &mut r, pid)?;
    }
    drop(call);
    let copies: Vec<(&VmDir, &VmRecord)> = dirs.iter().zip(recs.iter()).collect();
    let gateway_problems = moment.end(home, true, &copies);
    let forked_ms = t0.elapsed().as_secs_f64() * 1000.0;

    // Wake-up: the parent and every child, at once.
    let mut problems = gateway_problems;
    let child_dirs: Vec<&VmDir> = dirs.iter().collect();
    problems.extend(crate::tree_cmds::link_children(home, &vm, &child_dirs));
    let taps: Vec<(String, net::Lease)> = recs
        .iter()
        .filter_map(|rec| rec.lease.map(|l| (tap_name(&rec.name), l)))
        .collect();
    if let Err(e) = net::configure_taps(&taps) {
        problems.push(format!("host network: {e:#}"));
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
    let ready_ms = t0.elapsed().as_secs_f64() * 1000.0;
    for w in &woken {
        problems.extend(w.failures());
        if !w.ready() && w.role == Role::Child {
            if let Some((d, rec)) = dirs.iter().zip(&recs).find(|(d, _)| d.name == w.name) {
                fail_closed(d, rec, w.error.as_deref().unwrap_or("wake failed"));
            }
        }
    }
    let wake_ms = woken.iter().map(|w| w.wake_ms).fold(0.0f64, f64::max);
    if json {
        let mut v = serde_json::to_value(&reply)?;
        v["total_ms"] = serde_json::json!(ready_ms);
        v["forked_ms"] = serde_json::json!(forked_ms);
        v["wake_ms"] = serde_json::json!(wake_ms);
        v["quiesce_ms"] = serde_json::json!(quiesce_ms);
        v["quiesce"] = serde_json::to_value(&quiesced)?;
        v["names"] = serde_json::json!(names);
        v["wake"] = serde_json::to_value(&woken)?;
        v["problems"] = serde_json::json!(problems);
        println!("{}", serde_json::to_string(&v)?);
    } else {
        let how = if quiesced.is_some() {
            format!("; woken in {wake_ms:.1} ms")
        } else {
            "; no agent: children are exact copies".into()
        };
        println!(
            "{name}: forked into {} in {ready_ms:.1} ms (guest paused {:.2} ms{how})",
            names.join(", "),
            reply.pause_ms.unwrap_or_default(),
        );
    }
    report_problems(&problems)
}

/// Prints what went wrong in a wake; non-zero exit when anything did.
fn report_problems(problems: &[String]) -> anyhow::Result<ExitCode> {
    for p in problems {
        eprintln!("tine: {p}");
    }
    Ok(if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("tine: {} wake step(s) failed (see above)", problems.len());
        ExitCode::FAILURE
    })
}

/// A copy whose randomness was not renewed must not run on: it is killed
/// and its record says why (`tine ls` shows it stopped).
fn fail_closed(d: &VmDir, rec: &VmRecord, why: &str) {
    let _ = crate::vm_cmds::kill_quietly(rec);
    let exit = state::ExitRecord {
        reason: format!("killed: {why}"),
        ended_ms: state::now_ms(),
    };
    if let Ok(bytes) = serde_json::to_vec_pretty(&exit) {
        let _ = state::write_atomic(&d.exit_path(), &bytes);
    }
}

/// The vm's contract, or `file`'s over it (secrets merge).
pub fn effective_contract(vm: &VmDir, file: Option<&Path>) -> anyhow::Result<contract::Contract> {
    let own = vm.read_contract()?;
    match file {
        None => Ok(own),
        Some(f) => {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("cannot read the contract {}", f.display()))?;
            let over =
                contract::Contract::parse(&text).with_context(|| format!("in {}", f.display()))?;
            Ok(own.overridden_by(&over))
        }
    }
}

/// What a fork made before the VMM was asked, to undo on failure.
#[derive(Default)]
struct Made {
    dirs: Vec<PathBuf>,
    leases: Vec<net::Lease>,
    taps: Vec<String>,
}

impl Made {
    fn undo(&self, home: &Path) {
        for t in &self.taps {
            net::forget(t);
        }
        for l in &self.leases {
            net::release(home, l);
        }
        for d in &self.dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// `NAME-1`, `NAME-2`, ... skipping names in use.
fn free_names(home: &Path, name: &str, n: usize) -> Vec<String> {
    let mut out = Vec::with_capacity(n);
    let mut i = 1;
    while out.len() < n {
        let cand = format!("{name}-{i}");
        if !VmDir::new(home, &cand).dir.exists() {
            out.push(cand);
        }
        i += 1;
    }
    out
}

fn print_reply(
    json: bool,
    reply: &Reply,
    t0: Instant,
    text: impl FnOnce() -> String,
) -> anyhow::Result<ExitCode> {
    if json {
        let mut v = serde_json::to_value(reply)?;
        v["total_ms"] = serde_json::json!(t0.elapsed().as_secs_f64() * 1000.0);
        println!("{}", serde_json::to_string(&v)?);
    } else {
        println!("{}", text());
    }
    Ok(ExitCode::SUCCESS)
}

/// `tine checkpoint NAME [--tag T]`.
pub fn checkpoint(
    home: &Path,
    name: &str,
    tag: Option<String>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let (vm, mut r) = running(home, name)?;
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
    let record = dir.join(format!("{tag}.json"));
    if let Ok(old) = read_checkpoint(&record) {
        if state::process_alive(old.pid, old.pid_start) {
            bail!("vm {name:?} has a checkpoint {tag:?}; choose another --tag");
        }
    }
    let t0 = Instant::now();
    effects_cmds::ensure_branch(&vm, &mut r)?;
    let (res, woken, moment, mut problems) = moment_of(
        home,
        &vm,
        &r,
        MomentKind::Checkpoint,
        &Request::Checkpoint {
            tag: tag.clone(),
            socket: dir.join(format!("{tag}.sock")),
            layers_dir: state::layers_dir(home),
        },
    )?;
    let call = res.with_context(|| format!("cannot checkpoint {name:?}"))?;
    let reply = &call.reply.clone();
    if let Some(pid) = reply.template_pid {
        let rec = CheckpointRecord {
            tag: tag.clone(),
            pid,
            pid_start: state::process_start(pid).unwrap_or(0),
            created_ms: state::now_ms(),
            moment: moment.id.clone(),
            branch: r.branch.clone(),
            lineage: r.lineage.clone(),
        };
        state::write_atomic(&record, &serde_json::to_vec_pretty(&rec)?)?;
    }
    if let Some(pid) = reply.continuation_pid {
        moved(&vm, &mut r, pid)?;
    }
    drop(call);
    print_reply(json, reply, t0, || {
        format!(
            "{name}: checkpoint {tag} (guest paused {:.2} ms)",
            reply.pause_ms.unwrap_or_default()
        )
    })?;
    problems.extend(woken.map(|w| w.failures()).unwrap_or_default());
    report_problems(&problems)
}

/// What [`moment_of`] returns: the VMM's answer, the vm's wake, the
/// effects moment, and the gateway's problems.
type MomentOf = (
    anyhow::Result<api::Call>,
    Option<wake::Woken>,
    Moment,
    Vec<String>,
);

/// Quiesces the vm, records the effects barrier, asks its VMM for a moment
/// (`req`: a checkpoint or a snapshot), and wakes the vm going on, whether
/// the moment was taken or not.
fn moment_of(
    home: &Path,
    vm: &VmDir,
    r: &VmRecord,
    kind: MomentKind,
    req: &Request,
) -> anyhow::Result<MomentOf> {
    let contract = vm.read_contract()?;
    let round = wake::Round::new(&contract)?;
    let mut moment = Moment::new(r, kind)?;
    let quiesced = wake::quiesce(vm, r)?;
    if let Err(e) = moment.begin(home, vm, r) {
        if quiesced.is_some() {
            let _ = wake::wake_one(vm, round.message(Role::Parent, r, &[])?);
        }
        return Err(e);
    }
    let res = call(&vm.api_socket(), req);
    let problems = moment.end(home, res.is_ok(), &[]);
    let woken = match quiesced {
        Some(_) => Some(wake::wake_one(vm, round.message(Role::Parent, r, &[])?)),
        None => None,
    };
    Ok((res, woken, moment, problems))
}

fn read_checkpoint(path: &Path) -> anyhow::Result<CheckpointRecord> {
    let text = std::fs::read_to_string(path)?;
    Ok(serde_json::from_str(&text)?)
}

/// `tine rollback NAME TAG`.
pub fn rollback(home: &Path, name: &str, tag: &str, json: bool) -> anyhow::Result<ExitCode> {
    state::validate_name(name)?;
    let vm = VmDir::new(home, name);
    let mut r = vm.read_record()?;
    let socket = vm.checkpoints().join(format!("{tag}.sock"));
    let cp = read_checkpoint(&vm.checkpoints().join(format!("{tag}.json"))).map_err(|_| {
        anyhow::anyhow!("vm {name:?} has no checkpoint {tag:?} (see `tine checkpoints {name}`)")
    })?;
    if !state::process_alive(cp.pid, cp.pid_start) {
        bail!("checkpoint {tag:?} of vm {name:?} is gone (its template process ended)");
    }
    let t0 = Instant::now();
    if vm.state(&r) == VmState::Running {
        crate::vm_cmds::kill_stopped(&r)?;
    }
    let _ = std::fs::remove_file(vm.exit_path());
    let call = call(
        &socket,
        &Request::Rollback {
            vm: identity(&vm, &r),
        },
    )
    .with_context(|| format!("cannot roll {name:?} back to {tag:?}"))?;
    let reply = &call.reply.clone();
    // A new branch continues from the checkpoint's moment.
    if !cp.moment.is_empty() {
        r.branch = effects_cmds::new_id()?;
        r.lineage = cp.lineage.clone();
        r.lineage.push(effects::Step {
            branch: cp.branch.clone(),
            moment: cp.moment.clone(),
            kind: MomentKind::Checkpoint,
        });
    }
    if let Some(pid) = reply.continuation_pid {
        moved(&vm, &mut r, pid)?;
    }
    drop(call);
    // The vm is back at a quiesced moment with stale time and connections.
    let mut problems: Vec<String> = effects_cmds::register(home, &vm, &r).into_iter().collect();
    if r.agent {
        let contract = vm.read_contract()?;
        let w = wake::Round::new(&contract)?.message(Role::Rollback, &r, &[])?;
        let woken = wake::wake_one(&vm, w);
        problems.extend(woken.failures());
        if !woken.ready() {
            fail_closed(&vm, &r, woken.error.as_deref().unwrap_or("wake failed"));
        }
    }
    print_reply(json, reply, t0, || {
        format!(
            "{name}: rolled back to {tag} in {:.1} ms",
            t0.elapsed().as_secs_f64() * 1000.0
        )
    })?;
    report_problems(&problems)
}

/// `tine checkpoints NAME`: the live checkpoints of a vm.
pub fn list_checkpoints(home: &Path, name: &str) -> anyhow::Result<Vec<CheckpointRecord>> {
    let vm = VmDir::new(home, name);
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(vm.checkpoints()) else {
        return Ok(out);
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "json") {
            if let Ok(c) = read_checkpoint(&p) {
                if state::process_alive(c.pid, c.pid_start) {
                    out.push(c);
                }
            }
        }
    }
    out.sort_by_key(|c| c.created_ms);
    Ok(out)
}

/// Ends every checkpoint template of a vm (on `rm`).
pub fn drop_checkpoints(vm: &VmDir) {
    let Ok(rd) = std::fs::read_dir(vm.checkpoints()) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if let Ok(c) = read_checkpoint(&p) {
            if state::process_alive(c.pid, c.pid_start) {
                // SAFETY: kill(2) of a pid checked to be our template.
                unsafe {
                    libc::kill(c.pid as libc::pid_t, libc::SIGKILL);
                }
            }
        }
    }
}

/// `tine snapshot NAME --to DIR`.
pub fn snapshot(home: &Path, name: &str, to: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let (vm, mut r) = running(home, name)?;
    let dir: PathBuf = if to.is_absolute() {
        to.into()
    } else {
        std::env::current_dir()?.join(to)
    };
    if dir.join(vmm::snapshot_dir::MANIFEST).exists() {
        bail!(
            "{} already holds a snapshot; choose a new directory",
            dir.display()
        );
    }
    let t0 = Instant::now();
    effects_cmds::ensure_branch(&vm, &mut r)?;
    let (res, woken, moment, mut problems) = moment_of(
        home,
        &vm,
        &r,
        MomentKind::Snapshot,
        &Request::Snapshot {
            dir: dir.clone(),
            layers_dir: state::layers_dir(home),
            contract: Some(vm.read_contract()?.to_toml()),
        },
    )?;
    let call = res.with_context(|| format!("cannot snapshot {name:?}"))?;
    let reply = &call.reply.clone();
    effects_cmds::write_snapshot_lineage(&dir, &r, &moment)?;
    if let Some(pid) = reply.continuation_pid {
        moved(&vm, &mut r, pid)?;
    }
    drop(call);
    print_reply(json, reply, t0, || {
        format!(
            "{name}: snapshot in {} ({} MiB of memory) in {:.0} ms (guest paused {:.2} ms)",
            dir.display(),
            reply.memory_bytes.unwrap_or_default() >> 20,
            reply.snapshot_ms.unwrap_or_default(),
            reply.pause_ms.unwrap_or_default()
        )
    })?;
    problems.extend(woken.map(|w| w.failures()).unwrap_or_default());
    report_problems(&problems)
}
