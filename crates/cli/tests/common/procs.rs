//! What the processes of one home are, from /proc, and whether `tine ls`
//! agrees with them (crash.rs, soak.rs).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::Home;

/// A live `tine-vmm` process of a home.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmmProc {
    pub pid: u32,
    pub ppid: u32,
    /// The vm it runs (`tine-vmm NAME`), or `NAME@TAG` for a checkpoint
    /// template (`tine-vmm NAME (checkpoint TAG)`).
    pub name: String,
}

/// State letter and parent of a process (None: gone).
pub fn stat(pid: u32) -> Option<(char, u32)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = s.get(s.rfind(')')? + 1..)?;
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    Some((state, ppid))
}

fn pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The canonical path tined and its VMMs know a home by.
pub fn canonical(h: &Home) -> PathBuf {
    std::fs::canonicalize(h.0.path()).unwrap_or_else(|_| h.0.path().to_path_buf())
}

/// Whether `pid`'s environment has `TINE_HOME=home`.
fn of_home(pid: u32, home: &Path) -> bool {
    let want = format!("TINE_HOME={}", home.display()).into_bytes();
    std::fs::read(format!("/proc/{pid}/environ"))
        .is_ok_and(|env| env.split(|b| *b == 0).any(|kv| kv == want.as_slice()))
}

/// Every live (not exited) `tine-vmm` process whose environment names
/// `home` as its TINE_HOME, by its command line (`tine-vmm NAME ...`).
pub fn vmm_procs(home: &Path) -> Vec<VmmProc> {
    let mut out = Vec::new();
    for pid in pids() {
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmd
            .split(|b| *b == 0)
            .filter(|a| !a.is_empty())
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let is_vmm = args
            .first()
            .and_then(|a| Path::new(a).file_name())
            .is_some_and(|n| n == "tine-vmm");
        if !is_vmm || !of_home(pid, home) {
            continue;
        }
        let Some((state, ppid)) = stat(pid) else {
            continue;
        };
        if matches!(state, 'Z' | 'X') {
            continue;
        }
        let mut name = args.get(1).cloned().unwrap_or_default();
        if let Some(tag) = args
            .get(2)
            .and_then(|d| d.strip_prefix("(checkpoint "))
            .and_then(|d| d.strip_suffix(')'))
        {
            name = format!("{name}@{tag}");
        }
        out.push(VmmProc { pid, ppid, name });
    }
    out.sort_by_key(|p| p.pid);
    out
}

/// tined's pid for this home, if one runs.
pub fn tined_pid(h: &Home) -> Option<u32> {
    let pid: u32 = std::fs::read_to_string(h.0.path().join("tined.pid"))
        .ok()?
        .trim()
        .parse()
        .ok()?;
    let (state, _) = stat(pid)?;
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let is_tined = cmd
        .split(|b| *b == 0)
        .next()
        .and_then(|a| Path::new(std::str::from_utf8(a).ok()?).file_name())
        .is_some_and(|n| n == "tined");
    (is_tined && !matches!(state, 'Z' | 'X')).then_some(pid)
}

/// `GET /v1/health` of the home's tined straight over its socket (None:
/// none answers).
pub fn health(h: &Home) -> Option<serde_json::Value> {
    let mut s = std::os::unix::net::UnixStream::connect(h.0.path().join("tined.sock")).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(b"GET /v1/health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let body = text.split_once("\r\n\r\n")?.1;
    serde_json::from_str(body).ok()
}

/// Waits until tined runs no engine call and no operation (what a killed
/// client left running finishes in tined), or no tined runs.
pub fn quiesce(h: &Home) {
    // A request its killed client wrote reaches the handler by now.
    std::thread::sleep(Duration::from_millis(20));
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut idle = 0;
    while idle < 2 {
        let busy = health(h).is_some_and(|v| {
            v["operations_running"].as_u64().unwrap_or(0) > 0
                || v["engine_calls_running"].as_u64().unwrap_or(0) > 0
        });
        idle = if busy { 0 } else { idle + 1 };
        assert!(
            Instant::now() < deadline,
            "tined stayed busy for 120 s: {:?}",
            health(h)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What disagrees between `ls` rows and the home's VMM processes: a row
/// running (or a checkpoint) without its process, a process no row shows.
pub fn disagreements(rows: &[serde_json::Value], procs: &[VmmProc]) -> Vec<String> {
    let mut out = Vec::new();
    for r in rows {
        let name = r["name"].as_str().unwrap_or_default();
        match r["state"].as_str().unwrap_or_default() {
            "running" => {
                let pid = r["pid"].as_u64().and_then(|p| u32::try_from(p).ok());
                if !procs.iter().any(|p| Some(p.pid) == pid && p.name == name) {
                    out.push(format!(
                        "{name} is listed running (pid {pid:?}) but no such tine-vmm {name} runs"
                    ));
                }
            }
            "checkpoint" if !procs.iter().any(|p| p.name == name) => {
                out.push(format!(
                    "checkpoint {name} is listed but no template process runs"
                ));
            }
            _ => {}
        }
    }
    for p in procs {
        let shown = rows.iter().any(|r| {
            let name = r["name"].as_str().unwrap_or_default();
            match r["state"].as_str().unwrap_or_default() {
                "running" => name == p.name && r["pid"].as_u64() == Some(u64::from(p.pid)),
                "checkpoint" => name == p.name,
                _ => false,
            }
        });
        if !shown {
            out.push(format!(
                "tine-vmm {} (pid {}, parent {}) runs but ls does not show it",
                p.name, p.pid, p.ppid
            ));
        }
    }
    out
}

/// `ls --json` once tined is idle, checked against the processes: every
/// running vm and checkpoint it lists has its live `tine-vmm`, and every
/// live `tine-vmm` of the home is listed. A process on its way out (the
/// old VMM after a handoff) gets `settle` to go. Returns the rows.
pub fn ls_tells_the_truth(h: &Home, what: &str, settle: Duration) -> Vec<serde_json::Value> {
    quiesce(h);
    let home = canonical(h);
    let deadline = Instant::now() + settle;
    loop {
        let rows = h.ls();
        let procs = vmm_procs(&home);
        let mut bad = disagreements(&rows, &procs);
        // tined is idle (or was just started, and reconciled): no
        // operation is unfinished.
        let intents = entries(&h.0.path().join("intents"));
        if !intents.is_empty() {
            bad.push(format!("intents left unsettled: {intents:?}"));
        }
        if bad.is_empty() {
            return rows;
        }
        if Instant::now() > deadline {
            let log = super::file_tail(&h.0.path().join("tined.log"), 60);
            panic!(
                "{what}: ls does not tell the truth:\n  {}\nrows: {}\nprocesses: {procs:#?}\n{log}",
                bad.join("\n  "),
                serde_json::to_string_pretty(&rows).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// The names in a directory (none if it is missing).
pub fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Removes every vm and branch `ls` shows; then no process of the home may
/// remain, nor a vm directory, an intent, a staged snapshot, or (once `gc`
/// ran) a frozen layer; and tined's log shows no panic.
pub fn rm_everything_leaves_no_process(h: &Home, what: &str) {
    for r in h.ls() {
        let name = r["name"].as_str().unwrap_or_default().to_string();
        match r["state"].as_str().unwrap_or_default() {
            "checkpoint" => {}
            "sleeping" => {
                h.ok(&["rm", &name]);
            }
            _ => {
                h.ok(&["rm", "--force", &name]);
            }
        }
    }
    let rows = h.ls();
    assert!(rows.is_empty(), "{what}: rm left rows: {rows:?}");
    let home = canonical(h);
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = vmm_procs(&home);
        if left.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: after rm of everything these processes run: {left:#?}"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
    h.ok(&["gc"]);
    let root = h.0.path();
    for (dir, left) in [
        ("vms", entries(&root.join("vms"))),
        ("intents", entries(&root.join("intents"))),
        ("store/staging", entries(&root.join("store/staging"))),
        ("store/wake", entries(&root.join("store/wake"))),
        ("layers", entries(&root.join("layers"))),
        // Trees: every vm directory and frozen layer gone, so their
        // directories too.
        ("t", entries(&root.join("t"))),
    ] {
        // What each leftover holds says who made it.
        let inside: Vec<String> = left
            .iter()
            .map(|e| format!("{e}: {:?}", entries(&root.join(dir).join(e))))
            .collect();
        assert!(
            left.is_empty(),
            "{what}: {dir}/ holds {inside:?} after rm of everything and gc"
        );
    }
    let log = std::fs::read_to_string(root.join("tined.log")).unwrap_or_default();
    assert!(
        !log.contains("panicked"),
        "{what}: tined panicked:\n{}",
        super::file_tail(&root.join("tined.log"), 80)
    );
}

/// Zombies among the children of `parents`.
pub fn zombies_of(parents: &[u32]) -> Vec<u32> {
    pids()
        .into_iter()
        .filter(|&p| stat(p).is_some_and(|(s, pp)| s == 'Z' && parents.contains(&pp)))
        .collect()
}

/// Open fds of a process.
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Resident memory of a process in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// Bytes allocated under `dir` (symlinks not followed).
pub fn disk_use(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let Ok(m) = e.path().symlink_metadata() else {
                continue;
            };
            if m.is_dir() {
                stack.push(e.path());
            } else {
                total += m.blocks() * 512;
            }
        }
    }
    total
}

/// The directory of the group that counts `pid`'s processes (the pids
/// controller's: v1 on this machine, v2 in the nested test host).
pub fn pids_group(pid: u32) -> PathBuf {
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup");
    for l in cg.lines() {
        let mut f = l.splitn(3, ':');
        let (_, ctrl, path) = (f.next(), f.next().unwrap_or(""), f.next().unwrap_or(""));
        if ctrl.split(',').any(|c| c == "pids") {
            return Path::new("/sys/fs/cgroup/pids").join(path.trim_start_matches('/'));
        }
    }
    let path = cg
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .expect("a cgroup v2 line");
    Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'))
}
