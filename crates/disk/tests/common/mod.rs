// Shared helpers for the qemu-img oracle tests.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "tine-disk-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn join(&self, s: &str) -> PathBuf {
        self.0.join(s)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // Frozen layers are chmod a-w; root can still remove them.
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn qemu_img(args: &[&str]) -> (i32, String) {
    let out = Command::new("qemu-img")
        .args(args)
        .output()
        .expect("qemu-img runs");
    let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
    s.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), s)
}

pub fn qemu_img_ok(args: &[&str]) -> String {
    let (rc, s) = qemu_img(args);
    assert_eq!(rc, 0, "qemu-img {args:?} failed: {s}");
    s
}

/// `qemu-img check` must report no errors and no leaks.
pub fn check(p: &Path) {
    let (rc, s) = qemu_img(&["check", "-f", "qcow2", p.to_str().unwrap()]);
    assert_eq!(rc, 0, "qemu-img check {}: rc {rc}: {s}", p.display());
    assert!(s.contains("No errors were found"), "{}: {s}", p.display());
}

/// Flatten the chain under `top` with `qemu-img convert` and compare the two.
pub fn compare_flattened(top: &Path, dir: &Path) {
    let flat = dir.join(format!(
        "{}.flat.raw",
        top.file_name().unwrap().to_string_lossy()
    ));
    qemu_img_ok(&[
        "convert",
        "-O",
        "raw",
        top.to_str().unwrap(),
        flat.to_str().unwrap(),
    ]);
    let s = qemu_img_ok(&["compare", top.to_str().unwrap(), flat.to_str().unwrap()]);
    assert!(s.contains("Images are identical"), "{s}");
    std::fs::remove_file(flat).unwrap();
}

/// Read the guest-visible contents of any image through qemu-img convert.
pub fn qemu_contents(img: &Path, dir: &Path) -> Vec<u8> {
    let flat = dir.join("contents.raw");
    let _ = std::fs::remove_file(&flat);
    qemu_img_ok(&[
        "convert",
        "-O",
        "raw",
        img.to_str().unwrap(),
        flat.to_str().unwrap(),
    ]);
    let v = std::fs::read(&flat).unwrap();
    std::fs::remove_file(flat).unwrap();
    v
}

pub fn hash(p: &Path) -> blake3::Hash {
    blake3::hash(&std::fs::read(p).unwrap())
}

/// A raw base of `size` bytes filled with a deterministic pattern.
pub fn make_raw_base(p: &Path, size: usize, seed: u8) -> Vec<u8> {
    let mut v = vec![0u8; size];
    let mut x: u32 = 0x9e37_79b9 ^ u32::from(seed);
    for chunk in v.chunks_mut(4) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let b = x.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
    std::fs::write(p, &v).unwrap();
    v
}

pub fn pattern(len: usize, tag: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31) ^ tag).collect()
}

/// Small deterministic RNG (xorshift64*).
pub struct Rng(pub u64);
impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}
