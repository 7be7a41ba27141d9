//! Test rig: the real gateway as a process (so kill -9 is real), a real
//! HTTP server that counts what reaches it, and clients that talk to the
//! per-branch sockets exactly as the VMM does (a Unix connection to
//! `vms/NAME/vsock.sock_3128` carrying the guest's bytes).

#![allow(dead_code)]

pub mod pg;

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use effects::control::{self, Request};
use effects::{Effects, MomentKind, Paths, Registration, Step};
use http_body_util::{BodyExt, Full};

pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "tine-fx-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("temp dir");
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One request as the destination saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub body: Vec<u8>,
    pub key: Option<String>,
}

/// A real HTTP server on 127.0.0.1 (hyper, in its own thread). Paths:
/// `/slow?ms=N` answers after N ms, `/big?bytes=N` answers N bytes, any
/// other path answers `PATH #n` (n counts requests to that path).
pub struct Server {
    pub port: u16,
    pub seen: Arc<Mutex<Vec<Seen>>>,
}

impl Server {
    pub fn start() -> Self {
        Server::start_on(None)
    }

    /// The same server behind TLS (`acceptor`'s certificate).
    pub fn start_tls(acceptor: tokio_rustls::TlsAcceptor) -> Self {
        Server::start_on(Some(acceptor))
    }

    fn start_on(tls: Option<tokio_rustls::TlsAcceptor>) -> Self {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.set_nonblocking(true).expect("nonblocking");
        let port = l.local_addr().expect("addr").port();
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let s2 = seen.clone();
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let l = tokio::net::TcpListener::from_std(l).expect("listener");
                loop {
                    let Ok((s, _)) = l.accept().await else {
                        continue;
                    };
                    let seen = s2.clone();
                    let tls = tls.clone();
                    tokio::spawn(async move {
                        let svc = hyper::service::service_fn(move |req| {
                            let seen = seen.clone();
                            async move { Ok::<_, Infallible>(answer(seen, req).await) }
                        });
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
        Server { port, seen }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Requests to paths starting with `prefix`.
    pub fn count(&self, prefix: &str) -> usize {
        self.seen
            .lock()
            .expect("seen")
            .iter()
            .filter(|s| s.path.starts_with(prefix))
            .count()
    }

    /// Waits until `n` requests to `prefix` arrived.
    pub fn wait_count(&self, prefix: &str, n: usize, limit: Duration) {
        let t0 = Instant::now();
        while self.count(prefix) < n {
            assert!(
                t0.elapsed() < limit,
                "the server saw {} requests to {prefix}, not {n}",
                self.count(prefix)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

async fn answer(
    seen: Arc<Mutex<Vec<Seen>>>,
    req: hyper::Request<hyper::body::Incoming>,
) -> hyper::Response<Full<Bytes>> {
    let method = req.method().to_string();
    let path = req.uri().path().to_string();
    let query: HashMap<String, String> = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes().to_vec())
        .unwrap_or_default();
    let n = {
        let mut s = seen.lock().expect("seen");
        s.push(Seen {
            method,
            path: path.clone(),
            body,
            key,
        });
        s.iter().filter(|x| x.path == path).count()
    };
    if let Some(ms) = query.get("ms").and_then(|m| m.parse().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let body = match query.get("bytes").and_then(|b| b.parse::<usize>().ok()) {
        Some(len) => Bytes::from(vec![b'x'; len]),
        None => Bytes::from(format!("{path} #{n}")),
    };
    let mut r = hyper::Response::new(Full::new(body));
    *r.status_mut() = hyper::StatusCode::CREATED;
    r.headers_mut()
        .insert("x-order", hyper::header::HeaderValue::from(n));
    r
}

/// What the tests' gateways may reach on the host: the test servers, on
/// 127.0.0.1 (the knob a host sets explicitly; unset, loopback is refused).
pub const TEST_ALLOW_PRIVATE: &str = "127.0.0.1";

/// A gateway process over a temporary TINE_HOME.
pub struct Gateway {
    pub home: TempDir,
    pub paths: Paths,
    pub child: Option<Child>,
    /// `TINE_META` for the process (None: its own SQLite journal).
    pub meta: Option<String>,
    /// `TINE_GATEWAY_ALLOW_PRIVATE` for the process (None: unset, the
    /// production default). The test servers listen on 127.0.0.1.
    pub allow_private: Option<String>,
    /// `TINE_GATEWAY_EXTRA_ROOTS`: the test CA of TLS servers.
    pub extra_roots: Option<PathBuf>,
}

impl Gateway {
    pub fn start() -> Self {
        Gateway::start_meta(None)
    }

    /// A gateway whose journal is `meta` (a postgres URL: a host of a fleet).
    pub fn start_meta(meta: Option<&str>) -> Self {
        Gateway::start_with(meta, Some(TEST_ALLOW_PRIVATE))
    }

    /// A gateway with its journal `meta` and host setting `allow_private`.
    pub fn start_with(meta: Option<&str>, allow_private: Option<&str>) -> Self {
        let home = TempDir::new("gw");
        let paths = Paths::new(&home.0);
        let mut g = Gateway {
            home,
            paths,
            child: None,
            meta: meta.map(str::to_string),
            allow_private: allow_private.map(str::to_string),
            extra_roots: None,
        };
        g.spawn(None);
        g
    }

    /// A gateway that trusts `roots` (a PEM file) for destinations.
    pub fn start_trusting(roots: Option<&Path>) -> Self {
        let home = TempDir::new("gw");
        let paths = Paths::new(&home.0);
        let mut g = Gateway {
            home,
            paths,
            child: None,
            meta: None,
            allow_private: Some(TEST_ALLOW_PRIVATE.into()),
            extra_roots: roots.map(Path::to_path_buf),
        };
        g.spawn(None);
        g
    }

    /// (Re)starts the process, with `TINE_EFFECTS_FAULT` if given.
    pub fn spawn(&mut self, fault: Option<&str>) {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tine-gateway"));
        cmd.arg("--home")
            .arg(&self.home.0)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit());
        match fault {
            Some(f) => cmd.env(effects::gateway::FAULT_ENV, f),
            None => cmd.env_remove(effects::gateway::FAULT_ENV),
        };
        match &self.meta {
            Some(m) => cmd.env(effects::journal::META_ENV, m),
            None => cmd.env_remove(effects::journal::META_ENV),
        };
        match &self.allow_private {
            Some(a) => cmd.env(effects::egress::ALLOW_PRIVATE_ENV, a),
            None => cmd.env_remove(effects::egress::ALLOW_PRIVATE_ENV),
        };
        match &self.extra_roots {
            Some(r) => cmd.env(effects::tls::EXTRA_ROOTS_ENV, r),
            None => cmd.env_remove(effects::tls::EXTRA_ROOTS_ENV),
        };
        // Only the roots named here: no SSL_CERT_FILE of the caller's.
        cmd.env_remove("SSL_CERT_FILE").env_remove("SSL_CERT_DIR");
        // Each gateway's home is a host: its id from its own home.
        cmd.env_remove("TINE_HOST_ID");
        let child = cmd.spawn().expect("start the gateway");
        self.child = Some(child);
        let t0 = Instant::now();
        while !control::answers(&self.paths) {
            if let Some(st) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("the gateway ended at start: {st}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "gateway did not answer"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL, as a crash would.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits for the process to end on its own (an abort()).
    pub fn wait_dead(&mut self, limit: Duration) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("a running gateway");
        let t0 = Instant::now();
        loop {
            if let Some(st) = c.try_wait().expect("wait") {
                return st;
            }
            assert!(t0.elapsed() < limit, "the gateway did not end");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn call(&self, req: Request) -> control::Reply {
        control::call(&self.paths.control(), &req, Duration::from_secs(30)).expect("control call")
    }

    pub fn socket(&self, vm: &str) -> PathBuf {
        let d = self.home.0.join("vms").join(vm);
        std::fs::create_dir_all(&d).expect("vm dir");
        d.join("vsock.sock_3128")
    }

    /// Registers a root vm.
    pub fn root(&self, vm: &str, effects: Effects) -> Registration {
        let reg = Registration {
            branch: effects::random_id().expect("id"),
            vm: vm.into(),
            socket: self.socket(vm),
            lineage: vec![],
            effects,
            network: Default::default(),
            peer_uid: None,
        };
        self.call(Request::Register { reg: reg.clone() });
        reg
    }

    /// Forks `parent` into `names`, as the CLI does around the VMM's fork.
    pub fn fork(&self, parent: &Registration, names: &[&str]) -> Vec<Registration> {
        let moment = effects::random_id().expect("id");
        self.call(Request::Moment {
            branch: parent.branch.clone(),
            moment: moment.clone(),
            kind: MomentKind::Fork,
        });
        let mut lineage = parent.lineage.clone();
        lineage.push(Step {
            branch: parent.branch.clone(),
            moment: moment.clone(),
            kind: MomentKind::Fork,
        });
        let children: Vec<Registration> = names
            .iter()
            .map(|n| Registration {
                branch: effects::random_id().expect("id"),
                vm: n.to_string(),
                socket: self.socket(n),
                lineage: lineage.clone(),
                effects: parent.effects.clone(),
                network: parent.network.clone(),
                peer_uid: None,
            })
            .collect();
        self.call(Request::MomentDone {
            branch: parent.branch.clone(),
            moment,
            ok: true,
            register: children.clone(),
        });
        children
    }

    /// A moment of `parent` on this gateway whose copies `names` continue
    /// on `onto`'s host: a branch put to sleep here and woken there (a
    /// snapshot), or forked there. Both journals must be one database.
    pub fn copy_onto(
        &self,
        parent: &Registration,
        names: &[&str],
        kind: MomentKind,
        onto: &Gateway,
    ) -> Vec<Registration> {
        let moment = effects::random_id().expect("id");
        self.call(Request::Moment {
            branch: parent.branch.clone(),
            moment: moment.clone(),
            kind,
        });
        self.call(Request::MomentDone {
            branch: parent.branch.clone(),
            moment: moment.clone(),
            ok: true,
            register: vec![],
        });
        let mut lineage = parent.lineage.clone();
        lineage.push(Step {
            branch: parent.branch.clone(),
            moment,
            kind,
        });
        names
            .iter()
            .map(|n| {
                let reg = Registration {
                    branch: effects::random_id().expect("id"),
                    vm: n.to_string(),
                    socket: onto.socket(n),
                    lineage: lineage.clone(),
                    effects: parent.effects.clone(),
                    network: parent.network.clone(),
                    peer_uid: None,
                };
                onto.call(Request::Register { reg: reg.clone() });
                reg
            })
            .collect()
    }

    pub fn journal(&self) -> effects::journal::Journal {
        let meta = match &self.meta {
            Some(m) => effects::journal::Meta::Postgres(m.clone()),
            None => effects::journal::Meta::Sqlite(self.paths.journal()),
        };
        let host = self.paths.host_id().expect("host id");
        effects::journal::Journal::connect(&meta, &host).expect("journal")
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A response as the guest reads it.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Sends raw bytes on a branch's socket and reads until the gateway closes.
pub fn raw(socket: &Path, bytes: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut s = UnixStream::connect(socket)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    s.write_all(bytes)?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    Ok(out)
}

/// Parses an HTTP/1.1 response (Content-Length or to EOF).
pub fn parse(b: &[u8]) -> Option<Resp> {
    let end = b.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&b[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let body = b[end + 4..].to_vec();
    Some(Resp {
        status,
        headers,
        body,
    })
}

/// A proxy request from `reg`'s guest.
pub fn send(
    reg: &Registration,
    method: &str,
    url: &str,
    body: &str,
    extra: &[(&str, &str)],
) -> Resp {
    let mut req = format!(
        "{method} {url} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in extra {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    let out = raw(&reg.socket, req.as_bytes()).expect("proxy request");
    parse(&out).unwrap_or_else(|| panic!("no HTTP response: {:?}", String::from_utf8_lossy(&out)))
}

/// A test CA and a TLS server certificate for 127.0.0.1 signed by it: the
/// acceptor for [`Server::start_tls`] and the CA's PEM file (what the
/// gateway is told to trust).
pub fn test_tls(dir: &Path) -> (tokio_rustls::TlsAcceptor, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().expect("key");
    let mut ca = CertificateParams::default();
    ca.distinguished_name
        .push(DnType::CommonName, "tine test upstream CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_cert = ca.self_signed(&ca_key).expect("ca");
    let issuer = Issuer::new(ca, ca_key);
    let key = KeyPair::generate().expect("key");
    let leaf = CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".into()])
        .expect("params")
        .signed_by(&key, &issuer)
        .expect("leaf");
    let pem = dir.join("test-ca.pem");
    std::fs::write(&pem, ca_cert.pem()).expect("write ca");
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into());
    let config = rustls::ServerConfig::builder_with_provider(effects::tls::provider())
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(vec![leaf.der().clone(), ca_cert.der().clone()], key)
        .expect("server config");
    (tokio_rustls::TlsAcceptor::from(Arc::new(config)), pem)
}

/// An HTTPS request as a guest program makes it through `https_proxy`:
/// CONNECT host:port on the branch's socket, then TLS trusting `ca_pem`
/// (the gateway's CA), then the request. The response as read (to the
/// end), or the error that ended the exchange.
pub fn https(
    reg: &Registration,
    ca_pem: &str,
    dest: &str,
    request: &str,
) -> Result<Vec<u8>, String> {
    let mut s = UnixStream::connect(&reg.socket).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| e.to_string())?;
    s.write_all(format!("CONNECT {dest} HTTP/1.1\r\nHost: {dest}\r\n\r\n").as_bytes())
        .map_err(|e| e.to_string())?;
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match s.read(&mut b) {
            Ok(1) => head.push(b[0]),
            _ => return Err(format!("CONNECT: {:?}", String::from_utf8_lossy(&head))),
        }
    }
    if !head.starts_with(b"HTTP/1.1 200") {
        return Err(format!("CONNECT: {:?}", String::from_utf8_lossy(&head)));
    }
    let mut roots = rustls::RootCertStore::empty();
    use rustls::pki_types::pem::PemObject;
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots
            .add(c.map_err(|e| e.to_string())?)
            .map_err(|e| e.to_string())?;
    }
    let config = rustls::ClientConfig::builder_with_provider(effects::tls::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let host = dest.rsplit_once(':').map(|(h, _)| h).unwrap_or(dest);
    let name =
        rustls::pki_types::ServerName::try_from(host.to_string()).map_err(|e| e.to_string())?;
    let conn = rustls::ClientConnection::new(Arc::new(config), name).map_err(|e| e.to_string())?;
    let mut tls = rustls::StreamOwned::new(conn, s);
    tls.write_all(request.as_bytes())
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    match tls.read_to_end(&mut out) {
        Ok(_) => Ok(out),
        // A peer that closed without close_notify: what came is the answer.
        Err(_) if !out.is_empty() => Ok(out),
        Err(e) => Err(e.to_string()),
    }
}
