//! What an open chain costs in file descriptors: one per layer (a test
//! binary of its own, so no other test opens files meanwhile).
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use disk::{create_overlay, Disk};

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn each_open_layer_costs_one_fd() {
    let d = TempDir::new("fds");
    let base = d.join("base.raw");
    make_raw_base(&base, 1 << 20, 3);
    let mut below = base.clone();
    for i in 0..9 {
        let top = d.join(&format!("l{i}.qcow2"));
        create_overlay(&below, &top).unwrap();
        below = top;
    }
    let before = open_fds();
    let disk = Disk::open(&below, true).unwrap();
    assert_eq!(disk.chain().len(), 10);
    assert_eq!(open_fds() - before, 10, "fds for a chain of 10 layers");
    let mut buf = [0u8; 4096];
    disk.write_at(&[7u8; 4096], 8192).unwrap();
    disk.read_at(&mut buf, 8192).unwrap();
    assert_eq!(buf, [7u8; 4096]);
    disk.flush().unwrap();
    drop(disk);
    assert_eq!(open_fds(), before, "closing the disk closes every layer");
    check(&below);
}
