//! Folding layers into an open top, checked against qemu-img: the chain
//! stays valid, the disk reads the same, guest-style writes during the
//! fold land, and a crash midway leaves a valid chain.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use disk::{create_overlay, Disk, FOLD_STEP};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const MIB: usize = 1 << 20;
const SIZE: usize = 8 * MIB;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// base.raw <- l1 <- l2 <- top, each overlay with writes of its own
/// (data, zeroes, overlapping the others); returns (top, model of the
/// disk, [l2, l1]).
fn three_layers(d: &TempDir) -> (PathBuf, Vec<u8>, Vec<PathBuf>) {
    let base = d.join("base.raw");
    let mut model = make_raw_base(&base, SIZE, 5);
    let mut below = base;
    let mut mids = Vec::new();
    let mut rng = Rng(0x1234_5678);
    for (i, name) in ["l1.qcow2", "l2.qcow2", "top.qcow2"].iter().enumerate() {
        let p = d.join(name);
        create_overlay(&below, &p).unwrap();
        let disk = Disk::open(&p, true).unwrap();
        for j in 0..40 {
            let len = 512 * (1 + (rng.next_u64() % 300) as usize);
            let off = 512 * (rng.next_u64() % ((SIZE - len) as u64 / 512)) as usize;
            if j % 7 == 3 {
                disk.write_zeroes(off as u64, len as u64).unwrap();
                model[off..off + len].fill(0);
            } else {
                let data = pattern(len, (i * 50 + j) as u8);
                disk.write_at(&data, off as u64).unwrap();
                model[off..off + len].copy_from_slice(&data);
            }
        }
        disk.flush().unwrap();
        drop(disk);
        if i < 2 {
            mids.push(p.clone());
        }
        below = p;
    }
    // Top-most first, as the chain lists them.
    mids.reverse();
    (below, model, mids)
}

#[test]
fn folding_two_layers_keeps_the_disk_and_passes_qemu_check() {
    let d = TempDir::new("fold");
    let (top, model, mids) = three_layers(&d);
    assert_eq!(qemu_contents(&top, &d.0), model);
    let mut disk = Disk::open(&top, true).unwrap();
    assert_eq!(disk.chain().len(), 4);
    let done = disk.fold(2).unwrap();
    assert_eq!(done.folded, mids);
    assert_eq!(done.depth, 2);
    assert!(done.bytes_copied > 0);
    assert_eq!(disk.chain().len(), 2);
    // The disk reads the same through the open, folded chain...
    let mut buf = vec![0u8; SIZE];
    disk.read_at(&mut buf, 0).unwrap();
    assert!(buf == model, "the folded disk reads differently");
    // ...and writes go on.
    disk.write_at(&[9u8; 4096], 4096).unwrap();
    disk.flush().unwrap();
    drop(disk);
    let mut model = model;
    model[4096..8192].fill(9);
    check(&top);
    let info = qemu_img_ok(&["info", "--output=json", s(&top)]);
    assert!(info.contains("base.raw"), "{info}");
    assert!(
        info.contains("\"backing-filename-format\": \"raw\""),
        "{info}"
    );
    // The folded layers are not needed any more.
    for m in &mids {
        std::fs::remove_file(m).unwrap();
    }
    assert_eq!(qemu_contents(&top, &d.0), model);
    let base = d.join("base.raw");
    let flat = d.join("model.raw");
    std::fs::write(&flat, &model).unwrap();
    let cmp = qemu_img_ok(&["compare", "-f", "qcow2", "-F", "raw", s(&top), s(&flat)]);
    assert!(cmp.contains("Images are identical"), "{cmp}");
    assert_eq!(Disk::open(&top, false).unwrap().chain()[1].path, base);
}

#[test]
fn folding_one_of_two_leaves_a_qcow2_below() {
    let d = TempDir::new("fold1");
    let (top, model, mids) = three_layers(&d);
    let mut disk = Disk::open(&top, true).unwrap();
    let done = disk.fold(1).unwrap();
    assert_eq!(done.folded, mids[..1]);
    assert_eq!(disk.chain().len(), 3);
    drop(disk);
    check(&top);
    std::fs::remove_file(&mids[0]).unwrap();
    assert_eq!(qemu_contents(&top, &d.0), model);
    let info = qemu_img_ok(&["info", "--output=json", s(&top)]);
    assert!(
        info.contains("\"backing-filename-format\": \"qcow2\""),
        "{info}"
    );
}

#[test]
fn a_fold_is_refused_for_the_bottom_layer_or_nothing() {
    let d = TempDir::new("foldbad");
    let (top, _, _) = three_layers(&d);
    let mut disk = Disk::open(&top, true).unwrap();
    assert!(disk.fold(0).is_err());
    assert!(disk.fold(3).is_err(), "the raw base cannot be folded");
    drop(disk);
    let mut ro = Disk::open(&top, false).unwrap();
    assert!(ro.fold(1).is_err(), "a read-only disk is not folded");
    drop(ro);
    check(&top);
}

#[test]
fn guest_writes_during_a_fold_land_and_win() {
    let d = TempDir::new("foldrace");
    let (top, model, mids) = three_layers(&d);
    let disk = Arc::new(Mutex::new(Disk::open(&top, true).unwrap()));
    let model = Arc::new(Mutex::new(model));
    let writer = {
        let (disk, model) = (disk.clone(), model.clone());
        std::thread::spawn(move || {
            let mut rng = Rng(0xfeed);
            for j in 0..400 {
                let len = 512 * (1 + (rng.next_u64() % 64) as usize);
                let off = 512 * (rng.next_u64() % ((SIZE - len) as u64 / 512)) as usize;
                let data = pattern(len, (j % 251) as u8);
                // The device thread's lock: a guest write and a fold step
                // never interleave.
                let d = disk.lock().unwrap();
                d.write_at(&data, off as u64).unwrap();
                model.lock().unwrap()[off..off + len].copy_from_slice(&data);
                drop(d);
                std::thread::yield_now();
            }
        })
    };
    let mut fold = disk.lock().unwrap().fold_start(2).unwrap();
    let mut steps = 0;
    // Small steps, so the writer gets in between them.
    while disk
        .lock()
        .unwrap()
        .fold_step(&mut fold, 64 * 1024)
        .unwrap()
    {
        steps += 1;
        std::thread::yield_now();
    }
    fold.open_rest().unwrap();
    writer.join().unwrap();
    let done = disk.lock().unwrap().fold_finish(fold).unwrap();
    assert_eq!(done.depth, 2);
    assert!(steps > 4, "{steps} steps");
    let disk = Arc::try_unwrap(disk).unwrap().into_inner().unwrap();
    disk.flush().unwrap();
    drop(disk);
    check(&top);
    for m in &mids {
        std::fs::remove_file(m).unwrap();
    }
    assert!(qemu_contents(&top, &d.0) == *model.lock().unwrap());
}

/// The child of [`a_crash_midway_leaves_a_valid_chain`]: folds part way,
/// then dies by SIGKILL (no destructor, no flush of cached metadata).
fn crash_child(top: &Path, steps: usize, finish: bool) -> ! {
    let mut disk = Disk::open(top, true).unwrap();
    let mut fold = disk.fold_start(2).unwrap();
    for _ in 0..steps {
        if !disk.fold_step(&mut fold, FOLD_STEP / 4).unwrap() {
            break;
        }
    }
    if finish {
        disk.fold_finish(fold).unwrap();
    }
    // SAFETY: kills this test's own child process.
    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    unreachable!("SIGKILL")
}

#[test]
fn a_crash_midway_leaves_a_valid_chain() {
    if let Ok(top) = std::env::var("TINE_FOLD_CRASH_TOP") {
        let steps = std::env::var("TINE_FOLD_CRASH_STEPS")
            .unwrap()
            .parse()
            .unwrap();
        let finish = std::env::var("TINE_FOLD_CRASH_FINISH").is_ok();
        crash_child(Path::new(&top), steps, finish);
    }
    for (steps, finish) in [(0, false), (3, false), (1000, false), (1000, true)] {
        let d = TempDir::new("foldcrash");
        let (top, model, mids) = three_layers(&d);
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args([
            "--exact",
            "a_crash_midway_leaves_a_valid_chain",
            "--nocapture",
        ])
        .env("TINE_FOLD_CRASH_TOP", &top)
        .env("TINE_FOLD_CRASH_STEPS", steps.to_string());
        if finish {
            cmd.env("TINE_FOLD_CRASH_FINISH", "1");
        }
        let status = cmd.output().unwrap().status;
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL),
            "the child was to die midway"
        );
        // Whatever the crash left is a valid image reading as before...
        let (rc, out) = qemu_img(&["check", "-f", "qcow2", s(&top)]);
        // Clusters copied but not yet referenced by flushed metadata are
        // leaks (rc 3), never errors; `qemu-img check -r leaks` reclaims them.
        assert!(rc == 0 || rc == 3, "steps {steps}: rc {rc}: {out}");
        assert!(!out.contains("ERROR"), "steps {steps}: {out}");
        assert!(qemu_contents(&top, &d.0) == model, "steps {steps}");
        let depth = Disk::open(&top, false).unwrap().chain().len();
        assert_eq!(depth, if finish { 2 } else { 4 }, "steps {steps}");
        // ...and a fold started again completes.
        let mut disk = Disk::open(&top, true).unwrap();
        if !finish {
            disk.fold(2).unwrap();
        }
        drop(disk);
        check(&top);
        for m in &mids {
            std::fs::remove_file(m).unwrap();
        }
        assert!(qemu_contents(&top, &d.0) == model, "steps {steps}");
    }
}
