//! tine's VMM: one KVM microVM per process.
//!
//! Read top-down: [`config::VmConfig`] says what to run, [`builder::build`]
//! creates the VM, memory, kernel, devices and vCPUs, and [`Vmm::run`] runs
//! it until the guest resets, powers off or the host stops it.
//! [`Vmm::start`] runs it in the background and gives a [`VmmHandle`] to
//! pause, resume and save it ([`state`] holds what is saved, [`vstate`] the
//! control and the restore into a new VM).

pub mod arch;
pub mod builder;
pub mod compat;
pub mod config;
pub mod devices;
pub mod exit;
pub mod memory;
pub mod state;
pub mod vcpu;
pub mod vm;
pub mod vstate;

use std::io::Read;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::devices::legacy::SerialDevice;
use crate::devices::Bus;
use crate::exit::{ExitNotifier, GuestExit};
use crate::memory::GuestMemoryMmap;
use crate::vcpu::{Vcpu, VcpuError};
use crate::vm::Vm;

pub use builder::{build, BuildError};
pub use config::VmConfig;
pub use state::{FpuState, MachineState, VcpuState, VmState, XsaveState};
pub use vstate::{ControlError, RunningVmm, VmmHandle};

/// A built vm, ready to run.
pub struct Vmm {
    vm: Vm,
    mem: GuestMemoryMmap,
    vcpus: Vec<Vcpu>,
    pio: Arc<Bus>,
    mmio: Arc<Bus>,
    exit: Arc<ExitNotifier>,
    serial: Arc<Mutex<SerialDevice>>,
    console_stdin: bool,
    event_manager: builder::DeviceEventManager,
}

/// Errors while running a vm.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error("Cannot start the {0} thread")]
    Thread(&'static str, #[source] std::io::Error),
}

impl Vmm {
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
        let exit = self.exit.clone();
        let signals = block_stop_signals();
        spawn("signals", {
            let exit = exit.clone();
            move || wait_stop_signal(&signals, &exit)
        })?;
        if self.console_stdin {
            let serial = self.serial.clone();
            spawn("console-in", move || forward_stdin(&serial))?;
        }
        let mut event_manager = self.event_manager;
        spawn("devices", move || loop {
            if let Err(e) = event_manager.run() {
                tracing::error!("device event loop failed: {e:?}");
                return;
            }
        })?;
        Ok(RunningVmm::start(
            self.vm, self.mem, self.vcpus, self.pio, self.mmio, exit,
        )?)
    }

    /// The shared exit notifier (devices report through it).
    pub fn exit_notifier(&self) -> &Arc<ExitNotifier> {
        &self.exit
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

/// Copies stdin into the UART's receive FIFO, waiting while it is full.
fn forward_stdin(serial: &Mutex<SerialDevice>) {
    let mut stdin = std::io::stdin().lock();
    let mut buf = [0u8; 64];
    loop {
        let n = match stdin.read(&mut buf) {
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
