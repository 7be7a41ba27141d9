//! The store over the local-directory backend (and over a second local
//! directory playing a remote backend, for the cache).
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use common::*;
use store::*;

fn opener(tag: &str, db: Db) -> (tempfile::TempDir, LocalOpener) {
    let d = temp_dir(tag);
    let o = LocalOpener {
        dir: d.path().join("store"),
        meta: db.meta(tag),
    };
    (d, o)
}

/// Each scenario runs against both metadata databases, as `NAME::sqlite`
/// and `NAME::pg` (a fresh database in this binary's PostgreSQL 15).
macro_rules! both {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[test]
            fn sqlite() {
                super::$name(super::Db::Sqlite)
            }
            #[test]
            fn pg() {
                super::$name(super::Db::Pg)
            }
        }
    )*};
}

both!(
    layer_chain_round_trip,
    ten_siblings_of_a_1gib_parent_share_it,
    corrupt_chunk_is_detected_and_named,
    swapped_chunk_is_detected,
    gc_keeps_referenced_chunks_and_removes_the_rest,
    gc_racing_writers_never_breaks_a_snapshot,
    kill_9_and_faults_leave_a_consistent_store,
    working_set_pack_local,
    working_set_pack_fills_the_cache,
    remote_backend_reads_through_a_verified_cache,
    branches_tree_and_sizes,
    progress_is_reported,
    bad_configuration_and_input_are_refused,
    leases_of_other_hosts_hold_until_they_expire,
);

fn layer_chain_round_trip(db: Db) {
    let (_d, o) = opener("chain", db);
    common::layer_chain_round_trip(&o);
}

fn ten_siblings_of_a_1gib_parent_share_it(db: Db) {
    let (_d, o) = opener("siblings", db);
    let ratio = common::ten_siblings(&o, 1 << 30);
    println!("dedup ratio (stored / logical of parent + 10 x 8 MiB): {ratio:.3}");
}

fn corrupt_chunk_is_detected_and_named(db: Db) {
    let (_d, o) = opener("corrupt", db);
    let dir = o.dir.clone();
    common::corrupt_chunk_detected(&o, &|_, id| {
        let b = LocalBackend::new(&dir.join("chunks")).unwrap();
        let p = b.path_of(id);
        let mut bytes = std::fs::read(&p).unwrap();
        let n = bytes.len();
        bytes[n / 2] ^= 0x40;
        std::fs::write(&p, bytes).unwrap();
    });
}

fn swapped_chunk_is_detected(db: Db) {
    // Another chunk's valid bytes under this id: decompresses fine, the
    // hash check catches it.
    let (_d, o) = opener("swapped", db);
    let dir = o.dir.clone();
    common::corrupt_chunk_detected(&o, &|_, id| {
        let b = LocalBackend::new(&dir.join("chunks")).unwrap();
        std::fs::write(b.path_of(id), chunk::encode(&[1u8; 4096], 1).unwrap()).unwrap();
    });
}

fn gc_keeps_referenced_chunks_and_removes_the_rest(db: Db) {
    let (_d, o) = opener("gc", db);
    common::gc_keeps_referenced(&o);
}

fn gc_racing_writers_never_breaks_a_snapshot(db: Db) {
    let (_d, o) = opener("gcrace", db);
    common::gc_races_writers(&o);
}

#[test]
fn crash_child_local() {
    // Runs only as the child of `kill_9_and_faults_leave_a_consistent_store`.
    if is_child() {
        let o = LocalOpener {
            dir: std::env::var("TINE_STORE_TEST_DIR").unwrap().into(),
            meta: MetaConfig::parse(&std::env::var(META_ENV).unwrap()).unwrap(),
        };
        common::crash_child(&o);
    }
}

fn kill_9_and_faults_leave_a_consistent_store(db: Db) {
    let (_d, o) = opener("crash", db);
    common::crash_at_every_point(&o, "crash_child_local");
}

fn working_set_pack_local(db: Db) {
    let (_d, o) = opener("pack", db);
    common::pack_scenario(&o, &common::flip_pack_byte);
}

/// A local directory as a remote backend (so there is a cache to fill).
struct CachedLocalOpener {
    dir: std::path::PathBuf,
    remote: Arc<LocalBackend>,
    meta: MetaConfig,
}

impl common::Opener for CachedLocalOpener {
    fn open(&self) -> Store {
        let mut cfg = StoreConfig::local(&self.dir);
        cfg.meta = self.meta.clone();
        cfg.backend = BackendConfig::Custom {
            backend: self.remote.clone(),
            remote: true,
        };
        Store::open(cfg).unwrap()
    }
    fn child_env(&self) -> Vec<(String, String)> {
        Vec::new()
    }
    fn name(&self) -> &str {
        "local-as-remote"
    }
}

fn working_set_pack_fills_the_cache(db: Db) {
    let d = temp_dir("packcache");
    let o = CachedLocalOpener {
        dir: d.path().join("store"),
        remote: Arc::new(LocalBackend::new(&d.path().join("remote")).unwrap()),
        meta: db.meta("packcache"),
    };
    common::pack_scenario(&o, &common::flip_pack_byte);
}

fn remote_backend_reads_through_a_verified_cache(db: Db) {
    let d = temp_dir("cache");
    let remote = Arc::new(LocalBackend::new(&d.path().join("remote")).unwrap());
    let mut cfg = StoreConfig::local(&d.path().join("store"));
    cfg.meta = db.meta("cache");
    cfg.backend = BackendConfig::Custom {
        backend: remote.clone(),
        remote: true,
    };
    let s = Store::open(cfg.clone()).unwrap();
    let img = synthetic_memory(16 << 20, 4);
    let mut w = s.begin(None, "{}").unwrap();
    w.put_layer(LayerKind::Memory, img.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    let snap = w.commit().unwrap();
    // Written through: every chunk is in both.
    let cache = LocalBackend::cache(&d.path().join("store/cache")).unwrap();
    let mut in_remote = remote.list().unwrap();
    // The bucket's claim is the remote's alone (crate::claim).
    in_remote.retain(|o| *o != ::store::claim::CLAIM_ID);
    let mut in_cache = cache.list().unwrap();
    in_remote.sort();
    in_cache.sort();
    assert_eq!(in_remote, in_cache);

    // Cold: cache cleared, reads go to the remote and fill the cache.
    std::fs::remove_dir_all(cache.root()).unwrap();
    let s = Store::open(cfg.clone()).unwrap();
    assert_layer(&s.layer(snap, LayerKind::Memory).unwrap(), &img);
    let c = s.counters();
    assert_eq!(c.cache_hits, 0, "{c:?}");
    assert_eq!(c.backend_reads, in_remote.len() as u64, "{c:?}");
    // Warm: all from the cache.
    assert_layer(&s.layer(snap, LayerKind::Memory).unwrap(), &img);
    let c2 = s.counters();
    assert_eq!(c2.backend_reads, c.backend_reads, "{c2:?}");
    assert_eq!(c2.cache_hits, in_remote.len() as u64, "{c2:?}");

    // A corrupt cache copy is dropped and fetched again, silently.
    let victim = in_remote[0];
    std::fs::write(cache.path_of(&victim), b"garbage").unwrap();
    assert_layer(&s.layer(snap, LayerKind::Memory).unwrap(), &img);
    let c3 = s.counters();
    assert_eq!(c3.cache_corrupt, 1, "{c3:?}");
    assert_eq!(c3.backend_reads, c2.backend_reads + 1, "{c3:?}");

    // Prefetch fills the cache for the windows asked.
    std::fs::remove_dir_all(cache.root()).unwrap();
    let s = Store::open(cfg.clone()).unwrap();
    let v = s.layer(snap, LayerKind::Memory).unwrap();
    let wanted = v.windows_of_pages(&[0, 1, 2, 300, 4000], 4096);
    let fetched = v.prefetch(&wanted, &NoProgress).unwrap();
    let reads = s.counters().backend_reads;
    assert!(fetched > 0 && reads <= wanted.len() as u64);
    let mut buf = vec![0u8; v.window_size() as usize];
    for &w in &wanted {
        v.read_window(w, &mut buf).unwrap();
    }
    assert_eq!(
        s.counters().backend_reads,
        reads,
        "prefetched windows read from the cache"
    );

    // Trimming the cache keeps it under its budget, least recently used
    // first; reads still work.
    assert_layer(&v, &img); // the whole layer in the cache
    let full = s.cache_bytes().unwrap();
    let last = (0..v.windows())
        .find(|&i| matches!(v.window(i), Some(Window::Chunk { .. })))
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(50));
    v.read_window(last, &mut buf).unwrap(); // used last
    let (n, freed) = s.trim_cache(full / 2).unwrap();
    assert!(n > 0 && freed > 0, "{n} {freed} of {full}");
    assert!(s.cache_bytes().unwrap() <= full / 2);
    let before = s.counters().backend_reads;
    v.read_window(wanted[0], &mut buf).unwrap();
    assert_eq!(
        s.counters().backend_reads,
        before,
        "the last used chunk was kept"
    );
    assert_layer(&v, &img);
    assert!(s.counters().backend_reads > before);

    // A corrupt remote copy is an error naming the chunk.
    std::fs::remove_dir_all(cache.root()).unwrap();
    let bad = in_remote[1];
    std::fs::write(remote.path_of(&bad), b"garbage").unwrap();
    let s = Store::open(cfg).unwrap();
    let v = s.layer(snap, LayerKind::Memory).unwrap();
    let e = v
        .restore(&FnSink(|_: &[u8], _| Ok(())), true, &NoProgress)
        .unwrap_err();
    assert!(e.to_string().contains(&bad.to_hex()), "{e}");
}

fn branches_tree_and_sizes(db: Db) {
    let (_d, o) = opener("tree", db);
    let s = o.open();
    let img = synthetic_memory(4 << 20, 8);
    let mut w = s.begin(None, r#"{"name":"root-vm"}"#).unwrap();
    w.put_layer(LayerKind::Memory, img.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    let (root, a) = w
        .commit_branch(BranchChange::Create {
            name: "a".into(),
            state: BranchState::Sleeping,
        })
        .unwrap();
    // A name is unique among running and sleeping branches.
    assert!(matches!(
        s.create_branch("a", root, BranchState::Running),
        Err(StoreError::Meta(MetaError::NameTaken(_)))
    ));
    // Wake a twice: a runs again, b is a second branch from the same snapshot.
    s.set_branch(a, None, BranchState::Running).unwrap();
    let b = s.create_branch("b", root, BranchState::Running).unwrap();
    // Both sleep again with their own diffs; identical diffs are shared.
    let mut same = img.clone();
    same[..4096].fill(9);
    for (id, img2) in [(a, same.clone()), (b, same.clone())] {
        let mut w = s.begin(Some(root), r#"{"name":"sleep"}"#).unwrap();
        w.put_layer(
            LayerKind::Memory,
            img2.as_slice(),
            &Dirty::Windows(&[0]),
            &NoProgress,
        )
        .unwrap();
        w.commit_branch(BranchChange::Update {
            id,
            state: BranchState::Sleeping,
        })
        .unwrap();
    }
    let t = s.tree().unwrap();
    assert_eq!(t.snapshots.len(), 3);
    let kids: Vec<_> = t
        .snapshots
        .iter()
        .filter(|x| x.parent == Some(root))
        .collect();
    assert_eq!(kids.len(), 2);
    for k in &kids {
        assert_eq!(k.sizes.own_stored, 0, "{:?}", k.sizes);
        assert!(k.sizes.shared_stored > 0, "{:?}", k.sizes);
        assert_eq!(k.sizes.shared_chunks, 1);
    }
    let r = t.snapshots.iter().find(|x| x.id == root).unwrap();
    assert!(
        r.sizes.own_stored > 0 && r.sizes.shared_stored == 0,
        "{:?}",
        r.sizes
    );
    assert!(s.branch("a").unwrap().unwrap().snapshot != root);
    let pic = t.render();
    println!("{pic}");
    assert!(pic.contains("root-vm"), "{pic}");
    assert!(
        pic.contains("a (sleeping)") && pic.contains("b (sleeping)"),
        "{pic}"
    );
    assert!(pic.contains("└─ "), "{pic}");
    let json = serde_json::to_value(&t).unwrap();
    assert_eq!(json["snapshots"][0]["manifest"]["name"], "root-vm");
    assert_eq!(json["branches"][0]["state"], "sleeping");
    // A gone branch frees its name.
    s.set_branch(b, None, BranchState::Gone).unwrap();
    s.create_branch("b", root, BranchState::Running).unwrap();
    assert_eq!(s.branches().unwrap().len(), 3);
}

fn progress_is_reported(db: Db) {
    let (_d, o) = opener("progress", db);
    let s = o.open();
    let img = synthetic_memory(8 << 20, 12);
    let last = AtomicU64::new(0);
    let calls = AtomicU64::new(0);
    let p = FnProgress::new(|done, total| {
        assert!(done <= total);
        last.store(done, Ordering::Relaxed);
        calls.fetch_add(1, Ordering::Relaxed);
    });
    let mut w = s.begin(None, "{}").unwrap();
    w.put_layer(LayerKind::Memory, img.as_slice(), &Dirty::All, &p)
        .unwrap();
    let snap = w.commit().unwrap();
    assert_eq!(last.load(Ordering::Relaxed), 8 << 20);
    assert!(calls.load(Ordering::Relaxed) >= 2);
    let v = s.layer(snap, LayerKind::Memory).unwrap();
    v.restore(&FnSink(|_: &[u8], _| Ok(())), false, &p).unwrap();
    assert_eq!(last.load(Ordering::Relaxed), 8 << 20);
    let r = s.verify(&p).unwrap();
    assert_eq!(last.load(Ordering::Relaxed), r.stored_bytes_checked);
}

#[test]
fn schema_is_versioned_and_migrated_once() {
    let d = temp_dir("schema");
    let path = d.path().join("tree.db");
    let m = SqliteMeta::open(&path).unwrap();
    assert_eq!(m.schema_version().unwrap(), store::meta::SCHEMA_VERSION);
    drop(m);
    // Reopening runs nothing again.
    let m = SqliteMeta::open(&path).unwrap();
    assert_eq!(m.schema_version().unwrap(), store::meta::SCHEMA_VERSION);
    drop(m);
    // A database from a newer tine is refused with a clear error.
    let c = rusqlite::Connection::open(&path).unwrap();
    c.execute("UPDATE schema_version SET version = 99", [])
        .unwrap();
    drop(c);
    let e = SqliteMeta::open(&path).unwrap_err();
    assert!(e.to_string().contains("schema version 99"), "{e}");
}

fn bad_configuration_and_input_are_refused(db: Db) {
    let d = temp_dir("bad");
    let mut cfg = StoreConfig::local(d.path());
    cfg.meta = db.meta("bad");
    let good = cfg.clone();
    cfg.window_size = 3000;
    assert!(Store::open(cfg).is_err());
    let s = Store::open(good).unwrap();
    assert!(s.begin(None, "not json").is_err());
    assert!(s.begin(Some(SnapshotId(12345)), "{}").is_err());
    let mut w = s.begin(None, "{}").unwrap();
    w.put_layer(
        LayerKind::Memory,
        [0u8; 8192].as_slice(),
        &Dirty::All,
        &NoProgress,
    )
    .unwrap();
    // One layer of a kind per snapshot.
    assert!(w
        .put_layer(
            LayerKind::Memory,
            [0u8; 8192].as_slice(),
            &Dirty::All,
            &NoProgress
        )
        .is_err());
    let id = w.id();
    drop(w); // dropped uncommitted: gone
    assert!(s.snapshot(id).is_err());
    assert!(s.meta().snapshot(id).unwrap().is_none());
    // An all-zero image stores no chunk and reads back as zeros.
    let mut w = s.begin(None, "{}").unwrap();
    let st = w
        .put_layer(
            LayerKind::Memory,
            vec![0u8; 1 << 20].as_slice(),
            &Dirty::All,
            &NoProgress,
        )
        .unwrap();
    assert_eq!((st.recorded, st.chunks_put), (0, 0));
    let z = w.commit().unwrap();
    assert_layer(&s.layer(z, LayerKind::Memory).unwrap(), &vec![0u8; 1 << 20]);
    // A partial last window.
    let odd: Vec<u8> = (0..(DEFAULT_WINDOW_SIZE as usize * 2 + 1234))
        .map(|i| i as u8)
        .collect();
    let mut w = s.begin(None, "{}").unwrap();
    w.put_layer(LayerKind::Disk(1), odd.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    let o = w.commit().unwrap();
    assert_layer(&s.layer(o, LayerKind::Disk(1)).unwrap(), &odd);
}

fn leases_of_other_hosts_hold_until_they_expire(db: Db) {
    let (_d, o) = opener("leases", db);
    let s = o.open();
    let meta = s.meta();
    let now = store::lease::now_ms;
    let other = |ms: i64| store::meta::Lease {
        owner: "another-host-boot:1:1".into(),
        expires_ms: now() + ms,
    };
    let gone = &store::lease::gone;

    // A pending snapshot of a writer on another host: kept while its
    // lease runs, reaped after.
    let p = meta.begin_snapshot(None, "{}", &other(1500)).unwrap();
    let l = meta
        .add_layer(p, LayerKind::Memory, None, 4096, 4096)
        .unwrap();
    let x = ChunkId::of(b"x");
    let pinned = meta
        .pin(
            p,
            l,
            &[store::meta::NewWindow {
                index: 0,
                entry: store::meta::Entry::Chunk(x),
                stored_len: 10,
                raw_len: 1,
            }],
            now() + 1500,
            gone,
        )
        .unwrap();
    assert!(matches!(pinned, store::meta::Pin::Pinned(ref v) if v == &[true]));
    let r = s.gc(&GcOptions::default(), &NoProgress).unwrap();
    assert!(r.pending_reaped.is_empty(), "{r:?}");
    assert!(meta.chunks().unwrap().iter().any(|c| c.id == x));
    std::thread::sleep(std::time::Duration::from_millis(1600));
    let r = s.gc(&GcOptions::default(), &NoProgress).unwrap();
    assert_eq!(r.pending_reaped, vec![p], "{r:?}");
    assert!(!meta.chunks().unwrap().iter().any(|c| c.id == x));

    // A gc on another host is deleting chunk y: a writer that needs y
    // waits for that gc's lease, then takes y back and puts it again.
    let mut win = vec![0u8; DEFAULT_WINDOW_SIZE as usize];
    Rng(99).fill(&mut win);
    let y = ChunkId::of(&win);
    let mut w = s.begin(None, "{}").unwrap();
    w.put_layer(LayerKind::Memory, win.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    w.abort().unwrap();
    let marked = meta.gc_mark(&other(1500), &[], gone).unwrap();
    assert!(marked.iter().any(|(c, _)| *c == y), "{marked:?}");
    // That gc deleted the object and then stalled (or died) before
    // forgetting the row.
    s.chunks().backend().delete(&y).unwrap();
    let t = std::time::Instant::now();
    let mut w = s.begin(None, "{}").unwrap();
    w.put_layer(LayerKind::Memory, win.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    let snap = w.commit().unwrap();
    let waited = t.elapsed();
    assert!(
        waited >= std::time::Duration::from_millis(1000),
        "{waited:?}"
    );
    assert_layer(&s.layer(snap, LayerKind::Memory).unwrap(), &win);
    let v = s.verify(&NoProgress).unwrap();
    assert!(v.is_ok(), "{v}");
    // The other gc, late, forgets only rows it still owns: none.
    meta.gc_forget("another-host-boot:1:1", &[y]).unwrap();
    assert!(s.verify(&NoProgress).unwrap().is_ok());
    assert_layer(&s.layer(snap, LayerKind::Memory).unwrap(), &win);
}
