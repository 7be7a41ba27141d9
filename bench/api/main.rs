//! bench/api: what tined's API costs over the engine, and whether tined
//! holds up under sustained forks (issue 13, "Numbers").
//!
//! All on this machine's /dev/kvm with micro-memtouch guests (no agent),
//! in temporary homes (`images` linked to the image cache, as the CLI
//! tests do); every vm started is removed at the end, also on errors and
//! Ctrl-C.
//!
//! 1. Fork overhead: one vm forked into one child, then the child removed,
//!    `--forks` (100) times each, interleaved: in this process through the
//!    engine library (`host::fork::fork`, `host::vm::remove`, home A, with
//!    a subreaper installed as in tined) and through tined's HTTP API over
//!    its Unix socket (`POST /v1/vms/P/fork {"count":1}`, `DELETE
//!    /v1/vms/P-1?force=true`, home B; a new connection per request, as
//!    the CLI does), also with an `Idempotency-Key`. Medians and p90s, the
//!    difference of the medians, the median of the paired differences,
//!    and the part of each call outside the engine's own fork time
//!    (wall - the report's `total_ms`), whose difference is the API's
//!    cost without the noise of the fork itself. Also the fixed cost of a
//!    request: `GET /v1/health`, and `GET /v1/vms/P` against
//!    `host::vm::info`.
//! 2. Console round trip (micro guests have no agent, so no exec): `ping`
//!    typed in, until its `PONG` is in the console log: through the
//!    engine (send, read the log file), the API (`POST .../console`, then
//!    `GET .../console` until it shows), the API with a `?follow=true`
//!    stream open, and the CLI (`tine console P --send ping`, then `tine
//!    console P` until it shows). exec of a Linux guest needs the nested
//!    test host here (kvm_pvm cannot run Linux): not measured.
//! 3. Sustained: fork P into one child and remove it, through the API, as
//!    fast as it goes, for `--secs` (300): forks/s overall and per window,
//!    and at the start and end: tined's RSS, fds and threads, the parent
//!    VMM's RSS, $TINE_HOME's disk use and files, the parent's disk chain
//!    depth.
//! 4. tined's RSS idle (fresh, and after the phases above), and with
//!    `--vms` (100) micro vms of 64 MiB running (their start time, and
//!    `GET /v1/vms` with all of them); all removed after.
//!
//! Run: `bench/api/run [--secs N] [--forks N] [--pings N] [--vms N]
//! [--only overhead,console,sustained,many] [--baseline-tined PATH]`
//! (builds the workspace in release first). `--baseline-tined` adds, to
//! phase 1, API forks through another tined binary (a copy of an older
//! build) in a home of its own, interleaved with the others: before/after
//! of a change to tined in one run, under the same load. Last line:
//! name=value pairs.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::Value;

const IMAGE: &str = "micro-memtouch";
/// Parent memory for the fork phases (the CLI tests' size).
const PARENT_MIB: u64 = 256;
/// Memory of each vm of phase 4.
const MANY_MIB: u64 = 64;
/// Before each measured fork: the previous child's VMM finishes exiting
/// (on 2 shared cores it would compete with what is measured).
const SETTLE: Duration = Duration::from_millis(100);
/// The sustained phase prints a line this often.
const WINDOW: Duration = Duration::from_secs(30);

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::Relaxed);
}

fn stopped() -> bool {
    STOP.load(Ordering::Relaxed)
}

// --- numbers ---

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s
}

/// Median (the mean of the middle two of an even count).
fn p50(v: &[f64]) -> f64 {
    let s = sorted(v);
    match s.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// Nearest-rank p90.
fn p90(v: &[f64]) -> f64 {
    let s = sorted(v);
    if s.is_empty() {
        return f64::NAN;
    }
    let i = ((s.len() as f64 * 0.9).ceil() as usize).clamp(1, s.len()) - 1;
    s[i]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// "p50 X ms, p90 Y ms (n N)".
fn show(v: &[f64]) -> String {
    format!(
        "p50 {:8.3} ms  p90 {:8.3} ms  (n {})",
        p50(v),
        p90(v),
        v.len()
    )
}

// --- the API over a Unix socket: one connection per request ---

struct Resp {
    status: u16,
    body: Vec<u8>,
    /// tined's `Server-Timing`: ms in engine calls, ms in tined in all.
    timing: Option<(f64, f64)>,
}

impl Resp {
    fn json(&self) -> anyhow::Result<Value> {
        serde_json::from_slice(&self.body).with_context(|| {
            format!(
                "status {}, body not JSON: {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }
    fn ok(self, what: &str) -> anyhow::Result<Resp> {
        if !(200..300).contains(&self.status) {
            bail!(
                "{what}: status {}: {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            );
        }
        Ok(self)
    }
}

struct Api {
    sock: PathBuf,
}

impl Api {
    fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> anyhow::Result<Resp> {
        let mut s = UnixStream::connect(&self.sock)
            .with_context(|| format!("cannot reach {}", self.sock.display()))?;
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let mut req = format!("{method} {path} HTTP/1.1\r\nhost: tined\r\nconnection: close\r\n");
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        if !body.is_empty() {
            req.push_str("content-type: application/json\r\n");
        }
        req.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
        s.write_all(req.as_bytes())?;
        // Read until the body is complete (as an HTTP client does), not
        // until tined closes the connection.
        let mut raw = Vec::new();
        let mut buf = [0u8; 16 << 10];
        loop {
            let k = s.read(&mut buf)?;
            if k == 0 {
                break;
            }
            raw.extend_from_slice(&buf[..k]);
            if response_complete(&raw) {
                break;
            }
        }
        parse_response(&raw)
    }

    fn get(&self, path: &str) -> anyhow::Result<Resp> {
        self.request("GET", path, None, &[])?.ok(path)
    }

    fn post(&self, path: &str, body: &Value) -> anyhow::Result<Resp> {
        self.request("POST", path, Some(body), &[])?.ok(path)
    }

    fn delete(&self, path: &str) -> anyhow::Result<Resp> {
        self.request("DELETE", path, None, &[])?.ok(path)
    }
}

/// Whether `raw` holds a whole answer (by content-length, or the last
/// chunk of a chunked body).
fn response_complete(raw: &[u8]) -> bool {
    let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return false;
    };
    let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
    let body = raw.len() - end - 4;
    if let Some(n) = head
        .split("\r\n")
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse::<usize>().ok())
    {
        return body >= n;
    }
    if head.contains("transfer-encoding: chunked") {
        return raw.ends_with(b"\r\n0\r\n\r\n") || (body == 5 && raw.ends_with(b"0\r\n\r\n"));
    }
    // No length: until the connection closes.
    false
}

fn parse_response(raw: &[u8]) -> anyhow::Result<Resp> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no HTTP header in the answer")?;
    let head = String::from_utf8_lossy(&raw[..end]);
    let mut lines = head.split("\r\n");
    let status: u16 = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .context("no status line")?;
    let (mut chunked, mut timing) = (false, None);
    for l in lines {
        let l = l.to_ascii_lowercase();
        if l.starts_with("transfer-encoding: chunked") {
            chunked = true;
        }
        if let Some(v) = l.strip_prefix("server-timing:") {
            timing = server_timing(v);
        }
    }
    let mut body = raw[end + 4..].to_vec();
    if chunked {
        body = dechunk(&body)?;
    }
    Ok(Resp {
        status,
        body,
        timing,
    })
}

/// `engine;dur=X, handler;dur=Y` -> (X, Y).
fn server_timing(v: &str) -> Option<(f64, f64)> {
    let dur = |name: &str| -> Option<f64> {
        v.split(',')
            .map(str::trim)
            .find_map(|m| m.strip_prefix(name)?.strip_prefix(";dur=")?.parse().ok())
    };
    Some((dur("engine")?, dur("handler")?))
}

fn dechunk(mut b: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let nl = b
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("bad chunk")?;
        let size = usize::from_str_radix(
            String::from_utf8_lossy(&b[..nl])
                .split(';')
                .next()
                .unwrap_or("")
                .trim(),
            16,
        )?;
        b = &b[nl + 2..];
        if size == 0 {
            return Ok(out);
        }
        out.extend_from_slice(b.get(..size).context("short chunk")?);
        b = b.get(size + 2..).context("short chunk")?;
    }
}

// --- processes and homes ---

/// Fields of /proc/PID/status in KiB (VmRSS) or counts (Threads).
fn status_field(pid: u32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let l = s.lines().find(|l| l.starts_with(field))?;
    l.split_whitespace().nth(1)?.parse().ok()
}

/// CPU time (ns) a process's threads have run, from /proc/PID/task/*/schedstat.
fn proc_cpu_ns(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// CPU time (ns) this thread has run.
fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Bytes allocated under `dir` (symlinks not followed) and the number of files.
fn disk_use(dir: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let (mut bytes, mut files) = (0, 0);
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(m) = e.path().symlink_metadata() else {
                continue;
            };
            if m.is_dir() {
                stack.push(e.path());
            } else {
                bytes += m.blocks() * 512;
                files += 1;
            }
        }
    }
    (bytes, files)
}

/// The `n` largest files under `dir` (allocated size), as text.
fn largest_files(dir: &Path, n: usize) -> String {
    use std::os::unix::fs::MetadataExt;
    let mut all = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(m) = e.path().symlink_metadata() else {
                continue;
            };
            if m.is_dir() {
                stack.push(e.path());
            } else {
                all.push((m.blocks() * 512, e.path()));
            }
        }
    }
    all.sort_by_key(|e| std::cmp::Reverse(e.0));
    all.iter()
        .take(n)
        .map(|(b, p)| {
            format!(
                "{} {:.0} KiB",
                p.strip_prefix(dir).unwrap_or(p).display(),
                *b as f64 / 1024.0
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn mem_available_mib() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .map(|k| k / 1024.0)
        .unwrap_or(f64::NAN)
}

/// A temporary home whose `images` is the image cache's.
fn new_home(scratch: &Path, tag: &str) -> anyhow::Result<PathBuf> {
    let home = scratch.join(tag);
    std::fs::create_dir_all(&home)?;
    let cache = std::env::var_os("TINE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/tine")
        });
    std::os::unix::fs::symlink(cache.join("images"), home.join("images")).context("link images")?;
    Ok(home)
}

/// Where `cargo build --release` put tine, tined, tine-vmm and
/// tine-gateway: beside this bench (`target/release/deps/api-*`), or
/// `TINE_BIN_DIR`.
fn bin_dir() -> anyhow::Result<PathBuf> {
    if let Some(d) = std::env::var_os("TINE_BIN_DIR") {
        return Ok(PathBuf::from(d));
    }
    let exe = std::env::current_exe()?;
    let mut d = exe.parent().context("no exe dir")?.to_path_buf();
    if d.ends_with("deps") {
        d.pop();
    }
    for b in ["tine", "tined", "tine-vmm", "tine-gateway"] {
        if !d.join(b).is_file() {
            bail!(
                "{} missing: `cargo build --release` first (bench/api/run does)",
                d.join(b).display()
            );
        }
    }
    Ok(d)
}

/// The tined of home B, started by this bench.
struct Tined {
    pid: u32,
    api: Api,
}

fn start_tined(tined: &Path, bins: &Path, home: &Path) -> anyhow::Result<Tined> {
    let log = std::fs::File::create(home.join("tined.log"))?;
    let mut cmd = Command::new(tined);
    if tined.parent() != Some(bins) {
        // A copy elsewhere: it starts this build's VMM and gateway.
        cmd.env("TINE_VMM_BIN", bins.join("tine-vmm"))
            .env("TINE_GATEWAY_BIN", bins.join("tine-gateway"));
    }
    let child = cmd
        .arg("--home")
        .arg(home)
        .env("TINE_HOME", home)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("start tined")?;
    let pid = child.id();
    // Reaped by the subreaper when it exits.
    std::mem::forget(child);
    let api = Api {
        sock: home.join("tined.sock"),
    };
    let t0 = Instant::now();
    while api.get("/v1/health").is_err() {
        if t0.elapsed() > Duration::from_secs(30) {
            bail!(
                "tined did not answer in 30 s; see {}/tined.log",
                home.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(Tined { pid, api })
}

/// The line count of "PONG" in a console log.
fn pongs(text: &[u8]) -> usize {
    text.windows(4).filter(|w| w == b"PONG").count()
}

/// Waits until `read` shows `want` in its text (or 10 s).
fn wait_for(
    mut read: impl FnMut() -> anyhow::Result<Vec<u8>>,
    want: &[u8],
    pause: Duration,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    loop {
        let t = read()?;
        if t.windows(want.len()).any(|w| w == want) {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(10) || stopped() {
            bail!("{:?} never showed", String::from_utf8_lossy(want));
        }
        std::thread::sleep(pause);
    }
}

fn run_spec(name: &str, mem: u64, disk: Option<&Path>) -> host::vm::RunSpec {
    let mut s = host::vm::RunSpec::new(name, IMAGE);
    s.mem_mib = mem;
    s.no_agent = true;
    s.disks = disk.map(|d| vec![d.to_path_buf()]).unwrap_or_default();
    s
}

fn spec_json(s: &host::vm::RunSpec) -> anyhow::Result<Value> {
    Ok(serde_json::to_value(s)?)
}

fn fork_spec() -> host::fork::ForkSpec {
    host::fork::ForkSpec {
        count: Some(1),
        ..Default::default()
    }
}

// --- the bench ---

struct Opts {
    secs: u64,
    forks: usize,
    pings: usize,
    vms: usize,
    only: Vec<String>,
    /// Another tined binary to compare with in phase 1 (a home of its own).
    baseline: Option<PathBuf>,
}

impl Opts {
    fn parse() -> anyhow::Result<Opts> {
        let mut o = Opts {
            secs: 300,
            forks: 100,
            pings: 50,
            vms: 100,
            only: Vec::new(),
            baseline: None,
        };
        let a: Vec<String> = std::env::args().skip(1).collect();
        let mut i = 0;
        while i < a.len() {
            let val = || a.get(i + 1).context("a value after the flag");
            match a[i].as_str() {
                "--secs" => o.secs = val()?.parse()?,
                "--forks" => o.forks = val()?.parse()?,
                "--pings" => o.pings = val()?.parse()?,
                "--vms" => o.vms = val()?.parse()?,
                "--only" => o.only = val()?.split(',').map(str::to_string).collect(),
                "--baseline-tined" => o.baseline = Some(PathBuf::from(val()?)),
                // cargo bench passes --bench.
                "--bench" => {
                    i += 1;
                    continue;
                }
                x => bail!("unknown flag {x} (--secs N --forks N --pings N --vms N --only LIST --baseline-tined PATH)"),
            }
            i += 2;
        }
        Ok(o)
    }
    fn wants(&self, phase: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|p| p == phase)
    }
}

struct Bench {
    opts: Opts,
    bins: PathBuf,
    scratch: PathBuf,
    /// Home A: the engine in this process.
    engine: host::Host,
    /// Home B: tined.
    home_b: PathBuf,
    tined: Tined,
    /// Home C and the baseline tined serving it (--baseline-tined).
    baseline: Option<(PathBuf, Tined)>,
    base: PathBuf,
    pairs: Vec<String>,
}

impl Bench {
    fn pair(&mut self, k: &str, v: f64) {
        self.pairs.push(format!("{k}={v:.3}"));
    }

    fn tined_rss_mib(&self) -> f64 {
        status_field(self.tined.pid, "VmRSS:").unwrap_or(0) as f64 / 1024.0
    }

    fn start_parents(&self) -> anyhow::Result<()> {
        host::vm::start(&self.engine, run_spec("pa", PARENT_MIB, Some(&self.base)))
            .map_err(|e| anyhow::anyhow!("in-process run: {e}"))?;
        self.tined.api.post(
            "/v1/vms",
            &spec_json(&run_spec("pb", PARENT_MIB, Some(&self.base)))?,
        )?;
        if let Some((home_c, t)) = &self.baseline {
            t.api.post(
                "/v1/vms",
                &spec_json(&run_spec("pc", PARENT_MIB, Some(&self.base)))?,
            )?;
            let c = home_c.join("vms/pc/console.log");
            wait_for(
                || Ok(std::fs::read(&c)?),
                b"READY",
                Duration::from_millis(5),
            )?;
        }
        let a = self.engine.home.join("vms/pa/console.log");
        let b = self.home_b.join("vms/pb/console.log");
        wait_for(
            || Ok(std::fs::read(&a)?),
            b"READY",
            Duration::from_millis(5),
        )?;
        wait_for(
            || Ok(std::fs::read(&b)?),
            b"READY",
            Duration::from_millis(5),
        )?;
        Ok(())
    }

    /// Phase 1.
    fn overhead(&mut self) -> anyhow::Result<()> {
        let n = self.opts.forks;
        let api = &self.tined.api;
        // Fixed cost of a request.
        let mut health = Vec::new();
        let mut info_api = Vec::new();
        let mut info_lib = Vec::new();
        let mut info_added = Vec::new();
        for _ in 0..200 {
            let t = Instant::now();
            api.get("/v1/health")?;
            health.push(ms(t.elapsed()));
            let t = Instant::now();
            let r = api.get("/v1/vms/pb")?;
            let w = ms(t.elapsed());
            info_api.push(w);
            if let Some((engine, _)) = r.timing {
                info_added.push(w - engine);
            }
            let t = Instant::now();
            host::vm::info(&self.engine, "pa").map_err(|e| anyhow::anyhow!("{e}"))?;
            info_lib.push(ms(t.elapsed()));
        }
        // The same GET after 12 ms asleep (about a fork's time): both
        // sides wake from sleep, as after a fork, but no VMM competes.
        let mut info_slept = Vec::new();
        for _ in 0..100 {
            std::thread::sleep(Duration::from_millis(12));
            let t = Instant::now();
            let r = api.get("/v1/vms/pb")?;
            let w = ms(t.elapsed());
            if let Some((engine, _)) = r.timing {
                info_slept.push(w - engine);
            }
        }
        // Forks, interleaved (the order rotates each round).
        let mut lib = Series::default();
        let mut http = Series::default();
        let mut idem = Series::default();
        let mut base = Series::default();
        let pid = std::process::id();
        let kinds = if self.baseline.is_some() { 4 } else { 3 };
        let tpid = self.tined.pid;
        for i in 0..n {
            if stopped() {
                break;
            }
            for k in 0..kinds {
                std::thread::sleep(SETTLE);
                match (i + k) % kinds {
                    0 => {
                        let cpu = thread_cpu_ns();
                        let t = Instant::now();
                        let r = host::fork::fork(&self.engine, "pa", &fork_spec())
                            .map_err(|e| anyhow::anyhow!("in-process fork: {e}"))?;
                        let w = ms(t.elapsed());
                        lib.fork_cpu
                            .push(thread_cpu_ns().saturating_sub(cpu) as f64 / 1e6);
                        lib.fork.push(w);
                        lib.outside.push(w - r.total_ms);
                        lib.engine_total.push(r.total_ms);
                        let t = Instant::now();
                        host::vm::remove(&self.engine, &r.names[0], true)
                            .map_err(|e| anyhow::anyhow!("in-process rm: {e}"))?;
                        lib.rm.push(ms(t.elapsed()));
                    }
                    1 => api_cycle(api, tpid, "pb", &[], &mut http)?,
                    2 => {
                        let key = format!("bench-{pid}-{i}");
                        api_cycle(api, tpid, "pb", &[("idempotency-key", &key)], &mut idem)?
                    }
                    _ => {
                        if let Some(b) = &self.baseline {
                            api_cycle(&b.1.api, b.1.pid, "pc", &[], &mut base)?
                        }
                    }
                }
            }
        }
        let paired = |a: &[f64], b: &[f64]| -> Vec<f64> {
            a.iter().zip(b).map(|(x, y)| x - y).collect::<Vec<_>>()
        };
        println!(
            "== 1. API overhead: fork of one vm into one child (count 1), then rm of the child"
        );
        println!(
            "   {IMAGE} {PARENT_MIB} MiB parent with a disk; {n} rounds, each: engine in-process / API / API+Idempotency-Key, order rotating, {} ms settle before each",
            SETTLE.as_millis()
        );
        println!("   GET /v1/health              {}", show(&health));
        println!("   GET /v1/vms/P (API)         {}", show(&info_api));
        println!("   host::vm::info (in-process) {}", show(&info_lib));
        if !info_added.is_empty() {
            println!("   GET /v1/vms/P wall - engine {}", show(&info_added));
            println!(
                "     the same, each after 12 ms asleep {}",
                show(&info_slept)
            );
        }
        println!("   fork, in-process            {}", show(&lib.fork));
        println!("   fork, API                   {}", show(&http.fork));
        println!("   fork, API + idempotency key {}", show(&idem.fork));
        println!(
            "     engine's own total_ms: in-process p50 {:.3}, API p50 {:.3}, API+key p50 {:.3}",
            p50(&lib.engine_total),
            p50(&http.engine_total),
            p50(&idem.engine_total)
        );
        let d50 = p50(&http.fork) - p50(&lib.fork);
        let dpair = p50(&paired(&http.fork, &lib.fork));
        let dout = p50(&http.outside) - p50(&lib.outside);
        let dout_idem = p50(&idem.outside) - p50(&lib.outside);
        println!("   API - in-process, fork: difference of p50s {d50:+.3} ms; p50 of paired differences {dpair:+.3} ms");
        println!(
            "   outside the engine's fork time (wall - total_ms): in-process {}",
            show(&lib.outside)
        );
        println!(
            "                                                      API        {}",
            show(&http.outside)
        );
        println!(
            "                                                      API+key    {}",
            show(&idem.outside)
        );
        println!(
            "   => by wall - total_ms: API adds {dout:+.3} ms at p50 per fork (+{dout_idem:.3} ms with an idempotency key)"
        );
        if !http.fork_added.is_empty() {
            println!(
                "   tined's Server-Timing (the engine's call timed inside tined, per request):"
            );
            println!(
                "     fork in the engine, in tined       {}",
                show(&http.fork_engine)
            );
            println!(
                "     fork: wall - engine (API's cost)   {}",
                show(&http.fork_added)
            );
            println!(
                "       of which in tined's handler      {}",
                show(&http.fork_tined)
            );
            println!(
                "       and the connection (wall - handler) {}",
                show(&http.fork_transport)
            );
            println!(
                "     CPU per fork: in-process (the calling thread) {}",
                show(&lib.fork_cpu)
            );
            println!(
                "                   tined (all threads)             {}",
                show(&http.fork_cpu)
            );
            println!(
                "                   tined, with a key               {}",
                show(&idem.fork_cpu)
            );
            println!(
                "     same with an idempotency key       {}",
                show(&idem.fork_added)
            );
            println!(
                "     rm in the engine, in tined         {}",
                show(&http.rm_engine)
            );
            println!(
                "     rm: wall - engine (API's cost)     {}",
                show(&http.rm_added)
            );
            println!(
                "   => API adds {:.3} ms at p50 per fork (target <= 0.3 ms), {:.3} ms with an idempotency key, {:.3} ms per rm",
                p50(&http.fork_added),
                p50(&idem.fork_added),
                p50(&http.rm_added)
            );
            if self.baseline.is_some() {
                let b = &base;
                println!(
                    "   baseline tined ({}), interleaved with the above:",
                    self.opts
                        .baseline
                        .as_deref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default()
                );
                println!("     fork, API                          {}", show(&b.fork));
                println!(
                    "     fork in the engine, in tined       {}",
                    show(&b.fork_engine)
                );
                println!(
                    "     fork: wall - engine (API's cost)   {}",
                    show(&b.fork_added)
                );
                println!(
                    "       of which in tined's handler      {}",
                    show(&b.fork_tined)
                );
                println!(
                    "       and the connection (wall - handler) {}",
                    show(&b.fork_transport)
                );
                println!(
                    "     CPU per fork, tined (all threads)  {}",
                    show(&b.fork_cpu)
                );
                println!(
                    "     rm: wall - engine (API's cost)     {}",
                    show(&b.rm_added)
                );
                println!(
                    "   => this tined's API cost per fork: {:.3} ms at p50, the baseline's {:.3} ms",
                    p50(&http.fork_added),
                    p50(&b.fork_added)
                );
                self.pair("fork_api_cost_ms_p50_baseline", p50(&b.fork_added));
                self.pair("fork_api_tined_ms_p50_baseline", p50(&b.fork_tined));
                self.pair("fork_cpu_tined_ms_p50_baseline", p50(&b.fork_cpu));
                self.pair("rm_api_cost_ms_p50_baseline", p50(&b.rm_added));
            }
            self.pair("fork_api_tined_ms_p50", p50(&http.fork_tined));
            self.pair("fork_api_connection_ms_p50", p50(&http.fork_transport));
            self.pair("fork_cpu_lib_ms_p50", p50(&lib.fork_cpu));
            self.pair("fork_cpu_tined_ms_p50", p50(&http.fork_cpu));
            self.pair("info_api_slept_cost_ms_p50", p50(&info_slept));
            self.pair("fork_api_cost_ms_p50", p50(&http.fork_added));
            self.pair("fork_api_cost_ms_p90", p90(&http.fork_added));
            self.pair("fork_api_idem_cost_ms_p50", p50(&idem.fork_added));
            self.pair("rm_api_cost_ms_p50", p50(&http.rm_added));
            self.pair("fork_engine_in_tined_ms_p50", p50(&http.fork_engine));
            self.pair("rm_engine_in_tined_ms_p50", p50(&http.rm_engine));
        }
        println!("   rm, in-process              {}", show(&lib.rm));
        println!("   rm, API                     {}", show(&http.rm));
        println!(
            "   API - in-process, rm: difference of p50s {:+.3} ms; p50 of paired differences {:+.3} ms",
            p50(&http.rm) - p50(&lib.rm),
            p50(&paired(&http.rm, &lib.rm))
        );
        println!(
            "   fork+rm cycle: in-process p50 {:.3} ms, API p50 {:.3} ms",
            p50(&paired_sum(&lib.fork, &lib.rm)),
            p50(&paired_sum(&http.fork, &http.rm))
        );
        self.pair("health_ms_p50", p50(&health));
        self.pair("info_api_ms_p50", p50(&info_api));
        self.pair("info_lib_ms_p50", p50(&info_lib));
        self.pair("fork_lib_ms_p50", p50(&lib.fork));
        self.pair("fork_lib_ms_p90", p90(&lib.fork));
        self.pair("fork_api_ms_p50", p50(&http.fork));
        self.pair("fork_api_ms_p90", p90(&http.fork));
        self.pair("fork_api_idem_ms_p50", p50(&idem.fork));
        self.pair("fork_api_minus_lib_ms_p50", d50);
        self.pair("fork_api_minus_lib_paired_ms_p50", dpair);
        self.pair("fork_api_added_ms_p50", dout);
        self.pair("fork_api_idem_added_ms_p50", dout_idem);
        self.pair("rm_lib_ms_p50", p50(&lib.rm));
        self.pair("rm_api_ms_p50", p50(&http.rm));
        self.pair("rm_api_minus_lib_ms_p50", p50(&http.rm) - p50(&lib.rm));
        Ok(())
    }

    /// Phase 2.
    fn console(&mut self) -> anyhow::Result<()> {
        let n = self.opts.pings;
        let api = &self.tined.api;
        let log_a = self.engine.home.join("vms/pa/console.log");
        let tine = self.bins.join("tine");
        let cli = |args: &[&str]| -> anyhow::Result<Vec<u8>> {
            // Done when its output ends (it exited): its status comes
            // through this process's reaper, which polls every 20 ms, and
            // waiting for it would time the reaper, not the CLI. An error
            // is what it prints on stderr.
            let mut child = Command::new(&tine)
                .args(args)
                .env("TINE_HOME", &self.home_b)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()?;
            let (mut out, mut err) = (Vec::new(), Vec::new());
            child
                .stdout
                .take()
                .context("stdout")?
                .read_to_end(&mut out)?;
            child
                .stderr
                .take()
                .context("stderr")?
                .read_to_end(&mut err)?;
            // Reaped by the reaper.
            std::mem::forget(child);
            if !err.is_empty() {
                bail!("tine {args:?}: {}", String::from_utf8_lossy(&err));
            }
            Ok(out)
        };
        let get_log = || -> anyhow::Result<Vec<u8>> { Ok(api.get("/v1/vms/pb/console")?.body) };
        let (mut lib, mut http, mut follow, mut cmd) = (vec![], vec![], vec![], vec![]);
        let (mut http_send, mut cmd_send) = (vec![], vec![]);
        // The follow stream: a reader thread counts PONGs as they come.
        let seen = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut stream = UnixStream::connect(&api.sock)?;
        stream.write_all(b"GET /v1/vms/pb/console?follow=true HTTP/1.1\r\nhost: tined\r\n\r\n")?;
        let reader = {
            let seen = seen.clone();
            let mut s = stream.try_clone()?;
            std::thread::spawn(move || {
                // The stream so far, and its body without the chunk
                // framing (a guest writes a byte at a time: a PONG may
                // come in several chunks).
                let (mut raw, mut body) = (Vec::<u8>::new(), Vec::<u8>::new());
                let mut pos = None;
                let mut buf = [0u8; 4096];
                while let Ok(k) = s.read(&mut buf) {
                    if k == 0 {
                        break;
                    }
                    raw.extend_from_slice(&buf[..k]);
                    if pos.is_none() {
                        pos = raw.windows(4).position(|w| w == b"\r\n\r\n").map(|e| e + 4);
                    }
                    let Some(p) = pos.as_mut() else { continue };
                    // Whole chunks from `p` on.
                    while let Some(nl) = raw[*p..].windows(2).position(|w| w == b"\r\n") {
                        let Ok(size) = usize::from_str_radix(
                            String::from_utf8_lossy(&raw[*p..*p + nl]).trim(),
                            16,
                        ) else {
                            break;
                        };
                        let start = *p + nl + 2;
                        if raw.len() < start + size + 2 {
                            break;
                        }
                        body.extend_from_slice(&raw[start..start + size]);
                        *p = start + size + 2;
                    }
                    seen.store(pongs(&body), Ordering::SeqCst);
                }
            })
        };
        // Let the stream catch up with what is there.
        std::thread::sleep(Duration::from_millis(300));
        for _ in 0..n {
            if stopped() {
                break;
            }
            // Engine: send, read the log file until the PONG shows.
            let before = pongs(&std::fs::read(&log_a)?);
            let t = Instant::now();
            host::vm::console_send(&self.engine, "pa", "ping")
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            wait_count(|| Ok(pongs(&std::fs::read(&log_a)?)), before + 1, 200).context("engine")?;
            lib.push(ms(t.elapsed()));
            // API: POST, then GET the log until it shows.
            let before = pongs(&get_log()?);
            let t = Instant::now();
            api.post("/v1/vms/pb/console", &serde_json::json!({"line": "ping"}))?;
            http_send.push(ms(t.elapsed()));
            wait_count(|| Ok(pongs(&get_log()?)), before + 1, 200).context("API")?;
            http.push(ms(t.elapsed()));
            // API with the follow stream open.
            std::thread::sleep(Duration::from_millis(150));
            let before = seen.load(Ordering::SeqCst);
            let t = Instant::now();
            api.post("/v1/vms/pb/console", &serde_json::json!({"line": "ping"}))?;
            wait_count(|| Ok(seen.load(Ordering::SeqCst)), before + 1, 100)
                .context("API follow")?;
            follow.push(ms(t.elapsed()));
            std::thread::sleep(Duration::from_millis(150));
            // CLI.
            let before = pongs(&cli(&["console", "pb"])?);
            let t = Instant::now();
            cli(&["console", "pb", "--send", "ping"])?;
            cmd_send.push(ms(t.elapsed()));
            wait_count(|| Ok(pongs(&cli(&["console", "pb"])?)), before + 1, 0).context("CLI")?;
            cmd.push(ms(t.elapsed()));
        }
        let _ = stream.shutdown(std::net::Shutdown::Both);
        let _ = reader.join();
        println!(
            "== 2. console round trip: `ping` typed in -> `PONG` in the console log ({n} each)"
        );
        println!("   engine (console_send, read the log)      {}", show(&lib));
        println!(
            "   API (POST console, GET console polled)   {}",
            show(&http)
        );
        println!(
            "     of which the POST                      {}",
            show(&http_send)
        );
        println!(
            "   API (POST console, GET ?follow=true)     {}",
            show(&follow)
        );
        println!("   CLI (tine console --send, tine console)  {}", show(&cmd));
        println!(
            "     of which `tine console --send`         {}",
            show(&cmd_send)
        );
        println!("   exec: micro guests have no agent; exec of a Linux guest needs the nested test host here (not measured)");
        self.pair("console_lib_ms_p50", p50(&lib));
        self.pair("console_api_ms_p50", p50(&http));
        self.pair("console_api_send_ms_p50", p50(&http_send));
        self.pair("console_api_follow_ms_p50", p50(&follow));
        self.pair("console_cli_ms_p50", p50(&cmd));
        self.pair("console_cli_send_ms_p50", p50(&cmd_send));
        Ok(())
    }

    /// A sample of what the sustained phase watches.
    fn sample(&self, parent_pid: u32) -> anyhow::Result<Sample> {
        let chain = self.tined.api.get("/v1/vms/pb/disks")?.json()?;
        let depth = chain[0].as_array().map(Vec::len).unwrap_or(0);
        let (disk, files) = disk_use(&self.home_b);
        let count = |d: &str| {
            std::fs::read_dir(self.home_b.join(d))
                .map(|r| r.count())
                .unwrap_or(0)
        };
        Ok(Sample {
            tined_rss_mib: self.tined_rss_mib(),
            tined_fds: fd_count(self.tined.pid),
            tined_threads: status_field(self.tined.pid, "Threads:").unwrap_or(0),
            vmm_rss_mib: status_field(parent_pid, "VmRSS:").unwrap_or(0) as f64 / 1024.0,
            disk_mib: disk as f64 / (1 << 20) as f64,
            files,
            depth,
            vms: count("vms"),
            layers: count("layers"),
            intents: count("intents"),
        })
    }

    /// Phase 3.
    fn sustained(&mut self) -> anyhow::Result<()> {
        let api = &self.tined.api;
        let info = api.get("/v1/vms/pb")?.json()?;
        let mut parent = info["pid"].as_u64().context("pid")? as u32;
        let start = self.sample(parent)?;
        let secs = self.opts.secs;
        println!("== 3. sustained: fork pb into one child and rm it through the API, as fast as it goes, {secs} s");
        println!("   start: {start}");
        let (mut fork, mut rm) = (Vec::new(), Vec::new());
        let t0 = Instant::now();
        let mut window = (Instant::now(), 0usize);
        let mut rates = Vec::new();
        let mut failures = 0usize;
        while t0.elapsed() < Duration::from_secs(secs) && !stopped() {
            let t = Instant::now();
            let r = api
                .post("/v1/vms/pb/fork", &serde_json::json!({"count": 1}))
                .and_then(|r| r.json());
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    failures += 1;
                    eprintln!("   fork failed: {e:#}");
                    if failures > 10 {
                        bail!("more than 10 forks failed");
                    }
                    continue;
                }
            };
            fork.push(ms(t.elapsed()));
            if let Some(p) = r["continuation_pid"].as_u64() {
                parent = p as u32;
            }
            let child = r["names"][0].as_str().context("names")?.to_string();
            let t = Instant::now();
            api.delete(&format!("/v1/vms/{child}?force=true"))?;
            rm.push(ms(t.elapsed()));
            window.1 += 1;
            if window.0.elapsed() >= WINDOW {
                let rate = window.1 as f64 / window.0.elapsed().as_secs_f64();
                rates.push(rate);
                println!(
                    "   t={:4.0} s: {rate:5.1} forks/s  {}",
                    t0.elapsed().as_secs_f64(),
                    self.sample(parent)?
                );
                window = (Instant::now(), 0);
            }
        }
        let elapsed = t0.elapsed().as_secs_f64();
        let total = fork.len();
        let rate = total as f64 / elapsed;
        let end = self.sample(parent)?;
        std::thread::sleep(Duration::from_secs(3));
        let settled = self.sample(parent)?;
        println!("   {total} fork+rm cycles in {elapsed:.1} s: {rate:.1} forks/s (target >= 10/s); failures {failures}");
        if !rates.is_empty() {
            println!(
                "   per {} s window: min {:.1}, p50 {:.1}, max {:.1} forks/s",
                WINDOW.as_secs(),
                sorted(&rates)[0],
                p50(&rates),
                sorted(&rates)[rates.len() - 1]
            );
        }
        println!("   fork {}", show(&fork));
        println!("   rm   {}", show(&rm));
        println!("   end:       {end}");
        println!("   end + 3 s: {settled}");
        println!(
            "   largest files in the home at the end: {}",
            largest_files(&self.home_b, 4)
        );
        self.pair("sustained_secs", elapsed);
        self.pair("sustained_forks", total as f64);
        self.pair("sustained_forks_per_s", rate);
        self.pair("sustained_fork_ms_p50", p50(&fork));
        self.pair("sustained_rm_ms_p50", p50(&rm));
        self.pair("sustained_tined_rss_mib_start", start.tined_rss_mib);
        self.pair("sustained_tined_rss_mib_end", settled.tined_rss_mib);
        self.pair("sustained_tined_fds_start", start.tined_fds as f64);
        self.pair("sustained_tined_fds_end", settled.tined_fds as f64);
        self.pair("sustained_vmm_rss_mib_start", start.vmm_rss_mib);
        self.pair("sustained_vmm_rss_mib_end", settled.vmm_rss_mib);
        self.pair("sustained_home_mib_start", start.disk_mib);
        self.pair("sustained_home_mib_end", settled.disk_mib);
        self.pair("sustained_home_files_start", start.files as f64);
        self.pair("sustained_home_files_end", settled.files as f64);
        self.pair("sustained_chain_depth_start", start.depth as f64);
        self.pair("sustained_chain_depth_end", settled.depth as f64);
        Ok(())
    }

    /// Phase 4 (idle RSS is measured by the caller).
    fn many(&mut self) -> anyhow::Result<()> {
        let n = self.opts.vms;
        let api = &self.tined.api;
        let before = self.tined_rss_mib();
        let avail0 = mem_available_mib();
        let mut start = Vec::new();
        let mut started = Vec::new();
        let res = (|| -> anyhow::Result<()> {
            for i in 0..n {
                if stopped() {
                    bail!("interrupted");
                }
                let name = format!("m{i}");
                let t = Instant::now();
                api.post("/v1/vms", &spec_json(&run_spec(&name, MANY_MIB, None))?)?;
                start.push(ms(t.elapsed()));
                started.push(name);
            }
            Ok(())
        })();
        std::thread::sleep(Duration::from_secs(2));
        let running = self.tined_rss_mib();
        let fds = fd_count(self.tined.pid);
        let threads = status_field(self.tined.pid, "Threads:").unwrap_or(0);
        let mut list = Vec::new();
        let mut metrics = Vec::new();
        let mut listed = 0;
        for _ in 0..20 {
            let t = Instant::now();
            let l = api.get("/v1/vms")?.json()?;
            list.push(ms(t.elapsed()));
            listed = l.as_array().map(Vec::len).unwrap_or(0);
            let t = Instant::now();
            api.get("/metrics")?;
            metrics.push(ms(t.elapsed()));
        }
        let after_list = self.tined_rss_mib();
        let vmm_rss: f64 = api
            .get("/v1/vms")?
            .json()?
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|v| v["pid"].as_u64())
                    .filter_map(|p| status_field(p as u32, "VmRSS:"))
                    .sum::<u64>() as f64
                    / 1024.0
            })
            .unwrap_or(0.0);
        let avail1 = mem_available_mib();
        let mut rm = Vec::new();
        for name in &started {
            let t = Instant::now();
            api.delete(&format!("/v1/vms/{name}?force=true"))?;
            rm.push(ms(t.elapsed()));
        }
        std::thread::sleep(Duration::from_secs(2));
        let after = self.tined_rss_mib();
        res?;
        println!("== 4. tined with {n} {IMAGE} vms of {MANY_MIB} MiB running (started one after another through the API)");
        println!("   start (POST /v1/vms)      {}", show(&start));
        println!("   GET /v1/vms ({listed} vms)   {}", show(&list));
        println!("   GET /metrics             {}", show(&metrics));
        println!("   rm (DELETE ?force=true)  {}", show(&rm));
        println!(
            "   tined RSS: {before:.1} MiB before, {running:.1} MiB with {n} running ({fds} fds, {threads} threads), {after_list:.1} MiB after 20 lists, {after:.1} MiB after all were removed"
        );
        println!(
            "   the {n} VMMs' RSS together: {vmm_rss:.0} MiB; MemAvailable dropped {:.0} MiB",
            avail0 - avail1
        );
        self.pair("many_vms", n as f64);
        self.pair("many_start_ms_p50", p50(&start));
        self.pair("many_list_ms_p50", p50(&list));
        self.pair("tined_rss_mib_many", running);
        self.pair("tined_rss_mib_many_after_rm", after);
        self.pair("tined_fds_many", fds as f64);
        self.pair("many_vmm_rss_mib_total", vmm_rss);
        Ok(())
    }

    /// Removes every vm of both homes, stops tined and the gateways,
    /// ends anything left, removes the scratch directory.
    fn cleanup(&self) {
        if let Ok(vms) = host::vm::list(&self.engine) {
            for v in vms {
                let _ = host::vm::remove(&self.engine, &v.name, true);
            }
        }
        let _ = host::gateway::stop(&self.engine);
        if let Ok(l) = self.tined.api.get("/v1/vms").and_then(|r| r.json()) {
            for v in l.as_array().into_iter().flatten() {
                if let Some(n) = v["name"].as_str() {
                    let _ = self.tined.api.delete(&format!("/v1/vms/{n}?force=true"));
                }
            }
        }
        let _ = self
            .tined
            .api
            .post("/v1/gateway", &serde_json::json!({"action": "stop"}));
        let _ = self.tined.api.post("/v1/shutdown", &serde_json::json!({}));
        if let Some((_, t)) = &self.baseline {
            for n in ["pc-1", "pc"] {
                let _ = t.api.delete(&format!("/v1/vms/{n}?force=true"));
            }
            let _ = t.api.post("/v1/shutdown", &serde_json::json!({}));
        }
        std::thread::sleep(Duration::from_millis(500));
        let mut homes = vec![&self.engine.home, &self.home_b];
        homes.extend(self.baseline.as_ref().map(|b| &b.0));
        for home in homes {
            for p in host::proc::vmm_processes("tine-vmm", home) {
                // SAFETY: kill(2) of a VMM of this bench's own home.
                unsafe { libc::kill(p.pid as i32, libc::SIGKILL) };
            }
        }
        let mut pids = vec![self.tined.pid];
        pids.extend(self.baseline.as_ref().map(|b| b.1.pid));
        for pid in pids {
            if Path::new(&format!("/proc/{pid}")).exists() {
                // SAFETY: kill(2) of a tined this bench started.
                unsafe { libc::kill(pid as i32, libc::SIGTERM) };
            }
        }
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

/// One variant's numbers in phase 1.
#[derive(Default)]
struct Series {
    fork: Vec<f64>,
    rm: Vec<f64>,
    /// wall - the report's total_ms.
    outside: Vec<f64>,
    engine_total: Vec<f64>,
    /// From Server-Timing: fork and rm in the engine (in tined), and the
    /// wall time outside it: in tined, and in all.
    fork_engine: Vec<f64>,
    fork_tined: Vec<f64>,
    fork_added: Vec<f64>,
    /// wall - tined's handler time: connection, HTTP, wake-ups.
    fork_transport: Vec<f64>,
    /// CPU ms of the fork call: this thread's (in-process) or tined's
    /// (all its threads, through the API).
    fork_cpu: Vec<f64>,
    rm_engine: Vec<f64>,
    rm_added: Vec<f64>,
}

/// Fork `parent` into one child through `api` (served by process
/// `tined`), then remove the child.
fn api_cycle(
    api: &Api,
    tined: u32,
    parent: &str,
    headers: &[(&str, &str)],
    s: &mut Series,
) -> anyhow::Result<()> {
    let cpu = proc_cpu_ns(tined);
    let t = Instant::now();
    let resp = api
        .request(
            "POST",
            &format!("/v1/vms/{parent}/fork"),
            Some(&serde_json::json!({"count": 1})),
            headers,
        )?
        .ok("fork")?;
    let w = ms(t.elapsed());
    s.fork_cpu
        .push(proc_cpu_ns(tined).saturating_sub(cpu) as f64 / 1e6);
    let r = resp.json()?;
    if let Some((engine, handler)) = resp.timing {
        s.fork_engine.push(engine);
        s.fork_tined.push(handler - engine);
        s.fork_added.push(w - engine);
        s.fork_transport.push(w - handler);
    }
    let total = r["total_ms"].as_f64().context("total_ms")?;
    s.fork.push(w);
    s.outside.push(w - total);
    s.engine_total.push(total);
    let child = r["names"][0].as_str().context("names")?.to_string();
    let t = Instant::now();
    let resp = api.delete(&format!("/v1/vms/{child}?force=true"))?;
    let w = ms(t.elapsed());
    s.rm.push(w);
    if let Some((engine, _)) = resp.timing {
        s.rm_engine.push(engine);
        s.rm_added.push(w - engine);
    }
    Ok(())
}

fn paired_sum(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

/// Waits until `count()` reaches `want`, pausing `pause_us` between tries.
fn wait_count(
    mut count: impl FnMut() -> anyhow::Result<usize>,
    want: usize,
    pause_us: u64,
) -> anyhow::Result<()> {
    let t0 = Instant::now();
    while count()? < want {
        if t0.elapsed() > Duration::from_secs(10) || stopped() {
            bail!("the PONG never came");
        }
        if pause_us > 0 {
            std::thread::sleep(Duration::from_micros(pause_us));
        }
    }
    Ok(())
}

struct Sample {
    tined_rss_mib: f64,
    tined_fds: usize,
    tined_threads: u64,
    vmm_rss_mib: f64,
    disk_mib: f64,
    files: u64,
    depth: usize,
    vms: usize,
    layers: usize,
    intents: usize,
}

impl std::fmt::Display for Sample {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tined RSS {:.1} MiB, {} fds, {} threads; parent VMM RSS {:.1} MiB; home {:.1} MiB in {} files (vms {}, layers {}, intents {}); chain depth {}",
            self.tined_rss_mib,
            self.tined_fds,
            self.tined_threads,
            self.vmm_rss_mib,
            self.disk_mib,
            self.files,
            self.vms,
            self.layers,
            self.intents,
            self.depth
        )
    }
}

fn main() -> std::process::ExitCode {
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench/api: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let opts = Opts::parse()?;
    if !Path::new("/dev/kvm").exists() {
        bail!("/dev/kvm is missing");
    }
    // SAFETY: installs a handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    let bins = bin_dir()?;
    let scratch = std::env::temp_dir().join(format!("tine-bench-api-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch)?;
    let home_a = new_home(&scratch, "a")?;
    let home_b = new_home(&scratch, "b")?;
    let base = scratch.join("base.raw");
    std::fs::File::create(&base)?.set_len(64 << 20)?;
    // In this process the engine runs as in tined: with a subreaper.
    host::proc::Reaper::install(|_, _| {}).map_err(|e| anyhow::anyhow!("{e}"))?;
    let engine = host::Host::new(
        home_a,
        host::Binaries {
            vmm: bins.join("tine-vmm"),
            gateway: bins.join("tine-gateway"),
        },
    );
    let tined = start_tined(&bins.join("tined"), &bins, &home_b)?;
    let baseline = match &opts.baseline {
        Some(bin) => {
            let home_c = new_home(&scratch, "c")?;
            match start_tined(bin, &bins, &home_c) {
                Ok(t) => Some((home_c, t)),
                Err(e) => {
                    // SAFETY: kill(2) of the tined this bench started.
                    unsafe { libc::kill(tined.pid as i32, libc::SIGTERM) };
                    let _ = std::fs::remove_dir_all(&scratch);
                    return Err(e);
                }
            }
        }
        None => None,
    };
    let mut b = Bench {
        opts,
        bins,
        scratch,
        engine,
        home_b,
        tined,
        baseline,
        base,
        pairs: Vec::new(),
    };
    let res = phases(&mut b);
    b.cleanup();
    res?;
    println!("{}", b.pairs.join(" "));
    Ok(())
}

fn phases(b: &mut Bench) -> anyhow::Result<()> {
    let idle = b.tined_rss_mib();
    println!(
        "tined pid {}: idle RSS {idle:.1} MiB, {} fds, {} threads (fresh, no vm)",
        b.tined.pid,
        fd_count(b.tined.pid),
        status_field(b.tined.pid, "Threads:").unwrap_or(0)
    );
    b.pair("tined_rss_mib_idle", idle);
    b.start_parents()?;
    if b.opts.wants("overhead") {
        b.overhead()?;
    }
    if b.opts.wants("console") {
        b.console()?;
    }
    if b.opts.wants("sustained") {
        b.sustained()?;
    }
    // Idle again: only the parent left.
    std::thread::sleep(Duration::from_secs(1));
    let idle2 = b.tined_rss_mib();
    println!("tined idle RSS after the phases above: {idle2:.1} MiB (one vm running)");
    b.pair("tined_rss_mib_idle_after", idle2);
    if b.opts.wants("many") {
        b.many()?;
    }
    Ok(())
}
