//! `tine`: the command line. Each verb is a thin layer over the library crates.

mod agent_client;
mod contract_cmds;
mod effects_cmds;
mod exec_cmds;
mod fork_cmds;
mod image_cmd;
mod machine;
mod net;
mod routing;
mod size;
mod state;
mod tree_cmds;
mod vm_cmds;
mod vmm_cmd;
mod wake;

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
    Run(vm_cmds::RunArgs),
    /// Run a command in a vm (stdin, stdout, stderr and exit code pass through).
    Exec(exec_cmds::ExecArgs),
    /// Copy a file into or out of a vm: `tine cp FILE NAME:/path`, `tine cp NAME:/path FILE` (`-` for stdin/stdout).
    Cp { src: String, dst: String },
    /// List vms: name, state, pid, memory, uptime.
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
    /// Remove a stopped vm and its state.
    Rm {
        name: String,
        /// Kill it first if it runs.
        #[arg(long)]
        force: bool,
    },
    /// Fork a running vm: K children continue from this moment, each with
    /// its own disk layer, console, vsock socket and MAC; the vm goes on.
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
        contract: Option<std::path::PathBuf>,
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
    Checkpoints { name: String },
    /// Write a running vm to a directory (memory, state, manifest) while it
    /// runs on; `tine run --from DIR` restores it.
    Snapshot {
        name: String,
        /// The directory (created; must not hold a snapshot).
        #[arg(long)]
        to: std::path::PathBuf,
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
    },
    /// The snapshot tree: snapshots, branches, own and shared bytes.
    Tree {
        #[arg(long)]
        json: bool,
    },
    /// Remove what nothing in the tree references (chunks, unfinished
    /// snapshots, materialized copies).
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
    Contract(contract_cmds::ContractCommand),
    /// Secrets in a vm, and what a fork does to them (keep, revoke, rotate).
    #[command(subcommand)]
    Secret(contract_cmds::SecretCommand),
    /// Run one vm in the foreground: this process is its VMM.
    Vmm(Box<vmm_cmd::VmmArgs>),
    /// Guest images.
    #[command(subcommand)]
    Image(image_cmd::ImageCommand),
    /// The nested host that runs vms where there is no hardware virtualization.
    #[command(subcommand)]
    Machine(machine::MachineCommand),
    /// The effects in a vm's lineage (its own and its ancestors' before each
    /// fork point), which were replayed, which are in doubt.
    Effects(effects_cmds::EffectsArgs),
    /// The effects gateway: the host-side HTTP(S) proxy that journals what
    /// guests send, so copies never repeat it.
    #[command(subcommand)]
    Gateway(effects_cmds::GatewayCommand),
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
    let cli = Cli::parse();
    if !matches!(cli.command, Command::Vmm(_)) {
        // `tine ls | head` should end quietly, as Unix tools do. The VMM
        // keeps SIGPIPE ignored: a closed console must not kill the vm.
        // SAFETY: restoring the default disposition of one signal before
        // any thread exists.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let routed = home().map(|h| routing::through_machine(&h, &cli.command, &args));
    let result = match routed {
        Ok(Some(r)) => r,
        Err(e) => Err(e),
        Ok(None) => dispatch(cli.command),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tine: {}", chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// Runs a verb on this host.
fn dispatch(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Vmm(args) => vmm_cmd::run(*args),
        Command::Run(args) => home().and_then(|h| vm_cmds::run(&h, args)),
        Command::Exec(args) => home().and_then(|h| exec_cmds::exec(&h, args)),
        Command::Cp { src, dst } => home().and_then(|h| exec_cmds::cp(&h, &src, &dst)),
        Command::Ls { json } => home().and_then(|h| {
            let mut rows = vm_cmds::ls_rows(&h)?;
            rows.extend(routing::machine_rows(&h)?);
            vm_cmds::ls(&rows, json)
        }),
        Command::Console {
            name,
            send: Some(line),
            ..
        } => home().and_then(|h| vm_cmds::console_send(&h, &name, &line)),
        Command::Console { name, follow, .. } => {
            home().and_then(|h| vm_cmds::console(&h, &name, follow))
        }
        Command::Stop { name, timeout_secs } => home()
            .and_then(|h| vm_cmds::stop(&h, &name, std::time::Duration::from_secs(timeout_secs))),
        Command::Kill { name } => home().and_then(|h| vm_cmds::kill(&h, &name)),
        Command::Disk(DiskCommand::Layers { name, json }) => {
            home().and_then(|h| vm_cmds::disk_layers(&h, &name, json))
        }
        Command::Rm { name, force } => home().and_then(|h| vm_cmds::rm(&h, &name, force)),
        Command::Fork {
            name,
            count,
            names,
            contract,
            json,
        } => home().and_then(|h| {
            if tree_cmds::is_sleeping(&h, &name) {
                let names: Vec<String> = match names {
                    Some(n) => n.split(',').map(str::to_string).collect(),
                    None => (1..=count.unwrap_or(1))
                        .map(|i| format!("{name}-{i}"))
                        .collect(),
                };
                return tree_cmds::fork_sleeping(
                    &h,
                    &name,
                    &names,
                    false,
                    contract.as_deref(),
                    json,
                );
            }
            fork_cmds::fork(&h, &name, count, names, contract.as_deref(), json)
        }),
        Command::Sleep { name, json } => home().and_then(|h| tree_cmds::sleep(&h, &name, json)),
        Command::Wake {
            branch,
            name,
            net,
            lazy,
        } => home().and_then(|h| tree_cmds::wake(&h, &branch, name.as_deref(), net, lazy)),
        Command::Tree { json } => home().and_then(|h| tree_cmds::tree(&h, json)),
        Command::Gc { json } => home().and_then(|h| tree_cmds::gc(&h, json)),
        Command::Store(StoreCommand::Verify { json }) => {
            home().and_then(|h| tree_cmds::verify(&h, json))
        }
        Command::Contract(cmd) => home().and_then(|h| contract_cmds::contract(&h, cmd)),
        Command::Secret(cmd) => home().and_then(|h| contract_cmds::secret(&h, cmd)),
        Command::Checkpoint { name, tag, json } => {
            home().and_then(|h| fork_cmds::checkpoint(&h, &name, tag, json))
        }
        Command::Rollback { name, tag, json } => {
            home().and_then(|h| fork_cmds::rollback(&h, &name, &tag, json))
        }
        Command::Checkpoints { name } => home().and_then(|h| {
            for c in fork_cmds::list_checkpoints(&h, &name)? {
                println!("{}\tpid {}", c.tag, c.pid);
            }
            Ok(ExitCode::SUCCESS)
        }),
        Command::Snapshot { name, to, json } => {
            home().and_then(|h| fork_cmds::snapshot(&h, &name, &to, json))
        }
        Command::Image(cmd) => image_cmd::run(cmd),
        Command::Machine(cmd) => home().and_then(|h| machine::run(&h, cmd)),
        Command::Effects(args) => home().and_then(|h| effects_cmds::effects_cmd(&h, args)),
        Command::Gateway(cmd) => home().and_then(|h| effects_cmds::gateway(&h, cmd)),
    }
}

/// `$TINE_HOME`, or `~/.cache/tine`.
fn home() -> anyhow::Result<std::path::PathBuf> {
    Ok(image::default_home()?)
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
