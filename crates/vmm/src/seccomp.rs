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
    /// Ends the process (SIGSYS; with [`report_violations`], after one
    /// line on stderr naming the syscall): the default.
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
    CATEGORY.with(|c| c.set(Some(thread)));
    if let Some(mode) = mode() {
        if let Err(e) = install(thread, mode) {
            tracing::error!("{e}: {:?}", std::error::Error::source(&e));
            std::process::abort();
        }
    }
}

thread_local! {
    /// The filter this thread took, for the report of a violation (a
    /// forked process's threads start without one: they inherit the api
    /// thread's).
    static CATEGORY: std::cell::Cell<Option<Thread>> = const { std::cell::Cell::new(None) };
}

/// Makes a syscall outside a thread's list end the process with one line
/// on stderr naming it (`tine: seccomp: syscall N is not allowed in this
/// thread`), which tined shows as the vm's exit reason, instead of a
/// silent SIGSYS. Call once, before any filter is installed.
pub fn report_violations() -> std::io::Result<()> {
    extern "C" fn on_sigsys(
        _sig: libc::c_int,
        info: *mut libc::siginfo_t,
        _ctx: *mut libc::c_void,
    ) {
        // siginfo_t for SIGSYS: the syscall number is the int after the
        // 16-byte header and the 8-byte call address (<asm/siginfo.h>).
        // SAFETY: the kernel hands a valid siginfo_t to an SA_SIGINFO
        // handler; the read stays inside its 128 bytes.
        let nr = unsafe { info.cast::<u8>().add(24).cast::<i32>().read_unaligned() };
        let mut buf =
            *b"tine: seccomp: syscall       is not allowed in a          thread; the VMM stops\n";
        let name = CATEGORY
            .try_with(|c| c.get())
            .ok()
            .flatten()
            .map(Thread::name)
            .unwrap_or("forked");
        for (d, b) in buf[49..58].iter_mut().zip(name.bytes()) {
            *d = b;
        }
        let mut n = nr.unsigned_abs();
        let mut i = 27;
        loop {
            buf[i] = b'0' + (n % 10) as u8;
            n /= 10;
            if n == 0 || i == 24 {
                break;
            }
            i -= 1;
        }
        // SAFETY: write(2) and exit_group(2) are async-signal-safe and in
        // every thread's list.
        unsafe {
            libc::write(2, buf.as_ptr().cast(), buf.len());
            libc::syscall(libc::SYS_exit_group, 128 + libc::SIGSYS);
        }
    }
    // SAFETY: installs a handler for one signal; the struct is zeroed then
    // filled as sigaction(2) expects.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigsys as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
