//! The fork contract: what every copy of a vm keeps, renews or loses when
//! it wakes (ARCHITECTURE.md, "Wake-up and the fork contract").
//!
//! A contract is TOML. It lives with the vm (`vms/NAME/contract.toml`),
//! travels in snapshot manifests, and `tine fork --contract FILE` overrides
//! it for one fork. Unknown keys and unknown policies are errors: a typo in
//! a safety policy must never silently fall back to a default. It names
//! secrets and their policies, never their values.
//!
//! ```toml
//! randomness = "secure"          # secure | reproducible
//! clock = "host"                 # host | virtual (default follows randomness)
//!
//! [network]
//! keep_connections = "parent"    # parent | none | the name of one child
//! children_egress = "allow"      # allow | deny (deny: only `allow` below)
//! allow = ["10.213.0.1:8080", "192.0.2.0/24"]
//!
//! [secrets.db]
//! path = "/run/secrets/db"
//! on_fork = "rotate"             # keep | revoke | rotate
//! provider = "/usr/local/bin/new-db-token"   # host command, for rotate
//! revoke_hook = "/usr/local/bin/db-revoked"  # guest command, for revoke
//!
//! [hooks]
//! run = true                     # run /etc/tine/wake.d/* last
//! timeout_s = 30
//!
//! [effects]                      # the effects gateway (docs/design/effects.md)
//! max_response_bytes = 1048576   # responses kept for replay, at most
//! https = "tunnel"               # tunnel | intercept (TLS ends at the gateway: journaled like HTTP)
//! [effects.destinations]         # host, host:port, *.suffix[:port] or *
//! "api.example.com" = "once-per-tree"   # once-per-tree | per-branch | deny-in-children | pass
//! ```

#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzz;

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use serde::{Deserialize, Serialize};

/// Errors in a contract, each naming what to fix.
#[derive(Debug, thiserror::Error)]
pub enum ContractError {
    #[error("invalid contract: {0}")]
    Parse(String),
    #[error("invalid contract: {0}")]
    Invalid(String),
}

/// Per-copy randomness (and, by default, clock) policy: the agent's own
/// type, so the contract and the wake message cannot drift apart.
pub use protocol::wake::Randomness;

/// What a copy's clock shows after wake.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Clock {
    /// Stepped to the host's time.
    Host,
    /// Continues from the snapshot moment.
    Virtual,
}

/// Where children may send packets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Egress {
    #[default]
    Allow,
    /// Only to the `allow` list.
    Deny,
}

/// What happens to a secret in a new copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnFork {
    Keep,
    /// Wiped in every child (and the revoke hook runs).
    Revoke,
    /// A fresh value per child from the host's provider command.
    Rotate,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Network {
    /// The copy that keeps inherited TCP connections: `parent` (default),
    /// `none`, or one child's name.
    #[serde(default = "default_keeper")]
    pub keep_connections: String,
    #[serde(default)]
    pub children_egress: Egress,
    /// `ADDR`, `ADDR/PREFIX`, `ADDR:PORT` or `ADDR/PREFIX:PORT` (IPv4, TCP
    /// or UDP port).
    #[serde(default)]
    pub allow: Vec<String>,
}

impl Default for Network {
    fn default() -> Self {
        Network {
            keep_connections: default_keeper(),
            children_egress: Egress::default(),
            allow: Vec::new(),
        }
    }
}

fn default_keeper() -> String {
    "parent".into()
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Secret {
    /// Absolute path of the secret's file in the guest.
    pub path: String,
    pub on_fork: OnFork,
    /// Host command for `rotate`: run as `PROVIDER BRANCH PARENT` (also in
    /// `TINE_BRANCH`, `TINE_PARENT`, `TINE_SECRET`); its stdout is the value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<String>,
    /// Guest command run after the file is wiped, for `revoke`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoke_hook: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hooks {
    #[serde(default = "yes")]
    pub run: bool,
    #[serde(default = "default_hook_timeout")]
    pub timeout_s: u64,
}

impl Default for Hooks {
    fn default() -> Self {
        Hooks {
            run: true,
            timeout_s: default_hook_timeout(),
        }
    }
}

fn yes() -> bool {
    true
}

fn default_hook_timeout() -> u64 {
    30
}

/// What the effects gateway does with a request to a destination
/// (docs/design/effects.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EffectPolicy {
    /// One execution per (tree, key): every other branch of the tree that
    /// sends the same key gets the recorded response (default for methods
    /// other than GET, HEAD and OPTIONS).
    OncePerTree,
    /// One execution per branch: a branch replays only what its ancestors
    /// did before its fork point, and executes its own.
    PerBranch,
    /// Children (copies made by a fork or a restore) are refused (403).
    DenyInChildren,
    /// Forwarded and journaled, never replayed (default for GET, HEAD and
    /// OPTIONS).
    Pass,
}

impl std::fmt::Display for EffectPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EffectPolicy::OncePerTree => "once-per-tree",
            EffectPolicy::PerBranch => "per-branch",
            EffectPolicy::DenyInChildren => "deny-in-children",
            EffectPolicy::Pass => "pass",
        })
    }
}

/// What the gateway does with a guest's HTTPS (CONNECT).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Https {
    /// Bytes are tunneled: journaled by destination, never replayed.
    #[default]
    Tunnel,
    /// TLS ends at the gateway (its CA is installed in the guest at wake),
    /// which opens its own verified TLS to the destination: requests are
    /// journaled and replayed exactly like plain HTTP.
    Intercept,
}

/// The `[effects]` section: policies of the effects gateway.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Effects {
    /// Responses up to this size are kept for replay; a larger one goes to
    /// the branch that made the request and is recorded as too large.
    #[serde(default = "default_max_response")]
    pub max_response_bytes: u64,
    /// Destination pattern (`host`, `host:port`, `*.suffix`,
    /// `*.suffix:port` or `*`) to policy; the most specific match wins.
    #[serde(default)]
    pub destinations: BTreeMap<String, EffectPolicy>,
    /// HTTPS: tunneled (default) or intercepted by the gateway.
    #[serde(default, skip_serializing_if = "is_tunnel")]
    pub https: Https,
}

fn is_tunnel(h: &Https) -> bool {
    *h == Https::Tunnel
}

impl Default for Effects {
    fn default() -> Self {
        Effects {
            max_response_bytes: default_max_response(),
            destinations: BTreeMap::new(),
            https: Https::Tunnel,
        }
    }
}

impl Effects {
    fn is_default(&self) -> bool {
        *self == Effects::default()
    }

    /// Checks every destination pattern and the size limit.
    pub fn validate(&self) -> Result<(), ContractError> {
        if self.max_response_bytes > MAX_RESPONSE_LIMIT {
            return Err(ContractError::Invalid(format!(
                "effects.max_response_bytes = {}: give at most {MAX_RESPONSE_LIMIT} (64 MiB)",
                self.max_response_bytes
            )));
        }
        for pat in self.destinations.keys() {
            check_destination_pattern(pat)?;
        }
        Ok(())
    }

    /// The policy for a request: `host` (lower case) and `port` of its
    /// destination, and whether its method is safe (GET, HEAD, OPTIONS).
    /// The most specific pattern wins: `host:port`, `host`, the longest
    /// `*.suffix:port`, the longest `*.suffix`, then `*`. A safe method is
    /// never replayed: it passes unless the destination denies children.
    pub fn policy_for(&self, host: &str, port: u16, safe: bool) -> EffectPolicy {
        let host = host.to_ascii_lowercase();
        let mut best: Option<(u32, EffectPolicy)> = None;
        for (pat, &policy) in &self.destinations {
            let (hpat, ppat) = match pat.rsplit_once(':') {
                Some((h, p)) => (h, p.parse::<u16>().ok()),
                None => (pat.as_str(), None),
            };
            if ppat.is_some_and(|p| p != port) {
                continue;
            }
            let port_bonus = u32::from(ppat.is_some());
            let score = if hpat == "*" {
                Some(port_bonus)
            } else if let Some(suffix) = hpat.strip_prefix("*.") {
                let dotted = format!(".{suffix}");
                host.ends_with(&dotted)
                    .then(|| 2 + 2 * suffix.len() as u32 + port_bonus)
            } else {
                (hpat == host).then_some(1_000_000 + port_bonus)
            };
            if let Some(s) = score {
                if best.is_none_or(|(b, _)| s > b) {
                    best = Some((s, policy));
                }
            }
        }
        match (best.map(|(_, p)| p), safe) {
            (Some(EffectPolicy::DenyInChildren), _) => EffectPolicy::DenyInChildren,
            (_, true) => EffectPolicy::Pass,
            (Some(p), false) => p,
            (None, false) => EffectPolicy::OncePerTree,
        }
    }
}

/// The largest `effects.max_response_bytes` (the journal keeps bodies).
pub const MAX_RESPONSE_LIMIT: u64 = 64 << 20;

fn default_max_response() -> u64 {
    1 << 20
}

fn check_destination_pattern(pat: &str) -> Result<(), ContractError> {
    let bad = |why: &str| {
        ContractError::Invalid(format!(
            "effects.destinations key {pat:?}: {why} (write host, host:port, *.suffix, *.suffix:port or *)"
        ))
    };
    let (host, port) = match pat.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (pat, None),
    };
    if let Some(p) = port {
        if p.parse::<u16>().ok().filter(|p| *p > 0).is_none() {
            return Err(bad("bad port"));
        }
    }
    if host == "*" {
        return Ok(());
    }
    let name = host.strip_prefix("*.").unwrap_or(host);
    let ok = !name.is_empty()
        && name.len() <= 253
        && !name.starts_with('.')
        && !name.ends_with('.')
        && !name.contains("..")
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.');
    if !ok {
        return Err(bad("bad host (lower-case letters, digits, '-' and '.')"));
    }
    Ok(())
}

/// The whole contract.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Contract {
    #[serde(default)]
    pub randomness: Randomness,
    /// `None`: host for secure, virtual for reproducible.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock: Option<Clock>,
    #[serde(default)]
    pub network: Network,
    #[serde(default)]
    pub secrets: BTreeMap<String, Secret>,
    #[serde(default)]
    pub hooks: Hooks,
    #[serde(default, skip_serializing_if = "Effects::is_default")]
    pub effects: Effects,
}

/// One parsed `network.allow` entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllowRule {
    pub addr: Ipv4Addr,
    pub prefix: u8,
    pub port: Option<u16>,
}

impl std::fmt::Display for AllowRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)?;
        if let Some(p) = self.port {
            write!(f, ":{p}")?;
        }
        Ok(())
    }
}

impl AllowRule {
    pub fn parse(s: &str) -> Result<Self, ContractError> {
        let bad = |why: &str| {
            ContractError::Invalid(format!(
                "network.allow entry {s:?}: {why} (write ADDR, ADDR/PREFIX, ADDR:PORT or ADDR/PREFIX:PORT, IPv4)"
            ))
        };
        let (net, port) = match s.rsplit_once(':') {
            Some((n, p)) => (n, Some(p.parse::<u16>().map_err(|_| bad("bad port"))?)),
            None => (s, None),
        };
        let (addr, prefix) = match net.split_once('/') {
            Some((a, p)) => (
                a,
                p.parse::<u8>()
                    .ok()
                    .filter(|p| *p <= 32)
                    .ok_or_else(|| bad("bad prefix length"))?,
            ),
            None => (net, 32),
        };
        let addr: Ipv4Addr = addr.parse().map_err(|_| bad("bad address"))?;
        Ok(AllowRule { addr, prefix, port })
    }
}

impl Contract {
    /// Parses and validates TOML.
    pub fn parse(text: &str) -> Result<Self, ContractError> {
        let c: Contract = toml::from_str(text)
            .map_err(|e| ContractError::Parse(e.to_string().trim_end().replace('\n', "\n  ")))?;
        c.validate()?;
        Ok(c)
    }

    /// The TOML form (what `tine contract show` prints).
    pub fn to_toml(&self) -> String {
        // A struct of strings, enums and maps always serializes.
        toml::to_string(self).unwrap_or_default()
    }

    /// The clock policy in effect.
    pub fn clock(&self) -> Clock {
        self.clock.unwrap_or(match self.randomness {
            Randomness::Secure => Clock::Host,
            Randomness::Reproducible => Clock::Virtual,
        })
    }

    /// The parsed allow list.
    pub fn allow_rules(&self) -> Result<Vec<AllowRule>, ContractError> {
        self.network
            .allow
            .iter()
            .map(|s| AllowRule::parse(s))
            .collect()
    }

    /// Checks what serde cannot: paths, names, the policies' companions.
    pub fn validate(&self) -> Result<(), ContractError> {
        let invalid = |m: String| Err(ContractError::Invalid(m));
        self.allow_rules()?;
        self.effects.validate()?;
        let k = &self.network.keep_connections;
        if k.is_empty() {
            return invalid(
                "network.keep_connections is empty: name `parent`, `none` or one child".into(),
            );
        }
        if self.hooks.timeout_s == 0 || self.hooks.timeout_s > 3600 {
            return invalid(format!(
                "hooks.timeout_s = {}: give 1 to 3600 seconds",
                self.hooks.timeout_s
            ));
        }
        for (name, s) in &self.secrets {
            if name.is_empty()
                || !name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._-".contains(c))
            {
                return invalid(format!(
                    "secret name {name:?}: use letters, digits, '.', '_' and '-'"
                ));
            }
            if !s.path.starts_with('/') || s.path.contains("/../") || s.path.ends_with('/') {
                return invalid(format!(
                    "secrets.{name}.path {:?}: give an absolute file path in the guest",
                    s.path
                ));
            }
            match (s.on_fork, &s.provider) {
                (OnFork::Rotate, None) => {
                    return invalid(format!(
                        "secrets.{name}: on_fork = \"rotate\" needs `provider`, the host command that makes each child's value"
                    ))
                }
                (OnFork::Keep | OnFork::Revoke, Some(_)) => {
                    return invalid(format!(
                        "secrets.{name}: `provider` is only for on_fork = \"rotate\""
                    ))
                }
                _ => {}
            }
            if let Some(h) = &s.revoke_hook {
                if s.on_fork != OnFork::Revoke {
                    return invalid(format!(
                        "secrets.{name}: `revoke_hook` is only for on_fork = \"revoke\""
                    ));
                }
                if !h.starts_with('/') {
                    return invalid(format!(
                        "secrets.{name}.revoke_hook {h:?}: give an absolute path in the guest"
                    ));
                }
            }
        }
        Ok(())
    }

    /// `self` with `over`'s policies; secrets merge (`over` wins by name),
    /// so an override file need not repeat the vm's registered secrets.
    pub fn overridden_by(&self, over: &Contract) -> Contract {
        let mut c = over.clone();
        for (k, v) in &self.secrets {
            c.secrets.entry(k.clone()).or_insert_with(|| v.clone());
        }
        c
    }

    /// Whether `copy` (a child's name, or `parent`) keeps inherited
    /// connections.
    pub fn keeps_connections(&self, copy: &str) -> bool {
        self.network.keep_connections == copy
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_defaults_and_roundtrip() {
        let c = Contract::parse("").expect("empty is the default");
        assert_eq!(
            c,
            Contract::default().overridden_by(&Contract::parse("").expect("p"))
        );
        assert_eq!(c.randomness, Randomness::Secure);
        assert_eq!(c.clock(), Clock::Host);
        assert!(c.keeps_connections("parent"));
        assert!(c.hooks.run);
        let text = r#"
randomness = "reproducible"
[network]
keep_connections = "none"
children_egress = "deny"
allow = ["10.213.0.1:8080", "192.0.2.0/24"]
[secrets.db]
path = "/run/secrets/db"
on_fork = "rotate"
provider = "/bin/echo"
[secrets.tok]
path = "/run/secrets/tok"
on_fork = "revoke"
revoke_hook = "/bin/true"
"#;
        let c = Contract::parse(text).expect("parse");
        assert_eq!(c.clock(), Clock::Virtual);
        assert_eq!(c.network.children_egress, Egress::Deny);
        let rules = c.allow_rules().expect("rules");
        assert_eq!(rules[0].to_string(), "10.213.0.1/32:8080");
        assert_eq!(rules[1].to_string(), "192.0.2.0/24");
        let again = Contract::parse(&c.to_toml()).expect("its own output parses");
        assert_eq!(again, c);
    }

    #[test]
    fn test_bad_contracts_name_the_problem() {
        for (text, needle) in [
            ("randomnes = \"secure\"", "randomnes"),
            ("randomness = \"chaotic\"", "chaotic"),
            ("[network]\nchildren_egress = \"maybe\"", "maybe"),
            ("[network]\nallow = [\"10.0.0.300\"]", "10.0.0.300"),
            ("[network]\nallow = [\"10.0.0.1:99999\"]", "bad port"),
            (
                "[secrets.a]\npath = \"/x\"\non_fork = \"rotate\"",
                "provider",
            ),
            ("[secrets.a]\npath = \"x\"\non_fork = \"keep\"", "absolute"),
            ("[secrets.a]\npath = \"/x\"\non_fork = \"burn\"", "burn"),
            (
                "[secrets.\"a b\"]\npath = \"/x\"\non_fork = \"keep\"",
                "secret name",
            ),
            ("[hooks]\ntimeout_s = 0", "timeout_s"),
            ("[hooks]\nrun = true\nextra = 1", "extra"),
        ] {
            let e = Contract::parse(text).expect_err(text).to_string();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
    }

    #[test]
    fn test_effects_section_and_policy_choice() {
        use EffectPolicy::*;
        let c = Contract::parse(
            r#"
[effects]
max_response_bytes = 4096
[effects.destinations]
"*" = "per-branch"
"*.example.com" = "deny-in-children"
"api.example.com" = "pass"
"api.example.com:8443" = "once-per-tree"
"10.0.0.1:80" = "deny-in-children"
"#,
        )
        .expect("parse");
        let e = &c.effects;
        assert_eq!(e.max_response_bytes, 4096);
        assert_eq!(e.https, Https::Tunnel);
        let i = Contract::parse("[effects]\nhttps = \"intercept\"").expect("intercept");
        assert_eq!(i.effects.https, Https::Intercept);
        assert_eq!(Contract::parse(&i.to_toml()).expect("again"), i);
        assert!(Contract::parse("[effects]\nhttps = \"sniff\"").is_err());
        assert_eq!(e.policy_for("api.example.com", 8443, false), OncePerTree);
        assert_eq!(e.policy_for("API.example.com", 80, false), Pass);
        assert_eq!(e.policy_for("x.example.com", 80, false), DenyInChildren);
        assert_eq!(e.policy_for("x.example.com", 80, true), DenyInChildren);
        assert_eq!(e.policy_for("example.com", 80, false), PerBranch);
        assert_eq!(e.policy_for("example.com", 80, true), Pass);
        assert_eq!(e.policy_for("10.0.0.1", 80, false), DenyInChildren);
        assert_eq!(e.policy_for("10.0.0.1", 81, false), PerBranch);
        let d = Effects::default();
        assert_eq!(d.policy_for("a", 1, false), OncePerTree);
        assert_eq!(d.policy_for("a", 1, true), Pass);
        assert_eq!(d.max_response_bytes, 1 << 20);
        assert_eq!(Contract::parse(&c.to_toml()).expect("again"), c);
        assert!(!Contract::default().to_toml().contains("effects"));
        for (text, needle) in [
            (
                "[effects.destinations]
\"a:0\" = \"pass\"",
                "bad port",
            ),
            (
                "[effects.destinations]
\"A.com\" = \"pass\"",
                "bad host",
            ),
            (
                "[effects.destinations]
\"a.com\" = \"twice\"",
                "twice",
            ),
            (
                "[effects]
max_response_bytes = 999999999",
                "max_response_bytes",
            ),
            (
                "[effects]
limit = 1",
                "limit",
            ),
        ] {
            let e = Contract::parse(text).expect_err(text).to_string();
            assert!(e.contains(needle), "{text:?}: {e}");
        }
    }

    #[test]
    fn test_override_keeps_registered_secrets() {
        let vm = Contract::parse("[secrets.a]\npath = \"/a\"\non_fork = \"keep\"").expect("vm");
        let over = Contract::parse(
            "randomness = \"reproducible\"\n[secrets.b]\npath = \"/b\"\non_fork = \"revoke\"",
        )
        .expect("over");
        let c = vm.overridden_by(&over);
        assert_eq!(c.randomness, Randomness::Reproducible);
        assert_eq!(c.secrets.len(), 2);
    }
}
