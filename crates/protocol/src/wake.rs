//! The wake-up step: what the host tells the agent after a fork, restore or
//! rollback, and what the agent reports back.
//!
//! Before a vm is frozen the host sends [`Message::Quiesce`]: the agent
//! freezes every guest process but itself, so nothing in the guest can use
//! the inherited RNG state, clock or identity before it is renewed. After
//! the moment is taken each copy (the parent going on included) gets a
//! [`Wake`]; the agent applies its steps in order, thaws the guest's
//! processes once the randomness step is done, runs the wake hooks last,
//! and answers with a [`WakeReport`] that says what each step did.
//!
//! [`Message::Quiesce`]: crate::Message::Quiesce

use serde::{Deserialize, Serialize};

/// Longest a quiesced guest stays frozen without a [`Wake`]: then the agent
/// thaws it on its own, so a host that died mid-fork never leaves a guest
/// frozen for good. Measured on the guest's monotonic clock, which does not
/// advance while the vm is paused or asleep in a snapshot.
pub const DEFAULT_QUIESCE_TIMEOUT_MS: u64 = 60_000;

/// Who the woken copy is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A vm that just booted: it takes its identity (hostname, network)
    /// for the first time.
    Boot,
    /// The vm that was forked, going on with its own identity.
    Parent,
    /// A new child of a fork.
    Child,
    /// A new vm started from a snapshot on disk.
    Restored,
    /// The vm itself, rolled back to a checkpoint (its identity stays).
    Rollback,
}

/// `secure`: fresh entropy per copy, CRNG reseeded, clock stepped to host
/// time. `reproducible`: every child of one fork gets the same seed, no
/// reseed, and the clock continues from the snapshot moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Randomness {
    #[default]
    Secure,
    Reproducible,
}

/// The network identity a copy takes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WakeNet {
    /// Guest interface to configure; `None`: the first non-loopback one.
    #[serde(default)]
    pub interface: Option<String>,
    /// `52:54:00:xx:yy:zz`.
    pub mac: String,
    /// Address with prefix length, e.g. `10.213.0.5/24`.
    pub ip: String,
    /// Default route, e.g. `10.213.0.1`.
    pub gateway: String,
}

/// What happens to one secret file in this copy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum SecretAction {
    /// The file stays as it is.
    Keep,
    /// The file is overwritten with zeros, synced and removed; then `hook`
    /// (a guest path) runs with `TINE_SECRET` and `TINE_SECRET_PATH` set.
    Revoke {
        #[serde(default)]
        hook: Option<String>,
    },
    /// The file is replaced (atomically, mode 0600) by `value`.
    Rotate {
        /// The new contents, hex-encoded (secrets may be binary).
        value_hex: String,
    },
}

/// One secret registered with the vm.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WakeSecret {
    pub name: String,
    /// Absolute guest path.
    pub path: String,
    #[serde(flatten)]
    pub action: SecretAction,
}

/// The wake message: everything a copy needs to become itself.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wake {
    pub role: Role,
    /// The copy's vm name (its new id).
    pub vm_id: String,
    /// The vm it was forked or restored from, if any.
    #[serde(default)]
    pub parent_id: Option<String>,
    /// Set as the kernel hostname and written to /etc/hostname.
    pub hostname: String,
    /// 32 lowercase hex digits written to /etc/machine-id; `None` keeps it.
    #[serde(default)]
    pub machine_id: Option<String>,
    /// `None`: the network is left alone.
    #[serde(default)]
    pub net: Option<WakeNet>,
    pub randomness: Randomness,
    /// Bytes (hex) mixed into the kernel's pool with RNDADDENTROPY. Secure:
    /// fresh per copy, then RNDRESEEDCRNG. Reproducible: the fork's seed,
    /// the same in every child, and no reseed.
    pub entropy_hex: String,
    /// Host CLOCK_REALTIME in ns, taken just before the message is sent:
    /// secure steps the guest's clock to it (the transit is well under a
    /// millisecond). `None` keeps the guest's virtual time.
    #[serde(default)]
    pub host_time_ns: Option<u64>,
    /// Close (reset) TCP connections to non-loopback peers inherited from
    /// the moment: the remote end only knows one of the copies.
    pub reset_connections: bool,
    #[serde(default)]
    pub secrets: Vec<WakeSecret>,
    /// Run the executables in /etc/tine/wake.d, last.
    pub run_hooks: bool,
    /// Each hook is killed after this long (and reported as failed).
    pub hook_timeout_ms: u64,
    /// The effective contract, as TOML, written to /run/tine/contract.toml
    /// for the application to read (names and policies, never values).
    #[serde(default)]
    pub contract_toml: String,
    /// The effects gateway's CA certificate (PEM), when the contract has
    /// the gateway intercept HTTPS (`effects.https = "intercept"`): the
    /// agent adds it to the guest's trust store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_pem: Option<String>,
}

/// How one step ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepStatus {
    /// Done as asked.
    Ok,
    /// Not asked for, or nothing to do.
    Skipped,
    Failed,
}

/// One step the agent took (or did not).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WakeStep {
    /// `thaw`, `randomness`, `clock`, `hostname`, `machine_id`, `network`,
    /// `connections`, `secret:NAME`, `hook:FILE`, `contract`.
    pub name: String,
    pub status: StepStatus,
    /// What was done or what went wrong, for people (e.g. which reseed path
    /// ran, how many connections were reset, a hook's stderr tail).
    pub detail: String,
    /// Wall time of the step, in microseconds.
    pub micros: u64,
}

/// The agent's answer to [`Wake`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WakeReport {
    pub steps: Vec<WakeStep>,
    /// True when the randomness step succeeded (fail closed: a copy whose
    /// RNG was not renewed as asked must not be let loose).
    pub randomness_ok: bool,
    /// The agent's CPU time (user + system) spent on the wake, in µs.
    pub cpu_micros: u64,
    /// Wall time from receiving Wake to this report, in µs.
    pub wall_micros: u64,
    /// 32 bytes (hex) the agent read from /dev/urandom right
    /// after the randomness step, before anything else in the guest ran:
    /// distinct per copy when secure, equal in a fork's children when
    /// reproducible. Empty when the step failed or in the sandbox.
    #[serde(default)]
    pub sample_hex: String,
    /// Guest time from the kernel CRNG's last reseed by this agent (the
    /// quiesce's, for a copy of a moment) to `sample_hex`, in ms; `None`
    /// when the agent never reseeded.
    #[serde(default)]
    pub seed_age_ms: Option<u64>,
    /// How long the kernel keeps that seed before it reseeds on its own,
    /// mixing in hardware randomness ([`QuiesceReport::crng_window_ms`]). A
    /// reproducible child draws what its siblings draw only while
    /// `seed_age_ms` is below this.
    #[serde(default)]
    pub crng_window_ms: Option<u64>,
}

impl WakeReport {
    /// Steps that failed.
    pub fn failed(&self) -> impl Iterator<Item = &WakeStep> {
        self.steps.iter().filter(|s| s.status == StepStatus::Failed)
    }
}

/// The agent's answer to Quiesce.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuiesceReport {
    /// How the processes were frozen: `cgroup` (cgroup v2 freezer) or
    /// `sigstop` (no cgroup v2 in this guest).
    pub method: String,
    /// Processes frozen.
    pub processes: u32,
    /// Wall time to freeze them, in µs.
    pub micros: u64,
    /// Whether the kernel's CRNG was reseeded (RNDRESEEDCRNG) once the
    /// processes were frozen, so the moment's copies inherit a young seed.
    #[serde(default)]
    pub crng_reseeded: bool,
    /// How long the kernel keeps that seed, counted in guest time from the
    /// reseed (a copy's time runs from its resume): 60 s, or less in the
    /// guest's first minute (Linux 6.1 then reseeds at uptime/2). Within
    /// it, copies that draw alike get the same bytes; a reproducible fork's
    /// children match only inside this window.
    #[serde(default)]
    pub crng_window_ms: u64,
    /// Why the reseed failed, when it did.
    #[serde(default)]
    pub crng_error: Option<String>,
}

/// Hex without a crate: the protocol crate stays dependency-light.
pub fn to_hex(bytes: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(D[usize::from(b >> 4)] as char);
        s.push(D[usize::from(b & 15)] as char);
    }
    s
}

/// Inverse of [`to_hex`]; `None` on odd length or a non-hex digit.
pub fn from_hex(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    if b.len() % 2 != 0 {
        return None;
    }
    let nib = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    b.chunks(2)
        .map(|p| Some(nib(p[0])? << 4 | nib(p[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_hex_roundtrip_and_rejects() {
        let v = vec![0u8, 1, 0xab, 0xff];
        assert_eq!(to_hex(&v), "0001abff");
        assert_eq!(from_hex("0001ABff"), Some(v));
        assert_eq!(from_hex("abc"), None);
        assert_eq!(from_hex("zz"), None);
    }

    #[test]
    fn test_secret_action_wire_shape() {
        let s = WakeSecret {
            name: "db".into(),
            path: "/run/secrets/db".into(),
            action: SecretAction::Revoke { hook: None },
        };
        let j = serde_json::to_string(&s).expect("json");
        assert!(j.contains(r#""action":"revoke""#), "{j}");
        let back: WakeSecret = serde_json::from_str(&j).expect("back");
        assert_eq!(back, s);
    }
}
