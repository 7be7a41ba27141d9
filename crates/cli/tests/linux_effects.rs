//! The effects gateway end to end (issue 7): a guest program POSTs through
//! its http_proxy to a slow server on the host; the vm is forked into five
//! children while the POST is in flight; the parent and every child retry
//! (their proxy connections were reset by the fork); the server counts one
//! request, and every branch prints the same response.
//!
//! Named `linux_*`: runs inside the nested test host when this machine has
//! no hardware virtualization.

mod common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{kvm_available, Home};

/// A server that answers `/order` only once `release` is set, with
/// `order #n` (n counts the requests it got).
struct Slow {
    port: u16,
    orders: Arc<AtomicUsize>,
    release: Arc<AtomicBool>,
}

impl Slow {
    fn start() -> Self {
        let l = TcpListener::bind("0.0.0.0:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        let orders = Arc::new(AtomicUsize::new(0));
        let release = Arc::new(AtomicBool::new(false));
        let (o, r) = (orders.clone(), release.clone());
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                let (o, r) = (o.clone(), r.clone());
                std::thread::spawn(move || answer(s, &o, &r));
            }
        });
        Slow {
            port,
            orders,
            release,
        }
    }
}

/// Reads one request (head and Content-Length body) and answers it.
fn answer(mut s: std::net::TcpStream, orders: &AtomicUsize, release: &AtomicBool) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + len {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let n = orders.fetch_add(1, Ordering::SeqCst) + 1;
    let t0 = Instant::now();
    while !release.load(Ordering::SeqCst) && t0.elapsed() < Duration::from_secs(900) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let body = format!("order #{n}");
    let _ = s.write_all(
        format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    );
}

fn exec(h: &Home, vm: &str, script: &str) -> String {
    h.ok(&["exec", vm, "--", "sh", "-c", script])
}

/// The program: POSTs through `$http_proxy` (busybox wget sends every
/// request through a proxy as GET, so it speaks HTTP itself, over nc) and
/// retries until it gets a 200; the response is left in /tmp/done.
const PROGRAM: &str = r#"
hp=${http_proxy#http://}; host=${hp%:*}; port=${hp##*:}
req="POST http://127.0.0.1:@PORT@/order HTTP/1.1\r\nHost: 127.0.0.1:@PORT@\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\npizza"
i=0
while [ $i -lt 3000 ]; do
  printf "$req" | nc "$host" "$port" > /tmp/resp 2>/dev/null
  if grep -q '^HTTP/1.1 200' /tmp/resp; then cp /tmp/resp /tmp/done; exit 0; fi
  i=$((i+1)); echo "try $i: $(head -c 60 /tmp/resp | tr '\r\n' '  ')" >> /tmp/tries
  sleep 0.3
done
"#;

#[test]
fn test_post_in_flight_at_fork_reaches_the_server_once() {
    if !kvm_available() {
        return;
    }
    let _serial = common::one_linux_test_at_a_time();
    // The server is on the host's loopback, which the gateway never
    // reaches unless the host names it (the gateways this test's `tine`
    // starts inherit the setting). One test in this binary: nothing else
    // reads the environment meanwhile.
    std::env::set_var("TINE_GATEWAY_ALLOW_PRIVATE", "127.0.0.1");
    let srv = Slow::start();
    let h = Home::new("linuxeffects");
    h.ok(&["run", "--name", "p", "--mem", "256M"]);
    // The agent set the proxy for what it starts, and for login shells.
    let env = exec(
        &h,
        "p",
        "echo $http_proxy; cat /etc/profile.d/tine-proxy.sh",
    );
    assert!(env.starts_with("http://127.0.0.1:3128"), "{env}");
    assert!(
        env.contains("export https_proxy=http://127.0.0.1:3128"),
        "{env}"
    );
    let program = PROGRAM.replace("@PORT@", &srv.port.to_string());
    exec(
        &h,
        "p",
        &format!("cat > /tmp/post.sh <<'EOF'\n{program}\nEOF\nsetsid sh /tmp/post.sh </dev/null >/dev/null 2>&1 &"),
    );
    let t0 = Instant::now();
    while srv.orders.load(Ordering::SeqCst) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the POST never reached the server; the guest's tries: {}",
            exec(&h, "p", "cat /tmp/tries 2>/dev/null; true")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The POST waits at the server: fork now.
    let fork = h.ok_within(
        &["fork", "p", "-n", "5", "--json"],
        Duration::from_secs(600),
    );
    let v: serde_json::Value = serde_json::from_str(fork.trim()).expect("fork json");
    assert_eq!(v["names"].as_array().map(|a| a.len()), Some(5), "{fork}");
    let failed: Vec<&serde_json::Value> = v["results"]
        .as_array()
        .map(|r| r.iter().filter(|c| c["ok"] != true).collect())
        .unwrap_or_default();
    assert!(
        failed.is_empty(),
        "children that did not wake: {failed:?}\n{fork}"
    );
    // Let the copies retry (their waits join the one in flight), then the
    // server answers.
    std::thread::sleep(Duration::from_secs(3));
    srv.release.store(true, Ordering::SeqCst);
    let vms = ["p", "p-1", "p-2", "p-3", "p-4", "p-5"];
    for vm in vms {
        let t0 = Instant::now();
        let done = loop {
            let out = exec(&h, vm, "cat /tmp/done 2>/dev/null; true");
            if out.contains("order #") {
                break out;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(180),
                "{vm} got no response; its tries: {}",
                exec(&h, vm, "cat /tmp/tries 2>/dev/null; true")
            );
            std::thread::sleep(Duration::from_millis(500));
        };
        assert!(done.contains("order #1"), "{vm}: {done}");
        let fx = done
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("x-tine-effect"))
            .unwrap_or("");
        assert!(
            fx.contains("replayed;") && fx.contains("from=p"),
            "{vm}: {done}"
        );
        eprintln!(
            "{vm}: {} (tries: {})",
            fx.trim(),
            exec(&h, vm, "wc -l < /tmp/tries 2>/dev/null || echo 0").trim()
        );
    }
    assert_eq!(
        srv.orders.load(Ordering::SeqCst),
        1,
        "the server got the POST exactly once"
    );
    // `tine effects` shows it from a child: the parent's, replayed here.
    let out = h.ok(&["effects", "p-3", "--json"]);
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("effects json");
    let list = v["effects"].as_array().expect("effects");
    let post = list
        .iter()
        .find(|e| e["method"] == "POST")
        .unwrap_or_else(|| panic!("no POST in {out}"));
    assert_eq!(post["state"], "replayed", "{out}");
    assert_eq!(post["executed_by"], "p", "{out}");
    assert_eq!(post["key_source"], "derived", "{out}");
    let to: Vec<&str> = post["replayed_to"]
        .as_array()
        .expect("replayed_to")
        .iter()
        .filter_map(|x| x.as_str())
        .collect();
    for vm in vms {
        assert!(to.contains(&vm), "{vm} not in {to:?}");
    }
    eprintln!("{}", h.ok(&["effects", "p"]));
    let st = h.ok(&["gateway", "status", "--json"]);
    let st: serde_json::Value = serde_json::from_str(&st).expect("status json");
    assert_eq!(st["running"], true);
    let registered = st["status"]["branches"].as_array().map(|a| a.len());
    assert_eq!(registered, Some(6), "{st}");
}
