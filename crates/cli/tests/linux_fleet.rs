//! A Linux guest across a fleet (issue 15): it sleeps on one host and
//! wakes on another, asked of the first, with its files and processes; the
//! wake-up contract runs there (its new name, its own seed, an address the
//! waking host leased). Two tineds with their own homes and host ids on one
//! PostgreSQL (TINE_META) and one Garage bucket (TINE_STORE), real servers
//! `scripts/servers` starts inside the nested host and removes after.
//!
//! Named `linux_*`: runs inside the nested test host when this machine has
//! no hardware virtualization.

mod common;
#[path = "../../tined/tests/common/servers.rs"]
mod servers;

use common::{kvm_available, Home};
use servers::Servers;

fn exec(h: &Home, vm: &str, script: &str) -> String {
    h.ok(&["exec", vm, "--", "sh", "-c", script])
}

/// A home that is host `id` of the fleet (tined reads `$TINE_HOME/host-id`).
fn host(id: &str) -> Home {
    let h = Home::new(&format!("fleet{id}"));
    std::fs::write(h.0.path().join("host-id"), id).expect("host-id");
    h
}

#[test]
fn test_a_linux_guest_sleeps_on_one_host_and_wakes_on_another() {
    if !kvm_available() {
        return;
    }
    let _serial = common::one_linux_test_at_a_time();
    let s = Servers::start("linux", 1);
    // Every tined this test starts (on demand, from `tine`) is in the
    // fleet: one test in this binary, so the process environment is its.
    for (k, v) in &s.env {
        std::env::set_var(k, v);
    }
    std::env::set_var("TINE_HEARTBEAT_MS", "1000");
    let h1 = host("h1");
    let h2 = host("h2");

    h1.ok(&["run", "--name", "a", "--net"]);
    let pid = exec(
        &h1,
        "a",
        "(i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 1; done) >/dev/null 2>&1 & echo $!",
    );
    let pid = pid.trim().to_string();
    let seed_a = exec(
        &h1,
        "a",
        "echo fleet-data > /tmp/f; cat /run/tine/seed 2>/dev/null; true",
    );
    let before: u64 = exec(&h1, "a", "sleep 2; cat /tmp/count")
        .trim()
        .parse()
        .expect("count");
    h1.ok(&["sleep", "a"]);

    // Both hosts are up and see one tree.
    let hosts: serde_json::Value =
        serde_json::from_str(&h2.ok(&["hosts", "--json"])).expect("hosts --json");
    let up = |id: &str| {
        hosts["hosts"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x["id"] == id && x["state"] == "up"))
    };
    assert!(up("h1") && up("h2"), "{hosts}");
    assert!(h2.ok(&["tree"]).contains("a (sleeping)"));

    // Asked of h1, woken on h2 under a new name: a copy of the branch,
    // which the wake-up contract tells who it is now.
    h1.ok(&["wake", "a", "--name", "b", "--host", "h2", "--net"]);
    assert!(
        h2.0.path().join("vms/b/vm.json").exists(),
        "b runs on h2, not on h1"
    );
    assert!(!h1.0.path().join("vms/b").exists());
    let out = exec(
        &h2,
        "b",
        &format!("cat /tmp/f; kill -0 {pid} && echo alive; hostname; sleep 2; cat /tmp/count; ip -4 -o addr show dev eth0 | grep -o 'inet [0-9.]*'"),
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first(), Some(&"fleet-data"), "{out}");
    assert_eq!(lines.get(1), Some(&"alive"), "the loop goes on: {out}");
    assert_eq!(lines.get(2), Some(&"b"), "the contract named it: {out}");
    let after: u64 = lines
        .get(3)
        .and_then(|l| l.parse().ok())
        .unwrap_or_else(|| panic!("count: {out}"));
    assert!(after > before, "the counter went on: {before} then {after}");
    assert_eq!(
        lines.get(4).copied(),
        Some(format!("inet {}", h2.lease_ip("b")).as_str()),
        "the address h2 leased: {out}"
    );
    let seed_b = exec(&h2, "b", "cat /run/tine/seed 2>/dev/null; true");
    if !seed_a.trim().is_empty() {
        assert_ne!(seed_a, seed_b, "a wake gets its own seed");
    }

    // The tree is one, and every host's store verifies.
    for h in [&h1, &h2] {
        let tree = h.ok(&["tree"]);
        assert!(
            tree.contains("a (sleeping)") && tree.contains('b'),
            "{tree}"
        );
        let v = h.ok(&["store", "verify"]);
        assert!(v.contains("0 missing, 0 corrupt"), "{v}");
    }
    h2.ok(&["rm", "--force", "b"]);
    h1.ok(&["rm", "--force", "a"]);
    for h in [&h2, &h1] {
        let _ = h.out(&["daemon", "stop"]);
    }
}
