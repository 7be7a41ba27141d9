//! Two trees on one bucket: the claim keeps them from deleting each
//! other's chunks. Before it, host B's gc deleted every chunk of host A's
//! snapshots when both had their own SQLite metadata and one S3 prefix.
//! A shared local directory stands in for the bucket (a remote backend
//! to the store: a cache in front, a claim in it).

use std::sync::Arc;

use store::*;

fn open(dir: &std::path::Path, bucket: &Arc<LocalBackend>) -> Store {
    let mut cfg = StoreConfig::local(dir);
    cfg.backend = BackendConfig::Custom {
        backend: bucket.clone(),
        remote: true,
    };
    Store::open(cfg).expect("open")
}

fn image(seed: u8) -> Vec<u8> {
    (0..4u32 << 20).map(|i| (i / 4096) as u8 ^ seed).collect()
}

#[test]
fn a_second_tree_on_the_bucket_is_refused_before_it_deletes_anything() {
    let d = tempfile::tempdir().expect("tempdir");
    let bucket = Arc::new(LocalBackend::new(&d.path().join("bucket")).expect("bucket"));
    let a = open(&d.path().join("a"), &bucket);
    let img = image(7);
    let mut w = a.begin(None, "{}").expect("begin");
    w.put_layer(LayerKind::Memory, img.as_slice(), &Dirty::All, &NoProgress)
        .expect("put");
    let snap = w.commit().expect("commit");
    let objects = bucket.list().expect("list").len();
    assert!(objects > 1, "chunks and the claim: {objects}");

    // Host B: its own SQLite metadata, the same bucket.
    let b = open(&d.path().join("b"), &bucket);
    let e = b
        .gc(&GcOptions::default(), &NoProgress)
        .expect_err("refused");
    let text = e.to_string();
    assert!(matches!(e, StoreError::ForeignBucket { .. }), "{text}");
    assert!(text.contains("TINE_META=postgres://"), "{text}");
    assert!(b.begin(None, "{}").is_err(), "nor does it write there");
    assert_eq!(
        bucket.list().expect("list").len(),
        objects,
        "nothing deleted"
    );

    // A's tree is whole, and its own gc runs (and keeps it).
    a.gc(&GcOptions::default(), &NoProgress).expect("gc");
    let v = a.verify(&NoProgress).expect("verify");
    assert!(v.missing.is_empty() && v.corrupt.is_empty(), "{v:?}");
    assert_eq!(v.orphans, 0, "the claim is no orphan");
    let fresh = open(&d.path().join("a"), &bucket);
    let got = fresh.layer(snap, LayerKind::Memory).expect("layer");
    let mut out = vec![0u8; img.len()];
    got.read_at(&mut out, 0).expect("read");
    assert!(out == img, "A reads its snapshot back");

    // Another prefix (another bucket here) is B's to use.
    let other = Arc::new(LocalBackend::new(&d.path().join("bucket2")).expect("bucket"));
    let b2 = open(&d.path().join("b"), &other);
    b2.gc(&GcOptions::default(), &NoProgress)
        .expect("its own bucket");
}
