//! tine's VMM: one KVM microVM per process.
//!
//! Read top-down: [`config::VmConfig`] says what to run, [`builder::build`]
//! creates the VM, memory, kernel, devices and vCPUs, and [`Vmm::run`] runs
//! it until the guest resets, powers off or the host stops it.
//! [`Vmm::start`] runs it in the background and gives a [`VmmHandle`] to
//! pause, resume and save it ([`state`] holds what is saved, [`vstate`] the
//! control and the restore into a new VM).
//!
//! Sleep and wake (docs/design/store.md, "Memory layers in the VMM"):
//! [`dirty`] tracks the pages changed since a stored base, [`layer`]
//! writes and reads memory layers (full or diff), and [`pagein`] wakes a
//! vm whose RAM is paged in lazily (userfaultfd) from a
//! [`pagein::PageSource`].

pub mod api;
pub mod api_socket;
pub mod arch;
pub mod builder;
pub mod compat;
pub mod config;
pub mod devices;
pub mod dirty;
pub mod exit;
pub mod fold;
pub mod fork;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzz;
pub mod jail;
pub mod layer;
pub mod memory;
pub mod moment;
pub mod pagein;
pub mod peer;
pub mod persist;
pub mod process;
pub mod seccomp;
pub mod size;
pub mod snapshot_dir;
pub mod state;
pub mod title;
pub mod trace;
mod uffd;
pub mod vcpu;
pub mod vm;
pub mod vstate;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::builder::Devices;
use crate::config::VmConfig as Config;
use crate::devices::legacy::SerialDevice;
use crate::devices::Bus;
use crate::dirty::DirtyTracking;
use crate::exit::{ExitNotifier, GuestExit};
use crate::fork::ForkSource;
use crate::memory::{GuestMemoryMmap, RamBacking};
use crate::pagein::{PageIn, PageInError};
use crate::vcpu::{Vcpu, VcpuError};
use crate::vm::Vm;

pub use builder::{build, restore, BuildError};
pub use config::VmConfig;
pub use moment::Moment;
/// CPU templates (tine-snapshot's), for the crates that start VMMs.
pub use snapshot::template as cpu_template;
pub use state::{FpuState, MachineState, VcpuState, VmState, XsaveState};
pub use vstate::{ControlError, RunningVcpus, VmmHandle};

/// A built vm, ready to run.
pub struct Vmm {
    vm: Vm,
    mem: GuestMemoryMmap,
    backing: RamBacking,
    vcpus: Vec<Vcpu>,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
    exit: Arc<ExitNotifier>,
    serial: Arc<Mutex<SerialDevice>>,
    devices: Devices,
    config: Config,
    /// Dirty tracking to turn on before the vCPUs start.
    dirty: DirtyTracking,
    /// Lazy page-in of this vm's RAM, if it was woken that way.
    pagein: Option<Arc<PageIn>>,
}

/// Errors while running a vm.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error("Cannot start the {0} thread")]
    Thread(&'static str, #[source] std::io::Error),
    #[error("Cannot listen on the console socket {0}")]
    ConsoleSocket(std::path::PathBuf, #[source] std::io::Error),
    #[error("Cannot turn on dirty tracking")]
    DirtyTracking(#[source] crate::vm::VmError),
}

impl Vmm {
    pub(crate) fn assemble(
        vm: Vm,
        mem: GuestMemoryMmap,
        backing: RamBacking,
        vcpus: Vec<Vcpu>,
        mut devices: Devices,
        config: Config,
    ) -> Self {
        let pio = Arc::new(std::mem::take(&mut devices.pio));
        let mmio = Arc::new(std::mem::take(&mut devices.mmio));
        Self {
            vm,
            mem,
            backing,
            vcpus,
            pio,
            mmio,
            exit: devices.exit.clone(),
            serial: devices.serial.clone(),
            devices,
            config,
            dirty: DirtyTracking::default(),
            pagein: None,
        }
    }

    /// Tracks dirty pages from the first instruction on, relative to
    /// `t.base` (see [`dirty`]): KVM's dirty log is turned on before the
    /// vCPUs start. A forked or restored vm is given the tracking of the
    /// moment it continues from; a vm woken from a stored snapshot, that
    /// snapshot's label.
    pub fn track_dirty(&mut self, t: DirtyTracking) {
        self.dirty = t;
    }

    /// Makes `pagein` part of this vm: a failed fill ends it, and a fork
    /// makes its RAM resident first. Fails if a fill failed already.
    pub fn attach_pagein(&mut self, pagein: Arc<PageIn>) -> Result<(), PageInError> {
        pagein.attach(self.exit.clone())?;
        self.pagein = Some(pagein);
        Ok(())
    }

    /// The lazy page-in of this vm, if any.
    pub fn pagein(&self) -> Option<&Arc<PageIn>> {
        self.pagein.as_ref()
    }

    /// Runs the vm until it exits; returns why.
    ///
    /// SIGINT, SIGTERM and SIGHUP end the vm with [`GuestExit::Stopped`]:
    /// they are blocked here, before any thread starts, and taken by one
    /// thread with sigwait, so no vCPU thread is interrupted by them.
    pub fn run(self) -> Result<GuestExit, RunError> {
        Ok(self.start()?.wait())
    }

    /// Starts the vm's threads (signals, console input, devices, vCPUs) and
    /// returns while it runs; [`RunningVmm::handle`] pauses, resumes and
    /// saves it, [`RunningVmm::wait`] waits for its exit.
    pub fn start(self) -> Result<RunningVmm, RunError> {
        self.start_as(false)
    }

    /// [`Vmm::start`], with every vCPU parked before its first instruction
    /// when `paused` (resumed through the control socket's `Resume`).
    pub fn start_as(self, paused: bool) -> Result<RunningVmm, RunError> {
        let exit = self.exit.clone();
        let signals = block_stop_signals();
        spawn("signals", {
            let exit = exit.clone();
            move || {
                seccomp::apply(seccomp::Thread::Signals);
                wait_stop_signal(&signals, &exit)
            }
        })?;
        if self.config.console_stdin {
            let serial = self.serial.clone();
            spawn("console-in", move || {
                seccomp::apply(seccomp::Thread::Console);
                forward_input(0, &serial)
            })?;
        }
        if let Some(path) = &self.config.console_socket {
            // A socket file left by the process this vm was forked from
            // (or a crashed VMM) is replaced: the path is this vm's.
            let _ = std::fs::remove_file(path);
            let listener = std::os::unix::net::UnixListener::bind(path)
                .map_err(|e| RunError::ConsoleSocket(path.clone(), e))?;
            let serial = self.serial.clone();
            spawn("console-socket", move || {
                seccomp::apply(seccomp::Thread::Console);
                for conn in listener.incoming().flatten() {
                    if let Err(e) = peer::check_peer(&conn) {
                        tracing::warn!("console socket: refusing a connection: {e}");
                        continue;
                    }
                    forward_input(std::os::fd::AsRawFd::as_raw_fd(&conn), &serial);
                }
            })?;
        }
        let Devices {
            mut event_manager,
            serial,
            transports,
            park,
            tap_fds,
            ..
        } = self.devices;
        spawn("devices", move || {
            seccomp::apply(seccomp::Thread::Devices);
            loop {
                if let Err(e) = event_manager.run() {
                    tracing::error!("device event loop failed: {e:?}");
                    return;
                }
            }
        })?;
        let mem = self.mem.clone();
        if self.dirty.enabled {
            self.vm
                .set_dirty_logging(&self.mem, true)
                .map_err(RunError::DirtyTracking)?;
        }
        let running = RunningVcpus::start(
            self.vm, self.mem, self.vcpus, self.pio, self.mmio, exit, paused,
        )?;
        running.handle().set_dirty_tracking(self.dirty);
        let source = ForkSource::new(
            running.handle(),
            fork::DeviceControl {
                serial,
                transports,
                park,
            },
            self.config,
            mem,
            self.backing,
            tap_fds,
            self.pagein,
        );
        Ok(RunningVmm {
            vcpus: running,
            source: Arc::new(source),
        })
    }

    /// The shared exit notifier (devices report through it).
    pub fn exit_notifier(&self) -> &Arc<ExitNotifier> {
        &self.exit
    }
}

/// A vm started by [`Vmm::start`]: its vCPUs run, and it can be forked.
pub struct RunningVmm {
    vcpus: RunningVcpus,
    source: Arc<ForkSource>,
}

impl RunningVmm {
    /// A handle to pause, resume and save this vm.
    pub fn handle(&self) -> VmmHandle {
        self.vcpus.handle()
    }

    /// What forks, checkpoints and snapshots of this vm start from.
    pub fn fork_source(&self) -> Option<Arc<ForkSource>> {
        Some(self.source.clone())
    }

    /// Blocks until the vm exits; returns why.
    pub fn wait(self) -> GuestExit {
        // Devices and memory must outlive vCPU threads still in KVM_RUN:
        // the process ends right after this returns.
        std::mem::forget(self.source);
        self.vcpus.wait()
    }
}

fn spawn(name: &'static str, f: impl FnOnce() + Send + 'static) -> Result<(), RunError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(|_| ())
        .map_err(|e| RunError::Thread(name, e))
}

fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it and
    // pthread_sigmask only changes this thread's mask (inherited by threads
    // spawned afterwards).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn wait_stop_signal(set: &libc::sigset_t, exit: &ExitNotifier) {
    let mut sig = 0;
    // SAFETY: `set` is an initialised signal set and `sig` a valid out pointer.
    let rc = unsafe { libc::sigwait(set, &mut sig) };
    if rc == 0 {
        tracing::info!("signal {sig}: stopping the vm");
        exit.notify(GuestExit::Stopped);
    }
}

/// Copies what `fd` delivers into the UART's receive FIFO, waiting while
/// it is full, until end of input.
///
/// Reads the fd directly rather than through `std::io::stdin()`: this
/// thread blocks in the read, and a forked child (which has only the
/// forking thread) would find std's stdin lock held forever.
fn forward_input(fd: i32, serial: &Mutex<SerialDevice>) {
    let mut buf = [0u8; 64];
    loop {
        // SAFETY: reads into a live buffer of the given length.
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        let n = match usize::try_from(n) {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let mut pending = &buf[..n];
        while !pending.is_empty() {
            let taken = serial
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .enqueue_input(pending);
            pending = &pending[taken..];
            if !pending.is_empty() {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}
