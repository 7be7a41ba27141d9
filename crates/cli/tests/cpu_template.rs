//! `tine run --cpu-template` with the `cpuid` micro guest on this
//! machine's /dev/kvm, through tined: the guest sees the template, its
//! snapshot records it and restores; custom template files; bad ones and
//! misuse refused before anything runs; `tine cpu-templates`.

mod common;

use std::time::{Duration, Instant};

use common::{kvm_available, Home, TempDir};

fn console(h: &Home, vm: &str) -> String {
    std::fs::read_to_string(h.0.path().join("vms").join(vm).join("console.log")).unwrap_or_default()
}

/// Sends `cpuid <leaf> <sub>` and returns the four registers the guest saw.
fn cpuid(h: &Home, vm: &str, leaf: u32, sub: u32) -> [u32; 4] {
    let from = console(h, vm).len();
    h.ok(&["console", vm, "--send", &format!("cpuid {leaf} {sub}")]);
    let want = format!("CPUID {leaf} {sub} ");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = console(h, vm);
        let done = text.rfind('\n').map(|i| i + 1).unwrap_or(0);
        if let Some(l) = text
            .get(from..done)
            .unwrap_or("")
            .lines()
            .find(|l| l.starts_with(&want))
        {
            let r: Vec<u32> = l
                .split_whitespace()
                .skip(3)
                .map(|w| u32::from_str_radix(&w[8..], 16).expect("hex register"))
                .collect();
            return [r[0], r[1], r[2], r[3]];
        }
        assert!(
            Instant::now() < deadline,
            "no {want:?} line from {vm}:\n{}",
            text.get(from..).unwrap_or("")
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn test_run_under_a_template_snapshot_and_restore() {
    if !kvm_available() {
        return;
    }
    let h = Home::new("cputpl");
    let kernel = guests::cpuid_path().display().to_string();

    let list: serde_json::Value =
        serde_json::from_str(&h.ok(&["cpu-templates", "--json"])).expect("json");
    let t2 = list
        .as_array()
        .and_then(|a| a.iter().find(|t| t["name"] == "t2"))
        .expect("t2 listed")
        .clone();
    assert_eq!(t2["satisfied"], true, "this host satisfies t2: {t2}");
    let hash = t2["hash"].as_str().expect("hash").to_string();
    let text = h.ok(&["cpu-templates"]);
    assert!(text.contains("t2     satisfies"), "{text}");

    h.ok(&[
        "run",
        "--name",
        "c",
        "--kernel",
        &kernel,
        "--mem",
        "64M",
        "--cpu-template",
        "t2",
    ]);
    let leaf1 = cpuid(&h, "c", 1, 0);
    assert_eq!(leaf1[2] & (1 << 17), 0, "pcid hidden");
    assert_ne!(leaf1[2] & (1 << 20), 0, "sse4_2 shown");
    let ext = cpuid(&h, "c", 0x8000_0001, 0);
    assert_eq!(ext[3] & (1 << 26), 0, "1 GiB pages hidden");

    let dir = TempDir::new("cputpl-snap");
    let snap = dir.path().join("s");
    let snap_s = snap.to_str().expect("utf-8");
    h.ok(&["snapshot", "c", "--to", snap_s]);
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(snap.join("manifest.json")).expect("manifest"),
    )
    .expect("json");
    let rec = &manifest["compat"]["cpu_template"];
    assert_eq!(rec["name"], "t2", "{rec}");
    assert_eq!(rec["hash"], hash.as_str());

    // A restore keeps the snapshot's template; it takes none of its own.
    let out = h.out(&[
        "run",
        "--name",
        "x",
        "--from",
        snap_s,
        "--cpu-template",
        "t2",
    ]);
    assert!(!out.status.success());
    h.ok(&["run", "--name", "r", "--from", snap_s]);
    assert_eq!(
        cpuid(&h, "r", 1, 0),
        leaf1,
        "the restored guest sees the same"
    );

    // A custom template: t2 as JSON, renamed, from a relative path.
    let t2_json = h.ok(&["cpu-templates", "show", "t2"]);
    let custom = dir.path().join("mine.json");
    std::fs::write(
        &custom,
        t2_json.replace("\"name\": \"t2\"", "\"name\": \"mine\""),
    )
    .expect("write");
    let mut run = h.cmd(&[
        "run",
        "--name",
        "m",
        "--kernel",
        &kernel,
        "--mem",
        "64M",
        "--cpu-template",
        "mine.json",
    ]);
    run.current_dir(dir.path());
    let out = run.output().expect("tine run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(cpuid(&h, "m", 1, 0)[2], leaf1[2]);

    // A bad template file is refused before anything starts, naming the fault.
    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        r#"{"cpuid_modifiers": [{"leaf": "0x7", "modifiers": [{"register": "ebz", "bitmap": "0b1"}]}]}"#,
    )
    .expect("write");
    let out = h.out(&[
        "run",
        "--name",
        "b",
        "--kernel",
        &kernel,
        "--cpu-template",
        bad.to_str().expect("utf-8"),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("register \"ebz\" is not one of eax, ebx, ecx, edx"),
        "{err}"
    );
    let out = h.out(&[
        "run",
        "--name",
        "b",
        "--kernel",
        &kernel,
        "--cpu-template",
        "t9",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a built-in template (t2, t2s)"), "{err}");
    assert!(h.ls().iter().all(|r| r["name"] != "b"), "nothing left of b");
    for vm in ["c", "r", "m"] {
        h.ok(&["rm", "--force", vm]);
    }
}
