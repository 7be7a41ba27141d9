//! qcow2 chains checked against qemu-img as the oracle.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use disk::{create_overlay, freeze, Disk, DiskError, Format};
use std::path::Path;

const MIB: usize = 1 << 20;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn overlay_on_raw_base_writes_read_back_and_pass_qemu_check() {
    let d = TempDir::new("raw");
    let base = d.join("base.raw");
    let mut model = make_raw_base(&base, 8 * MIB, 1);
    let base_hash = hash(&base);
    let top = d.join("top.qcow2");
    create_overlay(&base, &top).unwrap();
    // A freshly created overlay is a valid image with the right backing.
    check(&top);
    let info = qemu_img_ok(&["info", "--output=json", s(&top)]);
    assert!(
        info.contains("\"backing-filename-format\": \"raw\""),
        "{info}"
    );
    assert!(
        info.contains(&format!("\"virtual-size\": {}", 8 * MIB)),
        "{info}"
    );

    {
        let disk = Disk::open(&top, true).unwrap();
        assert_eq!(disk.size(), (8 * MIB) as u64);
        // Unaligned writes crossing cluster boundaries, and a sector-aligned one.
        for (off, len, tag) in [
            (0usize, 4096usize, 7u8),
            (65536 - 100, 300, 8),
            (3 * MIB + 17, 200_000, 9),
            (8 * MIB - 512, 512, 10),
        ] {
            let p = pattern(len, tag);
            disk.write_at(&p, off as u64).unwrap();
            model[off..off + len].copy_from_slice(&p);
        }
        let mut buf = vec![0u8; 8 * MIB];
        disk.read_at(&mut buf, 0).unwrap();
        assert!(buf == model, "read-back through the overlay differs");
        disk.flush().unwrap();
        // Out-of-range requests are refused, not truncated.
        assert!(matches!(
            disk.read_at(&mut [0u8; 2], (8 * MIB - 1) as u64),
            Err(DiskError::OutOfRange { .. })
        ));
        let chain = disk.chain();
        assert_eq!(chain.len(), 2);
        assert_eq!(chain[0].format, Format::Qcow2);
        assert_eq!(chain[1].format, Format::Raw);
        assert_eq!(chain[1].virtual_size, (8 * MIB) as u64);
        assert!(chain[0].allocated_bytes > 0);
    }
    check(&top);
    assert_eq!(hash(&base), base_hash, "the base was written");
    assert!(qemu_contents(&top, &d.0) == model, "qemu sees other data");
    compare_flattened(&top, &d.0);

    // Reopen read-only: same data, writes refused.
    let disk = Disk::open(&top, false).unwrap();
    let mut buf = vec![0u8; 8 * MIB];
    disk.read_at(&mut buf, 0).unwrap();
    assert!(buf == model);
    assert!(matches!(
        disk.write_at(&[1], 0),
        Err(DiskError::NotWritable { .. })
    ));
}

#[test]
fn overlay_on_qcow2_base_with_discard_and_zeroes() {
    let d = TempDir::new("q2");
    let raw = d.join("src.raw");
    let mut model = make_raw_base(&raw, 4 * MIB, 2);
    let base = d.join("base.qcow2");
    qemu_img_ok(&["convert", "-f", "raw", "-O", "qcow2", s(&raw), s(&base)]);
    let base_hash = hash(&base);
    let top = d.join("top.qcow2");
    create_overlay(&base, &top).unwrap();
    {
        let mut disk = Disk::open(&top, true).unwrap();
        let mut rng = Rng(42);
        for i in 0..500u32 {
            let off = (rng.next_u64() % (4 * MIB as u64 - 8192)) as usize;
            let len = 1 + (rng.next_u64() % 8192) as usize;
            let p = pattern(len, i as u8);
            disk.write_at(&p, off as u64).unwrap();
            model[off..off + len].copy_from_slice(&p);
        }
        disk.write_zeroes(MIB as u64, 3 * 65536).unwrap();
        model[MIB..MIB + 3 * 65536].fill(0);
        disk.flush().unwrap();
        let mut buf = vec![0u8; 4 * MIB];
        disk.read_at(&mut buf, 0).unwrap();
        assert!(buf == model);
        // Discard: contents of the range become unspecified; the rest must be untouched.
        disk.discard(2 * MIB as u64, 65536).unwrap();
        disk.flush().unwrap();
        disk.read_at(&mut buf, 0).unwrap();
        assert!(
            buf[..2 * MIB] == model[..2 * MIB]
                && buf[2 * MIB + 65536..] == model[2 * MIB + 65536..]
        );
        model.copy_from_slice(&buf);
    }
    check(&top);
    check(&base);
    assert_eq!(hash(&base), base_hash);
    assert!(qemu_contents(&top, &d.0) == model);
    compare_flattened(&top, &d.0);
}

#[test]
fn freeze_then_two_overlays_diverge() {
    let d = TempDir::new("freeze");
    let base = d.join("base.raw");
    let mut model = make_raw_base(&base, 4 * MIB, 3);
    let top = d.join("vm.qcow2");
    create_overlay(&base, &top).unwrap();
    let disk = Disk::open(&top, true).unwrap();
    let p = pattern(100_000, 0x55);
    disk.write_at(&p, 12345).unwrap();
    model[12345..12345 + p.len()].copy_from_slice(&p);
    disk.flush().unwrap();
    // A writer still holds the top: freeze refuses and changes nothing.
    let before = hash(&top);
    match freeze(&top, 2, &d.0) {
        Err(e @ DiskError::Busy { .. }) => assert!(e.to_string().contains("vm.qcow2"), "{e}"),
        other => panic!("expected Busy, got {other:?}"),
    }
    assert!(!d.join("vm.0.qcow2").exists());
    drop(disk);
    assert_eq!(hash(&top), before);

    let (base_hash, frozen_hash) = (hash(&base), hash(&top));
    let kids = freeze(&top, 2, &d.0).unwrap();
    assert_eq!(kids, vec![d.join("vm.0.qcow2"), d.join("vm.1.qcow2")]);
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&top).unwrap().permissions().mode() & 0o222,
        0
    );
    // Frozen: even root (which ignores mode bits) cannot open it for writing through us.
    assert!(matches!(
        Disk::open(&top, true),
        Err(DiskError::ReadOnly { .. })
    ));

    let a = Disk::open(&kids[0], true).unwrap();
    let b = Disk::open(&kids[1], true).unwrap();
    let pa = pattern(70_000, 0xa);
    let pb = pattern(90_000, 0xb);
    a.write_at(&pa, 50_000).unwrap();
    b.write_at(&pb, 60_000).unwrap();
    b.write_at(&pb[..4096], 3 * MIB as u64).unwrap();
    a.flush().unwrap();
    b.flush().unwrap();
    let mut ma = model.clone();
    ma[50_000..120_000].copy_from_slice(&pa);
    let mut mb = model.clone();
    mb[60_000..150_000].copy_from_slice(&pb);
    mb[3 * MIB..3 * MIB + 4096].copy_from_slice(&pb[..4096]);
    let mut buf = vec![0u8; 4 * MIB];
    a.read_at(&mut buf, 0).unwrap();
    assert!(buf == ma, "branch a sees other data");
    b.read_at(&mut buf, 0).unwrap();
    assert!(buf == mb, "branch b sees other data");
    // Opening a frozen layer for write stays refused while branches read it.
    assert!(Disk::open(&top, true).is_err());
    drop(a);
    drop(b);
    for k in &kids {
        check(k);
        compare_flattened(k, &d.0);
    }
    check(&top);
    assert!(qemu_contents(&kids[0], &d.0) == ma);
    assert!(qemu_contents(&kids[1], &d.0) == mb);
    assert!(qemu_contents(&top, &d.0) == model);
    assert_eq!(hash(&base), base_hash, "base changed");
    assert_eq!(hash(&top), frozen_hash, "frozen layer changed");

    // Freezing a branch again: names must not clash, existing ones are refused.
    assert!(matches!(
        freeze(&top, 1, &d.0),
        Err(DiskError::Exists { .. })
    ));
}

#[test]
fn chain_fifty_deep_reads_correctly() {
    let d = TempDir::new("deep");
    let base = d.join("l00.raw");
    let mut model = make_raw_base(&base, 2 * MIB, 4);
    let base_hash = hash(&base);
    let mut rng = Rng(7);
    let mut below = base.clone();
    let mut layers = Vec::new();
    for i in 1..=50 {
        let top = d.join(&format!("l{i:02}.qcow2"));
        create_overlay(&below, &top).unwrap();
        let disk = Disk::open(&top, true).unwrap();
        for j in 0..3u8 {
            let off = (rng.next_u64() % (2 * MIB as u64 - 20_000)) as usize;
            let len = 1 + (rng.next_u64() % 20_000) as usize;
            let p = pattern(len, (i as u8) ^ (j << 6));
            disk.write_at(&p, off as u64).unwrap();
            model[off..off + len].copy_from_slice(&p);
        }
        disk.flush().unwrap();
        drop(disk);
        layers.push(top.clone());
        below = top;
    }
    let disk = Disk::open(&below, false).unwrap();
    assert_eq!(disk.chain().len(), 51);
    let mut buf = vec![0u8; 2 * MIB];
    disk.read_at(&mut buf, 0).unwrap();
    assert!(buf == model, "50-deep chain reads other data");
    drop(disk);
    for l in &layers {
        check(l);
    }
    compare_flattened(&below, &d.0);
    assert!(qemu_contents(&below, &d.0) == model);
    assert_eq!(hash(&base), base_hash);
}

#[test]
fn overlay_creation_time() {
    let d = TempDir::new("time");
    let base = d.join("base.qcow2");
    qemu_img_ok(&["create", "-q", "-f", "qcow2", s(&base), "20G"]);
    let mut times = Vec::new();
    for i in 0..100 {
        let o = d.join(&format!("o{i}.qcow2"));
        let t = std::time::Instant::now();
        create_overlay(&base, &o).unwrap();
        times.push(t.elapsed());
    }
    times.sort();
    println!(
        "overlay_create_ms median={:.3} max={:.3} (100 overlays on a 20 GiB qcow2)",
        times[50].as_secs_f64() * 1e3,
        times[99].as_secs_f64() * 1e3
    );
    check(&d.join("o0.qcow2"));
    check(&d.join("o99.qcow2"));
    // freeze with N overlays, including its single fsync of the directory.
    let t = std::time::Instant::now();
    let kids = freeze(&d.join("o0.qcow2"), 10, &d.0).unwrap();
    println!(
        "freeze_10_overlays_ms={:.3}",
        t.elapsed().as_secs_f64() * 1e3
    );
    check(&kids[9]);
}
