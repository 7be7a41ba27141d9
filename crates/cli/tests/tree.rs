//! The snapshot tree with micro guests on this machine's /dev/kvm: a vm
//! put to sleep wakes and continues exactly, a sleeping branch woken twice
//! gives two independent branches, siblings share chunks, a corrupted
//! chunk is caught, and a sleep killed midway leaves a store that
//! verifies, no half snapshot and a running vm.

mod common;

use std::time::{Duration, Instant};

use common::{kvm_available, Home, TempDir};

fn console(h: &Home, vm: &str) -> String {
    std::fs::read_to_string(h.0.path().join("vms").join(vm).join("console.log")).unwrap_or_default()
}

/// Sends a memtouch command; returns the last word of its reply line.
fn ask(h: &Home, vm: &str, cmd: &str, reply: &str) -> String {
    let from = console(h, vm).len();
    h.ok(&["console", vm, "--send", cmd]);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = console(h, vm);
        let done = text.rfind('\n').map(|i| i + 1).unwrap_or(0);
        if let Some(l) = text
            .get(from..done)
            .unwrap_or("")
            .lines()
            .find(|l| l.starts_with(reply))
        {
            return l.split_whitespace().last().unwrap_or("").to_string();
        }
        assert!(
            Instant::now() < deadline,
            "{vm} did not answer {cmd:?}; console:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn memtouch(h: &Home, name: &str, mem: &str) {
    h.ok(&[
        "run",
        "--name",
        name,
        "--image",
        "micro-memtouch",
        "--mem",
        mem,
    ]);
    ask(h, name, "ping", "PONG");
}

fn tree(h: &Home) -> serde_json::Value {
    serde_json::from_str(&h.ok(&["tree", "--json"])).expect("tree --json")
}

fn branch_state(t: &serde_json::Value, name: &str) -> String {
    t["branches"]
        .as_array()
        .expect("branches")
        .iter()
        .find(|b| b["name"] == name)
        .map(|b| b["state"].as_str().unwrap_or("").to_string())
        .unwrap_or_default()
}

/// Flips a byte in the middle of every chunk of the local store.
fn corrupt_every_chunk(h: &Home) {
    let chunks = h.0.path().join("store").join("chunks");
    let mut n = 0;
    for dir in std::fs::read_dir(&chunks).expect("chunks dir").flatten() {
        for f in std::fs::read_dir(dir.path()).expect("chunk dir").flatten() {
            let mut b = std::fs::read(f.path()).expect("chunk");
            let mid = b.len() / 2;
            b[mid] ^= 0x5a;
            std::fs::write(f.path(), b).expect("corrupt");
            n += 1;
        }
    }
    assert!(n > 0, "no chunk files under {}", chunks.display());
}

fn running(h: &Home) -> Vec<String> {
    h.ls()
        .iter()
        .filter(|r| r["state"] == "running")
        .map(|r| r["name"].as_str().unwrap_or("").to_string())
        .collect()
}

#[test]
fn test_sleep_then_wake_continues_exactly_and_a_branch_woken_twice_gives_two() {
    if !kvm_available() {
        return;
    }
    let h = Home::new("tree-wake");
    memtouch(&h, "m", "256M");
    let sum = ask(&h, "m", "touch 32 7", "TOUCHED");
    let out = h.ok(&["sleep", "m"]);
    assert!(out.contains("sleeping in snapshot"), "{out}");
    assert!(running(&h).is_empty(), "a sleeping branch has no vm");
    assert_eq!(branch_state(&tree(&h), "m"), "sleeping");
    let picture = h.ok(&["tree"]);
    assert!(picture.contains("m (sleeping)"), "{picture}");

    // Woken: the same memory, not a boot.
    h.ok(&["wake", "m"]);
    assert_eq!(ask(&h, "m", "sum 32", "SUM"), sum);
    assert!(!console(&h, "m").contains("READY"), "woken, not booted");
    assert_eq!(branch_state(&tree(&h), "m"), "running");
    let again = h.out(&["wake", "m"]);
    assert!(!again.status.success());
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(err.contains("--name"), "{err}");

    // Sleep again (a child snapshot), then two copies of it diverge.
    ask(&h, "m", "touch 8 8", "TOUCHED");
    let slept = h.ok(&["sleep", "m", "--json"]);
    let s: serde_json::Value = serde_json::from_str(&slept).expect("sleep --json");
    assert!(
        s["parent"].is_i64(),
        "the second sleep is a child snapshot: {slept}"
    );
    // Only what was dirtied since the wake is stored (a diff layer from
    // the dirty log): the 8 MiB touched, plus a few windows of the guest's
    // own stack and buffers, not the 32 MiB the first snapshot holds.
    let logical = s["memory_logical"].as_u64().expect("memory_logical");
    assert!(
        logical <= (8 << 20) + 8 * store::DEFAULT_WINDOW_SIZE,
        "a sleep after a wake stores only the dirtied pages: {slept}"
    );
    h.ok(&["wake", "m", "--name", "a"]);
    h.ok(&["wake", "m", "--name", "b"]);
    let sum8 = ask(&h, "a", "sum 8", "SUM");
    assert_eq!(ask(&h, "b", "sum 8", "SUM"), sum8);
    assert_ne!(sum8, sum, "the second snapshot has the second touch");
    let a = ask(&h, "a", "touch 8 1", "TOUCHED");
    assert_eq!(
        ask(&h, "b", "sum 8", "SUM"),
        sum8,
        "b does not see a's writes"
    );
    assert_ne!(ask(&h, "b", "touch 8 2", "TOUCHED"), a);
    let t = tree(&h);
    assert_eq!(branch_state(&t, "a"), "running");
    assert_eq!(branch_state(&t, "b"), "running");
    assert_eq!(branch_state(&t, "m"), "sleeping");

    // A sleeping branch forks into new branches; an invalid contract is
    // refused before any of them wakes; --json reports each copy.
    let files = TempDir::new("treecontract");
    let bad = files.path().join("bad.toml");
    std::fs::write(&bad, "randomness = \"sometimes\"\n").expect("write");
    let out = h.out(&[
        "fork",
        "m",
        "--names",
        "f1,f2",
        "--contract",
        bad.to_str().expect("utf8"),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("nothing was woken"),
        "{err}"
    );
    assert!(!h.ok(&["ls"]).contains("f1"), "no copy woke");
    let out = h.ok(&["fork", "m", "--names", "f1,f2", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("fork json");
    // The same report as a fork of a running vm: one result per child.
    assert_eq!(v["name"], "m", "{v}");
    assert_eq!(v["problems"], serde_json::json!([]), "{v}");
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 2, "{v}");
    assert!(
        results
            .iter()
            .all(|c| c["pid"].as_u64().is_some() && c["ok"] == true),
        "{v}"
    );
    assert_eq!(
        v["child_running_ms"].as_array().map(Vec::len),
        Some(2),
        "{v}"
    );
    assert_eq!(ask(&h, "f2", "sum 8", "SUM"), sum8);
    let v = h.ok(&["store", "verify"]);
    assert!(v.contains("0 missing, 0 corrupt"), "{v}");
    for vm in ["a", "b", "f1", "f2"] {
        h.ok(&["rm", "--force", vm]);
    }
}

#[test]
fn test_ten_siblings_asleep_share_their_parents_chunks() {
    if !kvm_available() {
        return;
    }
    let h = Home::new("tree-dedup");
    memtouch(&h, "p", "1G");
    ask(&h, "p", "touch 64 0", "TOUCHED");
    let names: Vec<String> = (1..=10).map(|i| format!("s{i}")).collect();
    h.ok(&["fork", "p", "--names", &names.join(",")]);
    for (i, n) in names.iter().enumerate() {
        ask(&h, n, &format!("touch 8 {}", i + 1), "TOUCHED");
    }
    let parent: serde_json::Value =
        serde_json::from_str(&h.ok(&["sleep", "p", "--json"])).expect("json");
    let parent_stored = parent["new_stored"].as_u64().expect("new_stored");
    for n in &names {
        h.ok(&["sleep", n]);
    }
    let t = tree(&h);
    let stored = t["totals"]["stored_bytes"].as_u64().expect("stored_bytes");
    let metadata = t["metadata_bytes"].as_u64().expect("metadata_bytes");
    // Besides its 8 MiB each sibling dirties a few pages of its own (the
    // guest's stack, the console's line buffer): one window of the store
    // (store::DEFAULT_WINDOW_SIZE) per such spot, allowed as overhead.
    let strict = parent_stored + 10 * (8 << 20);
    let bound = strict + 10 * 2 * store::DEFAULT_WINDOW_SIZE;
    eprintln!(
        "10 siblings of a 1 GiB parent, 8 MiB each of their own: stored {} KiB, parent {} KiB, parent + 10 x 8 MiB = {} KiB, ratio {:.4}; metadata {} KiB",
        stored >> 10,
        parent_stored >> 10,
        strict >> 10,
        stored as f64 / strict as f64,
        metadata >> 10
    );
    assert!(
        stored <= bound,
        "siblings share their parent's chunks: stored {stored} > {bound} (parent + 10 x (8 MiB + 2 windows))"
    );
    for n in &names {
        assert_eq!(branch_state(&t, n), "sleeping");
    }
}

#[test]
fn test_a_corrupted_chunk_fails_the_wake_and_verify_names_it() {
    if !kvm_available() {
        return;
    }
    let h = Home::new("tree-corrupt");
    memtouch(&h, "c", "128M");
    ask(&h, "c", "touch 4 3", "TOUCHED");
    h.ok(&["sleep", "c"]);
    corrupt_every_chunk(&h);
    let v = h.out(&["store", "verify"]);
    assert!(!v.status.success(), "verify fails on a corrupted store");
    let text = String::from_utf8_lossy(&v.stdout);
    assert!(
        text.contains("corrupt") && text.contains("chunk "),
        "{text}"
    );
    let w = h.out(&["wake", "c"]);
    assert!(!w.status.success(), "a corrupted chunk fails the wake");
    let err = String::from_utf8_lossy(&w.stderr);
    assert!(
        err.contains("snapshot") && err.contains("chunk"),
        "the error names the snapshot and the chunk: {err}"
    );
    assert!(running(&h).is_empty());
}

#[test]
fn test_a_sleep_killed_midway_leaves_a_running_vm_and_a_store_that_verifies() {
    if !kvm_available() {
        return;
    }
    let h = Home::new("tree-kill");
    memtouch(&h, "k", "128M");
    let sum = ask(&h, "k", "touch 4 5", "TOUCHED");
    for point in ["mid-chunks:3", "after-chunks", "before-commit"] {
        let out = h
            .cmd(&["sleep", "k"])
            .env("TINE_STORE_FAULT", point)
            .output()
            .expect("tine sleep");
        assert!(!out.status.success(), "the fault {point} ends the sleep");
        assert_eq!(running(&h), vec!["k".to_string()], "after {point}");
        assert_eq!(ask(&h, "k", "sum 4", "SUM"), sum, "after {point}");
        let t = tree(&h);
        assert!(
            t["snapshots"].as_array().expect("snapshots").is_empty(),
            "no half snapshot after {point}: {t}"
        );
        let v = h.ok(&["store", "verify"]);
        assert!(v.contains("0 missing, 0 corrupt"), "after {point}: {v}");
    }
    // The store still works: the sleep now succeeds, and gc keeps it.
    h.ok(&["sleep", "k"]);
    h.ok(&["gc"]);
    h.ok(&["wake", "k"]);
    assert_eq!(ask(&h, "k", "sum 4", "SUM"), sum);
}

#[test]
fn test_a_lazy_wake_pages_memory_in_from_the_store_and_records_its_working_set() {
    if !kvm_available() {
        return;
    }
    let h = Home::new("tree-lazy");
    memtouch(&h, "l", "256M");
    let sum = ask(&h, "l", "touch 16 9", "TOUCHED");
    h.ok(&["sleep", "l"]);
    // Nothing of the memory is written out: the VMM faults it in.
    h.ok(&["wake", "l", "--lazy"]);
    assert_eq!(ask(&h, "l", "sum 16", "SUM"), sum);
    let lazy_dir = h.0.path().join("store").join("wake").join("1-lazy");
    let on_disk = std::fs::metadata(lazy_dir.join("memory"))
        .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
        .expect("the lazy wake's memory file");
    assert_eq!(on_disk, 0, "a lazy wake writes no memory file");
    // The working set is written once the recording window (5 s) closes,
    // and the next sleep stores it.
    let ws = h.0.path().join("vms").join("l").join("working-set.json");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ws.exists() {
        assert!(Instant::now() < deadline, "no working set recorded");
        std::thread::sleep(Duration::from_millis(100));
    }
    let set: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&ws).expect("working set")).expect("json");
    assert!(
        !set["ranges"].as_array().expect("ranges").is_empty(),
        "{set}"
    );
    h.ok(&["sleep", "l"]);
    // Woken lazily again (with the stored working set prefetched), then
    // forked: a lazily woken vm is made resident before fork(2).
    h.ok(&["wake", "l", "--lazy"]);
    h.ok(&["fork", "l", "--names", "l1"]);
    assert_eq!(ask(&h, "l1", "sum 16", "SUM"), sum);
    assert_eq!(ask(&h, "l", "sum 16", "SUM"), sum);
    // The child descends from the snapshot its parent woke from: its sleep
    // is a diff layer under that snapshot, not a new root.
    let link: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(h.0.path().join("vms/l/branch.json")).expect("l's link"),
    )
    .expect("link json");
    let slept: serde_json::Value =
        serde_json::from_str(&h.ok(&["sleep", "l1", "--json"])).expect("sleep json");
    assert_eq!(slept["parent"], link["snapshot"], "{slept} {link}");
    assert!(
        slept["new_stored"].as_u64().expect("new_stored") < 8 << 20,
        "a diff over the 16 MiB the parent snapshot holds: {slept}"
    );
    h.ok(&["wake", "l1"]);
    assert_eq!(ask(&h, "l1", "sum 16", "SUM"), sum);
    for vm in ["l", "l1"] {
        h.ok(&["rm", "--force", vm]);
    }
}

#[test]
fn test_a_lazy_wake_over_a_corrupted_chunk_ends_the_vm_naming_the_chunk() {
    if !kvm_available() {
        return;
    }
    let h = Home::new("tree-lazybad");
    memtouch(&h, "z", "128M");
    ask(&h, "z", "touch 4 3", "TOUCHED");
    h.ok(&["sleep", "z"]);
    corrupt_every_chunk(&h);
    // The first fault ends the VMM: either before the wake counts it
    // ready (the wake fails naming the chunk, and the branch still
    // sleeps: no vm is left behind), or just after (the vm ends, and its
    // exit names the chunk).
    let woke = h.out(&["wake", "z", "--lazy"]);
    let reason = if woke.status.success() {
        let exit = h.0.path().join("vms").join("z").join("exit.json");
        let deadline = Instant::now() + Duration::from_secs(30);
        while !exit.exists() {
            assert!(Instant::now() < deadline, "the vm did not end");
            std::thread::sleep(Duration::from_millis(100));
        }
        std::fs::read_to_string(&exit).expect("exit.json")
    } else {
        assert_eq!(branch_state(&tree(&h), "z"), "sleeping");
        assert!(
            !h.0.path().join("vms").join("z").exists(),
            "no vm left behind"
        );
        let err = String::from_utf8_lossy(&woke.stderr).into_owned();
        // The logs the error points to outlive the half-started vm.
        let kept = err
            .split("are kept in ")
            .nth(1)
            .and_then(|t| t.split(')').next())
            .unwrap_or_else(|| panic!("the error says where the logs are: {err}"));
        let kept = std::path::Path::new(kept);
        assert!(kept.join("vmm.log").is_file(), "{err}");
        assert!(kept.starts_with(h.0.path().join("failed")), "{err}");
        err
    };
    assert!(
        reason.contains("chunk") && reason.contains("snapshot"),
        "the failure names the chunk and the snapshot: {reason}"
    );
    assert!(running(&h).is_empty());
}

/// An S3 server for one test (crates/store/tests/s3-server.sh: moto's
/// server mode) with bucket `tine`, killed on drop; None if not installed
/// (outside CI, where scripts/setup installs it).
struct S3(std::process::Child, u16);

impl Drop for S3 {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn s3_server() -> Option<S3> {
    use std::io::{Read, Write};
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../store/tests/s3-server.sh");
    let installed = std::process::Command::new(script)
        .arg("path")
        .output()
        .is_ok_and(|o| o.status.success());
    if !installed {
        assert!(
            std::env::var_os("CI").is_none(),
            "no S3 server installed in CI (scripts/setup installs it)"
        );
        eprintln!("!!!!!!!! S3 TEST SKIPPED: run `{script} install` !!!!!!!!");
        return None;
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let child = std::process::Command::new(script)
        .args(["run", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the S3 server");
    let server = S3(child, port);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut s = loop {
        if let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            break s;
        }
        assert!(Instant::now() < deadline, "the S3 server did not listen");
        std::thread::sleep(Duration::from_millis(100));
    };
    write!(
        s,
        "PUT /tine HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .expect("create bucket");
    let mut reply = String::new();
    s.read_to_string(&mut reply).expect("create bucket reply");
    assert!(reply.starts_with("HTTP/1.1 200"), "CreateBucket: {reply}");
    Some(server)
}

#[test]
fn test_a_branch_sleeps_in_s3_and_wakes_lazily_with_an_empty_cache() {
    if !kvm_available() {
        return;
    }
    let Some(s3) = s3_server() else { return };
    let h = Home::new("tree-s3");
    let env = [
        ("TINE_STORE", "s3://tine/cli".to_string()),
        ("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{}", s3.1)),
        ("AWS_ACCESS_KEY_ID", "tine".into()),
        ("AWS_SECRET_ACCESS_KEY", "tine-secret".into()),
        ("AWS_REGION", "us-east-1".into()),
        ("AWS_ALLOW_HTTP", "1".into()),
    ];
    let tine_with = |args: &[&str], extra: &[(&str, &str)]| -> String {
        let out = h
            .cmd(args)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .envs(extra.iter().copied())
            .output()
            .expect("tine");
        assert!(
            out.status.success(),
            "tine {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let tine = |args: &[&str]| tine_with(args, &[]);
    memtouch(&h, "s", "256M");
    let sum = ask(&h, "s", "touch 16 4", "TOUCHED");
    tine(&["sleep", "s"]);
    // Only the bucket has the chunks now.
    let store = h.0.path().join("store");
    for d in ["cache", "wake"] {
        let _ = std::fs::remove_dir_all(store.join(d));
    }
    assert!(
        !store.join("chunks").exists(),
        "an S3 store keeps no local chunk directory"
    );
    tine(&["wake", "s", "--lazy"]);
    assert_eq!(ask(&h, "s", "sum 16", "SUM"), sum);
    let v = tine(&["store", "verify"]);
    assert!(v.contains("0 missing, 0 corrupt"), "{v}");

    // Its working set, slept with it, is stored as one pack; a cold lazy
    // wake fetches it into the cache (the VMM logs it at info).
    let ws = h.0.path().join("vms/s/working-set.json");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ws.exists() {
        assert!(Instant::now() < deadline, "no working set recorded");
        std::thread::sleep(Duration::from_millis(100));
    }
    tine(&["sleep", "s"]);
    let v = tine(&["store", "verify"]);
    assert!(v.contains("1 working-set packs checked, 0 bad"), "{v}");
    for d in ["cache", "wake"] {
        let _ = std::fs::remove_dir_all(store.join(d));
    }
    tine_with(&["wake", "s", "--lazy"], &[("TINE_LOG", "info")]);
    assert_eq!(ask(&h, "s", "sum 16", "SUM"), sum);
    let log = std::fs::read_to_string(h.0.path().join("vms/s/vmm.log")).expect("vmm.log");
    assert!(log.contains("working-set pack of snapshot 2:"), "{log}");

    // The chunk cache keeps to its budget (TINE_STORE_CACHE); what it
    // drops is still in the bucket, so a new branch from the same
    // snapshot reads the same memory.
    let cache_bytes = || -> u64 {
        fn walk(p: &std::path::Path) -> u64 {
            std::fs::read_dir(p).map_or(0, |rd| {
                rd.flatten()
                    .map(|e| match e.metadata() {
                        Ok(m) if m.is_dir() => walk(&e.path()),
                        Ok(m) => m.len(),
                        Err(_) => 0,
                    })
                    .sum()
            })
        }
        walk(&store.join("cache"))
    };
    assert!(cache_bytes() > 1 << 20, "the verify filled the cache");
    tine_with(
        &["wake", "s", "--name", "s2"],
        &[("TINE_STORE_CACHE", "1M")],
    );
    assert!(
        cache_bytes() <= 1 << 20,
        "cache trimmed to 1 MiB: {} bytes",
        cache_bytes()
    );
    assert_eq!(ask(&h, "s2", "sum 16", "SUM"), sum);
    h.ok(&["rm", "--force", "s"]);
    h.ok(&["rm", "--force", "s2"]);
}

/// Reads a vm's whole disk through its chain with qemu-img (-U: the vm
/// holds it open; a micro guest never writes it).
fn disk_contents(h: &Home, vm: &str, dir: &std::path::Path) -> Vec<u8> {
    let out = dir.join(format!("{vm}.flat.raw"));
    let _ = std::fs::remove_file(&out);
    let st = std::process::Command::new("qemu-img")
        .args(["convert", "-U", "-O", "raw"])
        .arg(h.top(vm))
        .arg(&out)
        .status()
        .expect("qemu-img");
    assert!(st.success(), "qemu-img convert of {vm}'s disk");
    let v = std::fs::read(&out).expect("flat disk");
    std::fs::remove_file(&out).expect("rm flat disk");
    v
}

/// Has blkio in `vm` write the 4 KiB block at byte `off` with `seed`'s
/// pattern (guests/micro/blkio.rs), checks its checksum, and applies the
/// same write to `data`. Returns `off`.
fn blkio_write(h: &Home, vm: &str, data: &mut [u8], off: u64, seed: u64) -> u64 {
    let block = off / 4096;
    let mut sum: u64 = 0xcbf2_9ce4_8422_2325;
    for o in (off..off + 4096).step_by(8) {
        let v = (o ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes();
        data[o as usize..o as usize + 8].copy_from_slice(&v);
        for b in v {
            sum = (sum ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    let got = ask(
        h,
        vm,
        &format!("write {block} {seed}"),
        &format!("WROTE {block}"),
    );
    assert_eq!(
        got,
        format!("{sum:016x}"),
        "{vm}: blkio's checksum of block {block}"
    );
    ask(h, vm, "flush", "FLUSHED");
    off
}

fn sleep_json(h: &Home, vm: &str) -> serde_json::Value {
    let out = h.ok(&["sleep", vm, "--json"]);
    let s: serde_json::Value = serde_json::from_str(&out).expect("sleep --json");
    eprintln!(
        "sleep {vm}: store {:.0} ms, total {:.0} ms, disks {}",
        s["store_ms"].as_f64().unwrap_or(0.0),
        s["total_ms"].as_f64().unwrap_or(0.0),
        s["disks"]
    );
    s
}

#[test]
fn test_a_woken_vm_sleeps_its_disk_as_a_diff_and_it_round_trips() {
    if !kvm_available() {
        return;
    }
    let h = Home::new("tree-disk");
    let dir = TempDir::new("tree-disk");
    // 128 MiB of random data, so neither dedup nor zero windows hide a
    // whole read.
    const SIZE: u64 = 128 << 20;
    let base = dir.path().join("data.raw");
    let mut data = vec![0u8; SIZE as usize];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for c in data.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        c.copy_from_slice(&x.to_le_bytes());
    }
    std::fs::write(&base, &data).expect("write base");
    h.ok(&[
        "run",
        "--name",
        "m",
        "--image",
        "micro-blkio",
        "--mem",
        "64M",
        "--disk",
        base.to_str().expect("utf8"),
    ]);
    ask(&h, "m", "ping", "PONG");

    // First sleep: no parent, the whole disk is read.
    let s1 = sleep_json(&h, "m");
    assert!(s1["parent"].is_null(), "{s1}");
    assert_eq!(s1["disks"][0]["diff"], false, "{s1}");
    assert_eq!(s1["disks"][0]["read_bytes"], SIZE, "{s1}");
    // The store holds it now: the original base goes away.
    std::fs::remove_file(&base).expect("rm base");

    // Woken and put to sleep again: the chain bottoms out at the first
    // snapshot's materialized disk and nothing above it maps a cluster,
    // so nothing of the disk is read.
    h.ok(&["wake", "m"]);
    ask(&h, "m", "ping", "PONG");
    assert!(
        disk_contents(&h, "m", dir.path()) == data,
        "first wake's disk"
    );
    let s2 = sleep_json(&h, "m");
    assert_eq!(s2["parent"], s1["snapshot"], "{s2}");
    assert_eq!(s2["disks"][0]["diff"], true, "{s2}");
    assert_eq!(s2["disks"][0]["size"], SIZE, "{s2}");
    assert_eq!(s2["disks"][0]["read_bytes"], 0, "not read in full: {s2}");
    assert_eq!(s2["disks"][0]["logical"], 0, "{s2}");

    // A fork child of a woken vm: its chain has the parent's frozen layer
    // between its own top and the materialized disk; still a diff. The
    // guest writes its disk itself (blkio): one block before the fork (in
    // the layer the fork freezes, which both vms read through), one in
    // each vm after it (in its own top).
    h.ok(&["wake", "m"]);
    ask(&h, "m", "ping", "PONG");
    let before = blkio_write(&h, "m", &mut data, 10 << 20, 1);
    h.ok(&["fork", "m", "--names", "f"]);
    ask(&h, "f", "ping", "PONG");
    let layers: serde_json::Value =
        serde_json::from_str(&h.ok(&["disk", "layers", "f", "--json"])).expect("layers");
    assert!(
        layers[0].as_array().map_or(0, Vec::len) >= 3,
        "fork child over the woken vm's frozen layer: {layers}"
    );
    let mut f_data = data.clone();
    let in_f = blkio_write(&h, "f", &mut f_data, 50 << 20, 2);
    let in_m = blkio_write(&h, "m", &mut data, 90 << 20, 3);
    assert_eq!(disk_contents(&h, "f", dir.path()), f_data);
    assert_eq!(disk_contents(&h, "m", dir.path()), data);
    // The store windows those writes touch (qcow2 clusters are 64 KiB).
    let ws = store::DEFAULT_WINDOW_SIZE;
    let want = |offs: &[u64]| {
        let mut windows: Vec<u64> = offs.iter().map(|o| o / ws).collect();
        windows.sort_unstable();
        windows.dedup();
        windows.len() as u64 * ws
    };

    let sf = sleep_json(&h, "f");
    assert_eq!(sf["parent"], s2["snapshot"], "{sf}");
    assert_eq!(sf["disks"][0]["diff"], true, "{sf}");
    assert_eq!(sf["disks"][0]["read_bytes"], want(&[before, in_f]), "{sf}");

    // The forked parent too. With f asleep only m uses the frozen layer,
    // so it was folded into m's top (its chain is short again) and the
    // block written before the fork is still in m's diff.
    let ml: serde_json::Value =
        serde_json::from_str(&h.ok(&["disk", "layers", "m", "--json"])).expect("layers");
    assert_eq!(
        ml[0].as_array().map_or(0, Vec::len),
        2,
        "m's frozen layer folded: {ml}"
    );
    assert_eq!(disk_contents(&h, "m", dir.path()), data, "m after the fold");
    let s3 = sleep_json(&h, "m");
    assert_eq!(s3["parent"], s2["snapshot"], "{s3}");
    assert_eq!(s3["disks"][0]["diff"], true, "{s3}");
    assert_eq!(s3["disks"][0]["read_bytes"], want(&[before, in_m]), "{s3}");
    let changed = [("m", data), ("f", f_data)];

    // Through a third wake (of the diff snapshots), the disk is byte-exact.
    for (name, want) in &changed {
        h.ok(&["wake", name]);
        ask(&h, name, "ping", "PONG");
        assert!(
            disk_contents(&h, name, dir.path()) == *want,
            "{name}: the disk did not round-trip"
        );
    }
    let v = h.ok(&["store", "verify"]);
    assert!(v.contains("0 missing, 0 corrupt"), "{v}");
}
