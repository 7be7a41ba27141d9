//! Disk layers with a Linux guest: every vm writes into its own qcow2 top
//! layer; bases never change; frozen layers branch; a crash loses nothing
//! that was flushed. `qemu-img` is the oracle.
//!
//! Named `linux_*`: runs inside the nested test host when this machine has
//! no hardware virtualization.

mod common;

use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{kvm_available, Home, TempDir};

fn hash(p: &Path) -> String {
    blake3::hash(&std::fs::read(p).expect("read"))
        .to_hex()
        .to_string()
}

fn qemu_img(args: &[&str]) -> Output {
    Command::new("qemu-img")
        .args(args)
        .output()
        .expect("qemu-img (qemu-utils) must be installed")
}

fn check(p: &Path) {
    let out = qemu_img(&["check", p.to_str().expect("utf8")]);
    assert!(
        out.status.success(),
        "qemu-img check {}: {}",
        p.display(),
        String::from_utf8_lossy(&out.stdout)
    );
}

/// The guest-visible bytes of a chain, flattened by qemu-img.
fn flatten(top: &Path, dir: &Path) -> Vec<u8> {
    let raw = dir.join(format!("flat-{}.raw", std::process::id()));
    let out = qemu_img(&[
        "convert",
        "-O",
        "raw",
        top.to_str().expect("utf8"),
        raw.to_str().expect("utf8"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(&raw).expect("read");
    let _ = std::fs::remove_file(raw);
    bytes
}

fn write_at(h: &Home, vm: &str, block: u64, text: &str) {
    let cmd = format!("printf {text} | dd of=/dev/vda bs=4096 seek={block} conv=fsync 2>/dev/null");
    h.ok(&["exec", vm, "--", "sh", "-c", &cmd]);
}

fn read_at(h: &Home, vm: &str, block: u64, len: usize) -> String {
    let cmd = format!("dd if=/dev/vda bs=4096 skip={block} count=1 2>/dev/null | head -c {len}");
    h.ok(&["exec", vm, "--", "sh", "-c", &cmd])
}

#[test]
fn test_vm_writes_its_own_layer_and_frozen_layers_branch() {
    if !kvm_available() {
        return;
    }
    let _serial = common::one_linux_test_at_a_time();
    let h = Home::new("disk");
    let dir = TempDir::new("diskfiles");
    let base = dir.path().join("base.raw");
    std::fs::write(&base, vec![0u8; 64 << 20]).expect("base");
    let base_hash = hash(&base);

    h.ok(&[
        "run",
        "--name",
        "w",
        "--mem",
        "256M",
        "--disk",
        base.to_str().expect("utf8"),
    ]);
    write_at(&h, "w", 100, "pattern-A");
    // The guest sees discard support and can discard (a range away from the pattern).
    write_at(&h, "w", 300, "discard-me");
    let out = h.ok(&[
        "exec",
        "w",
        "--",
        "sh",
        "-c",
        "cat /sys/block/vda/queue/discard_max_bytes && blkdiscard -o 1228800 -l 65536 /dev/vda && echo discarded",
    ]);
    assert!(
        out.ends_with("discarded\n") && !out.starts_with("0\n"),
        "{out}"
    );
    let layers = h.ok(&["disk", "layers", "w"]);
    assert!(
        layers.contains("qcow2") && layers.contains("raw"),
        "{layers}"
    );
    h.ok(&["stop", "w"]);
    let top = h.top("w");
    check(&top);
    assert_eq!(hash(&base), base_hash, "the base must never be written");
    let flat = flatten(&top, dir.path());
    assert_eq!(&flat[100 * 4096..100 * 4096 + 9], b"pattern-A");

    // Freeze the vm's layer and branch twice; each branch sees only its own writes.
    let frozen_hash = hash(&top);
    let branches = disk::freeze(&top, 2, dir.path()).expect("freeze");
    for (vm, b) in ["c1", "c2"].iter().zip(&branches) {
        h.ok(&[
            "run",
            "--name",
            vm,
            "--mem",
            "256M",
            "--disk",
            b.to_str().expect("utf8"),
        ]);
    }
    write_at(&h, "c1", 200, "from-c1");
    write_at(&h, "c2", 200, "from-c2");
    for (vm, mine) in [("c1", "from-c1"), ("c2", "from-c2")] {
        assert_eq!(
            read_at(&h, vm, 100, 9),
            "pattern-A",
            "{vm} sees the parent's write"
        );
        assert_eq!(
            read_at(&h, vm, 200, 7),
            mine,
            "{vm} sees only its own write"
        );
    }
    h.ok(&["stop", "c1"]);
    h.ok(&["stop", "c2"]);
    for vm in ["c1", "c2"] {
        check(&h.top(vm));
    }
    for b in &branches {
        check(b);
    }
    assert_eq!(hash(&top), frozen_hash, "the frozen layer must not change");
    assert_eq!(hash(&base), base_hash, "the base must not change");
    let c1 = flatten(&h.top("c1"), dir.path());
    let c2 = flatten(&h.top("c2"), dir.path());
    assert_eq!(&c1[200 * 4096..200 * 4096 + 7], b"from-c1");
    assert_eq!(&c2[200 * 4096..200 * 4096 + 7], b"from-c2");
    let cmp = qemu_img(&[
        "compare",
        h.top("c1").to_str().expect("utf8"),
        h.top("c2").to_str().expect("utf8"),
    ]);
    assert_eq!(cmp.status.code(), Some(1), "the branches must differ");
}

#[test]
fn test_kill_9_keeps_every_flushed_write() {
    if !kvm_available() {
        return;
    }
    let _serial = common::one_linux_test_at_a_time();
    let h = Home::new("crash");
    let dir = TempDir::new("crashfiles");
    let base = dir.path().join("base.raw");
    std::fs::write(&base, vec![0u8; 32 << 20]).expect("base");
    h.ok(&[
        "run",
        "--name",
        "crash",
        "--mem",
        "256M",
        "--disk",
        base.to_str().expect("utf8"),
    ]);

    // The guest writes record i at sector i with an fsync each, and says ACK i
    // only after dd (and so the flush) returned.
    let args = [
        "exec",
        "crash",
        "--",
        "sh",
        "-c",
        "i=0; while [ $i -lt 100000 ]; do printf 'rec%08d' $i | dd of=/dev/vda bs=512 seek=$i conv=fsync 2>/dev/null && echo ACK $i; i=$((i+1)); done",
    ];
    let mut writer = h
        .cmd(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        // Its own group, so killing it below also ends anything it started.
        .process_group(0)
        .spawn()
        .expect("exec");
    // Lines come through a channel so a guest that stops printing cannot
    // block the test past the deadline.
    let stdout = writer.stdout.take().expect("stdout");
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let started = Instant::now();
    let deadline = started + Duration::from_secs(120);
    let mut acked = 0u64;
    let mut last = String::new();
    while acked < 40 {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                if let Some(n) = line
                    .strip_prefix("ACK ")
                    .and_then(|n| n.parse::<u64>().ok())
                {
                    acked = n;
                }
                last = line;
            }
            // The deadline, or the writer ended (its output is all in).
            Err(_) => break,
        }
    }
    common::progress(&format!(
        "kill -9 test: {acked} flushed writes acknowledged in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    if acked < 10 {
        let _ = writer.kill();
        let status = writer.wait();
        panic!(
            "the guest acknowledged only {acked} writes in {:.1} s (last line {last:?}, writer {status:?})\n{}",
            started.elapsed().as_secs_f64(),
            h.diagnostics()
        );
    }
    let out = h.ok(&["ls", "--json"]);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out).expect("json");
    let pid = rows[0]["pid"].as_u64().expect("pid");
    assert!(Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill")
        .success());
    let _ = writer.kill();
    let _ = writer.wait();

    let top = h.top("crash");
    check(&top);
    let flat = flatten(&top, dir.path());
    for i in 0..=acked {
        let at = (i * 512) as usize;
        assert_eq!(
            &flat[at..at + 11],
            format!("rec{i:08}").as_bytes(),
            "acknowledged write {i} lost"
        );
    }
}

#[test]
fn test_debian_image_boots_with_root_on_its_own_layer() {
    if !kvm_available() {
        return;
    }
    let _serial = common::one_linux_test_at_a_time();
    let h = Home::new("debian");
    h.ok(&["run", "--name", "w", "--image", "debian", "--mem", "512M"]);
    let out = h.ok(&["exec", "w", "--", "python3", "-c", "print(6 * 7)"]);
    assert_eq!(out, "42\n");
    let out = h.ok(&[
        "exec",
        "w",
        "--",
        "sh",
        "-c",
        "fio --version && findmnt -n -o SOURCE / && echo kept > /root/f && sync",
    ]);
    assert!(out.starts_with("fio-") && out.contains("/dev/vda"), "{out}");
    let layers = h.ok(&["disk", "layers", "w"]);
    assert!(
        layers.contains("debian.ext4"),
        "the image's rootfs is the base: {layers}"
    );
    h.ok(&["stop", "w"]);
    check(&h.top("w"));
}
