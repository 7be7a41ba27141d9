//! The effects gateway from the CLI (docs/design/effects.md): `tine
//! gateway start|stop|status`, `tine effects NAME`, `tine effects resolve`,
//! and the hooks the vm verbs call: every vm with an agent is registered
//! with the gateway (started on demand) under its branch id, and every
//! moment (fork, checkpoint, snapshot) is bracketed by `moment` (after the
//! quiesce: the barrier) and `moment_done` (after the VMM's answer: the
//! copies are registered).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use effects::control::{self, Request};
use effects::{MomentKind, Paths, Registration, Step};
use serde::{Deserialize, Serialize};

use crate::state::{VmDir, VmRecord};

/// How long a control call may take (a moment waits for responses being
/// written, at most a few seconds).
const CONTROL_TIMEOUT: Duration = Duration::from_secs(30);
/// Written into a snapshot directory: whose moment it is, so a restored
/// copy continues the lineage.
pub const SNAPSHOT_LINEAGE: &str = "tine-lineage.json";

/// `tine gateway ...`.
#[derive(clap::Subcommand, Debug)]
pub enum GatewayCommand {
    /// Start the effects gateway (does nothing if it runs).
    Start,
    /// Stop it (vms keep their registration; it is re-bound at the next start).
    Stop,
    /// Pid, registered vms, effects per state.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Run the gateway in the foreground (what `start` runs).
    #[command(hide = true)]
    Serve,
}

/// `tine effects NAME [--json]` or `tine effects resolve NAME KEY --resend|--fail`.
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct EffectsArgs {
    #[command(subcommand)]
    cmd: Option<EffectsCommand>,
    /// The vm whose lineage's effects to list.
    name: Option<String>,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Subcommand, Debug)]
enum EffectsCommand {
    /// Decide an in-doubt effect: send it again on the next request, or
    /// treat it as failed.
    Resolve {
        name: String,
        key: String,
        #[arg(long, conflicts_with = "fail", required_unless_present = "fail")]
        resend: bool,
        #[arg(long)]
        fail: bool,
    },
}

/// What a snapshot directory says about its moment.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct SnapshotLineage {
    branch: String,
    moment: String,
    lineage: Vec<Step>,
}

/// A new branch or moment id.
pub fn new_id() -> anyhow::Result<String> {
    Ok(effects::random_id()?)
}

fn paths(home: &Path) -> Paths {
    Paths::new(home)
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
pub fn ensure_gateway(home: &Path) -> anyhow::Result<()> {
    let p = paths(home);
    if control::answers(&p) {
        return Ok(());
    }
    let exe = std::env::current_exe().context("cannot find the tine binary")?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["gateway", "serve"]).env("TINE_HOME", home);
    control::start(&p, cmd)?;
    Ok(())
}

fn call(home: &Path, req: Request) -> anyhow::Result<control::Reply> {
    Ok(control::call(
        &paths(home).control(),
        &req,
        CONTROL_TIMEOUT,
    )?)
}

fn registration(vm: &VmDir, r: &VmRecord) -> anyhow::Result<Registration> {
    Ok(Registration {
        branch: r.branch.clone(),
        vm: vm.name.clone(),
        socket: proxy_socket(vm),
        lineage: r.lineage.clone(),
        effects: vm.read_contract()?.effects,
    })
}

/// Gives a record made before branches existed its branch id.
pub fn ensure_branch(vm: &VmDir, r: &mut VmRecord) -> anyhow::Result<()> {
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
pub fn register(home: &Path, vm: &VmDir, r: &VmRecord) -> Option<String> {
    if !proxied(r) {
        return None;
    }
    let res = (|| -> anyhow::Result<()> {
        ensure_gateway(home)?;
        call(
            home,
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
pub fn unregister(home: &Path, r: &VmRecord) {
    if !proxied(r) || r.branch.is_empty() || !control::answers(&paths(home)) {
        return;
    }
    let _ = call(
        home,
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
    pub fn new(r: &VmRecord, kind: MomentKind) -> anyhow::Result<Self> {
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
    pub fn begin(&mut self, home: &Path, vm: &VmDir, r: &VmRecord) -> anyhow::Result<()> {
        if !proxied(r) || self.branch.is_empty() {
            return Ok(());
        }
        let tell = || -> anyhow::Result<()> {
            ensure_gateway(home)?;
            let req = Request::Moment {
                branch: self.branch.clone(),
                moment: self.id.clone(),
                kind: self.kind,
            };
            match call(home, req.clone()) {
                Ok(_) => Ok(()),
                // Not registered (the gateway's state was removed): again.
                Err(_) => {
                    call(
                        home,
                        Request::Register {
                            reg: registration(vm, r)?,
                        },
                    )?;
                    call(home, req).map(|_| ())
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
    pub fn end(&self, home: &Path, ok: bool, copies: &[(&VmDir, &VmRecord)]) -> Vec<String> {
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
        let res = (|| -> anyhow::Result<()> {
            if self.told {
                call(
                    home,
                    Request::MomentDone {
                        branch: self.branch.clone(),
                        moment: self.id.clone(),
                        ok,
                        register,
                    },
                )?;
            } else {
                ensure_gateway(home)?;
                for reg in register {
                    call(home, Request::Register { reg })?;
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

/// After `snapshot NAME --to DIR`: the directory says whose moment it is.
pub fn write_snapshot_lineage(dir: &Path, r: &VmRecord, m: &Moment) -> anyhow::Result<()> {
    let l = SnapshotLineage {
        branch: r.branch.clone(),
        moment: m.id.clone(),
        lineage: r.lineage.clone(),
    };
    crate::state::write_atomic(&dir.join(SNAPSHOT_LINEAGE), &serde_json::to_vec_pretty(&l)?)
}

/// The lineage of a vm restored from `dir` (empty: a new tree).
pub fn lineage_from_snapshot(dir: &Path) -> Vec<Step> {
    let Ok(text) = std::fs::read_to_string(dir.join(SNAPSHOT_LINEAGE)) else {
        return Vec::new();
    };
    match serde_json::from_str::<SnapshotLineage>(&text) {
        Ok(l) => {
            let mut v = l.lineage;
            v.push(Step {
                branch: l.branch,
                moment: l.moment,
                kind: MomentKind::Snapshot,
            });
            v
        }
        Err(_) => Vec::new(),
    }
}

/// `tine gateway ...`.
pub fn gateway(home: &Path, cmd: GatewayCommand) -> anyhow::Result<ExitCode> {
    let p = paths(home);
    match cmd {
        GatewayCommand::Serve => {
            effects::gateway::serve(effects::gateway::Options::new(home))?;
        }
        GatewayCommand::Start => {
            ensure_gateway(home)?;
            let st = control::status(&p).context("the gateway does not answer")?;
            println!("gateway running (pid {}), journal {}", st.pid, st.journal);
        }
        GatewayCommand::Stop => {
            if control::stop(&p, Duration::from_secs(10))? {
                println!("gateway stopped");
            } else {
                println!("gateway not running");
            }
        }
        GatewayCommand::Status { json } => {
            let st = control::status(&p);
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({
                        "running": st.is_some(),
                        "status": st,
                    }))?
                );
            } else {
                match st {
                    None => println!("gateway not running"),
                    Some(st) => {
                        println!(
                            "gateway running: pid {}, journal {} (schema {})",
                            st.pid, st.journal, st.schema_version
                        );
                        for (vm, b) in &st.branches {
                            println!("  vm {vm}\tbranch {b}");
                        }
                        for (state, n) in &st.effects {
                            println!("  {n} {state}");
                        }
                    }
                }
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `tine effects ...`: runs here for a vm here, else in the machine.
pub fn effects_cmd(home: &Path, args: EffectsArgs) -> anyhow::Result<ExitCode> {
    let name = match (&args.cmd, &args.name) {
        (Some(EffectsCommand::Resolve { name, .. }), _) | (None, Some(name)) => name.clone(),
        (None, None) => bail!("say which vm: tine effects NAME"),
    };
    crate::state::validate_name(&name)?;
    if !VmDir::new(home, &name).exists()
        && crate::machine::needed()?
        && crate::machine::status(home).state == crate::machine::MachineState::Running
    {
        let argv: Vec<String> = std::env::args().skip(1).collect();
        return Ok(crate::machine::exit_code(crate::machine::forward(
            home,
            &argv,
            &[],
            false,
        )?));
    }
    let journal_path = paths(home).journal();
    if !journal_path.exists() {
        bail!(
            "no effects journal yet ({}): no vm has used the gateway",
            journal_path.display()
        );
    }
    let mut j = effects::journal::Journal::open(&journal_path)?;
    let branch = match VmDir::new(home, &name).read_record() {
        Ok(r) if !r.branch.is_empty() => j.branch(&r.branch)?,
        _ => j.branch_of_vm(&name)?,
    }
    .with_context(|| format!("the effects journal knows no vm {name:?}"))?;
    let reg = branch.registration;
    match args.cmd {
        Some(EffectsCommand::Resolve { key, resend, .. }) => {
            match j.resolve(reg.tree(), &key, resend)? {
                Some(id) => println!(
                    "effect {id} ({key}): {}",
                    if resend {
                        "the next request with this key is sent again"
                    } else {
                        "failed; requests with this key get an error"
                    }
                ),
                None => bail!("no in-doubt effect with key {key:?} in the tree of vm {name:?} (see `tine effects {name}`)"),
            }
            Ok(ExitCode::SUCCESS)
        }
        None => {
            let list = j.lineage_effects(&reg.branch)?;
            if args.json {
                println!(
                    "{}",
                    serde_json::to_string(&serde_json::json!({
                        "vm": name,
                        "branch": reg.branch,
                        "tree": reg.tree(),
                        "lineage": reg.lineage,
                        "effects": list,
                    }))?
                );
                return Ok(ExitCode::SUCCESS);
            }
            if list.is_empty() {
                println!("{name}: no effects");
            }
            for e in &list {
                let when = e.completed_ms.unwrap_or(e.started_ms) - e.started_ms;
                println!(
                    "{:>4} {:<9} {:>3} {} {} key {} ({}) by {}{}{} [{} ms]",
                    e.id,
                    e.state,
                    e.status
                        .map(|s| s.to_string())
                        .unwrap_or_else(|| "-".into()),
                    e.method,
                    e.url,
                    e.key.as_deref().unwrap_or("-"),
                    e.key_source.as_deref().unwrap_or(&e.policy),
                    e.executed_by,
                    if e.replayed_to.is_empty() {
                        String::new()
                    } else {
                        format!(", replayed to {}", e.replayed_to.join(","))
                    },
                    e.error
                        .as_deref()
                        .map(|x| format!(": {x}"))
                        .unwrap_or_default(),
                    when
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}
