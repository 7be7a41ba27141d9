//! Driving micro guests from the VMM's tests: a console log to read and a
//! console socket to type into, and VMM processes forked from the test
//! (a real control socket, a real exit record).
#![allow(dead_code)]

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vmm::api::{self, Reply, Request};
use vmm::process::{self, ProcessOptions};
use vmm::VmConfig;

pub const WAIT: Duration = Duration::from_secs(30);

/// A fresh scratch directory for one test.
pub fn scratch(prefix: &str, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tine-{prefix}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// A micro guest's console: its log and its input socket.
#[derive(Clone, Debug)]
pub struct Console {
    pub log: PathBuf,
    pub socket: PathBuf,
}

impl Console {
    pub fn in_dir(dir: &Path, name: &str) -> Self {
        Self {
            log: dir.join(format!("{name}.log")),
            socket: dir.join(format!("{name}.sock")),
        }
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&std::fs::read(&self.log).unwrap_or_default()).into_owned()
    }

    /// Complete lines so far.
    pub fn lines(&self) -> Vec<String> {
        let t = self.text();
        let complete = match t.rfind('\n') {
            Some(i) => &t[..=i],
            None => "",
        };
        complete.lines().map(|l| l.trim_end().to_string()).collect()
    }

    /// Waits until at least `n` complete lines start with `prefix`;
    /// returns the last of them.
    pub fn wait_nth(&self, prefix: &str, n: usize) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let found: Vec<String> = self
                .lines()
                .into_iter()
                .filter(|l| l.starts_with(prefix))
                .collect();
            if found.len() >= n {
                return found[n - 1].clone();
            }
            assert!(
                Instant::now() < deadline,
                "no {n}th {prefix:?} line in {}: {:?}",
                self.log.display(),
                self.text()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Types one line into the console.
    pub fn send(&self, line: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            match UnixStream::connect(&self.socket) {
                Ok(mut s) => {
                    s.write_all(format!("{line}\n").as_bytes())
                        .expect("console write");
                    return;
                }
                Err(e) => {
                    assert!(Instant::now() < deadline, "console socket: {e}");
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
    }

    /// Sends a command and waits for the `n`th line starting with `reply`.
    pub fn command(&self, line: &str, reply: &str, n: usize) -> String {
        self.send(line);
        self.wait_nth(reply, n)
    }

    /// `CNT <n>` values so far (counter guest).
    pub fn counts(&self) -> Vec<u64> {
        self.lines()
            .iter()
            .filter_map(|l| l.strip_prefix("CNT "))
            .filter_map(|n| n.trim().parse().ok())
            .collect()
    }
}

/// A vm configuration for micro guest `kernel` with `console`.
pub fn config(kernel: &Path, mem_mib: u64, console: &Console) -> VmConfig {
    VmConfig {
        kernel: kernel.into(),
        mem_mib,
        vcpus: 1,
        console_log: Some(console.log.clone()),
        console_socket: Some(console.socket.clone()),
        ..Default::default()
    }
}

/// The FNV-1a checksum memtouch prints for `touch <mib> <seed>`.
pub fn touch_sum(mib: u64, seed: u64) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let start = 16u64 << 20;
    for a in (start..start + (mib << 20)).step_by(8) {
        let v = (a ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for b in v.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// A VMM process forked from the test: it builds its vm with `make` and
/// serves it (control socket, exit record) until the vm ends.
pub struct VmmProcess {
    pub pid: i32,
    pub api: PathBuf,
    pub exit_file: PathBuf,
}

impl VmmProcess {
    /// Forks; the child runs `make()` then [`process::serve`]. Returns
    /// once the control socket answers.
    pub fn spawn(dir: &Path, name: &str, make: impl FnOnce() -> vmm::Vmm) -> Self {
        let api = dir.join(format!("{name}.api"));
        let exit_file = dir.join(format!("{name}.exit.json"));
        let log = dir.join(format!("{name}.vmm.log"));
        // SAFETY: fork(2); the child only builds and serves a vm, then
        // _exits without returning into the test harness.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            redirect(&log);
            let opts = ProcessOptions {
                name: name.into(),
                api_socket: Some(api.clone()),
                exit_file: Some(exit_file.clone()),
                start_paused: false,
            };
            let code = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                process::serve(make(), opts, || {})
            })) {
                Ok(Ok((exit, _))) => exit.exit_code(),
                Ok(Err(e)) => {
                    eprintln!("serve: {e}");
                    3
                }
                Err(_) => 101,
            };
            // SAFETY: ends the forked process without the harness's exit path.
            unsafe { libc::_exit(code) }
        }
        let me = Self {
            pid,
            api,
            exit_file,
        };
        let deadline = Instant::now() + WAIT;
        while me.call(&Request::Ping).is_err() {
            assert!(
                Instant::now() < deadline,
                "the VMM process did not answer; its log: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        me
    }

    /// One control request; the reply (errors are failures).
    pub fn call(&self, req: &Request) -> Result<Reply, String> {
        let call = api::call(&self.api, req, WAIT).map_err(|e| e.to_string())?;
        match call.reply.error.clone() {
            Some(e) => Err(e),
            None => Ok(call.reply),
        }
    }

    /// Waits (bounded) for the process to exit; its status.
    pub fn wait(&self, timeout: Duration) -> Option<i32> {
        wait_pid(self.pid, timeout)
    }
}

/// Waits for `pid` (a child of this process, or any pid by polling).
pub fn wait_pid(pid: i32, timeout: Duration) -> Option<i32> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut status = 0;
        // SAFETY: waitpid on a pid with a valid status pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return Some(libc::WEXITSTATUS(status));
        }
        if r < 0 && !alive(pid) {
            return Some(-1);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether a process exists.
pub fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Kills a process this test started.
pub fn kill(pid: i32) {
    // SAFETY: kill(2) of a pid this test started.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
}

fn redirect(log: &Path) {
    use std::os::fd::AsRawFd;
    if let Ok(f) = std::fs::File::create(log) {
        // SAFETY: dup2 onto stdout/stderr of this forked process.
        unsafe {
            libc::dup2(f.as_raw_fd(), 1);
            libc::dup2(f.as_raw_fd(), 2);
        }
    }
}
