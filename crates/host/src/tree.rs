//! The snapshot tree: sleep, wake, fork of a sleeping branch, the lineage
//! view, remove/prune/gc, store verify. A branch sleeps as a snapshot in
//! the store (crates/store: chunks + `$TINE_HOME/store/tree.db`) and wakes
//! as a vm restored from it (the same path as a restore of a snapshot
//! directory).
//!
//! - sleep: quiesce, take a snapshot into a staging directory, store its
//!   layers (memory, each disk's contents) and state, commit it with the
//!   branch now sleeping, then end the vm. Until the commit the vm is
//!   still there; a failure wakes it again. The commit is the point of no
//!   return: a crash after it is finished by reconcile.
//! - precopy (a move's first round): the same store of a moment, but the
//!   vm runs on, its branch running at the snapshot and its dirty set
//!   restarted there, so the move's sleep stores only a diff.
//! - wake: materialize the snapshot once per host into
//!   `store/wake/SNAPSHOT/` (its manifest written last), then restore a
//!   new vm from it. Copies of one snapshot map the same memory file
//!   MAP_PRIVATE, so they share its page cache; gc removes the copies no
//!   vm uses.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use store::{BranchChange, BranchState, Dirty, LayerKind, Progress, SnapshotId, Store};
use vmm::api::{self, Request};
use vmm::snapshot_dir::{self, Manifest};

use crate::branches::{branch_row, link_path, read_link, reap_branches, store_exists, trim_cache};
pub use crate::branches::{
    has_branch_in, is_sleeping, is_sleeping_in, open, BranchLink, CACHE_ENV,
};
use crate::error::Context;
use crate::intent::{Intent, Op, Phase};
use crate::state::{self, VmDir, VmRecord};
use crate::vm::{RunReport, RunSpec};
use crate::{bail, gateway, lock, wake, Error, Host};
use protocol::wake::Role;

/// How long the VMM may take to write a snapshot for `sleep`.
const SNAPSHOT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// What `sleep` did.
#[derive(Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SleepReport {
    pub name: String,
    pub branch: String,
    pub snapshot: i64,
    pub parent: Option<i64>,
    pub pause_ms: f64,
    pub snapshot_ms: f64,
    pub store_ms: f64,
    pub total_ms: f64,
    /// Logical bytes of the memory layer this snapshot records itself
    /// (windows not inherited from its parent).
    pub memory_logical: u64,
    /// Bytes that went to the backend (new chunks, compressed).
    pub new_stored: u64,
    /// Each disk layer, in manifest order.
    pub disks: Vec<DiskReport>,
    /// Trouble that did not stop the sleep.
    pub problems: Vec<String>,
}

/// How `sleep` stored one disk.
#[derive(Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DiskReport {
    pub size: u64,
    /// Stored as a diff over the parent snapshot's layer: only the windows
    /// the qcow2 layers above the woken snapshot's disk map were read.
    pub diff: bool,
    /// Bytes read from the disk chain (and hashed).
    pub read_bytes: u64,
    /// Logical bytes this snapshot records itself.
    pub logical: u64,
}

/// Puts a running vm to sleep: its moment goes into the store and the vm
/// ends; its branch sleeps.
pub fn sleep(h: &Host, name: &str, bar: &dyn Progress) -> crate::Result<SleepReport> {
    to_store(h, name, bar, Round::Sleep)
}

/// A move's pre-copy round: the vm's moment goes into the store as a
/// snapshot while the vm runs on, its branch running at it, and the VMM's
/// dirty tracking restarts there. The sleep that follows stores only the
/// pages written since (a diff layer over this snapshot), and the target
/// host can fetch this snapshot's chunks while the vm still runs: a
/// move's downtime pays for what the guest wrote meanwhile, not for all
/// of its memory. QEMU's and vMotion's pre-copy, through the store.
pub fn precopy(h: &Host, name: &str, bar: &dyn Progress) -> crate::Result<SleepReport> {
    to_store(h, name, bar, Round::Precopy)
}

/// What storing a running vm's moment is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Round {
    /// The vm ends; its branch sleeps.
    Sleep,
    /// The vm runs on; its branch runs at the new snapshot.
    Precopy,
}

impl Round {
    /// Crash point `sleep:POINT` or `precopy:POINT` (crate::fault).
    fn fault(self, point: &str) {
        let round = match self {
            Round::Sleep => "sleep",
            Round::Precopy => "precopy",
        };
        crate::fault::point(&format!("{round}:{point}"));
    }
}

fn to_store(h: &Host, name: &str, bar: &dyn Progress, round: Round) -> crate::Result<SleepReport> {
    state::validate_name(name)?;
    let _lock = lock::acquire(&h.home, name, lock::DEFAULT_WAIT)?;
    let (vm, mut r) = crate::vm::running_for(h, name, "be put to sleep")?;
    let _layers = crate::layers::shared(h)?;
    if !crate::fork::list_checkpoints(h, name)?.is_empty() {
        return Err(Error::conflict(format!("vm {name:?} has checkpoints; they live in processes and cannot sleep with it (delete them with `tine rm {name}@TAG`, or roll back first)")));
    }
    let store = open(h)?;
    let link = read_link(&vm);
    let parent = match &link {
        Some(l) => store.snapshot(SnapshotId(l.snapshot)).ok().map(|s| s.id),
        None => None,
    };
    if let Some(b) = store.branch(name)? {
        if b.state == BranchState::Sleeping {
            return Err(Error::conflict(format!("a sleeping branch named {name:?} exists already; wake it under another name, or remove it with `tine rm {name}`")));
        }
    }
    let staging = store
        .dir()
        .join("staging")
        .join(format!("sleep-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    // A pre-copy round restarts the dirty set at its moment (under a
    // label of its own: the snapshot's id comes from the store later).
    let label = match round {
        Round::Sleep => None,
        Round::Precopy => {
            let c = api::call(&vm.api_socket(), &Request::TrackDirty, SNAPSHOT_TIMEOUT)
                .with_context(|| format!("cannot ask {name:?}'s VMM to track dirty pages"))?;
            if let Some(e) = &c.reply.error {
                bail!("{name:?}'s VMM cannot track dirty pages: {e}");
            }
            Some(format!("pre-{}-{}", std::process::id(), state::now_ms()))
        }
    };
    let t0 = Instant::now();
    let (vm_name, staging_dir) = (name.to_string(), staging.clone());
    let op = match round {
        Round::Sleep => Op::Sleep {
            vm: vm_name,
            staging: staging_dir,
        },
        Round::Precopy => Op::Precopy {
            vm: vm_name,
            staging: staging_dir,
        },
    };
    let mut intent = Intent::begin(&h.home, op)?;
    // Made once the intent is recorded (a reconcile removes it), and
    // mounted into the VMM's jail (which masks the store).
    let made = std::fs::create_dir_all(&staging)
        .with_context(|| format!("cannot create {}", staging.display()))
        .and_then(|()| crate::jail::expose(r.pid, &staging));
    if let Err(e) = made {
        let _ = std::fs::remove_dir_all(&staging);
        intent.done();
        return Err(e);
    }

    // The moment: quiesced, recorded by the effects gateway (the branch's
    // effects up to here are its wakers' past), written to the staging
    // directory; the vm goes on (in a new process) until the commit.
    gateway::ensure_branch(&vm, &mut r)?;
    let mut moment = gateway::Moment::new(&r, effects::MomentKind::Snapshot)?;
    // A pre-copy round is no branch point: its moment is only a base the
    // sleep's diff goes over, so the guest is not asked to quiesce.
    let quiesced = match round {
        Round::Sleep => wake::quiesce(&vm, &r),
        Round::Precopy => Ok(None),
    };
    let quiesced = match quiesced {
        Ok(q) => q.is_some(),
        Err(e) => {
            intent.done();
            return Err(e);
        }
    };
    if let Err(e) = moment.begin(h, &vm, &r) {
        wake_again(&vm, &r, quiesced);
        intent.done();
        return Err(e);
    }
    let contract = vm.read_contract()?;
    // A vm woken from a stored snapshot tracks the pages it dirtied since
    // (KVM's dirty log and the VMM's own writes): only those are written
    // and stored, as a diff layer over that snapshot's.
    // A diff only over the base the link names (the VMM's may be another
    // after a crash between a pre-copy round's rebase and its record: then
    // a full layer).
    let base = parent.and(link.as_ref()).map(BranchLink::base_label);
    let req = match (parent, round) {
        (Some(_), _) | (None, Round::Precopy) => Request::SnapshotLayer {
            dir: staging.clone(),
            layers_dir: vm.layers_dir(),
            contract: Some(contract.to_toml()),
            full: parent.is_none(),
            rebase: label.clone(),
            expect_base: base.clone(),
        },
        (None, Round::Sleep) => Request::Snapshot {
            dir: staging.clone(),
            layers_dir: vm.layers_dir(),
            contract: Some(contract.to_toml()),
        },
    };
    let spawning = crate::settle::spawning();
    intent.phase(Phase::Asked)?;
    let res = api::call(&vm.api_socket(), &req, SNAPSHOT_TIMEOUT);
    let taken = matches!(&res, Ok(c) if c.reply.error.is_none());
    let mut problems = moment.end(h, taken, &[]);
    let reply = match res {
        Ok(c) if c.reply.error.is_none() => {
            let reply = c.reply.clone();
            round.fault("answered");
            if reply.continuation_pid.is_some() {
                // The process now listening on its control socket (the
                // reply's pid is one of the tree's PID namespace).
                let p = crate::proc::Pid::listening_on_or_gone(&vm.api_socket());
                r.pid = p.pid;
                r.pid_start = p.start;
                vm.write_record(&r)?;
            }
            intent.phase(Phase::Recorded)?;
            drop(spawning);
            drop(c);
            reply
        }
        Ok(c) => {
            let e = c.reply.error.clone().unwrap_or_default();
            drop(c);
            drop(spawning);
            let _ = std::fs::remove_dir_all(&staging);
            crate::settle::settle_pid(&vm);
            wake_again(&vm, &r, quiesced);
            intent.done();
            bail!("cannot snapshot {name:?}: {e}");
        }
        Err(e) => {
            drop(spawning);
            // A writer the VMM started may still run (the VMM died): it
            // ends before its staging directory goes.
            crate::settle::sweep(h);
            let _ = std::fs::remove_dir_all(&staging);
            crate::settle::settle_pid(&vm);
            wake_again(&vm, &r, quiesced);
            intent.done();
            return Err(Error::from(e).context(format!("cannot snapshot {name:?}")));
        }
    };
    // The vm runs on until the commit (its workload stays frozen where an
    // agent quiesced it); the branch continues from the moment. Not held
    // stopped: a sleep killed midway must leave a running vm (a quiesced
    // guest thaws itself when no wake comes).
    let snapshot_ms = t0.elapsed().as_secs_f64() * 1000.0;

    let t1 = Instant::now();
    gateway::write_snapshot_lineage(&staging, &r, &moment)?;
    let _ = std::fs::copy(
        vm.dir.join(crate::vm::WORKING_SET),
        staging.join(crate::vm::WORKING_SET),
    );
    let commit = Commit {
        name,
        state: match round {
            Round::Sleep => BranchState::Sleeping,
            Round::Precopy => BranchState::Running,
        },
        // The link first: a crash after the commit leaves the vm linked to
        // its new base; one before it, linked to a snapshot that never
        // was, whose next sleep is then a full one.
        before: &|id: SnapshotId| match &label {
            Some(l) => {
                let link = BranchLink {
                    branch: name.into(),
                    snapshot: id.0,
                    base: Some(l.clone()),
                };
                state::write_atomic(&link_path(&vm), &serde_json::to_vec(&link)?)
            }
            None => Ok(()),
        },
    };
    let stored = store_snapshot(&store, &staging, parent, base.as_deref(), &commit, bar);
    let _ = std::fs::remove_dir_all(&staging);
    let (snap, logical, new_stored, disks) = match stored {
        Ok(s) => s,
        Err(e) => {
            wake_again(&vm, &r, quiesced);
            intent.done();
            return Err(e.context(format!("{name:?} did not go to sleep; it runs on")));
        }
    };
    round.fault("stored");
    intent.phase(Phase::Committed)?;
    round.fault("committed");
    let store_ms = t1.elapsed().as_secs_f64() * 1000.0;
    if round == Round::Sleep {
        // Committed: the vm ends, its branch sleeps in the store.
        let removed = crate::vm::remove_locked(h, &vm, &r)?;
        problems.extend(removed.problems);
        intent.done();
        drop(_layers);
        let (_, more) = crate::layers::after_removal(h);
        problems.extend(more);
    } else {
        intent.done();
    }
    trim_cache(&store);
    Ok(SleepReport {
        name: name.into(),
        branch: name.into(),
        snapshot: snap.0,
        parent: parent.map(|p| p.0),
        pause_ms: reply.pause_ms.unwrap_or_default(),
        snapshot_ms,
        store_ms,
        total_ms: t0.elapsed().as_secs_f64() * 1000.0,
        memory_logical: logical,
        new_stored,
        disks,
        problems,
    })
}

/// The vm was quiesced for a sleep that did not happen: it goes on.
fn wake_again(vm: &VmDir, r: &VmRecord, quiesced: bool) {
    if !quiesced {
        return;
    }
    let r = vm.read_record().unwrap_or_else(|_| r.clone());
    let msg = vm
        .read_contract()
        .and_then(|c| wake::Round::new(&c)?.message(Role::Parent, &r, &[]));
    match msg {
        Ok(w) => {
            let woken = wake::wake_one(vm, w);
            for p in woken.failures() {
                tracing::warn!("{p}");
            }
        }
        Err(e) => tracing::warn!("cannot wake {:?} again: {e}", vm.name),
    }
}

/// What to wake (`tine wake`, `POST /v1/branches/{name}/wake`).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WakeSpec {
    /// The new vm's name (default: the branch's own, which must be
    /// sleeping; another name starts a new branch from its snapshot).
    #[serde(default)]
    pub name: Option<String>,
    /// A tap and an address from a new network tree.
    #[serde(default)]
    pub net: bool,
    /// Page memory in on demand from the store instead of writing it all
    /// out before the vm starts.
    #[serde(default)]
    pub lazy: bool,
    /// A fork contract (TOML text) over the snapshot's own.
    #[serde(default)]
    pub contract: Option<String>,
    /// The host to wake on (a fleet's, see `GET /v1/hosts`); default:
    /// the placement policy picks one (docs/design/fleet.md).
    #[serde(default)]
    pub host: Option<String>,
}

/// What waking a branch needs from a host (placement reads it).
#[derive(Clone, Debug)]
pub struct BranchNeeds {
    pub snapshot: store::SnapshotId,
    pub mem_mib: u64,
    pub vcpus: usize,
    pub compat: snapshot::compat::Compat,
}

/// What waking `branch` needs: its snapshot's memory, vCPUs and
/// compatibility manifest.
pub fn branch_needs(h: &Host, branch: &str) -> crate::Result<BranchNeeds> {
    let store = open(h)?;
    let b = store.branch(branch)?.ok_or_else(|| {
        Error::not_found(format!(
            "no branch named {branch:?} in the store (see `tine tree`)"
        ))
    })?;
    let info = store.snapshot(b.snapshot)?;
    let m: Manifest = serde_json::from_str(&info.manifest)
        .with_context(|| format!("snapshot {} has no vm manifest", b.snapshot))?;
    Ok(BranchNeeds {
        snapshot: b.snapshot,
        mem_mib: m.mem_mib,
        vcpus: m.vcpus,
        compat: m.compat,
    })
}

/// Wakes a branch: a vm continues from its snapshot.
pub fn wake(
    h: &Host,
    branch: &str,
    spec: &WakeSpec,
    bar: &dyn Progress,
) -> crate::Result<RunReport> {
    let t0 = Instant::now();
    state::validate_name(branch)?;
    let name = spec.name.clone().unwrap_or_else(|| branch.to_string());
    state::validate_name(&name)?;
    // The branch's lock serializes its wakes; the name's, the new vm.
    let _branch_lock = lock::acquire(&h.home, &format!(".branch-{branch}"), lock::DEFAULT_WAIT)?;
    let _name_lock = lock::reserve(&h.home, std::slice::from_ref(&name))?;
    let store = open(h)?;
    let b = store.branch(branch)?.ok_or_else(|| {
        Error::not_found(format!(
            "no branch named {branch:?} in the store (see `tine tree`)"
        ))
    })?;
    if name == branch && b.state != BranchState::Sleeping {
        return Err(Error::conflict(format!(
            "branch {branch:?} is {}; wake a copy of it under another name (`tine wake {branch} --name NEW`)",
            b.state
        )));
    }
    if name != branch && store.branch(&name)?.is_some() {
        return Err(Error::conflict(format!(
            "a branch named {name:?} exists already; pick another name"
        )));
    }
    if VmDir::new(&h.home, &name).exists() {
        return Err(Error::conflict(format!(
            "a vm named {name:?} exists already; pick another name"
        )));
    }
    if let Some(c) = &spec.contract {
        contract::Contract::parse(c).context("the contract; nothing was woken")?;
    }
    let mut intent = Intent::begin(
        &h.home,
        Op::Wake {
            branch: branch.into(),
            vm: name.clone(),
        },
    )?;
    // Whether the branch was marked running (past that, the vm stays).
    let mut marked = false;
    let res = (|| -> crate::Result<RunReport> {
        // gc removes wake copies no vm uses: not this one, between its
        // materializing and the vm running from it.
        let _copies = crate::layers::shared(h)?;
        let dir = materialize(&store, b.snapshot, spec.lazy, bar)?;
        crate::fault::point("wake:materialized");
        let shown = store
            .blob(b.snapshot, gateway::SNAPSHOT_LINEAGE)
            .ok()
            .flatten()
            .and_then(|l| serde_json::from_slice::<gateway::SnapshotLineage>(&l).ok())
            .and_then(|l| l.image);
        let mut run = RunSpec::restore(&name, &dir, spec.net);
        run.lazy_snapshot = spec.lazy.then_some(b.snapshot.0);
        run.dirty_base = Some(b.snapshot.0);
        run.contract = spec.contract.clone();
        run.shown_image = Some(shown.unwrap_or_else(|| format!("branch {branch}")));
        intent.phase(Phase::Asked)?;
        let mut started = crate::vm::start_reserved(h, run)?;
        crate::fault::point("wake:started");
        let vm = VmDir::new(&h.home, &name);
        let link = BranchLink {
            branch: name.clone(),
            snapshot: b.snapshot.0,
            base: None,
        };
        state::write_atomic(&link_path(&vm), &serde_json::to_vec(&link)?)?;
        if name == branch {
            store.set_branch(b.id, None, BranchState::Running)?;
        } else {
            store.create_branch(&name, b.snapshot, BranchState::Running)?;
        }
        marked = true;
        intent.phase(Phase::Recorded)?;
        // The time the caller waited, the materialization included.
        started.ready_ms = t0.elapsed().as_secs_f64() * 1000.0;
        Ok(started)
    })();
    // A wake that failed before its branch was marked leaves no vm: the
    // branch still sleeps (a stopped vm of its name beside it would make
    // `ls` show both and refuse `tine wake` of it until a `tine rm`).
    let res = match res {
        Err(e) if !marked => {
            let vm = VmDir::new(&h.home, &name);
            let mut kept = String::new();
            if vm.dir.exists() {
                // The error names the vm's logs; they outlive its removal.
                if let Some(d) = keep_failed_logs(h, &vm) {
                    kept = format!(" (its vmm.log and console.log are kept in {})", d.display());
                }
                crate::vm::undo_start(h, &vm);
            }
            Err(e.context(format!(
                "branch {branch:?} was not woken; it still sleeps{kept}"
            )))
        }
        res => res,
    };
    intent.done();
    trim_cache(&store);
    res
}

/// How many failed wakes' logs `$TINE_HOME/failed/` keeps (the oldest go).
const FAILED_LOGS_KEPT: usize = 8;

/// Moves a half-started vm's logs to `$TINE_HOME/failed/NAME-MS/` before
/// the vm is removed, keeping the newest [`FAILED_LOGS_KEPT`]; where they
/// went, or `None` if nothing could be kept.
fn keep_failed_logs(h: &Host, vm: &VmDir) -> Option<std::path::PathBuf> {
    let root = h.home.join("failed");
    let dest = root.join(format!("{}-{}", vm.name, state::now_ms()));
    std::fs::create_dir_all(&dest).ok()?;
    let mut any = false;
    for f in [vm.vmm_log(), vm.console_log()] {
        if let Some(base) = f.file_name() {
            any |= std::fs::rename(&f, dest.join(base)).is_ok();
        }
    }
    let mut old: Vec<_> = std::fs::read_dir(&root)
        .ok()?
        .flatten()
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    old.sort();
    let n = old.len().saturating_sub(FAILED_LOGS_KEPT);
    for (_, p) in old.into_iter().take(n) {
        let _ = std::fs::remove_dir_all(p);
    }
    if !any {
        let _ = std::fs::remove_dir(&dest);
        return None;
    }
    Some(dest)
}

/// Finishes a wake whose vm became ready but whose branch was not
/// marked running (tined was killed in between): reconcile's roll forward.
pub(crate) fn finish_wake(h: &Host, branch: &str, name: &str) -> crate::Result<()> {
    let store = open(h)?;
    let b = store
        .branch(branch)?
        .ok_or_else(|| Error::not_found(format!("no branch {branch:?}")))?;
    let vm = VmDir::new(&h.home, name);
    let link = BranchLink {
        branch: name.into(),
        snapshot: b.snapshot.0,
        base: None,
    };
    state::write_atomic(&link_path(&vm), &serde_json::to_vec(&link)?)?;
    if name == branch {
        if b.state == BranchState::Sleeping {
            store.set_branch(b.id, None, BranchState::Running)?;
        }
    } else if store.branch(name)?.is_none() {
        store.create_branch(name, b.snapshot, BranchState::Running)?;
    }
    Ok(())
}

/// Forks a sleeping branch: new branches wake from its snapshot, one after
/// another (they share its materialized memory file). The names are
/// checked as a running vm's fork checks them (count or names, limits,
/// duplicates, names in use) and an invalid contract is refused, before
/// any of them starts; a copy that fails to start stops the fork with the
/// ones started so far left running, reported per child (an error when
/// the first one fails: then nothing started).
pub(crate) fn fork_sleeping(
    h: &Host,
    branch: &str,
    spec: &crate::fork::ForkSpec,
) -> crate::Result<crate::fork::ForkReport> {
    let names = crate::fork::child_names(h, branch, spec)?;
    fork_sleeping_by(h, branch, spec, &names, &|n, w| {
        wake(h, branch, w, &store::NoProgress)
            .with_context(|| format!("cannot wake {n:?} from {branch:?}"))
    })
}

/// [`fork`] of a sleeping branch into `names`, each child woken by
/// `wake_child(name, spec)`: here, or (tined, in a fleet) on the host
/// placement picked for it.
pub fn fork_sleeping_by(
    h: &Host,
    branch: &str,
    spec: &crate::fork::ForkSpec,
    names: &[String],
    wake_child: &dyn Fn(&str, &WakeSpec) -> crate::Result<RunReport>,
) -> crate::Result<crate::fork::ForkReport> {
    let names = names.to_vec();
    for n in &names {
        if crate::branches::has_branch_in(&h.home, n) {
            return Err(Error::conflict(format!(
                "a branch named {n:?} exists in the store; choose other names"
            )));
        }
    }
    if let Some(c) = &spec.contract {
        contract::Contract::parse(c).context("the contract; nothing was woken")?;
    }
    let t0 = Instant::now();
    let mut report = crate::fork::ForkReport {
        name: branch.into(),
        names: names.clone(),
        ..Default::default()
    };
    for (i, n) in names.iter().enumerate() {
        let woken = wake_child(
            n,
            &WakeSpec {
                name: Some(n.clone()),
                contract: spec.contract.clone(),
                ..WakeSpec::default()
            },
        );
        let s = match woken {
            Ok(s) => s,
            Err(e) if i == 0 => return Err(e),
            Err(e) => {
                report.results.push(crate::fork::ChildResult {
                    name: n.clone(),
                    pid: None,
                    ok: false,
                    error: Some(e.to_string()),
                });
                for rest in &names[i + 1..] {
                    report.results.push(crate::fork::ChildResult {
                        name: rest.clone(),
                        pid: None,
                        ok: false,
                        error: Some(format!("not started: {n:?} failed before it")),
                    });
                }
                report
                    .problems
                    .push(format!("the fork stopped at {n:?}: {e}"));
                break;
            }
        };
        report.children.push(s.pid);
        report.child_running_ms.push(s.ready_ms);
        report.results.push(crate::fork::ChildResult {
            name: n.clone(),
            pid: Some(s.pid),
            ok: true,
            error: None,
        });
        report.problems.extend(s.problems);
        report.wake.extend(s.wake);
    }
    report.total_ms = t0.elapsed().as_secs_f64() * 1000.0;
    report.all_children_ms = Some(report.total_ms);
    Ok(report)
}

/// Forks any node of the tree by name: a running vm (its children
/// continue from this moment, [`crate::fork::fork`]) or a sleeping branch
/// (new branches wake from its snapshot).
pub fn fork(
    h: &Host,
    name: &str,
    spec: &crate::fork::ForkSpec,
) -> crate::Result<crate::fork::ForkReport> {
    state::validate_name(name)?;
    if is_sleeping(h, name) {
        return fork_sleeping(h, name, spec);
    }
    crate::fork::fork(h, name, spec)
}

/// Removes any node of the tree by name: a vm ([`crate::vm::remove`]) or
/// a sleeping branch.
pub fn remove(h: &Host, name: &str, force: bool) -> crate::Result<crate::vm::Removed> {
    state::validate_name(name)?;
    if VmDir::new(&h.home, name).exists() {
        return crate::vm::remove(h, name, force);
    }
    remove_branch(h, name)
}

/// Removes a sleeping branch (`tine rm` of a name that is no vm): it no
/// longer keeps its snapshot alive; gc reclaims what only it held.
pub(crate) fn remove_branch(h: &Host, name: &str) -> crate::Result<crate::vm::Removed> {
    let _lock = lock::acquire(&h.home, &format!(".branch-{name}"), lock::DEFAULT_WAIT)?;
    let b = branch_row(h, name).ok_or_else(|| {
        Error::not_found(format!(
            "no vm named {name:?}, nor a sleeping branch (see `tine ls`)"
        ))
    })?;
    open(h)?.set_branch(b.id, None, BranchState::Gone)?;
    Ok(crate::vm::Removed {
        name: name.into(),
        what: "branch".into(),
        processes: 0,
        layers_freed: 0,
        problems: Vec::new(),
    })
}

/// The store's tree (snapshots with their own and shared bytes, branches).
pub fn store_tree(h: &Host) -> crate::Result<store::Tree> {
    let store = open(h)?;
    reap_branches(h, &store)?;
    Ok(store.tree()?)
}

/// One node of the lineage: a running vm, a sleeping branch, a checkpoint,
/// or a stored snapshot.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Node {
    /// `vm:NAME`, `branch:NAME`, `checkpoint:VM@TAG`, `snapshot:ID`.
    pub id: String,
    /// `vm`, `branch`, `checkpoint` or `snapshot`.
    pub kind: String,
    pub name: String,
    /// running, stopped, crashed (a vm); sleeping (a branch); ready (a
    /// checkpoint); committed (a snapshot).
    pub state: String,
    /// The node it continues from.
    pub parent: Option<String>,
    pub created_ms: u64,
    /// Bytes only this node holds in the store (snapshots).
    pub own_bytes: Option<u64>,
    /// Memory of a vm, in MiB.
    pub mem_mib: Option<u64>,
    pub pid: Option<u32>,
}

/// The whole lineage: running vms, sleeping branches, checkpoints and
/// stored snapshots as one tree (what `ls` and `tree` both show).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Lineage {
    pub nodes: Vec<Node>,
    /// The store's totals (None: no store yet).
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub store: Option<store::Totals>,
}

/// The lineage of this home.
pub fn lineage(h: &Host) -> crate::Result<Lineage> {
    let mut nodes = Vec::new();
    let mut totals = None;
    let mut branch_of_vm = std::collections::HashMap::new();
    if store_exists(h) {
        let t = store_tree(h)?;
        for s in &t.snapshots {
            nodes.push(Node {
                id: format!("snapshot:{}", s.id),
                kind: "snapshot".into(),
                name: s
                    .manifest
                    .get("name")
                    .and_then(|v| v.as_str())
                    .map(|n| format!("{} ({n})", s.id))
                    .unwrap_or_else(|| s.id.to_string()),
                state: "committed".into(),
                parent: s.parent.map(|p| format!("snapshot:{p}")),
                created_ms: u64::try_from(s.created_ms).unwrap_or(0),
                own_bytes: Some(s.sizes.own_stored),
                mem_mib: s.manifest.get("mem_mib").and_then(|v| v.as_u64()),
                pid: None,
            });
        }
        for b in &t.branches {
            match b.state {
                BranchState::Sleeping => nodes.push(Node {
                    id: format!("branch:{}", b.name),
                    kind: "branch".into(),
                    name: b.name.clone(),
                    state: "sleeping".into(),
                    parent: Some(format!("snapshot:{}", b.snapshot)),
                    created_ms: u64::try_from(b.updated_ms).unwrap_or(0),
                    own_bytes: None,
                    mem_mib: None,
                    pid: None,
                }),
                BranchState::Running => {
                    branch_of_vm.insert(b.name.clone(), b.snapshot);
                }
                BranchState::Gone => {}
            }
        }
        totals = Some(t.totals);
    }
    for info in crate::vm::list(h)? {
        let parent = match (&info.parent, branch_of_vm.get(&info.name)) {
            // A fork's child hangs under its parent vm while that runs.
            (Some(p), _) if VmDir::new(&h.home, p).exists() => Some(format!("vm:{p}")),
            (_, Some(s)) => Some(format!("snapshot:{s}")),
            (Some(p), None) => Some(format!("vm:{p}")),
            (None, None) => None,
        };
        let vm = VmDir::new(&h.home, &info.name);
        let created = vm.read_record().map(|r| r.created_ms).unwrap_or(0);
        for c in crate::fork::list_checkpoints(h, &info.name)? {
            nodes.push(Node {
                id: format!("checkpoint:{}@{}", info.name, c.tag),
                kind: "checkpoint".into(),
                name: format!("{}@{}", info.name, c.tag),
                state: "ready".into(),
                parent: Some(format!("vm:{}", info.name)),
                created_ms: c.created_ms,
                own_bytes: None,
                mem_mib: Some(info.mem_mib),
                pid: Some(c.pid),
            });
        }
        nodes.push(Node {
            id: format!("vm:{}", info.name),
            kind: "vm".into(),
            name: info.name.clone(),
            state: info.state.to_string(),
            parent,
            created_ms: created,
            own_bytes: None,
            mem_mib: Some(info.mem_mib),
            pid: info.pid,
        });
    }
    Ok(Lineage {
        nodes,
        store: totals,
    })
}

/// What gc reclaimed.
#[derive(Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct GcReport {
    /// The store's part: pruned snapshots, chunks deleted.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub store: Option<store::GcReport>,
    /// Materialized wake copies (`store/wake/`) no vm uses, removed.
    pub wake_copies_removed: usize,
    pub wake_bytes_freed: u64,
    /// Frozen disk layers nothing uses, removed or folded.
    pub layers_freed: usize,
    /// Stray VMM processes of this home no record knows, ended.
    pub strays_ended: usize,
    pub problems: Vec<String>,
}

/// Reclaims everything nothing references: snapshots without a branch or
/// child, their chunks, wake copies no vm uses, frozen layers no chain
/// uses, stray processes.
pub fn gc(h: &Host, bar: &dyn Progress) -> crate::Result<GcReport> {
    let mut report = GcReport {
        strays_ended: crate::settle::sweep(h),
        ..GcReport::default()
    };
    if store_exists(h) {
        let store = open(h)?;
        reap_branches(h, &store)?;
        let opts = store::GcOptions {
            prune_snapshots: true,
            ..store::GcOptions::default()
        };
        report.store = Some(store.gc(&opts, bar)?);
        let (n, bytes) = remove_unused_wake_copies(h, &store);
        report.wake_copies_removed = n;
        report.wake_bytes_freed = bytes;
        trim_cache(&store);
    }
    let (freed, problems) = crate::layers::after_removal(h);
    report.layers_freed = freed;
    report.problems.extend(problems);
    Ok(report)
}

/// Removes materialized snapshots under `store/wake/` that no vm or
/// checkpoint uses (no disk chain reaches into them, no vm was restored
/// from them and runs). Returns how many and their bytes.
fn remove_unused_wake_copies(h: &Host, store: &Store) -> (usize, u64) {
    let wake = store.dir().join("wake");
    // Not while a wake is between its copy and its vm (it holds it shared).
    let Ok(Some(_lock)) = crate::layers::try_exclusive(h) else {
        return (0, 0);
    };
    let Ok(rd) = std::fs::read_dir(&wake) else {
        return (0, 0);
    };
    let used = crate::layers::paths_in_use(h);
    let mut n = 0;
    let mut bytes = 0;
    for e in rd.flatten() {
        let dir = e.path();
        if used.iter().any(|p| p.starts_with(&dir)) {
            continue;
        }
        bytes += dir_bytes(&dir);
        if std::fs::remove_dir_all(&dir).is_ok() {
            n += 1;
        }
    }
    (n, bytes)
}

/// Bytes allocated by the files directly in `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.blocks() * 512)
                .sum()
        })
        .unwrap_or(0)
}

/// What `prefetch` brought into this host's chunk cache.
#[derive(Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PrefetchReport {
    pub snapshot: i64,
    /// Stored bytes fetched from the backend (chunks the cache had are
    /// not counted).
    pub fetched: u64,
    pub ms: f64,
}

/// Brings every chunk of committed snapshot `id` (memory and disks) into
/// this host's chunk cache, verified: a move's target does it while the
/// vm still runs on its source, so the wake after the move's final sleep
/// reads the cache. Without a remote backend there is nothing to do.
pub fn prefetch(h: &Host, id: i64, bar: &dyn Progress) -> crate::Result<PrefetchReport> {
    let t0 = Instant::now();
    let store = open(h)?;
    let info = store.snapshot(SnapshotId(id))?;
    let mut fetched = 0;
    for l in &info.layers {
        let view = store.layer(info.id, l.kind)?;
        let all: Vec<u64> = (0..view.windows()).collect();
        fetched += view.prefetch(&all, bar)?;
    }
    Ok(PrefetchReport {
        snapshot: id,
        fetched,
        ms: t0.elapsed().as_secs_f64() * 1000.0,
    })
}

/// Checks every chunk of the store: present, decompresses, hashes to its name.
pub fn verify(h: &Host, bar: &dyn Progress) -> crate::Result<store::VerifyReport> {
    Ok(open(h)?.verify(bar)?)
}

/// Stores a snapshot directory as snapshot `name` (child of `parent`) and
/// commits it with branch `name` sleeping in it. Returns the snapshot,
/// the memory bytes it records itself, the bytes new in the backend and
/// how each disk was stored.
fn store_snapshot(
    store: &Store,
    dir: &Path,
    parent: Option<SnapshotId>,
    base: Option<&str>,
    commit: &Commit,
    bar: &dyn Progress,
) -> crate::Result<(SnapshotId, u64, u64, Vec<DiskReport>)> {
    let name = commit.name;
    let manifest_text = std::fs::read_to_string(dir.join(snapshot_dir::MANIFEST))
        .context("the staged snapshot has no manifest")?;
    let manifest: Manifest = serde_json::from_str(&manifest_text)?;
    let state_bytes = std::fs::read(dir.join(snapshot_dir::STATE))?;
    let before = store.counters();
    let mut w = store.begin(parent, &manifest_text)?;
    let mem = match (parent, dir.join(snapshot_dir::MEMORY_LAYER)) {
        (p, layer) if layer.is_file() => {
            let file = vmm::layer::LayerFile::open(&layer)?;
            match (p, file.base()) {
                (Some(p), Some(b)) if file.is_diff() && Some(b) == base => {
                    let source = DiffSource {
                        base: store.layer(p, LayerKind::Memory)?,
                        bitmap: file.flat_bitmap(),
                        file,
                    };
                    let dirty = Dirty::Pages {
                        bitmap: &source.bitmap,
                        page_size: 4096,
                    };
                    w.put_layer(LayerKind::Memory, &source, &dirty, bar)?
                }
                // A diff over anything else cannot be read as an image.
                (_, b) if file.is_diff() => bail!(
                    "the VMM wrote a diff over {b:?}, but {name:?} is linked to {base:?} (parent snapshot {parent:?}); nothing was stored"
                ),
                // A full layer (the VMM had no complete dirty set).
                _ => w.put_layer(LayerKind::Memory, &FullSource(file), &Dirty::All, bar)?,
            }
        }
        _ => {
            let memory = std::fs::File::open(dir.join(snapshot_dir::MEMORY))?;
            w.put_layer(LayerKind::Memory, &memory, &Dirty::All, bar)?
        }
    };
    let mut disks = Vec::with_capacity(manifest.disks.len());
    for (i, d) in manifest.disks.iter().enumerate() {
        let disk = disk::Disk::open(&d.path, false)
            .with_context(|| format!("cannot read disk {}", d.path.display()))?;
        let read_bytes = std::sync::atomic::AtomicU64::new(0);
        let source = store::FnSource {
            len: disk.size(),
            read: |buf: &mut [u8], off: u64| {
                read_bytes.fetch_add(buf.len() as u64, std::sync::atomic::Ordering::Relaxed);
                disk.read_at(buf, off)
                    .map_err(|e| std::io::Error::other(e.to_string()))
            },
        };
        let i = u32::try_from(i).map_err(|_| Error::invalid("too many disks"))?;
        let changed = disk_changed_windows(store, parent, i, &disk)
            .with_context(|| format!("cannot map disk {}", d.path.display()))?;
        let dirty = match &changed {
            Some(w) => Dirty::Windows(w),
            None => Dirty::All,
        };
        let st = w.put_layer(LayerKind::Disk(i), &source, &dirty, bar)?;
        disks.push(DiskReport {
            size: disk.size(),
            diff: changed.is_some(),
            read_bytes: read_bytes.into_inner(),
            logical: st.logical_bytes,
        });
    }
    w.put_blob(snapshot_dir::STATE, state_bytes);
    if let Ok(l) = std::fs::read(dir.join(gateway::SNAPSHOT_LINEAGE)) {
        w.put_blob(gateway::SNAPSHOT_LINEAGE, l);
    }
    if let Some(pages) = working_set_pages(dir, &manifest) {
        w.set_working_set(pages);
    }
    let change = match store.branch(name)? {
        Some(b) => BranchChange::Update {
            id: b.id,
            state: commit.state,
        },
        None => BranchChange::Create {
            name: name.into(),
            state: commit.state,
        },
    };
    (commit.before)(w.id())?;
    let (snap, _) = w.commit_branch(change)?;
    let after = store.counters();
    Ok((
        snap,
        mem.logical_bytes,
        after.put_bytes.saturating_sub(before.put_bytes),
        disks,
    ))
}

/// How a stored moment is committed: branch `name` in `state`, after
/// `before` ran with the snapshot's id.
struct Commit<'a> {
    name: &'a str,
    state: BranchState,
    before: &'a dyn Fn(SnapshotId) -> crate::Result<()>,
}

/// The store windows of disk `i` that can differ from the `parent`
/// snapshot's disk layer `i`, when the chain bottoms out at that layer as
/// materialized by a wake (`store/wake/PARENT[-lazy]/disk<i>.raw`): the
/// windows touched by whatever the qcow2 layers above it map (data, zero
/// and discarded clusters). None (read the whole disk) for any other
/// chain: a window wrongly left out would lose the guest's data.
fn disk_changed_windows(
    store: &Store,
    parent: Option<SnapshotId>,
    i: u32,
    disk: &disk::Disk,
) -> crate::Result<Option<Vec<u64>>> {
    use std::os::unix::fs::MetadataExt;
    let Some(p) = parent else {
        return Ok(None);
    };
    let chain = disk.chain();
    let Some(bottom) = chain.last() else {
        return Ok(None);
    };
    if chain.len() < 2 || bottom.format != disk::Format::Raw {
        return Ok(None);
    }
    // Same file by identity, however the chain spells its path.
    let Ok(b) = std::fs::metadata(&bottom.path) else {
        return Ok(None);
    };
    let wake = store.dir().join("wake");
    let is_base = [p.0.to_string(), format!("{}-lazy", p.0)].iter().any(|n| {
        std::fs::metadata(wake.join(n).join(format!("disk{i}.raw")))
            .is_ok_and(|m| (m.dev(), m.ino()) == (b.dev(), b.ino()))
    });
    if !is_base {
        return Ok(None);
    }
    let base = match store.layer(p, LayerKind::Disk(i)) {
        Ok(v) => v,
        Err(store::StoreError::NoLayer { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if base.size() != disk.size() || bottom.virtual_size != base.size() {
        return Ok(None);
    }
    let ws = base.window_size();
    let mut windows: Vec<u64> = Vec::new();
    for r in disk.changed_above(chain.len() - 1)? {
        let first = r.start / ws;
        let last = (r.end - 1) / ws;
        let from = match windows.last() {
            Some(&l) if l >= first => l + 1,
            _ => first,
        };
        windows.extend(from..=last);
    }
    Ok(Some(windows))
}

/// A diff memory layer read as a whole image: the parent snapshot's
/// memory (from the store) with the layer's pages over it. Only the
/// windows holding dirty pages are read.
struct DiffSource {
    base: store::LayerView,
    file: vmm::layer::LayerFile,
    bitmap: Vec<u64>,
}

impl store::Source for DiffSource {
    fn len(&self) -> u64 {
        self.file.layout().len()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.base
            .read_at(buf, offset)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        self.file
            .overlay(buf, offset)
            .map_err(|e| std::io::Error::other(e.to_string()))
    }
}

/// A full memory layer file read as an image.
struct FullSource(vmm::layer::LayerFile);

impl store::Source for FullSource {
    fn len(&self) -> u64 {
        self.0.layout().len()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.0
            .read_at(buf, offset)
            .map_err(|e| std::io::Error::other(e.to_string()))
    }
}

/// Writes committed snapshot `id` as a snapshot directory (once per host;
/// later wakes reuse it) and returns the directory. For a lazy wake
/// (`lazy`) its `memory` file is only a size (a hole): the VMM pages RAM
/// in from the store instead.
fn materialize(
    store: &Store,
    id: SnapshotId,
    lazy: bool,
    bar: &dyn Progress,
) -> crate::Result<PathBuf> {
    let name = if lazy {
        format!("{}-lazy", id.0)
    } else {
        id.0.to_string()
    };
    let dir = store.dir().join("wake").join(&name);
    if dir.join(snapshot_dir::MANIFEST).is_file() {
        return Ok(dir);
    }
    let info = store.snapshot(id)?;
    let mut manifest: Manifest = serde_json::from_str(&info.manifest)
        .with_context(|| format!("snapshot {id} has no vm manifest"))?;
    // The memory is a plain file here, whatever layer it came from.
    manifest.memory_layer = None;
    let tmp = store
        .dir()
        .join("wake")
        .join(format!("{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let memory = store.layer(id, LayerKind::Memory)?;
    let f = std::fs::File::create(tmp.join(snapshot_dir::MEMORY))?;
    f.set_len(memory.size())?;
    if !lazy {
        memory
            .restore(&f, true, bar)
            .with_context(|| format!("cannot read the memory of snapshot {id}"))?;
        f.sync_all()?;
    }
    for (i, d) in manifest.disks.iter_mut().enumerate() {
        let kind = LayerKind::Disk(u32::try_from(i).map_err(|_| Error::invalid("too many disks"))?);
        let layer = store.layer(id, kind)?;
        let f = std::fs::File::create(tmp.join(format!("disk{i}.raw")))?;
        f.set_len(layer.size())?;
        layer
            .restore(&f, true, bar)
            .with_context(|| format!("cannot read disk {i} of snapshot {id}"))?;
        f.sync_all()?;
        // The woken vm stacks its own top layer on the restored contents.
        d.path = dir.join(format!("disk{i}.raw"));
        d.frozen = true;
    }
    let state_bytes = store
        .blob(id, snapshot_dir::STATE)?
        .with_context(|| format!("snapshot {id} has no vCPU and device state"))?;
    std::fs::write(tmp.join(snapshot_dir::STATE), state_bytes)?;
    // Whose moment it is: a woken branch continues its effects lineage.
    if let Some(l) = store.blob(id, gateway::SNAPSHOT_LINEAGE)? {
        std::fs::write(tmp.join(gateway::SNAPSHOT_LINEAGE), l)?;
    }
    // The stored manifest as the VMM sealed it, checked, then re-sealed
    // with this host's disk paths.
    std::fs::write(tmp.join(snapshot_dir::MANIFEST), info.manifest.as_bytes())?;
    snapshot_dir::reseal(&tmp, &manifest)
        .with_context(|| format!("snapshot {id}'s state does not verify"))?;
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another wake of the same snapshot got there first.
        Err(_) if dir.join(snapshot_dir::MANIFEST).is_file() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(e).with_context(|| format!("cannot create {}", dir.display())),
    }
}

/// The working set a lazy wake of this vm recorded (copied into the
/// staged snapshot `dir`), as 4 KiB page numbers of the memory layer in
/// the order they were first touched.
fn working_set_pages(dir: &Path, manifest: &Manifest) -> Option<Vec<u64>> {
    let ws = vmm::pagein::WorkingSet::read(&dir.join(crate::vm::WORKING_SET)).ok()?;
    let layout = vmm::layer::RamLayout::of(&vmm::moment::ram_regions(manifest.mem_mib));
    let mut pages = Vec::new();
    for (gpa, len) in ws.ranges {
        for p in (gpa..gpa.saturating_add(len)).step_by(4096) {
            if let Some(off) = layout.offset(p) {
                pages.push(off / 4096);
            }
        }
    }
    Some(pages)
}
