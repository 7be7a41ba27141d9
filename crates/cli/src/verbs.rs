//! The verbs: each turns its arguments into one request to tined and
//! renders the report (text, or `--json`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::Args;
use hyper::Method;

use crate::client::Client;
use crate::render::{self, human_bytes, human_ms};
use crate::{Command, DiskCommand, StoreCommand};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Name of the vm (letters, digits, '-', '_', '.').
    #[arg(long)]
    pub name: String,
    /// Image: `minimal` or `debian` (Linux, `tine image build [debian]`),
    /// `micro-counter`, `micro-memtouch`, `micro-blkio`, or an image directory.
    #[arg(long, default_value = "minimal", conflicts_with = "kernel")]
    image: String,
    /// A kernel file instead of an image (a micro guest ELF, vmlinux or bzImage).
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Guest memory (e.g. 512M, 2G).
    #[arg(long, default_value = "512M", value_parser = crate::size::parse_mib)]
    mem: u64,
    /// vCPUs (1–4).
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// Raw disk image as virtio-blk (repeatable).
    #[arg(long = "disk")]
    disks: Vec<PathBuf>,
    /// Give the vm a tap device (`tt-NAME`) as virtio-net, with an address
    /// from a new network tree (10.213.T.0/24; the host is .1).
    #[arg(long)]
    net: bool,
    /// Do not wait for a guest agent (micro guests have none).
    #[arg(long)]
    no_agent: bool,
    /// How long to wait for the agent to answer.
    #[arg(long, default_value_t = 180)]
    timeout_secs: u64,
    /// Restore a snapshot directory (`tine snapshot NAME --to DIR`) in a
    /// new process instead of booting; --image, --kernel, --mem, --vcpus
    /// and --disk come from the snapshot.
    #[arg(long, conflicts_with_all = ["kernel", "disks"])]
    from: Option<PathBuf>,
    /// The vm's fork contract (TOML): how its copies wake. With --from,
    /// it goes over the one in the snapshot's manifest.
    #[arg(long)]
    contract: Option<PathBuf>,
    /// CPU template: `t2`, `t2s` (`tine cpu-templates`) or a custom
    /// template's JSON file. The guest sees the template's CPUID, and its
    /// snapshots wake on any host that satisfies it. Not with --from (a
    /// restore keeps its snapshot's).
    #[arg(long, conflicts_with = "from")]
    cpu_template: Option<String>,
    /// Snapshot it into the store this often while it runs (`30s`, `2m`,
    /// at least 5 s; `tine keep NAME off` stops it).
    #[arg(long, value_parser = parse_period)]
    keep_every: Option<u64>,
    /// Run once per key: a repeat gets the first run's answer.
    #[arg(long)]
    idempotency_key: Option<String>,
    #[arg(long)]
    json: bool,
}

impl RunArgs {
    /// The request, with every path made absolute (tined's working
    /// directory is not ours) and the contract file read.
    fn spec(&self) -> anyhow::Result<host::vm::RunSpec> {
        let mut s = host::vm::RunSpec::new(&self.name, &self.image);
        s.kernel = self.kernel.as_deref().map(absolute).transpose()?;
        s.mem_mib = self.mem;
        s.vcpus = self.vcpus;
        s.disks = self
            .disks
            .iter()
            .map(|d| absolute(d))
            .collect::<anyhow::Result<_>>()?;
        s.net = self.net;
        s.no_agent = self.no_agent;
        s.timeout_s = self.timeout_secs;
        s.from = self.from.as_deref().map(absolute).transpose()?;
        s.contract = read_contract(self.contract.as_deref())?;
        s.cpu_template = self
            .cpu_template
            .as_deref()
            .map(crate::cpu_templates::for_run)
            .transpose()?;
        s.keep_every_s = self.keep_every;
        if s.image.contains('/') {
            s.image = absolute(Path::new(&self.image))?.display().to_string();
        }
        Ok(s)
    }

    /// A micro guest: runs on any /dev/kvm, so never in the machine.
    pub fn is_micro(&self) -> bool {
        match self.spec() {
            Ok(s) => s.is_micro(),
            Err(_) => self.kernel.is_some() || self.image.starts_with("micro-"),
        }
    }
}

/// `p` made absolute against our working directory (not canonicalized:
/// a missing file is tined's to report).
pub fn absolute(p: &Path) -> anyhow::Result<PathBuf> {
    Ok(if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()?.join(p)
    })
}

/// A contract file's text. The rotate providers it names join this
/// host's allow-list: the user of this command is the host's owner.
pub(crate) fn read_contract(f: Option<&Path>) -> anyhow::Result<Option<String>> {
    let Some(f) = f else { return Ok(None) };
    let text = std::fs::read_to_string(f)
        .with_context(|| format!("cannot read the contract {}", f.display()))?;
    // A contract that does not parse is refused by tined with the reason.
    if let Ok(c) = contract::Contract::parse(&text) {
        host::providers::allow_contract(&crate::home()?, &c)?;
    }
    Ok(Some(text))
}

/// `tine effects NAME [--json]` or `tine effects resolve NAME KEY --resend|--fail`.
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct EffectsArgs {
    #[command(subcommand)]
    cmd: Option<EffectsCommand>,
    /// The vm whose lineage's effects to list.
    pub name: Option<String>,
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

impl EffectsArgs {
    pub fn vm(&self) -> Option<&str> {
        match (&self.cmd, &self.name) {
            (Some(EffectsCommand::Resolve { name, .. }), _) | (None, Some(name)) => Some(name),
            (None, None) => None,
        }
    }
}

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
    /// Run the gateway in the foreground (`tine-gateway`).
    #[command(hide = true)]
    Serve,
}

/// `tine keys ...`.
#[derive(clap::Subcommand, Debug)]
pub enum KeysCommand {
    /// Issue an API key for tined's TCP listener (`tined --tcp`; E2B's
    /// `E2B_API_KEY`). The key is printed this once; tined keeps its hash.
    Create {
        /// What it is for.
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// The keys issued (ids, names, prefixes; never the keys).
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// Revoke a key (by id or name): requests with it are refused at once.
    Rm { id: String },
}

/// `tine hosts ...`.
#[derive(clap::Subcommand, Debug)]
pub enum HostsCommand {
    /// List them (the default).
    Ls,
    /// Forget a host that is lost or stopped and will not come back.
    Rm { id: String },
}

/// `tine daemon ...`.
#[derive(clap::Subcommand, Debug)]
pub enum DaemonCommand {
    /// Start tined for this home (the CLI does it on first use anyway).
    Start,
    /// Stop tined; its vms keep running and the next tined adopts them.
    Stop,
    /// Whether it runs: pid, build, uptime.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Run tined in the foreground (`tined ARGS...`).
    #[command(disable_help_flag = true)]
    Run {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// A program beside this executable (`tine-vmm`, `tined`, `tine-gateway`).
fn sibling(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join(name)))
        .unwrap_or_else(|| PathBuf::from(name))
}

/// Replaces this process with `prog args`.
fn exec(prog: &str, args: &[String]) -> ExitCode {
    use std::os::unix::process::CommandExt;
    let p = sibling(prog);
    let e = std::process::Command::new(&p).args(args).exec();
    eprintln!("tine: cannot run {}: {e}", p.display());
    ExitCode::FAILURE
}

/// `tine vmm ARGS`: `tine-vmm ARGS` in this process.
pub fn exec_vmm(args: &[String]) -> ExitCode {
    exec("tine-vmm", args)
}

fn client() -> anyhow::Result<Client> {
    Client::connect(&crate::home()?)
}

/// Runs a verb on this host (through its tined).
pub fn dispatch(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Vmm { args } => Ok(exec_vmm(&args)),
        Command::Image(cmd) => crate::image_cmd::run(cmd),
        Command::CpuTemplates(args) => crate::cpu_templates::run(args),
        Command::Machine(cmd) => crate::machine::run(&crate::home()?, cmd),
        Command::Gateway(GatewayCommand::Serve) => Ok(exec(
            "tine-gateway",
            &["--home".into(), crate::home()?.display().to_string()],
        )),
        Command::Daemon(cmd) => daemon(cmd),
        Command::Exec(args) => crate::agent_cmds::exec(&client()?, args),
        Command::Cp { src, dst } => crate::agent_cmds::cp(&client()?, &src, &dst),
        Command::Contract(cmd) => crate::agent_cmds::contract(&client()?, cmd),
        Command::Secret(cmd) => crate::agent_cmds::secret(&client()?, cmd),
        command => with_client(&client()?, command),
    }
}

fn with_client(c: &Client, command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Run(args) => run(c, &args),
        Command::Ls { json } => {
            let mut rows = ls_rows(c)?;
            rows.extend(crate::machine::rows(&crate::home()?)?);
            ls(&rows, json)
        }
        Command::Console {
            name,
            send: Some(line),
            ..
        } => {
            c.call::<serde_json::Value>(
                Method::POST,
                &format!("/v1/vms/{name}/console"),
                Some(&serde_json::json!({ "line": line })),
                &[],
            )?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Console { name, follow, .. } => {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            c.stream(
                &format!("/v1/vms/{name}/console?follow={follow}"),
                None,
                |chunk| {
                    out.write_all(chunk)?;
                    out.flush()?;
                    Ok(())
                },
            )?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Stop { name, timeout_secs } => {
            let r: tined_types::StopReport = c.post(
                &format!("/v1/vms/{name}/stop"),
                &serde_json::json!({ "timeout_s": timeout_secs }),
            )?;
            println!("{name}: {}", stopped_text(r.stopped));
            Ok(ExitCode::SUCCESS)
        }
        Command::Kill { name } => {
            let r: tined_types::StopReport =
                c.post(&format!("/v1/vms/{name}/kill"), &serde_json::json!({}))?;
            println!("{name}: {}", stopped_text(r.stopped));
            Ok(ExitCode::SUCCESS)
        }
        Command::Disk(DiskCommand::Layers { name, json }) => disk_layers(c, &name, json),
        Command::Rm { name, force, json } => {
            let r: host::vm::Removed = match name.split_once('@') {
                Some((vm, tag)) => c.call(
                    Method::DELETE,
                    &format!("/v1/vms/{vm}/checkpoints/{tag}"),
                    None::<&()>,
                    &[],
                )?,
                None => c.call(
                    Method::DELETE,
                    &format!("/v1/vms/{name}?force={force}"),
                    None::<&()>,
                    &[],
                )?,
            };
            if json {
                render::json(&r, true)?;
            } else {
                let freed = if r.layers_freed > 0 {
                    format!(" ({} frozen layers freed)", r.layers_freed)
                } else {
                    String::new()
                };
                println!("{}: removed{freed}", r.name);
            }
            Ok(render::problems(&r.problems))
        }
        Command::Fork {
            name,
            count,
            names,
            contract,
            idempotency_key,
            json,
        } => {
            let spec = host::fork::ForkSpec {
                count,
                names: names.map(|n| n.split(',').map(|s| s.trim().to_string()).collect()),
                contract: read_contract(contract.as_deref())?,
            };
            let headers: Vec<(&str, &str)> = idempotency_key
                .as_deref()
                .map(|k| vec![("idempotency-key", k)])
                .unwrap_or_default();
            let r: host::fork::ForkReport = c.call(
                Method::POST,
                &format!("/v1/vms/{name}/fork"),
                Some(&spec),
                &headers,
            )?;
            if json {
                render::json(&r, false)?;
            } else {
                let how = if r.wake.is_empty() {
                    "; no agent: children are exact copies".to_string()
                } else {
                    format!("; woken in {}", human_ms(r.wake_ms))
                };
                println!(
                    "{name}: forked into {} in {} (guest paused {:.2} ms{how})",
                    r.names.join(", "),
                    human_ms(r.total_ms),
                    r.pause_ms.unwrap_or_default(),
                );
            }
            Ok(render::problems(&r.problems))
        }
        Command::Checkpoint { name, tag, json } => {
            let r: host::fork::MomentReport = c.post(
                &format!("/v1/vms/{name}/checkpoints"),
                &serde_json::json!({ "tag": tag }),
            )?;
            if json {
                render::json(&r, false)?;
            } else {
                println!(
                    "{name}: checkpoint {} (guest paused {:.2} ms)",
                    r.tag.as_deref().unwrap_or("?"),
                    r.pause_ms.unwrap_or_default()
                );
            }
            Ok(render::problems(&r.problems))
        }
        Command::Rollback { name, tag, json } => {
            let r: host::fork::MomentReport = c.post(
                &format!("/v1/vms/{name}/rollback"),
                &serde_json::json!({ "tag": tag }),
            )?;
            if json {
                render::json(&r, false)?;
            } else {
                println!("{name}: rolled back to {tag} in {}", human_ms(r.total_ms));
            }
            Ok(render::problems(&r.problems))
        }
        Command::Checkpoints { name, json } => {
            let list: Vec<host::fork::CheckpointRecord> =
                c.get(&format!("/v1/vms/{name}/checkpoints"))?;
            if json {
                render::json(&list, true)?;
            } else {
                for cp in list {
                    println!("{}\tpid {}", cp.tag, cp.pid);
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Snapshot { name, to, json } => {
            let t0 = Instant::now();
            let dir = absolute(&to)?;
            let mut bar = render::Bar::new();
            let r: host::fork::MomentReport = c.operation(
                &format!("/v1/vms/{name}/snapshot"),
                &serde_json::json!({ "dir": dir }),
                |p| bar.update(p),
            )?;
            bar.finish();
            if json {
                let mut v = serde_json::to_value(&r)?;
                v["total_ms"] = serde_json::json!(t0.elapsed().as_secs_f64() * 1000.0);
                render::json(&v, false)?;
            } else {
                println!(
                    "{name}: snapshot in {} ({} of memory) in {} (guest paused {:.2} ms)",
                    dir.display(),
                    human_bytes(r.memory_bytes.unwrap_or_default()),
                    human_ms(t0.elapsed().as_secs_f64() * 1000.0),
                    r.pause_ms.unwrap_or_default()
                );
            }
            Ok(render::problems(&r.problems))
        }
        Command::Keep { name, every, json } => {
            let k: serde_json::Value = if every == "off" {
                c.call(
                    Method::DELETE,
                    &format!("/v1/vms/{name}/keep"),
                    None::<&()>,
                    &[],
                )?
            } else {
                let every_s = parse_period(&every).map_err(|e| anyhow::anyhow!(e))?;
                c.call(
                    Method::PUT,
                    &format!("/v1/vms/{name}/keep"),
                    Some(&serde_json::json!({ "every_s": every_s })),
                    &[],
                )?
            };
            if json {
                render::json(&k, true)?;
            } else {
                match k["every_s"].as_u64() {
                    Some(s) => print!("{name}: kept every {s} s"),
                    None => print!("{name}: no longer kept"),
                }
                match (k["last_branch"].as_str(), k["last_snapshot"].as_i64()) {
                    (Some(b), Some(id)) => println!("; last keep: {b} (snapshot {id})"),
                    _ => println!(),
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Sleep { name, json } => {
            let t0 = Instant::now();
            let mut bar = render::Bar::new();
            let r: host::tree::SleepReport = c.operation(
                &format!("/v1/vms/{name}/sleep"),
                &serde_json::json!({}),
                |p| bar.update(p),
            )?;
            bar.finish();
            if json {
                render::json(&r, true)?;
            } else {
                let disk_read: u64 = r.disks.iter().map(|d| d.read_bytes).sum();
                println!(
                    "{name}: sleeping in snapshot {} ({} of memory recorded, {} of disk read, {} new in the store) in {}",
                    r.snapshot,
                    human_bytes(r.memory_logical),
                    human_bytes(disk_read),
                    human_bytes(r.new_stored),
                    human_ms(t0.elapsed().as_secs_f64() * 1000.0)
                );
            }
            Ok(render::problems(&r.problems))
        }
        Command::Wake {
            branch,
            name,
            net,
            lazy,
            host,
            json,
        } => {
            let t0 = Instant::now();
            let mut bar = render::Bar::new();
            let r: host::vm::RunReport = c.operation(
                &format!("/v1/branches/{branch}/wake"),
                &host::tree::WakeSpec {
                    name,
                    net,
                    lazy,
                    contract: None,
                    host,
                },
                |p| bar.update(p),
            )?;
            bar.finish();
            let waited = t0.elapsed().as_secs_f64() * 1000.0;
            if json {
                let mut v = serde_json::to_value(&r)?;
                v["total_ms"] = serde_json::json!(waited);
                render::json(&v, true)?;
            } else {
                println!(
                    "{}: woke from {branch} in {} (pid {})",
                    r.name,
                    human_ms(waited),
                    r.pid
                );
            }
            Ok(render::problems(&r.problems))
        }
        Command::Tree { json } => tree(c, json),
        Command::Gc { json } => {
            let mut bar = render::Bar::new();
            let r: host::tree::GcReport =
                c.operation("/v1/gc", &serde_json::json!({}), |p| bar.update(p))?;
            bar.finish();
            if json {
                render::json(&r, true)?;
            } else {
                let (chunks, freed, pruned, reaped) = match &r.store {
                    Some(s) => (
                        s.chunks_deleted,
                        s.stored_bytes_freed,
                        s.snapshots_pruned.len(),
                        s.pending_reaped.len(),
                    ),
                    None => (0, 0, 0, 0),
                };
                println!(
                    "gc: {pruned} snapshots pruned, {chunks} chunks deleted ({} freed), {reaped} unfinished snapshots reaped, {} wake copies removed ({}), {} frozen layers freed",
                    human_bytes(freed),
                    r.wake_copies_removed,
                    human_bytes(r.wake_bytes_freed),
                    r.layers_freed
                );
            }
            Ok(render::problems(&r.problems))
        }
        Command::Store(StoreCommand::Verify { json }) => {
            let mut bar = render::Bar::new();
            let r: store::VerifyReport =
                c.operation("/v1/store/verify", &serde_json::json!({}), |p| {
                    bar.update(p)
                })?;
            bar.finish();
            if json {
                render::json(&r, true)?;
            } else {
                print!("{r}");
            }
            Ok(if r.is_ok() {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Command::Effects(args) => effects(c, args),
        Command::Gateway(cmd) => gateway(c, cmd),
        Command::Keys(cmd) => keys(c, cmd),
        Command::Move {
            name,
            to,
            no_precopy,
            json,
        } => {
            let mut bar = render::Bar::new();
            let r: serde_json::Value = c.operation(
                &format!("/v1/vms/{name}/move"),
                &serde_json::json!({ "to": to, "precopy": !no_precopy }),
                |p| bar.update(p),
            )?;
            bar.finish();
            if json {
                render::json(&r, true)?;
            } else {
                if let Some(p) = r["precopy"].as_object() {
                    println!(
                        "{name}: pre-copied while it ran in {} (snapshot {}, {} fetched by the target)",
                        human_ms(p["total_ms"].as_f64().unwrap_or(0.0)),
                        p["snapshot"],
                        p["prefetched"]
                            .as_u64()
                            .map(|b| format!("{} MiB", b >> 20))
                            .unwrap_or_else(|| "nothing".into()),
                    );
                }
                println!(
                    "{name}: moved from {} to {}, stopped {} (its pause {}, stored {}, woken there in {})",
                    r["from"].as_str().unwrap_or("?"),
                    r["to"].as_str().unwrap_or("?"),
                    human_ms(r["downtime_ms"].as_f64().unwrap_or(0.0)),
                    human_ms(r["sleep"]["pause_ms"].as_f64().unwrap_or(0.0)),
                    human_ms(r["sleep"]["store_ms"].as_f64().unwrap_or(0.0)),
                    human_ms(r["wake"]["ready_ms"].as_f64().unwrap_or(0.0)),
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Hosts { cmd, json } => hosts(c, cmd.unwrap_or(HostsCommand::Ls), json),
        Command::Events => {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            let mut buf = Vec::new();
            c.stream("/v1/events", Some("text/event-stream"), |chunk| {
                buf.extend_from_slice(chunk);
                while let Some(i) = buf.iter().position(|b| *b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=i).collect();
                    if let Some(d) = line.strip_prefix(b"data:") {
                        out.write_all(d.trim_ascii_start())?;
                        out.flush()?;
                    }
                }
                Ok(())
            })?;
            Ok(ExitCode::SUCCESS)
        }
        _ => unreachable!("dispatched above"),
    }
}

/// Types of tined's answers that are tined's own (not the engine's).
mod tined_types {
    #[derive(serde::Deserialize)]
    pub struct StopReport {
        pub stopped: host::vm::Stopped,
    }
}

fn stopped_text(s: host::vm::Stopped) -> &'static str {
    match s {
        host::vm::Stopped::Already => "already stopped",
        host::vm::Stopped::Clean => "stopped",
        host::vm::Stopped::Terminated => "stopped (SIGTERM)",
        host::vm::Stopped::Killed => "killed",
    }
}

fn run(c: &Client, args: &RunArgs) -> anyhow::Result<ExitCode> {
    let spec = args.spec()?;
    let headers: Vec<(&str, &str)> = args
        .idempotency_key
        .as_deref()
        .map(|k| vec![("idempotency-key", k)])
        .unwrap_or_default();
    let r: host::vm::RunReport = c.call(Method::POST, "/v1/vms", Some(&spec), &headers)?;
    if args.json {
        render::json(&r, true)?;
    } else {
        let what = if r.wake.is_some() {
            "agent answered"
        } else {
            "VMM running"
        };
        println!("{}: {what} in {:.0} ms (pid {})", r.name, r.ready_ms, r.pid);
    }
    Ok(render::problems(&r.problems))
}

/// Every vm, sleeping branch and checkpoint of this host's tined.
fn ls_rows(c: &Client) -> anyhow::Result<Vec<render::LsRow>> {
    let vms: Vec<host::vm::VmInfo> = c.get("/v1/vms")?;
    let lineage: host::tree::Lineage = c.get("/v1/tree")?;
    let mut rows = Vec::new();
    for v in vms {
        for tag in &v.checkpoints {
            rows.push(render::LsRow {
                name: format!("{}@{tag}", v.name),
                state: "checkpoint".into(),
                pid: None,
                image: v.image.clone(),
                mem_mib: v.mem_mib,
                vcpus: v.vcpus,
                rss_mib: None,
                uptime_s: None,
                exit: None,
                parent: Some(v.name.clone()),
            });
        }
        rows.push(render::LsRow {
            name: v.name,
            state: v.state.to_string(),
            pid: v.pid,
            image: v.image,
            mem_mib: v.mem_mib,
            vcpus: v.vcpus,
            rss_mib: v.rss_mib,
            uptime_s: v.uptime_s,
            exit: v.exit,
            parent: v.parent,
        });
    }
    for n in lineage.nodes.iter().filter(|n| n.kind == "branch") {
        rows.push(render::LsRow {
            name: n.name.clone(),
            state: "sleeping".into(),
            pid: None,
            image: "-".into(),
            mem_mib: n.mem_mib.unwrap_or(0),
            vcpus: 0,
            rss_mib: None,
            uptime_s: None,
            exit: None,
            parent: n.parent.clone(),
        });
    }
    rows.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(rows)
}

/// `tine ls`.
fn ls(rows: &[render::LsRow], json: bool) -> anyhow::Result<ExitCode> {
    if json {
        render::json(&rows, true)?;
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<20} {:<10} {:>8} {:>10} {:>8}  {:<14} IMAGE",
        "NAME", "STATE", "PID", "MEM", "UPTIME", "PARENT"
    );
    for r in rows {
        let pid = r.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into());
        let mem = match r.rss_mib {
            Some(rss) => format!("{rss}/{}M", r.mem_mib),
            None if r.mem_mib > 0 => format!("{}M", r.mem_mib),
            None => "-".into(),
        };
        let up = r
            .uptime_s
            .map(render::duration_s)
            .unwrap_or_else(|| "-".into());
        let note = r
            .exit
            .as_ref()
            .map(|e| format!("  ({e})"))
            .unwrap_or_default();
        let parent = r.parent.as_deref().unwrap_or("-");
        println!(
            "{:<20} {:<10} {:>8} {:>10} {:>8}  {:<14} {}{note}",
            r.name, r.state, pid, mem, up, parent, r.image
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn disk_layers(c: &Client, name: &str, json: bool) -> anyhow::Result<ExitCode> {
    let disks: Vec<Vec<serde_json::Value>> = c.get(&format!("/v1/vms/{name}/disks"))?;
    if json {
        render::json(&disks, true)?;
        return Ok(ExitCode::SUCCESS);
    }
    if disks.is_empty() {
        println!("{name}: no disks");
    }
    for (i, chain) in disks.iter().enumerate() {
        let size = chain
            .first()
            .and_then(|l| l["virtual_size"].as_u64())
            .unwrap_or(0);
        println!("disk{i} ({}):", human_bytes(size));
        for (depth, l) in chain.iter().enumerate() {
            let role = if depth == 0 { "top " } else { "base" };
            println!(
                "  {role} {:>6} {:>10} allocated  {}",
                l["format"].as_str().unwrap_or("?"),
                human_bytes(l["allocated_bytes"].as_u64().unwrap_or(0)),
                l["path"].as_str().unwrap_or("?")
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `tine tree`: the store's tree, then what lives outside it (running
/// vms, forks and checkpoints).
fn tree(c: &Client, json: bool) -> anyhow::Result<ExitCode> {
    let t: serde_json::Value = c.get("/v1/tree/store")?;
    let lineage: host::tree::Lineage = c.get("/v1/tree")?;
    // The machine's tree too, where Linux vms live in it.
    let inside = crate::machine::tree(&crate::home()?)?;
    if json {
        let mut v = t;
        v["nodes"] = serde_json::to_value(&lineage.nodes)?;
        if let Some(m) = inside {
            v["machine"] = m;
        }
        render::json(&v, true)?;
        return Ok(ExitCode::SUCCESS);
    }
    if inside.is_some() {
        println!("on this host:");
    }
    render_tree(t, &lineage)?;
    if let Some(m) = inside {
        println!("in the machine (the nested test host):");
        let lineage = serde_json::from_value(
            serde_json::json!({ "nodes": m["nodes"].clone(), "store": null }),
        )
        .context("the machine's tree")?;
        render_tree(m, &lineage)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The store's tree, then what lives outside it (running vms, forks,
/// checkpoints).
fn render_tree(t: serde_json::Value, lineage: &host::tree::Lineage) -> anyhow::Result<()> {
    let store: store::Tree = serde_json::from_value(t).context("tined's tree")?;
    print!("{}", store.render());
    let live: Vec<&host::tree::Node> = lineage
        .nodes
        .iter()
        .filter(|n| n.kind == "vm" || n.kind == "checkpoint")
        .collect();
    if !live.is_empty() {
        println!("live:");
        print_nodes(&live, None, 1);
    }
    Ok(())
}

/// The live nodes under `parent` (a node id), indented.
fn print_nodes(nodes: &[&host::tree::Node], parent: Option<&str>, depth: usize) {
    let ids: std::collections::HashSet<&str> = nodes.iter().map(|n| n.id.as_str()).collect();
    for n in nodes {
        let p = n.parent.as_deref().filter(|p| ids.contains(p));
        if p != parent {
            continue;
        }
        let from = match (&n.parent, p) {
            (Some(s), None) => format!(" (from {s})"),
            _ => String::new(),
        };
        let pid = n.pid.map(|p| format!(" pid {p}")).unwrap_or_default();
        println!(
            "{}{} [{} {}]{pid}{from}",
            "  ".repeat(depth),
            n.name,
            n.kind,
            n.state
        );
        print_nodes(nodes, Some(&n.id), depth + 1);
    }
}

fn effects(c: &Client, args: EffectsArgs) -> anyhow::Result<ExitCode> {
    let Some(name) = args.vm().map(str::to_string) else {
        anyhow::bail!("say which vm: tine effects NAME");
    };
    if let Some(EffectsCommand::Resolve { key, resend, .. }) = &args.cmd {
        let r: serde_json::Value = c.post(
            &format!("/v1/vms/{name}/effects/resolve"),
            &serde_json::json!({ "key": key, "resend": resend }),
        )?;
        println!(
            "effect {} ({key}): {}",
            r["effect"],
            if *resend {
                "the next request with this key is sent again"
            } else {
                "failed; requests with this key get an error"
            }
        );
        return Ok(ExitCode::SUCCESS);
    }
    let l: host::gateway::LineageEffects = c.get(&format!("/v1/vms/{name}/effects"))?;
    if args.json {
        render::json(&l, false)?;
        return Ok(ExitCode::SUCCESS);
    }
    if l.effects.is_empty() {
        println!("{name}: no effects");
    }
    for e in &l.effects {
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

fn gateway(c: &Client, cmd: GatewayCommand) -> anyhow::Result<ExitCode> {
    let st: serde_json::Value = match &cmd {
        GatewayCommand::Start => {
            c.post("/v1/gateway", &serde_json::json!({ "action": "start" }))?
        }
        GatewayCommand::Stop => c.post("/v1/gateway", &serde_json::json!({ "action": "stop" }))?,
        GatewayCommand::Status { .. } => c.get("/v1/gateway")?,
        GatewayCommand::Serve => unreachable!("dispatched before"),
    };
    let s = &st["status"];
    match cmd {
        GatewayCommand::Start => println!(
            "gateway running (pid {}), journal {}",
            s["pid"],
            s["journal"].as_str().unwrap_or("?")
        ),
        GatewayCommand::Stop => println!("gateway stopped"),
        GatewayCommand::Status { json: true } => render::json(&st, true)?,
        GatewayCommand::Status { json: false } => {
            if s.is_null() {
                println!("gateway not running");
            } else {
                println!(
                    "gateway running: pid {}, journal {} (schema {})",
                    s["pid"],
                    s["journal"].as_str().unwrap_or("?"),
                    s["schema_version"]
                );
                for b in s["branches"].as_array().into_iter().flatten() {
                    println!(
                        "  vm {}\tbranch {}",
                        b[0].as_str().unwrap_or("?"),
                        b[1].as_str().unwrap_or("?")
                    );
                }
                for e in s["effects"].as_array().into_iter().flatten() {
                    println!("  {} {}", e[1], e[0].as_str().unwrap_or("?"));
                }
            }
        }
        GatewayCommand::Serve => {}
    }
    Ok(ExitCode::SUCCESS)
}

fn hosts(c: &Client, cmd: HostsCommand, json: bool) -> anyhow::Result<ExitCode> {
    if let HostsCommand::Rm { id } = cmd {
        let _: serde_json::Value =
            c.call(Method::DELETE, &format!("/v1/hosts/{id}"), None::<&()>, &[])?;
        println!("forgot host {id}");
        return Ok(ExitCode::SUCCESS);
    }
    let v: serde_json::Value = c.get("/v1/hosts")?;
    if json {
        render::json(&v, true)?;
        return Ok(ExitCode::SUCCESS);
    }
    let Some(this) = v["this"].as_str() else {
        println!("this tined is in no fleet (see tined.log)");
        return Ok(ExitCode::SUCCESS);
    };
    println!("fleet on {}", v["meta"].as_str().unwrap_or("?"));
    println!("HOST\tSTATE\tVMS\tMEM FREE\tCPUS\tHEARTBEAT\tADDRESS");
    let now = host::state::now_ms() as i64;
    for h in v["hosts"].as_array().into_iter().flatten() {
        let id = h["id"].as_str().unwrap_or("?");
        let cap = &h["capacity"];
        println!(
            "{}{}\t{}\t{}\t{}/{} MiB\t{}\t{:.1}s ago\t{}",
            id,
            if id == this { " *" } else { "" },
            h["state"].as_str().unwrap_or("?"),
            cap["vms"],
            cap["mem_available_mib"],
            cap["mem_total_mib"],
            cap["vcpus"],
            (now - h["heartbeat_ms"].as_i64().unwrap_or(0)) as f64 / 1000.0,
            h["address"].as_str().unwrap_or("?"),
        );
    }
    for vm in v["lost_vms"].as_array().into_iter().flatten() {
        let snap = vm["snapshot"]
            .as_i64()
            .map(|s| format!("its last snapshot is {s}"))
            .unwrap_or_else(|| "it has no snapshot in the store".into());
        println!(
            "lost: vm {} on host {} ({snap})",
            vm["name"].as_str().unwrap_or("?"),
            vm["host"].as_str().unwrap_or("?")
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn keys(c: &Client, cmd: KeysCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        KeysCommand::Create { name, json } => {
            let k: serde_json::Value = c.post("/v1/keys", &serde_json::json!({ "name": name }))?;
            if json {
                render::json(&k, true)?;
            } else {
                println!("{}", k["key"].as_str().unwrap_or_default());
                eprintln!(
                    "key {} ({}): shown this once; `tine keys rm {}` revokes it",
                    k["id"].as_str().unwrap_or("?"),
                    k["name"].as_str().unwrap_or("?"),
                    k["id"].as_str().unwrap_or("?"),
                );
            }
        }
        KeysCommand::Ls { json } => {
            let ks: Vec<serde_json::Value> = c.get("/v1/keys")?;
            if json {
                render::json(&ks, true)?;
            } else if ks.is_empty() {
                println!("no API keys (tine keys create NAME)");
            } else {
                for k in ks {
                    println!(
                        "{}\t{}...\t{}",
                        k["id"].as_str().unwrap_or("?"),
                        k["prefix"].as_str().unwrap_or("?"),
                        k["name"].as_str().unwrap_or("?")
                    );
                }
            }
        }
        KeysCommand::Rm { id } => {
            let _: serde_json::Value =
                c.call(Method::DELETE, &format!("/v1/keys/{id}"), None::<&()>, &[])?;
            println!("revoked {id}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn daemon(cmd: DaemonCommand) -> anyhow::Result<ExitCode> {
    let home = crate::home()?;
    match cmd {
        DaemonCommand::Run { args } => Ok(exec("tined", &args)),
        DaemonCommand::Start => {
            let c = Client::connect(&home)?;
            let h: serde_json::Value = c.get("/v1/health")?;
            println!("tined running (pid {}) for {}", h["pid"], home.display());
            Ok(ExitCode::SUCCESS)
        }
        DaemonCommand::Stop => {
            let pid = std::fs::read_to_string(home.join("tined.pid")).unwrap_or_default();
            let sock = home.join("tined.sock");
            if !sock.exists() {
                println!("tined not running");
                return Ok(ExitCode::SUCCESS);
            }
            // Without starting one: talk to the socket as it is.
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let stopped = rt.block_on(async {
                let Ok(s) = tokio::net::UnixStream::connect(&sock).await else {
                    return false;
                };
                let Ok((mut tx, conn)) =
                    hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(s)).await
                else {
                    return false;
                };
                tokio::spawn(conn);
                let req = hyper::Request::post("/v1/shutdown")
                    .header("host", "tined")
                    .body(http_body_util::Empty::<bytes::Bytes>::new());
                match req {
                    Ok(r) => tx.send_request(r).await.is_ok(),
                    Err(_) => false,
                }
            });
            let pid = pid.trim();
            let deadline = Instant::now() + std::time::Duration::from_secs(10);
            while stopped
                && Instant::now() < deadline
                && Path::new(&format!("/proc/{pid}")).exists()
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            println!("tined stopped (its vms keep running)");
            Ok(ExitCode::SUCCESS)
        }
        DaemonCommand::Status { json } => {
            let sock = home.join("tined.sock");
            let up = sock.exists() && std::os::unix::net::UnixStream::connect(&sock).is_ok();
            if !up {
                if json {
                    render::json(&serde_json::json!({ "running": false }), true)?;
                } else {
                    println!("tined not running for {}", home.display());
                }
                return Ok(ExitCode::SUCCESS);
            }
            let c = Client::connect(&home)?;
            let h: serde_json::Value = c.get("/v1/health")?;
            if json {
                render::json(&h, true)?;
            } else {
                println!(
                    "tined running: pid {}, up {}, home {}, {} operations running",
                    h["pid"],
                    render::duration_s(h["uptime_s"].as_u64().unwrap_or(0)),
                    h["home"].as_str().unwrap_or("?"),
                    h["operations_running"]
                );
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// A keep period: `30s`, `2m`, `1h` or plain seconds.
fn parse_period(s: &str) -> Result<u64, String> {
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: say 30s, 2m, 1h or a number of seconds"))?;
    let mult = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return Err(format!("{s:?}: the unit is s, m or h")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?}: too long"))
}

#[cfg(test)]
mod period_tests {
    use super::parse_period;

    #[test]
    fn periods() {
        assert_eq!(parse_period("30s"), Ok(30));
        assert_eq!(parse_period("2m"), Ok(120));
        assert_eq!(parse_period("1h"), Ok(3600));
        assert_eq!(parse_period("45"), Ok(45));
        assert!(parse_period("off").is_err());
        assert!(parse_period("5d").is_err());
        assert!(parse_period("").is_err());
    }
}
