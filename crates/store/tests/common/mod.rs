//! Shared scenarios for the local and the S3 tests: each takes a way to
//! open the store, so both backends run the same checks.
#![allow(clippy::unwrap_used, dead_code)]

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use store::*;

pub const MIB: u64 = 1 << 20;

#[path = "synth.rs"]
mod synth;
pub use synth::*;

/// A base image with regions replaced (a fork's view: shared pages plus
/// its own dirty ones), without copying the base.
pub struct Overlay<'a> {
    pub base: &'a [u8],
    pub patches: Vec<(u64, Vec<u8>)>,
}

impl Source for Overlay<'_> {
    fn len(&self) -> u64 {
        self.base.len() as u64
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        Source::read_at(self.base, buf, offset)?;
        let end = offset + buf.len() as u64;
        for (at, data) in &self.patches {
            let pend = at + data.len() as u64;
            if *at < end && pend > offset {
                let s = (*at).max(offset);
                let e = pend.min(end);
                buf[(s - offset) as usize..(e - offset) as usize]
                    .copy_from_slice(&data[(s - at) as usize..(e - at) as usize]);
            }
        }
        Ok(())
    }
}

impl Overlay<'_> {
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.base.len()];
        Source::read_at(self, &mut v, 0).unwrap();
        v
    }
}

/// Reads a whole layer through `restore` (parallel, like a wake).
pub fn read_all(view: &LayerView) -> Vec<u8> {
    let out = Mutex::new(vec![0u8; view.size() as usize]);
    let sink = FnSink(|data: &[u8], off: u64| {
        out.lock().unwrap()[off as usize..off as usize + data.len()].copy_from_slice(data);
        Ok(())
    });
    view.restore(&sink, true, &NoProgress).unwrap();
    out.into_inner().unwrap()
}

/// Asserts a layer reads back as `want`, naming the first bad window.
pub fn assert_layer(view: &LayerView, want: &[u8]) {
    assert_eq!(view.size(), want.len() as u64);
    let got = read_all(view);
    if got != want {
        let ws = view.window_size() as usize;
        let bad = (0..want.len().div_ceil(ws))
            .find(|&i| {
                got[i * ws..((i + 1) * ws).min(got.len())]
                    != want[i * ws..((i + 1) * ws).min(want.len())]
            })
            .unwrap();
        panic!(
            "snapshot {} {} layer differs at window {bad} ({:?})",
            view.snapshot(),
            view.kind(),
            view.window(bad as u64)
        );
    }
}

/// How a scenario opens (and reopens) its store.
pub trait Opener: Sync {
    fn open(&self) -> Store;
    /// Environment for a child process that opens the same store.
    fn child_env(&self) -> Vec<(String, String)>;
    fn name(&self) -> &str;
}

#[path = "pg.rs"]
pub mod pg;

/// A local store in a directory, its tree in SQLite (`DIR/tree.db`) or
/// PostgreSQL.
pub struct LocalOpener {
    pub dir: PathBuf,
    pub meta: MetaConfig,
}

impl LocalOpener {
    pub fn config(&self) -> StoreConfig {
        let mut cfg = StoreConfig::local(&self.dir);
        cfg.meta = self.meta.clone();
        cfg
    }
}

/// The environment a child needs to open a store with `meta`.
pub fn meta_env(meta: &MetaConfig) -> (String, String) {
    let v = match meta {
        MetaConfig::Sqlite => "sqlite".into(),
        MetaConfig::Postgres(url) => url.clone(),
    };
    (META_ENV.into(), v)
}

/// The metadata database a test runs against.
#[derive(Clone, Copy, Debug)]
pub enum Db {
    Sqlite,
    Pg,
}

impl Db {
    /// SQLite in the store's directory, or a fresh PostgreSQL database.
    pub fn meta(self, tag: &str) -> MetaConfig {
        match self {
            Db::Sqlite => MetaConfig::Sqlite,
            Db::Pg => MetaConfig::Postgres(pg::database(tag)),
        }
    }
}

impl Opener for LocalOpener {
    fn open(&self) -> Store {
        Store::open(self.config()).unwrap()
    }
    fn child_env(&self) -> Vec<(String, String)> {
        vec![
            ("TINE_STORE_TEST_DIR".into(), self.dir.display().to_string()),
            ("TINE_STORE".into(), "local".into()),
            meta_env(&self.meta),
        ]
    }
    fn name(&self) -> &str {
        match self.meta {
            MetaConfig::Sqlite => "local",
            MetaConfig::Postgres(_) => "local+pg",
        }
    }
}

/// Sizes of a memory layer's first snapshot in the scenarios.
pub const MEM: usize = 32 << 20;
pub const DISK: usize = 8 << 20;

/// A layer chain: base (memory + disk), child (dirty windows and pages),
/// grandchild (zeroing a window, growing nothing), and a sibling; every
/// snapshot reads back exactly, blobs and working sets too.
pub fn layer_chain_round_trip(o: &dyn Opener) {
    let s = o.open();
    let ws = DEFAULT_WINDOW_SIZE;
    let mem0 = synthetic_memory(MEM, 1);
    let disk0 = synthetic_memory(DISK, 2);
    let mut w = s.begin(None, r#"{"name":"base"}"#).unwrap();
    let st = w
        .put_layer(LayerKind::Memory, mem0.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    assert_eq!(st.windows, MEM as u64 / ws);
    assert!(st.zero > 0, "{st:?}");
    assert_eq!(st.recorded + st.zero, st.windows, "{st:?}");
    w.put_layer(
        LayerKind::Disk(0),
        disk0.as_slice(),
        &Dirty::All,
        &NoProgress,
    )
    .unwrap();
    w.put_blob("state", b"cpu state 0".to_vec());
    w.set_working_set(vec![1, 2, 3, 4096]);
    let base = w.commit().unwrap();

    // Child: memory pages 10 and 2000 (a bitmap), disk window 3.
    let mut mem1 = mem0.clone();
    mem1[10 * PAGE..11 * PAGE].fill(0xAB);
    mem1[2000 * PAGE + 7] ^= 0xFF;
    let mut bitmap = vec![0u64; MEM / PAGE / 64];
    for p in [10usize, 2000] {
        bitmap[p / 64] |= 1 << (p % 64);
    }
    // Page 5000 is marked dirty but did not change: not recorded.
    bitmap[5000 / 64] |= 1 << (5000 % 64);
    let mut disk1 = disk0.clone();
    disk1[3 * ws as usize..3 * ws as usize + 100].fill(7);
    let mut w = s.begin(Some(base), r#"{"name":"child"}"#).unwrap();
    let st = w
        .put_layer(
            LayerKind::Memory,
            mem1.as_slice(),
            &Dirty::Pages {
                bitmap: &bitmap,
                page_size: PAGE as u64,
            },
            &NoProgress,
        )
        .unwrap();
    assert_eq!(st.examined, 3, "{st:?}");
    assert_eq!(st.recorded, 2, "{st:?}");
    assert_eq!(st.unchanged, 1, "{st:?}");
    w.put_layer(
        LayerKind::Disk(0),
        disk1.as_slice(),
        &Dirty::Windows(&[3]),
        &NoProgress,
    )
    .unwrap();
    w.put_blob("state", b"cpu state 1".to_vec());
    let child = w.commit().unwrap();

    // Grandchild: window 0 becomes zero; Dirty::All finds it by itself.
    let mut mem2 = mem1.clone();
    mem2[..ws as usize].fill(0);
    let mut w = s.begin(Some(child), "{}").unwrap();
    let st = w
        .put_layer(LayerKind::Memory, mem2.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    let first_was_zero = mem1[..ws as usize].iter().all(|&b| b == 0);
    assert_eq!(st.recorded, u64::from(!first_was_zero), "{st:?}");
    let grand = w.commit().unwrap();

    // Sibling of child: other pages.
    let mut mem3 = mem0.clone();
    mem3[(MEM - PAGE)..].fill(0x55);
    let mut w = s.begin(Some(base), "{}").unwrap();
    w.put_layer(
        LayerKind::Memory,
        mem3.as_slice(),
        &Dirty::Windows(&[(MEM as u64 - 1) / ws]),
        &NoProgress,
    )
    .unwrap();
    let sib = w.commit().unwrap();

    // Read back through a freshly opened store.
    drop(s);
    let s = o.open();
    assert_layer(&s.layer(base, LayerKind::Memory).unwrap(), &mem0);
    assert_layer(&s.layer(base, LayerKind::Disk(0)).unwrap(), &disk0);
    assert_layer(&s.layer(child, LayerKind::Memory).unwrap(), &mem1);
    assert_layer(&s.layer(child, LayerKind::Disk(0)).unwrap(), &disk1);
    assert_layer(&s.layer(grand, LayerKind::Memory).unwrap(), &mem2);
    assert_layer(&s.layer(sib, LayerKind::Memory).unwrap(), &mem3);
    assert!(matches!(
        s.layer(grand, LayerKind::Disk(0)),
        Err(StoreError::NoLayer { .. })
    ));
    // Unaligned reads across windows.
    let v = s.layer(child, LayerKind::Memory).unwrap();
    let mut buf = vec![0u8; 3 * ws as usize + 17];
    v.read_at(&mut buf, ws - 9).unwrap();
    assert_eq!(buf, mem1[ws as usize - 9..ws as usize - 9 + buf.len()]);
    assert!(v.read_at(&mut buf, MEM as u64 - 10).is_err());
    // The child's windows point at the snapshots that recorded them.
    let w10 = v.window((10 * PAGE) as u64 / ws).unwrap();
    assert!(
        matches!(w10, Window::Chunk { from, .. } if from == child),
        "{w10:?}"
    );
    let w_other = v.window(60).unwrap();
    assert!(
        matches!(w_other, Window::Chunk { from, .. } if from == base) || w_other == Window::Zero
    );

    assert_eq!(s.blob(base, "state").unwrap().unwrap(), b"cpu state 0");
    assert_eq!(s.blob(child, "state").unwrap().unwrap(), b"cpu state 1");
    assert_eq!(s.blob(grand, "state").unwrap(), None);
    assert_eq!(s.snapshot(base).unwrap().working_set, vec![1, 2, 3, 4096]);
    let info = s.snapshot(child).unwrap();
    assert_eq!(info.parent, Some(base));
    assert_eq!(info.manifest, r#"{"name":"child"}"#);
    assert_eq!(info.layers.len(), 2);
    assert_eq!(s.snapshots().unwrap().len(), 4);
    let r = s.verify(&NoProgress).unwrap();
    assert!(r.is_ok(), "{r}");
    assert_eq!(r.pending, 0);
}

/// 10 siblings of one parent, each dirtying its own 8 MiB: stored bytes
/// stay within parent + 10 × 8 MiB (+ metadata); returns the ratio of
/// stored bytes to that bound's logical content.
pub fn ten_siblings(o: &dyn Opener, parent_size: usize) -> f64 {
    let s = o.open();
    let parent_img = synthetic_memory(parent_size, 42);
    let t0 = std::time::Instant::now();
    let mut w = s.begin(None, r#"{"name":"parent"}"#).unwrap();
    w.put_layer(
        LayerKind::Memory,
        parent_img.as_slice(),
        &Dirty::All,
        &NoProgress,
    )
    .unwrap();
    let parent = w.commit().unwrap();
    let parent_put = t0.elapsed();
    let after_parent = s.totals().unwrap();
    let dirty = 8 * MIB;
    let ws = DEFAULT_WINDOW_SIZE;
    let mut kids = Vec::new();
    let mut kid_imgs = Vec::new();
    for k in 0..10u64 {
        let at = (k * 3 + 1) * dirty; // distinct, non-overlapping 8 MiB
        let mut patch = vec![0u8; dirty as usize];
        let mut rng = Rng(1000 + k);
        for pg in patch.chunks_mut(PAGE) {
            let kind = 1 + rng.below(3);
            fill_page(&mut rng, kind, pg);
        }
        let src = Overlay {
            base: &parent_img,
            patches: vec![(at, patch)],
        };
        let windows: Vec<u64> = (at / ws..(at + dirty) / ws).collect();
        let mut w = s.begin(Some(parent), r#"{"name":"sibling"}"#).unwrap();
        let st = w
            .put_layer(
                LayerKind::Memory,
                &src,
                &Dirty::Windows(&windows),
                &NoProgress,
            )
            .unwrap();
        assert_eq!(st.recorded, windows.len() as u64, "{st:?}");
        kids.push(w.commit().unwrap());
        kid_imgs.push(src);
    }
    let t = s.totals().unwrap();
    let meta = s.tree().unwrap().metadata_bytes;
    let parent_logical = parent_img.len() as u64;
    let bound_logical = parent_logical + 10 * dirty;
    // Stored (compressed, deduplicated) bytes vs the bound on stored
    // bytes: the parent's own stored bytes + 10 × 8 MiB.
    let bound = after_parent.stored_bytes + 10 * dirty;
    println!(
        "[{}] ten siblings: parent {} MiB logical, {:.1} MiB stored ({:.1} s); all 11: {:.1} MiB stored, {:.1} MiB logical chunks, metadata {:.2} MiB; \
         bound parent+10x8MiB = {:.1} MiB stored; stored/bound = {:.3}; stored/logical(parent+10x8MiB) = {:.3}",
        o.name(),
        parent_logical >> 20,
        after_parent.stored_bytes as f64 / MIB as f64,
        parent_put.as_secs_f64(),
        t.stored_bytes as f64 / MIB as f64,
        t.logical_bytes as f64 / MIB as f64,
        meta as f64 / MIB as f64,
        bound as f64 / MIB as f64,
        t.stored_bytes as f64 / bound as f64,
        t.stored_bytes as f64 / bound_logical as f64,
    );
    assert!(
        t.stored_bytes <= bound,
        "stored {} > parent {} + 10 x 8 MiB",
        t.stored_bytes,
        after_parent.stored_bytes
    );
    // Logical content stored: the parent's non-zero windows plus at most
    // 10 × 8 MiB of new windows.
    assert!(t.logical_bytes <= after_parent.logical_bytes + 10 * dirty);
    // Sizes: each sibling's bytes are its own; the parent's are its own.
    let tree = s.tree().unwrap();
    for k in &kids {
        let ts = tree.snapshots.iter().find(|x| x.id == *k).unwrap();
        assert!(
            ts.sizes.own_logical > 0 && ts.sizes.own_logical <= dirty,
            "{:?}",
            ts.sizes
        );
    }
    // Every sibling reads back: its dirty region and a window elsewhere.
    for (k, img) in kids.iter().zip(&kid_imgs) {
        let v = s.layer(*k, LayerKind::Memory).unwrap();
        let at = img.patches[0].0;
        let mut buf = vec![0u8; dirty as usize];
        v.read_at(&mut buf, at).unwrap();
        assert_eq!(buf, img.patches[0].1);
        let mut one = vec![0u8; ws as usize];
        v.read_at(&mut one, parent_logical - ws).unwrap();
        assert_eq!(one, parent_img[parent_img.len() - ws as usize..]);
    }
    assert_layer(
        &s.layer(kids[9], LayerKind::Memory).unwrap(),
        &kid_imgs[9].to_vec(),
    );
    t.stored_bytes as f64 / bound_logical as f64
}

/// A chunk's stored bytes altered in the backend: reading the layer fails
/// naming the snapshot, layer and chunk; verify names it too.
pub fn corrupt_chunk_detected(o: &dyn Opener, corrupt: &dyn Fn(&Store, &ChunkId)) {
    let s = o.open();
    let img = synthetic_memory(4 << 20, 9);
    let mut w = s.begin(None, "{}").unwrap();
    w.put_layer(LayerKind::Memory, img.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    let snap = w.commit().unwrap();
    let v = s.layer(snap, LayerKind::Memory).unwrap();
    let (idx, id) = (0..v.windows())
        .find_map(|i| match v.window(i) {
            Some(Window::Chunk { id, .. }) => Some((i, id)),
            _ => None,
        })
        .unwrap();
    corrupt(&s, &id);
    let s = o.open(); // no cache of the good copy in this handle
    let v = s.layer(snap, LayerKind::Memory).unwrap();
    let mut buf = vec![0u8; v.window_size() as usize];
    let err = v.read_window(idx, &mut buf).unwrap_err();
    let msg = format!("{err}");
    println!("[{}] corrupt chunk error: {msg}", o.name());
    assert!(msg.contains(&id.to_hex()), "{msg}");
    assert!(msg.contains(&format!("snapshot {snap}")), "{msg}");
    assert!(msg.contains("memory layer"), "{msg}");
    assert!(msg.contains("corrupt"), "{msg}");
    assert!(matches!(err, StoreError::Chunk { .. }));
    let r = s.verify(&NoProgress).unwrap();
    assert!(!r.is_ok());
    assert_eq!(r.corrupt.len(), 1, "{r}");
    assert_eq!(r.corrupt[0].chunk, id);
    assert_eq!(r.corrupt[0].snapshots, vec![snap]);
    println!("[{}] verify: {r}", o.name());
    // A missing chunk is reported as missing.
    s.chunks().backend().delete(&id).unwrap();
    let r = s.verify(&NoProgress).unwrap();
    assert_eq!(r.missing.len(), 1, "{r}");
    let err = v.read_window(idx, &mut buf).unwrap_err();
    assert!(format!("{err}").contains("missing"), "{err}");
}

/// gc keeps what committed snapshots reference and removes the rest:
/// an aborted writer's chunks, a pruned snapshot's own chunks, orphans.
pub fn gc_keeps_referenced(o: &dyn Opener) {
    let s = o.open();
    let img = synthetic_memory(8 << 20, 11);
    let mut w = s.begin(None, "{}").unwrap();
    w.put_layer(LayerKind::Memory, img.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    let base = w.commit().unwrap();
    let base_chunks = s.layer(base, LayerKind::Memory).unwrap().chunk_ids();

    // An aborted writer leaves chunks nobody references.
    let mut other = img.clone();
    Rng(5).fill(&mut other[..MIB as usize]);
    let mut w = s.begin(Some(base), "{}").unwrap();
    w.put_layer(
        LayerKind::Memory,
        other.as_slice(),
        &Dirty::All,
        &NoProgress,
    )
    .unwrap();
    w.abort().unwrap();
    let before = s.chunks().backend().list().unwrap().len();
    assert!(before > base_chunks.len());

    // A child with a branch, and one whose branch is gone.
    let mut kid = img.clone();
    Rng(6).fill(&mut kid[2 * MIB as usize..3 * MIB as usize]);
    let mut w = s.begin(Some(base), "{}").unwrap();
    w.put_layer(LayerKind::Memory, kid.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    let (keep, _) = w
        .commit_branch(BranchChange::Create {
            name: "keep".into(),
            state: BranchState::Sleeping,
        })
        .unwrap();
    let mut gone_img = img.clone();
    Rng(7).fill(&mut gone_img[4 * MIB as usize..5 * MIB as usize]);
    let mut w = s.begin(Some(base), "{}").unwrap();
    w.put_layer(
        LayerKind::Memory,
        gone_img.as_slice(),
        &Dirty::All,
        &NoProgress,
    )
    .unwrap();
    let (dropped, b) = w
        .commit_branch(BranchChange::Create {
            name: "dropped".into(),
            state: BranchState::Sleeping,
        })
        .unwrap();
    s.set_branch(b, None, BranchState::Gone).unwrap();
    let dropped_own: Vec<ChunkId> = s
        .layer(dropped, LayerKind::Memory)
        .unwrap()
        .chunk_ids()
        .into_iter()
        .filter(|c| !base_chunks.contains(c))
        .collect();
    assert!(!dropped_own.is_empty());

    // An orphan object no row knows.
    let orphan = ChunkId::of(b"orphan");
    s.chunks()
        .backend()
        .put(&orphan, &chunk::encode(b"orphan", 1).unwrap())
        .unwrap();

    let r = s.gc(&GcOptions::default(), &NoProgress).unwrap();
    println!("[{}] gc: {r:?}", o.name());
    // The aborted writer's 1 MiB (4 windows) and the orphan.
    assert!(r.chunks_deleted > 4, "{r:?}");
    let objs = s.chunks().backend().list().unwrap();
    assert!(!objs.contains(&orphan));
    for c in &base_chunks {
        assert!(objs.contains(c), "gc removed referenced chunk {c}");
    }
    assert_layer(&s.layer(base, LayerKind::Memory).unwrap(), &img);
    assert_layer(&s.layer(keep, LayerKind::Memory).unwrap(), &kid);
    assert_layer(&s.layer(dropped, LayerKind::Memory).unwrap(), &gone_img);

    // Prune: the gone branch's snapshot goes, and only its own chunks.
    let r = prune(&s);
    assert_eq!(r.snapshots_pruned, vec![dropped], "{r:?}");
    assert_eq!(r.chunks_deleted, dropped_own.len() as u64, "{r:?}");
    let objs = s.chunks().backend().list().unwrap();
    for c in &dropped_own {
        assert!(!objs.contains(c));
    }
    assert!(s.snapshot(dropped).is_err());
    assert_layer(&s.layer(base, LayerKind::Memory).unwrap(), &img);
    assert_layer(&s.layer(keep, LayerKind::Memory).unwrap(), &kid);
    let v = s.verify(&NoProgress).unwrap();
    assert!(v.is_ok() && v.orphans == 0, "{v}");
    // Nothing more to do.
    let r = s.gc(&GcOptions::default(), &NoProgress).unwrap();
    assert_eq!(r.chunks_deleted, 0, "{r:?}");
}

/// The image the crash child writes (snapshot of the base in the store).
pub fn crash_image(seed: u64) -> Vec<u8> {
    let mut img = synthetic_memory(16 << 20, 77);
    let mut rng = Rng(seed);
    // Make every window new (so every one is a put).
    for c in img.chunks_mut(64 << 10) {
        let v = rng.next().to_le_bytes();
        c[..8].copy_from_slice(&v);
    }
    img
}

/// Run by the child process: writes one snapshot of `crash_image` as a
/// child of `TINE_STORE_TEST_PARENT`, then commits. The fault hook (or the
/// parent's SIGKILL) stops it somewhere.
pub fn crash_child(o: &dyn Opener) {
    let s = o.open();
    let env = |k: &str| std::env::var(k).unwrap().parse::<i64>().unwrap();
    let parent = SnapshotId(env("TINE_STORE_TEST_PARENT"));
    let img = crash_image(env("TINE_STORE_TEST_SEED") as u64);
    // With a working set and packs on, so the pack put is among the
    // points a kill can hit.
    s.set_packs(true);
    let mut w = s.begin(Some(parent), r#"{"name":"crash"}"#).unwrap();
    w.put_layer(LayerKind::Memory, img.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    w.put_blob("state", b"child".to_vec());
    w.set_working_set((0..2048).step_by(16).collect());
    w.commit().unwrap();
    println!("CHILD COMMITTED");
}

/// Runs the test binary's `test` (which calls `crash_child`) in a child
/// process; SIGKILLs it after `kill_after` if given.
pub fn run_child(
    o: &dyn Opener,
    test: &str,
    env: &[(&str, String)],
    kill_after: Option<Duration>,
) -> std::process::ExitStatus {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = Command::new(exe);
    cmd.args(["--exact", test, "--nocapture", "--test-threads=1"]);
    cmd.env("TINE_STORE_TEST_CHILD", "1");
    for (k, v) in o.child_env() {
        cmd.env(k, v);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdout(std::process::Stdio::null());
    cmd.stderr(std::process::Stdio::null());
    let mut child = cmd.spawn().unwrap();
    if let Some(d) = kill_after {
        std::thread::sleep(d);
        // Child::kill is SIGKILL on Unix; it may have exited already.
        let _ = child.kill();
    }
    child.wait().unwrap()
}

/// Checks the store after a crash: verify passes, at most the crashed
/// snapshot appeared (whole), the base reads back, gc reaps the leftovers
/// and verify passes again with nothing pending or orphaned. Returns
/// whether the crashed writer had committed.
pub fn check_after_crash(
    o: &dyn Opener,
    base: SnapshotId,
    base_img: &[u8],
    before: &[SnapshotId],
    seed: u64,
) -> bool {
    let s = o.open();
    let r = s.verify(&NoProgress).unwrap();
    assert!(r.is_ok(), "verify after crash: {r}");
    println!("[{}]   after the crash: {r}", o.name());
    let snaps: Vec<SnapshotId> = s.snapshots().unwrap().iter().map(|x| x.id).collect();
    let new: Vec<SnapshotId> = snaps
        .iter()
        .copied()
        .filter(|x| !before.contains(x))
        .collect();
    assert!(new.len() <= 1, "snapshots appeared: {new:?}");
    assert!(
        before.iter().all(|b| snaps.contains(b)),
        "a snapshot vanished"
    );
    for id in &new {
        let info = s.snapshot(*id).unwrap();
        assert!(
            info.pack.is_some(),
            "the crash child's snapshot has no pack"
        );
        assert_eq!(info.parent, Some(base));
        assert_eq!(info.manifest, r#"{"name":"crash"}"#);
        assert_layer(
            &s.layer(*id, LayerKind::Memory).unwrap(),
            &crash_image(seed),
        );
        assert_eq!(s.blob(*id, "state").unwrap().unwrap(), b"child");
    }
    assert_layer(&s.layer(base, LayerKind::Memory).unwrap(), base_img);
    let g = s.gc(&GcOptions::default(), &NoProgress).unwrap();
    assert_eq!(
        s.meta().snapshots(SnapshotState::Pending).unwrap().len(),
        0,
        "{g:?}"
    );
    let r = s.verify(&NoProgress).unwrap();
    assert!(
        r.is_ok() && r.orphans == 0 && r.pending == 0,
        "verify after gc: {r}"
    );
    assert_layer(&s.layer(base, LayerKind::Memory).unwrap(), base_img);
    for id in &new {
        assert_layer(
            &s.layer(*id, LayerKind::Memory).unwrap(),
            &crash_image(seed),
        );
    }
    !new.is_empty()
}

/// Kills the writer at every fault point and at moments spread over its
/// run (SIGKILL); the store stays consistent each time.
pub fn crash_at_every_point(o: &dyn Opener, child_test: &str) {
    let s = o.open();
    let base_img = synthetic_memory(8 << 20, 3);
    let mut w = s.begin(None, r#"{"name":"base"}"#).unwrap();
    w.put_layer(
        LayerKind::Memory,
        base_img.as_slice(),
        &Dirty::All,
        &NoProgress,
    )
    .unwrap();
    let base = w.commit().unwrap();
    drop(s);
    let mut seed = 100;
    let mut runs: Vec<(String, Option<Duration>, Option<bool>)> = [
        "chunk-temp:3",
        "mid-chunks:1",
        "mid-chunks:40",
        "after-chunks",
        "pack-put",
        "before-commit",
        "after-commit",
    ]
    .iter()
    .filter(|p| o.name() == "local" || !p.starts_with("chunk-temp"))
    .map(|p| (p.to_string(), None, Some(*p == "after-commit")))
    .collect();
    // One undisturbed run to time the child; SIGKILLs spread over that.
    let t0 = std::time::Instant::now();
    let before: Vec<SnapshotId> = o.open().snapshots().unwrap().iter().map(|x| x.id).collect();
    let st = run_child(
        o,
        child_test,
        &[
            ("TINE_STORE_TEST_SEED", "99".into()),
            ("TINE_STORE_TEST_PARENT", base.0.to_string()),
        ],
        None,
    );
    let full = t0.elapsed();
    assert!(st.success(), "undisturbed child: {st:?}");
    assert!(check_after_crash(o, base, &base_img, &before, 99));
    println!("[{}] an undisturbed child takes {full:?}", o.name());
    for pct in [5u32, 20, 35, 50, 65, 80, 95] {
        runs.push((String::new(), Some(full * pct / 100), None));
    }
    let mut committed_by_kill = 0;
    for (point, kill, want) in runs {
        seed += 1;
        let before: Vec<SnapshotId> = o.open().snapshots().unwrap().iter().map(|x| x.id).collect();
        let mut env = vec![
            ("TINE_STORE_TEST_SEED", seed.to_string()),
            ("TINE_STORE_TEST_PARENT", base.0.to_string()),
        ];
        if !point.is_empty() {
            env.push(("TINE_STORE_FAULT", point.clone()));
        }
        let st = run_child(o, child_test, &env, kill);
        if kill.is_none() {
            assert!(!st.success(), "{point}: the child did not abort: {st:?}");
        }
        let committed = check_after_crash(o, base, &base_img, &before, seed);
        if let Some(want) = want {
            assert_eq!(committed, want, "{point}");
            println!(
                "[{}] fault {point}: verify ok, committed={committed}",
                o.name()
            );
        } else {
            committed_by_kill += u32::from(committed);
            println!(
                "[{}] SIGKILL after {:?} ({st:?}): verify ok, committed={committed}",
                o.name(),
                kill.unwrap_or_default()
            );
        }
    }
    println!(
        "[{}] {committed_by_kill} SIGKILLed children had committed",
        o.name()
    );
}

/// A gc running in a loop while snapshots are written in another thread
/// (two store handles, as two processes): every committed snapshot stays
/// whole.
pub fn gc_races_writers(o: &dyn Opener) {
    let img = synthetic_memory(8 << 20, 21);
    let s = o.open();
    let mut w = s.begin(None, "{}").unwrap();
    w.put_layer(LayerKind::Memory, img.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    let base = w.commit().unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|sc| {
        let gc = sc.spawn(|| {
            let g = o.open();
            let mut runs = 0;
            let mut deleted = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let r = g.gc(&GcOptions::default(), &NoProgress).unwrap();
                deleted += r.chunks_deleted;
                runs += 1;
            }
            (runs, deleted)
        });
        let writer = o.open();
        for round in 0..12u64 {
            // Alternate: the same content again (dedup against chunks gc
            // may be deleting: the aborted round's), and new content.
            let mut kid = img.clone();
            Rng(500 + round / 2).fill(&mut kid[..2 * MIB as usize]);
            let mut w = writer.begin(Some(base), "{}").unwrap();
            w.put_layer(LayerKind::Memory, kid.as_slice(), &Dirty::All, &NoProgress)
                .unwrap();
            if round % 2 == 0 {
                w.abort().unwrap();
                continue;
            }
            let id = w.commit().unwrap();
            assert_layer(&writer.layer(id, LayerKind::Memory).unwrap(), &kid);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (runs, deleted) = gc.join().unwrap();
        println!(
            "[{}] gc ran {runs} times during the writes, deleted {deleted} chunks",
            o.name()
        );
    });
    let r = s.verify(&NoProgress).unwrap();
    assert!(r.is_ok(), "{r}");
    for x in s.snapshots().unwrap() {
        read_all(&s.layer(x.id, LayerKind::Memory).unwrap());
    }
}

pub fn is_child() -> bool {
    std::env::var_os("TINE_STORE_TEST_CHILD").is_some()
}

pub fn temp_dir(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("tine-store-{tag}-"))
        .tempdir()
        .unwrap()
}

pub fn exists(p: &Path) -> bool {
    p.exists()
}

/// Working-set packs: a snapshot committed with a working set stores one
/// pack of its chunks; fetching it fills the cache with verified chunks
/// (a remote store then reads none of them from the backend); verify
/// checks it and names the snapshot of a corrupt one, whose fetch fails
/// naming it too while the per-chunk path still reads right; gc keeps a
/// pack while a snapshot names it and removes it after. `corrupt` puts
/// other bytes under the pack's id in the backend.
pub fn pack_scenario(o: &dyn Opener, corrupt: &dyn Fn(&Store, &ChunkId)) {
    let s = o.open();
    s.set_packs(true);
    let ws = DEFAULT_WINDOW_SIZE as usize;
    let img = synthetic_memory(16 << 20, 31);
    let mut w = s.begin(None, "{}").unwrap();
    w.put_layer(LayerKind::Memory, img.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    let base = w.commit().unwrap();
    assert_eq!(s.snapshot(base).unwrap().pack, None);
    assert!(s.fetch_pack(base).unwrap().is_none());

    // A child with 2 windows of its own and a working set over windows
    // 0..12 (own, inherited, and a zeroed one), pages out of order.
    let mut child = img.clone();
    Rng(32).fill(&mut child[3 * ws..4 * ws]);
    Rng(33).fill(&mut child[9 * ws..9 * ws + 4096]);
    child[5 * ws..6 * ws].fill(0);
    let mut w = s.begin(Some(base), "{}").unwrap();
    w.put_layer(
        LayerKind::Memory,
        child.as_slice(),
        &Dirty::Windows(&[3, 5, 9]),
        &NoProgress,
    )
    .unwrap();
    let per = (ws / 4096) as u64;
    let mut pages: Vec<u64> = (0..12u64).rev().map(|w| w * per + 1).collect();
    pages.push(4 * per + 2); // a second page of window 4: one entry
    w.set_working_set(pages);
    let snap = w.commit().unwrap();
    let (pack, len) = s.snapshot(snap).unwrap().pack.expect("a pack");
    assert!(s.chunks().backend().exists(&pack).unwrap());
    let view = s.layer(snap, LayerKind::Memory).unwrap();
    let want: std::collections::BTreeSet<ChunkId> = (0..12)
        .filter_map(|i| match view.window(i) {
            Some(Window::Chunk { id, .. }) => Some(id),
            _ => None,
        })
        .collect();
    // synthetic memory has zero and repeated windows of its own.
    let n = want.len() as u64;
    assert!(n >= 6, "{n} chunks");
    let r = s.verify(&NoProgress).unwrap();
    assert!(r.is_ok() && r.packs_checked == 1 && r.orphans == 0, "{r}");

    // Its chunks are exactly those, checked into the cache; the layer
    // then reads them from there.
    if let Some(cache) = s.chunks().cache() {
        for id in cache.list().unwrap() {
            cache.delete(&id).unwrap();
        }
    }
    let arrived = Mutex::new(Vec::new());
    let f = s
        .fetch_pack_with(snap, &|c| arrived.lock().unwrap().push(*c))
        .unwrap();
    match s.chunks().cache() {
        Some(cache) => {
            let f = f.expect("a remote store fetches its pack");
            assert_eq!((f.chunks, f.stored_bytes), (n, len));
            // Each chunk announced once, in working-set (first touch) order:
            // windows 11, 10, ... 0.
            let arrived = arrived.into_inner().unwrap();
            let order: Vec<ChunkId> = (0..12u64)
                .rev()
                .filter_map(|i| match view.window(i) {
                    Some(Window::Chunk { id, .. }) => Some(id),
                    _ => None,
                })
                .fold(Vec::new(), |mut v, id| {
                    if !v.contains(&id) {
                        v.push(id);
                    }
                    v
                });
            assert_eq!(arrived, order);
            let got: std::collections::BTreeSet<ChunkId> =
                cache.list().unwrap().into_iter().collect();
            assert_eq!(got, want);
            // Again with every chunk cached: only the index is read, and
            // each chunk is still announced.
            let again = Mutex::new(Vec::new());
            let f2 = s
                .fetch_pack_with(snap, &|c| again.lock().unwrap().push(*c))
                .unwrap()
                .expect("a pack");
            assert!(f2.stored_bytes < len / 2, "{f2:?} of {len}");
            assert_eq!(again.into_inner().unwrap().len(), arrived.len());
            let s2 = o.open();
            let v = s2.layer(snap, LayerKind::Memory).unwrap();
            let mut buf = vec![0u8; ws];
            for i in 0..12 {
                v.read_window(i, &mut buf).unwrap();
                assert_eq!(&buf[..], &child[i as usize * ws..(i as usize + 1) * ws]);
            }
            let c = s2.counters();
            assert_eq!(c.backend_reads, 0, "{c:?}");
            assert!(c.cache_hits >= n, "{c:?}");
        }
        None => assert!(f.is_none()),
    }

    // One byte of the pack changed: verify names the snapshot, the fetch
    // fails naming it, and the layer still reads (chunk by chunk).
    corrupt(&s, &pack);
    let r = s.verify(&NoProgress).unwrap();
    assert!(!r.is_ok(), "{r}");
    assert_eq!(r.bad_packs.len(), 1, "{r}");
    assert_eq!(r.bad_packs[0].snapshots, vec![snap]);
    let shown = r.to_string();
    println!("[{}] verify, corrupt pack: {shown}", o.name());
    assert!(shown.contains(&pack.to_hex()) && shown.contains(&format!("snapshots {snap}")));
    if let Some(cache) = s.chunks().cache() {
        for id in cache.list().unwrap() {
            cache.delete(&id).unwrap();
        }
        let e = s.fetch_pack(snap).unwrap_err();
        println!("[{}] fetch, corrupt pack: {e}", o.name());
        assert!(
            matches!(e, StoreError::Pack { snapshot, .. } if snapshot == snap),
            "{e}"
        );
        assert!(e.to_string().contains(&format!("snapshot {snap}")), "{e}");
    }
    assert_layer(&o.open().layer(snap, LayerKind::Memory).unwrap(), &child);

    // gc keeps a pack a snapshot names (even a corrupt one: it is not
    // gc's to judge), and removes it with the snapshot. (A pack named by
    // a pending row whose writer died goes with the row: the crash test's
    // `pack-put` point.)
    s.gc(&GcOptions::default(), &NoProgress).unwrap();
    assert!(s.chunks().backend().exists(&pack).unwrap());
    let g = prune(&s);
    assert!(g.snapshots_pruned.contains(&snap), "{g:?}");
    assert!(!s.chunks().backend().exists(&pack).unwrap());
    let r = s.verify(&NoProgress).unwrap();
    assert!(r.is_ok() && r.orphans == 0 && r.packs_checked == 0, "{r}");
    // Nothing is left but the bucket's claim (a remote backend's).
    let mut left = s.chunks().backend().list().unwrap();
    left.retain(|o| *o != ::store::claim::CLAIM_ID);
    assert!(left.is_empty(), "{left:?}");
}

/// Replaces the pack `id` in the backend with its bytes, one flipped.
pub fn flip_pack_byte(s: &Store, id: &ChunkId) {
    let mut b = s.chunks().backend().get(id).unwrap().unwrap();
    let at = b.len() - 100;
    b[at] ^= 0x10;
    s.chunks().backend().put(id, &b).unwrap();
}

/// gc with pruning of snapshots no branch needs.
fn prune(s: &Store) -> GcReport {
    s.gc(
        &GcOptions {
            prune_snapshots: true,
            ..GcOptions::default()
        },
        &NoProgress,
    )
    .unwrap()
}
