//! A Linux guest sleeps in the snapshot store and wakes with its files
//! (in RAM and on its disk) and processes, eagerly and lazily, and a
//! sleeping branch forks into new branches.
//!
//! Named `linux_*`: runs inside the nested test host when this machine has
//! no hardware virtualization.

mod common;

use common::{kvm_available, Home};

fn exec(h: &Home, vm: &str, script: &str) -> String {
    h.ok(&["exec", vm, "--", "sh", "-c", script])
}

#[test]
fn test_a_linux_guest_sleeps_and_wakes_with_its_files_and_processes() {
    if !kvm_available() {
        return;
    }
    let _serial = common::one_linux_test_at_a_time();
    let h = Home::new("linuxtree");
    let _disk = common::run_linux_with_disk(&h, "s", "linuxtreedisk");
    // A counter that runs across the sleep, a file in RAM (the initramfs
    // root), and a block on disk.
    let pid = exec(
        &h,
        "s",
        "(i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 1; done) >/dev/null 2>&1 & echo $!",
    );
    let pid = pid.trim().to_string();
    exec(
        &h,
        "s",
        "echo sleeper-data > /tmp/f && printf sleeper-disk | dd of=/dev/vda bs=4096 seek=100 conv=fsync 2>/dev/null \
         && printf doomed | dd of=/dev/vda bs=4096 seek=5000 conv=fsync 2>/dev/null",
    );
    let before: u64 = exec(&h, "s", "cat /tmp/count")
        .trim()
        .parse()
        .expect("count");

    let slept: serde_json::Value =
        serde_json::from_str(&h.ok(&["sleep", "s", "--json"])).expect("sleep --json");
    eprintln!(
        "linux sleep: guest paused {} ms, snapshot {} ms, store {} ms, {} MiB of memory, {} KiB new",
        slept["pause_ms"],
        slept["snapshot_ms"],
        slept["store_ms"],
        slept["memory_logical"].as_u64().unwrap_or(0) >> 20,
        slept["new_stored"].as_u64().unwrap_or(0) >> 10
    );
    let check = |vm: &str| {
        let out = exec(
            &h,
            vm,
            &format!("cat /tmp/f && kill -0 {pid} && echo alive && dd if=/dev/vda bs=4096 skip=100 count=1 2>/dev/null | head -c 12; echo; sleep 2; cat /tmp/count"),
        );
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.first(), Some(&"sleeper-data"), "{vm}: {out}");
        assert_eq!(lines.get(1), Some(&"alive"), "{vm}: {out}");
        assert_eq!(lines.get(2), Some(&"sleeper-disk"), "{vm}: {out}");
        let after: u64 = lines
            .get(3)
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or_else(|| panic!("{vm}: no count in {out}"));
        assert!(
            after > before,
            "{vm}: the counter goes on ({before} -> {after})"
        );
    };

    h.ok(&["wake", "s"]);
    check("s");
    // Writes after the wake are this branch's own; sleep it again (a
    // child snapshot) and wake that lazily, under another name too.
    // The disk too: a block overwritten, a new one, one zeroed. The sleep
    // stores the disk as a diff over the woken snapshot's (only the
    // windows its own layers map are read).
    exec(
        &h,
        "s",
        "echo second > /tmp/g && printf second-disk | dd of=/dev/vda bs=4096 seek=300 conv=fsync 2>/dev/null \
         && dd if=/dev/zero of=/dev/vda bs=4096 seek=5000 count=1 conv=fsync 2>/dev/null",
    );
    let slept: serde_json::Value =
        serde_json::from_str(&h.ok(&["sleep", "s", "--json"])).expect("sleep --json");
    let disk = &slept["disks"][0];
    assert_eq!(disk["diff"], true, "{slept}");
    assert!(
        disk["read_bytes"].as_u64().expect("read_bytes") < disk["size"].as_u64().expect("size") / 4,
        "a diff sleep reads the changed windows, not the disk: {slept}"
    );
    h.ok(&["wake", "s", "--lazy"]);
    check("s");
    assert_eq!(exec(&h, "s", "cat /tmp/g").trim(), "second");
    let blocks = exec(
        &h,
        "s",
        "dd if=/dev/vda bs=4096 skip=300 count=1 2>/dev/null | head -c 11; echo; dd if=/dev/vda bs=4096 skip=5000 count=1 2>/dev/null | od -An -tx1 | grep -c '[1-9a-f]' || true",
    );
    assert_eq!(
        blocks, "second-disk\n0\n",
        "the disk's writes after a wake survive the next sleep"
    );
    h.ok(&["sleep", "s"]);
    h.ok(&["fork", "s", "--names", "s1,s2"]);
    for c in ["s1", "s2"] {
        check(c);
        exec(&h, c, &format!("echo {c} > /tmp/g"));
    }
    assert_eq!(exec(&h, "s1", "cat /tmp/g").trim(), "s1");
    assert_eq!(exec(&h, "s2", "cat /tmp/g").trim(), "s2");
    let tree = h.ok(&["tree"]);
    eprintln!("{tree}");
    assert!(tree.contains("s (sleeping)"), "{tree}");
    let v = h.ok(&["store", "verify"]);
    assert!(v.contains("0 missing, 0 corrupt"), "{v}");
    for c in ["s1", "s2"] {
        h.ok(&["rm", "--force", c]);
    }
}
