//! The effects gateway from the engine (docs/design/effects.md): every vm
//! with an agent is registered with the gateway (started on demand) under
//! its branch id, and every moment (fork, checkpoint, snapshot) is
//! bracketed by [`Moment::begin`] (after the quiesce: the barrier) and
//! [`Moment::end`] (after the VMM's answer: the copies are registered).
//! Also the effects of a lineage, their resolution, and the gateway's status.

use std::path::{Path, PathBuf};
use std::time::Duration;

use effects::control::{self, Request};
use effects::{MomentKind, Paths, Registration, Step};
use serde::{Deserialize, Serialize};

use crate::error::Context;
use crate::state::{VmDir, VmRecord};
use crate::{Error, Host};

/// How long a control call may take (a moment waits for responses being
/// written, at most a few seconds).
const CONTROL_TIMEOUT: Duration = Duration::from_secs(30);
/// Written into a snapshot directory: whose moment it is, so a restored
/// copy continues the lineage.
pub const SNAPSHOT_LINEAGE: &str = "tine-lineage.json";

/// What a snapshot directory says about its moment.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SnapshotLineage {
    pub branch: String,
    pub moment: String,
    pub lineage: Vec<Step>,
    /// The image of the vm it was taken of (as `ls` shows it).
    #[serde(default)]
    pub image: Option<String>,
    /// The vm it was taken of.
    #[serde(default)]
    pub vm: Option<String>,
}

/// A new branch or moment id.
pub fn new_id() -> crate::Result<String> {
    Ok(effects::random_id()?)
}

fn paths(h: &Host) -> Paths {
    Paths::new(&h.home)
}

/// Whether the vm talks to the gateway (it has an agent and a vsock device).
fn proxied(r: &VmRecord) -> bool {
    r.agent && r.vsock
}

/// The gateway's socket for a vm: where the VMM bridges guest connections
/// to CID 2 port 3128.
pub fn proxy_socket(vm: &VmDir) -> PathBuf {
    PathBuf::from(format!("{}_{}", vm.vsock().display(), effects::PROXY_PORT))
}

/// Starts the gateway if it does not answer.
pub fn ensure_gateway(h: &Host) -> crate::Result<()> {
    let p = paths(h);
    if control::answers(&p) {
        return Ok(());
    }
    let mut cmd = std::process::Command::new(&h.bins.gateway);
    cmd.arg("--home").arg(&h.home).env("TINE_HOME", &h.home);
    control::start(&p, cmd)?;
    Ok(())
}

fn call(h: &Host, req: Request) -> crate::Result<control::Reply> {
    Ok(control::call(&paths(h).control(), &req, CONTROL_TIMEOUT)?)
}

fn registration(vm: &VmDir, r: &VmRecord) -> crate::Result<Registration> {
    let c = vm.read_contract()?;
    Ok(Registration {
        branch: r.branch.clone(),
        vm: vm.name.clone(),
        socket: proxy_socket(vm),
        lineage: r.lineage.clone(),
        effects: c.effects,
        // The gateway applies the contract's egress as the tap does.
        network: c.network,
        peer_uid: r.uid,
    })
}

/// The gateway's CA certificate for a copy whose effective contract
/// (`contract_toml`, the wake's) has the gateway intercept HTTPS: the agent
/// installs it in the guest's trust store. The CA is the home's (made here
/// if the gateway has not made it yet). `None` when HTTPS is tunneled.
pub fn ca_for_wake(vm: &VmDir, contract_toml: &str) -> crate::Result<Option<String>> {
    let c = contract::Contract::parse(contract_toml)?;
    if c.effects.https != contract::Https::Intercept {
        return Ok(None);
    }
    // `vms/NAME` is in the home.
    let home = vm
        .dir
        .parent()
        .and_then(Path::parent)
        .with_context(|| format!("{} is not in a tine home", vm.dir.display()))?;
    let pem = effects::tls::ca_cert_pem(&Paths::new(home))
        .context("the effects gateway's CA (for intercepted HTTPS) cannot be read or made")?;
    Ok(Some(pem))
}

/// Gives a record made before branches existed its branch id.
pub fn ensure_branch(vm: &VmDir, r: &mut VmRecord) -> crate::Result<()> {
    if r.branch.is_empty() {
        r.branch = new_id()?;
        vm.write_record(r)?;
    }
    Ok(())
}

/// Registers a vm with the gateway (starting it), so its guest's proxy
/// connections are served as its branch. A vm whose gateway cannot be
/// reached still runs: its proxy connections are refused (nothing is sent
/// unjournaled), and the reason is returned for the caller to print.
pub fn register(h: &Host, vm: &VmDir, r: &VmRecord) -> Option<String> {
    if !proxied(r) {
        return None;
    }
    let res = (|| -> crate::Result<()> {
        ensure_gateway(h)?;
        call(
            h,
            Request::Register {
                reg: registration(vm, r)?,
            },
        )?;
        Ok(())
    })();
    res.err().map(|e| {
        format!(
            "effects gateway: vm {:?} is not registered, its http proxy refuses connections: {e:#}",
            vm.name
        )
    })
}

/// On `rm`: the gateway stops listening for the vm's branch.
pub fn unregister(h: &Host, r: &VmRecord) {
    if !proxied(r) || r.branch.is_empty() || !control::answers(&paths(h)) {
        return;
    }
    let _ = call(
        h,
        Request::Unregister {
            branch: r.branch.clone(),
        },
    );
}

/// A moment being taken of a vm's branch.
pub struct Moment {
    pub id: String,
    branch: String,
    kind: MomentKind,
    /// Whether the gateway was told (a vm without an agent has no branch
    /// traffic to hold).
    told: bool,
}

impl Moment {
    /// A new moment of `r` (no gateway call yet).
    pub fn new(r: &VmRecord, kind: MomentKind) -> crate::Result<Self> {
        Ok(Moment {
            id: new_id()?,
            branch: r.branch.clone(),
            kind,
            told: false,
        })
    }

    /// The lineage of a copy that continues from this moment of `r`.
    pub fn lineage_after(&self, r: &VmRecord) -> Vec<Step> {
        let mut l = r.lineage.clone();
        l.push(Step {
            branch: self.branch.clone(),
            moment: self.id.clone(),
            kind: self.kind,
        });
        l
    }

    /// After the quiesce, before the VMM takes the moment: the gateway
    /// holds the branch's responses and records the barrier. Fails (and
    /// the caller stops before pausing anything) when the vm is served by
    /// a gateway that cannot be told.
    pub fn begin(&mut self, h: &Host, vm: &VmDir, r: &VmRecord) -> crate::Result<()> {
        if !proxied(r) || self.branch.is_empty() {
            return Ok(());
        }
        let tell = || -> crate::Result<()> {
            ensure_gateway(h)?;
            let req = Request::Moment {
                branch: self.branch.clone(),
                moment: self.id.clone(),
                kind: self.kind,
            };
            match call(h, req.clone()) {
                Ok(_) => Ok(()),
                // Not registered (the gateway's state was removed): again.
                Err(_) => {
                    call(
                        h,
                        Request::Register {
                            reg: registration(vm, r)?,
                        },
                    )?;
                    call(h, req).map(|_| ())
                }
            }
        };
        tell().with_context(|| {
            format!(
                "the effects gateway could not record the moment of vm {:?}",
                vm.name
            )
        })?;
        self.told = true;
        Ok(())
    }

    /// After the VMM answered: `ok` (the moment was taken: the branch's
    /// old connections are cut) or not (the barrier goes); then the copies
    /// that continue from it are registered. Problems are returned to print.
    pub fn end(&self, h: &Host, ok: bool, copies: &[(&VmDir, &VmRecord)]) -> Vec<String> {
        let mut problems = Vec::new();
        let register: Vec<Registration> = copies
            .iter()
            .filter(|(_, r)| proxied(r))
            .filter_map(|(vm, r)| match registration(vm, r) {
                Ok(reg) => Some(reg),
                Err(e) => {
                    problems.push(format!("effects gateway: {}: {e:#}", vm.name));
                    None
                }
            })
            .collect();
        if !self.told && register.is_empty() {
            return problems;
        }
        let res = (|| -> crate::Result<()> {
            if self.told {
                call(
                    h,
                    Request::MomentDone {
                        branch: self.branch.clone(),
                        moment: self.id.clone(),
                        ok,
                        register,
                    },
                )?;
            } else {
                ensure_gateway(h)?;
                for reg in register {
                    call(h, Request::Register { reg })?;
                }
            }
            Ok(())
        })();
        if let Err(e) = res {
            problems.push(format!(
                "effects gateway: the copies of this moment are not registered (their http proxy refuses connections): {e:#}"
            ));
        }
        problems
    }
}

/// After a snapshot: the directory says whose moment it is.
pub fn write_snapshot_lineage(dir: &Path, r: &VmRecord, m: &Moment) -> crate::Result<()> {
    let l = SnapshotLineage {
        branch: r.branch.clone(),
        moment: m.id.clone(),
        lineage: r.lineage.clone(),
        image: Some(r.image.clone()),
        vm: Some(r.name.clone()),
    };
    crate::state::write_atomic(&dir.join(SNAPSHOT_LINEAGE), &serde_json::to_vec_pretty(&l)?)
}

/// What snapshot directory `dir` says about its moment, if anything.
pub fn snapshot_lineage(dir: &Path) -> Option<SnapshotLineage> {
    let text = std::fs::read_to_string(dir.join(SNAPSHOT_LINEAGE)).ok()?;
    serde_json::from_str(&text).ok()
}

/// The lineage of a vm restored from `dir` (empty: a new tree).
pub fn lineage_from_snapshot(dir: &Path) -> Vec<Step> {
    match snapshot_lineage(dir) {
        Some(l) => {
            let mut v = l.lineage;
            v.push(Step {
                branch: l.branch,
                moment: l.moment,
                kind: MomentKind::Snapshot,
            });
            v
        }
        None => Vec::new(),
    }
}

/// Starts the gateway if it does not run; its status.
pub fn start(h: &Host) -> crate::Result<control::Status> {
    ensure_gateway(h)?;
    control::status(&paths(h)).ok_or_else(|| Error::failed("the effects gateway does not answer"))
}

/// Stops the gateway; whether it ran (vms keep their registration; it is
/// re-bound at the next start).
pub fn stop(h: &Host) -> crate::Result<bool> {
    Ok(control::stop(&paths(h), Duration::from_secs(10))?)
}

/// The gateway's status, if it runs.
pub fn status(h: &Host) -> Option<control::Status> {
    control::status(&paths(h))
}

/// The effects in a vm's lineage (`tine effects NAME`).
#[derive(Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LineageEffects {
    pub vm: String,
    pub branch: String,
    pub tree: String,
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Object>))]
    pub lineage: Vec<Step>,
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Object>))]
    pub effects: Vec<effects::journal::EffectView>,
}

/// The journal `TINE_META` selects (the fleet's PostgreSQL, or this
/// home's SQLite file), opened as this host.
fn open_journal(h: &Host) -> crate::Result<effects::journal::Journal> {
    let p = paths(h);
    let meta = p.meta()?;
    if let effects::journal::Meta::Sqlite(journal_path) = &meta {
        if !journal_path.exists() {
            return Err(Error::not_found(format!(
                "no effects journal yet ({}): no vm has used the gateway",
                journal_path.display()
            )));
        }
    }
    Ok(effects::journal::Journal::connect(&meta, &p.host_id()?)?)
}

fn branch_of(
    h: &Host,
    j: &mut effects::journal::Journal,
    name: &str,
) -> crate::Result<effects::journal::BranchRow> {
    crate::state::validate_name(name)?;
    let b = match VmDir::new(&h.home, name).read_record() {
        Ok(r) if !r.branch.is_empty() => j.branch(&r.branch)?,
        _ => j.branch_of_vm(name)?,
    };
    b.ok_or_else(|| Error::not_found(format!("the effects journal knows no vm {name:?}")))
}

/// The effects in vm `name`'s lineage: its own and its ancestors' before
/// each fork point, which were replayed, which are in doubt.
pub fn lineage_effects(h: &Host, name: &str) -> crate::Result<LineageEffects> {
    let mut j = open_journal(h)?;
    let reg = branch_of(h, &mut j, name)?.registration;
    let effects = j.lineage_effects(&reg.branch)?;
    Ok(LineageEffects {
        vm: name.into(),
        branch: reg.branch.clone(),
        tree: reg.tree().to_string(),
        lineage: reg.lineage.clone(),
        effects,
    })
}

/// Decides an effect left in doubt in vm `name`'s tree: sent again on the
/// next request (`resend`) or failed. Returns the effect's id.
pub fn resolve(h: &Host, name: &str, key: &str, resend: bool) -> crate::Result<i64> {
    let mut j = open_journal(h)?;
    let reg = branch_of(h, &mut j, name)?.registration;
    j.resolve(reg.tree(), key, resend)?.ok_or_else(|| {
        Error::not_found(format!(
            "no in-doubt effect with key {key:?} in the tree of vm {name:?} (see `tine effects {name}`)"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A copy whose contract intercepts HTTPS gets the home's CA in its
    /// wake (the same one every time, the key kept 0600); others get none.
    #[test]
    fn test_the_wake_carries_the_ca_only_when_https_is_intercepted() {
        use std::os::unix::fs::PermissionsExt;
        let home = tempfile::tempdir().expect("home");
        let vm = VmDir::new(home.path(), "v");
        assert_eq!(ca_for_wake(&vm, "").expect("tunnel"), None);
        let toml = "[effects]\nhttps = \"intercept\"\n";
        let pem = ca_for_wake(&vm, toml).expect("ca").expect("some");
        assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"), "{pem}");
        assert!(
            !pem.contains("PRIVATE KEY"),
            "the key never leaves the host"
        );
        assert_eq!(ca_for_wake(&vm, toml).expect("again"), Some(pem));
        let ca = Paths::new(home.path()).ca();
        let mode = std::fs::metadata(&ca)
            .expect("ca file")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
