//! Settling the processes of this home with their records, used by every
//! operation and by reconcile: the spawn guard, pointing a record at the
//! process that answers for it, ending VMMs no record knows, undoing a
//! failed snapshot's directory, waking the parent of a moment that did not
//! complete.

use std::sync::{RwLock, RwLockReadGuard};
use std::time::Duration;

use crate::intent::{self, Op};
use crate::proc::Pid;
use crate::state::{self, VmDir, VmState};
use crate::{wake, Host};

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
        Ok(_) => {
            // Who answers, as this host sees it (the pid a VMM reports is
            // one of its tree's PID namespace).
            if let Ok(p) = Pid::listening_on(&vm.api_socket()) {
                if p.pid != r.pid {
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
            if let Ok(cps) = crate::checkpoints::list_checkpoints(h, &vm.name) {
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

/// Wakes `vm` as the parent of a moment that did not complete (it may
/// still be quiesced; its watchdog would thaw it, but with stale time).
pub(crate) fn wake_parent(vm: &VmDir) {
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
