//! HTTPS effects (`effects.https = "intercept"`): a real TLS server with
//! its own test CA (the gateway is told to trust it), a real TLS client
//! that trusts the gateway's CA, as a guest program through `https_proxy`.

mod common;

use std::time::Duration;

use common::{https, parse, test_tls, Gateway, Server, TempDir};
use effects::{Effects, Https, Registration};

fn intercepting() -> Effects {
    Effects {
        https: Https::Intercept,
        ..Effects::default()
    }
}

fn post(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// A POST to an HTTPS payment API in flight at a fork: parent and children
/// retry over HTTPS and all get the one response; the server saw it once;
/// the journal has it under its https:// URL.
#[test]
fn test_https_post_in_flight_at_fork_reaches_the_server_once() {
    let dir = TempDir::new("tls");
    let (acceptor, test_ca) = test_tls(&dir.0);
    let srv = Server::start_tls(acceptor);
    let gw = Gateway::start_trusting(Some(&test_ca));
    // What the host puts in the wake message (made here if none yet).
    let ca = effects::tls::ca_cert_pem(&gw.paths).expect("gateway CA");
    let p = gw.root("p", intercepting());
    let dest = format!("127.0.0.1:{}", srv.port);
    let first = {
        let (p, ca, dest) = (p.clone(), ca.clone(), dest.clone());
        std::thread::spawn(move || https(&p, &ca, &dest, &post("/charge?ms=1500", "9.99")))
    };
    srv.wait_count("/charge", 1, Duration::from_secs(10));
    let kids = gw.fork(&p, &["c1", "c2", "c3"]);
    let cut = first.join().expect("thread");
    assert!(
        cut.as_ref().map_or(true, |b| parse(b).is_none()),
        "the parent's cut connection got a response: {cut:?}"
    );
    let all: Vec<Registration> = std::iter::once(p.clone()).chain(kids).collect();
    let handles: Vec<_> = all
        .iter()
        .cloned()
        .map(|r| {
            let (ca, dest) = (ca.clone(), dest.clone());
            std::thread::spawn(move || https(&r, &ca, &dest, &post("/charge?ms=1500", "9.99")))
        })
        .collect();
    for (h, reg) in handles.into_iter().zip(&all) {
        let out = h.join().expect("thread").expect("https");
        let r = parse(&out).expect("a response");
        assert_eq!(r.status, 201, "{}: {r:?}", reg.vm);
        assert_eq!(r.text(), "/charge #1", "{}", reg.vm);
        let fx = r.header("x-tine-effect").unwrap_or("");
        assert!(
            fx.starts_with("replayed;") && fx.contains("from=p"),
            "{}: {fx}",
            reg.vm
        );
    }
    assert_eq!(srv.count("/charge"), 1, "the payment API saw the POST once");
    // Releases are recorded once each connection ended (the TLS close
    // taken by the client), just after the responses were read.
    let t0 = std::time::Instant::now();
    let list = loop {
        let list = gw.journal().lineage_effects(&all[2].branch).expect("list");
        if list.first().is_some_and(|e| e.replayed_to.len() == 4) || t0.elapsed().as_secs() > 5 {
            break list;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0].url, format!("https://{dest}/charge?ms=1500"));
    assert_eq!(list[0].state, "replayed");
    assert_eq!(
        list[0].replayed_to.len(),
        4,
        "released to all four: {list:?}"
    );
    // A GET passes (journaled, never replayed); a second identical POST
    // is a second effect, as over plain HTTP.
    let get = format!("GET /page HTTP/1.1\r\nHost: {dest}\r\n\r\n");
    for _ in 0..2 {
        let r = parse(&https(&p, &ca, &dest, &get).expect("get")).expect("resp");
        assert_eq!(r.header("x-tine-effect"), Some("passed"));
    }
    assert_eq!(srv.count("/page"), 2);
    let r = parse(&https(&p, &ca, &dest, &post("/charge?ms=1", "9.99")).expect("post")).expect("r");
    assert_eq!(r.text(), "/charge #2");
}

/// A destination whose certificate the host does not trust is never sent
/// the request: the guest gets 502 saying so, and a retry is not an
/// effect that was made.
#[test]
fn test_https_upstream_that_does_not_verify_is_refused() {
    let dir = TempDir::new("tls");
    let (acceptor, _test_ca) = test_tls(&dir.0);
    let srv = Server::start_tls(acceptor);
    // The gateway trusts only an unrelated CA: the server's does not verify.
    let other = TempDir::new("tls-other");
    let (_, unrelated) = test_tls(&other.0);
    let gw = Gateway::start_trusting(Some(&unrelated));
    let ca = effects::tls::ca_cert_pem(&gw.paths).expect("gateway CA");
    let p = gw.root("p", intercepting());
    let dest = format!("127.0.0.1:{}", srv.port);
    let out = https(&p, &ca, &dest, &post("/charge", "1")).expect("https");
    let r = parse(&out).expect("a response");
    assert_eq!(r.status, 502, "{r:?}");
    let t = r.text();
    assert!(
        t.contains("certificate") && t.contains("nothing was sent"),
        "the error says why: {t}"
    );
    assert_eq!(srv.count("/"), 0, "nothing reached the server");
    let list = gw.journal().lineage_effects(&p.branch).expect("list");
    assert!(list.is_empty(), "no effect was made: {list:?}");
}

/// The guest's TLS ends at the gateway only with a certificate of the
/// gateway's CA: a client that trusts only the real server's CA refuses
/// it (interception is visible, never silent).
#[test]
fn test_a_client_without_the_gateway_ca_refuses_the_interception() {
    let dir = TempDir::new("tls");
    let (acceptor, test_ca) = test_tls(&dir.0);
    let srv = Server::start_tls(acceptor);
    let gw = Gateway::start_trusting(Some(&test_ca));
    let p = gw.root("p", intercepting());
    let dest = format!("127.0.0.1:{}", srv.port);
    let real = std::fs::read_to_string(&test_ca).expect("ca");
    let e = https(&p, &real, &dest, &post("/charge", "1")).expect_err("refused");
    assert!(e.to_lowercase().contains("certificate"), "{e}");
    assert_eq!(srv.count("/"), 0);
}
