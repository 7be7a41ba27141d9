//! The vm verbs: run, ls, console, stop, kill, rm. Each vm is one detached
//! VMM process (`tine vmm`) with its state under `$TINE_HOME/vms/NAME/`.

use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use serde::Serialize;

use crate::agent_client;
use crate::state::{self, VmDir, VmRecord, VmState};
use contract::Contract;
use protocol::wake::Role;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Name of the vm (letters, digits, '-', '_', '.').
    #[arg(long)]
    name: String,
    /// Image: `minimal` or `debian` (Linux, `tine image build [debian]`),
    /// `micro-counter`, `micro-memtouch`, or an image directory.
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
    /// With --from: page RAM in lazily from this store snapshot.
    #[arg(skip)]
    lazy_snapshot: Option<i64>,
    /// Track dirty pages from the start, relative to this store snapshot.
    #[arg(skip)]
    dirty_base: Option<i64>,
}

impl RunArgs {
    /// `run --name NAME --from DIR [--net]` (a wake from the store).
    pub fn restore(name: &str, from: &Path, net: bool) -> RunArgs {
        RunArgs {
            name: name.into(),
            image: "minimal".into(),
            kernel: None,
            mem: 512,
            vcpus: 1,
            disks: Vec::new(),
            net,
            no_agent: false,
            timeout_secs: 180,
            from: Some(from.into()),
            contract: None,
            lazy_snapshot: None,
            dirty_base: None,
        }
    }

    /// With a fork contract over the snapshot's own (`--contract`).
    pub fn contract(self, file: Option<&Path>) -> RunArgs {
        RunArgs {
            contract: file.map(Path::to_path_buf),
            ..self
        }
    }

    /// Its VMM tracks the pages the guest dirties from its first
    /// instruction, relative to store snapshot `id` (what it restores).
    pub fn dirty_base(self, id: i64) -> RunArgs {
        RunArgs {
            dirty_base: Some(id),
            ..self
        }
    }

    /// [`RunArgs::restore`] with RAM paged in lazily from store snapshot `id`.
    pub fn restore_lazy(name: &str, from: &Path, net: bool, id: i64) -> RunArgs {
        RunArgs {
            lazy_snapshot: Some(id),
            ..RunArgs::restore(name, from, net)
        }
    }

    /// A micro guest: runs on any /dev/kvm, has no agent.
    pub fn is_micro(&self) -> bool {
        match &self.from {
            // A snapshot without a vsock device is a micro guest's; one that
            // cannot be read is refused here, with the reason.
            Some(dir) => !vmm::snapshot_dir::load(dir).is_ok_and(|(m, _)| m.vsock_cid.is_some()),
            None => self.kernel.is_some() || self.image.starts_with("micro-"),
        }
    }
}

/// Where a lazily woken vm's VMM writes the working set it recorded
/// (`vms/NAME/working-set.json`); its next sleep stores it.
pub const WORKING_SET: &str = "working-set.json";

/// A vm `start` made ready.
#[derive(Debug, serde::Serialize)]
pub struct Started {
    pub name: String,
    pub pid: u32,
    /// From the start of the command to ready (agent answered or VMM up).
    pub ready_ms: f64,
    /// Its wake-up step (None: a micro guest, no agent).
    pub wake: Option<crate::wake::Woken>,
    /// Failed wake steps and other trouble that does not stop the vm.
    pub problems: Vec<String>,
}

impl Started {
    /// The line `tine run` prints, problems on stderr; failure if any.
    pub fn report(&self) -> ExitCode {
        let what = if self.wake.is_some() {
            "agent answered"
        } else {
            "VMM running"
        };
        println!(
            "{}: {what} in {:.0} ms (pid {})",
            self.name, self.ready_ms, self.pid
        );
        for p in &self.problems {
            eprintln!("tine: {p}");
        }
        if self.problems.is_empty() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }
}

/// `tine run`: starts the VMM detached and waits for the agent.
pub fn run(home: &Path, args: RunArgs) -> anyhow::Result<ExitCode> {
    Ok(start(home, args)?.report())
}

/// Starts the VMM detached, waits for it (and the agent) and wakes the vm.
pub fn start(home: &Path, args: RunArgs) -> anyhow::Result<Started> {
    state::validate_name(&args.name)?;
    let vm = VmDir::new(home, &args.name);
    if vm.exists() {
        let r = vm.read_record()?;
        match vm.state(&r) {
            VmState::Running => bail!(
                "a vm named {:?} is already running; pick another --name",
                args.name
            ),
            s => bail!(
                "a {s} vm named {:?} exists; remove it first with `tine rm {}`",
                args.name,
                args.name
            ),
        }
    }
    let micro = args.is_micro();
    let manifest = match &args.from {
        Some(dir) => {
            let (m, _) = vmm::snapshot_dir::load(dir)?;
            let kvm = std::env::var_os("TINE_KVM_DEVICE").unwrap_or_else(|| "/dev/kvm".into());
            vmm::snapshot_dir::check_host(dir, &m, Path::new(&kvm))?;
            Some(m)
        }
        None => None,
    };
    let vsock = match &manifest {
        Some(m) => m.vsock_cid.is_some(),
        None => !micro,
    };
    let agent = !args.no_agent && vsock;
    for base in &args.disks {
        anyhow::ensure!(base.is_file(), "disk image {} not found", base.display());
    }
    let contract = {
        let own = match manifest.as_ref().and_then(|m| m.contract.as_deref()) {
            Some(text) => Contract::parse(text).context("the snapshot's contract")?,
            None => Contract::default(),
        };
        match &args.contract {
            Some(f) => {
                let text = std::fs::read_to_string(f)
                    .with_context(|| format!("cannot read the contract {}", f.display()))?;
                own.overridden_by(
                    &Contract::parse(&text).with_context(|| format!("in {}", f.display()))?,
                )
            }
            None => own,
        }
    };
    // Leftovers of a vm that never wrote its record.
    let _ = std::fs::remove_dir_all(&vm.dir);
    std::fs::create_dir_all(&vm.dir)
        .with_context(|| format!("cannot create {}", vm.dir.display()))?;

    let lease = if args.net {
        let tap = tap_name(&args.name);
        let l = crate::net::lease_new_tree(home, &args.name)?;
        if let Err(e) = crate::net::isolate(&tap, &l, None) {
            crate::net::release(home, &l);
            let _ = std::fs::remove_dir_all(&vm.dir);
            return Err(e);
        }
        Some(l)
    } else {
        None
    };
    let undo_net = |l: &Option<crate::net::Lease>| {
        if let Some(l) = l {
            crate::net::forget(&tap_name(&args.name));
            crate::net::release(home, l);
        }
    };
    vm.write_contract(&contract)?;
    let made = match &manifest {
        Some(m) => restore_command(&vm, &args, m),
        None => vmm_command(&vm, &args, micro),
    };
    let (mut cmd, ndisks) = match made {
        Ok(cmd) => cmd,
        Err(e) => {
            // Nothing ran: leave no state behind.
            undo_net(&lease);
            let _ = std::fs::remove_dir_all(&vm.dir);
            return Err(e);
        }
    };
    let started = Instant::now();
    let mut child = cmd.spawn().context("cannot start the VMM")?;
    let pid = child.id();
    let record = VmRecord {
        name: args.name.clone(),
        pid,
        pid_start: state::process_start(pid).unwrap_or(0),
        created_ms: state::now_ms(),
        image: match (&args.kernel, &args.from) {
            (_, Some(d)) => format!("snapshot {}", d.display()),
            (Some(k), None) => k.display().to_string(),
            (None, None) => args.image.clone(),
        },
        mem_mib: manifest.as_ref().map(|m| m.mem_mib).unwrap_or(args.mem),
        vcpus: manifest
            .as_ref()
            .map(|m| m.vcpus as u8)
            .unwrap_or(args.vcpus),
        agent,
        parent: None,
        disks: ndisks,
        mac: args.net.then_some(crate::fork_cmds::DEFAULT_MAC),
        vsock,
        lease,
        branch: crate::effects_cmds::new_id()?,
        lineage: match &args.from {
            Some(d) => crate::effects_cmds::lineage_from_snapshot(d),
            None => Vec::new(),
        },
    };
    vm.write_record(&record)?;
    let gateway_problem = crate::effects_cmds::register(home, &vm, &record);

    let deadline = started + Duration::from_secs(args.timeout_secs);
    loop {
        if let Some(status) = child.try_wait().context("cannot watch the VMM")? {
            let log = std::fs::read_to_string(vm.vmm_log()).unwrap_or_default();
            let why = log
                .lines()
                .rev()
                .find(|l| l.starts_with("tine: "))
                .unwrap_or("");
            bail!(
                "vm {:?} ended before it was ready ({status}): {}; see {} and {}",
                args.name,
                why.trim_start_matches("tine: "),
                vm.vmm_log().display(),
                vm.console_log().display()
            );
        }
        // Ready: the control socket answers (forks can be asked for), and
        // the agent too where there is one. An agent probe may wait up to
        // 5 s: before the guest's vsock driver is up the VMM holds the
        // request and sends it the moment the driver is, and a guest whose
        // agent is not listening yet resets it at once; a short timeout
        // instead gives up on a guest that is merely slow, every time.
        let probe = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(500), Duration::from_secs(5));
        let ready = vmm::api::call(
            &vm.api_socket(),
            &vmm::api::Request::Ping,
            Duration::from_millis(500),
        )
        .is_ok()
            && (!agent || agent_client::probe(&vm.vsock(), probe).is_ok());
        if ready {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "the agent of vm {:?} did not answer within {}s; the vm was killed (see {})",
                args.name,
                args.timeout_secs,
                vm.console_log().display()
            );
        }
        std::thread::sleep(Duration::from_millis(if agent { 20 } else { 1 }));
    }
    if let Some(l) = &lease {
        crate::net::configure_taps(&[(tap_name(&args.name), *l)])?;
    }
    // Wake-up: a booted vm takes its identity; a restored one becomes a
    // new copy. It is ready only once that is done.
    let mut problems = Vec::new();
    let mut wake = None;
    if agent {
        let role = if manifest.is_some() {
            Role::Restored
        } else {
            Role::Boot
        };
        let mut rec = record.clone();
        rec.parent = manifest.as_ref().map(|m| m.name.clone());
        let w = match role {
            Role::Restored => crate::wake::rotate_values(
                &contract,
                &args.name,
                rec.parent.as_deref().unwrap_or(""),
            ),
            _ => Ok(Vec::new()),
        }
        .and_then(|rot| crate::wake::Round::new(&contract)?.message(role, &rec, &rot));
        let w = match w {
            Ok(w) => w,
            Err(e) => {
                let _ = kill_quietly(&record);
                return Err(e.context(format!("vm {:?} was stopped", args.name)));
            }
        };
        let woken = crate::wake::wake_one(&vm, w);
        problems = woken.failures();
        if !woken.ready() {
            let _ = kill_quietly(&record);
            bail!("vm {:?} was stopped: {}", args.name, problems.join("; "));
        }
        wake = Some(woken);
    }
    // The VMM is not our child to wait for: it is reparented when we exit.
    std::mem::forget(child);
    problems.extend(gateway_problem);
    Ok(Started {
        name: args.name.clone(),
        pid,
        ready_ms: started.elapsed().as_secs_f64() * 1000.0,
        wake,
        problems,
    })
}

/// The `tine vmm --from DIR` command line for `run --from`, with a top
/// layer on each frozen disk of the snapshot.
fn restore_command(
    vm: &VmDir,
    args: &RunArgs,
    m: &vmm::snapshot_dir::Manifest,
) -> anyhow::Result<(Command, usize)> {
    let dir = args.from.as_deref().unwrap_or(Path::new("."));
    let mut cmd = base_command(vm, &args.name)?;
    cmd.arg("--from").arg(dir);
    let mut n = 0;
    for d in &m.disks {
        if d.frozen {
            let top = vm.disk_layer(n);
            disk::create_overlay(&d.path, &top).with_context(|| {
                format!(
                    "cannot stack a top layer on the snapshot's disk {}",
                    d.path.display()
                )
            })?;
            cmd.arg("--disk").arg(&top);
            n += 1;
        } else {
            cmd.arg("--disk").arg(format!("{},ro", d.path.display()));
        }
    }
    if args.net {
        cmd.arg("--net").arg(tap_name(&args.name));
    }
    if m.vsock_cid.is_some() {
        cmd.arg("--vsock").arg(vm.vsock());
    }
    if let Some(id) = args.dirty_base {
        cmd.arg("--dirty-base").arg(id.to_string());
    }
    if let Some(id) = args.lazy_snapshot {
        cmd.arg("--lazy-snapshot").arg(id.to_string());
        cmd.arg("--working-set-out").arg(vm.dir.join(WORKING_SET));
    }
    detach(vm, &mut cmd)?;
    Ok((cmd, n))
}

/// `tine vmm` with the vm's own console, exit file and control socket.
fn base_command(vm: &VmDir, name: &str) -> anyhow::Result<Command> {
    let exe = std::env::current_exe().context("cannot find the tine executable")?;
    let mut cmd = Command::new(&exe);
    cmd.arg("vmm");
    cmd.arg("--name").arg(name);
    cmd.arg("--console-log").arg(vm.console_log());
    cmd.arg("--console-socket").arg(vm.console_socket());
    cmd.arg("--exit-file").arg(vm.exit_path());
    cmd.arg("--api-socket").arg(vm.api_socket());
    Ok(cmd)
}

/// The VMM's output goes to its log; it runs in its own session so it
/// outlives this command.
fn detach(vm: &VmDir, cmd: &mut Command) -> anyhow::Result<()> {
    let log = std::fs::File::create(vm.vmm_log())
        .with_context(|| format!("cannot create {}", vm.vmm_log().display()))?;
    let log_err = log.try_clone().context("cannot open the VMM log")?;
    cmd.stdin(Stdio::null()).stdout(log).stderr(log_err);
    // SAFETY: setsid is async-signal-safe and touches no memory of ours; it
    // detaches the VMM from our session so it outlives this command.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    Ok(())
}

/// The `tine vmm` command line for `run`, with the vm's own disk layers
/// created.
fn vmm_command(vm: &VmDir, args: &RunArgs, micro: bool) -> anyhow::Result<(Command, usize)> {
    let mut cmd = base_command(vm, &args.name)?;
    match &args.kernel {
        Some(k) => cmd.arg("--kernel").arg(k),
        None => cmd.arg("--image").arg(&args.image),
    };
    cmd.arg("--mem").arg(format!("{}M", args.mem));
    cmd.arg("--vcpus").arg(args.vcpus.to_string());
    // Each disk gets the vm's own empty qcow2 top layer; the file the user
    // gave (or the image's root filesystem, first) becomes a read-only base
    // that is never written.
    let mut bases = Vec::new();
    if args.kernel.is_none() && !micro {
        if let Some(rootfs) = crate::image_cmd::resolve(&args.image)?.rootfs {
            bases.push(rootfs);
        }
    }
    bases.extend(args.disks.iter().cloned());
    for (i, base) in bases.iter().enumerate() {
        let base = std::fs::canonicalize(base)
            .with_context(|| format!("disk image {} not found", base.display()))?;
        let top = vm.disk_layer(i);
        disk::Disk::open(&base, false)
            .with_context(|| format!("cannot use {} as a disk", base.display()))?;
        disk::create_overlay(&base, &top)
            .with_context(|| format!("cannot create the top layer {}", top.display()))?;
        cmd.arg("--disk").arg(&top);
    }
    if args.net {
        cmd.arg("--net").arg(tap_name(&args.name));
    }
    if !micro {
        cmd.arg("--vsock").arg(vm.vsock());
    }
    detach(vm, &mut cmd)?;
    Ok((cmd, bases.len()))
}

/// The tap of a vm: IFNAMSIZ allows 15 bytes, so a name longer than 12
/// keeps its first 6 and gets 6 hex digits of its hash (`web-server-1`
/// and `web-server-2` must not share a tap).
pub fn tap_name(name: &str) -> String {
    if name.len() <= 12 {
        return format!("tt-{name}");
    }
    let h = blake3::hash(name.as_bytes());
    let head: String = name.chars().take(6).collect();
    format!("tt-{head}{}", &h.to_hex()[..6])
}

/// One row of `tine ls`.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct LsRow {
    pub name: String,
    pub state: VmState,
    pub pid: Option<u32>,
    pub image: String,
    pub mem_mib: u64,
    pub vcpus: u8,
    /// Resident memory of the VMM process (guest pages it touched included).
    pub rss_mib: Option<u64>,
    pub uptime_s: Option<u64>,
    pub exit: Option<String>,
    /// The vm it was forked from.
    #[serde(default)]
    pub parent: Option<String>,
}

/// The rows for every vm under `home`.
pub fn ls_rows(home: &Path) -> anyhow::Result<Vec<LsRow>> {
    let mut rows = Vec::new();
    for vm in state::list(home)? {
        let Ok(r) = vm.read_record() else { continue };
        let st = vm.state(&r);
        let running = st == VmState::Running;
        rows.push(LsRow {
            name: r.name.clone(),
            state: st,
            pid: running.then_some(r.pid),
            image: r.image.clone(),
            mem_mib: r.mem_mib,
            vcpus: r.vcpus,
            rss_mib: if running {
                state::process_rss_kib(r.pid).map(|k| k / 1024)
            } else {
                None
            },
            uptime_s: running.then(|| state::now_ms().saturating_sub(r.created_ms) / 1000),
            exit: match st {
                VmState::Stopped => vm.read_exit().map(|e| e.reason),
                VmState::Crashed => Some("VMM process gone without an exit record".into()),
                VmState::Running => None,
            },
            parent: r.parent.clone(),
        });
    }
    Ok(rows)
}

/// `tine ls`.
pub fn ls(rows: &[LsRow], json: bool) -> anyhow::Result<ExitCode> {
    if json {
        println!("{}", serde_json::to_string_pretty(rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{:<20} {:<8} {:>8} {:>8} {:>8}  {:<12} IMAGE",
        "NAME", "STATE", "PID", "MEM", "UPTIME", "PARENT"
    );
    for r in rows {
        let pid = r.pid.map(|p| p.to_string()).unwrap_or_else(|| "-".into());
        let mem = match r.rss_mib {
            Some(rss) => format!("{rss}/{}M", r.mem_mib),
            None => format!("{}M", r.mem_mib),
        };
        let up = r.uptime_s.map(fmt_duration).unwrap_or_else(|| "-".into());
        let note = r
            .exit
            .as_ref()
            .map(|e| format!("  ({e})"))
            .unwrap_or_default();
        let parent = r.parent.as_deref().unwrap_or("-");
        println!(
            "{:<20} {:<8} {:>8} {:>8} {:>8}  {:<12} {}{note}",
            r.name, r.state, pid, mem, up, parent, r.image
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn fmt_duration(s: u64) -> String {
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{}s", s / 60, s % 60),
        _ => format!("{}h{}m", s / 3600, (s % 3600) / 60),
    }
}

/// `tine disk layers NAME`: every disk of the vm, top layer first.
pub fn disk_layers(home: &Path, name: &str, json: bool) -> anyhow::Result<ExitCode> {
    let vm = VmDir::new(home, name);
    vm.read_record()?;
    let mut disks = Vec::new();
    for i in 0.. {
        let top = vm.disk_layer(i);
        if !top.exists() {
            break;
        }
        let chain = disk::chain(&top)
            .with_context(|| format!("cannot read the layers of {}", top.display()))?;
        disks.push(chain);
    }
    if json {
        let v: Vec<Vec<serde_json::Value>> = disks
            .iter()
            .map(|chain| {
                chain
                    .iter()
                    .map(|l| {
                        serde_json::json!({
                            "path": l.path,
                            "format": format!("{:?}", l.format).to_lowercase(),
                            "virtual_size": l.virtual_size,
                            "allocated_bytes": l.allocated_bytes,
                        })
                    })
                    .collect()
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    if disks.is_empty() {
        println!("{name}: no disks");
    }
    for (i, chain) in disks.iter().enumerate() {
        println!(
            "disk{i} ({} MiB):",
            chain.first().map(|l| l.virtual_size >> 20).unwrap_or(0)
        );
        for (depth, l) in chain.iter().enumerate() {
            let role = if depth == 0 { "top " } else { "base" };
            println!(
                "  {role} {:>6} {:>10} allocated  {}",
                format!("{:?}", l.format).to_lowercase(),
                human_bytes(l.allocated_bytes),
                l.path.display()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn human_bytes(b: u64) -> String {
    match b {
        0..=1023 => format!("{b} B"),
        1024..=1_048_575 => format!("{:.1} KiB", b as f64 / 1024.0),
        1_048_576..=1_073_741_823 => format!("{:.1} MiB", b as f64 / 1_048_576.0),
        _ => format!("{:.2} GiB", b as f64 / 1_073_741_824.0),
    }
}

/// `tine console NAME [--follow]`.
pub fn console(home: &Path, name: &str, follow: bool) -> anyhow::Result<ExitCode> {
    let vm = VmDir::new(home, name);
    let record = vm.read_record()?;
    let path = vm.console_log();
    let mut file =
        std::fs::File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut out = std::io::stdout().lock();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = file
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n > 0 {
            out.write_all(&buf[..n])?;
            continue;
        }
        out.flush()?;
        if !follow || vm.state(&record) != VmState::Running {
            // One more read catches what was written just before the end.
            let pos = file.stream_position()?;
            file.seek(SeekFrom::Start(pos))?;
            let n = file.read(&mut buf)?;
            out.write_all(&buf[..n])?;
            return Ok(ExitCode::SUCCESS);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `tine console NAME --send LINE`: types LINE and a newline into the
/// guest's console.
pub fn console_send(home: &Path, name: &str, line: &str) -> anyhow::Result<ExitCode> {
    let vm = VmDir::new(home, name);
    let record = vm.read_record()?;
    if vm.state(&record) != VmState::Running {
        bail!("vm {name:?} is not running");
    }
    let path = vm.console_socket();
    let mut s = std::os::unix::net::UnixStream::connect(&path)
        .with_context(|| format!("cannot reach the console of {name:?} at {}", path.display()))?;
    s.write_all(line.as_bytes())?;
    s.write_all(b"\n")?;
    Ok(ExitCode::SUCCESS)
}

/// `tine stop NAME`: ask the agent to shut down, then SIGTERM, then SIGKILL.
pub fn stop(home: &Path, name: &str, timeout: Duration) -> anyhow::Result<ExitCode> {
    let vm = VmDir::new(home, name);
    let r = vm.read_record()?;
    if vm.state(&r) != VmState::Running {
        println!("{name}: already {}", vm.state(&r));
        return Ok(ExitCode::SUCCESS);
    }
    if r.agent
        && agent_client::shutdown(&vm.vsock(), Duration::from_secs(5)).is_ok()
        && wait_gone(&r, timeout)
    {
        println!("{name}: stopped");
        return Ok(ExitCode::SUCCESS);
    }
    signal(&r, libc::SIGTERM);
    if wait_gone(&r, Duration::from_secs(5)) {
        println!("{name}: stopped (SIGTERM)");
        return Ok(ExitCode::SUCCESS);
    }
    kill_now(&vm, &r)?;
    println!("{name}: killed (did not stop within the timeout)");
    Ok(ExitCode::SUCCESS)
}

/// `tine kill NAME`: SIGKILL the VMM.
pub fn kill(home: &Path, name: &str) -> anyhow::Result<ExitCode> {
    let vm = VmDir::new(home, name);
    let r = vm.read_record()?;
    if vm.state(&r) != VmState::Running {
        println!("{name}: already {}", vm.state(&r));
        return Ok(ExitCode::SUCCESS);
    }
    kill_now(&vm, &r)?;
    println!("{name}: killed");
    Ok(ExitCode::SUCCESS)
}

/// SIGKILLs the VMM and waits until it is gone; writes no exit record.
/// SIGKILLs the VMM and returns once its main thread has exited: the
/// guest no longer runs, while the kernel may still be freeing its memory
/// (rollback does not wait for that; the vm it starts takes over the
/// socket paths and gets a new top layer file).
pub fn kill_stopped(r: &VmRecord) -> anyhow::Result<()> {
    signal(r, libc::SIGKILL);
    let deadline = Instant::now() + Duration::from_secs(30);
    while state::process_alive(r.pid, r.pid_start) {
        if Instant::now() > deadline {
            bail!("VMM pid {} of vm {:?} survived SIGKILL", r.pid, r.name);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}

pub fn kill_quietly(r: &VmRecord) -> anyhow::Result<()> {
    signal(r, libc::SIGKILL);
    // Generous: a loaded host takes a while to tear down a big vm.
    if !wait_gone(r, Duration::from_secs(30)) {
        bail!("VMM pid {} of vm {:?} survived SIGKILL", r.pid, r.name);
    }
    Ok(())
}

fn kill_now(vm: &VmDir, r: &VmRecord) -> anyhow::Result<()> {
    kill_quietly(r)?;
    let rec = state::ExitRecord {
        reason: "killed".into(),
        ended_ms: state::now_ms(),
    };
    state::write_atomic(&vm.exit_path(), &serde_json::to_vec(&rec)?)
}

/// `tine rm NAME [--force]`.
pub fn rm(home: &Path, name: &str, force: bool) -> anyhow::Result<ExitCode> {
    remove(home, name, force)?;
    println!("{name}: removed");
    Ok(ExitCode::SUCCESS)
}

/// `rm` without the message (a vm that went to sleep ends this way).
pub fn remove(home: &Path, name: &str, force: bool) -> anyhow::Result<()> {
    state::validate_name(name)?;
    let vm = VmDir::new(home, name);
    let r = vm.read_record()?;
    if vm.state(&r) == VmState::Running {
        if !force {
            bail!("vm {name:?} is running; `tine stop {name}` first, or `tine rm --force {name}`");
        }
        kill_now(&vm, &r)?;
    }
    crate::fork_cmds::drop_checkpoints(&vm);
    crate::effects_cmds::unregister(home, &r);
    if let Some(l) = &r.lease {
        crate::net::forget(&tap_name(name));
        crate::net::release(home, l);
    }
    std::fs::remove_dir_all(&vm.dir)
        .with_context(|| format!("cannot remove {}", vm.dir.display()))?;
    Ok(())
}

fn signal(r: &VmRecord, sig: libc::c_int) {
    if state::process_alive(r.pid, r.pid_start) {
        // SAFETY: kill(2) with a pid we checked is our VMM (pid + start time).
        unsafe {
            libc::kill(r.pid as libc::pid_t, sig);
        }
    }
}

/// Waits until the VMM's whole thread group has exited. A pidfd becomes
/// readable exactly then (a zombie leader whose other threads still tear
/// down the vm is not gone yet: its sockets still accept); without one,
/// polls /proc.
fn wait_gone(r: &VmRecord, timeout: Duration) -> bool {
    if !state::process_alive(r.pid, r.pid_start) {
        return true;
    }
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new fd.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, r.pid as libc::pid_t, 0) };
    if let Ok(fd) = i32::try_from(fd) {
        if fd >= 0 {
            // SAFETY: `fd` is the new pidfd, owned here.
            let pidfd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
            // The pid may have been reused between the check and the open.
            if state::process_alive(r.pid, r.pid_start) {
                let mut pfd = libc::pollfd {
                    fd: pidfd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
                // SAFETY: polls one valid pollfd.
                return unsafe { libc::poll(&mut pfd, 1, ms) } == 1;
            }
            return true;
        }
    }
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if !state::process_alive(r.pid, r.pid_start) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    !state::process_alive(r.pid, r.pid_start)
}
