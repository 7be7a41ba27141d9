//! bench/fold: folding a layer directly under an open top into it
//! (`disk::Disk::fold`), the host's way to keep a forked vm's chain short.
//!
//! A raw base of 256 MiB, a frozen layer holding N MiB written in 64 KiB
//! clusters spread over the disk, an empty top over it; fold the layer
//! into the top. Median of --runs (7) per size, on this machine's
//! filesystem (page cache; the fold's two fsyncs included). Also the open
//! chain's fds per layer.
//!
//! Run: `cargo bench -p tine-disk --bench fold [-- --runs N]`. The last
//! line is name=value pairs.

use std::path::{Path, PathBuf};
use std::time::Instant;

use disk::{create_overlay, Disk};

const BASE_MIB: u64 = 256;

fn scratch() -> PathBuf {
    let d = std::env::temp_dir().join(format!("tine-bench-fold-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("scratch");
    d
}

/// base <- mid (with `mib` MiB of data) <- top; returns (top, mid).
fn chain(dir: &Path, mib: u64, run: usize) -> (PathBuf, PathBuf) {
    let base = dir.join("base.raw");
    if !base.exists() {
        let f = std::fs::File::create(&base).expect("base");
        f.set_len(BASE_MIB << 20).expect("size");
    }
    let mid = dir.join(format!("mid-{mib}-{run}.qcow2"));
    let top = dir.join(format!("top-{mib}-{run}.qcow2"));
    create_overlay(&base, &mid).expect("mid");
    let d = Disk::open(&mid, true).expect("open mid");
    let cluster = vec![0x5au8; 64 << 10];
    let clusters = mib * 16;
    let stride = (BASE_MIB * 16 / clusters.max(1)).max(1);
    for c in 0..clusters {
        d.write_at(&cluster, (c * stride) << 16).expect("write");
    }
    d.flush().expect("flush");
    drop(d);
    create_overlay(&mid, &top).expect("top");
    (top, mid)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut runs = 7;
    let a: Vec<String> = std::env::args().collect();
    if let Some(i) = a.iter().position(|x| x == "--runs") {
        runs = a.get(i + 1).and_then(|v| v.parse().ok()).unwrap_or(runs);
    }
    let dir = scratch();
    let mut pairs = Vec::new();
    for mib in [1u64, 16, 64] {
        let mut ms = Vec::new();
        for run in 0..runs {
            let (top, mid) = chain(&dir, mib, run);
            let mut d = Disk::open(&top, true).expect("open");
            let t = Instant::now();
            let done = d.fold(1).expect("fold");
            ms.push(t.elapsed().as_secs_f64() * 1000.0);
            assert_eq!(done.bytes_copied, mib << 20);
            drop(d);
            let _ = std::fs::remove_file(&top);
            let _ = std::fs::remove_file(&mid);
        }
        let m = median(ms);
        println!(
            "fold of {mib:>3} MiB: median {m:.1} ms ({:.0} MiB/s)",
            mib as f64 / (m / 1000.0)
        );
        pairs.push(format!("fold_{mib}mib_ms={m:.2}"));
    }
    // fds per layer of an open chain of 10.
    let base = dir.join("base.raw");
    let mut below = base;
    for i in 0..9 {
        let p = dir.join(format!("l{i}.qcow2"));
        create_overlay(&below, &p).expect("overlay");
        below = p;
    }
    let fds = || {
        std::fs::read_dir("/proc/self/fd")
            .map(|d| d.count())
            .unwrap_or(0)
    };
    let before = fds();
    let d = Disk::open(&below, true).expect("open");
    let per_layer = (fds() - before) as f64 / d.depth() as f64;
    drop(d);
    println!("fds per open layer: {per_layer}");
    pairs.push(format!("fds_per_layer={per_layer}"));
    let _ = std::fs::remove_dir_all(&dir);
    println!("{}", pairs.join(" "));
}
