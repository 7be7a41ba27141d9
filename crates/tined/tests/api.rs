//! The API of a real `tined` (this package's binary, in the foreground,
//! with a temporary home) over its Unix socket and its TCP listener, with
//! micro guests on this machine's /dev/kvm: every verb, the error answers,
//! idempotency, concurrent operations on one vm, the event stream, the
//! metrics, and the OpenAPI document against `docs/api/openapi.json`.
//!
//! Every test's [`Tined`] removes its vms and fails the test if a VMM
//! process of its home is left.

mod common;

use std::time::Duration;

use common::{kvm_available, vmm_processes, wait_gone, Tined};
use serde_json::{json, Value};

fn pid_of(v: &Value) -> u64 {
    v["pid"].as_u64().unwrap_or_else(|| panic!("no pid in {v}"))
}

/// The last `CNT n` of micro-counter `vm` so far.
fn last_cnt(t: &Tined, vm: &str) -> u64 {
    t.console(vm)
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("CNT ")?.parse().ok())
        .unwrap_or(0)
}

/// Runs micro-counter `name` and waits until it counts.
fn counter(t: &Tined, name: &str) -> Value {
    let r = t.run(name, "micro-counter");
    t.wait_line(name, 0, |l| l.starts_with("CNT 2"));
    r
}

/// Runs micro-memtouch `name` and waits for READY.
fn memtouch(t: &Tined, name: &str) -> Value {
    let r = t.run(name, "micro-memtouch");
    t.wait_line(name, 0, |l| l.starts_with("READY"));
    r
}

/// The checksum memtouch `vm` answers for `sum MIB`.
fn sum(t: &Tined, vm: &str, mib: u32) -> String {
    last_word(&t.ask(vm, &format!("sum {mib}"), "SUM"))
}

/// Writes memtouch `vm`'s first `mib` MiB with `seed`; the checksum.
fn touch(t: &Tined, vm: &str, mib: u32, seed: u32) -> String {
    last_word(&t.ask(vm, &format!("touch {mib} {seed}"), "TOUCHED"))
}

fn last_word(l: &str) -> String {
    l.split_whitespace().last().unwrap_or_default().to_string()
}

// ------------------------------------------------------------------ vms

#[test]
fn test_run_list_get_console_and_rm() {
    if !kvm_available() {
        return;
    }
    let t = Tined::start("vms");
    assert_eq!(t.get("/v1/vms").expect(200), json!([]));
    let r = counter(&t, "a");
    assert_eq!(r["name"], "a");
    let pid = pid_of(&r);
    assert!(common::alive(pid), "the vm's VMM runs: {r}");

    let list = t.get("/v1/vms").expect(200);
    let rows = list.as_array().expect("a list");
    assert_eq!(rows.len(), 1, "{list}");
    assert_eq!(rows[0]["name"], "a");
    assert_eq!(rows[0]["state"], "running");
    assert_eq!(rows[0]["pid"].as_u64(), Some(pid));
    assert_eq!(rows[0]["image"], "micro-counter");
    assert_eq!(rows[0]["mem_mib"], 64);
    assert_eq!(rows[0]["agent"], false);

    let one = t.get("/v1/vms/a").expect(200);
    assert_eq!(one["name"], "a");
    assert_eq!(one["state"], "running");

    // The guest runs: its counter goes on.
    let c = last_cnt(&t, "a");
    t.wait_line("a", 0, |l| {
        l.strip_prefix("CNT ")
            .and_then(|n| n.parse::<u64>().ok())
            .is_some_and(|n| n > c)
    });

    // Images: a list (of what the cache holds), each with a name.
    let imgs = t.get("/v1/images").expect(200);
    assert!(imgs.is_array(), "{imgs}");

    // A running vm is removed only with force.
    let msg = t.delete("/v1/vms/a").expect_error(409, "conflict");
    assert!(msg.contains("running"), "{msg}");
    assert!(common::alive(pid), "a refused rm leaves the vm running");
    let rm = t.delete("/v1/vms/a?force=true").expect(200);
    assert_eq!(rm["name"], "a");
    assert_eq!(rm["what"], "vm");
    assert!(wait_gone(&[pid]).is_empty(), "rm ends the VMM");
    t.get("/v1/vms/a").expect_error(404, "not_found");
    t.delete("/v1/vms/a").expect_error(404, "not_found");
    assert_eq!(t.get("/v1/vms").expect(200), json!([]));
    assert!(vmm_processes(&t.home).is_empty());

    // kill, then a plain rm of the stopped vm.
    let b = counter(&t, "b");
    let k = t.post("/v1/vms/b/kill", json!({})).expect(200);
    assert_eq!(k["name"], "b");
    assert!(wait_gone(&[pid_of(&b)]).is_empty(), "kill ends the VMM");
    assert_ne!(t.get("/v1/vms/b").expect(200)["state"], "running");
    t.delete("/v1/vms/b").expect(200);
    assert_eq!(t.get("/v1/vms").expect(200), json!([]));
}
