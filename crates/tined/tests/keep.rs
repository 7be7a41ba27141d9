//! Keep: a running vm snapshotted to the store every few seconds; after
//! its VMM is killed (the host "lost"), its last keep wakes with the
//! memory it had at that keep. Micro guests on this host's /dev/kvm.

mod common;

use std::time::{Duration, Instant};

use common::{kvm_available, Tined};
use serde_json::{json, Value};

fn last_word(l: &str) -> String {
    l.split_whitespace().last().unwrap_or_default().to_string()
}

fn keep_of(t: &Tined, vm: &str) -> Value {
    t.get(&format!("/v1/vms/{vm}/keep")).expect(200)
}

/// Waits until `vm` has a keep taken after unix ms `after`; returns it.
#[track_caller]
fn kept_after(t: &Tined, vm: &str, after: u64) -> Value {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let k = keep_of(t, vm);
        if k["last_ms"].as_u64().is_some_and(|ms| ms > after) {
            return k;
        }
        assert!(
            Instant::now() < deadline,
            "no keep of {vm} after {after}: {k}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn keep_branches(t: &Tined, vm: &str) -> Vec<String> {
    let b = t.get("/v1/branches").expect(200);
    let prefix = format!("{vm}.keep-");
    let mut names: Vec<String> = b
        .as_array()
        .expect("a list")
        .iter()
        .filter(|b| b["state"] == "sleeping")
        .filter_map(|b| b["name"].as_str())
        .filter(|n| n.starts_with(&prefix))
        .map(str::to_string)
        .collect();
    names.sort();
    names
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

#[test]
fn keep_survives_a_lost_vmm() {
    if !kvm_available() {
        eprintln!("skipped: no /dev/kvm");
        return;
    }
    let t0 = Instant::now();
    let t = Tined::start("keep");
    t.run("w", "micro-memtouch");
    t.wait_line("w", 0, |l| l.starts_with("READY"));

    // Below the minimum, and on no vm: refused.
    t.post(
        "/v1/vms",
        json!({"name": "x", "image": "micro-memtouch", "mem_mib": 64, "no_agent": true, "keep_every_s": 2}),
    )
    .expect_error(400, "invalid_input");
    t.put("/v1/vms/w/keep", json!({"every_s": 1}))
        .expect_error(400, "invalid_input");
    t.put("/v1/vms/nope/keep", json!({"every_s": 5}))
        .expect_error(404, "not_found");

    let before = now_ms();
    let touched = last_word(&t.ask("w", "touch 8 7", "TOUCHED"));
    let k = t.put("/v1/vms/w/keep", json!({"every_s": 5})).expect(200);
    assert_eq!(k["every_s"], 5, "{k}");
    let first = kept_after(&t, "w", before);
    let snap = first["last_snapshot"].as_i64().expect("a snapshot");
    assert!(first["last_branch"].as_str().is_some(), "{first}");
    // GET /v1/vms/NAME shows it.
    let info = t.get("/v1/vms/w").expect(200);
    assert_eq!(info["keep"]["last_snapshot"], snap, "{info}");
    assert_eq!(info["state"], "running", "the vm runs on: {info}");

    // A period later there is a newer keep, and only one keep branch.
    let second = kept_after(&t, "w", first["last_ms"].as_u64().unwrap_or_default());
    let branch = second["last_branch"]
        .as_str()
        .expect("a branch")
        .to_string();
    assert_ne!(second["last_branch"], first["last_branch"], "{second}");
    // (The previous branch goes just after the new keep is recorded.)
    let deadline = Instant::now() + Duration::from_secs(3);
    while keep_branches(&t, "w") != vec![branch.clone()] && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        keep_branches(&t, "w"),
        vec![branch.clone()],
        "{}\n{}",
        t.get("/v1/branches").expect(200),
        t.log()
    );

    // The host is "lost": its VMM dies at once.
    let pid = t.get("/v1/vms/w").expect(200)["pid"]
        .as_u64()
        .expect("a pid");
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    assert!(
        common::wait_gone(&[pid]).is_empty(),
        "the VMM {pid} is gone"
    );

    // The last keep wakes under a new name with the memory of before.
    let woken = t.operation_ok(&format!("/v1/branches/{branch}/wake"), json!({"name": "r"}));
    assert_eq!(woken["name"], "r", "{woken}");
    let sum = last_word(&t.ask("r", "sum 8", "SUM"));
    assert_eq!(sum, touched, "the keep holds what was written before it");

    // DELETE stops the keeps; the last keep branch stays.
    t.put("/v1/vms/r/keep", json!({"every_s": 5})).expect(200);
    let rk = kept_after(&t, "r", now_ms());
    let off = t.delete("/v1/vms/r/keep").expect(200);
    assert!(off["every_s"].is_null(), "{off}");
    std::thread::sleep(Duration::from_secs(6));
    let after = keep_of(&t, "r");
    assert_eq!(
        after["last_ms"], rk["last_ms"],
        "no keep after DELETE: {after}"
    );
    assert_eq!(keep_branches(&t, "r").len(), 1);
    common::progress(&format!("keep test in {:.1} s", t0.elapsed().as_secs_f64()));
}
