//! The wake-up step, host side (the agent's side is crates/agent).
//!
//! Before a moment is taken (fork, checkpoint, snapshot) the vm's agent
//! quiesces the guest: every process but the agent is frozen, so nothing
//! runs on the inherited RNG state, clock or identity. After it, every copy
//! gets a [`Wake`] built here from its role, its record and the contract:
//! fresh entropy (or the fork's shared seed), host time, hostname,
//! machine-id, network identity, what to do with inherited connections and
//! each secret. Copies are woken in parallel. A copy whose randomness step
//! failed is never reported ready: it is killed (fail closed).

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::bail;
use crate::error::Context;
use contract::{Clock, Contract, OnFork, Randomness};
use protocol::wake::{self, Role, SecretAction, WakeNet, WakeReport, WakeSecret};
use protocol::{QuiesceReport, Wake};
use serde::Serialize;

use crate::agent;
use crate::state::{VmDir, VmRecord};

/// How long a copy's agent may take to answer its wake.
const WAKE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long to wait for the agent's connection before a quiesce.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a rotate provider may run.
const PROVIDER_TIMEOUT: Duration = Duration::from_secs(30);

/// Fills `buf` from the kernel's CSPRNG.
pub fn random_bytes(buf: &mut [u8]) -> crate::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: getrandom(2) writes at most len bytes into the live,
        // exclusively borrowed tail of `buf`.
        let n = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e).context("getrandom failed");
            }
            continue;
        }
        done += n as usize;
    }
    Ok(())
}

fn random_hex(n: usize) -> crate::Result<String> {
    let mut b = vec![0u8; n];
    random_bytes(&mut b)?;
    Ok(wake::to_hex(&b))
}

/// The shared part of one wake round (one fork, one restore, ...).
pub struct Round<'a> {
    pub contract: &'a Contract,
    /// The seed every copy gets in reproducible mode.
    seed: [u8; 32],
}

impl<'a> Round<'a> {
    pub fn new(contract: &'a Contract) -> crate::Result<Self> {
        let mut seed = [0u8; 32];
        random_bytes(&mut seed)?;
        Ok(Round { contract, seed })
    }

    /// The wake message for one copy. `rotated` holds the values the
    /// providers made for this copy's `rotate` secrets.
    pub fn message(
        &self,
        role: Role,
        vm: &VmRecord,
        rotated: &[(String, Vec<u8>)],
    ) -> crate::Result<Wake> {
        let c = self.contract;
        let new_copy = matches!(role, Role::Child | Role::Restored);
        let randomness = c.randomness;
        let entropy_hex = match randomness {
            Randomness::Secure => random_hex(64)?,
            Randomness::Reproducible => wake::to_hex(&self.seed),
        };
        let machine_id = match (role, c.randomness) {
            (Role::Boot, _) | (Role::Child | Role::Restored, Randomness::Secure) => {
                Some(random_hex(16)?)
            }
            // Replays name the same child the same way.
            (Role::Child | Role::Restored, Randomness::Reproducible) => {
                let mut h = blake3::Hasher::new();
                h.update(&self.seed);
                h.update(vm.name.as_bytes());
                Some(wake::to_hex(&h.finalize().as_bytes()[..16]))
            }
            (Role::Parent | Role::Rollback, _) => None,
        };
        let net = match (role, vm.mac, vm.lease) {
            (Role::Boot | Role::Child | Role::Restored, Some(mac), Some(lease)) => Some(WakeNet {
                interface: None,
                mac: mac_text(&mac),
                ip: lease.cidr(),
                gateway: lease.gateway().to_string(),
            }),
            _ => None,
        };
        let who = if role == Role::Parent {
            "parent"
        } else {
            vm.name.as_str()
        };
        let reset_connections = match role {
            Role::Boot => false,
            Role::Rollback => true,
            _ => !c.keeps_connections(who),
        };
        let secrets = c
            .secrets
            .iter()
            .map(|(name, s)| {
                let action = match (new_copy, s.on_fork) {
                    (false, _) | (true, OnFork::Keep) => SecretAction::Keep,
                    (true, OnFork::Revoke) => SecretAction::Revoke {
                        hook: s.revoke_hook.clone(),
                    },
                    (true, OnFork::Rotate) => {
                        let v = rotated
                            .iter()
                            .find(|(n, _)| n == name)
                            .map(|(_, v)| v.clone())
                            .with_context(|| format!("no rotated value for secret {name:?}"))?;
                        SecretAction::Rotate {
                            value_hex: wake::to_hex(&v),
                        }
                    }
                };
                Ok(WakeSecret {
                    name: name.clone(),
                    path: s.path.clone(),
                    action,
                })
            })
            .collect::<crate::Result<Vec<_>>>()?;
        Ok(Wake {
            role,
            vm_id: vm.name.clone(),
            parent_id: vm.parent.clone(),
            hostname: vm.name.clone(),
            machine_id,
            net,
            randomness,
            entropy_hex,
            host_time_ns: match c.clock() {
                Clock::Host => Some(now_ns()),
                Clock::Virtual => None,
            },
            reset_connections,
            secrets: if role == Role::Boot {
                Vec::new()
            } else {
                secrets
            },
            run_hooks: c.hooks.run,
            hook_timeout_ms: c.hooks.timeout_s.saturating_mul(1000),
            contract_toml: c.to_toml(),
            // Filled in by `wake_one`, which knows the vm's home.
            ca_pem: None,
        })
    }
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

pub fn mac_text(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Runs every `rotate` secret's provider for copy `branch` of `parent`,
/// before anything is paused: a failing provider stops the fork cleanly.
/// The caller has checked the providers against the host's allow-list
/// ([`crate::providers::check`]).
pub fn rotate_values(
    c: &Contract,
    branch: &str,
    parent: &str,
) -> crate::Result<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    for (name, s) in &c.secrets {
        if s.on_fork != OnFork::Rotate {
            continue;
        }
        let Some(provider) = &s.provider else {
            bail!("secret {name:?} is rotated but has no provider");
        };
        let v = run_provider(provider, name, branch, parent).with_context(|| {
            format!(
                "the rotate provider of secret {name:?} failed for {branch:?}; nothing was paused"
            )
        })?;
        out.push((name.clone(), v));
    }
    Ok(out)
}

fn run_provider(
    provider: &str,
    secret: &str,
    branch: &str,
    parent: &str,
) -> crate::Result<Vec<u8>> {
    let out = crate::proc::output(
        std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("{provider} \"$@\""))
            .arg("tine-provider")
            .args([branch, parent])
            .env("TINE_BRANCH", branch)
            .env("TINE_PARENT", parent)
            .env("TINE_SECRET", secret),
        b"",
        PROVIDER_TIMEOUT,
    )
    .map_err(|e| crate::Error::failed(format!("{provider:?}: {e}")))?;
    if !out.status.success() {
        bail!(
            "{provider:?} {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    if out.stdout.is_empty() {
        bail!("{provider:?} printed nothing: a secret's value is its stdout");
    }
    Ok(out.stdout)
}

/// Freezes the guest's processes before a moment is taken. `None`: the vm
/// has no agent (micro guests): its copies are exact and are not woken.
pub fn quiesce(vm: &VmDir, r: &VmRecord) -> crate::Result<Option<QuiesceReport>> {
    if !r.agent {
        return Ok(None);
    }
    let mut s = agent::connect(&vm.vsock(), CONNECT_TIMEOUT).with_context(|| {
        format!(
            "the agent of vm {:?} does not answer: its copies could not be told who they are, so nothing was paused",
            vm.name
        )
    })?;
    s.set_read_timeout(Some(CONNECT_TIMEOUT))?;
    let rep = protocol::quiesce(&mut s, wake::DEFAULT_QUIESCE_TIMEOUT_MS)
        .with_context(|| format!("cannot quiesce vm {:?}", vm.name))?;
    Ok(Some(rep))
}

/// One copy's wake, as printed by `--json`.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct Woken {
    pub name: String,
    pub role: Role,
    /// Host-side time from sending Wake to the report, in ms.
    pub wake_ms: f64,
    pub report: Option<WakeReport>,
    /// Why the copy is not ready (unreachable agent, failed randomness).
    pub error: Option<String>,
}

impl Woken {
    /// Ready: the RNG was renewed as asked (other failed steps are reported
    /// but do not make the copy unsafe).
    pub fn ready(&self) -> bool {
        self.error.is_none() && self.report.as_ref().is_some_and(|r| r.randomness_ok)
    }
    /// `name: step: detail` lines for every failed step.
    pub fn failures(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .report
            .iter()
            .flat_map(|r| r.failed())
            .map(|s| format!("{}: {}: {}", self.name, s.name, s.detail))
            .collect();
        if let Some(e) = &self.error {
            v.push(format!("{}: {e}", self.name));
        }
        v
    }
}

/// Wakes one copy through its agent. A child was started parked: it is
/// resumed first (through its VMM's control socket).
pub fn wake_one(vm: &VmDir, w: Wake) -> Woken {
    let (vsock, name) = (vm.vsock(), vm.name.as_str());
    let role = w.role;
    let t0 = Instant::now();
    let res = (|| -> crate::Result<WakeReport> {
        if role == Role::Child {
            let call = vmm::api::call(&vm.api_socket(), &vmm::api::Request::Resume, WAKE_TIMEOUT)
                .context("cannot resume the child")?;
            if let Some(e) = &call.reply.error {
                bail!("cannot resume the child: {e}");
            }
        }
        let mut w = w;
        w.ca_pem = crate::gateway::ca_for_wake(vm, &w.contract_toml)?;
        let mut s = agent::connect(&vsock, WAKE_TIMEOUT)
            .context("connecting to the agent (nothing was asked of it)")?;
        s.set_read_timeout(Some(WAKE_TIMEOUT))?;
        // The host's time as of sending, not of building the message.
        if w.host_time_ns.is_some() {
            w.host_time_ns = Some(now_ns());
        }
        protocol::wake(&mut s, w).context("after the Wake message was sent")
    })();
    let wake_ms = t0.elapsed().as_secs_f64() * 1000.0;
    let (report, error) = match res {
        Ok(r) if r.randomness_ok => (Some(r), None),
        Ok(r) => {
            let why = r
                .steps
                .iter()
                .find(|s| s.name == "randomness")
                .map(|s| s.detail.clone())
                .unwrap_or_else(|| "no randomness step".into());
            (
                Some(r),
                Some(format!("randomness was not renewed ({why}): not ready")),
            )
        }
        // The whole chain: "Cannot connect to X" alone does not say whether
        // the socket was gone or refused.
        Err(e) => (
            None,
            Some(format!("wake failed: {}", vmm::trace::chain(&e))),
        ),
    };
    Woken {
        name: name.to_string(),
        role,
        wake_ms,
        report,
        error,
    }
}

/// Wakes every copy, as many at a time as the host has CPUs (a wake is
/// mostly guest CPU work: more at once only queues them); the result is in
/// the order given.
pub fn wake_all(copies: Vec<(VmDir, Wake)>) -> Vec<Woken> {
    let workers = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .min(copies.len().max(1));
    let names: Vec<(String, Role)> = copies
        .iter()
        .map(|(vm, w)| (vm.name.clone(), w.role))
        .collect();
    let queue = std::sync::Mutex::new(copies.into_iter().enumerate());
    let mut out: Vec<(usize, Woken)> = std::thread::scope(|sc| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                sc.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let next = queue.lock().unwrap_or_else(|e| e.into_inner()).next();
                        let Some((i, (vm, w))) = next else { break };
                        done.push((i, wake_one(&vm, w)));
                    }
                    done
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    out.sort_by_key(|(i, _)| *i);
    // A copy whose worker died is reported as not woken (so not ready).
    let mut out = out.into_iter().peekable();
    names
        .into_iter()
        .enumerate()
        .map(|(i, (name, role))| match out.next_if(|(j, _)| *j == i) {
            Some((_, w)) => w,
            None => Woken {
                name,
                role,
                wake_ms: 0.0,
                report: None,
                error: Some("the wake thread panicked".into()),
            },
        })
        .collect()
}
