//! Where the gateway may connect for a branch: the contract's egress policy
//! (`[network]`: children with `children_egress = "deny"` reach only the
//! `allow` list, as on the tap) and the host's own rule that a guest never
//! reaches the host itself through the gateway (its loopback, link-local
//! and cloud-metadata addresses, and every address on its interfaces).
//!
//! A destination is resolved once, every address is checked, and the
//! gateway connects only to the addresses it checked: a name that resolves
//! to a public address now and to 127.0.0.1 a moment later (DNS
//! rebinding) cannot switch the connection.
//!
//! Tests reach a server on the host's loopback through an explicit host
//! setting, [`ALLOW_PRIVATE_ENV`]: a list of networks the gateway may
//! reach although they are the host's own. Nothing a guest or a contract
//! says can widen it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use contract::{AllowRule, Egress, Network};

use crate::Registration;

/// Host configuration: comma-separated networks the gateway may connect to
/// although they are the host's own (loopback, link-local, its interfaces'
/// addresses): `ADDR`, `ADDR/PREFIX`, `ADDR:PORT`, `ADDR/PREFIX:PORT`
/// (IPv4), `[V6ADDR/PREFIX]:PORT` or a bare IPv6 `V6ADDR/PREFIX`. For tests
/// whose upstream listens on 127.0.0.1; unset in production.
pub const ALLOW_PRIVATE_ENV: &str = "TINE_GATEWAY_ALLOW_PRIVATE";

/// One network of [`ALLOW_PRIVATE_ENV`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostRule {
    pub addr: IpAddr,
    pub prefix: u8,
    pub port: Option<u16>,
}

impl HostRule {
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let bad = |why: &str| {
            format!(
                "{ALLOW_PRIVATE_ENV} entry {s:?}: {why} (write ADDR, ADDR/PREFIX, ADDR:PORT, ADDR/PREFIX:PORT or [V6ADDR/PREFIX]:PORT)"
            )
        };
        let (net, port) = if let Some(rest) = s.strip_prefix('[') {
            let (net, tail) = rest.split_once(']').ok_or_else(|| bad("no ']'"))?;
            let port = match tail.strip_prefix(':') {
                Some(p) => Some(p.parse::<u16>().map_err(|_| bad("bad port"))?),
                None if tail.is_empty() => None,
                None => return Err(bad("junk after ']'")),
            };
            (net, port)
        } else if s.matches(':').count() > 1 {
            (s, None)
        } else {
            match s.rsplit_once(':') {
                Some((n, p)) => (n, Some(p.parse::<u16>().map_err(|_| bad("bad port"))?)),
                None => (s, None),
            }
        };
        let (addr, prefix) = match net.split_once('/') {
            Some((a, p)) => (a, Some(p.parse::<u8>().map_err(|_| bad("bad prefix"))?)),
            None => (net, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| bad("bad address"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = prefix.unwrap_or(max);
        if prefix > max {
            return Err(bad("prefix too long"));
        }
        Ok(HostRule { addr, prefix, port })
    }

    /// Parses the comma-separated list (empty: none).
    pub fn parse_list(s: &str) -> Result<Vec<Self>, String> {
        s.split(',')
            .filter(|e| !e.trim().is_empty())
            .map(HostRule::parse)
            .collect()
    }

    fn matches(&self, a: SocketAddr) -> bool {
        self.port.is_none_or(|p| p == a.port()) && in_net(a.ip(), self.addr, self.prefix)
    }
}

fn in_net(ip: IpAddr, net: IpAddr, prefix: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

/// Why an address is the host's own (never reached by default), if it is.
pub fn host_own(ip: IpAddr, interfaces: &[IpAddr]) -> Option<&'static str> {
    let ip = ip.to_canonical();
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            if v4.is_loopback() {
                Some("the host's loopback")
            } else if v4.is_link_local() {
                Some("link-local (cloud metadata)")
            } else if o[0] == 0 {
                Some("0.0.0.0/8 (this host)")
            } else if v4.is_broadcast() || v4.is_multicast() {
                Some("broadcast or multicast")
            } else if interfaces.contains(&ip) {
                Some("an address of this host")
            } else {
                None
            }
        }
        IpAddr::V6(v6) => {
            if v6.is_loopback() {
                Some("the host's loopback")
            } else if v6.is_unspecified() {
                Some(":: (this host)")
            } else if v6.segments()[0] & 0xffc0 == 0xfe80 {
                Some("link-local")
            } else if v6.is_multicast() {
                Some("multicast")
            } else if interfaces.contains(&ip) {
                Some("an address of this host")
            } else if let Some(v4) = embedded_v4(v6) {
                // NAT64 and 6to4 forms of a v4 address say where it goes.
                host_own(IpAddr::V4(v4), interfaces)
            } else {
                None
            }
        }
    }
}

/// The IPv4 address in a NAT64 (64:ff9b::/96) or IPv4-compatible address.
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = v6.segments();
    let tail = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    let nat64 = s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0; 4];
    let compat = s[..6] == [0; 6];
    (nat64 || compat).then_some(tail)
}

/// Every address on this host's interfaces (read per check: taps come and
/// go with vms).
pub fn interface_addresses() -> Vec<IpAddr> {
    let Ok(list) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    list.filter_map(|i| {
        let a = i.address?;
        if let Some(v4) = a.as_sockaddr_in() {
            Some(IpAddr::V4(v4.ip()))
        } else {
            a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
        }
    })
    .collect()
}

/// Why a destination is not connected to.
#[derive(Debug)]
pub enum Denied {
    /// The egress policy forbids it (the guest gets 403).
    Refused(String),
    /// Its name did not resolve (502; a retry may work).
    Unresolved(String),
}

/// What the gateway checks for one branch.
pub struct Policy<'a> {
    pub reg: &'a Registration,
    /// [`ALLOW_PRIVATE_ENV`], parsed.
    pub allow_private: &'a [HostRule],
}

impl Policy<'_> {
    /// The contract's allow-list when it applies to this branch: a child
    /// (a fork's or a restore's copy) whose contract denies egress.
    fn allow_list(&self) -> Result<Option<Vec<AllowRule>>, String> {
        let n: &Network = &self.reg.network;
        if n.children_egress == Egress::Deny && self.reg.is_child() {
            let rules = n
                .allow
                .iter()
                .map(|s| AllowRule::parse(s).map_err(|e| e.to_string()))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Some(rules))
        } else {
            Ok(None)
        }
    }

    /// The addresses the gateway may connect to for `host:port`, resolved
    /// now; `Err` says why none (nothing was sent).
    pub async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, Denied> {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let addrs: Vec<SocketAddr> = match bare.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => tokio::net::lookup_host((bare, port))
                .await
                .map_err(|e| Denied::Unresolved(format!("cannot resolve {host}: {e}")))?
                .collect(),
        };
        if addrs.is_empty() {
            return Err(Denied::Unresolved(format!("{host} has no address")));
        }
        self.check(host, port, addrs).map_err(Denied::Refused)
    }

    /// Checks resolved addresses: any that is the host's own refuses the
    /// destination (a name that points some of its addresses at the host
    /// is not followed to the others either); the contract's allow-list,
    /// when it applies, keeps those it names.
    pub fn check(
        &self,
        host: &str,
        port: u16,
        addrs: Vec<SocketAddr>,
    ) -> Result<Vec<SocketAddr>, String> {
        if addrs.is_empty() {
            return Err(format!("{host} has no address"));
        }
        let addrs: Vec<SocketAddr> = addrs
            .into_iter()
            .map(|a| SocketAddr::new(a.ip().to_canonical(), a.port()))
            .collect();
        let ifs = interface_addresses();
        for a in &addrs {
            if let Some(why) = host_own(a.ip(), &ifs) {
                if !self.allow_private.iter().any(|r| r.matches(*a)) {
                    return Err(format!(
                        "refused: {host}:{port} resolves to {} ({why}); the gateway never connects a guest to the host itself"
                        , a.ip()
                    ));
                }
            }
        }
        let Some(rules) = self.allow_list()? else {
            return Ok(addrs);
        };
        let kept: Vec<SocketAddr> = addrs
            .iter()
            .copied()
            .filter(|a| match a.ip() {
                IpAddr::V4(ip) => rules.iter().any(|r| {
                    r.port.is_none_or(|p| p == a.port())
                        && in_net(IpAddr::V4(ip), IpAddr::V4(r.addr), r.prefix)
                }),
                IpAddr::V6(_) => false,
            })
            .collect();
        if kept.is_empty() {
            let shown: Vec<String> = addrs.iter().map(|a| a.ip().to_string()).collect();
            return Err(format!(
                "refused: the contract's network.children_egress is \"deny\" and {host}:{port} ({}) is not on network.allow; vm {:?} is a child (a fork or restored copy)",
                shown.join(", "),
                self.reg.vm
            ));
        }
        Ok(kept)
    }
}

/// Connects to the first of `addrs` that answers, each within `timeout`.
pub async fn connect(
    addrs: &[SocketAddr],
    dest: &str,
    timeout: std::time::Duration,
) -> Result<tokio::net::TcpStream, String> {
    let mut last = format!("{dest} has no address");
    for a in addrs {
        match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(a)).await {
            Ok(Ok(s)) => return Ok(s),
            Ok(Err(e)) => last = format!("cannot connect to {dest} ({a}): {e}"),
            Err(_) => last = format!("connecting to {dest} ({a}) timed out"),
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_host_rules_parse_and_match() {
        let r = HostRule::parse_list("127.0.0.1:8080, 10.0.0.0/8,[::1]:80,fe80::/10").expect("ok");
        assert_eq!(r.len(), 4);
        let sa = |s: &str| s.parse::<SocketAddr>().expect("addr");
        assert!(r[0].matches(sa("127.0.0.1:8080")));
        assert!(!r[0].matches(sa("127.0.0.1:8081")));
        assert!(r[1].matches(sa("10.1.2.3:1")));
        assert!(r[2].matches(sa("[::1]:80")));
        assert!(r[3].matches(sa("[fe80::1]:5")));
        for bad in ["1.2.3.4:x", "1.2.3.4/33", "nope", "[::1"] {
            assert!(HostRule::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn test_host_own_addresses() {
        let ifs = ["192.0.2.7".parse().expect("ip")];
        for ip in [
            "127.0.0.1",
            "127.9.9.9",
            "169.254.169.254",
            "0.0.0.0",
            "::1",
            "::ffff:127.0.0.1",
            "fe80::1",
            "64:ff9b::7f00:1",
            "192.0.2.7",
            "::ffff:192.0.2.7",
        ] {
            let ip: IpAddr = ip.parse().expect("ip");
            assert!(host_own(ip.to_canonical(), &ifs).is_some(), "{ip}");
        }
        for ip in ["192.0.2.8", "10.1.2.3", "2001:db8::1"] {
            let ip: IpAddr = ip.parse().expect("ip");
            assert!(host_own(ip, &ifs).is_none(), "{ip}");
        }
    }
}
