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

use serde::{Deserialize, Serialize};

use crate::intent::{self, Op, Phase};
use crate::settle::{settle_pid, sweep, undo_snapshot_dir, wake_parent};
use crate::state::{self, VmDir, VmState};
use crate::{vm, Host};

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
    // Groups no vm runs in any more (an `rm` killed halfway).
    let live: Vec<String> = state::list(&h.home)?
        .iter()
        .map(crate::cgroup::group_of)
        .collect();
    crate::cgroup::sweep(&h.home, &live);
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
        Op::Precopy { vm, .. } => format!("pre-copy {vm}"),
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
            if rec.phase >= Phase::Committed || crate::branches::branch_sleeps(h, name) {
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
        Op::Precopy { vm: name, staging } => {
            // The vm runs on either way; a committed round only left its
            // branch running at the new snapshot (its link was written
            // first, so the next sleep stores over the right base).
            let _ = std::fs::remove_dir_all(staging);
            crate::settle::settle_pid(&dir(name));
            "the vm runs on".into()
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
                    let _ = d.remove_dir();
                    "finished".into()
                }
            }
        }
    }
}
