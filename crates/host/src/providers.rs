//! The rotate providers this host runs. A provider is a host command, so
//! only the host's owner may name one: a contract that arrives inside a
//! snapshot, from the store or over the API runs no command that is not
//! in `$TINE_HOME/providers.allow` (one command per line). The `tine`
//! command line, which runs as the owner with `$TINE_HOME` in reach, adds
//! the providers its user names (`tine secret add --provider`, contract
//! files given to `contract set`, `run` and `fork`).

use std::path::{Path, PathBuf};

use contract::{Contract, OnFork};

use crate::error::Context;
use crate::{state, Error};

/// The allow-list's file name under `$TINE_HOME`.
pub const FILE: &str = "providers.allow";

fn path(home: &Path) -> PathBuf {
    home.join(FILE)
}

/// The commands this host's owner allowed.
pub fn allowed(home: &Path) -> Vec<String> {
    std::fs::read_to_string(path(home))
        .map(|t| {
            t.lines()
                .filter(|l| !l.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Adds `command` to the allow-list (the owner named it).
pub fn allow(home: &Path, command: &str) -> crate::Result<()> {
    if command.is_empty() || command.contains('\n') {
        return Err(Error::invalid(
            "a provider is one line: the command that prints a secret's value",
        ));
    }
    let mut list = allowed(home);
    if !list.iter().any(|c| c == command) {
        list.push(command.to_string());
        std::fs::create_dir_all(home)
            .with_context(|| format!("cannot create {}", home.display()))?;
        state::write_atomic(&path(home), (list.join("\n") + "\n").as_bytes())?;
    }
    Ok(())
}

/// Adds every rotate provider `contract` names.
pub fn allow_contract(home: &Path, contract: &Contract) -> crate::Result<()> {
    for s in contract.secrets.values() {
        if let (OnFork::Rotate, Some(p)) = (s.on_fork, &s.provider) {
            allow(home, p)?;
        }
    }
    Ok(())
}

/// Refuses a contract whose rotate providers this host does not allow.
pub fn check(home: &Path, contract: &Contract) -> crate::Result<()> {
    let list = allowed(home);
    for (name, s) in &contract.secrets {
        if let Some(p) = &s.provider {
            if !list.iter().any(|c| c == p) {
                return Err(Error::invalid(format!(
                    "secret {name:?}'s rotate provider {p:?} is not one this host runs: a provider is a host command, so only the host's owner names it (`tine secret add --provider`, or a contract file given to `tine contract set`, `run` or `fork`, adds it to {}). A contract that came with a snapshot or over the API cannot",
                    path(home).display()
                )));
            }
        }
    }
    Ok(())
}
