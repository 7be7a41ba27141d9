//! `tine machine`: the long-lived nested host, started for real (QEMU-TCG
//! with kvm_amd inside), used across CLI calls, made stale, and stopped.
//! One test, so the machine boots only twice (start, and after it is killed).

mod common;

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

fn tine(home: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tine"));
    c.env("TINE_HOME", home).env_remove("TINE_MACHINE");
    c
}

/// Runs `tine ARGS` (stdin /dev/null), bounded by `common::call_timeout()`;
/// a timeout (or a failure to start it) panics with the machine's logs.
fn run(home: &Path, args: &[&str]) -> Output {
    try_run(home, args).unwrap_or_else(|report| {
        common::progress(&report);
        panic!(
            "{} (report above on stderr)",
            report.lines().next().unwrap_or_default()
        );
    })
}

/// Set when a call timed out while the nested host's kernel was stuck:
/// QEMU's emulated SVM (TCG) occasionally soft-locks or panics the nested
/// kernel (testhost/README.md); that is the emulator, not `tine machine`.
static EMULATOR_FAULT: AtomicBool = AtomicBool::new(false);

/// What the nested kernel prints when the emulator, not the code under
/// test, stopped it.
const EMULATOR_FAULT_SIGNS: [&str; 4] = [
    "soft lockup",
    "rcu_preempt detected stalls",
    "rcu: INFO: rcu_sched",
    "Kernel panic",
];

/// `run` that returns the report instead of panicking (for Drop).
fn try_run(home: &Path, args: &[&str]) -> Result<Output, String> {
    let t0 = Instant::now();
    let mut cmd = tine(home);
    cmd.args(args).stdin(Stdio::null());
    match common::output_within(&mut cmd, common::call_timeout()) {
        Ok(out) => {
            if t0.elapsed() > common::SLOW_CALL {
                common::progress(&format!(
                    "tine {} took {:.1} s",
                    common::show_args(args),
                    t0.elapsed().as_secs_f64()
                ));
            }
            Ok(out)
        }
        Err(mut t) => {
            t.what = format!("tine {}", common::show_args(args));
            let console =
                std::fs::read_to_string(home.join("machine/run/console.log")).unwrap_or_default();
            if EMULATOR_FAULT_SIGNS.iter().any(|s| console.contains(s)) {
                EMULATOR_FAULT.store(true, Ordering::SeqCst);
            }
            Err(format!(
                "{t}{}--- end of the report ---",
                machine_logs(home)
            ))
        }
    }
}

/// The tails of the nested host's logs and of any vm's logs here.
fn machine_logs(home: &Path) -> String {
    let run = home.join("machine/run");
    let mut out = String::new();
    for f in [
        "console.log",
        "qemu.log",
        "virtiofsd.log",
        "stdout",
        "stderr",
    ] {
        out.push_str(&common::file_tail(&run.join(f), 40));
    }
    let mut vms: Vec<PathBuf> = std::fs::read_dir(home.join("vms"))
        .map(|d| d.filter_map(|e| Some(e.ok()?.path())).collect())
        .unwrap_or_default();
    vms.sort();
    for vm in vms {
        for f in ["console.log", "vmm.log"] {
            out.push_str(&common::file_tail(&vm.join(f), 40));
        }
    }
    out
}

fn ok(home: &Path, args: &[&str]) -> String {
    let out = run(home, args);
    assert!(
        out.status.success(),
        "tine {args:?}: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn status(home: &Path) -> serde_json::Value {
    serde_json::from_str(&ok(home, &["machine", "status", "--json"])).expect("status json")
}

/// Alive and not a zombie.
fn alive(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rfind(')')
                .and_then(|i| s[i + 1..].trim_start().chars().next())
        })
        .is_some_and(|st| st != 'Z' && st != 'X')
}

fn build_agent() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(root.join("scripts/build-agent"))
        .current_dir(&root)
        .stderr(Stdio::inherit())
        .output()
        .expect("run scripts/build-agent");
    assert!(out.status.success(), "scripts/build-agent failed");
    let path = String::from_utf8_lossy(&out.stdout);
    PathBuf::from(path.lines().last().expect("agent path").trim())
}

/// Stops the machine even when an assertion fails.
struct Machine(PathBuf);

impl Drop for Machine {
    fn drop(&mut self) {
        // Never panics (it may run while a panic unwinds).
        if let Err(report) = try_run(&self.0, &["machine", "stop"]) {
            common::progress(&format!("cleanup: {report}"));
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn pid(st: &serde_json::Value, key: &str) -> u64 {
    st[key].as_u64().unwrap_or_else(|| panic!("{key} in {st}"))
}

/// Runs the whole test again, once, in a fresh machine when the first
/// attempt failed because the nested kernel got stuck (soft lockup, RCU
/// stall, panic: seen once in CI during `tine stop inner`). Any other
/// failure fails at once.
#[test]
fn machine_start_exec_stale_stop() {
    let agent = build_agent();
    std::env::set_var("TINE_AGENT", &agent);
    for attempt in 1..=2 {
        EMULATOR_FAULT.store(false, Ordering::SeqCst);
        match std::panic::catch_unwind(|| one_attempt(attempt)) {
            Ok(()) => return,
            Err(e) if attempt == 1 && EMULATOR_FAULT.load(Ordering::SeqCst) => {
                common::progress(&format!(
                    "RETRY: the nested host's kernel got stuck (its console above shows a soft lockup, RCU stall or panic: the emulator, not tine); running the test again in a fresh machine. First failure: {}",
                    e.downcast_ref::<String>().map(String::as_str).unwrap_or("(panic)")
                ));
            }
            Err(e) => std::panic::resume_unwind(e),
        }
    }
}

fn one_attempt(attempt: u32) {
    let home = std::env::temp_dir().join(format!(
        "tine-machine-test-{}-{attempt}",
        std::process::id()
    ));
    std::fs::create_dir_all(&home).expect("home");
    let machine = Machine(home.clone());
    let home = machine.0.as_path();
    // Reuse the downloaded nested-host kernel and initramfs.
    let user_home = std::env::var_os("TINE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/tine")));
    if let Some(cached) = user_home
        .as_ref()
        .map(|h| h.join("testhost"))
        .filter(|p| p.is_dir())
    {
        std::os::unix::fs::symlink(cached, home.join("testhost")).expect("link testhost cache");
    }
    // The minimal image (scripts/test builds it) for the routed verbs below.
    if let Some(images) = user_home.map(|h| h.join("images")).filter(|p| p.is_dir()) {
        std::os::unix::fs::symlink(images, home.join("images")).expect("link image cache");
    }

    assert_eq!(status(home)["state"], "stopped");

    // Start, and start again (idempotent).
    let t = Instant::now();
    ok(home, &["machine", "start"]);
    let start_time = t.elapsed();
    let st = status(home);
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(st["agent_answers"], true, "{st}");
    let qemu = pid(&st, "qemu_pid");
    let vfsd = pid(&st, "virtiofsd_pid");
    assert!(alive(qemu) && alive(vfsd));
    ok(home, &["machine", "start"]);
    assert_eq!(
        pid(&status(home), "qemu_pid"),
        qemu,
        "a second start must reuse the machine"
    );

    // Inside: a real /dev/kvm with nested paging, the machine-local home.
    let out = ok(
        home,
        &[
            "machine",
            "exec",
            "--no-stdin",
            "--",
            "sh",
            "-c",
            "cat /sys/module/kvm_amd/parameters/npt; test -c /dev/kvm && echo kvm; echo $TINE_HOME; pwd",
        ],
    );
    let cwd = std::env::current_dir().expect("cwd");
    assert_eq!(out, format!("Y\nkvm\n/var/lib/tine\n{}\n", cwd.display()));

    // stdout and stderr apart; exit codes and death by signal pass through.
    let out = run(
        home,
        &[
            "machine",
            "exec",
            "--no-stdin",
            "--",
            "sh",
            "-c",
            "echo out; echo err >&2; exit 42",
        ],
    );
    assert_eq!(out.status.code(), Some(42));
    assert_eq!(out.stdout, b"out\n");
    assert_eq!(out.stderr, b"err\n");
    let out = run(
        home,
        &[
            "machine",
            "exec",
            "--no-stdin",
            "--",
            "sh",
            "-c",
            "kill -9 $$",
        ],
    );
    assert_eq!(out.status.code(), Some(128 + 9));
    let out = run(home, &["machine", "exec", "--no-stdin", "--", "true"]);
    assert_eq!(out.status.code(), Some(0));

    // A tine verb forwarded the way the CLI forwards them.
    let out = ok(
        home,
        &["machine", "forward", "--no-stdin", "--", "--version"],
    );
    assert!(out.starts_with("tine "), "{out}");

    // The user's verbs route through the machine: a Linux vm runs inside,
    // a micro guest here; `ls --json` shows both with the same fields.
    ok(home, &["run", "--name", "inner", "--mem", "256M"]);
    ok(
        home,
        &[
            "run",
            "--name",
            "outer",
            "--image",
            "micro-counter",
            "--mem",
            "64M",
        ],
    );
    let uname = ok(home, &["exec", "inner", "--", "uname", "-r"]);
    assert!(uname.trim().ends_with("cloud-amd64"), "{uname}");
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&ok(home, &["ls", "--json"])).expect("ls json");
    assert_eq!(rows.len(), 2, "{rows:?}");
    let keys = |r: &serde_json::Value| r.as_object().map(|o| o.keys().cloned().collect::<Vec<_>>());
    assert_eq!(
        keys(&rows[0]),
        keys(&rows[1]),
        "identical --json rows here and in the machine"
    );
    assert!(rows.iter().all(|r| r["state"] == "running"), "{rows:?}");
    assert!(
        !home.join("vms/inner").exists(),
        "the Linux vm lives in the machine"
    );
    assert!(home.join("vms/outer").exists(), "the micro guest runs here");
    let dir = std::env::temp_dir().join(format!("tine-machine-cp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let payload: Vec<u8> = (0..3u32 << 20).map(|i| (i * 7 + (i >> 9)) as u8).collect();
    std::fs::write(dir.join("in"), &payload).expect("write");
    ok(
        home,
        &["cp", dir.join("in").to_str().expect("utf8"), "inner:/tmp/f"],
    );
    ok(
        home,
        &[
            "cp",
            "inner:/tmp/f",
            dir.join("out").to_str().expect("utf8"),
        ],
    );
    assert!(
        std::fs::read(dir.join("out")).expect("read") == payload,
        "cp through the machine"
    );
    let _ = std::fs::remove_dir_all(&dir);
    ok(home, &["stop", "inner"]);
    ok(home, &["rm", "inner"]);
    ok(home, &["rm", "--force", "outer"]);
    assert_eq!(ok(home, &["ls", "--json"]).trim(), "[]");

    // 1 MiB of stdin comes back byte-exact.
    let input: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let mut child = tine(home)
        .args(["machine", "exec", "--", "cat"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("spawn");
    let mut stdin = child.stdin.take().expect("stdin");
    let data = input.clone();
    // Ends with an error at the latest when a timeout kills `cat`.
    let writer = std::thread::spawn(move || stdin.write_all(&data));
    let out = common::wait_within(child, "tine machine exec -- cat", common::call_timeout())
        .unwrap_or_else(|t| {
            common::progress(&format!("{t}{}", machine_logs(home)));
            panic!("tine machine exec -- cat: timed out (report above on stderr)");
        });
    writer.join().expect("writer").expect("write stdin");
    assert!(out.status.success());
    assert!(
        out.stdout == input,
        "1 MiB through cat came back different ({} bytes)",
        out.stdout.len()
    );

    // Round trip of a forwarded `true`.
    let mut times: Vec<Duration> = (0..5)
        .map(|_| {
            let t = Instant::now();
            ok(home, &["machine", "exec", "--no-stdin", "--", "true"]);
            t.elapsed()
        })
        .collect();
    times.sort();
    eprintln!(
        "machine: start {:.2} s; exec `true` round trip median {:.0} ms",
        start_time.as_secs_f64(),
        times[2].as_secs_f64() * 1000.0
    );

    // Stale: QEMU killed behind tine's back; the next use restarts it, saying so once.
    assert!(Command::new("kill")
        .args(["-9", &qemu.to_string()])
        .status()
        .expect("kill")
        .success());
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(qemu) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(status(home)["state"], "stale");
    let out = run(
        home,
        &["machine", "exec", "--no-stdin", "--", "echo", "back"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, b"back\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.lines().count(),
        1,
        "one line about starting the machine: {err}"
    );
    assert!(err.contains("starting the nested test host"), "{err}");
    let st = status(home);
    assert_eq!(st["state"], "running");
    let qemu2 = pid(&st, "qemu_pid");
    let vfsd2 = pid(&st, "virtiofsd_pid");
    assert_ne!(qemu2, qemu);
    assert!(!alive(vfsd), "the stale machine's virtiofsd must be gone");

    // Stop: nothing left running, no runtime state.
    ok(home, &["machine", "stop"]);
    assert_eq!(status(home)["state"], "stopped");
    assert!(
        !alive(qemu2) && !alive(vfsd2),
        "qemu or virtiofsd left running"
    );
    assert!(!home.join("machine/run").exists());
    assert!(!home.join("machine/state.json").exists());
}
