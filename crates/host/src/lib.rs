//! tine's engine as a library: everything between "a client asked for
//! something" and "a VMM process does it". tined serves it over HTTP; it
//! returns typed reports and typed errors and never prints.
//!
//! Read top-down: [`Host`] is one `$TINE_HOME`; [`vm`] starts, lists,
//! stops and removes vms (each one VMM process, `tine-vmm`); [`fork`]
//! takes moments of a running vm (fork, checkpoint, rollback, snapshot);
//! [`tree`] puts vms to sleep in the snapshot store and wakes them;
//! [`wake`] runs the wake-up round of every copy, [`gateway`] brackets each
//! moment with the effects gateway, [`net`] gives vms addresses and
//! isolates them. Every operation that changes a vm takes its [`lock`]
//! and records an [`intent`] before it acts, so that [`reconcile`] can put
//! things right after a crash.

pub mod agent;
pub mod branches;
pub mod cgroup;
pub mod checkpoints;
pub mod contract;
pub mod error;
pub mod exec;
pub mod fault;
pub mod fork;
pub mod gateway;
pub mod intent;
pub mod jail;
pub mod layers;
pub mod lock;
pub mod net;
pub mod proc;
pub mod providers;
pub mod reconcile;
pub mod settle;
pub use vmm::size;
pub mod state;
pub mod tree;
pub mod vm;
pub mod wake;

use std::path::{Path, PathBuf};

pub use error::{Code, Context, Error, Result};

/// The programs the engine starts.
#[derive(Clone, Debug)]
pub struct Binaries {
    /// `tine-vmm`, one per vm.
    pub vmm: PathBuf,
    /// `tine-gateway`, the effects gateway (one per home).
    pub gateway: PathBuf,
}

impl Binaries {
    /// `TINE_VMM_BIN` / `TINE_GATEWAY_BIN`, else the programs beside the
    /// running executable (cargo and an install put them together).
    pub fn find() -> Result<Binaries> {
        let exe = std::env::current_exe().context("cannot find the running executable")?;
        let dir = exe
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."));
        let pick = |env: &str, name: &str| -> Result<PathBuf> {
            let p = std::env::var_os(env)
                .map(PathBuf::from)
                .unwrap_or_else(|| dir.join(name));
            if !p.is_file() {
                return Err(Error::internal(format!(
                    "{} not found (build the workspace: cargo build --workspace; or set {env})",
                    p.display()
                )));
            }
            Ok(p)
        };
        Ok(Binaries {
            vmm: pick("TINE_VMM_BIN", "tine-vmm")?,
            gateway: pick("TINE_GATEWAY_BIN", "tine-gateway")?,
        })
    }

    /// The VMM's executable name (how its processes are found in /proc).
    pub fn vmm_name(&self) -> String {
        self.vmm
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "tine-vmm".into())
    }
}

/// The environment variables that configure the engine (the store, its
/// cache and fault points, S3 credentials, the KVM device, the VMMs'
/// logging). tined reports their fingerprint; the CLI restarts a tined
/// whose configuration differs from its own environment, so a command
/// runs as configured where it was typed.
pub const CONFIG_ENV: &[&str] = &[
    "TINE_STORE",
    "TINE_STORE_CACHE",
    "TINE_STORE_FAULT",
    "TINE_META",
    "TINE_EFFECTS_FAULT",
    "TINE_GATEWAY_ALLOW_PRIVATE",
    "TINE_GATEWAY_EXTRA_ROOTS",
    "TINE_HOST_FAULT",
    "TINE_KVM_DEVICE",
    "TINE_HOST_ID",
    "TINE_HOST_OFFER",
    "TINE_HEARTBEAT_MS",
    "TINE_FLEET_TOKEN",
    "TINE_LOG",
    "TINE_VMM_BIN",
    "TINE_GATEWAY_BIN",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ALLOW_HTTP",
];

/// A fingerprint of this process's [`CONFIG_ENV`] (values hashed, never shown).
pub fn config_fingerprint() -> String {
    let mut h = blake3::Hasher::new();
    for k in CONFIG_ENV {
        if let Some(v) = std::env::var_os(k) {
            h.update(k.as_bytes());
            h.update(b"=");
            h.update(v.as_encoded_bytes());
            h.update(b"\0");
        }
    }
    h.finalize().to_hex()[..16].to_string()
}

/// One tine home (`$TINE_HOME`): its vms, layers, store, leases, locks
/// and intents.
#[derive(Clone, Debug)]
pub struct Host {
    pub home: PathBuf,
    pub bins: Binaries,
}

impl Host {
    /// The engine on `home`, starting programs from `bins`.
    pub fn new(home: impl Into<PathBuf>, bins: Binaries) -> Host {
        Host {
            home: home.into(),
            bins,
        }
    }

    pub fn home(&self) -> &Path {
        &self.home
    }
}
