//! Per-thread seccomp filters (docs/design/isolation.md, "seccomp").
//!
//! Every thread of a VMM process installs the filter of its category at
//! its start, after the setup that needs more (opening files, creating
//! the VM): a syscall outside the list kills the whole process. The lists
//! are data, `seccomp/x86_64.json`, compiled into BPF by build.rs.
//!
//! Nothing is installed unless the process turned filtering on with
//! [`enable`] (`tine-vmm` does, at its start): a library user of this
//! crate (tests, benches) runs unfiltered.

use std::sync::OnceLock;

use seccompiler::{sock_filter, BpfProgram};

mod compiled {
    include!(concat!(env!("OUT_DIR"), "/seccomp.rs"));
}

/// The categories of threads, one filter each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Thread {
    /// The process's main thread once the vm runs: waits for its end,
    /// writes the exit file.
    Main,
    /// A vCPU: KVM_RUN, port and MMIO exits into the devices.
    Vcpu,
    /// The device event loop: virtio queues, disks, tap, vsock.
    Devices,
    /// Console input: stdin or the console socket into the UART.
    Console,
    /// Takes SIGINT/SIGTERM/SIGHUP and ends the vm.
    Signals,
    /// The control socket: pause, save, fork(2). A forked process runs
    /// on this thread's filter, so it holds every other list too.
    Api,
    /// Lazy page-in: userfaultfd, the page source (snapshot file or the
    /// store, local or remote), prefetch and readahead.
    PageIn,
}

impl Thread {
    /// Every category.
    pub const ALL: [Thread; 7] = [
        Thread::Main,
        Thread::Vcpu,
        Thread::Devices,
        Thread::Console,
        Thread::Signals,
        Thread::Api,
        Thread::PageIn,
    ];

    /// Its name in `seccomp/x86_64.json`.
    pub fn name(self) -> &'static str {
        match self {
            Thread::Main => "main",
            Thread::Vcpu => "vcpu",
            Thread::Devices => "devices",
            Thread::Console => "console",
            Thread::Signals => "signals",
            Thread::Api => "api",
            Thread::PageIn => "pagein",
        }
    }
}

/// What a syscall outside a thread's list does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Kills the process (SIGSYS): the default.
    Kill,
    /// Allows it and logs it to the kernel log (audit type 1326: comm,
    /// syscall number): for finding what a list lacks.
    Log,
}

/// Errors of the seccomp filters.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("No seccomp filter for the {0} thread in this build")]
    Missing(&'static str),
    #[error("Cannot install the seccomp filter of the {0} thread")]
    Install(&'static str, #[source] seccompiler::Error),
    #[error("Seccomp filtering was already turned on")]
    AlreadyEnabled,
}

static MODE: OnceLock<Mode> = OnceLock::new();

/// Turns filtering on for this process: from now on [`apply`] installs
/// each thread's filter. Call before any thread starts.
pub fn enable(mode: Mode) -> Result<(), SeccompError> {
    // Every category must exist before the first thread relies on it.
    for t in Thread::ALL {
        program(t, mode)?;
    }
    MODE.set(mode).map_err(|_| SeccompError::AlreadyEnabled)
}

/// The mode [`enable`] set, if any.
pub fn mode() -> Option<Mode> {
    MODE.get().copied()
}

/// The compiled filter of `thread`.
pub fn program(thread: Thread, mode: Mode) -> Result<BpfProgram, SeccompError> {
    let (_, kill, log) = compiled::FILTERS
        .iter()
        .find(|(name, _, _)| *name == thread.name())
        .ok_or(SeccompError::Missing(thread.name()))?;
    let insns = match mode {
        Mode::Kill => kill,
        Mode::Log => log,
    };
    Ok(insns
        .iter()
        .map(|&(code, jt, jf, k)| sock_filter { code, jt, jf, k })
        .collect())
}

/// Installs `thread`'s filter on the calling thread (with no_new_privs),
/// whatever [`enable`] said.
pub fn install(thread: Thread, mode: Mode) -> Result<(), SeccompError> {
    let prog = program(thread, mode)?;
    if mode == Mode::Log {
        // A marker for scripts/seccomp-trace: which filter this thread
        // took (an strace of the process shows it).
        if let Ok(path) = std::ffi::CString::new(format!("/tine-seccomp/{}", thread.name())) {
            // SAFETY: access(2) reads a NUL-terminated path; it only fails.
            unsafe { libc::access(path.as_ptr(), libc::F_OK) };
        }
    }
    seccompiler::apply_filter(&prog).map_err(|e| SeccompError::Install(thread.name(), e))
}

/// Installs `thread`'s filter on the calling thread if filtering is on.
/// A filter that cannot be installed aborts the process: it must never
/// run on without one.
pub fn apply(thread: Thread) {
    if let Some(mode) = mode() {
        if let Err(e) = install(thread, mode) {
            tracing::error!("{e}: {:?}", std::error::Error::source(&e));
            std::process::abort();
        }
    }
}
