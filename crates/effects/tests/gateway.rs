//! The effects gateway against a real HTTP server, with branches made the
//! way the CLI makes them (issue 7's test list).

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{parse, raw, send, Gateway, Server};
use effects::control::Request;
use effects::{EffectPolicy, Effects, MomentKind};

fn policy(pairs: &[(&str, EffectPolicy)], max: u64) -> Effects {
    Effects {
        max_response_bytes: max,
        destinations: pairs
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect::<BTreeMap<_, _>>(),
        ..Effects::default()
    }
}

/// A POST in flight when the parent is forked: the parent's connection is
/// cut (its VMM process is gone), parent and 5 children retry; the server
/// sees one request and every branch gets its response.
#[test]
fn test_in_flight_at_fork_reaches_the_server_once() {
    let srv = Server::start();
    let gw = Gateway::start();
    let p = gw.root("p", Effects::default());
    let url = srv.url("/order?ms=1500");
    let first = {
        let p = p.clone();
        let url = url.clone();
        std::thread::spawn(move || {
            let req = format!(
                "POST {url} HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\npizza"
            );
            raw(&p.socket, req.as_bytes())
        })
    };
    srv.wait_count("/order", 1, Duration::from_secs(10));
    let children = gw.fork(&p, &["c1", "c2", "c3", "c4", "c5"]);
    // The cut connection gets no response.
    let cut = first.join().expect("thread").unwrap_or_default();
    assert!(
        parse(&cut).is_none(),
        "the parent's old connection got a response: {:?}",
        String::from_utf8_lossy(&cut)
    );
    let all: Vec<_> = std::iter::once(p.clone()).chain(children).collect();
    let handles: Vec<_> = all
        .iter()
        .cloned()
        .map(|r| {
            let url = url.clone();
            std::thread::spawn(move || {
                send(&r, "POST", &url, "pizza", &[("Content-Type", "text/plain")])
            })
        })
        .collect();
    let resps: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().expect("thread"))
        .collect();
    for (r, reg) in resps.iter().zip(&all) {
        assert_eq!(r.status, 201, "{}: {r:?}", reg.vm);
        assert_eq!(r.text(), "/order #1", "{}", reg.vm);
        let fx = r.header("x-tine-effect").unwrap_or("");
        assert!(
            fx.starts_with("replayed;") && fx.contains("from=p"),
            "{}: {fx}",
            reg.vm
        );
    }
    assert_eq!(srv.count("/order"), 1, "the destination saw the POST once");
    // Releases are recorded once the connection ended (just after the
    // guest read its end).
    let t0 = std::time::Instant::now();
    let list = loop {
        let list = gw.journal().lineage_effects(&all[3].branch).expect("list");
        if list.first().is_some_and(|e| e.replayed_to.len() == 6) || t0.elapsed().as_secs() > 5 {
            break list;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0].state, "replayed");
    assert_eq!(list[0].executed_by, "p");
    assert_eq!(list[0].key_source.as_deref(), Some("derived"));
    assert_eq!(list[0].replayed_to.len(), 6, "{:?}", list[0].replayed_to);
}

/// A POST completed before the fork: children that repeat it get the
/// recorded response (Idempotency-Key), and so do children of a moment
/// taken before the parent made it (derived key).
#[test]
fn test_completed_before_fork_is_replayed() {
    let srv = Server::start();
    let gw = Gateway::start();
    let p = gw.root("p", Effects::default());
    let url = srv.url("/charge");
    let r = send(&p, "POST", &url, "9.99", &[("Idempotency-Key", "charge-1")]);
    assert_eq!((r.status, r.text().as_str()), (201, "/charge #1"));
    assert!(r
        .header("x-tine-effect")
        .unwrap_or("")
        .starts_with("executed;"));
    let kids = gw.fork(&p, &["a", "b", "c"]);
    for k in &kids {
        let r = send(k, "POST", &url, "9.99", &[("Idempotency-Key", "charge-1")]);
        assert_eq!(
            (r.status, r.text().as_str()),
            (201, "/charge #1"),
            "{}",
            k.vm
        );
        assert_eq!(r.header("x-order"), Some("1"));
        assert!(r.header("x-tine-effect").unwrap_or("").contains("from=p"));
    }
    assert_eq!(srv.count("/charge"), 1);

    // Derived keys: the moment first, then the parent sends; a child that
    // sends the same request from that moment gets the parent's response.
    let q = gw.root("q", Effects::default());
    let kids = gw.fork(&q, &["q1", "q2"]);
    let url = srv.url("/mail");
    let r = send(&q, "POST", &url, "hello", &[]);
    assert_eq!(r.text(), "/mail #1");
    for k in &kids {
        let r = send(k, "POST", &url, "hello", &[]);
        assert_eq!(r.text(), "/mail #1", "{}", k.vm);
        assert!(r
            .header("x-tine-effect")
            .unwrap_or("")
            .starts_with("replayed;"));
    }
    assert_eq!(srv.count("/mail"), 1);
    // The same request again is a new effect (a loop sends twice).
    let r = send(&q, "POST", &url, "hello", &[]);
    assert_eq!(r.text(), "/mail #2");
    let r = send(&kids[0], "POST", &url, "hello", &[]);
    assert_eq!(
        r.text(),
        "/mail #2",
        "the child's second is the tree's second"
    );
    assert_eq!(srv.count("/mail"), 2);
}

#[test]
fn test_per_branch_and_deny_in_children() {
    let srv = Server::start();
    let gw = Gateway::start();
    let dest = format!("127.0.0.1:{}", srv.port);
    let p = gw.root("p", policy(&[(&dest, EffectPolicy::PerBranch)], 1 << 20));
    let r = send(&p, "POST", &srv.url("/a"), "", &[("Idempotency-Key", "ka")]);
    assert_eq!(r.text(), "/a #1");
    let kids = gw.fork(&p, &["k1", "k2", "k3"]);
    for k in &kids {
        // The parent's, before the fork point: replayed.
        let r = send(k, "POST", &srv.url("/a"), "", &[("Idempotency-Key", "ka")]);
        assert_eq!(r.text(), "/a #1", "{}", k.vm);
        // Its own: executed once per branch, then replayed to its retry.
        let r1 = send(k, "POST", &srv.url("/b"), "", &[("Idempotency-Key", "kb")]);
        let r2 = send(k, "POST", &srv.url("/b"), "", &[("Idempotency-Key", "kb")]);
        assert_eq!(r1.text(), r2.text(), "{}", k.vm);
        assert!(r2
            .header("x-tine-effect")
            .unwrap_or("")
            .starts_with("replayed;"));
    }
    assert_eq!(srv.count("/a"), 1);
    assert_eq!(
        srv.count("/b"),
        3,
        "each child's request reached the server once"
    );
    let r = send(&p, "POST", &srv.url("/b"), "", &[("Idempotency-Key", "kb")]);
    assert!(r
        .header("x-tine-effect")
        .unwrap_or("")
        .starts_with("executed;"));
    assert_eq!(srv.count("/b"), 4, "the parent's own after the fork");

    // deny-in-children: the root may, children get a clear refusal.
    let d = gw.root(
        "d",
        policy(&[(&dest, EffectPolicy::DenyInChildren)], 1 << 20),
    );
    let r = send(&d, "POST", &srv.url("/pay"), "1", &[]);
    assert_eq!(r.status, 201);
    let kids = gw.fork(&d, &["d1", "d2"]);
    for k in &kids {
        for method in ["POST", "GET"] {
            let r = send(k, method, &srv.url("/pay"), "", &[]);
            assert_eq!(r.status, 403, "{method} {}", k.vm);
            let t = r.text();
            assert!(t.contains("deny-in-children") && t.contains(&dest), "{t}");
        }
        let out = raw(
            &k.socket,
            format!("CONNECT {dest} HTTP/1.1\r\nHost: {dest}\r\n\r\n").as_bytes(),
        )
        .expect("connect");
        assert_eq!(parse(&out).map(|r| r.status), Some(403));
    }
    assert_eq!(srv.count("/pay"), 1);
    let list = gw.journal().lineage_effects(&kids[0].branch).expect("list");
    let refused = list.iter().filter(|e| e.state == "refused").count();
    assert_eq!(refused, 3, "{list:?}");
}

/// kill -9 (abort) between the destination's response and the journal
/// write: after a restart the effect is in doubt and a retry is not sent.
#[test]
fn test_crash_before_journal_leaves_it_in_doubt() {
    let srv = Server::start();
    let mut gw = Gateway::start();
    gw.kill9();
    gw.spawn(Some("after-response-before-journal"));
    let p = gw.root("p", Effects::default());
    let url = srv.url("/transfer");
    let out = raw(
        &p.socket,
        format!("POST {url} HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n100").as_bytes(),
    )
    .unwrap_or_default();
    assert!(parse(&out).is_none(), "no response may be released");
    let st = gw.wait_dead(Duration::from_secs(10));
    assert!(!st.success(), "{st}");
    assert_eq!(srv.count("/transfer"), 1);
    gw.spawn(None);
    // The registration survived the restart; the retry is not sent.
    for _ in 0..2 {
        let r = send(&p, "POST", &url, "100", &[]);
        if r.status != 409 {
            let after = gw.journal().lineage_effects(&p.branch).expect("list");
            panic!("{r:?} {after:#?}");
        }
        let t = r.text();
        assert!(
            t.contains("in doubt") && t.contains("tine effects resolve p"),
            "{t}"
        );
    }
    assert_eq!(srv.count("/transfer"), 1, "nothing re-sent silently");
    let list = gw.journal().lineage_effects(&p.branch).expect("list");
    assert_eq!(list.len(), 1);
    assert_eq!(list[0].state, "in-doubt");
    let key = list[0].key.clone().expect("key");
    // A human decides: send it again.
    let mut j = gw.journal();
    assert!(j.resolve(p.tree(), &key, true).expect("resolve").is_some());
    let r = send(&p, "POST", &url, "100", &[]);
    assert_eq!((r.status, r.text().as_str()), (201, "/transfer #2"));
    // Or: treat it as failed.
    gw.kill9();
    gw.spawn(Some("after-response-before-journal"));
    let _ = raw(
        &p.socket,
        format!("POST {url} HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx").as_bytes(),
    );
    gw.wait_dead(Duration::from_secs(10));
    gw.spawn(None);
    let list = gw.journal().lineage_effects(&p.branch).expect("list");
    let doubt = list
        .iter()
        .find(|e| e.state == "in-doubt")
        .expect("in doubt");
    j.resolve(p.tree(), doubt.key.as_deref().expect("key"), false)
        .expect("resolve");
    let r = send(&p, "POST", &url, "x", &[]);
    assert_eq!(r.status, 502);
    assert!(r.text().contains("resolved as failed"), "{}", r.text());
    assert_eq!(srv.count("/transfer"), 3);
}

#[test]
fn test_bad_input_gets_clear_errors_and_one_row() {
    let srv = Server::start();
    let gw = Gateway::start();
    let p = gw.root("p", policy(&[], 1024));
    let s = &p.socket;
    let status = |bytes: &[u8]| parse(&raw(s, bytes).expect("raw")).map(|r| (r.status, r.text()));
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("garbage", b"NOT HTTP AT ALL\r\n\r\n".to_vec(), 400, ""),
        ("binary", vec![0u8, 1, 2, 255, 13, 10, 13, 10], 400, ""),
        (
            "origin-form",
            b"GET / HTTP/1.1\r\nHost: example\r\n\r\n".to_vec(),
            400,
            "absolute URLs",
        ),
        (
            "https absolute-form",
            b"GET https://example/ HTTP/1.1\r\nHost: example\r\n\r\n".to_vec(),
            400,
            "CONNECT",
        ),
        (
            "bad content-length",
            format!(
                "POST {} HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
                srv.url("/x")
            )
            .into_bytes(),
            400,
            "",
        ),
        (
            "bad idempotency key",
            format!(
                "POST {} HTTP/1.1\r\nIdempotency-Key: {}\r\nContent-Length: 0\r\n\r\n",
                srv.url("/x"),
                "k".repeat(300)
            )
            .into_bytes(),
            400,
            "Idempotency-Key",
        ),
        (
            "CONNECT without port",
            b"CONNECT example HTTP/1.1\r\nHost: example\r\n\r\n".to_vec(),
            400,
            "",
        ),
    ];
    for (what, bytes, want, needle) in cases {
        let (st, t) = status(&bytes).unwrap_or_else(|| panic!("{what}: no response"));
        assert_eq!(st, want, "{what}: {t}");
        assert!(t.contains(needle), "{what}: {t}");
    }
    // A body cut short: the guest closes its sending side early.
    {
        use std::io::{Read, Write};
        let mut c = std::os::unix::net::UnixStream::connect(s).expect("connect");
        let req = format!(
            "POST {} HTTP/1.1\r\nContent-Length: 100\r\n\r\nonly ten!!",
            srv.url("/x")
        );
        c.write_all(req.as_bytes()).expect("write");
        c.shutdown(std::net::Shutdown::Write).expect("shutdown");
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        if let Some(r) = parse(&out) {
            assert_eq!(r.status, 400, "{r:?}");
        }
    }
    assert_eq!(srv.count("/x"), 0, "nothing malformed reached the server");
    // A client that ends its sending side after a whole request (nc does)
    // still gets its response.
    {
        use std::io::{Read, Write};
        let mut c = std::os::unix::net::UnixStream::connect(s).expect("connect");
        let req = format!(
            "POST {} HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi",
            srv.url("/half")
        );
        c.write_all(req.as_bytes()).expect("write");
        c.shutdown(std::net::Shutdown::Write).expect("shutdown");
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        let r = parse(&out).expect("a response after a half-close");
        assert_eq!((r.status, r.text().as_str()), (201, "/half #1"));
    }
    // A header-only POST without a key: derived, executed once, journaled once.
    let r = send(&p, "POST", &srv.url("/empty"), "", &[]);
    assert_eq!(r.status, 201);
    // A response over the limit: the branch that made it gets all of it.
    let big = srv.url("/big?bytes=5000");
    let r = send(&p, "POST", &big, "", &[("Idempotency-Key", "big")]);
    assert_eq!((r.status, r.body.len()), (201, 5000));
    let kids = gw.fork(&p, &["c"]);
    let r = send(&kids[0], "POST", &big, "", &[("Idempotency-Key", "big")]);
    assert_eq!(r.status, 409, "{r:?}");
    assert!(
        r.text().contains("larger than the journal keeps"),
        "{}",
        r.text()
    );
    assert_eq!(srv.count("/big"), 1);
    // GET passes, every time, journaled, never replayed.
    for _ in 0..2 {
        let r = send(&p, "GET", &srv.url("/page"), "", &[]);
        assert_eq!(r.status, 201);
        assert_eq!(r.header("x-tine-effect"), Some("passed"));
    }
    assert_eq!(srv.count("/page"), 2);
    // A CONNECT tunnel: bytes pass through, journaled by destination.
    {
        use std::io::{Read, Write};
        let dest = format!("127.0.0.1:{}", srv.port);
        let mut c = std::os::unix::net::UnixStream::connect(s).expect("connect");
        c.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        c.write_all(format!("CONNECT {dest} HTTP/1.1\r\nHost: {dest}\r\n\r\n").as_bytes())
            .expect("write");
        let mut buf = [0u8; 1024];
        let n = c.read(&mut buf).expect("read");
        assert!(
            buf[..n].starts_with(b"HTTP/1.1 200"),
            "{:?}",
            String::from_utf8_lossy(&buf[..n])
        );
        c.write_all(b"GET /tunneled HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .expect("write");
        let mut out = Vec::new();
        let _ = c.read_to_end(&mut out);
        assert!(String::from_utf8_lossy(&out).contains("/tunneled #1"));
    }
    let st = gw.call(Request::Status).status.expect("status");
    let counts: BTreeMap<String, i64> = st.effects.into_iter().collect();
    let want: BTreeMap<String, i64> = [
        ("completed", 2),
        ("too-large", 1),
        ("passed", 2),
        ("tunnel", 1),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(
        counts, want,
        "nothing journaled twice, nothing malformed journaled"
    );
}

/// Two hosts, each with its own gateway, one PostgreSQL journal
/// (`TINE_META`): what a branch did through host 1's gateway is replayed,
/// not re-sent, for its copy woken behind host 2's; a restart of host 2's
/// gateway neither re-binds host 1's vms nor doubts host 1's effects.
#[test]
fn test_two_hosts_one_postgres_journal() {
    let db = common::pg::fresh_db("gateways");
    let srv = Server::start();
    let h1 = Gateway::start_meta(Some(&db));
    let mut h2 = Gateway::start_meta(Some(&db));

    // A keyed charge executed on host 1 before the branch sleeps; its
    // copy wakes on host 2 and retries it.
    let p = h1.root("p", Effects::default());
    let url = srv.url("/charge");
    let r = send(&p, "POST", &url, "9.99", &[("Idempotency-Key", "charge-1")]);
    assert_eq!((r.status, r.text().as_str()), (201, "/charge #1"));
    let woken = h1.copy_onto(&p, &["p-woken"], MomentKind::Snapshot, &h2);
    let r = send(
        &woken[0],
        "POST",
        &url,
        "9.99",
        &[("Idempotency-Key", "charge-1")],
    );
    assert_eq!((r.status, r.text().as_str()), (201, "/charge #1"));
    let tag = r.header("x-tine-effect").unwrap_or("").to_string();
    assert!(
        tag.starts_with("replayed;") && tag.contains("from=p"),
        "{tag}"
    );
    assert_eq!(srv.count("/charge"), 1);

    // A derived key: the moment first (the branch sleeps on host 1 while
    // its request is on its way), then the parent's request; the copy on
    // host 2 sends the same and gets the parent's response.
    let q = h1.root("q", Effects::default());
    let woken = h1.copy_onto(&q, &["q-woken"], MomentKind::Snapshot, &h2);
    let url = srv.url("/mail");
    assert_eq!(send(&q, "POST", &url, "hello", &[]).text(), "/mail #1");
    let r = send(&woken[0], "POST", &url, "hello", &[]);
    assert_eq!(r.text(), "/mail #1");
    assert!(r
        .header("x-tine-effect")
        .unwrap_or("")
        .starts_with("replayed;"));
    assert_eq!(srv.count("/mail"), 1);

    // Host 2's gateway restarts: it re-binds its own vms only, and host 1
    // goes on serving its own.
    h2.kill9();
    h2.spawn(None);
    let st = h2.call(Request::Status).status.expect("status");
    let mut vms: Vec<String> = st.branches.into_iter().map(|(vm, _)| vm).collect();
    vms.sort();
    assert_eq!(vms, vec!["p-woken".to_string(), "q-woken".to_string()]);
    assert!(st.journal.starts_with("postgres://"), "{}", st.journal);
    let r = send(&p, "POST", &srv.url("/after"), "x", &[]);
    assert_eq!((r.status, r.text().as_str()), (201, "/after #1"));
    let r = send(&woken[0], "POST", &srv.url("/after"), "y", &[]);
    assert_eq!((r.status, r.text().as_str()), (201, "/after #2"));
}

/// The shared journal's connection is cut (a database restart) while a
/// request is at its destination: the response cannot be recorded, so it
/// is not released; the effect is in doubt (recorded over a new
/// connection), never sent again, and the gateway goes on serving.
#[test]
fn test_postgres_cut_while_sending_leaves_it_in_doubt() {
    let db = common::pg::fresh_db("cut");
    let srv = Server::start();
    let gw = Gateway::start_meta(Some(&db));
    let p = gw.root("p", Effects::default());
    let url = srv.url("/slow?ms=1500");
    let guest = {
        let p = p.clone();
        let url = url.clone();
        std::thread::spawn(move || send(&p, "POST", &url, "x", &[]))
    };
    let t0 = std::time::Instant::now();
    while srv.count("/slow") == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "never sent");
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut admin = postgres::Client::connect(&db, postgres::NoTls).expect("admin");
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()",
            &[],
        )
        .expect("cut");
    let r = guest.join().expect("guest");
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.text().contains("could not record"), "{}", r.text());
    let r = send(&p, "POST", &url, "x", &[]);
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.text().contains("in doubt"), "{}", r.text());
    assert_eq!(srv.count("/slow"), 1);
    let counts: BTreeMap<String, i64> =
        gw.journal().counts().expect("counts").into_iter().collect();
    assert_eq!(counts.get("in-doubt"), Some(&1), "{counts:?}");
    let r = send(&p, "POST", &srv.url("/next"), "y", &[]);
    assert_eq!((r.status, r.text().as_str()), (201, "/next #1"));
}

/// A keyed request in flight through host 1's gateway: a copy behind host
/// 2's with the same key is told to retry (503), then gets the response
/// replayed. When host 1's gateway dies while sending, host 2 keeps
/// saying retry while host 1's heartbeat is fresh, and once it is stale
/// takes the effect as in doubt (409); the destination saw each once.
#[test]
fn test_another_hosts_effect_in_flight() {
    let db = common::pg::fresh_db("inflight");
    let srv = Server::start();
    let mut h1 = Gateway::start_meta(Some(&db));
    let h2 = Gateway::start_meta(Some(&db));
    let p = h1.root("p", Effects::default());
    let kids = h1.copy_onto(&p, &["p-2"], MomentKind::Fork, &h2);
    let url = srv.url("/slow?ms=1000");
    let wait_for = |n: usize| {
        let t0 = std::time::Instant::now();
        while srv.count("/slow") < n {
            assert!(t0.elapsed() < Duration::from_secs(10), "never sent");
            std::thread::sleep(Duration::from_millis(10));
        }
    };
    let guest = {
        let (p, url) = (p.clone(), url.clone());
        std::thread::spawn(move || send(&p, "POST", &url, "x", &[("Idempotency-Key", "k1")]))
    };
    wait_for(1);
    let r = send(&kids[0], "POST", &url, "x", &[("Idempotency-Key", "k1")]);
    assert_eq!(r.status, 503, "{}", r.text());
    assert!(r.text().contains("another host"), "{}", r.text());
    assert_eq!(guest.join().expect("guest").status, 201);
    let r = send(&kids[0], "POST", &url, "x", &[("Idempotency-Key", "k1")]);
    assert_eq!(r.status, 201, "{}", r.text());
    assert!(r
        .header("x-tine-effect")
        .unwrap_or("")
        .starts_with("replayed;"));

    // Host 1's gateway dies while sending k2.
    let url = srv.url("/slow?ms=3000");
    let p2 = p.clone();
    let url2 = url.clone();
    // Its guest's connection breaks with the gateway: not awaited.
    std::thread::spawn(move || raw(&p2.socket, post_bytes(&url2, "k2").as_bytes()));
    wait_for(2);
    h1.kill9();
    let r = send(&kids[0], "POST", &url, "x", &[("Idempotency-Key", "k2")]);
    assert_eq!(r.status, 503, "a fresh heartbeat: {}", r.text());
    let mut admin = postgres::Client::connect(&db, postgres::NoTls).expect("admin");
    admin
        .execute("UPDATE effects_hosts SET seen_ms = seen_ms - 600000", &[])
        .expect("age");
    let r = send(&kids[0], "POST", &url, "x", &[("Idempotency-Key", "k2")]);
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.text().contains("in doubt"), "{}", r.text());
    assert_eq!(srv.count("/slow"), 2);
}

fn post_bytes(url: &str, key: &str) -> String {
    format!(
        "POST {url} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx"
    )
}
