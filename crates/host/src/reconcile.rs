//! Putting things right after a crash: the processes are the truth, the
//! records follow them.
//!
//! On start tined calls [`reconcile`]: each vm's record is pointed at the
//! process that answers on its control socket (a fork or snapshot whose
//! answer was never recorded left the vm in a new process); every intent
//! left by an operation that did not finish is rolled back, or finished
//! when it was past its point of no return; and VMM processes of this home
//! that no record knows (children of a fork that never got recorded) are
//! ended. After it, `ls` shows what the processes are.

use std::sync::{RwLock, RwLockReadGuard};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::intent::{self, Op, Phase};
use crate::proc::Pid;
use crate::state::{self, VmDir, VmState};
use crate::{fork, vm, wake, Host};

/// Held (shared) by operations between starting a process and recording
/// it; [`sweep`] holds it exclusively, so it never ends a process that is
/// about to be recorded.
static SPAWNING: RwLock<()> = RwLock::new(());

/// Taken by an operation that starts VMM processes until they are recorded.
pub fn spawning() -> RwLockReadGuard<'static, ()> {
    SPAWNING.read().unwrap_or_else(|e| e.into_inner())
}

/// How long a control socket may take to answer a ping here.
const PING: Duration = Duration::from_millis(1500);

/// Points the vm's record at the process answering on its control socket
/// (the continuation of a moment whose answer was not recorded). Returns
/// whether a process answered.
pub fn settle_pid(vm: &VmDir) -> bool {
    let Ok(mut r) = vm.read_record() else {
        return false;
    };
    match vmm::api::call(&vm.api_socket(), &vmm::api::Request::Ping, PING) {
        Ok(c) => {
            let pid = c.reply.pid;
            if pid != 0 && pid != r.pid {
                if let Some(p) = Pid::of(pid) {
                    r.pid = p.pid;
                    r.pid_start = p.start;
                    let _ = vm.write_record(&r);
                }
            }
            true
        }
        Err(_) => false,
    }
}

/// Ends every VMM process of this home that no record knows (vms and
/// checkpoint templates). Returns how many.
pub fn sweep(h: &Host) -> usize {
    let _all = SPAWNING.write().unwrap_or_else(|e| e.into_inner());
    let mut known = std::collections::HashSet::new();
    let mut templates = std::collections::HashSet::new();
    if let Ok(vms) = state::list(&h.home) {
        for vm in vms {
            settle_pid(&vm);
            if let Ok(r) = vm.read_record() {
                known.insert(r.pid);
            }
            if let Ok(cps) = fork::list_checkpoints(h, &vm.name) {
                templates.extend(cps.iter().map(|c| c.pid));
            }
        }
    }
    known.extend(&templates);
    let mut ended = 0;
    for p in crate::proc::vmm_processes(&h.bins.vmm_name(), &h.home) {
        if known.contains(&p.pid) || is_template_standby(p.pid, &templates) {
            continue;
        }
        tracing::warn!(
            "ending VMM process {} that no record of {} knows",
            p.pid,
            h.home.display()
        );
        if p.kill(Duration::from_secs(10)).is_ok() {
            ended += 1;
        }
    }
    ended
}

/// Whether `pid` is the standby of a checkpoint template: its child that
/// waits, VM made, for the next rollback (no record names it). It still
/// shows as the template (`tine-vmm NAME (checkpoint TAG)`); a vm a
/// rollback started from the template names itself after its vm, and is
/// a stray like any other if no record knows it.
fn is_template_standby(pid: u32, templates: &std::collections::HashSet<u32>) -> bool {
    let child = crate::proc::ProcStat::read(pid).is_some_and(|s| templates.contains(&s.ppid));
    child
        && std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains("(checkpoint "))
}

/// Undoes the directory of a snapshot that did not complete (failed, or
/// its answer was never recorded): it must not look like a snapshot,
/// even if the VMM finished writing it, since nothing registered the
/// frozen disk layers it names (they may be folded or deleted) nor wrote
/// its effects lineage. Removed when this operation created it; else the
/// files a snapshot writes are taken out of it, its manifest first.
pub fn undo_snapshot_dir(record: &intent::Record) {
    if let Op::Snapshot { dir, created, .. } = &record.op {
        if *created {
            let _ = std::fs::remove_dir_all(dir);
            return;
        }
        use vmm::snapshot_dir::{MANIFEST, MEMORY, MEMORY_LAYER, STATE};
        for f in [
            MANIFEST,
            STATE,
            MEMORY,
            MEMORY_LAYER,
            crate::gateway::SNAPSHOT_LINEAGE,
        ] {
            let _ = std::fs::remove_file(dir.join(f));
        }
    }
}

/// What [`reconcile`] found and did.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReconcileReport {
    /// Vms whose record was pointed at the process that really runs them.
    pub repointed: Vec<String>,
    /// Operations found unfinished, and what was done about each.
    pub intents: Vec<String>,
    /// Stray VMM processes ended.
    pub strays_ended: usize,
    /// Running vms found (adopted).
    pub running: usize,
}

/// Wakes `vm` as the parent of a moment that did not complete (it may
/// still be quiesced; its watchdog would thaw it, but with stale time).
fn wake_parent(vm: &VmDir) {
    let Ok(r) = vm.read_record() else { return };
    if !r.agent || vm.state(&r) != VmState::Running {
        return;
    }
    let msg = vm
        .read_contract()
        .and_then(|c| wake::Round::new(&c)?.message(protocol::wake::Role::Parent, &r, &[]));
    if let Ok(w) = msg {
        let _ = wake::wake_one(vm, w);
    }
}

/// Brings records, processes and intents of `h` into agreement (see the
/// module). Run once at start, before anything else touches the home.
pub fn reconcile(h: &Host) -> crate::Result<ReconcileReport> {
    let mut report = ReconcileReport::default();
    for vm in state::list(&h.home)? {
        let before = vm.read_record().ok().map(|r| r.pid);
        settle_pid(&vm);
        let after = vm.read_record().ok().map(|r| r.pid);
        if before != after {
            report.repointed.push(vm.name.clone());
        }
    }
    // What no record knows (a snapshot's writer, children of a fork whose
    // answer was lost) ends before the intents are settled, so none of it
    // goes on writing into what they undo.
    report.strays_ended = sweep(h);
    // Newest first: an operation inside another (the vm start of a wake)
    // is settled before the one around it.
    intent::remove_partial(&h.home);
    let mut pending = intent::pending(&h.home);
    pending.reverse();
    for (path, rec) in pending {
        let what = settle_intent(h, &rec);
        report
            .intents
            .push(format!("{}: {what}", describe(&rec.op)));
        let _ = std::fs::remove_file(path);
    }
    report.strays_ended += sweep(h);
    let (_, problems) = crate::layers::after_removal(h);
    for p in problems {
        tracing::warn!("{p}");
    }
    report.running = vm::list(h)?
        .iter()
        .filter(|v| v.state == VmState::Running)
        .count();
    Ok(report)
}

fn describe(op: &Op) -> String {
    match op {
        Op::Run { vm } => format!("run {vm}"),
        Op::Fork { vm, children } => format!("fork {vm} into {}", children.join(",")),
        Op::Checkpoint { vm, tag } => format!("checkpoint {vm}@{tag}"),
        Op::Rollback { vm, tag } => format!("rollback {vm} to {tag}"),
        Op::Snapshot { vm, dir, .. } => format!("snapshot {vm} to {}", dir.display()),
        Op::Sleep { vm, .. } => format!("sleep {vm}"),
        Op::Wake { branch, vm } => format!("wake {branch} as {vm}"),
        Op::Remove { vm } => format!("rm {vm}"),
    }
}

/// Rolls one unfinished operation back (or forward past its point of no
/// return); says what it did.
fn settle_intent(h: &Host, rec: &intent::Record) -> String {
    let dir = |n: &str| VmDir::new(&h.home, n);
    match &rec.op {
        // A vm that was never reported ready (not woken with its identity)
        // is removed: nothing half-done is shown as done.
        Op::Run { vm: name } => {
            let d = dir(name);
            if d.dir.exists() {
                vm::undo_start(h, &d);
                "the vm was not ready; removed".into()
            } else {
                "nothing was left".into()
            }
        }
        // Children not yet woken are ended; the parent goes on in whatever
        // process answers for it, woken again.
        Op::Fork { vm: name, children } => {
            for c in children {
                let d = dir(c);
                if d.dir.exists() {
                    vm::undo_start(h, &d);
                }
            }
            wake_parent(&dir(name));
            format!("{} children removed, the parent goes on", children.len())
        }
        Op::Checkpoint { vm: name, tag } => {
            let d = dir(name);
            let recorded = d.checkpoints().join(format!("{tag}.json")).is_file();
            if rec.phase < Phase::Recorded || !recorded {
                let _ = std::fs::remove_file(d.checkpoints().join(format!("{tag}.json")));
                let _ = std::fs::remove_file(d.checkpoints().join(format!("{tag}.sock")));
            }
            wake_parent(&d);
            if recorded && rec.phase >= Phase::Recorded {
                "the checkpoint was recorded; kept".into()
            } else {
                "the checkpoint was not recorded; its template is ended".into()
            }
        }
        Op::Rollback { vm: name, .. } => {
            if settle_pid(&dir(name)) {
                "the vm runs from the checkpoint".into()
            } else {
                "the rollback did not complete; the vm is not running".into()
            }
        }
        Op::Snapshot { vm: name, .. } => {
            undo_snapshot_dir(rec);
            wake_parent(&dir(name));
            "the snapshot was not recorded; its directory was removed".into()
        }
        Op::Sleep { vm: name, staging } => {
            let _ = std::fs::remove_dir_all(staging);
            let d = dir(name);
            // The store's commit is the point of no return; the intent is
            // marked committed just after it, so a crash in between leaves
            // the branch sleeping in the store with the intent short of
            // it. The store is the truth (a sleep never starts while its
            // branch sleeps).
            if rec.phase >= Phase::Committed || crate::tree::branch_sleeps(h, name) {
                // The branch sleeps in the store: the vm must not run on.
                if let Ok(r) = d.read_record() {
                    let _ = vm::remove_locked(h, &d, &r);
                }
                "the snapshot was committed; the vm is ended, its branch sleeps".into()
            } else {
                wake_parent(&d);
                "the snapshot was not committed; the vm runs on".into()
            }
        }
        Op::Wake { branch, vm: name } => {
            // The Run intent of the same wake (if any) removed a vm that was
            // not ready; a ready one whose branch was not marked yet is
            // finished here.
            let d = dir(name);
            let running = d
                .read_record()
                .is_ok_and(|r| d.state(&r) == VmState::Running);
            if running && rec.phase >= Phase::Asked {
                match crate::tree::finish_wake(h, branch, name) {
                    Ok(()) => "the vm was ready; its branch is marked running".into(),
                    Err(e) => format!("the vm runs but its branch could not be marked: {e}"),
                }
            } else {
                "nothing was left".into()
            }
        }
        Op::Remove { vm: name } => {
            let d = dir(name);
            match d.read_record() {
                Ok(r) => match vm::remove_locked(h, &d, &r) {
                    Ok(_) => "finished".into(),
                    Err(e) => format!("could not finish: {e}"),
                },
                Err(_) => {
                    let _ = std::fs::remove_dir_all(&d.dir);
                    "finished".into()
                }
            }
        }
    }
}
