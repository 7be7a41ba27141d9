//! Shared helpers for tests that run the real `tine` binary on real KVM.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

/// The `tine` binary under test.
pub fn tine() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tine"))
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

/// A temporary TINE_HOME for Linux-guest tests: vms live in it, while its
/// `images` points at the real image cache (scripts/test builds the images).
/// Every vm still there is removed on drop, so no VMM outlives a failed test.
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
        self.cmd(args)
            .stdin(Stdio::null())
            .output()
            .expect("run tine")
    }
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.out(args);
        assert!(
            out.status.success(),
            "tine {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
    pub fn ls(&self) -> Vec<serde_json::Value> {
        serde_json::from_str(&self.ok(&["ls", "--json"])).expect("json")
    }
    /// The vm's own top layer of its first disk.
    pub fn top(&self, vm: &str) -> std::path::PathBuf {
        self.0.path().join("vms").join(vm).join("disk0.qcow2")
    }
}

impl Drop for Home {
    fn drop(&mut self) {
        // Never leave a VMM running behind a failed test.
        let out = self.out(&["ls", "--json"]);
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap_or_default();
        for row in rows {
            if let Some(name) = row["name"].as_str() {
                let _ = self.out(&["rm", "--force", name]);
            }
        }
    }
}
