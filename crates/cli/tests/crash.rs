//! Crashes at every moment of the lifecycle verbs, with micro guests on
//! this machine's /dev/kvm.
//!
//! - kill -9 of the client (`tine`) and, separately, of the vm's VMM at
//!   spread moments 0-50 ms into fork (-n 3), snapshot, checkpoint,
//!   rollback, sleep and wake, 20 times each (seeded; the seed and the
//!   delays are printed);
//! - kill -9 of tined at named points (`TINE_HOST_FAULT`, crates/host
//!   fault.rs) and at spread moments of a fork, a sleep and a wake: the
//!   VMMs survive and the next command's tined adopts them;
//! - two clients at once: fork/fork, fork/rm, run/run of one name.
//!
//! After each crash: once tined is idle, `ls --json` tells the truth (every
//! running vm and checkpoint it lists has its live `tine-vmm`, every live
//! `tine-vmm` of the home is listed), every vm it shows running answers,
//! nothing half-done shows as done and nothing committed is lost (memory
//! checksums). At the end: the last committed snapshot wakes, `store
//! verify` passes, and `rm` of everything leaves no process.
//!
//! `TINE_CRASH_ROUNDS` overrides the rounds per case (default 20),
//! `TINE_CRASH_SEED` mixes into every case's seed (other moments).

mod common;

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::procs::{self, ls_tells_the_truth, vmm_procs};
use common::{kvm_available, progress, Home, TempDir};

/// A process on its way out (the old VMM after a handoff) may take this
/// long to be gone.
const SETTLE: Duration = Duration::from_secs(3);
/// A command interrupted by a crash must still end within this.
const CALL_LIMIT: Duration = Duration::from_secs(60);

fn rounds() -> usize {
    std::env::var("TINE_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
}

/// xorshift64*: the delays of one case from its seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed | 1)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// A case's seed: from its name, and `TINE_CRASH_SEED` if set (to try
/// other moments than CI's).
fn seed_of(what: &str) -> u64 {
    let extra = std::env::var("TINE_CRASH_SEED").unwrap_or_default();
    let h = blake3::hash(format!("{what}{extra}").as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&h.as_bytes()[..8]);
    u64::from_le_bytes(b)
}

fn console(h: &Home, vm: &str) -> String {
    std::fs::read_to_string(h.0.path().join("vms").join(vm).join("console.log")).unwrap_or_default()
}

/// Sends each `(vm, command)` to its memtouch guest at once, then waits for
/// each reply line starting with `reply`; returns their last words.
fn ask_all(h: &Home, asks: &[(&str, String)], reply: &str) -> Vec<String> {
    let from: Vec<usize> = asks.iter().map(|(vm, _)| console(h, vm).len()).collect();
    for (vm, cmd) in asks {
        h.ok(&["console", vm, "--send", cmd]);
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    asks.iter()
        .zip(from)
        .map(|((vm, cmd), from)| loop {
            let text = console(h, vm);
            let done = text.rfind('\n').map(|i| i + 1).unwrap_or(0);
            if let Some(l) = text
                .get(from..done)
                .unwrap_or("")
                .lines()
                .find(|l| l.starts_with(reply))
            {
                break l.split_whitespace().last().unwrap_or("").to_string();
            }
            assert!(
                Instant::now() < deadline,
                "{vm} did not answer {cmd:?} (it is listed running); console:\n{}",
                text.get(from..).unwrap_or("")
            );
            std::thread::sleep(Duration::from_millis(5));
        })
        .collect()
}

/// The checksum of memtouch `vm`'s first MiB.
fn sum(h: &Home, vm: &str) -> String {
    ask_all(h, &[(vm, "sum 1".into())], "SUM").remove(0)
}

/// Writes memtouch `vm`'s first MiB with `seed`; its checksum.
fn touch(h: &Home, vm: &str, seed: usize) -> String {
    ask_all(h, &[(vm, format!("touch 1 {seed}"))], "TOUCHED").remove(0)
}

fn name_of(r: &serde_json::Value) -> &str {
    r["name"].as_str().unwrap_or_default()
}

fn state_of<'a>(rows: &'a [serde_json::Value], name: &str) -> Option<&'a str> {
    rows.iter()
        .find(|r| name_of(r) == name)
        .and_then(|r| r["state"].as_str())
}

/// The state of branch `name` in `tine tree --json`: its live one
/// (running, sleeping), else `gone` if it had one, else empty.
fn branch_state(h: &Home, name: &str) -> String {
    let t: serde_json::Value = serde_json::from_str(&h.ok(&["tree", "--json"])).expect("tree");
    let states: Vec<&str> = t["branches"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["name"] == name)
        .filter_map(|b| b["state"].as_str())
        .collect();
    let live: Vec<&str> = states.iter().copied().filter(|s| *s != "gone").collect();
    assert!(live.len() <= 1, "two live branches named {name}: {t}");
    live.first()
        .or(states.first())
        .copied()
        .unwrap_or_default()
        .to_string()
}

/// Who is killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    /// The `tine` command.
    Cli,
    /// Every `tine-vmm v` process (the vm's VMM, and its continuation if
    /// it has one yet).
    Vmm,
    /// tined.
    Tined,
    /// Nobody (a crash point of its own ends the command).
    Nobody,
}

/// What one crashed command did.
struct Crashed {
    out: Output,
    /// Pids killed (empty: the target was not there at that moment).
    killed: Vec<u32>,
}

impl Crashed {
    fn ok(&self) -> bool {
        self.out.status.success()
    }
    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.out.stderr).into_owned()
    }
}

fn sigkill(pid: u32) {
    if let Ok(p) = libc::pid_t::try_from(pid) {
        // SAFETY: kill(2) with plain integers; the pid was read from /proc
        // a moment ago (a test home's process).
        unsafe {
            libc::kill(p, libc::SIGKILL);
        }
    }
}

/// One vm `v` (micro-memtouch, 64 MiB, a small raw disk) in a home of its
/// own, and the cases' bookkeeping.
struct Rig {
    h: Home,
    files: TempDir,
    disk: String,
    home: PathBuf,
}

impl Rig {
    fn new(tag: &str) -> Rig {
        let h = Home::new(tag);
        let files = TempDir::new(&format!("{tag}-files"));
        let disk = files.path().join("disk.raw");
        let f = std::fs::File::create(&disk).expect("disk");
        f.set_len(8 << 20).expect("disk size");
        let home = procs::canonical(&h);
        Rig {
            disk: disk.to_str().expect("utf8").to_string(),
            h,
            files,
            home,
        }
    }

    fn run(&self, name: &str) {
        self.h.ok(&[
            "run",
            "--name",
            name,
            "--image",
            "micro-memtouch",
            "--mem",
            "64M",
            "--disk",
            &self.disk,
        ]);
        ask_all(&self.h, &[(name, "ping".into())], "PONG");
    }

    fn rows(&self) -> Vec<serde_json::Value> {
        self.h.ls()
    }

    /// `v` runs (woken if it sleeps, started anew if it crashed).
    fn ensure_running(&self) {
        let rows = self.rows();
        let states: Vec<&str> = rows
            .iter()
            .filter(|r| name_of(r) == "v")
            .filter_map(|r| r["state"].as_str())
            .collect();
        match states.as_slice() {
            ["running"] => {}
            ["sleeping"] => {
                self.h.ok(&["wake", "v"]);
            }
            [] => self.run("v"),
            [_] => {
                self.h.ok(&["rm", "--force", "v"]);
                self.run("v");
            }
            more => panic!("ls shows v as {more:?}: {rows:?}"),
        }
    }

    /// `v` sleeps; the checksum of its first MiB in the snapshot.
    fn ensure_sleeping(&self, seed: usize) -> String {
        self.ensure_running();
        self.drop_checkpoints();
        let s = touch(&self.h, "v", seed);
        self.h.ok(&["sleep", "v"]);
        s
    }

    fn drop_checkpoints(&self) {
        for r in self.rows() {
            if r["state"] == "checkpoint" {
                self.h.ok(&["rm", name_of(&r)]);
            }
        }
    }

    /// Removes every vm but `v` (forks' children, restores).
    fn clear_others(&self) {
        for r in self.rows() {
            let n = name_of(&r);
            if n != "v" && r["state"] != "checkpoint" && !n.starts_with("v@") {
                if r["state"] == "sleeping" {
                    self.h.ok(&["rm", n]);
                } else {
                    self.h.ok(&["rm", "--force", n]);
                }
            }
        }
    }

    /// Runs `tine ARGS` and kills `target` `delay` into it (the VMM: as
    /// soon as one of `v` runs from then on, for a wake that starts it).
    fn crash(&self, args: &[&str], target: Target, delay: Duration) -> Crashed {
        self.crash_env(args, target, delay, &[])
    }

    fn crash_env(
        &self,
        args: &[&str],
        target: Target,
        delay: Duration,
        env: &[(&str, &str)],
    ) -> Crashed {
        let tined = procs::tined_pid(&self.h);
        let mut cmd = self.h.cmd(args);
        cmd.envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let mut child = cmd.spawn().expect("spawn tine");
        let t0 = Instant::now();
        std::thread::sleep(delay);
        let mut killed = Vec::new();
        match target {
            Target::Cli => {
                killed.push(child.id());
                let _ = child.kill();
            }
            Target::Vmm => loop {
                let of_v: Vec<u32> = vmm_procs(&self.home)
                    .into_iter()
                    .filter(|p| p.name == "v")
                    .map(|p| p.pid)
                    .collect();
                for &p in &of_v {
                    sigkill(p);
                }
                killed.extend(of_v);
                if !killed.is_empty()
                    || child.try_wait().ok().flatten().is_some()
                    || t0.elapsed() > delay + Duration::from_secs(5)
                {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            },
            Target::Tined => {
                if let Some(p) = tined {
                    sigkill(p);
                    killed.push(p);
                }
            }
            Target::Nobody => {}
        }
        let out = self.h.wait_within(child, args, CALL_LIMIT);
        Crashed { out, killed }
    }

    /// The last moment that must survive everything: `v` sleeps with a
    /// known first MiB and wakes with it; the store verifies; `rm` of
    /// everything leaves no process.
    fn finale(&self, what: &str) {
        self.clear_others();
        let s = self.ensure_sleeping(4242);
        ls_tells_the_truth(&self.h, &format!("{what}: finale"), SETTLE);
        self.h.ok(&["wake", "v"]);
        assert_eq!(sum(&self.h, "v"), s, "{what}: the last snapshot woke");
        let v = self.h.ok(&["store", "verify"]);
        assert!(v.contains("0 missing, 0 corrupt"), "{what}: {v}");
        // Snapshot directories written keep their frozen layers: without
        // them, nothing may be left.
        for e in std::fs::read_dir(self.files.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            if e.path().is_dir() {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
        procs::rm_everything_leaves_no_process(&self.h, what);
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verb {
    Fork,
    Snapshot,
    Checkpoint,
    Rollback,
    Sleep,
    Wake,
}

/// One case: `verb` crashed by killing `target`, `rounds()` times.
fn crash_case(verb: Verb, target: Target) {
    if !kvm_available() {
        return;
    }
    let what = format!("{verb:?} with {target:?} killed");
    let tag = format!("crash-{verb:?}-{target:?}").to_lowercase();
    let rig = Rig::new(&tag);
    let h = &rig.h;
    let seed = seed_of(&what);
    let mut rng = Rng::new(seed);
    let n = rounds();
    let t0 = Instant::now();
    let mut delays = Vec::new();
    let (mut ok, mut failed, mut no_target) = (0, 0, 0);
    // The checksum at the checkpoint `c` (rollback).
    let mut at_c: Option<String> = None;
    for i in 0..n {
        let delay = Duration::from_millis(rng.below(51));
        delays.push(delay.as_millis());
        let round = format!("{what}, round {i} ({} ms)", delay.as_millis());
        rig.ensure_running();
        let crashed = match verb {
            Verb::Fork => {
                let s = touch(h, "v", i);
                let c = rig.crash(&["fork", "v", "-n", "3"], target, delay);
                let rows = ls_tells_the_truth(h, &round, SETTLE);
                let children: Vec<&serde_json::Value> = rows
                    .iter()
                    .filter(|r| name_of(r).starts_with("v-"))
                    .collect();
                assert!(
                    children.is_empty() || children.len() == 3,
                    "{round}: a fork is whole or not at all: {rows:?}"
                );
                if c.ok() {
                    assert_eq!(children.len(), 3, "{round}: the fork succeeded: {rows:?}");
                }
                // Every child runs and continues from the moment of the fork.
                let asks: Vec<(&str, String)> = children
                    .iter()
                    .map(|r| {
                        assert_eq!(r["state"], "running", "{round}: {r}");
                        (name_of(r), "sum 1".to_string())
                    })
                    .collect();
                for (got, (child, _)) in ask_all(h, &asks, "SUM").iter().zip(&asks) {
                    assert_eq!(got, &s, "{round}: {child} continues from the fork");
                }
                if state_of(&rows, "v") == Some("running") {
                    assert_eq!(sum(h, "v"), s, "{round}: the parent goes on");
                }
                rig.clear_others();
                c
            }
            Verb::Snapshot => {
                let s = touch(h, "v", i);
                let dir = rig.files.path().join(format!("snap-{i}"));
                let c = rig.crash(
                    &["snapshot", "v", "--to", dir.to_str().expect("utf8")],
                    target,
                    delay,
                );
                let rows = ls_tells_the_truth(h, &round, SETTLE);
                let complete = dir.join("manifest.json").is_file();
                assert!(
                    !dir.exists() || complete,
                    "{round}: a snapshot directory without a manifest was left: {:?}",
                    std::fs::read_dir(&dir)
                        .map(|d| d.flatten().map(|e| e.file_name()).collect::<Vec<_>>())
                );
                if c.ok() {
                    assert!(complete, "{round}: the snapshot succeeded");
                }
                if state_of(&rows, "v") == Some("running") {
                    assert_eq!(sum(h, "v"), s, "{round}: the vm goes on");
                }
                // A complete snapshot restores with what it holds.
                if complete && (i % 4 == 0 || c.ok() && i % 4 == 1) {
                    h.ok(&["run", "--name", "r", "--from", dir.to_str().expect("utf8")]);
                    assert_eq!(sum(h, "r"), s, "{round}: the snapshot restores");
                    h.ok(&["rm", "--force", "r"]);
                }
                c
            }
            Verb::Checkpoint => {
                let s = touch(h, "v", i);
                let tag = format!("c{i}");
                let c = rig.crash(&["checkpoint", "v", "--tag", &tag], target, delay);
                let rows = ls_tells_the_truth(h, &round, SETTLE);
                let full = format!("v@{tag}");
                let listed = state_of(&rows, &full) == Some("checkpoint");
                if c.ok() {
                    assert!(listed, "{round}: the checkpoint succeeded: {rows:?}");
                }
                if state_of(&rows, "v") == Some("running") {
                    assert_eq!(sum(h, "v"), s, "{round}: the vm goes on");
                }
                // A listed checkpoint is one to return to (also from a vm
                // whose VMM was killed).
                if listed {
                    if state_of(&rows, "v") == Some("running") {
                        touch(h, "v", 9000 + i);
                    }
                    h.ok(&["rollback", "v", &tag]);
                    assert_eq!(sum(h, "v"), s, "{round}: rollback to the checkpoint");
                    h.ok(&["rm", &full]);
                }
                c
            }
            Verb::Rollback => {
                if state_of(&rig.rows(), "v@c") != Some("checkpoint") {
                    at_c = Some(touch(h, "v", 5000 + i));
                    h.ok(&["checkpoint", "v", "--tag", "c"]);
                }
                let Some(want) = at_c.clone() else {
                    unreachable!("the checkpoint's checksum is set with it")
                };
                let diverged = touch(h, "v", i);
                let c = rig.crash(&["rollback", "v", "c"], target, delay);
                let rows = ls_tells_the_truth(h, &round, SETTLE);
                // (A VMM killed after the rollback is that of the vm it
                // started: then it succeeded and v crashed.)
                if c.ok() && target == Target::Cli {
                    assert_eq!(state_of(&rows, "v"), Some("running"), "{round}");
                }
                if state_of(&rows, "v") == Some("running") {
                    let now = sum(h, "v");
                    assert!(
                        now == want || (!c.ok() && now == diverged),
                        "{round}: after the rollback the vm is at the checkpoint ({want}) or, if it never began, where it was ({diverged}); it is at {now}"
                    );
                    if c.ok() {
                        assert_eq!(now, want, "{round}: rolled back");
                    }
                }
                // The checkpoint outlives whatever happened to the vm.
                assert_eq!(
                    state_of(&rows, "v@c"),
                    Some("checkpoint"),
                    "{round}: {rows:?}"
                );
                c
            }
            Verb::Sleep => {
                rig.drop_checkpoints();
                let s = touch(h, "v", i);
                let c = rig.crash(&["sleep", "v"], target, delay);
                let rows = ls_tells_the_truth(h, &round, SETTLE);
                let st = state_of(&rows, "v").unwrap_or("absent").to_string();
                let branch = branch_state(h, "v");
                match st.as_str() {
                    "running" => {
                        assert!(!c.ok(), "{round}: the sleep succeeded but v runs");
                        assert_ne!(branch, "sleeping", "{round}: v runs and sleeps");
                        assert_eq!(sum(h, "v"), s, "{round}: the vm runs on");
                    }
                    "sleeping" => {
                        assert_eq!(branch, "sleeping", "{round}");
                        // Committed: woken now and then, it has the moment.
                        if i % 3 == 0 {
                            h.ok(&["wake", "v"]);
                            assert_eq!(sum(h, "v"), s, "{round}: the committed sleep wakes");
                        }
                    }
                    // The VMM was killed before the commit.
                    "crashed" | "stopped" => {
                        assert!(!c.ok(), "{round}: the sleep succeeded but v is {st}");
                        assert_ne!(branch, "sleeping", "{round}: v is {st} and sleeps");
                    }
                    other => panic!("{round}: v is {other}: {rows:?}"),
                }
                c
            }
            Verb::Wake => {
                let s = rig.ensure_sleeping(i);
                let c = rig.crash(&["wake", "v"], target, delay);
                let rows = ls_tells_the_truth(h, &round, SETTLE);
                let st = state_of(&rows, "v").unwrap_or("absent").to_string();
                let branch = branch_state(h, "v");
                match st.as_str() {
                    "running" => {
                        assert_eq!(branch, "running", "{round}: v runs");
                        assert_eq!(sum(h, "v"), s, "{round}: woken with its moment");
                    }
                    "sleeping" => {
                        assert!(!c.ok(), "{round}: the wake succeeded but v sleeps");
                        assert_eq!(branch, "sleeping", "{round}");
                    }
                    // Woken, then its VMM was killed.
                    "crashed" | "stopped" => {}
                    other => panic!("{round}: v is {other}: {rows:?}"),
                }
                c
            }
        };
        if crashed.killed.is_empty() {
            no_target += 1;
        }
        if crashed.ok() {
            ok += 1;
        } else {
            failed += 1;
            // A command that failed says why (not an empty error).
            if target != Target::Cli {
                let err = crashed.stderr();
                assert!(
                    err.trim().len() > 5,
                    "{round}: the command failed without a word: {:?}",
                    crashed.out
                );
            }
        }
    }
    rig.finale(&what);
    progress(&format!(
        "{what}: {n} rounds in {:.1} s (seed {seed:#x}; delays ms {delays:?}): {ok} succeeded, {failed} failed, {no_target} found nothing to kill",
        t0.elapsed().as_secs_f64()
    ));
}

#[test]
fn test_fork_with_the_client_killed() {
    crash_case(Verb::Fork, Target::Cli);
}

#[test]
fn test_fork_with_the_vmm_killed() {
    crash_case(Verb::Fork, Target::Vmm);
}

#[test]
fn test_snapshot_with_the_client_killed() {
    crash_case(Verb::Snapshot, Target::Cli);
}

#[test]
fn test_snapshot_with_the_vmm_killed() {
    crash_case(Verb::Snapshot, Target::Vmm);
}

#[test]
fn test_checkpoint_with_the_client_killed() {
    crash_case(Verb::Checkpoint, Target::Cli);
}

#[test]
fn test_checkpoint_with_the_vmm_killed() {
    crash_case(Verb::Checkpoint, Target::Vmm);
}

#[test]
fn test_rollback_with_the_client_killed() {
    crash_case(Verb::Rollback, Target::Cli);
}

#[test]
fn test_rollback_with_the_vmm_killed() {
    crash_case(Verb::Rollback, Target::Vmm);
}

#[test]
fn test_sleep_with_the_client_killed() {
    crash_case(Verb::Sleep, Target::Cli);
}

#[test]
fn test_sleep_with_the_vmm_killed() {
    crash_case(Verb::Sleep, Target::Vmm);
}

#[test]
fn test_wake_with_the_client_killed() {
    crash_case(Verb::Wake, Target::Cli);
}

#[test]
fn test_wake_with_the_vmm_killed() {
    crash_case(Verb::Wake, Target::Vmm);
}

/// What a named crash point leaves, as the next tined shows it.
#[derive(Clone, Copy, Debug)]
enum After {
    /// `v` runs on with its memory; a fork's children are all there or none.
    RunsOn,
    /// `v` sleeps (the commit happened) and wakes with its memory.
    Sleeps,
    /// `v` is not running; its checkpoint `c` still returns it.
    CheckpointLeft,
    /// `v` runs on; the snapshot directory is complete or gone.
    SnapshotWhole,
}

#[test]
fn test_tined_killed_in_the_middle_of_fork_sleep_and_wake() {
    if !kvm_available() {
        return;
    }
    let rig = Rig::new("crash-tined");
    let h = &rig.h;
    let t0 = Instant::now();
    let points: &[(&str, &str, After)] = &[
        ("fork:prepared", "fork", After::RunsOn),
        ("fork:answered", "fork", After::RunsOn),
        ("fork:recorded", "fork", After::RunsOn),
        ("fork:done", "fork", After::RunsOn),
        ("checkpoint:answered", "checkpoint", After::RunsOn),
        ("rollback:killed", "rollback", After::CheckpointLeft),
        ("snapshot:answered", "snapshot", After::SnapshotWhole),
        ("sleep:answered", "sleep", After::RunsOn),
        ("sleep:stored", "sleep", After::Sleeps),
        ("sleep:committed", "sleep", After::Sleeps),
        ("wake:materialized", "wake", After::Sleeps),
        ("wake:started", "wake", After::RunsOn),
    ];
    for (i, &(point, verb, after)) in points.iter().enumerate() {
        let what = format!("tined killed at {point}");
        rig.clear_others();
        rig.ensure_running();
        rig.drop_checkpoints();
        let snap = rig.files.path().join(format!("tsnap-{i}"));
        let snap_s = snap.to_str().expect("utf8").to_string();
        let (s, args): (String, Vec<&str>) = match verb {
            "fork" => (touch(h, "v", i), vec!["fork", "v", "-n", "3"]),
            "checkpoint" => (touch(h, "v", i), vec!["checkpoint", "v", "--tag", "c"]),
            "rollback" => {
                let s = touch(h, "v", i);
                h.ok(&["checkpoint", "v", "--tag", "c"]);
                touch(h, "v", 100 + i);
                (s, vec!["rollback", "v", "c"])
            }
            "snapshot" => (touch(h, "v", i), vec!["snapshot", "v", "--to", &snap_s]),
            "sleep" => (touch(h, "v", i), vec!["sleep", "v"]),
            "wake" => (rig.ensure_sleeping(i), vec!["wake", "v"]),
            _ => unreachable!("a verb of the table"),
        };
        let before: Vec<u32> = vmm_procs(&rig.home).iter().map(|p| p.pid).collect();
        let old_tined = procs::tined_pid(h);
        let c = rig.crash_env(
            &args,
            Target::Nobody,
            Duration::ZERO,
            &[("TINE_HOST_FAULT", point)],
        );
        assert!(!c.ok(), "{what}: the command succeeded: {}", c.stderr());
        // The point was reached: the tined the command started with the
        // fault armed is gone, and nothing started another one.
        assert_eq!(procs::tined_pid(h), None, "{what}: tined still runs");
        // Its VMMs did not go with it: where no process took over from
        // another (a handoff's old VMM ends once its connection closes)
        // every one of them runs on, and a VMM of `v` runs wherever `v`
        // had one (the rollback ended it itself; a wake had none yet).
        let alive = vmm_procs(&rig.home);
        if point == "fork:prepared" || point.starts_with("sleep:s") || point.starts_with("sleep:c")
        {
            for p in &before {
                assert!(
                    alive.iter().any(|a| a.pid == *p),
                    "{what}: VMM {p} did not survive: {alive:?}"
                );
            }
        }
        if point != "rollback:killed" && point != "wake:materialized" {
            assert!(
                alive.iter().any(|p| p.name == "v"),
                "{what}: no VMM of v survived: {alive:?}"
            );
        }
        // The next command starts a new tined that adopts them.
        let rows = ls_tells_the_truth(h, &what, SETTLE);
        let new_tined = procs::tined_pid(h);
        assert!(
            new_tined.is_some() && new_tined != old_tined,
            "{what}: a new tined"
        );
        assert!(
            !h.0.path()
                .join("intents")
                .read_dir()
                .is_ok_and(|mut d| d.next().is_some()),
            "{what}: reconcile settled every intent"
        );
        let st = state_of(&rows, "v").unwrap_or("absent").to_string();
        match after {
            After::RunsOn => {
                assert_eq!(st, "running", "{what}: {rows:?}");
                assert_ne!(branch_state(h, "v"), "sleeping", "{what}");
                let children: Vec<&str> = rows
                    .iter()
                    .map(name_of)
                    .filter(|n| n.starts_with("v-"))
                    .collect();
                assert!(
                    children.is_empty() || children.len() == 3,
                    "{what}: {children:?}"
                );
                assert!(
                    point != "fork:done" || children.len() == 3,
                    "{what}: a finished fork keeps its children: {children:?}"
                );
                // Each child in its tree's group, with its parent.
                let group_of = |n: &str| {
                    let row = rows.iter().find(|r| name_of(r) == n).expect("a row");
                    procs::pids_group(row["pid"].as_u64().expect("a pid") as u32)
                };
                for c in &children {
                    assert_eq!(group_of(c), group_of("v"), "{what}: {c}'s group");
                }
                let mut asks = vec![("v", "sum 1".to_string())];
                asks.extend(children.iter().map(|c| (*c, "sum 1".to_string())));
                for got in ask_all(h, &asks, "SUM") {
                    assert_eq!(got, s, "{what}: memory of the moment");
                }
            }
            After::Sleeps => {
                assert_eq!(st, "sleeping", "{what}: the commit holds: {rows:?}");
                assert_eq!(branch_state(h, "v"), "sleeping", "{what}");
                h.ok(&["wake", "v"]);
                assert_eq!(sum(h, "v"), s, "{what}: woken with its moment");
            }
            After::CheckpointLeft => {
                assert_ne!(st, "running", "{what}: {rows:?}");
                assert_eq!(state_of(&rows, "v@c"), Some("checkpoint"), "{what}");
                h.ok(&["rollback", "v", "c"]);
                assert_eq!(sum(h, "v"), s, "{what}: the checkpoint returns it");
            }
            After::SnapshotWhole => {
                assert_eq!(st, "running", "{what}: {rows:?}");
                assert_eq!(sum(h, "v"), s, "{what}");
                let complete = snap.join("manifest.json").is_file();
                assert!(
                    !snap.exists() || complete,
                    "{what}: half a snapshot directory"
                );
                if complete {
                    h.ok(&["run", "--name", "r", "--from", &snap_s]);
                    assert_eq!(sum(h, "r"), s, "{what}: the snapshot restores");
                }
            }
        }
        progress(&format!("{what}: v {st} afterwards, as it should"));
    }

    // And at spread moments of a fork, a sleep and a wake.
    let mut rng = Rng::new(seed_of("tined"));
    let n = rounds().div_ceil(2);
    for verb in ["fork", "sleep", "wake"] {
        let mut delays = Vec::new();
        for i in 0..n {
            let delay = Duration::from_millis(rng.below(51));
            delays.push(delay.as_millis());
            let what = format!(
                "tined killed {} ms into {verb} (round {i})",
                delay.as_millis()
            );
            rig.clear_others();
            rig.ensure_running();
            rig.drop_checkpoints();
            let (s, args) = match verb {
                "fork" => (touch(h, "v", i), vec!["fork", "v", "-n", "3"]),
                "sleep" => (touch(h, "v", i), vec!["sleep", "v"]),
                _ => (rig.ensure_sleeping(i), vec!["wake", "v"]),
            };
            let c = rig.crash(&args, Target::Tined, delay);
            let rows = ls_tells_the_truth(h, &what, SETTLE);
            let st = state_of(&rows, "v").unwrap_or("absent").to_string();
            let branch = branch_state(h, "v");
            match st.as_str() {
                "running" => {
                    assert_ne!(branch, "sleeping", "{what}: runs and sleeps");
                    let mut asks = vec![("v", "sum 1".to_string())];
                    let children: Vec<&str> = rows
                        .iter()
                        .map(name_of)
                        .filter(|n| n.starts_with("v-"))
                        .collect();
                    assert!(
                        children.is_empty() || children.len() == 3,
                        "{what}: {children:?}"
                    );
                    if c.ok() && verb == "fork" {
                        assert_eq!(children.len(), 3, "{what}");
                    }
                    asks.extend(children.iter().map(|c| (*c, "sum 1".to_string())));
                    for got in ask_all(h, &asks, "SUM") {
                        assert_eq!(got, s, "{what}: memory of the moment");
                    }
                }
                "sleeping" => {
                    assert!(verb != "fork", "{what}: a fork put v to sleep");
                    assert_eq!(branch, "sleeping", "{what}");
                    assert!(!(verb == "wake" && c.ok()), "{what}: woke but sleeps");
                    h.ok(&["wake", "v"]);
                    assert_eq!(sum(h, "v"), s, "{what}: woken with its moment");
                }
                other => panic!("{what}: v is {other} though only tined was killed: {rows:?}"),
            }
        }
        progress(&format!(
            "tined killed during {verb}: {n} rounds, delays ms {delays:?}"
        ));
    }
    rig.finale("tined killed");
    progress(&format!(
        "tined crash points: done in {:.1} s",
        t0.elapsed().as_secs_f64()
    ));
}

/// Starts two commands at once; their outputs.
fn at_once(h: &Home, a: &[&str], b: &[&str]) -> (Output, Output) {
    let spawn = |args: &[&str]| {
        let mut cmd = h.cmd(args);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        cmd.spawn().expect("spawn tine")
    };
    let (ca, cb) = (spawn(a), spawn(b));
    (
        h.wait_within(ca, a, CALL_LIMIT),
        h.wait_within(cb, b, CALL_LIMIT),
    )
}

/// Of two calls at once exactly one succeeded (`what` says which race):
/// the loser's error.
fn one_wins(a: &Output, b: &Output, what: &str) -> String {
    assert!(
        a.status.success() != b.status.success(),
        "{what}: {} / {}",
        err_of(a),
        err_of(b)
    );
    err_of(if a.status.success() { b } else { a })
}

fn err_of(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn test_two_clients_at_once_one_wins_and_nothing_leaks() {
    if !kvm_available() {
        return;
    }
    let rig = Rig::new("crash-race");
    let h = &rig.h;
    let t0 = Instant::now();
    for round in 0..5 {
        rig.clear_others();
        rig.ensure_running();
        let s = touch(h, "v", round);

        // fork/fork: one after the other, both whole.
        let (a, b) = at_once(h, &["fork", "v", "-n", "3"], &["fork", "v", "-n", "3"]);
        assert!(
            a.status.success() && b.status.success(),
            "two forks of one vm wait for each other: {} / {}",
            err_of(&a),
            err_of(&b)
        );
        let rows = ls_tells_the_truth(h, "fork/fork", SETTLE);
        let children: Vec<&str> = rows
            .iter()
            .map(name_of)
            .filter(|n| n.starts_with("v-"))
            .collect();
        assert_eq!(children.len(), 6, "{rows:?}");
        rig.clear_others();

        // fork/fork of the same names: one wins, the other is told why.
        let (a, b) = at_once(
            h,
            &["fork", "v", "--names", "x,y"],
            &["fork", "v", "--names", "x,y"],
        );
        let e = one_wins(&a, &b, "one fork of the names x,y wins");
        assert!(
            e.contains("\"x\"") && (e.contains("exists") || e.contains("being used")),
            "a clear error: {e}"
        );
        let rows = ls_tells_the_truth(h, "fork/fork names", SETTLE);
        for n in ["x", "y"] {
            assert_eq!(state_of(&rows, n), Some("running"), "{rows:?}");
        }
        for got in ask_all(h, &[("x", "sum 1".into()), ("y", "sum 1".into())], "SUM") {
            assert_eq!(got, s);
        }
        rig.clear_others();

        // fork/rm: the rm waits for the fork (or the fork finds no vm).
        let (f, r) = at_once(h, &["fork", "v", "-n", "3"], &["rm", "--force", "v"]);
        assert!(r.status.success(), "rm: {}", err_of(&r));
        let e = err_of(&f);
        assert!(
            f.status.success() || e.contains("no vm named") || e.contains("only a running vm"),
            "fork next to rm: {e}"
        );
        let rows = ls_tells_the_truth(h, "fork/rm", SETTLE);
        assert_eq!(state_of(&rows, "v"), None, "rm removed v: {rows:?}");
        let children: Vec<&str> = rows
            .iter()
            .map(name_of)
            .filter(|n| n.starts_with("v-"))
            .collect();
        assert_eq!(
            children.len(),
            if f.status.success() { 3 } else { 0 },
            "the children of a fork stay, vms of their own: {rows:?}"
        );
        if !children.is_empty() {
            let asks: Vec<(&str, String)> =
                children.iter().map(|c| (*c, "sum 1".to_string())).collect();
            for got in ask_all(h, &asks, "SUM") {
                assert_eq!(got, s);
            }
        }
        rig.clear_others();

        // run/run of one name: one wins, the other is told why.
        let run = [
            "run",
            "--name",
            "dup",
            "--image",
            "micro-memtouch",
            "--mem",
            "64M",
            "--disk",
            &rig.disk,
        ];
        let (a, b) = at_once(h, &run, &run);
        let e = one_wins(&a, &b, "one run of dup wins");
        assert!(
            e.contains("\"dup\"")
                && (e.contains("being used")
                    || e.contains("already running")
                    || e.contains("exists")),
            "a clear error: {e}"
        );
        let rows = ls_tells_the_truth(h, "run/run", SETTLE);
        assert_eq!(state_of(&rows, "dup"), Some("running"), "{rows:?}");
        assert_eq!(
            rows.iter().filter(|r| name_of(r) == "dup").count(),
            1,
            "{rows:?}"
        );
        ask_all(h, &[("dup", "ping".into())], "PONG");
        h.ok(&["rm", "--force", "dup"]);
    }
    rig.finale("two clients at once");
    progress(&format!(
        "two clients at once: 5 rounds of fork/fork, fork/fork (same names), fork/rm, run/run in {:.1} s",
        t0.elapsed().as_secs_f64()
    ));
}
