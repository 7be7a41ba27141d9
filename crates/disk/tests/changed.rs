//! `Disk::changed_above`: the ranges where a chain differs from one of its layers,
//! checked against what was written (by qemu-io and by this crate) and against the
//! contents qemu-img reads.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use disk::{create_overlay, freeze, Disk, DiskError};
use std::ops::Range;
use std::path::Path;
use std::process::Command;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// qemu-img's and create_overlay's default cluster size.
const CLUSTER: u64 = 64 * KIB;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// An empty qcow2 overlay at `path` over `backing` (of format `fmt`).
fn overlay(backing: &Path, fmt: &str, path: &Path) {
    qemu_img_ok(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        s(backing),
        "-F",
        fmt,
        s(path),
    ]);
}

fn qemu_io(img: &Path, cmd: &str) {
    let out = Command::new("qemu-io")
        .args(["-f", "qcow2", "-c", cmd, s(img)])
        .output()
        .expect("qemu-io runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && !text.contains("failed"),
        "qemu-io {cmd:?} on {}: {text}",
        img.display()
    );
}

fn ranges(top: &Path, layer: usize) -> Vec<Range<u64>> {
    let disk = Disk::open(top, false).unwrap();
    let r = disk.changed_above(layer).unwrap();
    for w in r.windows(2) {
        assert!(w[0].end < w[1].start, "not sorted, disjoint, merged: {r:?}");
    }
    r
}

/// Every byte where `now` differs from `before` lies in one of `r`: a byte outside them
/// would be lost by a diff built from them.
fn covers(r: &[Range<u64>], before: &[u8], now: &[u8]) {
    assert_eq!(before.len(), now.len());
    let mut i = 0usize;
    while i < now.len() {
        if before[i] != now[i] {
            assert!(
                r.iter().any(|x| x.contains(&(i as u64))),
                "byte {i} changed but is in no listed range {r:?}"
            );
        }
        i += 1;
    }
}

fn cl(a: u64, b: u64) -> Range<u64> {
    a..b
}

#[test]
fn qemu_written_data_zeroes_and_discards_are_listed() {
    let d = TempDir::new("changed-qemu");
    let base = d.join("base.raw");
    let base_data = make_raw_base(&base, (16 * MIB) as usize, 3);
    let l1 = d.join("l1.qcow2");
    overlay(&base, "raw", &l1);
    // Nothing written yet: nothing differs.
    assert_eq!(ranges(&l1, 1), vec![]);

    // Data, unaligned and crossing a cluster boundary: both clusters.
    qemu_io(&l1, "write -P 0xaa 1052672 4096"); // 1 MiB + 4 KiB
    qemu_io(&l1, "write -P 0xbb 2158592 131072"); // 2 MiB + 60 KiB, 128 KiB: 3 clusters
                                                  // Zero writes (explicit zero clusters) over the base's random data.
    qemu_io(&l1, "write -z 4194304 131072");
    // A discard of base data: qcow2 v3 makes it a zero cluster, reads change.
    qemu_io(&l1, "discard 6291456 65536");
    check(&l1);
    let want1 = vec![
        cl(MIB, MIB + CLUSTER),
        cl(2 * MIB, 2 * MIB + 3 * CLUSTER),
        cl(4 * MIB, 4 * MIB + 2 * CLUSTER),
        cl(6 * MIB, 6 * MIB + CLUSTER),
    ];
    assert_eq!(ranges(&l1, 1), want1);
    let now1 = qemu_contents(&l1, &d.0);
    covers(&want1, &base_data, &now1);
    assert!(now1[(6 * MIB) as usize..(6 * MIB + CLUSTER) as usize]
        .iter()
        .all(|&b| b == 0));

    // Freeze l1 and stack l2: changes above the base are the union; compared against
    // l1, only l2's own.
    let l2 = freeze(&l1, 1, &d.0).unwrap().remove(0);
    qemu_io(&l2, "write -P 0xcc 8388608 512");
    // Discard in l2 of what l1 wrote: still differs from the base (reads zero or l1's),
    // and differs from l1.
    qemu_io(&l2, "discard 1048576 65536");
    // Zero a range far from everything.
    qemu_io(&l2, "write -z 15728640 65536");
    check(&l2);
    let above_base = ranges(&l2, 2);
    let now2 = qemu_contents(&l2, &d.0);
    covers(&above_base, &base_data, &now2);
    assert_eq!(
        above_base,
        vec![
            cl(MIB, MIB + CLUSTER),
            cl(2 * MIB, 2 * MIB + 3 * CLUSTER),
            cl(4 * MIB, 4 * MIB + 2 * CLUSTER),
            cl(6 * MIB, 6 * MIB + CLUSTER),
            cl(8 * MIB, 8 * MIB + CLUSTER),
            cl(15 * MIB, 15 * MIB + CLUSTER),
        ]
    );
    let above_l1 = ranges(&l2, 1);
    covers(&above_l1, &now1, &now2);
    assert_eq!(
        above_l1,
        vec![
            cl(MIB, MIB + CLUSTER),
            cl(8 * MIB, 8 * MIB + CLUSTER),
            cl(15 * MIB, 15 * MIB + CLUSTER),
        ]
    );
    assert_eq!(ranges(&l2, 0), vec![]);
    let disk = Disk::open(&l2, false).unwrap();
    assert!(matches!(
        disk.changed_above(3),
        Err(DiskError::NoSuchLayer {
            layer: 3,
            depth: 3,
            ..
        })
    ));
    check(&l2);
}

#[test]
fn writes_zeroes_and_discards_through_this_crate_are_listed() {
    let d = TempDir::new("changed-disk");
    let base = d.join("base.raw");
    let size = 32 * MIB;
    let base_data = make_raw_base(&base, size as usize, 5);
    let mid = d.join("mid.qcow2");
    create_overlay(&base, &mid).unwrap();
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    // Random writes, zero writes and discards in two layers; the model is what a read
    // must return.
    let mut model = base_data.clone();
    let mut touched: Vec<Range<u64>> = Vec::new();
    let op = |disk: &mut Disk, model: &mut Vec<u8>, rng: &mut Rng| {
        let off = rng.next_u64() % (size - 300 * KIB);
        let len = 1 + rng.next_u64() % (200 * KIB);
        match rng.next_u64() % 4 {
            0 | 1 => {
                let p = pattern(len as usize, rng.next_u64() as u8);
                disk.write_at(&p, off).unwrap();
                model[off as usize..(off + len) as usize].copy_from_slice(&p);
            }
            2 => {
                disk.write_zeroes(off, len).unwrap();
                model[off as usize..(off + len) as usize].fill(0);
            }
            _ => {
                // Reads zero or the data below afterwards (unspecified): the model
                // takes what the disk reads; qemu must read the same at the end.
                disk.discard(off, len).unwrap();
                let mut now = vec![0u8; len as usize];
                disk.read_at(&mut now, off).unwrap();
                model[off as usize..(off + len) as usize].copy_from_slice(&now);
            }
        }
        off..off + len
    };
    {
        let mut disk = Disk::open(&mid, true).unwrap();
        for _ in 0..40 {
            touched.push(op(&mut disk, &mut model, &mut rng));
        }
        disk.flush().unwrap();
    }
    check(&mid);
    let top = freeze(&mid, 1, &d.0).unwrap().remove(0);
    {
        let mut disk = Disk::open(&top, true).unwrap();
        for _ in 0..40 {
            touched.push(op(&mut disk, &mut model, &mut rng));
        }
        disk.flush().unwrap();
    }
    check(&top);
    let now = qemu_contents(&top, &d.0);
    assert!(now == model, "the chain reads other data than written");
    let r = ranges(&top, 2);
    covers(&r, &base_data, &now);
    // Precise: nothing listed that no request touched (rounded out to clusters).
    for x in &r {
        let mut at = x.start;
        while at < x.end {
            assert!(
                touched
                    .iter()
                    .any(|t| t.start / CLUSTER <= at / CLUSTER && at < t.end),
                "cluster at {at} listed but never touched"
            );
            at += CLUSTER;
        }
    }
    let listed: u64 = r.iter().map(|x| x.end - x.start).sum();
    assert!(listed < size, "everything listed: {listed}");
    // A fresh overlay on top changes nothing relative to the layer below it.
    let top2 = d.join("top2.qcow2");
    create_overlay(&top, &top2).unwrap();
    assert_eq!(ranges(&top2, 1), vec![]);
    assert_eq!(ranges(&top2, 3), r);
}

#[test]
fn qcow2_base_compressed_clusters_count_as_changed() {
    let d = TempDir::new("changed-compressed");
    let base = d.join("base.qcow2");
    qemu_img_ok(&["create", "-q", "-f", "qcow2", s(&base), "4M"]);
    qemu_io(&base, "write -P 0x11 0 4M");
    let mid = d.join("mid.qcow2");
    overlay(&base, "qcow2", &mid);
    // A compressed cluster (qemu-io write -c) in the layer above the base.
    qemu_io(&mid, "write -c -P 0x22 2097152 65536");
    check(&mid);
    assert_eq!(ranges(&mid, 1), vec![cl(2 * MIB, 2 * MIB + CLUSTER)]);
    assert_eq!(ranges(&mid, 0), vec![]);
}
