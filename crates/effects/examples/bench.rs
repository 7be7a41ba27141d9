//! bench/effects: what the effects gateway adds per proxied request, and
//! how many journal writes per second it commits (`bench/effects` runs
//! this; see there).
//!
//! `cargo run --release -p tine-effects --example bench -- GATEWAY_BIN [N]`

use std::convert::Infallible;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use effects::control::{self, Request};
use effects::journal::{Journal, NewEffect, State};
use effects::{Paths, Registration};
use http_body_util::{BodyExt, Full};

fn server() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.set_nonblocking(true).expect("nonblocking");
    let port = l.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let l = tokio::net::TcpListener::from_std(l).expect("listener");
            loop {
                let Ok((s, _)) = l.accept().await else {
                    continue;
                };
                let _ = s.set_nodelay(true);
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        |req: hyper::Request<hyper::body::Incoming>| async move {
                            let _ = req.into_body().collect().await;
                            Ok::<_, Infallible>(hyper::Response::new(Full::new(
                                Bytes::from_static(b"ok"),
                            )))
                        },
                    );
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                        .await;
                });
            }
        });
    });
    port
}

fn read_all(mut s: impl Read) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

fn direct(port: u16, body: &str) -> Duration {
    let t = Instant::now();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let _ = s.set_nodelay(true);
    let req = format!(
        "POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("write");
    let out = read_all(s);
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "direct: {}",
        String::from_utf8_lossy(&out)
    );
    t.elapsed()
}

fn proxied(sock: &Path, method: &str, port: u16, body: &str, key: Option<&str>) -> Duration {
    let t = Instant::now();
    let mut s = UnixStream::connect(sock).expect("connect");
    let key = key
        .map(|k| format!("Idempotency-Key: {k}\r\n"))
        .unwrap_or_default();
    let req = format!(
        "{method} http://127.0.0.1:{port}/x HTTP/1.1\r\nHost: 127.0.0.1\r\n{key}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).expect("write");
    let out = read_all(s);
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "proxied: {}",
        String::from_utf8_lossy(&out)
    );
    t.elapsed()
}

fn median_us(mut v: Vec<Duration>) -> f64 {
    v.sort();
    v[v.len() / 2].as_secs_f64() * 1e6
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let gw_bin = args.first().expect("usage: bench GATEWAY_BIN [N]");
    let n: usize = args.get(1).and_then(|x| x.parse().ok()).unwrap_or(1000);
    let home = std::env::temp_dir().join(format!("tine-bench-effects-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(home.join("vms/b")).expect("home");
    // Journal commits alone (each one fsynced: synchronous=FULL).
    let jpath = home.join("bench-journal.db");
    let mut j = Journal::open(&jpath).expect("journal");
    let commits = n.max(200);
    let t = Instant::now();
    let mut ins = Duration::ZERO;
    let mut comp = Duration::ZERO;
    for i in 0..commits / 2 {
        let t1 = Instant::now();
        let key = format!("k{i}");
        let id = j
            .insert(&NewEffect {
                tree: "t",
                scope: "",
                key: Some(&key),
                key_text: None,
                key_source: Some("header"),
                branch: "b",
                method: "POST",
                url: "http://x/",
                dest: "x:80",
                digest: Some("d"),
                policy: "once-per-tree",
                state: State::Sent,
                status: None,
                req_bytes: 2,
                error: None,
            })
            .expect("insert")
            .expect("new");
        let t2 = Instant::now();
        j.complete(id, 200, b"content-type: text/plain\r\n", b"ok")
            .expect("complete");
        ins += t2 - t1;
        comp += t2.elapsed();
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / (commits / 2) as f64;
    let (ins_us, comp_us) = (per(ins), per(comp));
    let writes_per_s = (commits / 2 * 2) as f64 / t.elapsed().as_secs_f64();
    drop(j);
    let paths = Paths::new(&home);
    let mut gw = Command::new(gw_bin)
        .arg("--home")
        .arg(&home)
        // The bench's server is on the host's loopback.
        .env(effects::egress::ALLOW_PRIVATE_ENV, "127.0.0.1")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("gateway");
    let t0 = Instant::now();
    while !control::answers(&paths) {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "gateway did not answer"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let sock = home.join("vms/b/vsock.sock_3128");
    let reg = Registration {
        branch: effects::random_id().expect("id"),
        vm: "b".into(),
        socket: sock.clone(),
        lineage: vec![],
        effects: Default::default(),
        network: Default::default(),
    };
    control::call(
        &paths.control(),
        &Request::Register { reg },
        Duration::from_secs(10),
    )
    .expect("register");
    let port = server();
    // Warm up both paths.
    for i in 0..20 {
        direct(port, &format!("warm{i}"));
        proxied(&sock, "GET", port, "", None);
    }
    let direct_v: Vec<_> = (0..n).map(|i| direct(port, &format!("d{i}"))).collect();
    // Each POST is a new effect: `sent` committed, destination, `completed`
    // committed, response, release committed.
    let effect_v: Vec<_> = (0..n)
        .map(|i| proxied(&sock, "POST", port, &format!("e{i}"), None))
        .collect();
    proxied(&sock, "POST", port, "r", Some("same"));
    let replay_v: Vec<_> = (0..n)
        .map(|_| proxied(&sock, "POST", port, "r", Some("same")))
        .collect();
    let pass_v: Vec<_> = (0..n)
        .map(|_| proxied(&sock, "GET", port, "", None))
        .collect();
    let _ = gw.kill();
    let _ = gw.wait();

    let _ = std::fs::remove_dir_all(&home);

    let (d, e, r, p) = (
        median_us(direct_v),
        median_us(effect_v),
        median_us(replay_v),
        median_us(pass_v),
    );
    println!("effects gateway, {n} small requests each, sequential, host-side (new connection per request):");
    println!("  direct to the server (TCP):           median {d:8.0} us");
    println!(
        "  POST via the gateway, executed:       median {e:8.0} us  ({:.1}x direct, +{:.0} us)",
        e / d,
        e - d
    );
    println!(
        "  POST via the gateway, replayed:       median {r:8.0} us  ({:.1}x direct)",
        r / d
    );
    println!(
        "  GET via the gateway, passed through:  median {p:8.0} us  ({:.1}x direct, +{:.0} us)",
        p / d,
        p - d
    );
    println!("  journal commits (fsync each):         {writes_per_s:8.0} per second (insert {ins_us:.0} us, complete {comp_us:.0} us)");
    println!(
        "direct_us_p50={d:.0} effect_us_p50={e:.0} effect_added_us_p50={:.0} effect_ratio={:.2} replay_us_p50={r:.0} pass_us_p50={p:.0} pass_added_us_p50={:.0} journal_writes_per_s={writes_per_s:.0} n={n}",
        e - d,
        e / d,
        p - d
    );
}
