//! Forking a Linux guest: every child answers exec, sees the parent's
//! files and processes as of the fork, and keeps its own writes to disk
//! and memory; rollback brings back a file deleted after the checkpoint.
//!
//! Named `linux_*`: runs inside the nested test host when this machine has
//! no hardware virtualization.

mod common;

use common::{kvm_available, Home};

fn exec(h: &Home, vm: &str, script: &str) -> String {
    h.ok(&["exec", vm, "--", "sh", "-c", script])
}

#[test]
fn test_fork_three_children_of_a_linux_guest_and_roll_back() {
    if !kvm_available() {
        return;
    }
    let _serial = common::one_linux_test_at_a_time();
    let h = Home::new("linuxfork");
    let _disk = common::run_linux_with_disk(&h, "p", "linuxforkdisk");
    // A process that runs across the fork, a file in RAM (the initramfs
    // root), and a block on disk.
    let pid = exec(
        &h,
        "p",
        "(while true; do sleep 1; done) >/dev/null 2>&1 & echo $!",
    );
    let pid = pid.trim().to_string();
    exec(
        &h,
        "p",
        "echo parent-data > /tmp/f && printf parent-disk | dd of=/dev/vda bs=4096 seek=100 conv=fsync 2>/dev/null",
    );

    let out = h.ok(&["fork", "p", "-n", "3", "--json"]);
    let reply: serde_json::Value = serde_json::from_str(&out).expect("json");
    eprintln!(
        "linux fork -n 3: guest paused {} ms, all children running after {} ms",
        reply["pause_ms"], reply["all_children_ms"]
    );
    let children = ["p-1", "p-2", "p-3"];
    for c in children {
        let out = exec(
            &h,
            c,
            &format!("cat /tmp/f && kill -0 {pid} && echo alive && dd if=/dev/vda bs=4096 skip=100 count=1 2>/dev/null | head -c 11"),
        );
        assert_eq!(out, "parent-data\nalive\nparent-disk", "{c}");
        exec(
            &h,
            c,
            &format!("echo {c} > /tmp/mine && printf {c} | dd of=/dev/vda bs=4096 seek=200 conv=fsync 2>/dev/null"),
        );
    }
    for c in children {
        let out = exec(
            &h,
            c,
            "cat /tmp/mine; dd if=/dev/vda bs=4096 skip=200 count=1 2>/dev/null | head -c 3",
        );
        assert_eq!(out, format!("{c}\n{c}"), "{c} keeps its own writes");
    }
    let out = exec(
        &h,
        "p",
        "cat /tmp/mine 2>/dev/null || echo none; dd if=/dev/vda bs=4096 skip=200 count=1 2>/dev/null | head -c 3 | od -An -tx1",
    );
    assert!(
        out.starts_with("none\n") && out.contains("00 00 00"),
        "the parent sees none of its children's writes: {out}"
    );

    // Rollback brings back a file deleted after the checkpoint.
    h.ok(&["checkpoint", "p", "--tag", "before-rm"]);
    exec(&h, "p", "rm /tmp/f && sync");
    assert_eq!(
        exec(&h, "p", "ls /tmp/f 2>/dev/null || echo gone"),
        "gone\n"
    );
    h.ok(&["rollback", "p", "before-rm"]);
    assert_eq!(exec(&h, "p", "cat /tmp/f"), "parent-data\n");
    for c in children.iter().chain(["p"].iter()) {
        h.ok(&["stop", c]);
    }
}
