//! The fleet's gc proof: three hosts (three `Store`s, each with its own
//! directory and chunk cache) share ONE PostgreSQL tree and ONE bucket (a
//! local directory behind the cache, as S3 would be). For a bounded time
//! every host writes snapshots (full and diff layers of partly shared
//! content, so chunks dedupe across hosts), aborts some, creates and
//! drops branches, prunes and runs gc, all at once. At the end every
//! committed snapshot restores byte-exact from a fresh store with no
//! cache, and verify finds no missing or corrupt chunk.
//!
//! `TINE_FLEET_SECS` changes the duration (default 16; ~30 s in all).
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use store::*;

const HOSTS: usize = 3;
const WRITERS: usize = 2;
const WINDOW: u64 = 64 << 10;
const WINDOWS: usize = 24;
/// Window contents 1..=POOL are shared by every host; 0 is a zero window.
const POOL: u64 = 40;
/// Contents from CHURN on come and go, CHURN_N at a time (see the writer).
const CHURN: u64 = 500;
const CHURN_N: u64 = 4;

/// A snapshot's content: the seed of each window.
type Recipe = Vec<u64>;

fn window_bytes(seed: u64) -> Vec<u8> {
    let mut w = vec![0u8; WINDOW as usize];
    if seed != 0 {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1).fill(&mut w);
    }
    w
}

fn image(r: &Recipe) -> Vec<u8> {
    r.iter().flat_map(|&s| window_bytes(s)).collect()
}

/// What the threads share: what each committed snapshot holds, a counter
/// for new content, and counts.
#[derive(Default)]
struct Stats {
    recipes: Mutex<HashMap<SnapshotId, Recipe>>,
    unique: AtomicU64,
    committed: AtomicU64,
    aborted: AtomicU64,
    diffs: AtomicU64,
    branches_dropped: AtomicU64,
    reads: AtomicU64,
    gc_runs: AtomicU64,
    chunks_deleted: AtomicU64,
    pruned: AtomicU64,
    reaped: AtomicU64,
}

/// The shared bucket: a local directory with an object store's latency
/// (a few ms per request, deletes the slowest), so a gc's deletes and a
/// writer's puts overlap as they would on S3.
#[derive(Debug)]
struct Bucket(LocalBackend);

fn lag(id: &ChunkId, base: u64, spread: u64) {
    std::thread::sleep(Duration::from_millis(base + u64::from(id.0[0]) % spread));
}

impl Backend for Bucket {
    fn describe(&self) -> String {
        format!("bucket {}", self.0.describe())
    }
    fn put(&self, id: &ChunkId, data: &[u8]) -> Result<(), BackendError> {
        lag(id, 2, 6);
        self.0.put(id, data)
    }
    fn get(&self, id: &ChunkId) -> Result<Option<Vec<u8>>, BackendError> {
        lag(id, 1, 2);
        self.0.get(id)
    }
    fn exists(&self, id: &ChunkId) -> Result<bool, BackendError> {
        self.0.exists(id)
    }
    fn delete(&self, id: &ChunkId) -> Result<(), BackendError> {
        lag(id, 5, 20);
        self.0.delete(id)
    }
    fn list(&self) -> Result<Vec<ChunkId>, BackendError> {
        std::thread::sleep(Duration::from_millis(10));
        self.0.list()
    }
    fn clean_leftovers(&self, older_than: Duration) -> Result<u64, BackendError> {
        self.0.clean_leftovers(older_than)
    }
}

fn host_config(dir: &std::path::Path, bucket: &Arc<Bucket>, url: &str) -> StoreConfig {
    let mut cfg = StoreConfig::local(dir);
    cfg.backend = BackendConfig::Custom {
        backend: bucket.clone(),
        remote: true,
    };
    cfg.meta = MetaConfig::Postgres(url.to_owned());
    cfg.window_size = WINDOW;
    cfg.threads = 2;
    cfg
}

/// One writer thread of one host.
fn writer(s: &Store, cold: &Store, tag: &str, seed: u64, deadline: Instant, stats: &Stats) {
    let (recipes, unique) = (&stats.recipes, &stats.unique);
    let mut rng = Rng(seed);
    // Snapshots this thread keeps alive with a sleeping branch (only this
    // thread drops them, so they are safe parents and safe to read).
    let mut mine: Vec<(SnapshotId, BranchId, Recipe)> = Vec::new();
    let mut n = 0u64;
    let started = Instant::now();
    while Instant::now() < deadline {
        n += 1;
        let parent = if !mine.is_empty() && rng.below(10) < 6 {
            Some(mine[rng.below(mine.len() as u64) as usize].clone())
        } else {
            None
        };
        let mut recipe: Recipe = match &parent {
            Some((_, _, r)) => r.clone(),
            None => (0..WINDOWS)
                .map(|_| match rng.below(8) {
                    0 => 0,
                    _ => 1 + rng.below(POOL),
                })
                .collect(),
        };
        let mut dirty: Vec<u64> = Vec::new();
        for _ in 0..1 + rng.below(4) {
            let w = rng.below(WINDOWS as u64);
            // Mostly shared content (other hosts have or had it, and gc
            // may be deleting it right now), sometimes new (garbage later).
            recipe[w as usize] = match rng.below(8) {
                0 => 1_000_000 + unique.fetch_add(1, Ordering::Relaxed),
                1 => 0,
                // Churn: a few contents that aborted and pruned snapshots
                // keep dropping and other writers keep wanting again, so
                // gc is often deleting a chunk some pin needs right then.
                // The set changes every 250 ms, so a set's chunks soon
                // belong only to aborted or pruned snapshots.
                2..=4 => {
                    CHURN
                        + ((started.elapsed().as_millis() as u64) / 250) * CHURN_N
                        + rng.below(CHURN_N)
                }
                _ => 1 + rng.below(POOL),
            };
            dirty.push(w);
        }
        dirty.sort_unstable();
        dirty.dedup();
        let img = image(&recipe);
        let mut w = s.begin(parent.as_ref().map(|p| p.0), "{}").unwrap();
        let how = match parent {
            Some(_) => Dirty::Windows(&dirty),
            None => Dirty::All,
        };
        w.put_layer(LayerKind::Memory, img.as_slice(), &how, &NoProgress)
            .unwrap();
        if rng.below(3) == 0 {
            // A working set: a pack of its chunks goes to the bucket too.
            w.set_working_set((0..WINDOWS as u64).map(|i| i * WINDOW / 4096).collect());
        }
        if rng.below(3) == 0 {
            w.abort().unwrap();
            stats.aborted.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        let id = if rng.below(2) == 0 {
            let (id, b) = w
                .commit_branch(BranchChange::Create {
                    name: format!("{tag}-{n}"),
                    state: BranchState::Sleeping,
                })
                .unwrap();
            mine.push((id, b, recipe.clone()));
            id
        } else {
            // No branch: a later prune may take it (and its chunks).
            w.commit().unwrap()
        };
        recipes.lock().unwrap().insert(id, recipe);
        stats.committed.fetch_add(1, Ordering::Relaxed);
        if parent.is_some() {
            stats.diffs.fetch_add(1, Ordering::Relaxed);
        }
        if mine.len() > 6 || (mine.len() > 1 && rng.below(4) == 0) {
            // Before its branch goes (and a prune may take it), the
            // snapshot reads back from the bucket itself, not this host's
            // cache (which a writer fills as it puts): a chunk a gc
            // deleted under it shows here, while the others keep going.
            let (id, b, r) = mine.swap_remove(rng.below(mine.len() as u64) as usize);
            assert_layer(&cold.layer(id, LayerKind::Memory).unwrap(), &image(&r));
            stats.reads.fetch_add(1, Ordering::Relaxed);
            s.set_branch(b, None, BranchState::Gone).unwrap();
            stats.branches_dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn gc_loop(s: &Store, seed: u64, stop: &AtomicBool, stats: &Stats) {
    let mut rng = Rng(seed);
    while !stop.load(Ordering::Relaxed) {
        let r = s
            .gc(
                &GcOptions {
                    prune_snapshots: rng.below(2) == 0,
                    ..GcOptions::default()
                },
                &NoProgress,
            )
            .unwrap();
        stats.gc_runs.fetch_add(1, Ordering::Relaxed);
        stats
            .chunks_deleted
            .fetch_add(r.chunks_deleted, Ordering::Relaxed);
        stats
            .pruned
            .fetch_add(r.snapshots_pruned.len() as u64, Ordering::Relaxed);
        stats
            .reaped
            .fetch_add(r.pending_reaped.len() as u64, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(rng.below(30)));
    }
}

/// A store with no cache in front of the bucket.
fn cold_config(dir: &std::path::Path, bucket: &Arc<Bucket>, url: &str) -> StoreConfig {
    let mut cfg = host_config(dir, bucket, url);
    cfg.backend = BackendConfig::Custom {
        backend: bucket.clone(),
        remote: false,
    };
    cfg
}

#[test]
fn fleet_gc_never_deletes_a_referenced_chunk() {
    let secs: u64 = std::env::var("TINE_FLEET_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    let d = temp_dir("fleet");
    let bucket = Arc::new(Bucket(LocalBackend::new(&d.path().join("bucket")).unwrap()));
    let url = pg::database("fleet");
    let hosts: Vec<Store> = (0..HOSTS)
        .map(|h| {
            Store::open(host_config(
                &d.path().join(format!("host{h}")),
                &bucket,
                &url,
            ))
            .unwrap()
        })
        .collect();
    // Each host's view of the bucket without its cache, for checks.
    let cold: Vec<Store> = (0..HOSTS)
        .map(|h| {
            Store::open(cold_config(
                &d.path().join(format!("cold{h}")),
                &bucket,
                &url,
            ))
            .unwrap()
        })
        .collect();
    let stats = Stats::default();
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    std::thread::scope(|sc| {
        let mut writers = Vec::new();
        for (h, s) in hosts.iter().enumerate() {
            for t in 0..WRITERS {
                let stats = &stats;
                let cold = &cold[h];
                writers.push(sc.spawn(move || {
                    writer(
                        s,
                        cold,
                        &format!("h{h}w{t}"),
                        1 + (h * WRITERS + t) as u64,
                        deadline,
                        stats,
                    )
                }));
            }
            let (stop, stats) = (&stop, &stats);
            sc.spawn(move || gc_loop(s, 100 + h as u64, stop, stats));
        }
        // Stop the gc loops even when a writer failed, then fail.
        let results: Vec<_> = writers.into_iter().map(|w| w.join()).collect();
        stop.store(true, Ordering::Relaxed);
        for r in results {
            if let Err(e) = r {
                std::panic::resume_unwind(e);
            }
        }
    });
    let ran = started.elapsed();

    // A fresh host with no cache: every byte from the bucket.
    let fresh = Store::open(cold_config(&d.path().join("fresh"), &bucket, &url)).unwrap();
    let r = fresh.verify(&NoProgress).unwrap();
    assert!(
        r.missing.is_empty() && r.corrupt.is_empty() && r.is_ok(),
        "{r}"
    );
    let recipes = std::mem::take(&mut *stats.recipes.lock().unwrap());
    let snaps = fresh.snapshots().unwrap();
    for x in &snaps {
        let want = recipes
            .get(&x.id)
            .unwrap_or_else(|| panic!("snapshot {} was never committed by a writer", x.id));
        assert_layer(&fresh.layer(x.id, LayerKind::Memory).unwrap(), &image(want));
    }
    // Once more after a last gc that prunes: what branches keep still
    // reads back, and nothing is left over.
    let g = fresh
        .gc(
            &GcOptions {
                prune_snapshots: true,
                ..GcOptions::default()
            },
            &NoProgress,
        )
        .unwrap();
    let r2 = fresh.verify(&NoProgress).unwrap();
    assert!(r2.is_ok() && r2.pending == 0 && r2.orphans == 0, "{r2}");
    let left = fresh.snapshots().unwrap();
    for x in &left {
        assert_layer(
            &fresh.layer(x.id, LayerKind::Memory).unwrap(),
            &image(&recipes[&x.id]),
        );
    }
    let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
    println!(
        "fleet: {HOSTS} hosts x {WRITERS} writers + 1 gc each for {:.1} s: {} committed ({} diffs), {} aborted, \
         {} branches dropped (each read back from the bucket first: {}); gc ran {} times, deleted {} chunks, pruned {} snapshots, reaped {}; \
         at the end {} snapshots restored from the bucket ({}), after a last gc {} ({} deleted, {} pruned)",
        ran.as_secs_f64(),
        c(&stats.committed),
        c(&stats.diffs),
        c(&stats.aborted),
        c(&stats.branches_dropped),
        c(&stats.reads),
        c(&stats.gc_runs),
        c(&stats.chunks_deleted),
        c(&stats.pruned),
        c(&stats.reaped),
        snaps.len(),
        r.to_string().trim(),
        left.len(),
        g.chunks_deleted,
        g.snapshots_pruned.len(),
    );
    assert!(c(&stats.committed) > 30 && c(&stats.chunks_deleted) > 0 && c(&stats.pruned) > 0);
}
