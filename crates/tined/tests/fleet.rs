//! A fleet on this machine: three tineds with their own homes, host ids
//! and network namespaces on one PostgreSQL (TINE_META) and one Garage
//! bucket (TINE_STORE), both real servers that `scripts/servers` starts
//! for the test and removes after it. Micro guests on this host's
//! /dev/kvm.

mod common;
#[path = "common/servers.rs"]
mod servers;

use std::process::Command;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{kvm_available, Tined};
use serde_json::{json, Value};
use servers::Servers;

/// Numbers for this process's addresses: 10.214.N.0/30 per host
/// namespace, 10.214.255.N for a test's servers.
fn next_number() -> u8 {
    static NEXT: AtomicU8 = AtomicU8::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    assert!(n < 255, "out of test addresses");
    n
}

#[track_caller]
fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An address on lo for one test's servers, which every host namespace
/// routes to; removed when dropped.
struct LoAddr(String);

impl LoAddr {
    fn new() -> LoAddr {
        let a = format!("10.214.255.{}", next_number());
        ip(&["addr", "add", &format!("{a}/32"), "dev", "lo"]);
        LoAddr(a)
    }
}

impl Drop for LoAddr {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["addr", "del", &format!("{}/32", self.0), "dev", "lo"])
            .status();
    }
}

/// A host's own network namespace, joined to this one by a veth pair
/// (10.214.N.1 here, .2 there) with its default route here, where the
/// servers are: hosts share nothing else, as machines do. Its vms' taps,
/// addresses and nftables rules are its own.
struct Netns {
    name: String,
}

impl Netns {
    fn new() -> Netns {
        let n = next_number();
        let pid = std::process::id() % 100_000;
        let name = format!("tine-fleet-{pid}-{n}");
        let (here, there) = (format!("tfa{pid}-{n}"), format!("tfb{pid}-{n}"));
        ip(&["netns", "add", &name]);
        let ns = Netns { name };
        ip(&[
            "link", "add", &here, "type", "veth", "peer", "name", &there, "netns", &ns.name,
        ]);
        ip(&["addr", "add", &format!("10.214.{n}.1/30"), "dev", &here]);
        ip(&["link", "set", &here, "up"]);
        let inside = |args: &[&str]| {
            let mut a = vec!["-n", ns.name.as_str()];
            a.extend_from_slice(args);
            ip(&a);
        };
        inside(&["addr", "add", &format!("10.214.{n}.2/30"), "dev", &there]);
        inside(&["link", "set", &there, "up"]);
        inside(&["link", "set", "lo", "up"]);
        inside(&["route", "add", "default", "via", &format!("10.214.{n}.1")]);
        ns
    }

    /// The IPv4 addresses on this namespace's interfaces.
    fn addresses(&self) -> String {
        let out = Command::new("ip")
            .args(["-n", &self.name, "-4", "-o", "addr"])
            .output()
            .expect("ip addr");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Its end of the veth goes with it, and so does ours.
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// One test's fleet: its servers on an address of their own, and a
/// network namespace per host. Dropped in that order (after the tineds,
/// which the tests make later).
struct World {
    servers: Servers,
    nets: Mutex<Vec<std::sync::Arc<Netns>>>,
    _lo: LoAddr,
}

impl World {
    fn start(tag: &str, garage_nodes: u32) -> World {
        let lo = LoAddr::new();
        World {
            servers: Servers::start_on(tag, garage_nodes, Some(&lo.0)),
            nets: Mutex::new(Vec::new()),
            _lo: lo,
        }
    }

    /// A new host namespace, kept until the test ends.
    fn netns(&self) -> std::sync::Arc<Netns> {
        let ns = std::sync::Arc::new(Netns::new());
        self.nets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(ns.clone());
        ns
    }
}

impl std::ops::Deref for World {
    type Target = Servers;
    fn deref(&self) -> &Servers {
        &self.servers
    }
}

/// The environment of fleet host `id`.
fn host_env(s: &World, id: &str, extra: &[(&str, String)]) -> Vec<(String, String)> {
    let mut env = s.env.clone();
    env.push(("TINE_HOST_ID".into(), id.into()));
    env.push(("TINE_HEARTBEAT_MS".into(), "300".into()));
    for (k, v) in extra {
        env.push((k.to_string(), v.clone()));
    }
    env
}

/// tined as fleet host `id`, in a network namespace of its own.
fn host(s: &World, id: &str, extra: &[(&str, String)]) -> Tined {
    host_in(s, id, extra, &s.netns())
}

fn host_in(s: &World, id: &str, extra: &[(&str, String)], ns: &Netns) -> Tined {
    Tined::start_env_in(id, &host_env(s, id, extra), &[], Some(&ns.name))
}

fn last_word(l: &str) -> String {
    l.split_whitespace().last().unwrap_or_default().to_string()
}

fn sum(t: &Tined, vm: &str, mib: u32) -> String {
    last_word(&t.ask(vm, &format!("sum {mib}"), "SUM"))
}

/// Starts micro-memtouch `name` on `t`, writes its first `mib` MiB from
/// `seed`; the checksum.
fn written(t: &Tined, name: &str, mib: u32, seed: u32) -> String {
    t.run(name, "micro-memtouch");
    t.wait_line(name, 0, |l| l.starts_with("READY"));
    last_word(&t.ask(name, &format!("touch {mib} {seed}"), "TOUCHED"))
}

fn hosts(t: &Tined) -> Value {
    t.get("/v1/hosts").expect(200)
}

fn state_of(view: &Value, id: &str) -> String {
    view["hosts"]
        .as_array()
        .and_then(|a| a.iter().find(|h| h["id"] == id))
        .map(|h| h["state"].as_str().unwrap_or_default().to_string())
        .unwrap_or_default()
}

/// An offer like `base` without SSE3 (CPUID leaf 1, ECX bit 0), which
/// every guest sees: a host that cannot take any of this host's snapshots.
fn narrower_offer(base: &Value) -> Value {
    let mut o = base.clone();
    if let Some(entries) = o["cpuid"].as_array_mut() {
        for e in entries {
            if e["function"] == 1 {
                let ecx = e["ecx"].as_u64().unwrap_or(0);
                e["ecx"] = json!(ecx & !1);
            }
        }
    }
    o
}

#[test]
fn test_sleep_on_one_host_wake_on_another_and_placement() {
    if !kvm_available() {
        return;
    }
    let s = World::start("wake", 1);
    let (ns1, ns2) = (s.netns(), s.netns());
    let h1 = host_in(&s, "h1", &[], &ns1);
    let h2 = host_in(&s, "h2", &[], &ns2);
    // h3 offers less than this CPU has: snapshots taken here cannot wake there.
    let offer = h1.get("/v1/hosts/self/offer").expect(200);
    let file = h1.home.join("narrow-offer.json");
    std::fs::write(&file, narrower_offer(&offer).to_string()).expect("offer file");
    let h3 = host(&s, "h3", &[("TINE_HOST_OFFER", file.display().to_string())]);

    let view = hosts(&h2);
    assert_eq!(view["this"], "h2", "{view}");
    for id in ["h1", "h2", "h3"] {
        assert_eq!(state_of(&view, id), "up", "{view}");
    }

    // A memtouch vm writes 8 MiB on h1, then sleeps into the shared store.
    let s1 = written(&h1, "w", 8, 5);
    let slept = h1.operation_ok("/v1/vms/w/sleep", json!({}));
    assert_eq!(slept["branch"], "w", "{slept}");

    // h2 sees the branch (one tree), and wakes it, asked on h1.
    let branches = h2.get("/v1/branches").expect(200);
    assert!(
        branches
            .as_array()
            .is_some_and(|b| b.iter().any(|b| b["name"] == "w")),
        "{branches}"
    );
    let woken = h1.operation_ok("/v1/branches/w/wake", json!({"host": "h2"}));
    assert_eq!(woken["name"], "w", "{woken}");
    assert_eq!(h2.get("/v1/vms/w").expect(200)["state"], "running");
    h1.get("/v1/vms/w").expect_error(404, "not_found");
    assert_eq!(
        sum(&h2, "w", 8),
        s1,
        "woken on h2 with the memory it had on h1"
    );
    // It goes on from there: written on h2, slept again.
    let s2 = last_word(&h2.ask("w", "touch 4 9", "TOUCHED"));
    h2.operation_ok("/v1/vms/w/sleep", json!({}));

    // h3 cannot take it, and says why.
    // (Placement answers before any operation starts.)
    let why = h2
        .post("/v1/branches/w/wake", json!({"host": "h3"}))
        .expect_error(409, "conflict");
    assert!(why.contains("h3") && why.contains("sse3"), "{why}");
    // Unpinned, placement passes h3 over; asked on h3, it goes elsewhere.
    let woken = h3.operation_ok("/v1/branches/w/wake", json!({}));
    assert_eq!(woken["name"], "w", "{woken}");
    let on: Vec<&str> = [("h1", &h1), ("h2", &h2), ("h3", &h3)]
        .iter()
        .filter(|(_, t)| t.get("/v1/vms/w").status == 200)
        .map(|(n, _)| *n)
        .collect();
    assert_eq!(on.len(), 1, "one host runs it: {on:?}");
    assert_ne!(on[0], "h3", "placement took h3, which cannot run it");
    let runner = if on[0] == "h1" { &h1 } else { &h2 };
    assert_eq!(sum(runner, "w", 4), s2);
    // Copies of the branch spread: one pinned on each of the other hosts.
    let other = if on[0] == "h1" {
        ("h2", &h2)
    } else {
        ("h1", &h1)
    };
    runner.operation_ok("/v1/vms/w/sleep", json!({}));
    let c = h3.operation_ok(
        "/v1/branches/w/wake",
        json!({"name": "w-copy", "host": other.0}),
    );
    assert_eq!(c["name"], "w-copy");
    assert_eq!(sum(other.1, "w-copy", 4), s2);

    // A fork of the sleeping branch into 4 spreads over the hosts that
    // can run it (h3 cannot), each child with the branch's memory.
    let f = h2.post("/v1/vms/w/fork", json!({"count": 4})).expect(200);
    let names: Vec<String> = f["names"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|n| n.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let on: Vec<String> = f["hosts"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|n| n.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!((names.len(), on.len()), (4, 4), "{f}");
    assert!(
        on.iter().any(|h| h == "h1") && on.iter().any(|h| h == "h2"),
        "spread: {f}"
    );
    assert!(!on.iter().any(|h| h == "h3"), "{f}");
    for (n, at) in names.iter().zip(&on) {
        let t = if at == "h1" { &h1 } else { &h2 };
        assert_eq!(
            t.get(&format!("/v1/vms/{n}")).expect(200)["state"],
            "running"
        );
        assert_eq!(sum(t, n, 4), s2, "child {n} on {at}");
    }
    // Asked of any host, `tine hosts` counts them (by the next heartbeats).
    let vms = |v: &Value| -> u64 {
        v["hosts"]
            .as_array()
            .map(|a| a.iter().filter_map(|h| h["capacity"]["vms"].as_u64()).sum())
            .unwrap_or(0)
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut view = hosts(&h3);
    while vms(&view) < 5 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        view = hosts(&h3);
    }
    assert_eq!(vms(&view), 5, "w-copy and 4 children: {view}");

    // A running vm moves: it sleeps on h1 and wakes on h2 in one call.
    let m1 = written(&h1, "mv", 8, 3);
    // Not to a host that is not there, and nothing stops for it.
    let op = h1.operation("/v1/vms/mv/move", json!({"to": "h9"}));
    assert_eq!(op["state"], "failed", "{op}");
    assert!(
        op["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("no host \"h9\"")),
        "{op}"
    );
    assert_eq!(h1.get("/v1/vms/mv").expect(200)["state"], "running");
    // What `touch 8 11` leaves, from a copy that has memtouch too.
    let at0 = if on[0] == "h1" { &h1 } else { &h2 };
    let s11 = last_word(&at0.ask(&names[0], "touch 8 11", "TOUCHED"));
    assert_ne!(s11, m1);
    // Its memory is stored while it runs (the pre-copy round) and fetched
    // by h2; then it sleeps on h1, storing what it wrote since (a diff
    // over the round's snapshot), and wakes on h2. It rewrites its memory
    // once the round is stored (while h2 fetches it): only the diff can
    // carry that to h2.
    let op = h1.post("/v1/vms/mv/move", json!({"to": "h2"})).expect(202);
    let id = op["id"].as_str().unwrap_or_default().to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut rewrote = false;
    while Instant::now() < deadline {
        let now = h1.get(&format!("/v1/operations/{id}")).expect(200);
        if now["state"] != "running" {
            break;
        }
        if now["progress"]["what"]
            .as_str()
            .is_some_and(|w| w.starts_with("prefetch"))
        {
            h1.post("/v1/vms/mv/console", json!({"line": "touch 8 11"}))
                .expect(204);
            rewrote = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let done = h1.wait_op(&id);
    assert_eq!(done["state"], "succeeded", "{done}");
    let moved = &done["result"];
    assert_eq!(
        (moved["from"].as_str(), moved["to"].as_str()),
        (Some("h1"), Some("h2")),
        "{moved}"
    );
    assert!(moved["downtime_ms"].as_f64() > Some(0.0), "{moved}");
    let pre = &moved["precopy"];
    assert!(pre["snapshot"].as_i64().is_some(), "{moved}");
    assert_eq!(
        moved["sleep"]["parent"], pre["snapshot"],
        "a diff over the round"
    );
    assert!(
        pre["prefetched"].as_u64().is_some(),
        "h2 fetched it: {moved}"
    );
    common::progress(&format!(
        "move with pre-copy: round {} ms (its pause {} ms), then stopped {} ms; the diff held {} bytes",
        pre["total_ms"], pre["pause_ms"], moved["downtime_ms"], moved["sleep"]["memory_logical"]
    ));
    h1.get("/v1/vms/mv").expect_error(404, "not_found");
    assert!(rewrote, "the move was never seen prefetching: {done}");
    assert!(
        moved["sleep"]["memory_logical"].as_u64() >= Some(8 << 20),
        "the diff holds the rewrite: {moved}"
    );
    assert_eq!(
        sum(&h2, "mv", 8),
        s11,
        "moved with the memory it wrote last"
    );

    // A network identity is the host's it runs on: its tap and gateway
    // are in that host's namespace. A vm moved with a network gets a new
    // lease there, a tree of its own, and leaves nothing behind.
    let subnet = |t: &Tined, vm: &str| -> String {
        let a = t.get(&format!("/v1/vms/{vm}")).expect(200)["address"]
            .as_str()
            .unwrap_or_else(|| panic!("{vm} has an address"))
            .to_string();
        a.rsplit_once('.').map(|(s, _)| s.to_string()).unwrap_or(a)
    };
    for (t, vm) in [(&h1, "n1"), (&h2, "n2")] {
        t.post(
            "/v1/vms",
            json!({"name": vm, "image": "micro-counter", "mem_mib": 64, "no_agent": true, "net": true}),
        )
        .expect(201);
    }
    let gateways = |ns: &Netns| -> Vec<String> {
        let mut g: Vec<String> = ns
            .addresses()
            .split_whitespace()
            .filter(|w| w.starts_with("10.213.") && w.ends_with(".1/32"))
            .map(|w| w.trim_end_matches(".1/32").to_string())
            .collect();
        g.sort();
        g.dedup();
        g
    };
    let (s1, s2) = (subnet(&h1, "n1"), subnet(&h2, "n2"));
    assert_eq!(gateways(&ns1), vec![s1.clone()], "{}", ns1.addresses());
    assert_eq!(gateways(&ns2), vec![s2.clone()], "{}", ns2.addresses());
    let m = h1.operation_ok("/v1/vms/n1/move", json!({"to": "h2", "precopy": false}));
    assert!(m["precopy"].is_null(), "asked without: {m}");
    let moved = subnet(&h2, "n1");
    assert_ne!(moved, s2, "a tree of its own on h2");
    assert!(gateways(&ns1).is_empty(), "{}", ns1.addresses());
    let mut both = vec![s2.clone(), moved.clone()];
    both.sort();
    assert_eq!(gateways(&ns2), both, "{}", ns2.addresses());
    h2.wait_line("n1", 0, |l| l.starts_with("CNT"));

    // The tree is one: every host lists the same branches; verify passes
    // on each.
    for t in [&h1, &h2, &h3] {
        let b = t.get("/v1/branches").expect(200);
        let names: Vec<&str> = b
            .as_array()
            .map(|a| a.iter().filter_map(|b| b["name"].as_str()).collect())
            .unwrap_or_default();
        assert!(names.contains(&"w") && names.contains(&"w-copy"), "{b}");
        let v = t.operation_ok("/v1/store/verify", json!({}));
        for k in ["missing", "corrupt", "not_durable", "bad_packs"] {
            assert_eq!(v[k], json!([]), "{v}");
        }
        assert!(v["chunks_checked"].as_u64() > Some(0), "{v}");
    }
}

/// tined killed (kill -9) in a move's pre-copy round, before and after
/// the round's commit: the next tined finds the vm running here with its
/// memory, and a move after that carries what it wrote since.
#[test]
fn test_a_move_killed_in_its_precopy_round_leaves_the_vm_running() {
    if !kvm_available() {
        return;
    }
    let s = World::start("precopy", 1);
    let ns = s.netns();
    let fleet_env = |fault: Option<&str>| match fault {
        Some(f) => host_env(&s, "h1", &[("TINE_HOST_FAULT", f.to_string())]),
        None => host_env(&s, "h1", &[]),
    };
    let mut h1 = host_in(&s, "h1", &[], &ns);
    let h2 = host(&s, "h2", &[]);
    let mut want = written(&h1, "pc", 8, 4);
    for (i, point) in ["precopy:answered", "precopy:stored"].iter().enumerate() {
        h1.kill();
        h1.start_again_env_in(&fleet_env(Some(point)), Some(&ns.name));
        let op = h1.post("/v1/vms/pc/move", json!({"to": "h2"})).expect(202);
        assert!(op["id"].is_string(), "{op}");
        assert!(h1.wait_exit().is_some(), "tined did not die at {point}");
        h1.start_again_env_in(&fleet_env(None), Some(&ns.name));
        assert_eq!(
            h1.get("/v1/vms/pc").expect(200)["state"],
            "running",
            "after {point}"
        );
        assert_eq!(sum(&h1, "pc", 8), want, "after {point}");
        want = last_word(&h1.ask("pc", &format!("touch 8 {}", 20 + i), "TOUCHED"));
    }
    // The round that committed is the base of the next sleep's diff.
    let moved = h1.operation_ok("/v1/vms/pc/move", json!({"to": "h2"}));
    assert!(moved["precopy"]["snapshot"].as_i64().is_some(), "{moved}");
    assert_eq!(sum(&h2, "pc", 8), want, "moved with what it wrote last");
    let v = h2.operation_ok("/v1/store/verify", json!({}));
    assert_eq!(v["missing"], json!([]), "{v}");
}

#[test]
fn test_host_loss_is_seen_and_its_vms_named() {
    if !kvm_available() {
        return;
    }
    let s = World::start("loss", 1);
    let h1 = host(&s, "h1", &[]);
    let mut h2 = host(&s, "h2", &[]);
    h2.run("c", "micro-counter");
    h2.wait_line("c", 0, |l| l.starts_with("CNT 2"));
    // Its heartbeat lists the vm.
    std::thread::sleep(Duration::from_millis(800));
    let pid = h2.get("/v1/vms/c").expect(200)["pid"].as_u64().unwrap_or(0);
    // kill -9 the host's tined and its VMM.
    h2.kill();
    if let Ok(p) = libc::pid_t::try_from(pid) {
        // SAFETY: kill(2) with plain integers: the VMM this test started.
        unsafe {
            libc::kill(p, libc::SIGKILL);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let view = loop {
        let v = hosts(&h1);
        if state_of(&v, "h2") == "lost" || Instant::now() > deadline {
            break v;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(state_of(&view, "h2"), "lost", "{view}");
    assert_eq!(state_of(&view, "h1"), "up", "{view}");
    let lost = view["lost_vms"].as_array().cloned().unwrap_or_default();
    assert!(
        lost.iter().any(|v| v["name"] == "c" && v["host"] == "h2"),
        "{view}"
    );
    // A lost host is passed over by placement, and can be forgotten.
    h1.delete("/v1/hosts/h1").expect_error(409, "conflict");
    h1.delete("/v1/hosts/h2").expect(200);
    assert_eq!(state_of(&hosts(&h1), "h2"), "");
}

#[test]
fn test_a_home_with_its_own_metadata_cannot_collect_a_shared_bucket() {
    if !kvm_available() {
        return;
    }
    let s = World::start("claim", 1);
    let h1 = host(&s, "h1", &[]);
    written(&h1, "c", 8, 2);
    h1.operation_ok("/v1/vms/c/sleep", json!({}));
    // Host x: the same bucket, but its own SQLite tree (no TINE_META).
    let env: Vec<(String, String)> = s
        .env
        .iter()
        .filter(|(k, _)| k != "TINE_META")
        .cloned()
        .chain([("TINE_HOST_ID".to_string(), "x".to_string())])
        .collect();
    let x = Tined::start_env("x", &env, &[]);
    let op = x.operation("/v1/gc", json!({}));
    assert_eq!(op["state"], "failed", "{op}");
    let why = op["error"]["message"].as_str().unwrap_or_default();
    assert!(
        why.contains("belongs to another tree") && why.contains("TINE_META"),
        "{why}"
    );
    // h1's tree is whole, and it wakes.
    let v = h1.operation_ok("/v1/store/verify", json!({}));
    assert_eq!(v["missing"], json!([]), "{v}");
    h1.operation_ok("/v1/branches/c/wake", json!({}));
}

/// gc on every host while the others sleep, wake elsewhere and remove,
/// for a bounded time: afterwards no chunk is missing anywhere.
#[test]
fn test_gc_on_every_host_while_branches_move() {
    if !kvm_available() {
        return;
    }
    let s = World::start("gc", 1);
    let hs = [
        host(&s, "h1", &[]),
        host(&s, "h2", &[]),
        host(&s, "h3", &[]),
    ];
    let secs: u64 = std::env::var("TINE_FLEET_GC_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let stop = Instant::now() + Duration::from_secs(secs);
    let rounds = std::sync::atomic::AtomicU64::new(0);
    let gcs = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|sc| {
        for (i, t) in hs.iter().enumerate() {
            let (rounds, gcs) = (&rounds, &gcs);
            // A worker: a vm written here, slept, woken on the next host
            // (checked), slept there, its branch removed now and then.
            let next = hs[(i + 1) % 3].get("/v1/hosts").expect(200)["this"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let other = &hs[(i + 1) % 3];
            sc.spawn(move || {
                let mut n = 0;
                while Instant::now() < stop {
                    let name = format!("g{i}-{n}");
                    let want = written(t, &name, 4, (n + 10 * i) as u32);
                    t.operation_ok(&format!("/v1/vms/{name}/sleep"), json!({}));
                    t.operation_ok(&format!("/v1/branches/{name}/wake"), json!({"host": next}));
                    assert_eq!(sum(other, &name, 4), want, "{name} woke on {next} whole");
                    other.operation_ok(&format!("/v1/vms/{name}/sleep"), json!({}));
                    if n % 2 == 0 {
                        other.delete(&format!("/v1/branches/{name}")).expect(200);
                    }
                    n += 1;
                    rounds.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
            sc.spawn(move || {
                while Instant::now() < stop {
                    t.operation_ok("/v1/gc", json!({}));
                    gcs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
    });
    common::progress(&format!(
        "fleet gc: {} rounds, {} gc passes in {secs} s",
        rounds.load(std::sync::atomic::Ordering::Relaxed),
        gcs.load(std::sync::atomic::Ordering::Relaxed)
    ));
    // Every sleeping branch wakes whole, and verify is clean everywhere.
    for t in &hs {
        let v = t.operation_ok("/v1/store/verify", json!({}));
        for k in ["missing", "corrupt", "not_durable", "bad_packs"] {
            assert_eq!(v[k], json!([]), "{v}");
        }
    }
    let branches = hs[0].get("/v1/branches").expect(200);
    let sleeping: Vec<String> = branches
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|b| b["state"] == "sleeping")
                .filter_map(|b| b["name"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    assert!(!sleeping.is_empty(), "{branches}");
    for b in &sleeping {
        hs[2].operation_ok(&format!("/v1/branches/{b}/wake"), json!({"host": "h3"}));
    }
}

/// Garage with three nodes (replication 3): one node killed, the fleet's
/// reads and writes go on.
#[test]
fn test_one_storage_node_lost_reads_and_writes_go_on() {
    if !kvm_available() {
        return;
    }
    let s = World::start("garage3", 3);
    let h1 = host(&s, "h1", &[]);
    let h2 = host(&s, "h2", &[]);
    let want = written(&h1, "n", 8, 4);
    h1.operation_ok("/v1/vms/n/sleep", json!({}));
    // kill -9 one storage node (not the one the hosts talk to).
    let pid: i32 = std::fs::read_to_string(s.dir.join("garage/n3/pid"))
        .expect("node 3's pid")
        .trim()
        .parse()
        .expect("a pid");
    // SAFETY: kill(2) with plain integers: the garage node this test started.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
    }
    // h2's cache is empty: the wake reads every chunk from the cluster.
    h1.operation_ok("/v1/branches/n/wake", json!({"host": "h2"}));
    assert_eq!(sum(&h2, "n", 8), want, "read back with a node down");
    let more = last_word(&h2.ask("n", "touch 2 8", "TOUCHED"));
    h2.operation_ok("/v1/vms/n/sleep", json!({}));
    h2.operation_ok("/v1/branches/n/wake", json!({"host": "h1"}));
    assert_eq!(sum(&h1, "n", 2), more, "written with a node down");
    let v = h2.operation_ok("/v1/store/verify", json!({}));
    assert_eq!(v["missing"], json!([]), "{v}");
}
