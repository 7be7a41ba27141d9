//! A vm's network on the host side: addresses leased from its tree's /24,
//! its tap's address and route, and the nftables rules that bind each tap
//! to its own address and hold children to an egress allow-list. Micro
//! guests on this machine's /dev/kvm, every `tine` call inside a network
//! namespace of the test's own, so the host's ruleset is never touched.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{kvm_available, Home, TempDir};

struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

fn tool(name: &str) -> bool {
    Command::new(name)
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok()
}

/// `tine ARGS` inside the namespace.
fn tine_in(h: &Home, ns: &str, args: &[&str]) -> Output {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_tine")])
        .args(args)
        .env("TINE_HOME", h.0.path())
        .stdin(Stdio::null());
    common::output_within(&mut c, Duration::from_secs(120)).unwrap_or_else(|t| panic!("{t}"))
}

fn ok_in(h: &Home, ns: &str, args: &[&str]) -> String {
    let out = tine_in(h, ns, args);
    assert!(
        out.status.success(),
        "tine {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn in_ns(ns: &str, cmd: &[&str]) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", ns])
        .args(cmd)
        .output()
        .expect("ip netns exec");
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn lease(h: &Home, vm: &str) -> String {
    let rec =
        std::fs::read_to_string(h.0.path().join("vms").join(vm).join("vm.json")).expect("record");
    let v: serde_json::Value = serde_json::from_str(&rec).expect("json");
    v["lease"]["ip"].as_str().expect("lease").to_string()
}

#[test]
fn test_leases_taps_and_isolation_rules_follow_the_tree() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !kvm_available() || !root || !tool("nft") {
        eprintln!("skipped: needs /dev/kvm, root and nft");
        return;
    }
    let ns = Netns(format!("tine-net-{}", std::process::id()));
    assert!(Command::new("ip")
        .args(["netns", "add", &ns.0])
        .status()
        .expect("ip")
        .success());
    let h = Home::new("net");
    let files = TempDir::new("netfiles");

    ok_in(
        &h,
        &ns.0,
        &["run", "--name", "n", "--image", "micro-counter", "--net"],
    );
    assert_eq!(lease(&h, "n"), "10.213.0.2");
    let addr = in_ns(&ns.0, &["ip", "-4", "-o", "addr", "show", "dev", "tt-n"]);
    assert!(
        addr.contains("10.213.0.1/32"),
        "the host is .1 on the tap: {addr}"
    );
    let routes = in_ns(&ns.0, &["ip", "-4", "route", "show", "dev", "tt-n"]);
    assert!(
        routes.contains("10.213.0.2"),
        "a /32 route to the vm: {routes}"
    );
    // Its VMM has no capability and a network namespace of its own: the
    // host opened the tap (in `ns`) and passed it; so for each child.
    let no_caps_own_netns = |vm: &str| {
        let rec: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(h.0.path().join("vms").join(vm).join("vm.json"))
                .expect("record"),
        )
        .expect("json");
        let pid = rec["pid"].as_u64().expect("pid");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
        assert!(
            status.contains("CapEff:\t0000000000000000"),
            "the VMM of {vm}, with a tap: {status}"
        );
        let theirs = std::fs::read_link(format!("/proc/{pid}/ns/net")).expect("netns");
        let host = std::fs::read_link(format!("/run/netns/{}", ns.0))
            .ok()
            .or_else(|| {
                let inode = std::fs::metadata(format!("/run/netns/{}", ns.0))
                    .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
                    .expect("netns file");
                Some(format!("net:[{inode}]").into())
            })
            .expect("netns");
        assert_ne!(
            theirs, host,
            "{vm}'s VMM is in the host's network namespace"
        );
    };
    no_caps_own_netns("n");

    // Children: addresses in the parent's tree, egress per the contract.
    let deny = files.path().join("deny.toml");
    std::fs::write(
        &deny,
        "[network]\nchildren_egress = \"deny\"\nallow = [\"10.213.0.1:80\"]\n",
    )
    .expect("contract");
    ok_in(
        &h,
        &ns.0,
        &[
            "fork",
            "n",
            "--names",
            "a,b",
            "--contract",
            deny.to_str().expect("utf8"),
        ],
    );
    let (a, b) = (lease(&h, "a"), lease(&h, "b"));
    assert!(
        a.starts_with("10.213.0.") && b.starts_with("10.213.0."),
        "{a} {b}"
    );
    assert!(a != b && a != "10.213.0.2" && b != "10.213.0.2");
    let own = in_ns(&ns.0, &["nft", "list", "set", "inet", "tine", "own"]);
    for (tap, ip) in [
        ("tt-n", "10.213.0.2"),
        ("tt-a", a.as_str()),
        ("tt-b", b.as_str()),
    ] {
        assert!(
            own.contains(&format!("\"{tap}\" . {ip}")),
            "{tap} bound to {ip}: {own}"
        );
    }
    let chain = in_ns(
        &ns.0,
        &["nft", "list", "chain", "inet", "tine", "egress-tt-a"],
    );
    assert!(
        chain.contains("ip daddr 10.213.0.1 tcp dport 80 accept") && chain.contains("drop"),
        "{chain}"
    );
    let addr = in_ns(&ns.0, &["ip", "-4", "-o", "addr", "show", "dev", "tt-a"]);
    assert!(addr.contains("10.213.0.1/32"), "{addr}");
    no_caps_own_netns("a");
    no_caps_own_netns("b");

    // A second tree gets its own /24.
    ok_in(
        &h,
        &ns.0,
        &["run", "--name", "m", "--image", "micro-counter", "--net"],
    );
    assert_eq!(lease(&h, "m"), "10.213.1.2");

    // Removing a vm frees its address and its rules.
    ok_in(&h, &ns.0, &["rm", "--force", "a"]);
    let own = in_ns(&ns.0, &["nft", "list", "set", "inet", "tine", "own"]);
    assert!(!own.contains("\"tt-a\""), "{own}");
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.0,
            "nft",
            "list",
            "chain",
            "inet",
            "tine",
            "egress-tt-a",
        ])
        .output()
        .expect("nft");
    assert!(
        !out.status.success(),
        "the egress chain of a removed vm is gone"
    );
    assert!(!h.0.path().join("net/leases").join(&a).exists());
    // Its tap went with its VMM (nothing else held it).
    let link = Command::new("ip")
        .args(["netns", "exec", &ns.0, "ip", "link", "show", "tt-a"])
        .output()
        .expect("ip");
    assert!(!link.status.success(), "the tap of a removed vm is left");
    ok_in(&h, &ns.0, &["fork", "n", "--names", "c"]);
    assert_eq!(lease(&h, "c"), a, "a freed address is reused");

    for vm in ["n", "b", "c", "m"] {
        ok_in(&h, &ns.0, &["rm", "--force", vm]);
    }
}
