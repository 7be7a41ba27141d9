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

fn server(tls: Option<tokio_rustls::TlsAcceptor>) -> u16 {
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
                let tls = tls.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(
                        |req: hyper::Request<hyper::body::Incoming>| async move {
                            let _ = req.into_body().collect().await;
                            Ok::<_, Infallible>(hyper::Response::new(Full::new(
                                Bytes::from_static(b"ok"),
                            )))
                        },
                    );
                    let b = hyper::server::conn::http1::Builder::new();
                    let _ = match tls {
                        None => {
                            b.serve_connection(hyper_util::rt::TokioIo::new(s), svc)
                                .await
                        }
                        Some(a) => match a.accept(s).await {
                            Ok(t) => {
                                b.serve_connection(hyper_util::rt::TokioIo::new(t), svc)
                                    .await
                            }
                            Err(_) => Ok(()),
                        },
                    };
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

/// A test CA (its PEM in `ca_file`) and a server certificate for
/// 127.0.0.1 signed by it.
fn test_tls(ca_file: &Path) -> tokio_rustls::TlsAcceptor {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("key");
    let mut ca = CertificateParams::default();
    ca.distinguished_name
        .push(DnType::CommonName, "bench upstream CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).expect("ca");
    std::fs::write(ca_file, ca_cert.pem()).expect("ca file");
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().expect("key");
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string()])
        .expect("params")
        .signed_by(&key, &issuer)
        .expect("leaf");
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
    let c = rustls::ServerConfig::builder_with_provider(effects::tls::provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(vec![leaf.der().clone(), ca_cert.der().clone()], key)
        .expect("config");
    tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(c))
}

/// A client trusting the CA in `pem` (one per run, as one program's).
fn client(pem: &str) -> std::sync::Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes()) {
        roots.add(c.expect("pem")).expect("root");
    }
    std::sync::Arc::new(
        rustls::ClientConfig::builder_with_provider(effects::tls::provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// One HTTPS POST over `s` (TLS to 127.0.0.1 with `config`).
fn tls_post<S: Read + Write>(
    s: S,
    config: &std::sync::Arc<rustls::ClientConfig>,
    body: &str,
    key: Option<&str>,
) {
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name");
    let conn = rustls::ClientConnection::new(config.clone(), name).expect("tls");
    let mut tls = rustls::StreamOwned::new(conn, s);
    let key = key
        .map(|k| format!("Idempotency-Key: {k}\r\n"))
        .unwrap_or_default();
    let req = format!(
        "POST /x HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n{key}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(req.as_bytes()).expect("write");
    let out = read_all(&mut tls);
    assert!(
        out.starts_with(b"HTTP/1.1 200"),
        "https: {}",
        String::from_utf8_lossy(&out)
    );
}

fn https_direct(port: u16, config: &std::sync::Arc<rustls::ClientConfig>) -> Duration {
    let t = Instant::now();
    let s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let _ = s.set_nodelay(true);
    tls_post(s, config, "pay", None);
    t.elapsed()
}

/// CONNECT through the gateway, then HTTPS to its interception.
fn https_proxied(
    sock: &Path,
    port: u16,
    config: &std::sync::Arc<rustls::ClientConfig>,
    body: &str,
    key: Option<&str>,
) -> Duration {
    let t = Instant::now();
    let mut s = UnixStream::connect(sock).expect("connect");
    s.write_all(
        format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n").as_bytes(),
    )
    .expect("write");
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        assert_eq!(s.read(&mut b).expect("read"), 1, "CONNECT answer cut");
        head.push(b[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&head)
    );
    tls_post(s, config, body, key);
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
    std::fs::create_dir_all(home.join("vms/h")).expect("home");
    let upstream_ca = home.join("upstream-ca.pem");
    let acceptor = test_tls(&upstream_ca);
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
        // The bench's servers are on the host's loopback, with a test CA.
        .env(effects::egress::ALLOW_PRIVATE_ENV, "127.0.0.1")
        .env(effects::tls::EXTRA_ROOTS_ENV, &upstream_ca)
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
        peer_uid: None,
    };
    control::call(
        &paths.control(),
        &Request::Register { reg },
        Duration::from_secs(10),
    )
    .expect("register");
    let port = server(None);
    let tls_port = server(Some(acceptor));
    let hsock = home.join("vms/h/vsock.sock_3128");
    let reg = Registration {
        branch: effects::random_id().expect("id"),
        vm: "h".into(),
        socket: hsock.clone(),
        lineage: vec![],
        effects: effects::Effects {
            https: effects::Https::Intercept,
            ..Default::default()
        },
        network: Default::default(),
        peer_uid: None,
    };
    control::call(
        &paths.control(),
        &Request::Register { reg },
        Duration::from_secs(10),
    )
    .expect("register");
    let upstream = client(&std::fs::read_to_string(&upstream_ca).expect("ca"));
    let via_gateway = client(&effects::tls::ca_cert_pem(&paths).expect("gateway ca"));
    for _ in 0..20 {
        https_direct(tls_port, &upstream);
        https_proxied(&hsock, tls_port, &via_gateway, "warm", Some("warm"));
    }
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
    let https_direct_v: Vec<_> = (0..n).map(|_| https_direct(tls_port, &upstream)).collect();
    let https_effect_v: Vec<_> = (0..n)
        .map(|i| https_proxied(&hsock, tls_port, &via_gateway, &format!("h{i}"), None))
        .collect();
    https_proxied(&hsock, tls_port, &via_gateway, "r", Some("same"));
    let https_replay_v: Vec<_> = (0..n)
        .map(|_| https_proxied(&hsock, tls_port, &via_gateway, "r", Some("same")))
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
    let (hd, he, hr) = (
        median_us(https_direct_v),
        median_us(https_effect_v),
        median_us(https_replay_v),
    );
    println!("  HTTPS direct to the server (TLS):     median {hd:8.0} us");
    println!(
        "  HTTPS POST via the gateway (intercepted), executed: median {he:8.0} us  (+{:.0} us over plain HTTP via the gateway)",
        he - e
    );
    println!(
        "  HTTPS POST via the gateway (intercepted), replayed: median {hr:8.0} us  (+{:.0} us over plain HTTP replayed)",
        hr - r
    );
    println!("  journal commits (fsync each):         {writes_per_s:8.0} per second (insert {ins_us:.0} us, complete {comp_us:.0} us)");
    println!(
        "direct_us_p50={d:.0} effect_us_p50={e:.0} effect_added_us_p50={:.0} effect_ratio={:.2} replay_us_p50={r:.0} pass_us_p50={p:.0} pass_added_us_p50={:.0} https_direct_us_p50={hd:.0} https_effect_us_p50={he:.0} https_added_us_p50={:.0} https_replay_us_p50={hr:.0} journal_writes_per_s={writes_per_s:.0} n={n}",
        e - d,
        e / d,
        p - d,
        he - e
    );
}
