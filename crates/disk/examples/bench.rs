//! Single-thread 4 KiB random I/O on a qcow2 overlay over a raw base, through this crate
//! (imago underneath), next to `qemu-img bench` on the same kind of chain and to plain
//! pwrite/pread on the raw file; plus overlay creation, ours vs imago's creator.
//!
//! `CARGO_TARGET_DIR=/work/target-disk cargo run --release -p tine-disk --example bench [dir]`
//! Prints numbers, asserts nothing about time.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use disk::{create_overlay, Disk};
use imago::file::File as ImagoFile;
use imago::qcow2::Qcow2;
use imago::{FormatCreateBuilder, Storage, StorageCreateOptions};

const SIZE: u64 = 1 << 30;
const OPS: u64 = 20_000;
const BS: u64 = 4096;

struct Rng(u64);
impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn block(&mut self) -> u64 {
        (self.next_u64() % (SIZE / BS)) * BS
    }
}

fn median_ms(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn qemu_bench(img: &Path, write: bool) -> f64 {
    // qemu-img bench walks offsets by a fixed step (wrapping at the end); a large odd step
    // scatters the requests over the whole disk like random I/O.
    let step = (BS * 7919).to_string();
    let mut args = vec![
        "bench",
        "-f",
        "qcow2",
        "-t",
        "writeback",
        "-i",
        "threads",
        "-d",
        "1",
    ];
    if write {
        args.push("-w");
    }
    let (c, s) = (OPS.to_string(), BS.to_string());
    args.extend(["-c", &c, "-s", &s, "-S", &step, img.to_str().unwrap()]);
    let out = Command::new("qemu-img").args(&args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    // "Run completed in 1.234 seconds."
    let secs: f64 = text
        .split("completed in ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|t| t.parse().ok())
        .unwrap_or(f64::NAN);
    OPS as f64 / secs
}

fn main() {
    let dir = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "/tmp/tine-disk-bench".into()),
    );
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let base = dir.join("base.raw");
    {
        // A base with data in every 64 KiB cluster so reads from it are real reads.
        let f = std::fs::File::create(&base).unwrap();
        f.set_len(SIZE).unwrap();
        let chunk = vec![0x5au8; 1 << 20];
        let mut off = 0;
        while off < SIZE {
            f.write_all_at(&chunk, off).unwrap();
            off += chunk.len() as u64;
        }
        f.sync_all().unwrap();
    }
    let buf = vec![0xa5u8; BS as usize];
    let mut rbuf = vec![0u8; BS as usize];

    // Raw baseline: pwrite/pread on a copy of the base.
    let rawcopy = dir.join("raw.raw");
    std::fs::copy(&base, &rawcopy).unwrap();
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&rawcopy)
        .unwrap();
    let mut rng = Rng(1);
    let t = Instant::now();
    for _ in 0..OPS {
        f.write_all_at(&buf, rng.block()).unwrap();
    }
    let raw_w = OPS as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..OPS {
        f.read_exact_at(&mut rbuf, rng.block()).unwrap();
    }
    let raw_r = OPS as f64 / t.elapsed().as_secs_f64();
    drop(f);
    std::fs::remove_file(&rawcopy).unwrap();

    // Ours: qcow2 overlay over the raw base.
    let top = dir.join("top.qcow2");
    create_overlay(&base, &top).unwrap();
    let disk = Disk::open(&top, true).unwrap();
    let mut rng = Rng(2);
    let t = Instant::now();
    for _ in 0..OPS {
        disk.write_at(&buf, rng.block()).unwrap();
    }
    let our_w = OPS as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    disk.flush().unwrap();
    let flush_ms = t.elapsed().as_secs_f64() * 1e3;
    // Rewrites of allocated clusters (no allocation).
    let mut rng = Rng(2);
    let t = Instant::now();
    for _ in 0..OPS {
        disk.write_at(&buf, rng.block()).unwrap();
    }
    let our_rw = OPS as f64 / t.elapsed().as_secs_f64();
    let mut rng = Rng(3);
    let t = Instant::now();
    for _ in 0..OPS {
        disk.read_at(&mut rbuf, rng.block()).unwrap();
    }
    let our_r = OPS as f64 / t.elapsed().as_secs_f64();
    disk.flush().unwrap();
    drop(disk);

    // Depth 10: reads fall through 10 empty-ish qcow2 layers to the base.
    let mut below = top.clone();
    for i in 0..9 {
        let o = dir.join(format!("d{i}.qcow2"));
        create_overlay(&below, &o).unwrap();
        below = o;
    }
    let deep = Disk::open(&below, true).unwrap();
    assert_eq!(deep.chain().len(), 11);
    let mut rng = Rng(4);
    let t = Instant::now();
    for _ in 0..OPS {
        deep.read_at(&mut rbuf, rng.block()).unwrap();
    }
    let deep_r = OPS as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    for _ in 0..OPS {
        deep.write_at(&buf, rng.block()).unwrap();
    }
    let deep_w = OPS as f64 / t.elapsed().as_secs_f64();
    drop(deep);

    // QEMU's qcow2 driver on the same kind of chain (fresh overlay on the same base).
    let qtop = dir.join("qtop.qcow2");
    create_overlay(&base, &qtop).unwrap();
    let q_w = qemu_bench(&qtop, true);
    let q_r = qemu_bench(&qtop, false);

    // Overlay creation: ours vs imago's creator vs `qemu-img create` (a process each).
    let mut ours = Vec::new();
    for i in 0..100 {
        let o = dir.join(format!("c{i}.qcow2"));
        let t = Instant::now();
        create_overlay(&base, &o).unwrap();
        ours.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let mut imago_ms = Vec::new();
    let bname = base.to_str().unwrap().to_string();
    for i in 0..100 {
        let o = dir.join(format!("i{i}.qcow2"));
        let t = Instant::now();
        let file = ImagoFile::create_open(StorageCreateOptions::new().filename(&o)).unwrap();
        Qcow2::<ImagoFile>::create_builder(file)
            .size(SIZE)
            .backing(bname.clone(), "raw".into())
            .create()
            .unwrap();
        imago_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let mut qemu_ms = Vec::new();
    for i in 0..20 {
        let o = dir.join(format!("q{i}.qcow2"));
        let t = Instant::now();
        let st = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-b", &bname, "-F", "raw"])
            .arg(&o)
            .status()
            .unwrap();
        assert!(st.success());
        qemu_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let st = Command::new("qemu-img")
        .args(["check", "-q"])
        .arg(dir.join("i0.qcow2"))
        .status()
        .unwrap();

    println!("4 KiB random I/O, single thread, 1 GiB disk, {OPS} ops each (writeback page cache, no fsync per op)");
    println!(
        "raw file pwrite/pread:             write {raw_w:>9.0} ops/s  read {raw_r:>9.0} ops/s"
    );
    println!("tine-disk qcow2 over raw (alloc):  write {our_w:>9.0} ops/s  (flush after: {flush_ms:.1} ms)");
    println!(
        "tine-disk qcow2 over raw (rewrite):write {our_rw:>9.0} ops/s  read {our_r:>9.0} ops/s"
    );
    println!(
        "tine-disk depth 10:                write {deep_w:>9.0} ops/s  read {deep_r:>9.0} ops/s"
    );
    println!("qemu-img bench qcow2 over raw:     write {q_w:>9.0} ops/s  read {q_r:>9.0} ops/s");
    println!(
        "overlay create median ms: ours {:.3}  imago create_builder {:.3} (qemu-img check ok: {})  qemu-img create (process) {:.1}",
        median_ms(ours.clone()),
        median_ms(imago_ms),
        st.success(),
        median_ms(qemu_ms)
    );
    println!(
        "overlay_create_ms={:.3} iops_4k_randwrite_depth1={our_w:.0} qemu_iops_4k_randwrite={q_w:.0} iops_ratio_vs_qemu={:.2}",
        median_ms(ours),
        our_w / q_w
    );
    let _ = std::fs::remove_dir_all(&dir);
}
