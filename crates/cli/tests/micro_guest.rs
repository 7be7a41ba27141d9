//! Micro guests on this machine's /dev/kvm (any KVM, including kvm_pvm).

mod common;

use std::time::Duration;

use common::{kvm_available, RunningVm};

fn counter() -> String {
    guests::counter_path().display().to_string()
}

fn cnt_value(line: &str) -> u64 {
    line.strip_prefix("CNT ")
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("not a CNT line: {line:?}"))
}

#[test]
fn test_counter_boots_prints_ready_and_counts_every_100ms() {
    if !kvm_available() {
        return;
    }
    let vm = RunningVm::start(&["--kernel", &counter(), "--mem", "128M"]);
    vm.expect_line("READY", Duration::from_secs(5));
    vm.expect_line("WROTE 32", Duration::from_secs(5));
    let (t0, first) = vm.expect_line("CNT ", Duration::from_secs(2));
    let mut prev = cnt_value(&first);
    let mut last_t = t0;
    for _ in 0..10 {
        let (t, l) = vm.expect_line("CNT ", Duration::from_secs(2));
        let n = cnt_value(&l);
        assert_eq!(n, prev + 1, "CNT must count up by one");
        prev = n;
        last_t = t;
    }
    // Ten intervals of 100 ms; the machine is shared, so allow generous slack.
    let avg = last_t.duration_since(t0) / 10;
    assert!(
        avg > Duration::from_millis(70) && avg < Duration::from_millis(200),
        "CNT interval {avg:?}, want ~100 ms"
    );
}

#[test]
fn test_two_counters_run_at_once_without_interfering() {
    if !kvm_available() {
        return;
    }
    let a = RunningVm::start(&["--kernel", &counter(), "--mem", "96M", "--cmdline", "mib=8"]);
    let b = RunningVm::start(&[
        "--kernel",
        &counter(),
        "--mem",
        "128M",
        "--cmdline",
        "mib=48",
    ]);
    a.expect_line("WROTE 8", Duration::from_secs(5));
    b.expect_line("WROTE 48", Duration::from_secs(5));
    for vm in [&a, &b] {
        let mut prev = cnt_value(&vm.expect_line("CNT ", Duration::from_secs(2)).1);
        for _ in 0..5 {
            let n = cnt_value(&vm.expect_line("CNT ", Duration::from_secs(2)).1);
            assert_eq!(n, prev + 1);
            prev = n;
        }
    }
}

#[test]
fn test_memtouch_dirties_and_checksums_on_request() {
    if !kvm_available() {
        return;
    }
    let mut vm = RunningVm::start(&[
        "--kernel",
        &guests::memtouch_path().display().to_string(),
        "--mem",
        "128M",
    ]);
    vm.expect_line("READY", Duration::from_secs(5));
    vm.send("touch 16 7\n");
    let (_, touched) = vm.expect_line("TOUCHED 16 SUM ", Duration::from_secs(10));
    // The pattern and checksum are documented (guests/README.md): recompute
    // them here so the test checks the guest's memory, not just consistency.
    let want = format!("TOUCHED 16 SUM {:016x}", memtouch_sum(16, 7));
    assert_eq!(touched, want);
    vm.send("sum 16\n");
    let (_, sum) = vm.expect_line("SUM ", Duration::from_secs(10));
    assert_eq!(
        touched.rsplit(' ').next(),
        sum.rsplit(' ').next(),
        "sum must match what touch reported"
    );
    vm.send("touch 16 8\n");
    let (_, other) = vm.expect_line("TOUCHED 16 SUM ", Duration::from_secs(10));
    assert_ne!(
        other, touched,
        "a different seed must give a different checksum"
    );
    vm.send("bogus\n");
    vm.expect_line("ERR", Duration::from_secs(5));
}

#[test]
fn test_guest_reset_ends_vmm_cleanly() {
    if !kvm_available() {
        return;
    }
    // memtouch understands `reset`: it asks the i8042 to reset the CPU.
    let mut vm = RunningVm::start(&[
        "--kernel",
        &guests::memtouch_path().display().to_string(),
        "--mem",
        "64M",
    ]);
    vm.expect_line("READY", Duration::from_secs(5));
    vm.send("reset\n");
    let status = vm
        .wait(Duration::from_secs(5))
        .expect("VMM must exit after a guest reset");
    assert!(status.success(), "guest reset is a clean exit: {status:?}");
}

#[test]
fn test_counter_boots_with_memory_split_around_the_mmio_gap() {
    if !kvm_available() {
        return;
    }
    // 5 GiB: RAM below 3 GiB and above 4 GiB, two memory slots; untouched
    // RAM costs nothing.
    let vm = RunningVm::start(&["--image", "micro-counter", "--mem", "5G", "--vcpus", "2"]);
    vm.expect_line("READY", Duration::from_secs(5));
    vm.expect_line("WROTE 32", Duration::from_secs(5));
    vm.expect_line("CNT ", Duration::from_secs(2));
}

/// memtouch's checksum after `touch MIB SEED`: the u64 at address `a` is
/// `(a ^ seed) * 0x9e3779b97f4a7c15`, hashed with 64-bit FNV-1a from 16 MiB up.
fn memtouch_sum(mib: u64, seed: u64) -> u64 {
    let base = 16u64 << 20;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut a = base;
    while a < base + (mib << 20) {
        for b in ((a ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        a += 8;
    }
    h
}
