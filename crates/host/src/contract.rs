//! A vm's fork contract and its secrets: `vms/NAME/contract.toml`
//! (crates/contract). Secrets are registered by name and policy; their
//! values only ever reach the guest.

use std::path::Path;
use std::time::Duration;

use contract::{Contract, OnFork, Secret};
use protocol::client;
use serde::{Deserialize, Serialize};

use crate::error::Context;
use crate::state::{self, VmDir};
use crate::{agent, bail, Error, Host};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

fn existing(h: &Host, name: &str) -> crate::Result<VmDir> {
    state::validate_name(name)?;
    let vm = VmDir::new(&h.home, name);
    vm.read_record()?;
    Ok(vm)
}

/// A vm's effective fork contract, as TOML.
pub fn show(h: &Host, name: &str) -> crate::Result<String> {
    Ok(existing(h, name)?.read_contract()?.to_toml())
}

/// Replaces a vm's contract with `toml` (its registered secrets stay
/// unless `toml` names them). Returns the new contract as TOML.
pub fn set(h: &Host, name: &str, toml: &str) -> crate::Result<String> {
    crate::state::validate_name(name)?;
    let _lock = crate::lock::acquire(&h.home, name, crate::lock::DEFAULT_WAIT)?;
    let vm = existing(h, name)?;
    let c = crate::fork::effective_contract(&vm, Some(toml))?;
    crate::providers::check(&h.home, &c)?;
    vm.write_contract(&c)?;
    Ok(c.to_toml())
}

/// One registered secret (never its value).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SecretInfo {
    pub name: String,
    pub path: String,
    /// keep | revoke | rotate.
    pub on_fork: String,
}

/// What to do with a secret at fork.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SecretSpec {
    /// Where its file lives in the guest (absolute).
    pub path: String,
    /// keep | revoke | rotate.
    pub on_fork: String,
    /// For rotate: host command printing a child's value.
    #[serde(default)]
    pub provider: Option<String>,
    /// For revoke: guest command run after the file is wiped.
    #[serde(default)]
    pub revoke_hook: Option<String>,
}

pub fn on_fork_text(o: OnFork) -> &'static str {
    match o {
        OnFork::Keep => "keep",
        OnFork::Revoke => "revoke",
        OnFork::Rotate => "rotate",
    }
}

fn parse_on_fork(s: &str) -> crate::Result<OnFork> {
    match s {
        "keep" => Ok(OnFork::Keep),
        "revoke" => Ok(OnFork::Revoke),
        "rotate" => Ok(OnFork::Rotate),
        _ => Err(Error::invalid(format!(
            "on_fork {s:?}: say keep, revoke or rotate"
        ))),
    }
}

/// The secrets registered with a vm.
pub fn secrets(h: &Host, name: &str) -> crate::Result<Vec<SecretInfo>> {
    Ok(existing(h, name)?
        .read_contract()?
        .secrets
        .iter()
        .map(|(n, s)| SecretInfo {
            name: n.clone(),
            path: s.path.clone(),
            on_fork: on_fork_text(s.on_fork).into(),
        })
        .collect())
}

/// Writes secret `secret` (`value`) into a running vm and registers what
/// forks do to it.
pub fn add_secret(
    h: &Host,
    name: &str,
    secret: &str,
    spec: &SecretSpec,
    value: &[u8],
) -> crate::Result<SecretInfo> {
    crate::state::validate_name(name)?;
    let _lock = crate::lock::acquire(&h.home, name, crate::lock::DEFAULT_WAIT)?;
    let vm = crate::exec::agent_vm(h, name)?;
    let on_fork = parse_on_fork(&spec.on_fork)?;
    let mut c: Contract = vm.read_contract()?;
    c.secrets.insert(
        secret.to_string(),
        Secret {
            path: spec.path.clone(),
            on_fork,
            provider: spec.provider.clone(),
            revoke_hook: spec.revoke_hook.clone(),
        },
    );
    // Checked before anything is written.
    c.validate()?;
    crate::providers::check(&h.home, &c)?;
    if value.is_empty() {
        return Err(Error::invalid(format!(
            "the secret {secret:?} is empty: give its value"
        )));
    }
    let dir = Path::new(&spec.path)
        .parent()
        .and_then(Path::to_str)
        .unwrap_or("/")
        .to_string();
    let mut conn = agent::connect(&vm.vsock(), CONNECT_TIMEOUT)
        .with_context(|| format!("cannot reach the agent of vm {name:?}"))?;
    let mut err = Vec::new();
    let info = client::exec(
        &mut conn,
        client::ExecRequest::new(["mkdir", "-p", "-m", "0700", dir.as_str()]),
        None::<std::io::Empty>,
        std::io::sink(),
        &mut err,
    )?;
    if info.exit_code() != 0 {
        bail!(
            "cannot create {dir} in vm {name:?}: {}",
            String::from_utf8_lossy(&err).trim()
        );
    }
    let mut conn = agent::connect(&vm.vsock(), CONNECT_TIMEOUT)?;
    client::write_file(&mut conn, &spec.path, 0o600, value)
        .with_context(|| format!("cannot write {name}:{}", spec.path))?;
    vm.write_contract(&c)?;
    Ok(SecretInfo {
        name: secret.into(),
        path: spec.path.clone(),
        on_fork: on_fork_text(on_fork).into(),
    })
}
