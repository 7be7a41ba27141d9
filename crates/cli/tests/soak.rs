//! Soak: 1,000 fork+rm cycles and 1,000 checkpoint+delete cycles of one
//! micro vm with a disk, on this machine's /dev/kvm. Every cycle succeeds;
//! no zombie is left among tined's and the VMMs' children; the vm's disk
//! chain stays short (`tine disk layers --json`); `$TINE_HOME`'s disk use,
//! tined's and the VMM's open fds and resident memory stay flat (first
//! sample after a warm-up against the last, with a tolerance). The
//! numbers are printed.
//!
//! The cycles go straight to tined's API over its socket (the `tine`
//! process per call would triple the time: each one starts, checks
//! tined's health, and renders); the samples use the CLI.
//! `TINE_SOAK_CYCLES` overrides the count (default 1000).

mod common;

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use common::procs::{self, ls_tells_the_truth, vmm_procs};
use common::{kvm_available, progress, Home, TempDir};

fn cycles() -> usize {
    std::env::var("TINE_SOAK_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

/// One cycle's budget at most: a soak test must end within 3 minutes.
const BUDGET: Duration = Duration::from_secs(180);

/// One request to tined over its socket; the status and the JSON answer.
fn api(h: &Home, method: &str, path: &str, body: &str) -> (u16, serde_json::Value) {
    let mut s = std::os::unix::net::UnixStream::connect(h.0.path().join("tined.sock"))
        .expect("connect to tined");
    s.set_read_timeout(Some(Duration::from_secs(120)))
        .expect("timeout");
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("answer");
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let json = text
        .split_once("\r\n\r\n")
        .and_then(|(_, b)| serde_json::from_str(b).ok())
        .unwrap_or(serde_json::Value::Null);
    (status, json)
}

fn ok(h: &Home, method: &str, path: &str, body: &str, what: &str) -> serde_json::Value {
    let (status, v) = api(h, method, path, body);
    assert!(
        (200..300).contains(&status),
        "{what}: {method} {path} answered {status}: {v}"
    );
    v
}

/// One sample of what must stay flat.
#[derive(Debug, Clone, Copy)]
struct Sample {
    cycle: usize,
    tined_fds: usize,
    tined_rss_kib: u64,
    vmm_fds: usize,
    vmm_rss_kib: u64,
    /// `$TINE_HOME` but tined's log (which tined bounds itself).
    home_bytes: u64,
    log_bytes: u64,
    depth: usize,
}

/// The vm's disk chain depth (top included).
fn depth(h: &Home, vm: &str) -> usize {
    let v: serde_json::Value =
        serde_json::from_str(&h.ok(&["disk", "layers", vm, "--json"])).expect("layers json");
    v[0].as_array().map_or(0, Vec::len)
}

/// Zombies among the children of tined and of the home's VMMs that are
/// still there after a moment (a child is reaped within the reaper's
/// poll, 20 ms). Returns (seen at first look, left).
fn zombies(h: &Home) -> (usize, Vec<u32>) {
    let parents = || {
        let mut p: Vec<u32> = vmm_procs(&procs::canonical(h))
            .iter()
            .map(|p| p.pid)
            .collect();
        p.extend(procs::tined_pid(h));
        p
    };
    let first = procs::zombies_of(&parents());
    if first.is_empty() {
        return (0, Vec::new());
    }
    std::thread::sleep(Duration::from_millis(200));
    let left: Vec<u32> = procs::zombies_of(&parents())
        .into_iter()
        .filter(|z| first.contains(z))
        .collect();
    (first.len(), left)
}

/// Bytes allocated by tined's log files.
fn log_bytes(h: &Home) -> u64 {
    use std::os::unix::fs::MetadataExt;
    ["tined.log", "tined.log.1"]
        .iter()
        .filter_map(|f| std::fs::metadata(h.0.path().join(f)).ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

fn sample(h: &Home, cycle: usize) -> Sample {
    let tined = procs::tined_pid(h).expect("tined runs");
    let vmm = vmm_procs(&procs::canonical(h))
        .into_iter()
        .find(|p| p.name == "v")
        .expect("v's VMM runs")
        .pid;
    Sample {
        cycle,
        tined_fds: procs::fd_count(tined),
        tined_rss_kib: procs::rss_kib(tined),
        vmm_fds: procs::fd_count(vmm),
        vmm_rss_kib: procs::rss_kib(vmm),
        home_bytes: procs::disk_use(h.0.path()) - log_bytes(h),
        log_bytes: log_bytes(h),
        depth: depth(h, "v"),
    }
}

/// Serializes the soak tests: each is timed alone.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs `cycle` `n` times on vm `v` of a fresh home, sampling as it goes,
/// and checks what must hold.
fn soak(tag: &str, what: &str, cycle: impl Fn(&Home, usize)) {
    if !kvm_available() {
        return;
    }
    let _one = one_at_a_time();
    let h = Home::new(tag);
    let files = TempDir::new(&format!("{tag}-disk"));
    let disk = files.path().join("disk.raw");
    std::fs::File::create(&disk)
        .and_then(|f| f.set_len(8 << 20))
        .expect("disk");
    h.ok(&[
        "run",
        "--name",
        "v",
        "--image",
        "micro-memtouch",
        "--mem",
        "64M",
        "--disk",
        disk.to_str().expect("utf8"),
    ]);
    let n = cycles();
    let warm = (n / 20).max(1);
    let t0 = Instant::now();
    let mut samples = Vec::new();
    let mut max_depth = depth(&h, "v");
    let mut transient_zombies = 0;
    let mut slowest = Duration::ZERO;
    for i in 0..n {
        let c0 = Instant::now();
        cycle(&h, i);
        slowest = slowest.max(c0.elapsed());
        if i + 1 == warm || (i + 1) % 100 == 0 || i + 1 == n {
            let s = sample(&h, i + 1);
            max_depth = max_depth.max(s.depth);
            let (seen, left) = zombies(&h);
            transient_zombies += seen;
            assert!(
                left.is_empty(),
                "{what}: zombies after cycle {}: {left:?}",
                i + 1
            );
            samples.push(s);
        }
        assert!(
            t0.elapsed() < BUDGET,
            "{what}: {} cycles took more than {BUDGET:?}",
            i + 1
        );
    }
    let took = t0.elapsed();
    let rows = ls_tells_the_truth(&h, what, Duration::from_secs(3));
    assert_eq!(rows.len(), 1, "{what}: only v is left: {rows:?}");
    let first = samples[0];
    let last = samples[samples.len() - 1];
    let table: String = samples
        .iter()
        .map(|s| {
            format!(
                "\n  cycle {:>5}: tined {} fds {} KiB, VMM {} fds {} KiB, home {} KiB (+ log {} KiB), depth {}",
                s.cycle,
                s.tined_fds,
                s.tined_rss_kib,
                s.vmm_fds,
                s.vmm_rss_kib,
                s.home_bytes >> 10,
                s.log_bytes >> 10,
                s.depth
            )
        })
        .collect();
    progress(&format!(
        "{what}: {n} cycles in {:.1} s ({:.1} ms each, slowest {:.1} ms); chain depth at most {max_depth}; zombies seen in passing {transient_zombies}, left 0{table}",
        took.as_secs_f64(),
        took.as_secs_f64() * 1000.0 / n as f64,
        slowest.as_secs_f64() * 1000.0
    ));
    assert!(
        max_depth <= 3,
        "{what}: the chain grew to {max_depth} layers"
    );
    assert!(
        last.tined_fds <= first.tined_fds + 4,
        "{what}: tined's fds {} -> {}",
        first.tined_fds,
        last.tined_fds
    );
    assert!(
        last.vmm_fds <= first.vmm_fds + 2,
        "{what}: the VMM's fds {} -> {}",
        first.vmm_fds,
        last.vmm_fds
    );
    assert!(
        last.tined_rss_kib <= first.tined_rss_kib + first.tined_rss_kib / 2 + (8 << 10),
        "{what}: tined's RSS {} -> {} KiB",
        first.tined_rss_kib,
        last.tined_rss_kib
    );
    assert!(
        last.vmm_rss_kib <= first.vmm_rss_kib + first.vmm_rss_kib / 4 + (4 << 10),
        "{what}: the VMM's RSS {} -> {} KiB",
        first.vmm_rss_kib,
        last.vmm_rss_kib
    );
    assert!(
        last.home_bytes <= first.home_bytes + (1 << 20),
        "{what}: TINE_HOME grew from {} to {} KiB",
        first.home_bytes >> 10,
        last.home_bytes >> 10
    );
    // tined's log takes a line per event; tined keeps it (and the one
    // before it, `tined.log.1`) within its limit (crates/tined logfile.rs).
    assert!(
        last.log_bytes <= 2 * (16 << 20) + (1 << 20),
        "{what}: tined's log is {} KiB",
        last.log_bytes >> 10
    );
    procs::rm_everything_leaves_no_process(&h, what);
}

#[test]
fn test_a_thousand_fork_and_rm_cycles() {
    soak("soak-fork", "fork+rm", |h, i| {
        let what = format!("fork+rm cycle {i}");
        let f = ok(h, "POST", "/v1/vms/v/fork", r#"{"names":["c"]}"#, &what);
        assert_eq!(f["results"][0]["ok"], true, "{what}: {f}");
        let r = ok(h, "DELETE", "/v1/vms/c?force=true", "", &what);
        assert_eq!(r["processes"], 1, "{what}: {r}");
    });
}

#[test]
fn test_a_thousand_checkpoint_and_delete_cycles() {
    soak("soak-checkpoint", "checkpoint+delete", |h, i| {
        let what = format!("checkpoint+delete cycle {i}");
        let c = ok(h, "POST", "/v1/vms/v/checkpoints", r#"{"tag":"cp"}"#, &what);
        assert_eq!(c["tag"], "cp", "{what}: {c}");
        ok(h, "DELETE", "/v1/vms/v/checkpoints/cp", "", &what);
    });
}
