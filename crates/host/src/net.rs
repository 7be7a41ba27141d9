//! A vm's network on the host side: its address from the tree's pool, its
//! tap's routes, and the nftables rules that keep each vm to its own
//! address and, when its contract says so, to an egress allow-list.
//!
//! Addressing: every tree (a vm started with `tine run --net` and all its
//! descendants) gets one /24 of 10.213.0.0/16; the host is `.1` on every
//! tap of the tree (a /32 on each tap, so no bridge is needed) and each vm
//! gets its own address with a /32 route to its tap. A lease is a file
//! `$TINE_HOME/net/leases/ADDR` created with O_EXCL, so concurrent forks
//! never hand out one address twice and nothing needs a lock. A new tree
//! also skips any /24 whose gateway is already on an interface of this
//! network namespace: another home's (a fleet's hosts sharing one).
//!
//! Isolation (table `inet tine`): a packet from a tap (`tt-*`) whose source
//! is not that tap's leased address is dropped, and so is IPv6 (the pool is
//! IPv4; the agent turns IPv6 off on the guest's interface). That matters at fork: a
//! child starts with its parent's address and inherited connections; what
//! it sends before the agent renews its identity (retransmits, the RSTs
//! that close inherited connections) never reaches the parent's peers.
//! Children whose contract denies egress get a chain that accepts only the
//! allow-list. Rules go through `nft -f -` (the nftables package): the
//! netlink protocol of nf_tables has no maintained Rust crate.

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::bail;
use crate::error::Context;
use serde::{Deserialize, Serialize};

/// First two octets of every tree's /24.
const POOL: [u8; 2] = [10, 213];
const TABLE: &str = "inet tine";

/// A vm's address in its tree's /24.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    pub ip: Ipv4Addr,
}

impl Lease {
    pub fn subnet(&self) -> u8 {
        self.ip.octets()[2]
    }
    /// The host's end, the vm's default route.
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(POOL[0], POOL[1], self.subnet(), 1)
    }
    /// `ADDR/24`, as the guest configures it.
    pub fn cidr(&self) -> String {
        format!("{}/24", self.ip)
    }
}

fn leases_dir(home: &Path) -> PathBuf {
    home.join("net").join("leases")
}

/// Takes `ip` for `vm` if it is free.
fn take(home: &Path, ip: Ipv4Addr, vm: &str) -> crate::Result<bool> {
    let path = leases_dir(home).join(ip.to_string());
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
    {
        Ok(mut f) => {
            f.write_all(vm.as_bytes())
                .with_context(|| format!("cannot write {}", path.display()))?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(crate::Error::from(e).context(format!("cannot create {}", path.display()))),
    }
}

fn subnet_in_use(home: &Path, s: u8) -> bool {
    (2..=254u8).any(|h| {
        leases_dir(home)
            .join(Ipv4Addr::new(POOL[0], POOL[1], s, h).to_string())
            .exists()
    })
}

fn prepare(home: &Path) -> crate::Result<()> {
    let d = leases_dir(home);
    std::fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))
}

/// The /24s whose gateway (`10.213.S.1`) is already on an interface of
/// this network namespace: trees of another home here, such as a second
/// tined of a fleet sharing the namespace (hosts that share one L2 must
/// not hand out one address twice). Best effort: an unreadable list
/// leaves only this home's own leases to go by.
fn subnets_on_interfaces() -> std::collections::HashSet<u8> {
    let Ok(list) = nix::ifaddrs::getifaddrs() else {
        return Default::default();
    };
    list.filter_map(|i| Some(i.address?.as_sockaddr_in()?.ip().octets()))
        .filter(|o| o[0] == POOL[0] && o[1] == POOL[1] && o[3] == 1)
        .map(|o| o[2])
        .collect()
}

/// A new tree's first address: `.2` of a /24 no other tree uses, in this
/// home or on this namespace's interfaces.
pub fn lease_new_tree(home: &Path, vm: &str) -> crate::Result<Lease> {
    prepare(home)?;
    let elsewhere = subnets_on_interfaces();
    for s in 0..=255u8 {
        if !elsewhere.contains(&s)
            && !subnet_in_use(home, s)
            && take(home, Ipv4Addr::new(POOL[0], POOL[1], s, 2), vm)?
        {
            return Ok(Lease {
                ip: Ipv4Addr::new(POOL[0], POOL[1], s, 2),
            });
        }
    }
    bail!("all 256 network trees of 10.213.0.0/16 are in use; remove vms with `tine rm`")
}

/// A free address in `parent`'s tree.
pub fn lease_in_tree(home: &Path, parent: &Lease, vm: &str) -> crate::Result<Lease> {
    prepare(home)?;
    let s = parent.subnet();
    for h in 2..=254u8 {
        let ip = Ipv4Addr::new(POOL[0], POOL[1], s, h);
        if take(home, ip, vm)? {
            return Ok(Lease { ip });
        }
    }
    bail!(
        "the network tree 10.213.{s}.0/24 has no free address (253 vms); remove some with `tine rm`"
    )
}

/// Gives the lease back (when its vm is removed, or a fork failed).
pub fn release(home: &Path, lease: &Lease) {
    let _ = std::fs::remove_file(leases_dir(home).join(lease.ip.to_string()));
}

/// The host side of each tap: up, the gateway address, a route to its vm.
/// One `ip -batch` for all of them: a fork of many children pays for one
/// process, not three per child.
pub fn configure_taps(taps: &[(String, Lease)]) -> crate::Result<()> {
    if taps.is_empty() {
        return Ok(());
    }
    let mut script = String::new();
    for (tap, l) in taps {
        script.push_str(&format!(
            "link set dev {tap} up\naddr replace {}/32 dev {tap}\nroute replace {}/32 dev {tap}\n",
            l.gateway(),
            l.ip
        ));
    }
    run_script("ip", &["-batch", "-"], &script, "(is iproute2 installed?)")
        .context("configuring the host side of the taps failed")
}

/// Feeds a script to `nft -f -`.
fn nft(script: &str) -> crate::Result<()> {
    run_script(
        "nft",
        &["-f", "-"],
        script,
        "tine isolates vm networks with nftables (apt-get install nftables)",
    )
    .with_context(|| format!("nft rejected tine's rules:\n{script}"))
}

/// Runs `prog args` with `script` on its stdin; its stderr is the error.
fn run_script(prog: &str, args: &[&str], script: &str, hint: &str) -> crate::Result<()> {
    let out = crate::proc::output(
        Command::new(prog).args(args),
        script.as_bytes(),
        HELPER_TIMEOUT,
    )
    .map_err(|e| crate::Error::failed(format!("{e} ({hint})")))?;
    if !out.status.success() {
        bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// How long `nft` and `ip` may take.
const HELPER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Creates table `inet tine` with its anti-spoofing rule unless it exists.
fn ensure_table() -> crate::Result<()> {
    let exists = crate::proc::output(
        Command::new("nft").args(["list", "table", "inet", "tine"]),
        b"",
        HELPER_TIMEOUT,
    )
    .is_ok_and(|o| o.status.success());
    if exists {
        return Ok(());
    }
    // Filter at prerouting: one place for packets to the host itself and
    // packets it would forward. ARP is another family and passes.
    nft(&format!(
        "table {TABLE} {{
  set own {{ type ifname . ipv4_addr; }}
  map egress {{ type ifname : verdict; }}
  chain prerouting {{
    type filter hook prerouting priority -150; policy accept;
    iifname \"tt-*\" meta nfproto ipv4 iifname . ip saddr != @own counter drop
    iifname \"tt-*\" meta nfproto ipv6 counter drop
    iifname \"tt-*\" iifname vmap @egress
  }}
}}
"
    ))
}

/// The chain of one tap's egress allow-list.
fn chain_name(tap: &str) -> String {
    format!("egress-{tap}")
}

/// Binds `tap` to its vm's address and sets its egress: `None` allows
/// everything, `Some(rules)` only the rules (anything else is dropped,
/// IPv6 included). Idempotent per tap.
pub fn isolate(
    tap: &str,
    lease: &Lease,
    allow: Option<&[contract::AllowRule]>,
) -> crate::Result<()> {
    ensure_table()?;
    forget(tap);
    let mut s = format!("add element {TABLE} own {{ \"{tap}\" . {} }}\n", lease.ip);
    if let Some(rules) = allow {
        let chain = chain_name(tap);
        s.push_str(&format!("add chain {TABLE} {chain}\n"));
        for r in rules {
            let dst = format!("ip daddr {}/{}", r.addr, r.prefix);
            match r.port {
                Some(p) => {
                    s.push_str(&format!(
                        "add rule {TABLE} {chain} {dst} tcp dport {p} accept\n"
                    ));
                    s.push_str(&format!(
                        "add rule {TABLE} {chain} {dst} udp dport {p} accept\n"
                    ));
                }
                None => s.push_str(&format!("add rule {TABLE} {chain} {dst} accept\n")),
            }
        }
        s.push_str(&format!("add rule {TABLE} {chain} counter drop\n"));
        s.push_str(&format!(
            "add element {TABLE} egress {{ \"{tap}\" : jump {chain} }}\n"
        ));
    }
    nft(&s)
}

/// Removes `tap`'s binding and egress chain (best effort: the vm is gone).
pub fn forget(tap: &str) {
    let chain = chain_name(tap);
    // One command per item: nft applies a script atomically, and a missing
    // element would fail the whole script.
    for cmd in [
        format!("delete element {TABLE} egress {{ \"{tap}\" }}"),
        format!("delete chain {TABLE} {chain}"),
    ] {
        let _ = nft(&cmd);
    }
    // The binding's address is not known here: flush matching elements.
    if let Ok(out) = crate::proc::output(
        Command::new("nft").args(["-j", "list", "set", "inet", "tine", "own"]),
        b"",
        HELPER_TIMEOUT,
    ) {
        let text = String::from_utf8_lossy(&out.stdout);
        for ip in own_addresses(&text, tap) {
            let _ = nft(&format!(
                "delete element {TABLE} own {{ \"{tap}\" . {ip} }}"
            ));
        }
    }
}

/// The addresses bound to `tap` in `nft -j list set inet tine own`.
fn own_addresses(json: &str, tap: &str) -> Vec<String> {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let sets = v["nftables"].as_array().cloned().unwrap_or_default();
    for item in sets {
        for e in item["set"]["elem"].as_array().cloned().unwrap_or_default() {
            let parts = &e["concat"];
            if parts[0].as_str() == Some(tap) {
                if let Some(ip) = parts[1].as_str() {
                    out.push(ip.to_string());
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_leases_are_unique_per_tree_and_trees_disjoint() {
        let home = std::env::temp_dir().join(format!("tine-net-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&home);
        let a = lease_new_tree(&home, "a").expect("a");
        let b = lease_new_tree(&home, "b").expect("b");
        assert_ne!(a.subnet(), b.subnet());
        assert_eq!(a.gateway(), Ipv4Addr::new(10, 213, a.subnet(), 1));
        let kids: Vec<Lease> = (0..10)
            .map(|i| lease_in_tree(&home, &a, &format!("a-{i}")).expect("child"))
            .collect();
        let mut all: Vec<Ipv4Addr> = kids.iter().map(|l| l.ip).collect();
        all.push(a.ip);
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 11, "addresses must be distinct");
        assert!(kids.iter().all(|k| k.subnet() == a.subnet()));
        release(&home, &kids[0]);
        let again = lease_in_tree(&home, &a, "again").expect("reuse");
        assert_eq!(again.ip, kids[0].ip, "a released address is reused");
        let _ = std::fs::remove_dir_all(&home);
    }

    /// Another home's tree in this namespace (its gateway on an interface:
    /// a tap here, since the dummy module may be missing) keeps its /24
    /// out of this home's new trees: two tineds of a fleet on one
    /// namespace never lease one address twice.
    #[test]
    fn test_a_subnet_another_home_uses_here_is_not_leased() {
        // A network namespace of this thread's own (root only), so the
        // host's interfaces are not touched; `ip` inherits it.
        let t = std::thread::spawn(|| {
            // SAFETY: unshare with a plain flag; affects this thread only.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                eprintln!("skipping: cannot make a network namespace (not root?)");
                return;
            }
            let ip = |args: &str| {
                let ok = Command::new("ip")
                    .args(args.split(' '))
                    .status()
                    .is_ok_and(|s| s.success());
                assert!(ok, "ip {args}");
            };
            ip("tuntap add dev tt-other mode tap");
            ip("addr add 10.213.0.1/32 dev tt-other");
            ip("addr add 10.213.2.1/32 dev tt-other");
            assert_eq!(
                subnets_on_interfaces(),
                [0u8, 2].into_iter().collect(),
                "the gateways on this namespace's interfaces"
            );
            let home = tempfile::tempdir().expect("home");
            let a = lease_new_tree(home.path(), "a").expect("a");
            let b = lease_new_tree(home.path(), "b").expect("b");
            assert_eq!((a.subnet(), b.subnet()), (1, 3), "{a:?} {b:?}");
        });
        t.join().expect("the namespace's thread");
    }

    #[test]
    fn test_own_addresses_parses_nft_json() {
        let j = r#"{"nftables":[{"metainfo":{}},{"set":{"name":"own","elem":[{"concat":["tt-a","10.213.0.2"]},{"concat":["tt-b","10.213.0.3"]}]}}]}"#;
        assert_eq!(own_addresses(j, "tt-b"), vec!["10.213.0.3".to_string()]);
        assert!(own_addresses("not json", "tt-b").is_empty());
    }
}
