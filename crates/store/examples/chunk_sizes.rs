//! Window (chunk) size measurement for docs/design/store.md.
//!
//!   cargo run --release -p tine-store --example chunk_sizes -- DIR [SIZES_KIB...]
//!
//! DIR holds memory images of one guest: `s1` (a first snapshot), `s2`
//! (the same vm later), `c1` and `c2` (two forks of s2, each after a little
//! work of its own), each a file at the RAM's layout (a snapshot
//! directory's `memory`). For each window size a fresh local store takes s1
//! whole, s2 as a diff of s1, c1 and c2 as diffs of s2 — each diff given
//! the exact bitmap of 4 KiB pages that changed, as KVM's dirty log would
//! — and the example prints what was stored, the metadata it took, and
//! put and get throughput of s1 (MB/s of its non-zero windows, medians
//! of 3; get = restore from the local backend, decompress and verify).
//! Without DIR it uses a synthetic image. `THREADS`, `ZSTD_LEVEL`
//! override the store's defaults.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Instant;

use store::*;

const PAGE: usize = 4096;

fn dirty_pages(a: &[u8], b: &[u8]) -> (Vec<u64>, u64) {
    let pages = a.len().min(b.len()) / PAGE;
    let mut bm = vec![0u64; pages.div_ceil(64)];
    let mut n = 0;
    for p in 0..pages {
        if a[p * PAGE..(p + 1) * PAGE] != b[p * PAGE..(p + 1) * PAGE] {
            bm[p / 64] |= 1 << (p % 64);
            n += 1;
        }
    }
    (bm, n)
}

fn mib(n: u64) -> f64 {
    n as f64 / (1 << 20) as f64
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dir = args.first().map(PathBuf::from);
    let sizes: Vec<u64> = if args.len() > 1 {
        args[1..]
            .iter()
            .map(|s| s.parse::<u64>().unwrap() << 10)
            .collect()
    } else {
        vec![
            64 << 10,
            128 << 10,
            256 << 10,
            512 << 10,
            1 << 20,
            2 << 20,
            4 << 20,
        ]
    };
    let load = |name: &str| -> Vec<u8> {
        let d: &Path = dir.as_deref().expect("DIR");
        std::fs::read(d.join(name)).unwrap()
    };
    let (s1, s2, c1, c2) = match &dir {
        Some(_) => (load("s1"), load("s2"), load("c1"), load("c2")),
        None => {
            let s1 = synthetic(512 << 20, 1);
            let mut s2 = s1.clone();
            scribble(&mut s2, 2, 3000);
            let mut c1 = s2.clone();
            scribble(&mut c1, 3, 300);
            let mut c2 = s2.clone();
            scribble(&mut c2, 4, 300);
            (s1, s2, c1, c2)
        }
    };
    let nonzero_pages = s1
        .chunks(PAGE)
        .filter(|p| p.iter().any(|&b| b != 0))
        .count();
    let (bm2, d2) = dirty_pages(&s1, &s2);
    let (bm_c1, dc1) = dirty_pages(&s2, &c1);
    let (bm_c2, dc2) = dirty_pages(&s2, &c2);
    println!(
        "image {} MiB, non-zero pages {} ({:.1} MiB); changed pages: s2 vs s1 {d2}, c1 vs s2 {dc1}, c2 vs s2 {dc2}",
        s1.len() >> 20,
        nonzero_pages,
        mib((nonzero_pages * PAGE) as u64)
    );
    println!(
        "| window | s1 windows | s1 stored MiB | put MB/s | put, no fsync | get MB/s | s2 diff MiB | c1 diff MiB | c2 diff MiB | c1+c2 / changed bytes | metadata KiB | rows |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for ws in sizes {
        let tmp = tempfile::tempdir().unwrap();
        let mut cfg = StoreConfig::local(tmp.path());
        cfg.window_size = ws;
        if let Ok(t) = std::env::var("THREADS") {
            cfg.threads = t.parse().unwrap();
        }
        if let Ok(l) = std::env::var("ZSTD_LEVEL") {
            cfg.zstd_level = l.parse().unwrap();
        }
        // Put s1 three times into fresh stores (median time); keep the last.
        let mut puts = Vec::new();
        let mut kept = None;
        for _ in 0..3 {
            let tmp = tempfile::tempdir().unwrap();
            let mut c = cfg.clone();
            c.dir = tmp.path().into();
            let s = Store::open(c).unwrap();
            let t = Instant::now();
            let mut w = s.begin(None, "{}").unwrap();
            let st = w
                .put_layer(LayerKind::Memory, s1.as_slice(), &Dirty::All, &NoProgress)
                .unwrap();
            w.commit().unwrap();
            puts.push(t.elapsed().as_secs_f64());
            kept = Some((tmp, st));
        }
        drop(kept);
        puts.sort_by(f64::total_cmp);
        let put_s = puts[1];
        // The same without fsync (a cache directory as the backend): what
        // hashing and compressing cost.
        let mut fast = Vec::new();
        for _ in 0..3 {
            let tmp = tempfile::tempdir().unwrap();
            let mut c = cfg.clone();
            c.dir = tmp.path().into();
            c.backend = BackendConfig::Custom {
                backend: std::sync::Arc::new(LocalBackend::cache(&tmp.path().join("c")).unwrap()),
                remote: false,
            };
            let s = Store::open(c).unwrap();
            let t = Instant::now();
            let mut w = s.begin(None, "{}").unwrap();
            w.put_layer(LayerKind::Memory, s1.as_slice(), &Dirty::All, &NoProgress)
                .unwrap();
            w.commit().unwrap();
            fast.push(t.elapsed().as_secs_f64());
        }
        fast.sort_by(f64::total_cmp);
        let fast_s = fast[1];
        let s = Store::open(cfg).unwrap();
        let mut w = s.begin(None, "{}").unwrap();
        let st1 = w
            .put_layer(LayerKind::Memory, s1.as_slice(), &Dirty::All, &NoProgress)
            .unwrap();
        let id1 = w.commit().unwrap();
        let after1 = s.totals().unwrap();
        let diff = |parent: SnapshotId, img: &[u8], bm: &[u64]| {
            let before = s.totals().unwrap().stored_bytes;
            let mut w = s.begin(Some(parent), "{}").unwrap();
            w.put_layer(
                LayerKind::Memory,
                img,
                &Dirty::Pages {
                    bitmap: bm,
                    page_size: PAGE as u64,
                },
                &NoProgress,
            )
            .unwrap();
            let id = w.commit().unwrap();
            (id, s.totals().unwrap().stored_bytes - before)
        };
        let (id2, b2) = diff(id1, &s2, &bm2);
        let (_, bc1) = diff(id2, &c1, &bm_c1);
        let (_, bc2) = diff(id2, &c2, &bm_c2);
        // Get: restore s1 into memory, verified, from the backend (files
        // in the page cache: this is decompress + hash speed).
        let v = s.layer(id1, LayerKind::Memory).unwrap();
        let mut gets: Vec<f64> = (0..3)
            .map(|_| {
                let t = Instant::now();
                v.restore(&FnSink(|_: &[u8], _| Ok(())), true, &NoProgress)
                    .unwrap();
                t.elapsed().as_secs_f64()
            })
            .collect();
        gets.sort_by(f64::total_cmp);
        let get_s = gets[1];
        let meta = s.tree().unwrap().metadata_bytes;
        let refs = s.totals().unwrap().references;
        let changed = ((dc1 + dc2) * PAGE as u64).max(1);
        println!(
            "| {} KiB | {} | {:.1} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} |",
            ws >> 10,
            st1.recorded,
            mib(after1.stored_bytes),
            after1.logical_bytes as f64 / 1e6 / put_s,
            after1.logical_bytes as f64 / 1e6 / fast_s,
            after1.logical_bytes as f64 / 1e6 / get_s,
            mib(b2),
            mib(bc1),
            mib(bc2),
            (bc1 + bc2) as f64 / changed as f64,
            meta >> 10,
            refs
        );
    }
}

fn synthetic(size: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; size];
    let mut x = seed | 1;
    let mut next = || {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    // A third of the pages: text-like, a tenth random, the rest zero.
    for p in v.chunks_mut(PAGE) {
        match next() % 10 {
            0..=2 => {
                for (i, b) in p.iter_mut().enumerate() {
                    *b = b"the kernel page struct "[i % 23];
                }
            }
            3 => {
                for c in p.chunks_mut(8) {
                    c.copy_from_slice(&next().to_le_bytes());
                }
            }
            _ => {}
        }
    }
    v
}

fn scribble(v: &mut [u8], seed: u64, pages: usize) {
    let mut x = seed | 1;
    let n = v.len() / PAGE;
    for _ in 0..pages {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let p = (x.wrapping_mul(0x2545_f491_4f6c_dd1d) % n as u64) as usize;
        v[p * PAGE + (x as usize % PAGE)] ^= 0x5a;
    }
}
