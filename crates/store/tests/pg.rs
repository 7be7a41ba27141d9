//! What is PostgreSQL's own in `PgMeta` (the shared scenarios run on it in
//! local.rs and fleet_gc.rs): schema versions, hosts migrating at once,
//! reconnecting, fork(2), URLs and their messages. Plus the measurement
//! of store.md's "PostgreSQL" section (ignored; run by hand).
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use store::meta_pg::PG_SCHEMA_VERSION;
use store::*;

fn admin(url: &str) -> postgres::Client {
    postgres::Client::connect(url, postgres::NoTls).unwrap()
}

#[test]
fn schema_is_versioned_migrated_once_and_a_newer_one_refused() {
    let url = pg::database("schema");
    let m = PgMeta::open(&url).unwrap();
    assert_eq!(m.schema_version().unwrap(), PG_SCHEMA_VERSION);
    drop(m);
    let m = PgMeta::open(&url).unwrap();
    assert_eq!(m.schema_version().unwrap(), PG_SCHEMA_VERSION);
    drop(m);
    admin(&url)
        .batch_execute("UPDATE schema_version SET version = 99")
        .unwrap();
    let e = PgMeta::open(&url).unwrap_err().to_string();
    println!("{e}");
    assert!(e.contains("schema version 99") && e.contains(&url), "{e}");
}

#[test]
fn hosts_opening_a_new_database_at_once_migrate_it_once() {
    let url = pg::database("race");
    std::thread::scope(|s| {
        let opens: Vec<_> = (0..6).map(|_| s.spawn(|| PgMeta::open(&url))).collect();
        for o in opens {
            assert_eq!(
                o.join().unwrap().unwrap().schema_version().unwrap(),
                PG_SCHEMA_VERSION
            );
        }
    });
}

fn store_on(url: &str, dir: &std::path::Path) -> Store {
    let mut cfg = StoreConfig::local(dir);
    cfg.meta = MetaConfig::Postgres(url.into());
    Store::open(cfg).unwrap()
}

fn small_snapshot(s: &Store, seed: u64) -> (SnapshotId, Vec<u8>) {
    let img = synthetic_memory(1 << 20, seed);
    let mut w = s.begin(None, "{}").unwrap();
    w.put_layer(LayerKind::Memory, img.as_slice(), &Dirty::All, &NoProgress)
        .unwrap();
    (w.commit().unwrap(), img)
}

#[test]
fn a_killed_session_is_reconnected_once() {
    let url = pg::database("reconnect");
    let d = temp_dir("reconnect");
    let s = store_on(&url, d.path());
    let (a, img) = small_snapshot(&s, 1);
    // The server ends every session of the store (as a restart would).
    let n: i64 = admin(&url)
        .query_one(
            "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .unwrap()
        .get(0);
    assert!(n >= 1);
    // Reads and writes go on.
    assert_layer(&s.layer(a, LayerKind::Memory).unwrap(), &img);
    let (b, img_b) = small_snapshot(&s, 2);
    assert_layer(&s.layer(b, LayerKind::Memory).unwrap(), &img_b);
    assert!(s.verify(&NoProgress).unwrap().is_ok());
}

#[test]
fn a_fork_child_uses_its_own_connection() {
    let url = pg::database("fork");
    let d = temp_dir("fork");
    let s = store_on(&url, d.path());
    let (a, img) = small_snapshot(&s, 3);
    let before = s.branches().unwrap().len();
    // SAFETY: the child only uses the store (its own new connection; the
    // parent's is leaked, never written) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // Busy at the same time as the parent below: on a shared socket
        // the two would read each other's replies.
        let ok = (0..100).all(|_| s.layer(a, LayerKind::Memory).is_ok() && s.branches().is_ok())
            && s.create_branch("from-child", a, BranchState::Sleeping)
                .is_ok();
        // SAFETY: _exit ends the child without running the parent's
        // destructors or atexit handlers.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    for _ in 0..100 {
        assert_eq!(s.snapshot(a).unwrap().id, a);
        s.totals().unwrap();
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{status}"
    );
    // The parent's session is intact, and sees the child's write.
    assert_eq!(s.branches().unwrap().len(), before + 1);
    assert!(s.branch("from-child").unwrap().is_some());
    assert_layer(&s.layer(a, LayerKind::Memory).unwrap(), &img);
    let (b, _) = small_snapshot(&s, 4);
    assert!(s.snapshot(b).is_ok());
}

#[test]
fn urls_messages_and_selection() {
    let c = pg::cluster();
    let db = pg::database("urls");
    // A password never shows (trust auth: the server does not ask).
    let with_pw = db.replace("tine@", "tine:s3cret@");
    let d = temp_dir("urls");
    let s = store_on(&with_pw, d.path());
    let shown = format!("{s:?} {}", s.meta().describe());
    assert!(
        !shown.contains("s3cret") && shown.contains("127.0.0.1"),
        "{shown}"
    );
    let cfg = format!("{:?}", MetaConfig::parse(&with_pw).unwrap());
    assert!(!cfg.contains("s3cret"), "{cfg}");
    // Nobody listening: the message says where and what to check.
    let dead = format!("postgres://tine:s3cret@127.0.0.1:{}/x", c.port + 1);
    let e = PgMeta::open(&dead).unwrap_err().to_string();
    println!("{e}");
    assert!(
        e.contains("cannot connect to postgres://tine@127.0.0.1:")
            && e.contains("is the server running? TINE_META")
            && !e.contains("s3cret"),
        "{e}"
    );
    // TINE_META values.
    for v in ["", "sqlite"] {
        assert_eq!(MetaConfig::parse(v).unwrap(), MetaConfig::Sqlite);
    }
    assert!(matches!(
        MetaConfig::parse("postgresql://u@h/db").unwrap(),
        MetaConfig::Postgres(_)
    ));
    let e = MetaConfig::parse("mysql://root:pw@h/db")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("TINE_META") && e.contains("mysql") && !e.contains("pw"),
        "{e}"
    );
    let e = PgMeta::open(&format!("{db}?sslmode=require"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("TLS"), "{e}");
}

/// store.md's "PostgreSQL" numbers: a sleep-like write (begin, a 256 MiB
/// memory layer as a diff whose windows are half the parent's, commit)
/// and a `Store::layer` resolve, on SQLite and on PostgreSQL (fsync on,
/// a cluster of its own), medians of 5. `cargo test --release -p
/// tine-store --test pg -- --ignored --nocapture meta_cost`.
#[test]
#[ignore]
fn meta_cost() {
    let cluster = pg::Cluster::start(true);
    let size = 256usize << 20;
    let ws = DEFAULT_WINDOW_SIZE as usize;
    let base = synthetic_memory(size, 5);
    let run = |meta: MetaConfig, name: &str| {
        let d = temp_dir("cost");
        let mut cfg = StoreConfig::local(d.path());
        cfg.meta = meta;
        let s = Store::open(cfg).unwrap();
        let mut w = s.begin(None, "{}").unwrap();
        w.put_layer(LayerKind::Memory, base.as_slice(), &Dirty::All, &NoProgress)
            .unwrap();
        let parent = w.commit().unwrap();
        let (mut put, mut resolve, mut pins) = (Vec::new(), Vec::new(), 0);
        for round in 0..5u64 {
            // Every other window new: half the windows shared with the
            // parent, the rest new chunks (dirty: all of them).
            let mut img = base.clone();
            for (i, win) in img.chunks_mut(ws).enumerate() {
                if i % 2 == 0 {
                    Rng(1000 * round + i as u64 + 7).fill(&mut win[..4096]);
                }
            }
            let t = Instant::now();
            let mut w = s.begin(Some(parent), "{}").unwrap();
            let st = w
                .put_layer(LayerKind::Memory, img.as_slice(), &Dirty::All, &NoProgress)
                .unwrap();
            let id = w.commit().unwrap();
            put.push(t.elapsed());
            pins = st.recorded;
            let t = Instant::now();
            let v = s.layer(id, LayerKind::Memory).unwrap();
            resolve.push(t.elapsed());
            assert_eq!(v.windows() as usize, size / ws);
        }
        let med = |mut v: Vec<Duration>| {
            v.sort();
            v[v.len() / 2].as_secs_f64() * 1000.0
        };
        let (p, r) = (med(put), med(resolve));
        println!(
            "meta_cost {name}: sleep-like put of 256 MiB ({pins} windows recorded) {p:.0} ms, \
             layer resolve {r:.1} ms (medians of 5); metadata {} KiB",
            s.tree().unwrap().metadata_bytes >> 10
        );
        (p, r)
    };
    let sq = run(MetaConfig::Sqlite, "sqlite");
    let pg = run(MetaConfig::Postgres(cluster.database("cost")), "postgres");
    println!(
        "meta_cost: postgres / sqlite: put {:.2}x, resolve {:.2}x",
        pg.0 / sq.0,
        pg.1 / sq.1
    );
    cluster.stop();
}
