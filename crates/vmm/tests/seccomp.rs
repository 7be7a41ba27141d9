//! The VMM's seccomp filters (vmm::seccomp, docs/design/isolation.md):
//! each thread category's real filter, installed in a forked process,
//! lets its own syscalls through and kills the process (SIGSYS) on one it
//! does not list, including an ioctl outside a KVM list.

use vmm::seccomp::{program, Mode, Thread};

/// How a forked process that installed `thread`'s filter and ran `then`
/// ended: `Ok(exit code)` or `Err(signal)`.
fn under_filter(thread: Thread, then: fn() -> i32) -> Result<i32, i32> {
    // Built before the fork: the child of a multi-threaded test process
    // must not allocate.
    let prog = program(thread, Mode::Kill).expect("filter");
    // SAFETY: the child only installs the filter, makes raw syscalls and
    // _exits; it never returns into the test harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let code = match seccompiler::apply_filter(&prog) {
            Ok(()) => then(),
            Err(_) => 90,
        };
        // SAFETY: ends the forked child without running destructors.
        unsafe { libc::_exit(code) }
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked, with a valid status pointer.
    let r = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(r, pid);
    if libc::WIFSIGNALED(status) {
        Err(libc::WTERMSIG(status))
    } else {
        Ok(libc::WEXITSTATUS(status))
    }
}

fn exec_shell() -> i32 {
    let sh = c"/bin/sh";
    let argv = [
        sh.as_ptr(),
        c"-c".as_ptr(),
        c"exit 7".as_ptr(),
        std::ptr::null(),
    ];
    let envp = [std::ptr::null()];
    // SAFETY: execve with NUL-terminated argv/envp arrays of live strings.
    unsafe { libc::execve(sh.as_ptr(), argv.as_ptr(), envp.as_ptr()) };
    91
}

fn inet_socket() -> i32 {
    // SAFETY: socket(2) takes no pointers.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    if fd >= 0 {
        92
    } else {
        93
    }
}

fn terminal_injection() -> i32 {
    let c = b'x';
    // SAFETY: TIOCSTI reads one byte from a live pointer.
    unsafe { libc::ioctl(0, libc::TIOCSTI, &c) };
    94
}

fn allowed_only() -> i32 {
    // write(2) and exit_group(2) are in every list.
    // SAFETY: writes zero bytes from a live pointer.
    unsafe { libc::write(2, c"".as_ptr().cast(), 0) };
    0
}

#[test]
fn every_thread_category_has_a_filter_that_compiles() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/seccomp/x86_64.json"))
        .expect("seccomp/x86_64.json");
    let file: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&text).expect("valid JSON");
    let mut names: Vec<&str> = file.keys().map(String::as_str).collect();
    names.sort_unstable();
    let mut expected: Vec<&str> = Thread::ALL.iter().map(|t| t.name()).collect();
    expected.push("common");
    expected.sort_unstable();
    assert_eq!(
        names, expected,
        "the JSON's filters are the thread categories"
    );
    for t in Thread::ALL {
        for mode in [Mode::Kill, Mode::Log] {
            let p = program(t, mode).expect("compiled");
            // More than the lone `return kill` of an empty list.
            assert!(p.len() > 10, "{t:?} {mode:?}: {} instructions", p.len());
        }
    }
}

#[test]
fn a_thread_runs_its_own_syscalls() {
    for t in Thread::ALL {
        assert_eq!(under_filter(t, allowed_only), Ok(0), "{t:?}");
    }
}

#[test]
fn a_syscall_outside_the_list_kills_the_process() {
    for t in Thread::ALL {
        assert_eq!(
            under_filter(t, exec_shell),
            Err(libc::SIGSYS),
            "{t:?}: execve"
        );
        assert_eq!(
            under_filter(t, terminal_injection),
            Err(libc::SIGSYS),
            "{t:?}: ioctl TIOCSTI"
        );
    }
    for t in [
        Thread::Vcpu,
        Thread::Devices,
        Thread::Main,
        Thread::Signals,
        Thread::Console,
    ] {
        assert_eq!(
            under_filter(t, inet_socket),
            Err(libc::SIGSYS),
            "{t:?}: socket(AF_INET)"
        );
    }
}

#[test]
fn without_a_filter_the_same_syscalls_run() {
    // The helper itself works: unfiltered, the shell runs and exits 7.
    // SAFETY: as in `under_filter`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        let code = exec_shell();
        // SAFETY: ends the forked child.
        unsafe { libc::_exit(code) }
    }
    let mut status = 0;
    // SAFETY: waits for that child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 7);
}
