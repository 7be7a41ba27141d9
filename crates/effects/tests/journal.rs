//! The journal over both backends (SQLite, and a real PostgreSQL 15), and
//! two hosts sharing one PostgreSQL database.

mod common;

use common::{pg, TempDir};
use effects::journal::{Journal, Meta, NewEffect, State, SCHEMA_VERSION};
use effects::{MomentKind, Registration, Step};

fn reg(branch: &str, lineage: Vec<Step>) -> Registration {
    Registration {
        branch: branch.into(),
        vm: format!("vm-{branch}"),
        socket: "/nonexistent".into(),
        lineage,
        effects: Default::default(),
        network: Default::default(),
        peer_uid: None,
    }
}

fn child_of(branch: &str, parent: &str, moment: &str, kind: MomentKind) -> Registration {
    reg(
        branch,
        vec![Step {
            branch: parent.into(),
            moment: moment.into(),
            kind,
        }],
    )
}

fn effect<'a>(tree: &'a str, branch: &'a str, key: &'a str, digest: &'a str) -> NewEffect<'a> {
    NewEffect {
        tree,
        scope: "",
        key: Some(key),
        key_text: None,
        key_source: Some("derived"),
        branch,
        method: "POST",
        url: "http://x/",
        dest: "x:80",
        digest: Some(digest),
        policy: "once-per-tree",
        state: State::Sent,
        status: None,
        req_bytes: 0,
        error: None,
    }
}

/// Keys, barriers, counts, lineage, reopening, in-doubt and resolve: the
/// journal's contract, whichever backend holds it.
fn keys_barriers_and_counts(meta: &Meta) {
    let open = || Journal::connect(meta, "host-1").expect("open");
    let mut j = open();
    assert_eq!(j.schema_version().expect("v"), SCHEMA_VERSION);
    let root = reg("r", vec![]);
    j.put_branch(&root, true).expect("branch");
    let a = j
        .insert(&effect("r", "r", "k1", "d"))
        .expect("i")
        .expect("new");
    assert!(
        j.insert(&effect("r", "r", "k1", "d")).expect("i").is_none(),
        "key taken"
    );
    j.complete(a, 201, b"x: y\r\n", b"body").expect("complete");
    let row = j.get(a).expect("get").expect("row");
    assert_eq!(
        (row.state, row.status, row.resp_body.as_deref()),
        (State::Completed, Some(201), Some(&b"body"[..]))
    );
    assert_eq!(row.host.as_deref(), Some("host-1"));
    j.release(a, "r", false).expect("release");
    let m = j.add_moment("m1", "r", MomentKind::Fork).expect("moment");
    // After the barrier: the parent's own count grows, the child's not.
    let b = j
        .insert(&effect("r", "r", "k2", "d"))
        .expect("i")
        .expect("new");
    j.complete(b, 201, b"", b"").expect("complete");
    j.release(b, "r", false).expect("release");
    let child = child_of("c", "r", "m1", MomentKind::Fork);
    j.put_branch(&child, true).expect("branch");
    let bar = j.barriers(&child).expect("barriers");
    assert_eq!(bar, vec![("r".to_string(), m)]);
    assert_eq!(j.count_released("r", &[], "d").expect("count"), 2);
    assert_eq!(j.count_released("c", &bar, "d").expect("count"), 1);
    assert_eq!(
        j.find_before("r", "k1", &bar).expect("f").map(|e| e.id),
        Some(a)
    );
    assert!(j.find_before("r", "k2", &bar).expect("f").is_none());
    j.release(b, "c", true).expect("replay");
    let v = j.lineage_effects("c").expect("list");
    assert_eq!(v.len(), 2, "{v:?}");
    assert_eq!(
        (v[0].relation.as_str(), v[1].state.as_str()),
        ("ancestor", "replayed")
    );
    assert_eq!(v[1].replayed_to, vec!["vm-c".to_string()]);
    assert_eq!(
        j.branch_of_vm("vm-c")
            .expect("b")
            .map(|b| b.registration.branch),
        Some("c".to_string())
    );
    j.set_active("c", false).expect("inactive");
    let active: Vec<String> = j
        .active_branches()
        .expect("active")
        .into_iter()
        .map(|r| r.branch)
        .collect();
    assert_eq!(active, vec!["r".to_string()]);
    j.set_bytes(b, 7, 9).expect("bytes");
    let counts = j.counts().expect("counts");
    assert_eq!(counts, vec![("completed".to_string(), 2)]);
    drop(j);
    // Reopened: same schema, sent rows become in-doubt, seq goes on.
    let mut j = open();
    let s = j
        .insert(&effect("r", "r", "k3", "e"))
        .expect("i")
        .expect("new");
    assert!(j.get(s).expect("g").expect("row").seq > m);
    drop(j);
    let mut j = open();
    assert_eq!(j.schema_version().expect("v"), SCHEMA_VERSION);
    assert_eq!(j.mark_in_doubt().expect("mark"), 1);
    assert_eq!(j.get(s).expect("g").expect("row").state, State::InDoubt);
    assert_eq!(j.resolve("r", "k3", true).expect("resolve"), Some(s));
    assert_eq!(j.resolve("r", "k3", true).expect("resolve"), None, "once");
    assert!(
        j.insert(&effect("r", "r", "k3", "e")).expect("i").is_some(),
        "key freed"
    );
    let f = j
        .insert(&effect("r", "r", "k4", "e"))
        .expect("i")
        .expect("new");
    j.in_doubt(f, "cut off").expect("in doubt");
    assert_eq!(j.resolve("r", "k4", false).expect("resolve"), Some(f));
    let row = j.get(f).expect("g").expect("row");
    assert_eq!(row.state, State::Failed);
    assert!(row
        .error
        .as_deref()
        .unwrap_or("")
        .contains("resolved by a human: failed"));
    let u = j
        .insert(&effect("r", "r", "k5", "e"))
        .expect("i")
        .expect("new");
    j.delete_unsent(u).expect("delete");
    assert!(j.get(u).expect("g").is_none());
    j.delete_moment("m1").expect("delete moment");
    assert_eq!(j.moment_seq("m1").expect("seq"), None);
}

#[test]
fn test_journal_sqlite() {
    let dir = TempDir::new("journal");
    keys_barriers_and_counts(&Meta::Sqlite(dir.0.join("journal.db")));
}

#[test]
fn test_journal_postgres() {
    keys_barriers_and_counts(&Meta::Postgres(pg::fresh_db("journal")));
}

/// A journal written by the SQLite schema before hosts (version 1) is
/// migrated: its rows are kept, its tables renamed.
#[test]
fn test_sqlite_version_1_is_migrated() {
    let dir = TempDir::new("journal-v1");
    let path = dir.0.join("journal.db");
    {
        let c = rusqlite::Connection::open(&path).expect("sqlite");
        c.execute_batch(
            "CREATE TABLE schema_version (version INTEGER NOT NULL);
             INSERT INTO schema_version VALUES (1);
             CREATE TABLE branches (id TEXT PRIMARY KEY, vm TEXT NOT NULL, tree TEXT NOT NULL,
                 registration TEXT NOT NULL, active INTEGER NOT NULL, created_ms INTEGER NOT NULL);
             CREATE TABLE moments (id TEXT PRIMARY KEY, branch TEXT NOT NULL, kind TEXT NOT NULL,
                 seq INTEGER NOT NULL, created_ms INTEGER NOT NULL);
             CREATE TABLE effects (id INTEGER PRIMARY KEY, seq INTEGER NOT NULL, tree TEXT NOT NULL,
                 scope TEXT NOT NULL, key TEXT, key_text TEXT, key_source TEXT, branch TEXT NOT NULL,
                 method TEXT NOT NULL, url TEXT NOT NULL, dest TEXT NOT NULL, digest TEXT,
                 policy TEXT NOT NULL, state TEXT NOT NULL, status INTEGER, resp_head BLOB,
                 resp_body BLOB, req_bytes INTEGER NOT NULL DEFAULT 0, resp_bytes INTEGER,
                 error TEXT, started_ms INTEGER NOT NULL, completed_ms INTEGER);
             CREATE UNIQUE INDEX effects_key ON effects(tree, scope, key) WHERE key IS NOT NULL;
             CREATE TABLE releases (seq INTEGER PRIMARY KEY, effect INTEGER NOT NULL,
                 branch TEXT NOT NULL, replay INTEGER NOT NULL, ms INTEGER NOT NULL);
             INSERT INTO effects (seq, tree, scope, key, branch, method, url, dest, policy, state,
                 started_ms) VALUES (5, 'r', '', 'k', 'r', 'POST', 'http://x/', 'x:80',
                 'once-per-tree', 'sent', 0);",
        )
        .expect("a version 1 journal");
    }
    let mut j = Journal::connect(&Meta::Sqlite(path), "host-1").expect("open");
    assert_eq!(j.schema_version().expect("v"), SCHEMA_VERSION);
    let row = j.find("r", "", "k").expect("find").expect("kept");
    assert_eq!((row.seq, row.host), (5, None));
    // Its sent row predates hosts: the file's only gateway owns it.
    assert_eq!(j.mark_in_doubt().expect("mark"), 1);
    let m = j.add_moment("m", "r", MomentKind::Fork).expect("moment");
    assert!(m > 5, "the sequence goes on from the rows kept");
}

/// Two hosts, one PostgreSQL database: what a branch executed through
/// host A's journal is replayed, not repeated, for its copy woken through
/// host B's; each host's gateway start touches only its own in-flight
/// effects and re-binds only its own branches.
#[test]
fn test_two_hosts_share_the_lineage() {
    let meta = Meta::Postgres(pg::fresh_db("hosts"));
    let mut a = Journal::connect(&meta, "host-a").expect("host a");
    let mut b = Journal::connect(&meta, "host-b").expect("host b");
    assert_eq!(a.schema_version().expect("v"), SCHEMA_VERSION);

    // On A: the root's request is in flight when its moment is taken
    // (it sleeps into the store); the response comes after the barrier.
    a.put_branch(&reg("r", vec![]), true).expect("branch");
    let e = a
        .insert(&effect("r", "r", "k-mail", "d-mail"))
        .expect("insert")
        .expect("new");
    let m = a
        .add_moment("m1", "r", MomentKind::Snapshot)
        .expect("moment");
    a.complete(e, 202, b"x-mail: queued\r\n", b"queued")
        .expect("complete");
    a.release(e, "r", false).expect("release");

    // On B: the copy woken from that moment asks the same: nothing of
    // that digest was released before the barrier, so its key is the
    // parent's, and B finds the parent's response.
    let c = child_of("c", "r", "m1", MomentKind::Snapshot);
    b.put_branch(&c, true).expect("branch on b");
    let bar = b.barriers(&c).expect("barriers");
    assert_eq!(bar, vec![("r".to_string(), m)]);
    assert_eq!(b.count_released("c", &bar, "d-mail").expect("count"), 0);
    let row = b.find(c.tree(), "", "k-mail").expect("find").expect("row");
    assert_eq!(
        (
            row.id,
            row.state,
            row.resp_body.as_deref(),
            row.host.as_deref()
        ),
        (e, State::Completed, Some(&b"queued"[..]), Some("host-a"))
    );
    // B cannot take the key: the database's unique index says no.
    assert!(b
        .insert(&effect("r", "c", "k-mail", "d-mail"))
        .expect("insert")
        .is_none());
    let replay = b.release(e, "c", true).expect("replay");
    assert!(replay > m, "one sequence orders both hosts' rows");
    let v = b.lineage_effects("c").expect("lineage");
    assert_eq!(v.len(), 1, "{v:?}");
    assert_eq!(
        (
            v[0].state.as_str(),
            v[0].executed_by.as_str(),
            v[0].executed_on.as_deref()
        ),
        ("replayed", "vm-r", Some("host-a"))
    );
    let v = a.lineage_effects("r").expect("lineage");
    assert_eq!(v[0].replayed_to, vec!["vm-c".to_string()]);

    // Each host re-binds only its own branches.
    let on = |j: &Journal| -> Vec<String> {
        j.active_branches()
            .expect("active")
            .into_iter()
            .map(|r| r.branch)
            .collect()
    };
    assert_eq!(
        (on(&a), on(&b)),
        (vec!["r".to_string()], vec!["c".to_string()])
    );

    // A is sending something; B's gateway (re)starts: A's is not in doubt.
    let s = a
        .insert(&effect("r", "r", "k-charge", "d-charge"))
        .expect("insert")
        .expect("new");
    let t = b
        .insert(&effect("r", "c", "k-b", "d-b"))
        .expect("insert")
        .expect("new");
    drop(b);
    let mut b = Journal::connect(&meta, "host-b").expect("host b again");
    assert_eq!(b.mark_in_doubt().expect("mark"), 1, "only B's own");
    assert_eq!(b.get(t).expect("get").expect("row").state, State::InDoubt);
    assert_eq!(a.get(s).expect("get").expect("row").state, State::Sent);
    a.complete(s, 200, b"", b"ok").expect("complete");
    // A's gateway restarting finds nothing of its own in flight.
    drop(a);
    let mut a = Journal::connect(&meta, "host-a").expect("host a again");
    assert_eq!(a.mark_in_doubt().expect("mark"), 0);
    assert_eq!(a.get(s).expect("get").expect("row").state, State::Completed);
}

/// Hosts that open a new database at once: one migrates, the others wait
/// for it (the advisory lock) and find the schema there.
#[test]
fn test_hosts_opening_together_migrate_once() {
    let meta = Meta::Postgres(pg::fresh_db("together"));
    let opened: Vec<Result<i64, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|i| {
                let meta = &meta;
                s.spawn(move || {
                    let j =
                        Journal::connect(meta, &format!("host-{i}")).map_err(|e| e.to_string())?;
                    j.schema_version().map_err(|e| e.to_string())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("panicked".into())))
            .collect()
    });
    for o in opened {
        assert_eq!(o, Ok(SCHEMA_VERSION));
    }
}

#[test]
fn test_postgres_needs_a_host_id() {
    let meta = Meta::Postgres(pg::fresh_db("nohost"));
    let err = Journal::connect(&meta, "").err().map(|e| e.to_string());
    assert!(
        err.as_deref().is_some_and(|e| e.contains("host")),
        "{err:?}"
    );
}

/// A connection the database cut (a restart, a failover) fails what it
/// was running; the journal connects again for the next call.
#[test]
fn test_postgres_connects_again_after_a_cut() {
    let url = pg::fresh_db("cut");
    let meta = Meta::Postgres(url.clone());
    let mut j = Journal::connect(&meta, "host-1").expect("open");
    j.put_branch(&reg("r", vec![]), true).expect("branch");
    let mut admin = postgres::Client::connect(&url, postgres::NoTls).expect("admin");
    let cut: i64 = admin
        .query_one(
            "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .expect("terminate")
        .get(0);
    assert_eq!(cut, 1);
    // The first call may see the cut; the next one works.
    let _ = j.counts();
    assert!(j.branch("r").expect("again").is_some());
    assert!(j
        .insert(&effect("r", "r", "k", "d"))
        .expect("insert")
        .is_some());
}

/// A host whose gateway stops beating while it was sending: after the
/// silence, another host takes the effect as in doubt (nobody will record
/// its outcome); before it, or for a live host, nothing changes.
#[test]
fn test_a_gone_hosts_effect_becomes_in_doubt() {
    let url = pg::fresh_db("gone");
    let meta = Meta::Postgres(url.clone());
    let mut a = Journal::connect(&meta, "host-a").expect("host a");
    let mut b = Journal::connect(&meta, "host-b").expect("host b");
    a.heartbeat().expect("beat");
    b.heartbeat().expect("beat");
    let s = a
        .insert(&effect("r", "r", "k", "d"))
        .expect("insert")
        .expect("new");
    let row = b.get(s).expect("get").expect("row");
    let minute = std::time::Duration::from_secs(60);
    assert!(!b.doubt_if_host_gone(&row, minute).expect("alive"));
    assert!(
        !a.doubt_if_host_gone(&row, minute).expect("own"),
        "never its own"
    );
    assert_eq!(b.get(s).expect("get").expect("row").state, State::Sent);
    // A's last heartbeat was two minutes ago.
    let mut admin = postgres::Client::connect(&url, postgres::NoTls).expect("admin");
    admin
        .execute(
            "UPDATE effects_hosts SET seen_ms = seen_ms - 120000 WHERE host = 'host-a'",
            &[],
        )
        .expect("age");
    assert!(b.doubt_if_host_gone(&row, minute).expect("gone"));
    let row = b.get(s).expect("get").expect("row");
    assert_eq!(row.state, State::InDoubt);
    assert!(
        row.error.as_deref().unwrap_or("").contains("host-a"),
        "{:?}",
        row.error
    );
    assert!(!b.doubt_if_host_gone(&row, minute).expect("once"));
    // A beats again: back among the living.
    a.heartbeat().expect("beat");
    let t = a
        .insert(&effect("r", "r", "k2", "d"))
        .expect("insert")
        .expect("new");
    let row = b.get(t).expect("get").expect("row");
    assert!(!b.doubt_if_host_gone(&row, minute).expect("alive"));
}
