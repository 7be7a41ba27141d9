//! `tine`: the command line, a client of tined (crates/tined). It parses
//! arguments, asks tined, and renders the answer (text, or `--json`);
//! where this host has no hardware virtualization, Linux vms live in the
//! nested test host and their verbs are forwarded there (routing.rs).

mod agent_cmds;
mod client;
mod cpu_templates;
mod image_cmd;
mod machine;
mod render;
mod routing;
use host::size;
mod verbs;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// tine forks running computers.
#[derive(Parser)]
#[command(name = "tine", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Start a vm in the background; returns when its agent answers.
    Run(verbs::RunArgs),
    /// CPU templates (`--cpu-template`): the built-in ones and whether
    /// this host satisfies each; `show` prints one as JSON.
    CpuTemplates(cpu_templates::CpuTemplatesArgs),
    /// Run a command in a vm (stdin, stdout, stderr and exit code pass through).
    Exec(agent_cmds::ExecArgs),
    /// Copy a file into or out of a vm: `tine cp FILE NAME:/path`, `tine cp NAME:/path FILE` (`-` for stdin/stdout).
    Cp { src: String, dst: String },
    /// List vms, sleeping branches and checkpoints: name, state, pid, memory, uptime, parent.
    Ls {
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Print a vm's console log.
    Console {
        name: String,
        /// Keep printing new output until the vm ends.
        #[arg(long, short)]
        follow: bool,
        /// Type this line into the console (COM1 input) instead.
        #[arg(long, conflicts_with = "follow")]
        send: Option<String>,
    },
    /// Stop a vm: agent shutdown, then SIGTERM, then SIGKILL after a timeout.
    Stop {
        name: String,
        /// Seconds to wait for a clean shutdown.
        #[arg(long, default_value_t = 60)]
        timeout_secs: u64,
    },
    /// Disks of a vm.
    #[command(subcommand)]
    Disk(DiskCommand),
    /// Kill a vm's VMM at once.
    Kill { name: String },
    /// Remove a vm (and its checkpoints), a sleeping branch, or one
    /// checkpoint (`NAME@TAG`); what only they held is freed.
    Rm {
        name: String,
        /// Kill it first if it runs.
        #[arg(long)]
        force: bool,
        #[arg(long)]
        json: bool,
    },
    /// Fork a vm: K children continue from this moment, each with its own
    /// disk layer, console, vsock socket and MAC; the vm goes on. Of a
    /// sleeping branch: K new branches wake from its snapshot.
    Fork {
        name: String,
        /// Number of children (named NAME-1, NAME-2, ... unless --names).
        #[arg(short = 'n', long = "count")]
        count: Option<usize>,
        /// Children's names, comma-separated.
        #[arg(long)]
        names: Option<String>,
        /// A fork contract (TOML) over the vm's own for this fork: how the
        /// children wake (randomness, clock, connections, egress, secrets).
        #[arg(long)]
        contract: Option<PathBuf>,
        /// Run once per key: a repeat gets the first fork's answer.
        #[arg(long)]
        idempotency_key: Option<String>,
        /// Machine-readable output (pids, timings, each child's wake steps).
        #[arg(long)]
        json: bool,
    },
    /// Keep this moment of a vm to roll back to (costs only the pages that
    /// later diverge).
    Checkpoint {
        name: String,
        /// Name of the checkpoint (default cp1, cp2, ...).
        #[arg(long)]
        tag: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Return a vm to a checkpoint: memory, CPU, devices and disk.
    Rollback {
        name: String,
        tag: String,
        #[arg(long)]
        json: bool,
    },
    /// List a vm's checkpoints.
    Checkpoints {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Write a running vm to a directory (memory, state, manifest) while it
    /// runs on; `tine run --from DIR` restores it.
    Snapshot {
        name: String,
        /// The directory (created; must not hold a snapshot).
        #[arg(long)]
        to: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Snapshot a running vm into the store periodically (`30s`, `2m`,
    /// at least 5 s), or `off`: a host loss costs at most that much work.
    /// Its last keep is the sleeping branch NAME.keep-N.
    Keep {
        name: String,
        /// The period (`30s`, `2m`, `1h`, plain seconds) or `off`.
        every: String,
        #[arg(long)]
        json: bool,
    },
    /// Put a running vm to sleep: its moment goes into the snapshot store
    /// (chunked, deduplicated) and the vm ends; its branch sleeps.
    Sleep {
        name: String,
        #[arg(long)]
        json: bool,
    },
    /// Wake a sleeping branch from the store (or, with --name, a new
    /// branch from the same snapshot).
    Wake {
        branch: String,
        /// The new vm's name (default: the branch's own, which must be
        /// sleeping).
        #[arg(long)]
        name: Option<String>,
        /// Give it a tap and an address from a new network tree.
        #[arg(long)]
        net: bool,
        /// Page its memory in on demand (userfaultfd) from the store, with
        /// the working set the last lazy wake recorded fetched first,
        /// instead of writing the whole memory out before it starts.
        #[arg(long)]
        lazy: bool,
        /// Wake it on this host of the fleet (`tine hosts`); default: the
        /// placement policy picks a compatible host with room.
        #[arg(long)]
        host: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// The tree: stored snapshots, sleeping branches, running vms and
    /// checkpoints, with own and shared bytes.
    Tree {
        #[arg(long)]
        json: bool,
    },
    /// Reclaim what nothing references: snapshots without a branch, their
    /// chunks, wake copies and frozen layers no vm uses.
    Gc {
        #[arg(long)]
        json: bool,
    },
    /// The snapshot store.
    #[command(subcommand)]
    Store(StoreCommand),
    /// A vm's fork contract: how its copies wake (randomness, clock,
    /// connections, egress, secrets, hooks).
    #[command(subcommand)]
    Contract(agent_cmds::ContractCommand),
    /// Secrets in a vm, and what a fork does to them (keep, revoke, rotate).
    #[command(subcommand)]
    Secret(agent_cmds::SecretCommand),
    /// Run one vm in the foreground: `tine-vmm` (this process becomes it).
    #[command(disable_help_flag = true)]
    Vmm {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Guest images.
    #[command(subcommand)]
    Image(image_cmd::ImageCommand),
    /// The nested host that runs vms where there is no hardware virtualization.
    #[command(subcommand)]
    Machine(machine::MachineCommand),
    /// The effects in a vm's lineage (its own and its ancestors' before each
    /// fork point), which were replayed, which are in doubt.
    Effects(verbs::EffectsArgs),
    /// The effects gateway: the host-side HTTP(S) proxy that journals what
    /// guests send, so copies never repeat it.
    #[command(subcommand)]
    Gateway(verbs::GatewayCommand),
    /// tined, the control plane this CLI talks to.
    #[command(subcommand)]
    Daemon(verbs::DaemonCommand),
    /// API keys for tined's TCP listener (E2B's E2B_API_KEY).
    #[command(subcommand)]
    Keys(verbs::KeysCommand),
    /// Move a running vm to another host of the fleet: it sleeps here into
    /// the shared store and wakes there; prints how long it was stopped.
    Move {
        name: String,
        /// The host (default: the one placement picks among the others).
        #[arg(long)]
        to: Option<String>,
        /// No pre-copy round: sleep, then wake (by default the memory is
        /// stored while the vm runs, and only what it writes after is
        /// copied while it is stopped).
        #[arg(long)]
        no_precopy: bool,
        #[arg(long)]
        json: bool,
    },
    /// The fleet's hosts (tineds sharing TINE_META): state, capacity,
    /// vms; and the vms of hosts that were lost.
    Hosts {
        #[command(subcommand)]
        cmd: Option<verbs::HostsCommand>,
        #[arg(long)]
        json: bool,
    },
    /// Print lifecycle events as they happen (JSON lines).
    Events,
}

#[derive(Subcommand)]
pub enum StoreCommand {
    /// Check every chunk: present, decompresses, hashes to its name.
    Verify {
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
pub enum DiskCommand {
    /// The layers of each disk of a vm, top first, with sizes.
    Layers {
        name: String,
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TINE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    host::state::private_umask();
    let cli = Cli::parse();
    if let Command::Vmm { args } = &cli.command {
        return verbs::exec_vmm(args);
    }
    // `tine ls | head` should end quietly, as Unix tools do.
    // SAFETY: restoring the default disposition of one signal before any
    // thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let routed = home().map(|h| routing::through_machine(&h, &cli.command, &args));
    let result = match routed {
        Ok(Some(r)) => r,
        Err(e) => Err(e),
        Ok(None) => verbs::dispatch(cli.command),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tine: {}", chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// `$TINE_HOME`, or `~/.cache/tine`.
pub fn home() -> anyhow::Result<PathBuf> {
    let home = image::default_home()?;
    host::state::close_home(&home)?;
    Ok(home)
}

/// The error and its sources on one line.
fn chain(e: &anyhow::Error) -> String {
    let mut s = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !s.contains(&c) {
            s.push_str(": ");
            s.push_str(&c);
        }
    }
    s
}
