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

    // Images: what the image cache holds, each with its manifest's files.
    let imgs = t.get("/v1/images").expect(200);
    for img in imgs.as_array().unwrap_or_else(|| panic!("a list: {imgs}")) {
        assert!(img["hash"].as_str().is_some(), "{img}");
        let kernel = img["kernel"].as_str().unwrap_or_else(|| panic!("{img}"));
        assert!(std::path::Path::new(kernel).is_absolute(), "{img}");
    }

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
    // What only a running vm can do is refused at once (no 202).
    for (path, body) in [
        ("/v1/vms/b/sleep", json!({})),
        ("/v1/vms/b/snapshot", json!({"dir": "/tmp/tined-api-never"})),
        ("/v1/vms/b/fork", json!({"count": 1})),
        ("/v1/vms/b/checkpoints", json!({})),
    ] {
        let m = t.post(path, body).expect_error(409, "conflict");
        assert!(m.contains("stopped"), "{path}: {m}");
    }
    assert!(!std::path::Path::new("/tmp/tined-api-never").exists());
    t.delete("/v1/vms/b").expect(200);
    assert_eq!(t.get("/v1/vms").expect(200), json!([]));
}

// ------------------------------------------------------------------ moments

#[test]
fn test_fork_children_names_results_and_limits() {
    if !kvm_available() {
        return;
    }
    let t = Tined::start("fork");
    counter(&t, "p");
    let before = last_cnt(&t, "p");
    let r = t.post("/v1/vms/p/fork", json!({"count": 2})).expect(200);
    assert_eq!(r["name"], "p");
    assert_eq!(r["names"], json!(["p-1", "p-2"]));
    let results = r["results"].as_array().expect("results");
    assert_eq!(results.len(), 2, "{r}");
    for (res, name) in results.iter().zip(["p-1", "p-2"]) {
        assert_eq!(res["name"], name, "{r}");
        assert_eq!(res["ok"], true, "{r}");
        assert!(res["error"].is_null(), "{r}");
        assert!(common::alive(pid_of(res)), "child {name} runs: {r}");
    }
    let children: Vec<u64> = r["children"]
        .as_array()
        .expect("children")
        .iter()
        .filter_map(Value::as_u64)
        .collect();
    assert_eq!(children, results.iter().map(pid_of).collect::<Vec<_>>());
    assert!(r["pause_ms"].as_f64().is_some(), "{r}");
    assert_eq!(
        r["child_running_ms"].as_array().map(Vec::len),
        Some(2),
        "{r}"
    );
    // Each child continues from the moment of the fork: its counter
    // starts near the parent's and goes on.
    for c in ["p-1", "p-2"] {
        let row = t.get(&format!("/v1/vms/{c}")).expect(200);
        assert_eq!(row["state"], "running", "{row}");
        assert_eq!(row["parent"], "p", "{row}");
        let first = t.wait_line(c, 0, |l| l.starts_with("CNT "));
        let n: u64 = first.trim_start_matches("CNT ").parse().expect("a count");
        assert!(
            n >= before,
            "child {c} counts on from {n}, the parent was at {before}"
        );
    }
    // The parent goes on too.
    assert_eq!(t.get("/v1/vms/p").expect(200)["state"], "running");

    // Names.
    let r = t
        .post("/v1/vms/p/fork", json!({"names": ["x", "y"]}))
        .expect(200);
    assert_eq!(r["names"], json!(["x", "y"]));
    assert_eq!(
        t.states()
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>(),
        ["p", "p-1", "p-2", "x", "y"]
    );

    // Refused before anything happens; nothing changes.
    let before = t.snapshot_state();
    let procs = vmm_processes(&t.home);
    let m = t
        .post("/v1/vms/p/fork", json!({"count": 101}))
        .expect_error(400, "invalid_input");
    assert!(m.contains("100"), "{m}");
    t.post("/v1/vms/p/fork", json!({"count": 0}))
        .expect_error(400, "invalid_input");
    t.post("/v1/vms/p/fork", json!({}))
        .expect_error(400, "invalid_input");
    t.post("/v1/vms/p/fork", json!({"names": ["d", "d"]}))
        .expect_error(400, "invalid_input");
    t.post("/v1/vms/p/fork", json!({"count": 2, "names": ["q"]}))
        .expect_error(400, "invalid_input");
    t.post("/v1/vms/p/fork", json!({"names": ["x"]}))
        .expect_error(409, "conflict");
    t.post("/v1/vms/p/fork", json!({"names": ["fresh", "x"]}))
        .expect_error(409, "conflict");
    t.post("/v1/vms/p/fork", json!({"names": ["../x"]}))
        .expect_error(400, "invalid_input");
    t.post("/v1/vms/p/fork", json!({"names": ["a/b"]}))
        .expect_error(400, "invalid_input");
    t.post("/v1/vms/p/fork", json!({"count": -1}))
        .expect_error(400, "invalid_input");
    t.post("/v1/vms/nope/fork", json!({"count": 1}))
        .expect_error(404, "not_found");
    assert_eq!(t.snapshot_state(), before, "refused forks change nothing");
    assert_eq!(
        vmm_processes(&t.home),
        procs,
        "refused forks start no process"
    );
}

#[test]
fn test_checkpoint_rollback_and_delete_checkpoint() {
    if !kvm_available() {
        return;
    }
    let t = Tined::start("checkpoint");
    memtouch(&t, "m");
    let s1 = touch(&t, "m", 8, 1);
    let cp = t
        .post("/v1/vms/m/checkpoints", json!({"tag": "t1"}))
        .expect(201);
    assert_eq!(cp["name"], "m");
    assert_eq!(cp["tag"], "t1");
    // Default tags.
    let cp2 = t.post("/v1/vms/m/checkpoints", json!({})).expect(201);
    assert_eq!(cp2["tag"], "cp1");
    t.post("/v1/vms/m/checkpoints", json!({"tag": "t1"}))
        .expect_error(409, "conflict");
    t.post("/v1/vms/m/checkpoints", json!({"tag": "../t"}))
        .expect_error(400, "invalid_input");
    let list = t.get("/v1/vms/m/checkpoints").expect(200);
    let tags: Vec<&str> = list
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|c| c["tag"].as_str())
        .collect();
    assert_eq!(tags, ["t1", "cp1"]);
    assert_eq!(
        t.get("/v1/vms/m").expect(200)["checkpoints"],
        json!(["t1", "cp1"])
    );

    let s2 = touch(&t, "m", 8, 2);
    assert_ne!(s1, s2);
    let rb = t
        .post("/v1/vms/m/rollback", json!({"tag": "t1"}))
        .expect(200);
    assert_eq!(rb["tag"], "t1");
    assert_eq!(
        sum(&t, "m", 8),
        s1,
        "rollback returns memory to the checkpoint"
    );
    assert_eq!(t.get("/v1/vms/m").expect(200)["state"], "running");

    // Again: a checkpoint serves many rollbacks.
    touch(&t, "m", 8, 3);
    t.post("/v1/vms/m/rollback", json!({"tag": "t1"}))
        .expect(200);
    assert_eq!(sum(&t, "m", 8), s1);

    // gc (which sweeps VMM processes no record knows) and then a rollback:
    // the checkpoint still serves it.
    touch(&t, "m", 8, 4);
    t.operation_ok("/v1/gc", json!({}));
    t.post("/v1/vms/m/rollback", json!({"tag": "t1"}))
        .expect(200);
    assert_eq!(sum(&t, "m", 8), s1, "a rollback after gc");

    // And after a restart of tined (whose reconcile sweeps too).
    let mut t = t;
    t.restart();
    touch(&t, "m", 8, 5);
    t.post("/v1/vms/m/rollback", json!({"tag": "t1"}))
        .expect(200);
    assert_eq!(sum(&t, "m", 8), s1, "a rollback after a restart of tined");

    t.post("/v1/vms/m/rollback", json!({"tag": "zz"}))
        .expect_error(404, "not_found");
    t.post("/v1/vms/m/rollback", json!({}))
        .expect_error(400, "invalid_input");
    t.post("/v1/vms/nope/rollback", json!({"tag": "t1"}))
        .expect_error(404, "not_found");
    t.post("/v1/vms/nope/checkpoints", json!({}))
        .expect_error(404, "not_found");
    t.get("/v1/vms/nope/checkpoints")
        .expect_error(404, "not_found");

    // A vm with checkpoints does not sleep (they live in processes).
    let msg = t
        .post("/v1/vms/m/sleep", json!({}))
        .expect_error(409, "conflict");
    assert!(msg.contains("checkpoints"), "{msg}");

    // rm of a checkpoint.
    let d = t.delete("/v1/vms/m/checkpoints/cp1").expect(200);
    assert_eq!(d["what"], "checkpoint");
    assert_eq!(d["name"], "m@cp1");
    t.delete("/v1/vms/m/checkpoints/cp1")
        .expect_error(404, "not_found");
    t.delete("/v1/vms/m/checkpoints/..%2F..%2Fx")
        .expect_error(400, "invalid_input");
    assert_eq!(t.get("/v1/vms/m").expect(200)["checkpoints"], json!(["t1"]));
    t.delete("/v1/vms/m/checkpoints/t1").expect(200);
    assert_eq!(t.get("/v1/vms/m/checkpoints").expect(200), json!([]));
    // The vm goes on; only it is left.
    assert_eq!(sum(&t, "m", 8), s1);
    let titles: Vec<String> = vmm_processes(&t.home)
        .into_iter()
        .map(|v| v.title)
        .collect();
    assert_eq!(
        titles,
        ["tine-vmm m"],
        "checkpoint templates end with their checkpoint"
    );
}

#[test]
fn test_snapshot_to_a_directory_and_run_from_it() {
    if !kvm_available() {
        return;
    }
    let t = Tined::start("snapshot");
    memtouch(&t, "s");
    let s1 = touch(&t, "s", 8, 7);
    let dir = tempfile::tempdir().expect("a directory");
    let snap = dir.path().join("snap");
    let res = t.operation_ok(
        "/v1/vms/s/snapshot",
        json!({"dir": snap.display().to_string()}),
    );
    assert_eq!(res["name"], "s");
    assert_eq!(res["dir"], snap.display().to_string());
    assert!(
        snap.join("manifest.json").is_file(),
        "the snapshot is written"
    );
    // The vm goes on.
    touch(&t, "s", 8, 8);

    let r = t
        .post(
            "/v1/vms",
            json!({"name": "r", "from": snap.display().to_string(), "no_agent": true}),
        )
        .expect(201);
    assert_eq!(r["name"], "r");
    assert_eq!(sum(&t, "r", 8), s1, "restored at the snapshot's moment");

    // Not twice into one directory; not a relative one; not of a vm that is not there.
    let op = t.operation(
        "/v1/vms/s/snapshot",
        json!({"dir": snap.display().to_string()}),
    );
    assert_eq!(op["state"], "failed", "{op}");
    assert_eq!(op["status"], 409, "{op}");
    assert_eq!(op["error"]["code"], "conflict", "{op}");
    t.post("/v1/vms/s/snapshot", json!({"dir": "rel/dir"}))
        .expect_error(400, "invalid_input");
    t.post("/v1/vms/s/snapshot", json!({}))
        .expect_error(400, "invalid_input");
    t.post(
        "/v1/vms",
        json!({"name": "r2", "from": dir.path().join("none").display().to_string(), "no_agent": true}),
    )
    .expect_error(404, "not_found");
    assert_eq!(
        t.states(),
        [
            ("r".to_string(), "running".to_string()),
            ("s".into(), "running".into())
        ]
    );
}

// ------------------------------------------------------------------ the tree

#[test]
fn test_sleep_wake_tree_rm_branch_and_gc() {
    if !kvm_available() {
        return;
    }
    let t = Tined::start("tree");
    let first = memtouch(&t, "w");
    let s1 = touch(&t, "w", 8, 5);

    // sleep: 202 with an operation; its event stream ends with `done`.
    let r = t.post("/v1/vms/w/sleep", json!({}));
    let op = r.expect(202);
    assert_eq!(op["kind"], "sleep");
    assert_eq!(op["target"], "w");
    let id = op["id"].as_str().expect("an id").to_string();
    assert_eq!(r.header("location"), Some(format!("/v1/operations/{id}")));
    let stream = t.sse(&format!("/v1/operations/{id}/events"));
    assert_eq!(stream.status, 200);
    assert_eq!(stream.content_type.as_deref(), Some("text/event-stream"));
    let events = stream.until(Duration::from_secs(60), |ev, _| ev == "done");
    let (_, done) = events.last().expect("a done event");
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["result"]["branch"], "w", "{done}");
    assert!(done["result"]["snapshot"].as_i64().is_some(), "{done}");
    for (ev, v) in &events[..events.len() - 1] {
        assert_eq!(ev, "progress", "only progress before done: {v}");
    }
    // Polling says the same.
    let polled = t.get(&format!("/v1/operations/{id}")).expect(200);
    assert_eq!(polled["state"], "succeeded");
    assert_eq!(polled["result"], done["result"]);
    // The stream of a finished operation: its `done` at once.
    let again = t.sse(&format!("/v1/operations/{id}/events"));
    let ev = again.until(Duration::from_secs(5), |ev, _| ev == "done");
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert_eq!(ev[0].1["result"], done["result"]);
    let ops = t.get("/v1/operations").expect(200);
    assert!(
        ops.as_array()
            .expect("a list")
            .iter()
            .any(|o| o["id"] == id.as_str()),
        "{ops}"
    );
    assert!(
        wait_gone(&[pid_of(&first)]).is_empty(),
        "a sleeping vm has no process"
    );
    t.get("/v1/vms/w").expect_error(404, "not_found");
    let branches = t.get("/v1/branches").expect(200);
    let w: Vec<&Value> = branches
        .as_array()
        .expect("a list")
        .iter()
        .filter(|b| b["name"] == "w")
        .collect();
    assert_eq!(w.len(), 1, "{branches}");
    assert_eq!(w[0]["state"], "sleeping");

    // wake: the vm continues with its memory.
    let res = t.operation_ok("/v1/branches/w/wake", json!({}));
    assert_eq!(res["name"], "w");
    assert_eq!(t.get("/v1/vms/w").expect(200)["state"], "running");
    assert_eq!(sum(&t, "w", 8), s1, "woken with its memory");
    // A woken branch is not woken twice.
    t.post("/v1/branches/w/wake", json!({}))
        .expect_error(409, "conflict");
    // DELETE /v1/branches/NAME removes branches, not vms.
    t.delete("/v1/branches/w").expect_error(409, "conflict");

    // Sleep again; a lazy wake under another name starts a new branch.
    t.operation_ok("/v1/vms/w/sleep", json!({}));
    let res = t.operation_ok("/v1/branches/w/wake", json!({"name": "w2", "lazy": true}));
    assert_eq!(res["name"], "w2");
    assert_eq!(sum(&t, "w2", 8), s1, "a lazy wake pages the same memory in");

    // A fork of a sleeping branch: new branches wake from its snapshot,
    // named and checked as a running vm's fork.
    let f = t.post("/v1/vms/w/fork", json!({"count": 2})).expect(200);
    assert_eq!(f["names"], json!(["w-1", "w-2"]), "{f}");
    for r in f["results"].as_array().expect("results") {
        assert_eq!(r["ok"], true, "{f}");
    }
    assert_eq!(sum(&t, "w-1", 8), s1);
    let f = t.post("/v1/vms/w/fork", json!({"count": 1})).expect(200);
    assert_eq!(f["names"], json!(["w-3"]), "names in use are skipped: {f}");
    let before = t.snapshot_state();
    for bad in [
        json!({}),
        json!({"count": 0}),
        json!({"count": 101}),
        json!({"names": ["d", "d"]}),
        json!({"names": ["../d"]}),
        json!({"count": 2, "names": ["d"]}),
    ] {
        t.post("/v1/vms/w/fork", bad.clone())
            .expect_error(400, "invalid_input");
    }
    t.post("/v1/vms/w/fork", json!({"names": ["w2"]}))
        .expect_error(409, "conflict");
    t.post("/v1/vms/w/fork", json!({"names": ["new", "w-1"]}))
        .expect_error(409, "conflict");
    assert_eq!(
        t.snapshot_state(),
        before,
        "refused forks of a branch change nothing"
    );
    for c in ["w-1", "w-2", "w-3"] {
        t.delete(&format!("/v1/vms/{c}?force=true")).expect(200);
    }

    // The tree: the snapshot, the sleeping branch, the running vm.
    let tree = t.get("/v1/tree").expect(200);
    let nodes = tree["nodes"].as_array().expect("nodes");
    let kind_of = |id: &str| {
        nodes
            .iter()
            .find(|n| n["id"] == id)
            .map(|n| (n["kind"].clone(), n["state"].clone()))
    };
    assert_eq!(
        kind_of("branch:w"),
        Some((json!("branch"), json!("sleeping"))),
        "{tree}"
    );
    assert_eq!(
        kind_of("vm:w2"),
        Some((json!("vm"), json!("running"))),
        "{tree}"
    );
    assert!(
        nodes.iter().any(|n| n["kind"] == "snapshot"),
        "a snapshot node: {tree}"
    );
    assert!(
        tree["store"]["stored_bytes"].as_u64().unwrap_or(0) > 0,
        "{tree}"
    );
    let store = t.get("/v1/tree/store").expect(200);
    assert!(
        store["snapshots"].is_array() || store.is_object(),
        "{store}"
    );
    assert!(t.get("/v1/snapshots").expect(200).is_array());

    // Unknown names; a bad new name: refused at once, nothing starts.
    t.post("/v1/vms/nope/sleep", json!({}))
        .expect_error(404, "not_found");
    t.post("/v1/branches/nope/wake", json!({}))
        .expect_error(404, "not_found");
    t.post("/v1/branches/w/wake", json!({"name": "../x"}))
        .expect_error(400, "invalid_input");
    t.post("/v1/branches/w/wake", json!({"name": "w2"}))
        .expect_error(409, "conflict");

    // rm of a branch; then gc reclaims what only it held.
    let rm = t.delete("/v1/branches/w").expect(200);
    assert_eq!(rm["what"], "branch");
    t.delete("/v1/branches/w").expect_error(404, "not_found");
    let gc = t.operation_ok("/v1/gc", json!({}));
    assert!(gc["store"].is_object(), "{gc}");
    // w2 still runs, from its own branch.
    assert_eq!(sum(&t, "w2", 8), s1);
    assert_eq!(t.states(), [("w2".to_string(), "running".to_string())]);

    // Unknown operations.
    t.get("/v1/operations/op-nope")
        .expect_error(404, "not_found");
    t.get("/v1/operations/op-nope/events")
        .expect_error(404, "not_found");
}

// ------------------------------------------------------------------ bad input

#[test]
fn test_bad_input_is_a_clear_4xx_and_changes_nothing() {
    if !kvm_available() {
        return;
    }
    let t = Tined::start("bad");
    counter(&t, "v");
    let before = t.snapshot_state();
    let procs = vmm_processes(&t.home);

    // Unknown vm, on every verb that names one.
    for (method, path, body) in [
        ("GET", "/v1/vms/nope", json!(null)),
        ("DELETE", "/v1/vms/nope?force=true", json!(null)),
        ("POST", "/v1/vms/nope/stop", json!({})),
        ("POST", "/v1/vms/nope/kill", json!({})),
        ("POST", "/v1/vms/nope/fork", json!({"count": 1})),
        ("GET", "/v1/vms/nope/checkpoints", json!(null)),
        ("POST", "/v1/vms/nope/checkpoints", json!({})),
        ("DELETE", "/v1/vms/nope/checkpoints/t1", json!(null)),
        ("POST", "/v1/vms/nope/rollback", json!({"tag": "t1"})),
        (
            "POST",
            "/v1/vms/nope/snapshot",
            json!({"dir": "/tmp/tined-never"}),
        ),
        ("POST", "/v1/vms/nope/sleep", json!({})),
        ("GET", "/v1/vms/nope/console", json!(null)),
        ("POST", "/v1/vms/nope/console", json!({"line": "ping"})),
        ("GET", "/v1/vms/nope/disks", json!(null)),
        ("GET", "/v1/vms/nope/contract", json!(null)),
        ("POST", "/v1/vms/nope/exec", json!({"argv": ["true"]})),
        ("GET", "/v1/vms/nope/files?path=/etc/hostname", json!(null)),
        ("DELETE", "/v1/branches/nope", json!(null)),
        ("POST", "/v1/branches/nope/wake", json!({})),
    ] {
        let body = if body.is_null() {
            Vec::new()
        } else {
            body.to_string().into_bytes()
        };
        let r = t.req(method, path, &[], body);
        assert_eq!(r.status, 404, "{method} {path}: {}", r.text());
        let m = r.expect_error(404, "not_found");
        assert!(
            m.contains("nope"),
            "{method} {path}: the message names it: {m}"
        );
    }

    // No such endpoint; a method a path does not take.
    let m = t.get("/v1/nothing").expect_error(404, "not_found");
    assert!(m.contains("/v1/nothing"), "{m}");
    let r = t.req("PATCH", "/v1/vms", &[], Vec::new());
    let m = r.expect_error(405, "method_not_allowed");
    assert!(m.contains("PATCH"), "{m}");
    assert!(
        r.header("allow").is_some_and(|a| a.contains("POST")),
        "{:?}",
        r.headers
    );
    t.req("PUT", "/v1/vms/v/fork", &[], Vec::new())
        .expect_error(405, "method_not_allowed");

    // Malformed JSON, wrong types, missing fields, a non-object.
    let raw = |path: &str, body: &str| t.req("POST", path, &[], body.as_bytes().to_vec());
    for (path, body) in [
        ("/v1/vms", "{bad"),
        ("/v1/vms", "{\"name\": 3}"),
        ("/v1/vms", "{}"),
        ("/v1/vms", "[1, 2]"),
        ("/v1/vms", "\"a string\""),
        ("/v1/vms", "{\"name\": \"x\", \"mem_mib\": -5}"),
        ("/v1/vms/v/fork", "{\"count\": \"two\"}"),
        ("/v1/vms/v/fork", "nul"),
        ("/v1/vms/v/rollback", "{}"),
        ("/v1/vms/v/checkpoints", "{\"tag\": 7}"),
        ("/v1/vms/v/snapshot", "{}"),
        ("/v1/vms/v/console", "{}"),
        ("/v1/vms/v/exec", "{\"argv\": []}"),
        ("/v1/branches/v/wake", "{\"lazy\": \"yes\"}"),
    ] {
        let r = raw(path, body);
        assert_eq!(r.status, 400, "POST {path} {body}: {}", r.text());
        r.expect_error(400, "invalid_input");
    }
    // Query strings that do not parse.
    t.delete("/v1/vms/v?force=maybe")
        .expect_error(400, "invalid_input");
    t.get("/v1/operations/x?wait=soon")
        .expect_error(400, "invalid_input");
    t.get("/v1/vms/v/files").expect_error(400, "invalid_input");
    t.get("/v1/vms/%FF").expect_error(400, "invalid_input");

    // Too large: 413 (a 5 MB body; the limit is 4 MiB).
    let big = format!("{{\"name\": \"{}\"}}", "x".repeat(5 << 20));
    let m = raw("/v1/vms", &big).expect_error(413, "too_large");
    assert!(m.contains("bytes"), "{m}");
    raw("/v1/vms/v/fork", &big).expect_error(413, "too_large");
    raw("/v1/vms/v/checkpoints", &big).expect_error(413, "too_large");

    // Names that would leave the home: in the path and in the body.
    for name in [
        "..%2Fx",
        "a%2Fb",
        "..",
        ".hidden",
        "a%00b",
        "%2Fetc%2Fpasswd",
    ] {
        t.get(&format!("/v1/vms/{name}"))
            .expect_error(400, "invalid_input");
        t.delete(&format!("/v1/vms/{name}?force=true"))
            .expect_error(400, "invalid_input");
        t.post(&format!("/v1/vms/{name}/fork"), json!({"count": 1}))
            .expect_error(400, "invalid_input");
        t.delete(&format!("/v1/vms/v/checkpoints/{name}"))
            .expect_error(400, "invalid_input");
        t.delete(&format!("/v1/branches/{name}"))
            .expect_error(400, "invalid_input");
        for (method, path, body) in [
            (
                "PUT",
                "secrets/s",
                json!({"path": "/run/s", "on_fork": "keep", "value_b64": "eA=="}),
            ),
            ("GET", "secrets", Value::Null),
            ("PUT", "contract", json!({"toml": ""})),
            ("GET", "contract", Value::Null),
            ("GET", "effects", Value::Null),
            (
                "POST",
                "effects/resolve",
                json!({"key": "k", "resend": true}),
            ),
            ("GET", "disks", Value::Null),
            ("POST", "console", json!({"line": "x"})),
            ("POST", "stop", json!({})),
            ("POST", "kill", json!({})),
            ("POST", "sleep", json!({})),
            ("POST", "checkpoints", json!({})),
            ("POST", "rollback", json!({"tag": "t"})),
            ("POST", "snapshot", json!({"dir": "/tmp/tined-api-never"})),
            ("POST", "exec", json!({"argv": ["true"]})),
        ] {
            let b = if body.is_null() {
                Vec::new()
            } else {
                body.to_string().into_bytes()
            };
            t.req(method, &format!("/v1/vms/{name}/{path}"), &[], b)
                .expect_error(400, "invalid_input");
        }
        t.post(&format!("/v1/branches/{name}/wake"), json!({}))
            .expect_error(400, "invalid_input");
    }
    // No file was made outside the home's own places (locks/ in particular).
    let mut top: Vec<String> = std::fs::read_dir(&t.home)
        .expect("the home")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".lock"))
        .collect();
    top.sort();
    assert_eq!(top, ["tined.lock"], "lock files beside the home's own");
    assert!(!std::path::Path::new("/tmp/tined-api-never").exists());
    for name in ["../x", "a/b", "/abs", "", "x\u{0}y", &"n".repeat(49)] {
        t.post(
            "/v1/vms",
            json!({"name": name, "image": "micro-counter", "no_agent": true}),
        )
        .expect_error(400, "invalid_input");
        t.post("/v1/vms/v/fork", json!({"names": [name]}))
            .expect_error(400, "invalid_input");
        t.post("/v1/vms/v/checkpoints", json!({"tag": name}))
            .expect_error(400, "invalid_input");
        t.post("/v1/vms/v/rollback", json!({"tag": name}))
            .expect_error(400, "invalid_input");
    }
    // Paths a client gives are absolute; images and snapshots that are
    // not there are not found.
    for spec in [
        json!({"name": "z", "image": "../../etc", "no_agent": true}),
        json!({"name": "z", "kernel": "vmlinux", "no_agent": true}),
        json!({"name": "z", "from": "snap", "no_agent": true}),
        json!({"name": "z", "image": "micro-counter", "disks": ["disk.raw"], "no_agent": true}),
    ] {
        t.post("/v1/vms", spec).expect_error(400, "invalid_input");
    }
    t.post(
        "/v1/vms",
        json!({"name": "z", "image": "no-such-image", "no_agent": true}),
    )
    .expect_error(404, "not_found");
    t.post(
        "/v1/vms",
        json!({"name": "z", "image": "micro-nothing", "no_agent": true}),
    )
    .expect_error(404, "not_found");
    t.post(
        "/v1/vms",
        json!({"name": "z", "from": "/nonexistent/snap", "no_agent": true}),
    )
    .expect_error(404, "not_found");
    t.post(
        "/v1/vms",
        json!({"name": "z", "kernel": "/nonexistent/vmlinux", "no_agent": true}),
    )
    .expect_error(400, "invalid_input");
    t.post(
        "/v1/vms",
        json!({"name": "z", "image": "micro-counter", "no_agent": true, "vcpus": 0}),
    )
    .expect_error(400, "invalid_input");
    t.post(
        "/v1/vms",
        json!({"name": "z", "image": "micro-counter", "no_agent": true, "mem_mib": 1}),
    )
    .expect_error(400, "invalid_input");
    // A name that is taken.
    t.post(
        "/v1/vms",
        json!({"name": "v", "image": "micro-counter", "no_agent": true}),
    )
    .expect_error(409, "conflict");
    // A contract that does not parse.
    t.put(
        "/v1/vms/v/contract",
        json!({"toml": "this is = = not toml"}),
    )
    .expect_error(400, "invalid_input");
    t.post("/v1/vms/v/fork", json!({"count": 1, "contract": "[[[bad"}))
        .expect_error(400, "invalid_input");

    // Guest files and exec: bad guest paths first, then: this vm has no agent.
    for p in [
        "../etc/passwd",
        "etc/passwd",
        "/a/../../etc/passwd",
        "/a%00b",
    ] {
        t.get(&format!("/v1/vms/v/files?path={p}"))
            .expect_error(400, "invalid_input");
        t.req(
            "PUT",
            &format!("/v1/vms/v/files?path={p}"),
            &[],
            b"x".to_vec(),
        )
        .expect_error(400, "invalid_input");
    }
    t.req(
        "PUT",
        "/v1/vms/v/files?path=/tmp/x&mode=999",
        &[],
        b"x".to_vec(),
    )
    .expect_error(400, "invalid_input");
    let m = t
        .post("/v1/vms/v/exec", json!({"argv": ["uname"]}))
        .expect_error(400, "invalid_input");
    assert!(m.contains("agent"), "{m}");
    let m = t
        .get("/v1/vms/v/files?path=/etc/hostname")
        .expect_error(400, "invalid_input");
    assert!(m.contains("agent"), "{m}");
    t.req("PUT", "/v1/vms/v/files?path=/tmp/x", &[], b"hello".to_vec())
        .expect_error(400, "invalid_input");
    t.req(
        "POST",
        "/v1/vms/v/attach",
        &[("connection", "upgrade"), ("upgrade", "tine-agent")],
        Vec::new(),
    )
    .expect_error(400, "invalid_input");
    t.post("/v1/vms/v/attach", json!({}))
        .expect_error(400, "invalid_input");
    // Idempotency keys that are not one.
    let long = "k".repeat(1000);
    t.req(
        "POST",
        "/v1/vms/v/fork",
        &[("idempotency-key", long.as_str())],
        json!({"count": 1}).to_string().into_bytes(),
    )
    .expect_error(400, "invalid_input");
    // Others.
    t.post("/v1/gateway", json!({"action": "explode"}))
        .expect_error(400, "invalid_input");
    t.post("/v1/images", json!({"kind": "windows"}))
        .expect_error(400, "invalid_input");
    t.post(
        "/v1/images",
        json!({"kind": "minimal", "agent": "rel/agent"}),
    )
    .expect_error(400, "invalid_input");

    assert_eq!(t.snapshot_state(), before, "bad requests change nothing");
    assert_eq!(
        vmm_processes(&t.home),
        procs,
        "bad requests start or end no process"
    );
    // The vm is unharmed.
    let c = last_cnt(&t, "v");
    t.wait_line("v", 0, |l| {
        l.strip_prefix("CNT ")
            .and_then(|n| n.parse::<u64>().ok())
            .is_some_and(|n| n > c)
    });
}

// ------------------------------------------------------------------ idempotency

#[test]
fn test_idempotency_keys_on_run_and_fork() {
    if !kvm_available() {
        return;
    }
    let mut t = Tined::start("idem");
    let spec = json!({"name": "i", "image": "micro-counter", "mem_mib": 64, "no_agent": true});
    let body = spec.to_string().into_bytes();
    let k = [("idempotency-key", "run-1")];
    let first = t.req("POST", "/v1/vms", &k, body.clone());
    let a = first.expect(201);
    assert_eq!(first.header("idempotent-replay"), None);
    let again = t.req("POST", "/v1/vms", &k, body.clone());
    assert_eq!(again.expect(201), a, "a repeat gets the first answer");
    assert_eq!(again.header("idempotent-replay").as_deref(), Some("true"));
    assert_eq!(t.states(), [("i".to_string(), "running".to_string())]);
    let vmms = vmm_processes(&t.home);
    assert_eq!(vmms.len(), 1, "one vm, one process: {vmms:?}");
    // The same key with another request: 422, nothing runs.
    let other = json!({"name": "i2", "image": "micro-counter", "mem_mib": 64, "no_agent": true});
    t.req("POST", "/v1/vms", &k, other.to_string().into_bytes())
        .expect_error(422, "conflict");
    t.get("/v1/vms/i2").expect_error(404, "not_found");
    // Without a key the same request is a new one: the name is taken.
    t.req("POST", "/v1/vms", &[], body.clone())
        .expect_error(409, "conflict");
    // A refused request (4xx: nothing was done) is not kept: once its
    // cause is gone, the same key runs.
    let k2 = [("idempotency-key", "run-2")];
    let b2 = json!({"name": "j", "image": "micro-counter", "mem_mib": 64, "no_agent": true})
        .to_string()
        .into_bytes();
    t.run("j", "micro-counter");
    t.req("POST", "/v1/vms", &k2, b2.clone())
        .expect_error(409, "conflict");
    t.delete("/v1/vms/j?force=true").expect(200);
    let ran = t.req("POST", "/v1/vms", &k2, b2.clone());
    ran.expect(201);
    assert_eq!(ran.header("idempotent-replay"), None, "it ran");
    let again = t.req("POST", "/v1/vms", &k2, b2);
    assert_eq!(again.header("idempotent-replay").as_deref(), Some("true"));
    t.delete("/v1/vms/j?force=true").expect(200);

    // fork: same key, same children; no second fork.
    t.wait_line("i", 0, |l| l.starts_with("CNT 1"));
    let fk = [("idempotency-key", "fork-1")];
    let fork = json!({"count": 2}).to_string().into_bytes();
    let f1 = t
        .req("POST", "/v1/vms/i/fork", &fk, fork.clone())
        .expect(200);
    assert_eq!(f1["names"], json!(["i-1", "i-2"]));
    let r2 = t.req("POST", "/v1/vms/i/fork", &fk, fork.clone());
    assert_eq!(r2.expect(200), f1);
    assert_eq!(r2.header("idempotent-replay").as_deref(), Some("true"));
    assert_eq!(
        t.states()
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>(),
        ["i", "i-1", "i-2"],
        "no second fork"
    );
    t.req(
        "POST",
        "/v1/vms/i/fork",
        &fk,
        json!({"count": 3}).to_string().into_bytes(),
    )
    .expect_error(422, "conflict");
    // The key belongs to the request (path included): the same key on another vm's fork.
    t.req("POST", "/v1/vms/i-1/fork", &fk, fork.clone())
        .expect_error(422, "conflict");

    // Concurrent repeats of one key: one fork, everyone gets its answer.
    let ck = [("idempotency-key", "fork-2")];
    let answers: Vec<Value> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..3)
            .map(|_| {
                sc.spawn(|| {
                    t.req("POST", "/v1/vms/i/fork", &ck, fork.clone())
                        .expect(200)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().expect("a thread"))
            .collect()
    });
    assert!(answers.windows(2).all(|w| w[0] == w[1]), "{answers:?}");
    assert_eq!(answers[0]["names"], json!(["i-3", "i-4"]));
    assert_eq!(t.states().len(), 5, "{:?}", t.states());

    // Answers survive a restart of tined (kept in the home): a retry
    // after it does not fork again.
    t.restart();
    let r3 = t.req("POST", "/v1/vms/i/fork", &fk, fork.clone());
    assert_eq!(r3.expect(200), f1);
    assert_eq!(r3.header("idempotent-replay").as_deref(), Some("true"));
    assert_eq!(t.states().len(), 5, "{:?}", t.states());
}

// ------------------------------------------------------------------ concurrency

#[test]
fn test_concurrent_operations_on_one_vm() {
    if !kvm_available() {
        return;
    }
    let t = Tined::start("concurrent");
    counter(&t, "c");

    // Two forks at once: both succeed (one after the other), four children.
    let (a, b) = std::thread::scope(|sc| {
        let a = sc.spawn(|| t.post("/v1/vms/c/fork", json!({"count": 2})));
        let b = sc.spawn(|| t.post("/v1/vms/c/fork", json!({"count": 2})));
        (a.join().expect("a"), b.join().expect("b"))
    });
    let mut names = Vec::new();
    for r in [&a, &b] {
        // Serialized by the vm's lock: both succeed (busy, 409, only after 120 s).
        let v = r.expect(200);
        for res in v["results"].as_array().expect("results") {
            assert_eq!(res["ok"], true, "{v}");
            names.push(res["name"].as_str().expect("a name").to_string());
        }
    }
    names.sort();
    assert_eq!(names, ["c-1", "c-2", "c-3", "c-4"], "distinct children");
    let states = t.states();
    assert_eq!(states.len(), 5, "{states:?}");
    assert!(states.iter().all(|(_, s)| s == "running"), "{states:?}");
    // Each child is its own process, and there is no other.
    let procs = vmm_processes(&t.home);
    assert_eq!(procs.len(), 5, "{procs:?}");

    // fork and rm at once: the rm waits for the fork (or the fork finds
    // no vm); either way nothing is half done.
    let parent_pid = pid_of(&t.get("/v1/vms/c").expect(200));
    let (f, rm) = std::thread::scope(|sc| {
        let f = sc.spawn(|| t.post("/v1/vms/c/fork", json!({"names": ["f1", "f2"]})));
        let rm = sc.spawn(|| t.delete("/v1/vms/c?force=true"));
        (f.join().expect("fork"), rm.join().expect("rm"))
    });
    rm.expect(200);
    assert!(wait_gone(&[parent_pid]).is_empty(), "the parent ended");
    t.get("/v1/vms/c").expect_error(404, "not_found");
    match f.status {
        200 => {
            for c in ["f1", "f2"] {
                assert_eq!(
                    t.get(&format!("/v1/vms/{c}")).expect(200)["state"],
                    "running"
                );
            }
        }
        404 => {
            f.expect_error(404, "not_found");
            t.get("/v1/vms/f1").expect_error(404, "not_found");
        }
        s => panic!("fork during rm: {s} {}", f.text()),
    }
    // Records and processes agree: one process per running vm.
    let running: Vec<u64> = t
        .get("/v1/vms")
        .expect(200)
        .as_array()
        .expect("a list")
        .iter()
        .filter(|v| v["state"] == "running")
        .map(pid_of)
        .collect();
    let mut pids: Vec<u64> = vmm_processes(&t.home)
        .iter()
        .map(|v| u64::from(v.pid))
        .collect();
    pids.sort_unstable();
    let mut want = running.clone();
    want.sort_unstable();
    assert_eq!(
        pids, want,
        "no process without a vm, no vm without a process"
    );

    // Two runs of one name at once: one wins, the other is a clear 409,
    // and only one process runs.
    let spec = json!({"name": "dup", "image": "micro-counter", "mem_mib": 64, "no_agent": true});
    let rs: Vec<common::Resp> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..3)
            .map(|_| sc.spawn(|| t.post("/v1/vms", spec.clone())))
            .collect();
        hs.into_iter().map(|h| h.join().expect("run")).collect()
    });
    let won: Vec<&common::Resp> = rs.iter().filter(|r| r.status == 201).collect();
    assert_eq!(won.len(), 1, "one run wins: {rs:?}");
    for r in rs.iter().filter(|r| r.status != 201) {
        let m = r.expect_error(409, "conflict");
        assert!(m.contains("dup"), "{m}");
    }
    let dups: Vec<_> = vmm_processes(&t.home)
        .into_iter()
        .filter(|v| v.title == "tine-vmm dup")
        .collect();
    assert_eq!(dups.len(), 1, "no leaked process: {dups:?}");
    assert_eq!(u64::from(dups[0].pid), pid_of(&won[0].json()));
}

// ------------------------------------------------------------------ events, metrics

#[test]
fn test_event_stream_shows_the_lifecycle() {
    if !kvm_available() {
        return;
    }
    let t = Tined::start("events");
    let events = t.sse("/v1/events");
    assert_eq!(events.status, 200);
    assert_eq!(events.content_type.as_deref(), Some("text/event-stream"));
    memtouch(&t, "e");
    t.post("/v1/vms/e/fork", json!({"names": ["e1"]}))
        .expect(200);
    t.post("/v1/vms/e/checkpoints", json!({"tag": "t"}))
        .expect(201);
    t.post("/v1/vms/e/rollback", json!({"tag": "t"}))
        .expect(200);
    t.delete("/v1/vms/e/checkpoints/t").expect(200);
    t.operation_ok("/v1/vms/e1/sleep", json!({}));
    t.operation_ok("/v1/branches/e1/wake", json!({}));
    t.delete("/v1/vms/e1?force=true").expect(200);
    t.delete("/v1/vms/e?force=true").expect(200);

    let want = [
        ("vm.started", "e"),
        ("vm.forked", "e"),
        ("vm.checkpointed", "e"),
        ("vm.rolled_back", "e"),
        ("checkpoint.removed", "e@t"),
        ("vm.slept", "e1"),
        ("branch.woken", "e1"),
        ("vm.removed", "e1"),
        ("vm.removed", "e"),
    ];
    let seen = events.until(Duration::from_secs(30), |ev, v| {
        ev == "vm.removed" && v["subject"] == "e"
    });
    // Every event: its type as the SSE event name, a seq that increases.
    let mut last = 0;
    for (ev, v) in &seen {
        assert_eq!(v["type"], ev.as_str(), "{v}");
        let seq = v["seq"].as_u64().expect("a seq");
        assert!(seq > last, "seq increases: {seen:?}");
        last = seq;
        assert!(v["ts_ms"].as_u64().is_some(), "{v}");
    }
    // The lifecycle, in order (other events, process exits and operations, between).
    let lifecycle: Vec<(String, String)> = seen
        .iter()
        .filter(|(ev, _)| !ev.starts_with("process.") && !ev.starts_with("operation."))
        .map(|(ev, v)| {
            (
                ev.clone(),
                v["subject"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    assert_eq!(lifecycle, want, "all events: {seen:#?}");
    let forked = seen
        .iter()
        .find(|(ev, _)| ev == "vm.forked")
        .map(|(_, v)| v["detail"]["children"].clone());
    assert_eq!(forked, Some(json!(["e1"])));
    assert!(
        seen.iter()
            .any(|(ev, v)| ev == "operation.finished" && v["detail"]["kind"] == "sleep"),
        "{seen:#?}"
    );
    // (No vm.exited above: a fork, checkpoint or rollback moves the vm to
    // a new process, a sleep or rm removes it; that the old process ends
    // is no vm's exit.)

    // A guest that resets: its VMM ends; the event names the vm.
    let x = memtouch(&t, "x");
    t.post("/v1/vms/x/console", json!({"line": "reset"}))
        .expect(204);
    let seen = events.until(Duration::from_secs(20), |ev, v| {
        ev == "vm.exited" && v["subject"] == "x"
    });
    let (_, ex) = seen.last().expect("vm.exited");
    assert_eq!(ex["detail"]["pid"].as_u64(), Some(pid_of(&x)), "{ex}");
    assert_ne!(t.get("/v1/vms/x").expect(200)["state"], "running");
}

/// The value of the sample `name` (with its labels, as written) in a
/// Prometheus text exposition.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[test]
fn test_metrics() {
    if !kvm_available() {
        return;
    }
    let t = Tined::start("metrics");
    let r = t.get("/metrics");
    let text = r.expect_text(200);
    assert!(
        r.header("content-type").is_some_and(|c| c.contains("text")),
        "{:?}",
        r.headers
    );
    assert_eq!(
        metric(&text, "tine_fork_pause_seconds_count"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "tine_vms{state=\"running\"}"),
        Some(0.0),
        "{text}"
    );

    memtouch(&t, "p");
    touch(&t, "p", 8, 1);
    t.post("/v1/vms/p/fork", json!({"count": 3})).expect(200);
    t.operation_ok("/v1/vms/p-3/sleep", json!({}));
    t.operation_ok("/v1/branches/p-3/wake", json!({"name": "lz", "lazy": true}));
    // The lazily woken vm pages memory in as it reads it.
    touch(&t, "lz", 8, 2);
    t.post("/v1/vms/p-1/kill", json!({})).expect(200);
    // A failed wake is not a wake.
    t.post("/v1/branches/p-3/wake", json!({"name": "p"}))
        .expect_error(409, "conflict");

    let text = t.get("/metrics").expect_text(200);
    for h in ["tine_fork_pause_seconds", "tine_fork_child_running_seconds"] {
        assert!(
            text.contains(&format!("# TYPE {h} histogram")),
            "{h}: {text}"
        );
        assert_eq!(
            metric(&text, &format!("{h}_count")),
            Some(if h.contains("child") { 3.0 } else { 1.0 }),
            "{h}: {text}"
        );
        assert!(
            metric(&text, &format!("{h}_sum")).is_some_and(|s| s > 0.0),
            "{h}: {text}"
        );
        assert!(
            metric(&text, &format!("{h}_bucket{{le=\"+Inf\"}}")).is_some(),
            "{h} buckets: {text}"
        );
    }
    assert_eq!(metric(&text, "tine_forks_total"), Some(1.0), "{text}");
    assert_eq!(
        metric(&text, "tine_wakes_total{kind=\"boot\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "tine_wakes_total{kind=\"child\"}"),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "tine_wakes_total{kind=\"branch\"}"),
        Some(1.0),
        "{text}"
    );
    // p, p-2, lz run; p-1 was killed; p-3 sleeps.
    assert_eq!(
        metric(&text, "tine_vms{state=\"running\"}"),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "tine_vms{state=\"stopped\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "tine_vms{state=\"sleeping\"}"),
        Some(1.0),
        "{text}"
    );
    assert!(
        metric(&text, "tine_store_stored_bytes").is_some_and(|b| b > 0.0),
        "{text}"
    );
    assert!(
        metric(&text, "tine_pagein_faults").is_some_and(|f| f > 0.0),
        "a lazy wake faults pages in: {text}"
    );
    assert!(
        metric(
            &text,
            "tine_api_requests_total{method=\"POST\",status=\"409\"}"
        ) >= Some(1.0),
        "{text}"
    );
    assert!(
        metric(&text, "tine_operations_total{kind=\"sleep.ok\"}") == Some(1.0),
        "{text}"
    );
    assert!(text.trim_end().ends_with("# EOF"), "{text}");

    // Request labels stay a small set whatever methods clients invent.
    for m in ["FOO", "BAR1", "BAZ2"] {
        t.req(m, "/v1/vms", &[], Vec::new())
            .expect_error(405, "method_not_allowed");
    }
    let text = t.get("/metrics").expect_text(200);
    assert!(!text.contains("FOO") && !text.contains("BAZ2"), "{text}");
    assert!(
        metric(
            &text,
            "tine_api_requests_total{method=\"other\",status=\"405\"}"
        ) == Some(3.0),
        "{text}"
    );
}

// ------------------------------------------------------------------ listeners

#[test]
fn test_tcp_listener_needs_the_bearer_token() {
    if !kvm_available() {
        return;
    }
    let token = "tok-0123456789abcdef-xyz";
    let t = Tined::start_tcp("tcp", token);
    let (addr, _) = t.tcp.clone().expect("a TCP listener");
    let tcp = common::Addr::Tcp(addr);
    let call = |method: &str, path: &str, auth: Option<&str>, body: Value| {
        let h: Vec<(&str, &str)> = auth.map(|a| ("authorization", a)).into_iter().collect();
        let b = if body.is_null() {
            Vec::new()
        } else {
            body.to_string().into_bytes()
        };
        common::call(&tcp, method, path, &h, b).expect("an answer")
    };
    let run = json!({"name": "n", "image": "micro-counter", "mem_mib": 64, "no_agent": true});
    let wrong_bearer = format!("Bearer {token}x");
    let short_bearer = format!("Bearer {}", &token[..token.len() - 1]);
    let basic = format!("Basic {token}");
    for auth in [
        None,
        Some("Bearer nope"),
        Some(wrong_bearer.as_str()),
        Some(short_bearer.as_str()),
        Some(basic.as_str()),
        Some(token),
        Some("Bearer"),
    ] {
        for (m, p, b) in [
            ("GET", "/v1/vms", Value::Null),
            ("GET", "/v1/health", Value::Null),
            ("POST", "/v1/vms", run.clone()),
            ("DELETE", "/v1/vms/n?force=true", Value::Null),
            ("GET", "/v1/nothing", Value::Null),
        ] {
            let r = call(m, p, auth, b);
            let msg = r.expect_error(401, "unauthorized");
            assert!(msg.contains("Bearer"), "{msg}");
            assert!(
                r.header("www-authenticate")
                    .is_some_and(|w| w.starts_with("Bearer")),
                "{:?}",
                r.headers
            );
        }
    }
    // Nothing was run.
    assert_eq!(t.get("/v1/vms").expect(200), json!([]));

    // The right token works (the scheme in any case).
    let right = format!("Bearer {token}");
    assert_eq!(
        call("GET", "/v1/vms", Some(&right), Value::Null).expect(200),
        json!([])
    );
    let lower = format!("bearer {token}");
    assert_eq!(
        call("GET", "/v1/health", Some(&lower), Value::Null).expect(200)["ok"],
        true
    );
    call("POST", "/v1/vms", Some(&right), run).expect(201);
    assert_eq!(t.states(), [("n".to_string(), "running".to_string())]);
    call("DELETE", "/v1/vms/n?force=true", Some(&right), Value::Null).expect(200);
    assert_eq!(t.get("/v1/vms").expect(200), json!([]));
    assert!(
        t.log().contains(&addr.to_string()),
        "the log names the address"
    );

    // The socket is the owner's alone.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(t.home.join("tined.sock"))
        .expect("the socket")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "{mode:o}");

    // One tined per home: a second refuses, naming the first.
    let out = std::process::Command::new(common::tined_bin())
        .arg("--home")
        .arg(&t.home)
        .env("TINE_HOME", &t.home)
        .output()
        .expect("a second tined");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already serves") && err.contains(&t.pid().to_string()),
        "{err}"
    );
    // The first still answers.
    t.get("/v1/health").expect(200);

    // A short token is refused at start.
    let (_dir, home) = common::temp_home("tcp-short");
    std::fs::write(home.join("token"), "short\n").expect("token");
    let out = std::process::Command::new(common::tined_bin())
        .arg("--home")
        .arg(&home)
        .args([
            "--tcp".to_string(),
            common::free_port().to_string(),
            "--token-file".into(),
            home.join("token").display().to_string(),
        ])
        .env("TINE_HOME", &home)
        .env_remove("TINED_TOKEN")
        .output()
        .expect("tined");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("16 or more characters"), "{err}");
}

#[test]
fn test_api_keys_open_the_tcp_listener() {
    // No token: closed until the owner makes a key (over the Unix socket).
    let t = Tined::start_tcp_keys("keys");
    let (addr, _) = t.tcp.clone().expect("a TCP listener");
    let tcp = common::Addr::Tcp(addr);
    let call = |method: &str, path: &str, h: &[(&str, &str)]| {
        common::call(&tcp, method, path, h, Vec::new()).expect("an answer")
    };
    call("GET", "/v1/vms", &[]).expect_error(401, "unauthorized");
    assert!(
        t.log().contains("every TCP request is refused"),
        "{}",
        t.log()
    );
    let made = t
        .req(
            "POST",
            "/v1/keys",
            &[],
            json!({"name": "ci"}).to_string().into_bytes(),
        )
        .expect(201);
    let key = made["key"].as_str().expect("the key").to_string();
    assert!(key.starts_with("tine_") && made["prefix"] == key[..9]);
    let listed = t.get("/v1/keys").expect(200);
    assert_eq!(listed[0]["id"], made["id"]);
    assert!(!listed.to_string().contains(&key), "the key is shown once");
    let bearer = format!("Bearer {key}");
    assert_eq!(
        call("GET", "/v1/vms", &[("authorization", &bearer)]).expect(200),
        json!([])
    );
    assert_eq!(
        call("GET", "/v1/vms", &[("x-api-key", &key)]).expect(200),
        json!([])
    );
    // A key names no host file outside tine's home (the owner may).
    let post = |path: &str, body: serde_json::Value| {
        common::call(
            &tcp,
            "POST",
            path,
            &[("x-api-key", &key), ("content-type", "application/json")],
            body.to_string().into_bytes(),
        )
        .expect("an answer")
    };
    for body in [
        json!({"name": "x", "image": "micro-counter", "disks": ["/etc/shadow"]}),
        json!({"name": "x", "kernel": "/etc/passwd"}),
        json!({"name": "x", "from": "/tmp"}),
        json!({"name": "x", "image": "micro-counter", "disks": [format!("{}/../../etc/shadow", t.home.display())]}),
    ] {
        let r = post("/v1/vms", body.clone());
        r.expect_error(403, "forbidden");
    }
    post("/v1/vms/none/snapshot", json!({"dir": "/etc/cron.d/x"})).expect_error(403, "forbidden");
    // A key does not manage keys.
    call("GET", "/v1/keys", &[("x-api-key", &key)]).expect_error(403, "forbidden");
    call(
        "DELETE",
        &format!("/v1/keys/{}", made["id"].as_str().unwrap_or("")),
        &[("x-api-key", &key)],
    )
    .expect_error(403, "forbidden");
    // Nor is a sandbox token a key: an envd token opens only its
    // sandbox's envd paths, and a sandbox that is not there is not found.
    let envd = [
        ("x-access-token", key.as_str()),
        ("e2b-sandbox-id", "sbx-none"),
    ];
    call("GET", "/v1/vms", &[("x-access-token", &key)]).expect_error(401, "unauthorized");
    assert_eq!(call("GET", "/health", &envd).status, 502);
    // Revoked: refused at once; the keys outlive a restart of tined.
    let id = made["id"].as_str().expect("id").to_string();
    let second = t
        .req(
            "POST",
            "/v1/keys",
            &[],
            json!({"name": "other"}).to_string().into_bytes(),
        )
        .expect(201)["key"]
        .as_str()
        .expect("key")
        .to_string();
    t.req("DELETE", &format!("/v1/keys/{id}"), &[], Vec::new())
        .expect(200);
    call("GET", "/v1/vms", &[("x-api-key", &key)]).expect_error(401, "unauthorized");
    t.req("DELETE", &format!("/v1/keys/{id}"), &[], Vec::new())
        .expect_error(404, "not_found");
    t.req(
        "POST",
        "/v1/keys",
        &[],
        json!({"name": ""}).to_string().into_bytes(),
    )
    .expect_error(400, "invalid_input");
    let mode = std::fs::metadata(t.home.join("keys.json"))
        .expect("keys.json")
        .permissions();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(mode.mode() & 0o777, 0o600);
    let text = std::fs::read_to_string(t.home.join("keys.json")).expect("keys.json");
    assert!(!text.contains(&second), "only hashes are kept");
}

// ------------------------------------------------------------------ the document

const REGENERATE: &str =
    "regenerate it: cargo build -p tined && target/debug/tined openapi > docs/api/openapi.json";

fn checked_in_document() -> String {
    let p = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/api/openapi.json");
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}; {REGENERATE}", p.display()))
}

/// Where two texts first differ, for a failure message.
fn first_difference(a: &str, b: &str) -> String {
    let line = a
        .lines()
        .zip(b.lines())
        .position(|(x, y)| x != y)
        .unwrap_or_else(|| a.lines().count().min(b.lines().count()));
    format!(
        "line {}: checked in {:?}, served {:?}",
        line + 1,
        a.lines().nth(line).unwrap_or("(end)"),
        b.lines().nth(line).unwrap_or("(end)")
    )
}

#[test]
fn test_served_document_equals_docs_api_openapi_json() {
    let file = checked_in_document();
    // What `tined openapi` prints.
    let out = std::process::Command::new(common::tined_bin())
        .arg("openapi")
        .output()
        .expect("tined openapi");
    assert!(out.status.success());
    let printed = String::from_utf8(out.stdout).expect("UTF-8");
    assert!(
        printed == file,
        "docs/api/openapi.json differs from `tined openapi` ({}); {REGENERATE}",
        first_difference(&file, &printed)
    );
    // What a running tined serves.
    let t = Tined::start("openapi");
    let r = t.get("/v1/openapi.json");
    let served = r.expect_text(200);
    assert_eq!(
        r.header("content-type").as_deref(),
        Some("application/json")
    );
    assert!(
        served == file,
        "docs/api/openapi.json differs from GET /v1/openapi.json ({}); {REGENERATE}",
        first_difference(&file, &served)
    );
    let doc: Value = serde_json::from_str(&served).expect("JSON");
    assert!(
        doc["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1")),
        "OpenAPI 3.1"
    );
}

/// The routes of `crates/tined/src/router.rs`: `(METHOD, path)` of every
/// `.route("PATH", get(..).post(..))`.
fn router_routes() -> Vec<(String, String)> {
    let src = include_str!("../src/router.rs");
    let mut out = Vec::new();
    let mut rest = src;
    while let Some(i) = rest.find(".route(") {
        rest = &rest[i + ".route(".len()..];
        // The call's text, up to its closing parenthesis.
        let mut depth = 1;
        let end = rest
            .char_indices()
            .find(|&(_, c)| {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                depth == 0
            })
            .map(|(i, _)| i)
            .expect("a closed .route(");
        let call = &rest[..end];
        let path = call
            .split('"')
            .nth(1)
            .expect("a path literal first")
            .to_string();
        let methods = &call[call.find(',').expect("a method router")..];
        for m in ["get", "post", "put", "delete", "patch"] {
            // `get(`, `.post(`, `axum::routing::put(`: a word of its own.
            let mut at = 0;
            while let Some(j) = methods[at..].find(&format!("{m}(")) {
                let k = at + j;
                let before = methods[..k].chars().next_back();
                if !before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                    out.push((m.to_uppercase(), path.clone()));
                }
                at = k + m.len();
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

fn document_routes(doc: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for m in item.as_object().expect("a path item").keys() {
            if ["get", "post", "put", "delete", "patch"].contains(&m.as_str()) {
                out.push((m.to_uppercase(), path.clone()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn test_every_route_is_in_the_document_and_answers() {
    let doc: Value = serde_json::from_str(&checked_in_document()).expect("JSON");
    let routes = router_routes();
    assert!(
        routes.len() > 40,
        "the router's routes were found: {routes:?}"
    );
    let documented = document_routes(&doc);
    let missing: Vec<_> = routes.iter().filter(|r| !documented.contains(r)).collect();
    let extra: Vec<_> = documented.iter().filter(|r| !routes.contains(r)).collect();
    assert!(
        missing.is_empty(),
        "routes of router.rs missing from the document (add #[utoipa::path] to the handler and list it in openapi.rs, then {REGENERATE}): {missing:?}"
    );
    assert!(
        extra.is_empty(),
        "the document has routes router.rs does not serve: {extra:?}"
    );

    // Every documented route is served by its handler: no 404 from the
    // fallback and no 405 (names that exist nowhere, so nothing changes).
    let t = Tined::start("routes");
    for (method, path) in &documented {
        let p = path
            .replace("{name}", "no-such-vm")
            .replace("{tag}", "no-such-tag")
            .replace("{secret}", "no-such-secret")
            .replace("{id}", "op-none");
        // Not these: one ends tined, the other streams until it ends.
        if p == "/v1/shutdown" || p == "/v1/events" {
            continue;
        }
        let body = if method == "GET" || method == "DELETE" {
            Vec::new()
        } else {
            b"{}".to_vec()
        };
        let r = t.req(method, &p, &[], body);
        assert_ne!(r.status, 405, "{method} {p}: {}", r.text());
        if r.status == 404 {
            let m = r.expect_error(404, "not_found");
            assert!(
                !m.contains("no such endpoint"),
                "{method} {p} is not routed: {m}"
            );
        }
        if r.status >= 400 {
            r.expect_error(r.status, r.json()["code"].as_str().unwrap_or("?"));
        }
    }
}

// ------------------------------------------------------------------ streams, restarts

#[test]
fn test_console_follow_streams_until_the_vm_ends() {
    if !kvm_available() {
        return;
    }
    let t = Tined::start("console");
    let r = counter(&t, "k");
    let mut follow = t.chunks("/v1/vms/k/console?follow=true");
    assert_eq!(follow.status, 200);
    // New lines arrive as the guest prints them.
    let have = last_cnt(&t, "k");
    let next = format!("CNT {}\n", have + 3);
    assert!(
        follow.until(Duration::from_secs(10), |s| s.contains(&next)),
        "the stream goes on: {:?}",
        follow.text
    );
    assert!(
        follow.text.contains("READY"),
        "from the start: {:?}",
        follow.text
    );
    // It ends when the vm does.
    t.post("/v1/vms/k/kill", json!({})).expect(200);
    assert!(wait_gone(&[pid_of(&r)]).is_empty());
    follow.until(Duration::from_secs(10), |_| false);
    assert!(follow.ended, "the stream ends with the vm");
    // Without follow: what there is, then the end.
    let mut once = t.chunks("/v1/vms/k/console");
    once.until(Duration::from_secs(10), |_| false);
    assert!(once.ended && once.text.contains("CNT"), "{:?}", once.text);
}

#[test]
fn test_shutdown_leaves_vms_running_and_the_next_tined_adopts_them() {
    if !kvm_available() {
        return;
    }
    let mut t = Tined::start("shutdown");
    let a = memtouch(&t, "a");
    let s1 = touch(&t, "a", 8, 9);
    t.post("/v1/vms/a/checkpoints", json!({"tag": "t"}))
        .expect(201);
    let pid = pid_of(&t.get("/v1/vms/a").expect(200));
    assert_ne!(
        pid,
        pid_of(&a),
        "a checkpoint moves the vm to a new process"
    );
    t.post("/v1/shutdown", json!({})).expect(202);
    let st = t.wait_exit().expect("tined exits after a shutdown");
    assert!(st.success(), "{st}");
    assert!(!t.home.join("tined.sock").exists(), "the socket is removed");
    assert!(common::alive(pid), "the vm keeps running");

    t.start_again();
    let v = t.get("/v1/vms/a").expect(200);
    assert_eq!(v["state"], "running");
    assert_eq!(pid_of(&v), pid, "adopted, the same process");
    assert_eq!(sum(&t, "a", 8), s1);
    // Everything works on an adopted vm: its checkpoint, a fork.
    touch(&t, "a", 8, 10);
    t.post("/v1/vms/a/rollback", json!({"tag": "t"}))
        .expect(200);
    assert_eq!(sum(&t, "a", 8), s1);
    let f = t.post("/v1/vms/a/fork", json!({"count": 1})).expect(200);
    assert_eq!(f["results"][0]["ok"], true, "{f}");
    assert_eq!(sum(&t, "a-1", 8), s1);
}
