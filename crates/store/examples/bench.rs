//! The store crate alone, for bench/store-chunks (run it through `bench/store-chunks`).
//!
//!   cargo run --release -p tine-store --example bench -- [--quick] [--s3 ENDPOINT]
//!
//! On a synthetic, guest-memory-like 1 GiB image (tests/common/synth.rs):
//! - put and get of a 1 GiB memory layer on the local backend (durable:
//!   fsync per chunk), get = restore verified into a null sink;
//! - with `--s3 ENDPOINT` (an S3 server with a bucket `tine`, keys from
//!   any value): put to S3, get cold (cache cleared: every chunk from the
//!   bucket) and warm (every chunk from the local cache);
//! - ten siblings of the 1 GiB parent, each dirtying its own 8 MiB: the
//!   stored bytes against the parent's stored bytes + 10 × 8 MiB.
//!
//! Medians of 3 runs (1 with --quick). Last line: name=value pairs.
#![allow(clippy::unwrap_used)]

#[path = "../tests/common/synth.rs"]
#[allow(dead_code)]
mod synth;

use std::time::Instant;

use store::*;
use synth::*;

const MIB: u64 = 1 << 20;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn null() -> FnSink<impl Fn(&[u8], u64) -> std::io::Result<()> + Sync> {
    FnSink(|_: &[u8], _| Ok(()))
}

/// Puts `img` as a first snapshot into a fresh store; returns ms, the
/// store and the snapshot.
fn put(cfg: &StoreConfig, img: &[u8]) -> (f64, Store, SnapshotId) {
    let s = Store::open(cfg.clone()).unwrap();
    let t = Instant::now();
    let mut w = s.begin(None, r#"{"name":"bench"}"#).unwrap();
    w.put_layer(LayerKind::Memory, img, &Dirty::All, &NoProgress)
        .unwrap();
    let id = w.commit().unwrap();
    (t.elapsed().as_secs_f64() * 1e3, s, id)
}

fn get(s: &Store, id: SnapshotId) -> f64 {
    let v = s.layer(id, LayerKind::Memory).unwrap();
    let t = Instant::now();
    v.restore(&null(), true, &NoProgress).unwrap();
    t.elapsed().as_secs_f64() * 1e3
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let s3 = args
        .iter()
        .position(|a| a == "--s3")
        .and_then(|i| args.get(i + 1).cloned());
    let runs = if quick { 1 } else { 3 };
    let size = 1usize << 30;
    let img = synthetic_memory(size, 42);
    let nonzero = img
        .chunks(PAGE)
        .filter(|p| p.iter().any(|&b| b != 0))
        .count() as u64
        * PAGE as u64;
    println!(
        "image: {} MiB synthetic guest memory, {} MiB in non-zero pages; window {} KiB, zstd {}",
        size >> 20,
        nonzero >> 20,
        DEFAULT_WINDOW_SIZE >> 10,
        DEFAULT_ZSTD_LEVEL
    );
    let mut kv: Vec<(String, String)> = Vec::new();

    // Local backend.
    let (mut puts, mut gets) = (Vec::new(), Vec::new());
    let mut stored = 0;
    for _ in 0..runs {
        let tmp = tempfile::tempdir().unwrap();
        let (ms, s, id) = put(&StoreConfig::local(tmp.path()), &img);
        puts.push(ms);
        gets.push(get(&s, id));
        stored = s.totals().unwrap().stored_bytes;
    }
    let (p, g) = (median(puts), median(gets));
    println!(
        "local: put {p:.0} ms ({:.0} MB/s of image), get {g:.0} ms ({:.0} MB/s); stored {} MiB",
        size as f64 / 1e3 / p,
        size as f64 / 1e3 / g,
        stored >> 20
    );
    kv.push(("put_ms".into(), format!("{p:.0}")));
    kv.push(("get_ms".into(), format!("{g:.0}")));

    // S3 backend with the local cache in front.
    if let Some(endpoint) = &s3 {
        let (mut puts, mut colds, mut warms) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..runs {
            let tmp = tempfile::tempdir().unwrap();
            let mut cfg = StoreConfig::local(tmp.path());
            cfg.backend = BackendConfig::S3(S3Config {
                bucket: "tine".into(),
                prefix: format!("bench-{}-{r}", std::process::id()),
                endpoint: Some(endpoint.clone()),
                region: Some("us-east-1".into()),
                access_key_id: Some("bench".into()),
                secret_access_key: Some("bench".into()),
                allow_http: true,
            });
            let (ms, s, id) = put(&cfg, &img);
            puts.push(ms);
            drop(s);
            std::fs::remove_dir_all(tmp.path().join("cache")).unwrap();
            let s = Store::open(cfg.clone()).unwrap();
            colds.push(get(&s, id));
            let c = s.counters();
            assert_eq!(c.cache_hits, 0);
            warms.push(get(&s, id));
            assert_eq!(s.counters().backend_reads, c.backend_reads);
            // Each run writes under its own prefix (cold means cold).
            drop(s);
            drop(tmp);
        }
        let (p, c, w) = (median(puts), median(colds), median(warms));
        println!(
            "s3 ({endpoint}): put {p:.0} ms ({:.0} MB/s), get cold {c:.0} ms ({:.0} MB/s), warm {w:.0} ms ({:.0} MB/s); cold/warm {:.2}",
            size as f64 / 1e3 / p,
            size as f64 / 1e3 / c,
            size as f64 / 1e3 / w,
            c / w
        );
        kv.push(("s3_put_ms".into(), format!("{p:.0}")));
        kv.push(("s3_cold_get_ms".into(), format!("{c:.0}")));
        kv.push(("s3_warm_get_ms".into(), format!("{w:.0}")));
        kv.push(("s3_cold_vs_warm".into(), format!("{:.2}", c / w)));
    }

    // Ten siblings.
    let tmp = tempfile::tempdir().unwrap();
    let (_, s, parent) = put(&StoreConfig::local(tmp.path()), &img);
    let after_parent = s.totals().unwrap();
    let dirty = 8 * MIB;
    let ws = DEFAULT_WINDOW_SIZE;
    let t = Instant::now();
    for k in 0..10u64 {
        let at = (k * 3 + 1) * dirty;
        let mut patch = img[at as usize..(at + dirty) as usize].to_vec();
        let mut rng = Rng(1000 + k);
        for pg in patch.chunks_mut(PAGE) {
            let kind = 1 + rng.below(3);
            fill_page(&mut rng, kind, pg);
        }
        let kid = Overlay {
            base: &img,
            at,
            patch: &patch,
        };
        let windows: Vec<u64> = (at / ws..(at + dirty) / ws).collect();
        let mut w = s.begin(Some(parent), "{}").unwrap();
        w.put_layer(
            LayerKind::Memory,
            &kid,
            &Dirty::Windows(&windows),
            &NoProgress,
        )
        .unwrap();
        w.commit().unwrap();
    }
    let sib_ms = t.elapsed().as_secs_f64() * 1e3 / 10.0;
    let all = s.totals().unwrap();
    let meta = s.tree().unwrap().metadata_bytes;
    let bound = after_parent.stored_bytes + 10 * dirty;
    let ratio = all.stored_bytes as f64 / bound as f64;
    let vs_logical = all.stored_bytes as f64 / (size as u64 + 10 * dirty) as f64;
    println!(
        "ten siblings: stored {:.1} MiB (parent {:.1} MiB + 10 x 8 MiB = {:.1} MiB bound): ratio {ratio:.3}; \
         vs logical 1 GiB + 80 MiB: {vs_logical:.3}; metadata {:.2} MiB; {sib_ms:.0} ms per sibling",
        all.stored_bytes as f64 / MIB as f64,
        after_parent.stored_bytes as f64 / MIB as f64,
        bound as f64 / MIB as f64,
        meta as f64 / MIB as f64
    );
    kv.push(("dedup_ratio".into(), format!("{ratio:.3}")));
    kv.push(("stored_vs_logical".into(), format!("{vs_logical:.3}")));
    kv.push(("sibling_put_ms".into(), format!("{sib_ms:.0}")));
    println!(
        "{}",
        kv.iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
}

/// The parent image with one region replaced.
struct Overlay<'a> {
    base: &'a [u8],
    at: u64,
    patch: &'a [u8],
}

impl Source for Overlay<'_> {
    fn len(&self) -> u64 {
        self.base.len() as u64
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        Source::read_at(self.base, buf, offset)?;
        let (s, e) = (offset, offset + buf.len() as u64);
        let (ps, pe) = (self.at, self.at + self.patch.len() as u64);
        if ps < e && pe > s {
            let (a, b) = (ps.max(s), pe.min(e));
            buf[(a - s) as usize..(b - s) as usize]
                .copy_from_slice(&self.patch[(a - ps) as usize..(b - ps) as usize]);
        }
        Ok(())
    }
}
