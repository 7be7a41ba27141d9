//! `tine run/ls/console/stop/kill/rm` with micro guests on this machine's
//! /dev/kvm: state under $TINE_HOME, processes supervised by pid + start time.

mod common;

use std::process::Output;
use std::time::{Duration, Instant};

use common::{kvm_available, tine, TempDir};

fn t(home: &TempDir, args: &[&str]) -> Output {
    tine()
        .args(args)
        .env("TINE_HOME", home.path())
        .output()
        .expect("run tine")
}

fn ok(home: &TempDir, args: &[&str]) -> String {
    let out = t(home, args);
    assert!(
        out.status.success(),
        "tine {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `tine args`, which must fail; returns its stderr.
fn fails(home: &TempDir, args: &[&str]) -> String {
    let out = t(home, args);
    assert!(!out.status.success(), "tine {args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `tine run` of micro guest `image` as `name` with 64 MiB.
fn run_args<'a>(name: &'a str, image: &'a str) -> [&'a str; 7] {
    ["run", "--name", name, "--image", image, "--mem", "64M"]
}

/// `tine run` of micro-counter as `name` on `disk`, default memory.
fn counter_on_disk<'a>(name: &'a str, disk: &'a str) -> [&'a str; 7] {
    [
        "run",
        "--name",
        name,
        "--image",
        "micro-counter",
        "--disk",
        disk,
    ]
}

fn ls(home: &TempDir) -> Vec<serde_json::Value> {
    serde_json::from_str(&ok(home, &["ls", "--json"])).expect("ls --json is JSON")
}

fn field<'a>(rows: &'a [serde_json::Value], name: &str, key: &str) -> &'a serde_json::Value {
    let row = rows
        .iter()
        .find(|r| r["name"] == name)
        .unwrap_or_else(|| panic!("{name} not in ls: {rows:?}"));
    &row[key]
}

fn pid_alive(pid: u64) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

#[test]
fn test_two_vms_run_list_stop_and_remove_leave_nothing() {
    if !kvm_available() {
        return;
    }
    let home = TempDir::new("lifecycle");
    ok(&home, &run_args("a", "micro-counter"));
    ok(&home, &run_args("b", "micro-memtouch"));
    let rows = ls(&home);
    assert_eq!(rows.len(), 2);
    assert_eq!(field(&rows, "a", "state"), "running");
    assert_eq!(field(&rows, "b", "state"), "running");
    let pid_a = field(&rows, "a", "pid").as_u64().expect("pid");
    let pid_b = field(&rows, "b", "pid").as_u64().expect("pid");
    assert!(pid_alive(pid_a) && pid_alive(pid_b));

    // The console log fills while the vm runs.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !ok(&home, &["console", "a"]).contains("CNT 2") {
        assert!(
            Instant::now() < deadline,
            "counter console never showed CNT 2"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    ok(&home, &["stop", "a"]);
    let rows = ls(&home);
    assert_eq!(field(&rows, "a", "state"), "stopped");
    assert_eq!(field(&rows, "b", "state"), "running");
    assert!(!pid_alive(pid_a), "stop must end the VMM");

    let out = t(&home, &["rm", "b"]);
    assert!(!out.status.success(), "rm of a running vm must be refused");
    ok(&home, &["stop", "b"]);
    ok(&home, &["rm", "a"]);
    ok(&home, &["rm", "b"]);
    assert!(!pid_alive(pid_b));
    assert!(ls(&home).is_empty());
    let left: Vec<_> = std::fs::read_dir(home.path().join("vms"))
        .expect("vms dir")
        .collect();
    assert!(left.is_empty(), "state left behind: {left:?}");
}

/// Kills vm `name`'s VMM with SIGKILL (a crash) and waits until `ls`
/// shows it crashed, with the wait status tined was told (a VMM killed so
/// leaves no exit record of its own).
fn crash_and_see_it_reported(home: &TempDir, name: &str) {
    let pid = field(&ls(home), name, "pid").as_u64().expect("pid");
    assert!(std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill")
        .success());
    let want = "ended without an exit record: signal: 9 (SIGKILL)";
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let rows = ls(home);
        let said = field(&rows, name, "exit")
            .as_str()
            .is_some_and(|e| e.contains(want));
        if said && field(&rows, name, "state") == "crashed" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "ls never said how {name}'s VMM ended: {rows:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn test_crashed_vmm_is_reported_and_cleaned() {
    if !kvm_available() {
        return;
    }
    let home = TempDir::new("crash");
    ok(&home, &run_args("c", "micro-counter"));
    crash_and_see_it_reported(&home, "c");
    let e = fails(&home, &["checkpoint", "c"]);
    assert!(e.contains("is crashed") && e.contains("SIGKILL"), "{e}");
    // A crashed vm's name stays taken until rm.
    let e = fails(&home, &["run", "--name", "c", "--image", "micro-counter"]);
    assert!(e.contains("tine rm c"), "{e}");
    ok(&home, &["rm", "c"]);
    assert!(ls(&home).is_empty());

    // The same for a fork child whose parent is gone: an orphan of its
    // tree's PID namespace, reaped by the tree's init, which tells tined.
    ok(&home, &run_args("p", "micro-counter"));
    ok(&home, &["fork", "p", "--names", "q"]);
    ok(&home, &["stop", "p"]);
    ok(&home, &["rm", "p"]);
    crash_and_see_it_reported(&home, "q");
    ok(&home, &["rm", "q"]);
    assert!(ls(&home).is_empty());
}

#[test]
fn test_duplicate_name_and_unknown_vm_are_clear_errors() {
    if !kvm_available() {
        return;
    }
    let home = TempDir::new("dup");
    ok(&home, &run_args("d", "micro-counter"));
    let e = fails(&home, &run_args("d", "micro-counter"));
    assert!(e.contains("already running"), "{e}");
    for verb in [
        &["stop", "nope"][..],
        &["rm", "nope"],
        &["console", "nope"],
        &["kill", "nope"],
    ] {
        let e = fails(&home, verb);
        assert!(e.contains("no vm named"), "{verb:?}: {e}");
    }
    fails(
        &home,
        &["run", "--name", "../evil", "--image", "micro-counter"],
    );
    ok(&home, &["rm", "--force", "d"]);
    assert!(ls(&home).is_empty());
}

#[test]
fn test_run_disk_gets_its_own_top_layer_and_bad_chains_are_refused() {
    if !kvm_available() {
        return;
    }
    let home = TempDir::new("disks");
    let dir = TempDir::new("diskfiles");
    let base = dir.path().join("base.raw");
    std::fs::write(&base, vec![0u8; 16 << 20]).expect("base");
    let b = base.to_str().expect("utf8");
    ok(
        &home,
        &[&run_args("d", "micro-counter")[..], &["--disk", b]].concat(),
    );
    let layers: serde_json::Value =
        serde_json::from_str(&ok(&home, &["disk", "layers", "d", "--json"])).expect("json");
    assert_eq!(layers[0][0]["format"], "qcow2", "{layers}");
    assert_eq!(layers[0][1]["format"], "raw", "{layers}");
    assert_eq!(layers[0][1]["path"], b);
    let top = home.path().join("vms/d/disk0.qcow2");
    let check = std::process::Command::new("qemu-img")
        .arg("check")
        .arg(&top)
        .output()
        .expect("qemu-img");
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stdout)
    );
    ok(&home, &["rm", "--force", "d"]);

    // A chain whose backing file is missing, and a cycle: clear errors, no vm.
    let top_a = dir.path().join("a.qcow2");
    let top_b = dir.path().join("b.qcow2");
    for (img, backing) in [(&top_a, &top_b), (&top_b, &top_a)] {
        let st = std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-u", "-F", "qcow2", "-b"])
            .arg(backing)
            .arg(img)
            .arg("16M")
            .status()
            .expect("qemu-img create");
        assert!(st.success());
    }
    let a = top_a.to_str().expect("utf8");
    let before = std::fs::read(&top_a).expect("read");
    let e = fails(&home, &counter_on_disk("e", a));
    assert!(e.contains("cycle"), "{e}");
    assert_eq!(
        std::fs::read(&top_a).expect("read"),
        before,
        "nothing changed"
    );
    std::fs::remove_file(&top_b).expect("rm");
    let e = fails(&home, &counter_on_disk("e", a));
    assert!(e.contains("no such file"), "{e}");
    let out = t(&home, &counter_on_disk("e", "/nonexistent.raw"));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not found"));
    assert!(ls(&home).is_empty(), "no vm left behind");
    assert!(!home.path().join("vms/e").exists(), "no state left behind");
}
