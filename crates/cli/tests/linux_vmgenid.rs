//! VMGenID in a Linux guest: the kernel enumerates the DSDT's `QEMUVGID`
//! device (the Debian cloud kernel has no VMGenID driver, but the ACPI bus
//! lists every DSDT device) and the Generic Event Device that announces a
//! new id; the `ADDR` it reads points at 16 non-zero bytes; a fork child
//! has the device too, a different id at the same address, and took the
//! GED interrupt, while the parent keeps its id.
//!
//! Named `linux_*`: runs inside the nested test host when this machine has
//! no hardware virtualization.

mod common;

use common::{kvm_available, Home};

fn exec(h: &Home, vm: &str, script: &str) -> String {
    h.ok(&["exec", vm, "--", "sh", "-c", script])
}

/// Bytes from `od -An -tx1` output.
fn hex_bytes(od: &str) -> Vec<u8> {
    od.split_whitespace()
        .map(|b| u8::from_str_radix(b, 16).expect("od hex byte"))
        .collect()
}

/// One AML integer constant at the start of `b`: (value, length).
fn aml_integer(b: &[u8]) -> (u64, usize) {
    let le = |n: usize| {
        let mut v = [0u8; 8];
        v[..n].copy_from_slice(&b[1..=n]);
        u64::from_le_bytes(v)
    };
    match b[0] {
        0x00 => (0, 1),
        0x01 => (1, 1),
        0x0a => (le(1), 2),
        0x0b => (le(2), 3),
        0x0c => (le(4), 5),
        0x0e => (le(8), 9),
        op => panic!("not an AML integer: opcode {op:#x}"),
    }
}

/// The address in the DSDT's `Name (ADDR, Package (2) { low, high })`.
fn vmgenid_addr(dsdt: &[u8]) -> u64 {
    let at = dsdt
        .windows(5)
        .position(|w| w == b"ADDR\x12")
        .expect("an ADDR package in the DSDT");
    // Name, PackageOp, PkgLength (one byte here), NumElements.
    let pkg = &dsdt[at + 6..];
    assert_eq!(pkg[0], 2, "ADDR has two elements");
    let (low, n) = aml_integer(&pkg[1..]);
    let (high, _) = aml_integer(&pkg[1 + n..]);
    low | (high << 32)
}

/// The 16-byte generation id at `addr`, as the guest reads it through
/// /dev/mem (allowed below 1 MiB with STRICT_DEVMEM).
fn guest_id(h: &Home, vm: &str, addr: u64) -> Vec<u8> {
    let out = exec(
        h,
        vm,
        &format!(
            "dd if=/dev/mem bs=16 skip={} count=1 2>/dev/null | od -An -tx1 -v",
            addr / 16
        ),
    );
    let id = hex_bytes(&out);
    assert_eq!(id.len(), 16, "{vm}: read 16 bytes of the id: {out:?}");
    id
}

/// How many GED interrupts (the acpi-ged driver's "ACPI:Ged" line in
/// /proc/interrupts) the guest took.
fn ged_interrupts(h: &Home, vm: &str) -> u64 {
    let all = exec(h, vm, "cat /proc/interrupts");
    let line = all
        .lines()
        .find(|l| l.trim_end().ends_with("ACPI:Ged"))
        .unwrap_or_else(|| panic!("{vm}: the acpi-ged driver holds no interrupt:\n{all}"));
    line.split_whitespace()
        .skip(1)
        .map_while(|w| w.parse::<u64>().ok())
        .sum()
}

fn check_device(h: &Home, vm: &str) {
    let out = exec(
        h,
        vm,
        "cat /sys/bus/acpi/devices/QEMUVGID:00/hid /sys/bus/acpi/devices/QEMUVGID:00/path \
         /sys/bus/acpi/devices/ACPI0013:00/hid; dmesg | grep -ci 'acpi error' || true",
    );
    assert_eq!(
        out, "QEMUVGID\n\\_SB_.VGEN\nACPI0013\n0\n",
        "{vm}: the VMGenID device and the GED are enumerated, no ACPI errors"
    );
}

#[test]
fn test_vmgenid_device_in_a_linux_guest_and_its_fork() {
    if !kvm_available() {
        return;
    }
    let _serial = common::one_linux_test_at_a_time();
    let h = Home::new("linuxvmgenid");
    h.ok(&["run", "--name", "p", "--mem", "256M"]);

    check_device(&h, "p");
    let dsdt = hex_bytes(&exec(
        &h,
        "p",
        "od -An -tx1 -v /sys/firmware/acpi/tables/DSDT",
    ));
    assert_eq!(&dsdt[..4], b"DSDT");
    let addr = vmgenid_addr(&dsdt);
    eprintln!("VMGenID ADDR in the guest's DSDT: {addr:#x}");
    assert_eq!(
        addr,
        vmm::devices::legacy::vmgenid::VMGENID_ADDR,
        "the address the VMM reserves"
    );
    let parent_id = guest_id(&h, "p", addr);
    assert_ne!(parent_id, [0u8; 16], "the booted guest has an id");
    let parent_irqs = ged_interrupts(&h, "p");

    h.ok(&["fork", "p", "-n", "1"]);

    check_device(&h, "p-1");
    let child_dsdt = hex_bytes(&exec(
        &h,
        "p-1",
        "od -An -tx1 -v /sys/firmware/acpi/tables/DSDT",
    ));
    assert_eq!(vmgenid_addr(&child_dsdt), addr);
    let child_id = guest_id(&h, "p-1", addr);
    eprintln!("parent id {parent_id:02x?}\nchild id  {child_id:02x?}");
    assert_ne!(child_id, [0u8; 16]);
    assert_ne!(
        child_id, parent_id,
        "the fork child has a new generation id"
    );
    assert_eq!(
        guest_id(&h, "p", addr),
        parent_id,
        "the parent keeps its generation id"
    );
    let child_irqs = ged_interrupts(&h, "p-1");
    eprintln!("GED interrupts: parent {parent_irqs}, child {child_irqs}");
    assert_eq!(
        child_irqs,
        parent_irqs + 1,
        "the child took one GED interrupt (Notify VGEN)"
    );
    assert_eq!(ged_interrupts(&h, "p"), parent_irqs, "the parent took none");

    for vm in ["p-1", "p"] {
        h.ok(&["stop", vm]);
    }
}
