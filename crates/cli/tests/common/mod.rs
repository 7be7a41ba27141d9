//! Shared helpers for tests that run the real `tine` binary on real KVM.
#![allow(dead_code)]

pub mod procs;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The `tine` binary under test.
pub fn tine() -> Command {
    siblings_are_fresh();
    Command::new(env!("CARGO_BIN_EXE_tine"))
}

/// `tine` starts `tined`, which starts `tine-vmm`: binaries of other
/// packages, which `cargo test -p tine-cli` does not rebuild. One older
/// than a source file it is built from would test old code: say so.
fn siblings_are_fresh() {
    static CHECKED: OnceLock<Result<(), String>> = OnceLock::new();
    let res = CHECKED.get_or_init(|| {
        let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let newest = |dirs: &[&str]| {
            let mut t = std::time::SystemTime::UNIX_EPOCH;
            let mut stack: Vec<PathBuf> = dirs.iter().map(|d| crates.join(d).join("src")).collect();
            while let Some(d) = stack.pop() {
                for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                    let p = e.path();
                    if p.is_dir() {
                        stack.push(p);
                    } else if let Ok(m) = e.metadata().and_then(|m| m.modified()) {
                        t = t.max(m);
                    }
                }
            }
            t
        };
        let engine = ["host", "vmm", "store", "disk", "snapshot", "effects", "contract", "protocol", "image"];
        let bins: [(&str, Vec<&str>); 3] = [
            ("tined", [&engine[..], &["tined"]].concat()),
            ("tine-vmm", vec!["tine-vmm", "vmm", "store", "disk", "snapshot", "image"]),
            ("tine-gateway", vec!["effects", "contract"]),
        ];
        let tine = PathBuf::from(env!("CARGO_BIN_EXE_tine"));
        for (name, srcs) in bins {
            let p = tine.with_file_name(name);
            let built = std::fs::metadata(&p).and_then(|m| m.modified()).ok();
            if built.is_none_or(|b| b < newest(&srcs)) {
                return Err(format!(
                    "{} is missing or older than its sources: run `cargo build --workspace` first (scripts/test does)",
                    p.display()
                ));
            }
        }
        Ok(())
    });
    // Not again while a test unwinds from it (Home's drop still cleans
    // up with what is there; a second panic would abort every test).
    if let Err(e) = res {
        if !std::thread::panicking() {
            panic!("{e}");
        }
    }
}

/// Fails loudly in CI when /dev/kvm is missing; elsewhere lets the caller skip.
pub fn kvm_available() -> bool {
    let ok = Path::new("/dev/kvm").exists();
    if !ok {
        assert!(
            std::env::var_os("CI").is_none(),
            "/dev/kvm is missing in CI: KVM tests must run"
        );
        eprintln!("skipping: /dev/kvm is missing");
    }
    ok
}

/// Serializes the tests of one binary that boot Linux guests: inside the
/// nested test host (two emulated CPUs) several at once only make each
/// slower and the timeouts flaky.
pub fn one_linux_test_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fresh temporary directory, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "tine-test-{tag}-{}-{:?}",
            std::process::id(),
            Instant::now()
        ));
        let p = PathBuf::from(p.to_string_lossy().replace([' ', '{', '}', ':', ','], ""));
        std::fs::create_dir_all(&p).expect("create temp dir");
        Self(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running VMM whose console is read line by line.
pub struct RunningVm {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    lines: Receiver<(Instant, String)>,
    pub started: Instant,
}

impl RunningVm {
    /// Starts `tine vmm ARGS --console`.
    pub fn start(args: &[&str]) -> Self {
        let mut cmd = tine();
        cmd.arg("vmm").args(args);
        Self::spawn(cmd)
    }

    /// Starts `PROGRAM ARGS --console` (e.g. `ip netns exec NS tine vmm ...`).
    pub fn start_command(program: &str, args: &[&str]) -> Self {
        let mut cmd = Command::new(program);
        cmd.args(args);
        Self::spawn(cmd)
    }

    fn spawn(mut cmd: Command) -> Self {
        let started = Instant::now();
        let mut child = cmd
            .arg("--console")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn tine vmm");
        let stdout = child.stdout.take().expect("stdout");
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let line = line.trim_end_matches('\r').to_string();
                if tx.send((Instant::now(), line)).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
            started,
        }
    }

    /// Next console line, or None after `timeout`.
    pub fn next_line(&self, timeout: Duration) -> Option<(Instant, String)> {
        self.lines.recv_timeout(timeout).ok()
    }

    /// Waits for a line starting with `prefix`, returning it; panics with
    /// the lines seen on timeout.
    pub fn expect_line(&self, prefix: &str, timeout: Duration) -> (Instant, String) {
        self.expect_matching(&format!("starting with {prefix:?}"), timeout, |l| {
            l.starts_with(prefix)
        })
    }

    /// Waits for a line containing `needle` (a shell prompt may precede it).
    pub fn expect_contains(&self, needle: &str, timeout: Duration) -> (Instant, String) {
        self.expect_matching(&format!("containing {needle:?}"), timeout, |l| {
            l.contains(needle)
        })
    }

    /// Waits for a line that `pred` accepts; panics with the lines seen on timeout.
    pub fn expect_matching(
        &self,
        what: &str,
        timeout: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> (Instant, String) {
        let deadline = Instant::now() + timeout;
        let mut seen = Vec::new();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.next_line(left) {
                Some((t, l)) if pred(&l) => return (t, l),
                Some((_, l)) => seen.push(l),
                None => break,
            }
        }
        panic!("no console line {what} within {timeout:?}; saw: {seen:#?}");
    }

    /// Sends input to the guest console.
    pub fn send(&mut self, s: &str) {
        let stdin = self.stdin.as_mut().expect("stdin");
        stdin.write_all(s.as_bytes()).expect("write console");
        stdin.flush().expect("flush console");
    }

    /// Waits for the VMM to exit, up to `timeout`.
    pub fn wait(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for RunningVm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------- bounded calls
//
// A hung guest, agent or VMM must fail the one call that waits for it, with
// enough on the log to see where it hung, instead of hanging the test binary
// (and the CI step) without a word.

/// The limit of one `tine` call made through `Home` unless the caller gives
/// another: `TINE_TEST_CALL_TIMEOUT` seconds, 300 by default.
pub fn call_timeout() -> Duration {
    let secs = std::env::var("TINE_TEST_CALL_TIMEOUT")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .filter(|&s| s > 0)
        .unwrap_or(300);
    Duration::from_secs(secs)
}

/// Calls that take longer than this get a progress line on stderr.
pub const SLOW_CALL: Duration = Duration::from_secs(10);

/// When this test process started, for progress lines (from /proc; the
/// first use where that cannot be read).
fn process_clock() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(|| {
        let now = Instant::now();
        process_age()
            .and_then(|age| now.checked_sub(age))
            .unwrap_or(now)
    })
}

/// How long ago this process started: /proc/uptime minus field 22 of
/// /proc/self/stat (clock ticks after boot).
fn process_age() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let ticks: f64 = stat[stat.rfind(')')? + 1..]
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()?;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    // SAFETY: sysconf only reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz <= 0 {
        return None;
    }
    Duration::try_from_secs_f64(uptime - ticks / hz as f64).ok()
}

/// Writes `[+12.3s] MSG` to stderr at once. Not through `eprintln!`, which
/// the test harness captures until a test ends: CI logs must show where the
/// time goes while it goes, and what hung even if the binary is then killed.
pub fn progress(msg: &str) {
    let line = format!("[+{:.1}s] {msg}\n", process_clock().elapsed().as_secs_f64());
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Args as a short shell-like line for progress lines.
pub fn show_args(args: &[&str]) -> String {
    let mut s = args
        .iter()
        .map(|a| {
            if a.is_empty() || a.contains(|c: char| c.is_whitespace() || c == '\'') {
                format!("'{}'", a.replace('\'', "'\\''"))
            } else {
                a.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    if s.chars().count() > 120 {
        s = s.chars().take(117).collect::<String>() + "...";
    }
    s
}

/// A call that could not be started, or did not end in time (then its
/// process group was killed).
pub struct CallFailed {
    pub what: String,
    /// Why it could not be started (then nothing below is set).
    pub not_started: Option<String>,
    pub limit: Duration,
    pub elapsed: Duration,
    /// Set when the process had exited but a pipe stayed open (a process it
    /// started still holds its stdout or stderr).
    pub exited: Option<ExitStatus>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// Where its threads were, taken before it was killed.
    pub stacks: String,
}

impl std::fmt::Display for CallFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(e) = &self.not_started {
            return writeln!(f, "FAILED: {} could not be started: {e}", self.what);
        }
        match self.exited {
            None => writeln!(
                f,
                "TIMEOUT: {} still running after {:.1} s (limit {} s); killed its process group",
                self.what,
                self.elapsed.as_secs_f64(),
                self.limit.as_secs()
            )?,
            Some(st) => writeln!(
                f,
                "TIMEOUT: {} exited ({st}) but its stdout/stderr stayed open for {:.1} s (limit {} s): a process it started holds them",
                self.what,
                self.elapsed.as_secs_f64(),
                self.limit.as_secs()
            )?,
        }
        writeln!(f, "--- its stdout so far ---")?;
        f.write_str(&tail_text(&self.stdout, 40))?;
        writeln!(f, "--- its stderr so far ---")?;
        f.write_str(&tail_text(&self.stderr, 40))?;
        f.write_str(&self.stacks)
    }
}

/// The last `n` lines of `bytes`, each ending in a newline.
fn tail_text(bytes: &[u8], n: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    if lines.len() > n {
        out.push_str(&format!("[... {} earlier lines]\n", lines.len() - n));
    }
    for l in &lines[lines.len().saturating_sub(n)..] {
        out.push_str(l.trim_end_matches('\r'));
        out.push('\n');
    }
    out
}

/// The last `n` lines of a file, headed by its path (nothing if it is missing).
/// The last lines of a vm directory's `console.log`, `vmm.log` and `exit.json`.
fn log_tails(dir: &Path) -> String {
    // exit.json says why a vm that is not running ended.
    ["console.log", "vmm.log", "exit.json"]
        .iter()
        .map(|f| file_tail(&dir.join(f), 40))
        .collect()
}

pub fn file_tail(path: &Path, n: usize) -> String {
    match std::fs::read(path) {
        Ok(b) => format!(
            "--- last lines of {} ---\n{}",
            path.display(),
            tail_text(&b, n)
        ),
        Err(_) => String::new(),
    }
}

/// Runs `cmd` in its own process group with stdout and stderr captured
/// (stdin as the caller set it, inherited otherwise) and waits at most `limit`.
pub fn output_within(cmd: &mut Command, limit: Duration) -> Result<Output, Box<CallFailed>> {
    output_impl(cmd, limit, true)
}

fn output_impl(
    cmd: &mut Command,
    limit: Duration,
    with_stacks: bool,
) -> Result<Output, Box<CallFailed>> {
    let what = format!("{cmd:?}");
    // An error, not a panic: Home::drop calls this while a failed test unwinds.
    let child = match cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            return Err(Box::new(CallFailed {
                what,
                not_started: Some(e.to_string()),
                limit,
                elapsed: Duration::ZERO,
                exited: None,
                stdout: Vec::new(),
                stderr: Vec::new(),
                stacks: String::new(),
            }))
        }
    };
    wait_impl(child, &what, limit, with_stacks)
}

/// Waits at most `limit` for `child` (whose stdout and stderr, where piped,
/// are collected). On timeout its threads' stacks are taken, then it is
/// killed with its process group when it leads one.
pub fn wait_within(child: Child, what: &str, limit: Duration) -> Result<Output, Box<CallFailed>> {
    wait_impl(child, what, limit, true)
}

fn wait_impl(
    mut child: Child,
    what: &str,
    limit: Duration,
    with_stacks: bool,
) -> Result<Output, Box<CallFailed>> {
    let started = Instant::now();
    let deadline = started + limit;
    let group = leads_group(child.id());
    let stdout = Arc::new(Mutex::new(Vec::new()));
    let stderr = Arc::new(Mutex::new(Vec::new()));
    let (done_tx, done) = mpsc::channel::<()>();
    let mut readers = 0;
    let mut read_into = |pipe: Option<Box<dyn Read + Send>>, buf: &Arc<Mutex<Vec<u8>>>| {
        let Some(mut pipe) = pipe else { return };
        let buf = Arc::clone(buf);
        let done_tx = done_tx.clone();
        readers += 1;
        std::thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            while let Ok(n @ 1..) = pipe.read(&mut chunk) {
                buf.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_from_slice(&chunk[..n]);
            }
            let _ = done_tx.send(());
        });
    };
    read_into(child.stdout.take().map(|p| Box::new(p) as _), &stdout);
    read_into(child.stderr.take().map(|p| Box::new(p) as _), &stderr);
    drop(done_tx);
    let take =
        |b: &Arc<Mutex<Vec<u8>>>| std::mem::take(&mut *b.lock().unwrap_or_else(|e| e.into_inner()));

    let mut pause = Duration::from_millis(1);
    let mut status = None;
    while Instant::now() < deadline {
        if let Ok(Some(st)) = child.try_wait() {
            status = Some(st);
            break;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(50));
    }
    if let Some(st) = status {
        // The pipes end with the process unless something it started keeps
        // them; give that the rest of the time (and a little more).
        let pipe_deadline = deadline.max(Instant::now() + Duration::from_secs(5));
        let mut left = readers;
        while left > 0 {
            let wait = pipe_deadline.saturating_duration_since(Instant::now());
            match done.recv_timeout(wait) {
                Ok(()) => left -= 1,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    // Reaped, but a group id is never reused while the group
                    // has members (whoever holds the pipe).
                    if group {
                        signal(child.id(), true, libc::SIGKILL);
                    }
                    return Err(Box::new(CallFailed {
                        what: what.to_string(),
                        not_started: None,
                        limit,
                        elapsed: started.elapsed(),
                        exited: Some(st),
                        stdout: take(&stdout),
                        stderr: take(&stderr),
                        stacks: String::new(),
                    }));
                }
            }
        }
        return Ok(Output {
            status: st,
            stdout: take(&stdout),
            stderr: take(&stderr),
        });
    }
    let elapsed = started.elapsed();
    // Where it waits, then frozen (so gdb sees that same place, not where it
    // got to during the seconds gdb takes), then its backtraces.
    let label = "the timed-out process";
    let mut stacks = String::new();
    if with_stacks {
        stacks = threads(child.id(), label);
        signal(child.id(), group, libc::SIGSTOP);
        stacks.push_str(&backtraces(child.id(), label));
    }
    signal(child.id(), group, libc::SIGKILL);
    let _ = child.kill();
    let _ = child.wait();
    // Whatever the readers got by now (they end once the group is gone).
    std::thread::sleep(Duration::from_millis(100));
    Err(Box::new(CallFailed {
        what: what.to_string(),
        not_started: None,
        limit,
        elapsed,
        exited: None,
        stdout: take(&stdout),
        stderr: take(&stderr),
        stacks,
    }))
}

/// Whether `pid` (our child, not yet reaped) leads its own process group.
fn leads_group(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: getpgid takes a plain integer and touches no memory.
    unsafe { libc::getpgid(pid) == pid }
}

/// Sends `sig` to `pid`'s process group (`group`) or to `pid` alone.
fn signal(pid: u32, group: bool, sig: libc::c_int) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill takes plain integers and touches no memory; the pid is
    // our own child, not yet reaped (or its group, which keeps its id while
    // it has members), so it cannot have been reused.
    unsafe {
        libc::kill(if group { -pid } else { pid }, sig);
    }
}

/// Where `pid`'s threads are: `threads` and `backtraces`.
pub fn stacks(pid: u32, label: &str) -> String {
    threads(pid, label) + &backtraces(pid, label)
}

/// State, kernel wait channel and syscall number of each of `pid`'s threads
/// (from /proc).
pub fn threads(pid: u32, label: &str) -> String {
    let mut out = format!("--- threads of {label} (pid {pid}) ---\n");
    let task = format!("/proc/{pid}/task");
    let mut tids: Vec<u32> = std::fs::read_dir(&task)
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    tids.sort_unstable();
    if tids.is_empty() {
        out.push_str("(gone)\n");
    }
    for tid in tids {
        let read = |f: &str| {
            std::fs::read_to_string(format!("{task}/{tid}/{f}"))
                .unwrap_or_default()
                .trim()
                .to_string()
        };
        let stat = read("stat");
        let state = stat
            .rfind(')')
            .and_then(|i| stat[i + 1..].split_whitespace().next())
            .unwrap_or("?")
            .to_string();
        let syscall = read("syscall");
        let syscall = syscall.split_whitespace().next().unwrap_or("?");
        out.push_str(&format!(
            "  tid {tid} {:<16} state {state} wchan {:<24} syscall {syscall}\n",
            read("comm"),
            read("wchan"),
        ));
    }
    out
}

/// A user-space backtrace of every thread of `pid`, where gdb is installed
/// and TINE_TEST_GDB is not 0 (empty otherwise). Takes seconds (tens in the
/// nested test host).
pub fn backtraces(pid: u32, label: &str) -> String {
    if std::env::var("TINE_TEST_GDB").as_deref() == Ok("0") {
        return String::new();
    }
    let Some(gdb) = ["/usr/bin/gdb", "/usr/local/bin/gdb"]
        .into_iter()
        .find(|p| Path::new(p).exists())
    else {
        return String::new();
    };
    let mut cmd = Command::new(gdb);
    cmd.args(["-nx", "-batch", "-p", &pid.to_string()])
        .args(["-ex", "set pagination off", "-ex", "thread apply all bt 16"])
        .stdin(Stdio::null());
    let mut out = format!("--- gdb backtraces of {label} (pid {pid}) ---\n");
    // Without stacks of its own if it hangs: that would start gdb on gdb.
    match output_impl(&mut cmd, Duration::from_secs(90), false) {
        Ok(o) => {
            let text = String::from_utf8_lossy(&o.stdout);
            for l in text
                .lines()
                .filter(|l| l.starts_with('#') || l.starts_with("Thread "))
            {
                // Frames of generic Rust code run to hundreds of characters.
                let mut l: String = l.chars().take(200).collect();
                l.push('\n');
                out.push_str(&l);
            }
        }
        Err(t) => out.push_str(&format!(
            "(gdb gave no backtrace within {} s)\n",
            t.limit.as_secs()
        )),
    }
    out
}

/// A temporary TINE_HOME for Linux-guest tests: vms live in it, while its
/// `images` points at the real image cache (scripts/test builds the images).
/// Every vm still there is removed on drop, so no VMM outlives a failed test.
///
/// Every `tine` call made through `out`/`ok` is bounded (`call_timeout()`,
/// or the `*_within` variants); one that times out panics with its output so
/// far, the stacks of its threads and of the vms' VMMs, and the tails of
/// every vm's `console.log` and `vmm.log`. Calls slower than `SLOW_CALL`
/// leave a progress line on stderr.
pub struct Home(pub TempDir);

impl Home {
    pub fn new(tag: &str) -> Self {
        let dir = TempDir::new(tag);
        let cache = std::env::var_os("TINE_HOME")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(std::env::var("HOME").expect("HOME")).join(".cache/tine")
            });
        std::os::unix::fs::symlink(cache.join("images"), dir.path().join("images"))
            .expect("link images");
        Self(dir)
    }
    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = tine();
        c.args(args).env("TINE_HOME", self.0.path());
        c
    }
    pub fn out(&self, args: &[&str]) -> Output {
        self.out_within(args, call_timeout())
    }
    /// `out` with its own time limit.
    pub fn out_within(&self, args: &[&str], limit: Duration) -> Output {
        let mut cmd = self.cmd(args);
        cmd.stdin(Stdio::null());
        self.call(args, &mut cmd, limit)
            .unwrap_or_else(|t| self.fail_call(&t))
    }
    pub fn ok(&self, args: &[&str]) -> String {
        self.ok_within(args, call_timeout())
    }
    /// `ok` with its own time limit.
    pub fn ok_within(&self, args: &[&str], limit: Duration) -> String {
        let out = self.out_within(args, limit);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "tine {args:?}: {stderr}\n{}",
            self.tails_of(args, &stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
    /// The last lines of `console.log` and `vmm.log` of every vm `args`
    /// names, or that the error names (`p-8: wake failed`: a fork's
    /// child), so a failed call shows what its guest and VMM were doing.
    pub fn tails_of(&self, args: &[&str], error: &str) -> String {
        let mut out = String::new();
        for (name, dir, _) in self.vms() {
            if args.iter().any(|a| a.split(',').any(|n| n == name))
                || error.contains(&format!("{name}: "))
            {
                out.push_str(&log_tails(&dir));
            }
        }
        out
    }
    /// Waits (bounded, as `out_within`) for a child spawned from `cmd(args)`
    /// with piped stdout/stderr; spawn it with `process_group(0)` so a
    /// timeout kills everything it started.
    pub fn wait_within(&self, child: Child, args: &[&str], limit: Duration) -> Output {
        let t0 = Instant::now();
        let out = wait_within(child, &format!("tine {}", show_args(args)), limit)
            .unwrap_or_else(|t| self.fail_call(&t));
        self.note_slow(args, t0.elapsed());
        out
    }
    pub fn ls(&self) -> Vec<serde_json::Value> {
        serde_json::from_str(&self.ok(&["ls", "--json"])).expect("json")
    }
    /// The address a vm with `--net` leased (its record, not `ls`).
    pub fn lease_ip(&self, vm: &str) -> String {
        let rec = std::fs::read_to_string(self.0.path().join("vms").join(vm).join("vm.json"))
            .expect("record");
        let v: serde_json::Value = serde_json::from_str(&rec).expect("json");
        v["lease"]["ip"]
            .as_str()
            .expect("a vm with --net has a lease")
            .to_string()
    }
    /// The vm's own top layer of its first disk.
    pub fn top(&self, vm: &str) -> std::path::PathBuf {
        self.0.path().join("vms").join(vm).join("disk0.qcow2")
    }

    /// What the vms show now: the stacks of their running VMMs and the last
    /// lines of every `vms/*/console.log` and `vmm.log`. For a test's own
    /// failure messages, too.
    pub fn diagnostics(&self) -> String {
        let mut out = String::new();
        for (name, dir, vmm) in self.vms() {
            if let Some(pid) = vmm {
                out.push_str(&stacks(pid, &format!("vm {name}'s VMM")));
            }
            out.push_str(&log_tails(&dir));
        }
        if out.is_empty() {
            out.push_str("(no vms in this home)\n");
        }
        out
    }

    /// Every vm directory: name, path, and the VMM's pid if it still runs.
    fn vms(&self) -> Vec<(String, PathBuf, Option<u32>)> {
        let mut dirs: Vec<PathBuf> = std::fs::read_dir(self.0.path().join("vms"))
            .map(|d| d.filter_map(|e| Some(e.ok()?.path())).collect())
            .unwrap_or_default();
        dirs.sort();
        dirs.into_iter()
            .map(|dir| {
                let name = dir
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                let vmm = live_vmm(&dir);
                (name, dir, vmm)
            })
            .collect()
    }

    fn call(
        &self,
        args: &[&str],
        cmd: &mut Command,
        limit: Duration,
    ) -> Result<Output, Box<CallFailed>> {
        let t0 = Instant::now();
        let r = output_within(cmd, limit);
        let r = r.map_err(|mut t| {
            t.what = format!("tine {}", show_args(args));
            t
        });
        if let Ok(out) = &r {
            self.note_slow(args, t0.elapsed());
            // The agent client's one retry of an unanswered handshake
            // (agent_client.rs) passes quietly otherwise; CI should show it.
            for line in String::from_utf8_lossy(&out.stderr).lines() {
                if line.contains("trying once more") {
                    progress(&format!("tine {}: {line}", show_args(args)));
                }
            }
        }
        r
    }

    fn note_slow(&self, args: &[&str], took: Duration) {
        if took > SLOW_CALL {
            progress(&format!(
                "tine {} took {:.1} s",
                show_args(args),
                took.as_secs_f64()
            ));
        }
    }

    /// Prints the whole report at once (it must reach the log even if the
    /// binary is killed later) and fails the test.
    fn fail_call(&self, t: &CallFailed) -> ! {
        let report = format!("{t}{}--- end of the report ---\n", self.diagnostics());
        progress(&report);
        panic!(
            "{} (report above on stderr)\nstderr so far:\n{}",
            t.to_string().lines().next().unwrap_or_default(),
            tail_text(&t.stderr, 20)
        );
    }
}

/// The pid in `dir/vm.json` if that process still runs (same start time, so
/// never a reused pid).
fn live_vmm(dir: &Path) -> Option<u32> {
    let rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("vm.json")).ok()?).ok()?;
    let pid = u32::try_from(rec["pid"].as_u64()?).ok()?;
    let start = rec["pid_start"].as_u64()?;
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // Field 3 is the state; field 22 the start time.
    let state = fields.next()?;
    let started: u64 = fields.nth(18)?.parse().ok()?;
    (started == start && state != "Z" && state != "X").then_some(pid)
}

impl Drop for Home {
    fn drop(&mut self) {
        // Never leave a VMM running behind a failed test, and never hang
        // here either (this may run while a timeout panic unwinds).
        let limit = Duration::from_secs(120);
        let mut cmd = self.cmd(&["ls", "--json"]);
        cmd.stdin(Stdio::null());
        let rows: Vec<serde_json::Value> = match self.call(&["ls", "--json"], &mut cmd, limit) {
            Ok(out) => serde_json::from_slice(&out.stdout).unwrap_or_default(),
            Err(t) => {
                progress(&format!("cleanup: {t}"));
                Vec::new()
            }
        };
        for row in rows {
            if let Some(name) = row["name"].as_str() {
                let args = ["rm", "--force", name];
                let mut cmd = self.cmd(&args);
                cmd.stdin(Stdio::null());
                if let Err(t) = self.call(&args, &mut cmd, limit) {
                    progress(&format!("cleanup: {t}"));
                }
            }
        }
        // Whatever `rm` could not stop (or `ls` did not list) is killed here.
        for (name, _, vmm) in self.vms() {
            if let Some(pid) = vmm.and_then(|p| libc::pid_t::try_from(p).ok()) {
                progress(&format!("cleanup: killing vm {name}'s VMM (pid {pid})"));
                // SAFETY: kill takes plain integers; live_vmm checked the
                // pid's start time, so it is that vm's VMM.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
    }
}

/// Starts Linux vm `name` (256 MiB) with a new zeroed 32 MiB raw base
/// disk as /dev/vda; the returned directory holds the base.
pub fn run_linux_with_disk(h: &Home, name: &str, tag: &str) -> TempDir {
    let dir = TempDir::new(tag);
    let base = dir.path().join("base.raw");
    std::fs::write(&base, vec![0u8; 32 << 20]).expect("base");
    h.ok(&[
        "run",
        "--name",
        name,
        "--mem",
        "256M",
        "--disk",
        base.to_str().expect("utf8"),
    ]);
    dir
}
