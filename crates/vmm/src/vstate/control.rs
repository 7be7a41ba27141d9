//! Control of a running vm: pause, resume and save from any thread.
//!
//! Threads and channels only (no async runtime: fork(2) keeps one thread).
//! Each vCPU thread owns its `VcpuFd`; the controller talks to it through
//! its request/reply channels and kicks it with a signal (see
//! [`crate::vcpu`]). A parked vCPU blocks in `recv` and holds no lock.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::devices::Bus;
use crate::dirty::{self, DirtyLog, DirtyTracking};
use crate::exit::{ExitNotifier, GuestExit};
use crate::memory::GuestMemoryMmap;
use crate::state::MachineState;
use crate::vcpu::{Vcpu, VcpuError, VcpuReply, VcpuRequest, VcpuThread};
use crate::vm::{Vm, VmError};

/// How long a vCPU thread may take to answer a request before the
/// controller gives up on it (it normally answers in microseconds).
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);

/// Errors of pause, resume and save.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("The vm has exited ({0})")]
    Exited(GuestExit),
    #[error("The vm is already paused")]
    AlreadyPaused,
    #[error("The vm is not paused")]
    NotPaused,
    #[error("vCPU {0} has stopped (the vm exited)")]
    VcpuGone(u8),
    #[error("vCPU {0} did not answer within {REPLY_TIMEOUT:?}")]
    VcpuTimeout(u8),
    #[error("vCPU {index} refused the request: {why}")]
    Refused { index: u8, why: &'static str },
    #[error("vCPU {index} gave an unexpected answer: {reply}")]
    Protocol { index: u8, reply: String },
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error(transparent)]
    Vm(#[from] VmError),
}

struct Inner {
    vm: Vm,
    mem: GuestMemoryMmap,
    exit: Arc<ExitNotifier>,
    /// Held by the controller for a whole pause/resume/save; never touched
    /// by vCPU threads.
    vcpus: Mutex<Vcpus>,
    /// A vm started paused: its kvmclock at start. KVM's clock runs on
    /// while the vCPUs are parked; the first resume sets it back, so the
    /// guest's time continues from its moment, not from how long it waited
    /// for its wake.
    held_clock: Mutex<Option<u64>>,
    /// Whether KVM's dirty log is on, and the base of the dirty set.
    dirty: Mutex<DirtyTracking>,
}

struct Vcpus {
    threads: Vec<VcpuThread>,
    paused: bool,
}

/// A handle on a running vm; clone it freely and use it from any thread.
#[derive(Clone)]
pub struct VmmHandle {
    inner: Arc<Inner>,
}

/// A vm whose vCPU threads are running (devices are the caller's; a vm
/// started by [`crate::Vmm::start`] is a [`crate::RunningVmm`]).
pub struct RunningVcpus {
    handle: VmmHandle,
}

impl RunningVcpus {
    /// Starts one thread per vCPU on `vm` and `mem` (a built vm, or one
    /// rebuilt by [`crate::vstate::restore_machine`]). Device threads are
    /// the caller's.
    /// With `paused` no vCPU runs guest code until [`VmmHandle::resume`]
    /// (a fork child waiting for its wake-up step).
    pub fn start(
        vm: Vm,
        mem: GuestMemoryMmap,
        vcpus: Vec<Vcpu>,
        pio: Arc<Bus>,
        mmio: Arc<Bus>,
        exit: Arc<ExitNotifier>,
        paused: bool,
    ) -> Result<Self, VcpuError> {
        let mut threads = Vec::with_capacity(vcpus.len());
        for vcpu in vcpus {
            threads.push(vcpu.start(pio.clone(), mmio.clone(), exit.clone(), paused)?);
        }
        if paused {
            for t in &threads {
                match t.replies.recv() {
                    Ok(VcpuReply::Paused) => {}
                    _ => {
                        return Err(VcpuError::Spawn {
                            index: t.index,
                            source: std::io::Error::other("vCPU did not park at start"),
                        })
                    }
                }
            }
        }
        let held_clock = if paused { vm.clock().ok() } else { None };
        Ok(Self {
            handle: VmmHandle {
                inner: Arc::new(Inner {
                    vm,
                    mem,
                    exit,
                    held_clock: Mutex::new(held_clock),
                    dirty: Mutex::new(DirtyTracking::default()),
                    vcpus: Mutex::new(Vcpus { threads, paused }),
                }),
            },
        })
    }

    /// A handle to pause, resume and save this vm.
    pub fn handle(&self) -> VmmHandle {
        self.handle.clone()
    }

    /// Blocks until the vm exits; returns why.
    pub fn wait(self) -> GuestExit {
        let reason = self.handle.inner.exit.wait();
        // vCPU threads may still be inside KVM_RUN: the VM and its memory
        // must outlive them, and the process ends right after this returns.
        std::mem::forget(self.handle);
        reason
    }
}

impl VmmHandle {
    /// Stops every vCPU: each leaves KVM_RUN, completes a pending I/O exit
    /// and parks. Returns how long it took until the last vCPU parked.
    pub fn pause(&self) -> Result<Duration, ControlError> {
        let mut vcpus = self.lock();
        self.check_running()?;
        if vcpus.paused {
            return Err(ControlError::AlreadyPaused);
        }
        let start = Instant::now();
        for t in &vcpus.threads {
            t.requests
                .send(VcpuRequest::Pause)
                .map_err(|_| ControlError::VcpuGone(t.index))?;
            t.kick();
        }
        // Mark paused before waiting: a vCPU that parked must be resumed
        // even if another one fails to answer.
        vcpus.paused = true;
        for t in &vcpus.threads {
            expect(t, |r| matches!(r, VcpuReply::Paused))?;
        }
        Ok(start.elapsed())
    }

    /// Lets every parked vCPU run again.
    pub fn resume(&self) -> Result<(), ControlError> {
        let mut vcpus = self.lock();
        self.check_running()?;
        if !vcpus.paused {
            return Err(ControlError::NotPaused);
        }
        let held = self
            .inner
            .held_clock
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(ns) = held {
            // Best effort: a clock that cannot be set back only runs ahead.
            if let Err(e) = self.inner.vm.set_clock(ns) {
                tracing::warn!("cannot set the held kvmclock back: {e}");
            }
        }
        for t in &vcpus.threads {
            t.requests
                .send(VcpuRequest::Resume)
                .map_err(|_| ControlError::VcpuGone(t.index))?;
        }
        vcpus.paused = false;
        for t in &vcpus.threads {
            expect(t, |r| matches!(r, VcpuReply::Resumed))?;
        }
        Ok(())
    }

    /// Saves every vCPU (each on its own thread, which owns its fd) and the
    /// VM-level state. Only while paused.
    pub fn save_state(&self) -> Result<MachineState, ControlError> {
        let vcpus = self.lock();
        self.check_running()?;
        if !vcpus.paused {
            return Err(ControlError::NotPaused);
        }
        let mut states = Vec::with_capacity(vcpus.threads.len());
        for t in &vcpus.threads {
            t.requests
                .send(VcpuRequest::Save)
                .map_err(|_| ControlError::VcpuGone(t.index))?;
            match recv(t)? {
                VcpuReply::Saved(result) => states.push((*result)?),
                other => return Err(unexpected(t, other)),
            }
        }
        Ok(MachineState {
            vcpus: states,
            vm: self.inner.vm.save_state()?,
        })
    }

    /// Ends the vm: reports [`GuestExit::Stopped`] (unless it already
    /// exited), makes every vCPU thread leave KVM_RUN or its parking and
    /// return, and joins them. Device threads are not stopped here.
    pub fn stop(&self) {
        self.inner.exit.notify(GuestExit::Stopped);
        let mut vcpus = self.lock();
        for t in &vcpus.threads {
            if vcpus.paused {
                let _ = t.requests.send(VcpuRequest::Resume);
            }
            t.kick();
        }
        vcpus.paused = false;
        for t in std::mem::take(&mut vcpus.threads) {
            if t.handle.join().is_err() {
                tracing::error!("vcpu{}: thread panicked", t.index);
            }
        }
    }

    /// Turns dirty tracking on (KVM's dirty log on every memslot). The set
    /// keeps its base, if any: a vm restored from a stored snapshot calls
    /// [`VmmHandle::rebase_dirty`] with that snapshot's label, paused,
    /// before it first runs. Allowed while running (the set then has no
    /// complete base until the next rebase).
    pub fn enable_dirty_tracking(&self) -> Result<(), ControlError> {
        let mut d = self.dirty_state();
        if !d.enabled {
            self.inner.vm.set_dirty_logging(&self.inner.mem, true)?;
            d.enabled = true;
        }
        Ok(())
    }

    /// Turns dirty tracking off; the set loses its base.
    pub fn disable_dirty_tracking(&self) -> Result<(), ControlError> {
        let mut d = self.dirty_state();
        if d.enabled {
            self.inner.vm.set_dirty_logging(&self.inner.mem, false)?;
        }
        *d = DirtyTracking::default();
        Ok(())
    }

    /// Whether dirty tracking is on, and its base.
    pub fn dirty_tracking(&self) -> DirtyTracking {
        self.dirty_state().clone()
    }

    /// Pages dirtied since the base, by the guest (KVM's log) and by the
    /// VMM (vm-memory's bitmaps); the set is kept (see [`dirty::collect`]).
    /// Only while paused; with tracking off only the VMM's writes are in
    /// it and the base is None.
    pub fn dirty_log(&self) -> Result<DirtyLog, ControlError> {
        let vcpus = self.lock();
        self.check_running()?;
        if !vcpus.paused {
            return Err(ControlError::NotPaused);
        }
        let d = self.dirty_state();
        self.collect_dirty_locked(&d)?;
        Ok(DirtyLog {
            base: d.base.clone().filter(|_| d.enabled),
            pages: dirty::read(&self.inner.mem),
        })
    }

    /// Folds KVM's dirty log into the set (the fork path, at its moment).
    pub(crate) fn collect_dirty(&self) -> Result<(), ControlError> {
        let d = self.dirty_state();
        self.collect_dirty_locked(&d)
    }

    fn collect_dirty_locked(&self, d: &DirtyTracking) -> Result<(), ControlError> {
        if d.enabled {
            dirty::collect(&self.inner.vm, &self.inner.mem)?;
        }
        Ok(())
    }

    /// Empties the dirty set: from now on it is relative to `base` (what
    /// the caller just stored). Only while paused, and with the devices
    /// quiet if a write they make now must count (the fork path parks
    /// them). Turns tracking on if it was off.
    pub fn rebase_dirty(&self, base: Option<String>) -> Result<(), ControlError> {
        let vcpus = self.lock();
        self.check_running()?;
        if !vcpus.paused {
            return Err(ControlError::NotPaused);
        }
        self.rebase_dirty_paused(base)
    }

    /// [`VmmHandle::rebase_dirty`] for a caller that holds the vm paused
    /// itself (the fork path).
    pub(crate) fn rebase_dirty_paused(&self, base: Option<String>) -> Result<(), ControlError> {
        let mut d = self.dirty_state();
        if !d.enabled {
            self.inner.vm.set_dirty_logging(&self.inner.mem, true)?;
            d.enabled = true;
        }
        dirty::rebase(&self.inner.vm, &self.inner.mem, true)?;
        d.base = base;
        Ok(())
    }

    /// Sets the tracking state of a vm whose memslots already log (see
    /// [`crate::Vmm::track_dirty`]).
    pub(crate) fn set_dirty_tracking(&self, t: DirtyTracking) {
        *self.dirty_state() = t;
    }

    fn dirty_state(&self) -> MutexGuard<'_, DirtyTracking> {
        self.inner.dirty.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_running(&self) -> Result<(), ControlError> {
        match self.inner.exit.get() {
            Some(exit) => Err(ControlError::Exited(exit)),
            None => Ok(()),
        }
    }

    /// Whether the vm is paused.
    pub fn is_paused(&self) -> bool {
        self.lock().paused
    }

    /// The vm's guest memory (read it only while paused for a consistent view).
    pub fn guest_memory(&self) -> &GuestMemoryMmap {
        &self.inner.mem
    }

    /// The VM (its fd, supported CPUID).
    pub fn vm(&self) -> &Vm {
        &self.inner.vm
    }

    /// The vm's exit notifier.
    pub fn exit_notifier(&self) -> &Arc<ExitNotifier> {
        &self.inner.exit
    }

    fn lock(&self) -> MutexGuard<'_, Vcpus> {
        self.inner.vcpus.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn recv(t: &VcpuThread) -> Result<VcpuReply, ControlError> {
    t.replies.recv_timeout(REPLY_TIMEOUT).map_err(|e| match e {
        std::sync::mpsc::RecvTimeoutError::Timeout => ControlError::VcpuTimeout(t.index),
        std::sync::mpsc::RecvTimeoutError::Disconnected => ControlError::VcpuGone(t.index),
    })
}

fn expect(t: &VcpuThread, ok: impl Fn(&VcpuReply) -> bool) -> Result<(), ControlError> {
    let reply = recv(t)?;
    if ok(&reply) {
        Ok(())
    } else {
        Err(unexpected(t, reply))
    }
}

fn unexpected(t: &VcpuThread, reply: VcpuReply) -> ControlError {
    match reply {
        VcpuReply::Refused(why) => ControlError::Refused {
            index: t.index,
            why,
        },
        other => ControlError::Protocol {
            index: t.index,
            reply: format!("{other:?}"),
        },
    }
}
