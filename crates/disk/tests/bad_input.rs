//! Bad input: each a clear typed error naming the file, and nothing changed on disk.
#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use disk::{create_overlay, Disk, DiskError};
use std::path::{Path, PathBuf};

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A qcow2 `top` of `size` over `backing` (in `format`). `-u`: qemu-img
/// does not open the backing, which may be missing or broken on purpose.
fn create_over(top: &Path, backing: &Path, format: &str, size: &str) {
    qemu_img_ok(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-u",
        "-b",
        s(backing),
        "-F",
        format,
        s(top),
        size,
    ]);
}

/// Points qcow2 `layer` at the qcow2 `backing` without checking it (to
/// make cycles).
fn rebase_over(layer: &Path, backing: &Path) {
    qemu_img_ok(&[
        "rebase",
        "-u",
        "-f",
        "qcow2",
        "-b",
        s(backing),
        "-F",
        "qcow2",
        s(layer),
    ]);
}

/// Hash every file in `dir` (name -> hash), to prove an error changed nothing.
fn snapshot(dir: &Path) -> Vec<(PathBuf, blake3::Hash, u32)> {
    use std::os::unix::fs::PermissionsExt;
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let mode = std::fs::metadata(&p).unwrap().permissions().mode();
            (p.clone(), hash(&p), mode)
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Open `top` for writing (and read-only too), expect an error, check the message names
/// `names` and that nothing in the directory changed.
fn expect_err(dir: &Path, top: &Path, names: &str) -> DiskError {
    let before = snapshot(dir);
    let err = Disk::open(top, true).unwrap_err();
    let msg = err.to_string();
    println!("{msg}");
    assert!(msg.contains(names), "error {msg:?} does not name {names}");
    let _ = Disk::open(top, false);
    assert_eq!(snapshot(dir), before, "a failed open changed files");
    err
}

#[test]
fn missing_backing_file() {
    let d = TempDir::new("missing");
    let top = d.join("top.qcow2");
    let gone = d.join("gone.raw");
    create_over(&top, &gone, "raw", "1M");
    let err = expect_err(&d.0, &top, "gone.raw");
    match err {
        DiskError::Missing {
            path,
            referenced_by,
        } => {
            assert_eq!(path, gone);
            assert_eq!(referenced_by.as_deref(), Some(top.as_path()));
        }
        e => panic!("expected Missing, got {e:?}"),
    }
    assert!(matches!(
        create_overlay(&gone, &d.join("x.qcow2")),
        Err(DiskError::Missing { .. })
    ));
    assert!(!d.join("x.qcow2").exists());
    // And the top itself missing.
    assert!(matches!(
        Disk::open(&d.join("nope.qcow2"), true),
        Err(DiskError::Missing { .. })
    ));
}

#[test]
fn backing_chain_cycle() {
    let d = TempDir::new("cycle");
    let a = d.join("a.qcow2");
    let b = d.join("b.qcow2");
    qemu_img_ok(&["create", "-q", "-f", "qcow2", s(&a), "1M"]);
    create_over(&b, &a, "qcow2", "1M");
    rebase_over(&a, &b);
    let err = expect_err(&d.0, &a, "b.qcow2 -> ");
    assert!(err.to_string().contains("cycle"), "{err}");
    assert!(matches!(err, DiskError::Cycle { .. }), "{err:?}");
    // A layer that names itself.
    let c = d.join("c.qcow2");
    qemu_img_ok(&["create", "-q", "-f", "qcow2", s(&c), "1M"]);
    rebase_over(&c, &c);
    assert!(matches!(
        expect_err(&d.0, &c, "c.qcow2"),
        DiskError::Cycle { .. }
    ));
}

#[test]
fn truncated_qcow2_header() {
    let d = TempDir::new("trunc");
    let good = d.join("good.qcow2");
    qemu_img_ok(&["create", "-q", "-f", "qcow2", s(&good), "1M"]);
    let bytes = std::fs::read(&good).unwrap();
    for cut in [3usize, 50, 90, 300] {
        let t = d.join(&format!("cut{cut}.qcow2"));
        std::fs::write(&t, &bytes[..cut]).unwrap();
        let err = expect_err(&d.0, &t, &format!("cut{cut}.qcow2"));
        assert!(
            matches!(err, DiskError::Truncated { .. } | DiskError::Corrupt { .. }),
            "cut at {cut}: {err:?}"
        );
        // A truncated image as the backing of a good overlay: the error names the backing.
        let top = d.join(&format!("over{cut}.qcow2"));
        create_over(&top, &t, "qcow2", "1M");
        let err = expect_err(&d.0, &top, &format!("cut{cut}.qcow2"));
        assert!(
            matches!(err, DiskError::Truncated { .. } | DiskError::Corrupt { .. }),
            "{err:?}"
        );
    }
    // Exactly the 3 header cases that are plainly "truncated".
    assert!(matches!(
        Disk::open(&d.join("cut50.qcow2"), false),
        Err(DiskError::Truncated { .. })
    ));
    assert!(matches!(
        Disk::open(&d.join("cut90.qcow2"), false),
        Err(DiskError::Truncated { .. })
    ));
}

#[test]
fn layer_of_another_virtual_size() {
    let d = TempDir::new("size");
    let base = d.join("base.raw");
    make_raw_base(&base, 1 << 20, 5);
    let top = d.join("top.qcow2");
    create_over(&top, &base, "raw", "2M");
    let err = expect_err(&d.0, &top, "base.raw");
    match &err {
        DiskError::SizeMismatch {
            path,
            size,
            backing,
            backing_size,
        } => {
            assert_eq!(
                (path, *size, backing, *backing_size),
                (&top, 2 << 20, &base, 1 << 20)
            );
        }
        e => panic!("expected SizeMismatch, got {e:?}"),
    }
    assert!(err.to_string().contains("top.qcow2"));
}

#[test]
fn read_only_base_opened_for_write() {
    use std::os::unix::fs::PermissionsExt;
    let d = TempDir::new("ro");
    let base = d.join("base.raw");
    make_raw_base(&base, 1 << 20, 6);
    let q = d.join("base.qcow2");
    qemu_img_ok(&["convert", "-O", "qcow2", s(&base), s(&q)]);
    for p in [&base, &q] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o444)).unwrap();
        let err = expect_err(&d.0, p, p.file_name().unwrap().to_str().unwrap());
        assert!(matches!(err, DiskError::ReadOnly { .. }), "{err:?}");
        assert!(err.to_string().contains("create_overlay"), "{err}");
        // Read-only open works, and an overlay on it is the way to write.
        Disk::open(p, false).unwrap();
    }
    let top = d.join("top.qcow2");
    create_overlay(&q, &top).unwrap();
    let before = hash(&q);
    let disk = Disk::open(&top, true).unwrap();
    disk.write_at(&[0xee; 4096], 0).unwrap();
    disk.flush().unwrap();
    drop(disk);
    assert_eq!(hash(&q), before);
    check(&top);
    // Two writers on one layer: the second is refused, the first is unaffected.
    let w1 = Disk::open(&top, true).unwrap();
    assert!(matches!(
        Disk::open(&top, true),
        Err(DiskError::Busy { .. })
    ));
    drop(w1);
    // create_overlay never overwrites.
    let before = hash(&top);
    assert!(matches!(
        create_overlay(&q, &top),
        Err(DiskError::Exists { .. })
    ));
    assert_eq!(hash(&top), before);
}
