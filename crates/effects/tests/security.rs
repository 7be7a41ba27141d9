//! The gateway as an attacker would try it (issue 16): a guest must not
//! reach the host itself or what its contract denies, must not pass for
//! another branch, and the gateway must not clobber paths, leave its
//! sockets open to others, or take orders from another user.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::time::Duration;

use common::{parse, send, Gateway, Server};
use effects::control::{self, Request};
use effects::{EffectPolicy, Effects, Egress, Network, Registration};

/// A CONNECT's status line (the tunnel is closed at once).
fn connect_status(reg: &Registration, dest: &str) -> u16 {
    let mut c = std::os::unix::net::UnixStream::connect(&reg.socket).expect("connect");
    c.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    c.write_all(format!("CONNECT {dest} HTTP/1.1\r\nHost: {dest}\r\n\r\n").as_bytes())
        .expect("write");
    let mut out = Vec::new();
    let mut b = [0u8; 1024];
    while !out.windows(4).any(|w| w == b"\r\n\r\n") {
        match c.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&b[..n]),
        }
    }
    parse(&out).map(|r| r.status).unwrap_or(0)
}

/// Without the host's explicit setting, the gateway connects to nothing of
/// the host's own: loopback by address or by name, link-local (cloud
/// metadata), the addresses of its interfaces; from a root and a child,
/// for GET, POST and CONNECT. 403 (refused before any connection) rather
/// than 502 shows nothing was tried.
#[test]
fn test_the_host_itself_is_never_reached_by_default() {
    let srv = Server::start();
    let gw = Gateway::start_with(None, None);
    let p = gw.root("p", Effects::default());
    let kids = gw.fork(&p, &["c"]);
    let mut targets = vec![
        format!("127.0.0.1:{}", srv.port),
        format!("localhost:{}", srv.port),
        format!("127.1.2.3:{}", srv.port),
        format!("[::1]:{}", srv.port),
        format!("[::ffff:127.0.0.1]:{}", srv.port),
        "169.254.169.254:80".to_string(),
        format!("0.0.0.0:{}", srv.port),
    ];
    if let Some(ip) = effects::egress::interface_addresses()
        .into_iter()
        .find(|ip| !ip.is_loopback())
    {
        let a = std::net::SocketAddr::new(ip, srv.port);
        targets.push(a.to_string());
    }
    for reg in [&p, &kids[0]] {
        for t in &targets {
            for method in ["GET", "POST"] {
                let r = send(reg, method, &format!("http://{t}/x"), "1", &[]);
                assert_eq!(r.status, 403, "{method} {t} from {}: {}", reg.vm, r.text());
                assert!(r.text().contains("refused"), "{}", r.text());
            }
            assert_eq!(connect_status(reg, t), 403, "CONNECT {t} from {}", reg.vm);
        }
    }
    assert_eq!(srv.count("/"), 0, "nothing reached the host's server");
    let list = gw.journal().lineage_effects(&p.branch).expect("list");
    assert!(
        list.iter()
            .all(|e| e.state == "refused" && e.policy == "egress"),
        "{list:?}"
    );
}

/// The host's setting names what may be reached, and nothing else: the
/// test server's port on 127.0.0.1, not another port there.
#[test]
fn test_the_host_setting_allows_only_what_it_names() {
    let srv = Server::start();
    let other = Server::start();
    let gw = Gateway::start_with(None, Some(&format!("127.0.0.1:{}", srv.port)));
    let p = gw.root("p", Effects::default());
    let r = send(&p, "POST", &srv.url("/ok"), "1", &[]);
    assert_eq!((r.status, r.text().as_str()), (201, "/ok #1"));
    let r = send(&p, "POST", &other.url("/no"), "1", &[]);
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(other.count("/"), 0);
    // A malformed setting stops the gateway at start, never ignored.
    let mut bad = Gateway::start_with(None, Some("127.0.0.1"));
    bad.kill9();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tine-gateway"))
        .arg("--home")
        .arg(&bad.home.0)
        .env(effects::egress::ALLOW_PRIVATE_ENV, "127.0.0.1:http")
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(effects::egress::ALLOW_PRIVATE_ENV),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `children_egress = "deny"` holds on the gateway as on the tap: the root
/// reaches both servers, its children only the one on `allow`, for GET,
/// POST and CONNECT; the refusals are journaled.
#[test]
fn test_children_egress_deny_applies_to_the_gateway() {
    let allowed = Server::start();
    let denied = Server::start();
    let gw = Gateway::start();
    let mut p = gw.root("p", Effects::default());
    p.network = Network {
        children_egress: Egress::Deny,
        allow: vec![format!("127.0.0.1:{}", allowed.port)],
        ..Network::default()
    };
    gw.call(Request::Register { reg: p.clone() });
    for srv in [&allowed, &denied] {
        let r = send(&p, "POST", &srv.url("/root"), "1", &[]);
        assert_eq!(r.status, 201, "the root is not restricted: {}", r.text());
        assert_eq!(connect_status(&p, &format!("127.0.0.1:{}", srv.port)), 200);
    }
    let kids = gw.fork(&p, &["c1", "c2"]);
    for k in &kids {
        let r = send(k, "POST", &allowed.url("/kid"), k.vm.as_str(), &[]);
        assert_eq!(r.status, 201, "{}: {}", k.vm, r.text());
        for method in ["GET", "POST"] {
            let r = send(k, method, &denied.url("/kid"), "1", &[]);
            assert_eq!(r.status, 403, "{method} {}: {}", k.vm, r.text());
            assert!(
                r.text().contains("children_egress"),
                "the refusal names the policy: {}",
                r.text()
            );
        }
        let dest = format!("127.0.0.1:{}", denied.port);
        assert_eq!(connect_status(k, &dest), 403, "CONNECT {}", k.vm);
        assert_eq!(
            connect_status(k, &format!("127.0.0.1:{}", allowed.port)),
            200
        );
    }
    assert_eq!(allowed.count("/kid"), 2);
    assert_eq!(
        denied.count("/kid"),
        0,
        "no child reached the denied server"
    );
    let list = gw.journal().lineage_effects(&kids[0].branch).expect("list");
    let refused = list
        .iter()
        .filter(|e| e.state == "refused" && e.policy == "egress")
        .count();
    assert_eq!(refused, 3, "{list:?}");
}

/// Which branch calls is the listener's: a child that names its parent
/// (or another vm) in any header is still the child, refused as one,
/// journaled as one.
#[test]
fn test_headers_cannot_change_the_branch() {
    let srv = Server::start();
    let gw = Gateway::start();
    let dest = format!("127.0.0.1:{}", srv.port);
    let pol = Effects {
        destinations: BTreeMap::from([(dest.clone(), EffectPolicy::DenyInChildren)]),
        ..Effects::default()
    };
    let p = gw.root("p", pol);
    let kids = gw.fork(&p, &["c"]);
    let c = &kids[0];
    let lies = [
        ("X-Tine-Branch", p.branch.as_str()),
        ("X-Tine-Vm", "p"),
        ("X-Tine-Effect", "replayed; key=x; from=p"),
        ("Forwarded", "for=p"),
        ("Proxy-Authorization", "Basic cDpw"),
        ("Via", "1.1 p"),
    ];
    let r = send(c, "POST", &srv.url("/pay"), "1", &lies);
    assert_eq!(r.status, 403, "{}", r.text());
    assert!(r.text().contains("vm \"c\""), "{}", r.text());
    // The parent's own request is not the child's either: executed as p.
    let r = send(
        &p,
        "POST",
        &srv.url("/pay"),
        "1",
        &[("X-Tine-Branch", &c.branch)],
    );
    assert_eq!(r.status, 201);
    assert_eq!(srv.count("/pay"), 1);
    let j = gw.journal();
    let child = j.lineage_effects(&c.branch).expect("list");
    assert_eq!(child.len(), 1, "the child's refusal only: {child:?}");
    assert_eq!(child[0].state, "refused");
    assert_eq!(child[0].executed_by, "c", "{child:?}");
}

/// Register never removes or replaces what the gateway did not make: a
/// file, a link, another program's socket, a path outside its home. Its
/// own socket (the same vm registered again, or after a restart) is.
#[test]
fn test_register_never_replaces_a_path_it_did_not_make() {
    let mut gw = Gateway::start();
    let try_at = |path: &Path| {
        let reg = Registration {
            branch: effects::random_id().expect("id"),
            vm: "x".into(),
            socket: path.to_path_buf(),
            lineage: vec![],
            effects: Effects::default(),
            network: Network::default(),
            peer_uid: None,
        };
        control::call(
            &gw.paths.control(),
            &Request::Register { reg },
            Duration::from_secs(10),
        )
    };
    let file = gw.socket("file");
    std::fs::write(&file, "precious").expect("write");
    let e = try_at(&file).expect_err("a file is not replaced");
    assert!(
        e.to_string().contains("not a socket this gateway made"),
        "{e}"
    );
    assert_eq!(std::fs::read_to_string(&file).expect("read"), "precious");

    let target = gw.home.0.join("target");
    std::fs::write(&target, "precious").expect("write");
    let link = gw.socket("link");
    std::os::unix::fs::symlink(&target, &link).expect("link");
    try_at(&link).expect_err("a link is not replaced");
    assert!(std::fs::symlink_metadata(&link).is_ok_and(|m| m.file_type().is_symlink()));

    let theirs = gw.socket("theirs");
    let other = std::os::unix::net::UnixListener::bind(&theirs).expect("bind");
    try_at(&theirs).expect_err("another program's socket is not replaced");
    let mut c = std::os::unix::net::UnixStream::connect(&theirs).expect("still theirs");
    let (mut s, _) = other.accept().expect("accept");
    c.write_all(b"hi").expect("write");
    let mut b = [0u8; 2];
    s.read_exact(&mut b).expect("read");

    let outside = common::TempDir::new("outside");
    let e = try_at(&outside.0.join("vsock.sock_3128")).expect_err("outside the home");
    assert!(e.to_string().contains("home"), "{e}");
    let escape = gw.home.0.join("vms").join("escape");
    std::os::unix::fs::symlink(&outside.0, &escape).expect("link");
    try_at(&escape.join("vsock.sock_3128")).expect_err("a linked directory leads outside");
    assert!(!outside.0.join("vsock.sock_3128").exists());

    // Its own sockets: the same vm again, and every vm after a restart.
    let p = gw.root("p", Effects::default());
    let again = gw.root("p", Effects::default());
    gw.kill9();
    gw.spawn(None);
    let st = gw.call(Request::Status).status.expect("status");
    assert!(
        st.branches.iter().any(|(_, b)| *b == again.branch),
        "re-bound after a restart: {:?}",
        st.branches
    );
    assert_ne!(p.branch, again.branch);
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p)
        .expect("stat")
        .permissions()
        .mode()
        & 0o7777
}

/// Under umask 000 every socket and file the gateway makes is its own
/// user's only.
#[test]
fn test_sockets_and_files_are_private_whatever_the_umask() {
    let home = common::TempDir::new("umask");
    let paths = effects::Paths::new(&home.0);
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_tine-gateway"));
    cmd.arg("--home").arg(&home.0);
    // SAFETY: umask(2) in the child before exec; async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0);
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("gateway");
    let t0 = std::time::Instant::now();
    while !control::answers(&paths) {
        assert!(t0.elapsed() < Duration::from_secs(20), "no answer");
        std::thread::sleep(Duration::from_millis(10));
    }
    let d = home.0.join("vms/v");
    std::fs::create_dir_all(&d).expect("dir");
    let reg = Registration {
        branch: effects::random_id().expect("id"),
        vm: "v".into(),
        socket: d.join("vsock.sock_3128"),
        lineage: vec![],
        effects: Effects::default(),
        network: Network::default(),
        peer_uid: None,
    };
    control::call(
        &paths.control(),
        &Request::Register { reg: reg.clone() },
        Duration::from_secs(10),
    )
    .expect("register");
    let _ = child.kill();
    let _ = child.wait();
    // Read after the kill: a killed gateway leaves its files as they were.
    assert_eq!(mode(&reg.socket), 0o600, "the branch's socket");
    assert_eq!(mode(&paths.control()), 0o600, "the control socket");
    assert_eq!(mode(&paths.journal()), 0o600, "the journal");
    assert_eq!(mode(&paths.dir) & 0o077, 0, "the gateway's directory");
}

/// Runs as another user (the test binary re-executed as `nobody`): asks
/// the control socket named in `TINE_TEST_CONTROL` for its status.
#[test]
fn peer_helper() {
    let Ok(sock) = std::env::var("TINE_TEST_CONTROL") else {
        return;
    };
    match control::call(Path::new(&sock), &Request::Status, Duration::from_secs(5)) {
        Ok(r) => println!("ANSWERED {}", r.ok),
        Err(e) => println!("REFUSED {e}"),
    }
}

/// Another user who can open the control socket (its mode loosened by
/// mistake) is still refused: the gateway checks the peer's credentials.
#[test]
fn test_control_socket_refuses_other_users() {
    // SAFETY: geteuid(2) cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipping: needs root to run a helper as another user");
        return;
    }
    let gw = Gateway::start();
    let open = std::fs::Permissions::from_mode(0o777);
    std::fs::set_permissions(&gw.home.0, open.clone()).expect("chmod home");
    std::fs::set_permissions(&gw.paths.dir, open.clone()).expect("chmod dir");
    std::fs::set_permissions(gw.paths.control(), open).expect("chmod socket");
    let out = std::process::Command::new(std::env::current_exe().expect("exe"))
        .args(["--exact", "peer_helper", "--nocapture", "--test-threads=1"])
        .env("TINE_TEST_CONTROL", gw.paths.control())
        .uid(65534)
        .gid(65534)
        .output()
        .expect("helper");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("REFUSED") && text.contains("uid 65534"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Its own user (root here) is served.
    assert!(gw.call(Request::Status).status.is_some());
}

/// Connects to `path` as a jailed VMM does: effective uid `uid` (what
/// SO_PEERCRED reports), file access still as root (fsuid 0). Raw
/// syscalls change the calling thread only, which ends right after.
fn connect_as_vmm(path: &Path, uid: u32) -> std::io::Result<std::os::unix::net::UnixStream> {
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        // SAFETY: setresuid(2)/setfsuid(2) on this thread's credentials.
        unsafe {
            if libc::syscall(libc::SYS_setresuid, -1i32, uid, -1i32) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::syscall(libc::SYS_setfsuid, 0);
        }
        std::os::unix::net::UnixStream::connect(&path)
    })
    .join()
    .expect("the connecting thread")
}

/// What the gateway answers on `s` to a request for a host it does not
/// reach (an error page when served; nothing when refused).
fn answer(mut s: std::os::unix::net::UnixStream) -> String {
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let _ = s.write_all(
        b"GET http://unreachable.invalid/ HTTP/1.1\r\nHost: unreachable.invalid\r\n\r\n",
    );
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    String::from_utf8_lossy(&out).into_owned()
}

/// Every tree's VMM sees the home's `vms/`; the VMM of another tree
/// (another uid) connecting to a branch's socket does not pass for it.
#[test]
fn test_a_branch_socket_refuses_the_vmm_of_another_tree() {
    // SAFETY: geteuid(2) cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipping: needs root to connect as another uid");
        return;
    }
    let gw = Gateway::start();
    let own = 0x7A00_0001;
    let reg = Registration {
        peer_uid: Some(own),
        ..gw.root("v", Effects::default())
    };
    gw.call(Request::Register { reg: reg.clone() });
    let other = connect_as_vmm(&reg.socket, 0x7A00_0002).expect("connect as another tree");
    let said = answer(other);
    assert!(said.is_empty(), "another tree's VMM was served: {said}");
    let mine = connect_as_vmm(&reg.socket, own).expect("connect as the branch's VMM");
    let said = answer(mine);
    assert!(
        said.starts_with("HTTP/1.1 "),
        "its own VMM was not served: {said:?}"
    );
    let host = std::os::unix::net::UnixStream::connect(&reg.socket).expect("connect as root");
    assert!(answer(host).starts_with("HTTP/1.1 "), "root was not served");
}
