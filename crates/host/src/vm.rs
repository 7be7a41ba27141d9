//! The vm lifecycle: start (boot or restore), list, stop, kill, remove.
//! Each vm is one `tine-vmm` process with its state under
//! `$TINE_HOME/vms/NAME/` ([`crate::state`]).
//!
//! Everything a request can get wrong (name, limits, image, contract,
//! disks, snapshot compatibility) is checked before anything is created,
//! so a refused `run` leaves nothing behind.

use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use contract::Contract;
use protocol::wake::Role;
use serde::{Deserialize, Serialize};

use crate::error::Context;
use crate::intent::{Intent, Op, Phase};
use crate::proc::Pid;
use crate::state::{self, VmDir, VmRecord, VmState};
use crate::{agent, bail, cgroup, gateway, lock, net, wake, Error, Host};

/// The MAC a vm started with `net` gets.
pub const DEFAULT_MAC: [u8; 6] = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];

/// Where a lazily woken vm's VMM writes the working set it recorded
/// (`vms/NAME/working-set.json`); its next sleep stores it.
pub const WORKING_SET: &str = "working-set.json";

fn default_image() -> String {
    "minimal".into()
}
fn default_mem() -> u64 {
    512
}
fn default_vcpus() -> u8 {
    1
}
fn default_timeout() -> u64 {
    180
}

/// What to start (`tine run`, `POST /v1/vms`). Paths are the host's,
/// absolute.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunSpec {
    /// Name of the vm (1-48 letters, digits, '-', '_', '.').
    pub name: String,
    /// `minimal` or `debian` (Linux, `tine image build [debian]`),
    /// `micro-counter`, `micro-memtouch`, `micro-blkio`, or an image directory.
    #[serde(default = "default_image")]
    pub image: String,
    /// A kernel file instead of an image (a micro guest ELF, vmlinux or bzImage).
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub kernel: Option<PathBuf>,
    /// Guest memory in MiB.
    #[serde(default = "default_mem")]
    pub mem_mib: u64,
    /// vCPUs (1-4).
    #[serde(default = "default_vcpus")]
    pub vcpus: u8,
    /// Raw or qcow2 disk images as virtio-blk; each gets the vm's own top
    /// layer, the file itself is never written.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<String>))]
    pub disks: Vec<PathBuf>,
    /// A tap and an address from a new network tree.
    #[serde(default)]
    pub net: bool,
    /// Do not wait for a guest agent (micro guests have none).
    #[serde(default)]
    pub no_agent: bool,
    /// How long to wait for the agent to answer, in seconds.
    #[serde(default = "default_timeout")]
    pub timeout_s: u64,
    /// Restore a snapshot directory instead of booting (image, kernel,
    /// memory, vCPUs and disks come from it).
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>))]
    pub from: Option<PathBuf>,
    /// The vm's fork contract (TOML text); with `from`, over the snapshot's.
    #[serde(default)]
    pub contract: Option<String>,
    /// CPU template for a boot: a built-in name (`t2`, `t2s`) or the
    /// absolute path of a custom template's JSON file. The guest's CPUID
    /// is normalized to it, and its snapshots wake on any host that
    /// satisfies it (docs/design/cpu-templates.md). A restore keeps its
    /// snapshot's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_template: Option<String>,
    /// Snapshot the running vm into the store this often (seconds, at
    /// least 5): tined's keep policy (`PUT /v1/vms/{name}/keep`); the
    /// engine itself ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_every_s: Option<u64>,
    /// Page RAM in lazily from this store snapshot (a lazy wake).
    #[serde(skip)]
    pub(crate) lazy_snapshot: Option<i64>,
    /// Track dirty pages from the start, relative to this store snapshot.
    #[serde(skip)]
    pub(crate) dirty_base: Option<i64>,
    /// How the snapshot's image is shown (a wake names the branch's).
    #[serde(skip)]
    pub(crate) shown_image: Option<String>,
}

impl RunSpec {
    /// A vm named `name` booted from `image` with the defaults.
    pub fn new(name: impl Into<String>, image: impl Into<String>) -> RunSpec {
        RunSpec {
            name: name.into(),
            image: image.into(),
            kernel: None,
            mem_mib: default_mem(),
            vcpus: default_vcpus(),
            disks: Vec::new(),
            net: false,
            no_agent: false,
            timeout_s: default_timeout(),
            from: None,
            contract: None,
            cpu_template: None,
            keep_every_s: None,
            lazy_snapshot: None,
            dirty_base: None,
            shown_image: None,
        }
    }

    /// A restore of snapshot directory `from` as `name`.
    pub fn restore(name: &str, from: &Path, net: bool) -> RunSpec {
        RunSpec {
            from: Some(from.into()),
            net,
            ..RunSpec::new(name, "minimal")
        }
    }

    /// A micro guest: runs on any /dev/kvm, has no agent.
    pub fn is_micro(&self) -> bool {
        match &self.from {
            // A snapshot without a vsock device is a micro guest's; one that
            // cannot be read is refused later, with the reason.
            Some(dir) => !vmm::snapshot_dir::load(dir).is_ok_and(|(m, _)| m.vsock_cid.is_some()),
            None => self.kernel.is_some() || self.image.starts_with("micro-"),
        }
    }
}

/// A vm that [`start`] made ready.
#[derive(Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunReport {
    pub name: String,
    pub pid: u32,
    /// From the request to ready (agent answered and woken, or VMM up).
    pub ready_ms: f64,
    /// Its wake-up step (None: a micro guest, no agent).
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub wake: Option<wake::Woken>,
    /// Failed wake steps and other trouble that does not stop the vm.
    pub problems: Vec<String>,
}

/// What a checked [`RunSpec`] resolved to.
struct Plan {
    manifest: Option<vmm::snapshot_dir::Manifest>,
    contract: Contract,
    agent: bool,
    vsock: bool,
    /// Base disks (the image's root first), each to get a top layer.
    bases: Vec<PathBuf>,
    /// Kernel, initramfs and command line of a boot.
    boot: Option<image::Resolved>,
    image_shown: String,
    parent: Option<String>,
}

/// Checks everything about `spec` that can be checked before a file is
/// made or a process started.
fn plan(h: &Host, spec: &RunSpec) -> crate::Result<Plan> {
    state::validate_name(&spec.name)?;
    let manifest = match &spec.from {
        Some(dir) => {
            let (m, _) = vmm::snapshot_dir::load(dir)?;
            let kvm = std::env::var_os("TINE_KVM_DEVICE").unwrap_or_else(|| "/dev/kvm".into());
            vmm::snapshot_dir::check_host(dir, &m, Path::new(&kvm))?;
            confine_disks(&h.home, dir, &m)?;
            Some(m)
        }
        None => None,
    };
    let micro = spec.is_micro();
    let boot = match (&manifest, &spec.kernel) {
        (Some(_), _) => None,
        (None, Some(k)) => Some(image::Resolved {
            kernel: k.clone(),
            initrd: None,
            cmdline: vmm_default_cmdline().into(),
            rootfs: None,
            micro: true,
            image: None,
        }),
        (None, None) => Some(
            image::resolve(&h.home, &spec.image)
                .with_context(|| format!("cannot use image {:?}", spec.image))?,
        ),
    };
    let vsock = match &manifest {
        Some(m) => m.vsock_cid.is_some(),
        None => !micro,
    };
    let agent = !spec.no_agent && vsock;
    if agent {
        if let Some(img) = boot.as_ref().and_then(|b| b.image.as_ref()) {
            if img.agent.is_none() {
                return Err(Error::invalid(format!(
                    "image {:?} ({}) has no guest agent, so its vms could never answer; rebuild it with `tine image build` (the agent is included by default), or run it with --no-agent",
                    spec.image,
                    img.dir.display()
                )));
            }
        }
    }
    let mut bases = Vec::new();
    if let Some(rootfs) = boot.as_ref().and_then(|b| b.rootfs.clone()) {
        bases.push(rootfs);
    }
    for d in &spec.disks {
        let d = std::fs::canonicalize(d)
            .map_err(|_| Error::invalid(format!("disk image {} not found", d.display())))?;
        disk::Disk::open(&d, false)
            .with_context(|| format!("cannot use {} as a disk", d.display()))?;
        bases.push(d);
    }
    // The VMM's own checks (memory, vCPUs, files), here, before anything
    // exists: a refused run leaves no vm holding the name.
    let (mem_mib, vcpus) = match &manifest {
        Some(m) => (m.mem_mib, u8::try_from(m.vcpus).unwrap_or(u8::MAX)),
        None => (spec.mem_mib, spec.vcpus),
    };
    let check = vmm::VmConfig {
        kernel: boot
            .as_ref()
            .map(|b| b.kernel.clone())
            .unwrap_or_else(|| PathBuf::from("/")),
        initrd: boot.as_ref().and_then(|b| b.initrd.clone()),
        mem_mib,
        vcpus,
        ..vmm::VmConfig::default()
    };
    match check.validate() {
        Ok(()) => {}
        // A restore has no kernel file to check.
        Err(vmm::config::ConfigError::KernelMissing(_)) if manifest.is_some() => {}
        Err(e) => return Err(Error::invalid(e.to_string())),
    }
    if let Some(t) = &spec.cpu_template {
        check_cpu_template(t, manifest.is_some())?;
    }
    let contract = {
        let own = match manifest.as_ref().and_then(|m| m.contract.as_deref()) {
            Some(text) => Contract::parse(text).context("the snapshot's contract")?,
            None => Contract::default(),
        };
        match &spec.contract {
            Some(text) => own.overridden_by(&Contract::parse(text).context("the contract")?),
            None => own,
        }
    };
    // A restore runs its contract's rotate providers: only those this
    // host's owner allowed.
    if manifest.is_some() {
        crate::providers::check(&h.home, &contract)?;
    }
    let lineage = spec
        .from
        .as_deref()
        .and_then(gateway::snapshot_lineage)
        .unwrap_or_default();
    let image_shown = match (&spec.shown_image, &spec.kernel, &spec.from) {
        (Some(s), _, _) => s.clone(),
        (None, _, Some(_)) => lineage
            .image
            .clone()
            .unwrap_or_else(|| "snapshot".to_string()),
        (None, Some(k), None) => k.display().to_string(),
        (None, None, None) => spec.image.clone(),
    };
    let parent = manifest.as_ref().map(|m| m.name.clone());
    Ok(Plan {
        manifest,
        contract,
        agent,
        vsock,
        bases,
        boot,
        image_shown,
        parent,
    })
}

/// A snapshot's disks must be files tine made: frozen layers and store
/// copies under `$TINE_HOME`. A manifest moves between hosts and is
/// untrusted, and a path in it must not make a host file (`/etc/shadow`)
/// a guest's disk.
fn confine_disks(home: &Path, dir: &Path, m: &vmm::snapshot_dir::Manifest) -> crate::Result<()> {
    let root = std::fs::canonicalize(home)
        .with_context(|| format!("cannot resolve {}", home.display()))?;
    for (i, d) in m.disks.iter().enumerate() {
        let inside =
            std::fs::canonicalize(&d.path).is_ok_and(|p| p.starts_with(&root) && p.is_file());
        if !inside {
            return Err(Error::invalid(format!(
                "the snapshot in {} names disk {i} at {}, which is not a disk file under {}: a snapshot's disks are frozen layers tine made there; take the snapshot again on this host, or wake it from the store",
                dir.display(),
                d.path.display(),
                root.display()
            )));
        }
    }
    Ok(())
}

/// The command line the VMM uses for a bare `--kernel` (a serial console).
fn vmm_default_cmdline() -> &'static str {
    "console=ttyS0 reboot=k panic=1 i8042.noaux i8042.nomux i8042.nopnp"
}

/// Starts a vm: boots or restores it, waits for its agent and wakes it.
pub fn start(h: &Host, spec: RunSpec) -> crate::Result<RunReport> {
    state::validate_name(&spec.name)?;
    let _lock = lock::reserve(&h.home, std::slice::from_ref(&spec.name))?;
    if crate::branches::is_sleeping(h, &spec.name) {
        return Err(Error::conflict(format!(
            "a sleeping branch named {:?} exists; wake it (`tine wake {}`), remove it (`tine rm {}`) or pick another name",
            spec.name, spec.name, spec.name
        )));
    }
    start_reserved(h, spec)
}

/// [`start`] with the name's lock held by the caller.
pub(crate) fn start_reserved(h: &Host, spec: RunSpec) -> crate::Result<RunReport> {
    let started = Instant::now();
    let plan = plan(h, &spec)?;
    let _layers = crate::layers::shared(h)?;
    let old = VmDir::new(&h.home, &spec.name);
    if let Ok(r) = old.read_record() {
        return Err(Error::conflict(match old.state(&r) {
            VmState::Running => format!(
                "a vm named {:?} is already running; pick another name",
                spec.name
            ),
            s => format!(
                "a {s} vm named {:?} exists; remove it first with `tine rm {}`",
                spec.name, spec.name
            ),
        }));
    }
    // A new VMM process tree: a directory of its own.
    let vm = VmDir::new_tree(&h.home, &spec.name)?;
    let mut intent = Intent::begin(
        &h.home,
        Op::Run {
            vm: spec.name.clone(),
        },
    )?;
    let res = launch(h, &spec, &plan, &vm, &mut intent, started);
    // A vm whose VMM ran stays, stopped (it has an exit record); anything
    // else a failed start made goes.
    if res.is_err() && vm.read_exit().is_none() {
        undo_start(h, &vm);
    }
    intent.done();
    res
}

/// Everything [`start`] does once the plan holds; on error the caller
/// removes what is left.
fn launch(
    h: &Host,
    spec: &RunSpec,
    plan: &Plan,
    vm: &VmDir,
    intent: &mut Intent,
    started: Instant,
) -> crate::Result<RunReport> {
    // (Leftovers of a vm of this name that never wrote its record go.)
    vm.create()?;
    let lease = if spec.net {
        let l = net::lease_new_tree(&h.home, &spec.name)?;
        // Recorded at once, so an undo releases it.
        state::write_atomic(&vm.dir.join("lease.json"), &serde_json::to_vec(&l)?)?;
        net::isolate(&tap_name(&spec.name), &l, None)?;
        Some(l)
    } else {
        None
    };
    vm.write_contract(&plan.contract)?;
    let (mut cmd, ndisks) = match &plan.manifest {
        Some(m) => restore_command(h, vm, spec, m)?,
        None => boot_command(h, vm, spec, plan)?,
    };
    // A tree's VMM runs in a PID namespace of its own.
    let report = match vm.tree() {
        Some(_) => Some(pid_report(&mut cmd)?),
        None => None,
    };
    let spawning = crate::settle::spawning();
    intent.phase(Phase::Asked)?;
    let mut child = cmd.spawn().context("cannot start the VMM")?;
    // The host's copy of a passed tap goes with the command: the tap
    // lives exactly as long as the VMM holds it (and so does the write
    // end of the report).
    drop(cmd);
    let pid = match report {
        None => child.id(),
        Some(r) => match read_pid_report(r, PID_REPORT_TIMEOUT) {
            Ok(Some(p)) => {
                // The process started here has forked the tree's init
                // and ends now.
                if !crate::proc::Reaper::installed() {
                    let _ = child.wait();
                }
                p
            }
            // No namespace (TINE_JAIL=off, or unprivileged).
            Ok(None) => child.id(),
            Err(e) => {
                let _ = child.kill();
                if !crate::proc::Reaper::installed() {
                    let _ = child.wait();
                }
                drop(spawning);
                return Err(e.context(format!(
                    "the VMM of {:?} did not start; see {}",
                    spec.name,
                    vm.vmm_log().display()
                )));
            }
        },
    };
    let record = VmRecord {
        name: spec.name.clone(),
        pid,
        pid_start: crate::proc::process_start(pid).unwrap_or(0),
        created_ms: state::now_ms(),
        image: plan.image_shown.clone(),
        mem_mib: plan
            .manifest
            .as_ref()
            .map(|m| m.mem_mib)
            .unwrap_or(spec.mem_mib),
        vcpus: plan
            .manifest
            .as_ref()
            .map(|m| m.vcpus as u8)
            .unwrap_or(spec.vcpus),
        agent: plan.agent,
        parent: plan.parent.clone(),
        disks: ndisks,
        mac: spec.net.then_some(DEFAULT_MAC),
        vsock: plan.vsock,
        lease,
        branch: gateway::new_id()?,
        lineage: match &spec.from {
            Some(d) => gateway::lineage_from_snapshot(d),
            None => Vec::new(),
        },
        lazy: spec.lazy_snapshot.is_some(),
        uid: Some(crate::jail::uid_for(&h.home, &vm.name)),
    };
    let written = vm.write_record(&record);
    drop(spawning);
    if let Err(e) = written {
        let _ = child.kill();
        return Err(e);
    }
    intent.phase(Phase::Recorded)?;
    let gateway_problem = gateway::register(h, vm, &record);

    let res = become_ready(spec, plan, vm, &record, &mut child, started);
    // The VMM is not ours to wait for here: the reaper (tined) or init
    // reaps it when it ends.
    std::mem::forget(child);
    match res {
        Ok((woken, mut problems)) => {
            problems.extend(gateway_problem);
            Ok(RunReport {
                name: spec.name.clone(),
                pid,
                ready_ms: started.elapsed().as_secs_f64() * 1000.0,
                wake: woken,
                problems,
            })
        }
        Err(e) => {
            // It ran: it stays, stopped, with its logs and why (so `ls`
            // and `tine console` can tell), its resources let go.
            stop_failed(h, vm, &record, &e.to_string());
            Err(e)
        }
    }
}

/// Waits until the vm answers and wakes it; its wake, and problems.
fn become_ready(
    spec: &RunSpec,
    plan: &Plan,
    vm: &VmDir,
    record: &VmRecord,
    child: &mut std::process::Child,
    started: Instant,
) -> crate::Result<(Option<wake::Woken>, Vec<String>)> {
    let pid = record.pid;
    let lease = record.lease;
    let deadline = started + Duration::from_secs(spec.timeout_s);
    let vmm = Pid {
        pid,
        start: record.pid_start,
    };
    loop {
        if !vmm.alive() {
            let _ = crate::proc::Pid::wait_gone(&vmm, Duration::from_secs(1));
            // Reap it here when nothing else does (no reaper outside tined).
            if !crate::proc::Reaper::installed() {
                let _ = child.wait();
            }
            let log = std::fs::read_to_string(vm.vmm_log()).unwrap_or_default();
            let why = log
                .lines()
                .rev()
                .find(|l| l.starts_with("tine: "))
                .unwrap_or("");
            bail!(
                "vm {:?} ended before it was ready: {}; see {} and {}",
                spec.name,
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
            && (!plan.agent || agent::probe(&vm.vsock(), probe).is_ok());
        if ready {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "the agent of vm {:?} did not answer within {}s; the vm was removed (see {})",
                spec.name,
                spec.timeout_s,
                vm.console_log().display()
            );
        }
        std::thread::sleep(Duration::from_millis(if plan.agent { 20 } else { 1 }));
    }
    if let Some(l) = &lease {
        net::configure_taps(&[(tap_name(&spec.name), *l)])?;
    }
    // Wake-up: a booted vm takes its identity; a restored one becomes a
    // new copy. It is ready only once that is done.
    let mut problems = Vec::new();
    let mut woken = None;
    if plan.agent {
        let role = if plan.manifest.is_some() {
            Role::Restored
        } else {
            Role::Boot
        };
        let rotated = match role {
            Role::Restored => wake::rotate_values(
                &plan.contract,
                &spec.name,
                record.parent.as_deref().unwrap_or(""),
            )?,
            _ => Vec::new(),
        };
        let w = wake::Round::new(&plan.contract)?.message(role, record, &rotated)?;
        let w = wake::wake_one(vm, w);
        problems = w.failures();
        if !w.ready() {
            bail!("vm {:?} was stopped: {}", spec.name, problems.join("; "));
        }
        woken = Some(w);
    }
    Ok((woken, problems))
}

/// Ends a vm whose start failed after its VMM ran: killed if it still
/// runs, its exit record saying why, its lease, tap and registration let go.
fn stop_failed(h: &Host, vm: &VmDir, r: &VmRecord, why: &str) {
    let _ = kill_quietly(r);
    if vm.read_exit().is_none() {
        let rec = state::ExitRecord {
            reason: format!("failed to start: {why}"),
            ended_ms: state::now_ms(),
        };
        if let Ok(b) = serde_json::to_vec(&rec) {
            let _ = state::write_atomic(&vm.exit_path(), &b);
        }
    }
    gateway::unregister(h, r);
    if let Some(l) = &r.lease {
        net::forget(&tap_name(&vm.name));
        net::release(&h.home, l);
    }
}

/// Removes what a failed start left: its process, lease, tap, directory.
pub(crate) fn undo_start(h: &Host, vm: &VmDir) {
    let record = vm.read_record().ok();
    if let Some(r) = &record {
        let _ = kill_quietly(r);
        gateway::unregister(h, r);
    }
    if let Ok(text) = std::fs::read(vm.dir.join("lease.json")) {
        if let Ok(l) = serde_json::from_slice::<net::Lease>(&text) {
            net::forget(&tap_name(&vm.name));
            net::release(&h.home, &l);
        }
    }
    release_group(
        h,
        vm,
        record.map(|r| cgroup::Limits::of(r.mem_mib, r.vcpus)),
    );
    let _ = vm.remove_dir();
}

/// Lets go of vm `vm`'s share of its group (`size`: one vm's limits,
/// from its record). With other vms left in its tree, the tree's limits
/// shrink by one vm's; otherwise (the tree's last vm, or a vm from before
/// trees) whatever is left in the group ends and the group goes. Returns
/// how many processes were ended.
fn release_group(h: &Host, vm: &VmDir, size: Option<cgroup::Limits>) -> usize {
    let group = cgroup::group_of(vm);
    if let Some(tree) = vm.tree() {
        let others = state::vms_in_tree(tree)
            .into_iter()
            .filter(|n| *n != vm.name)
            .count();
        if others > 0 {
            if let Some(l) = size {
                cgroup::set_limits(&h.home, &group, l.times(others));
            }
            return 0;
        }
    }
    cgroup::remove(&h.home, &group)
}

/// The `tine-vmm --from DIR` command line for a restore, with a top
/// layer on each frozen disk of the snapshot.
fn restore_command(
    h: &Host,
    vm: &VmDir,
    spec: &RunSpec,
    m: &vmm::snapshot_dir::Manifest,
) -> crate::Result<(Command, usize)> {
    let dir = spec.from.as_deref().unwrap_or(Path::new("."));
    let vcpus = u8::try_from(m.vcpus).unwrap_or(u8::MAX);
    let mut cmd = base_command(h, vm, cgroup::Limits::of(m.mem_mib, vcpus))?;
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
    if spec.net {
        pass_tap(&mut cmd, &tap_name(&spec.name))?;
    }
    if m.vsock_cid.is_some() {
        cmd.arg("--vsock").arg(vm.vsock());
    }
    if let Some(id) = spec.dirty_base {
        cmd.arg("--dirty-base").arg(id.to_string());
    }
    if let Some(id) = spec.lazy_snapshot {
        cmd.arg("--lazy-snapshot").arg(id.to_string());
        cmd.arg("--working-set-out").arg(vm.dir.join(WORKING_SET));
    }
    detach(vm, &mut cmd)?;
    Ok((cmd, n))
}

/// A run's CPU template, checked before anything exists: a built-in
/// name or an absolute path to a valid template file, and only for a
/// boot. (Whether this host satisfies it, the VMM checks as it boots.)
fn check_cpu_template(t: &str, restore: bool) -> crate::Result<()> {
    use vmm::cpu_template;
    if restore {
        return Err(Error::invalid(
            "cpu_template is for a boot: a restored vm keeps the CPU template of its snapshot",
        ));
    }
    if let Some(found) = cpu_template::builtin(t) {
        return found.map(drop).map_err(|e| Error::invalid(e.to_string()));
    }
    if !Path::new(t).is_absolute() {
        return Err(Error::invalid(format!(
            "cpu_template {t:?} is neither a built-in template ({}) nor an absolute path to a template file",
            cpu_template::builtin_names().join(", ")
        )));
    }
    cpu_template::Template::from_file(Path::new(t))
        .map(drop)
        .map_err(|e| Error::invalid(e.to_string()))
}

/// The `tine-vmm` command line of a boot, with the vm's own disk layers
/// created.
fn boot_command(
    h: &Host,
    vm: &VmDir,
    spec: &RunSpec,
    plan: &Plan,
) -> crate::Result<(Command, usize)> {
    let mut cmd = base_command(h, vm, cgroup::Limits::of(spec.mem_mib, spec.vcpus))?;
    if let Some(b) = &plan.boot {
        cmd.arg("--kernel").arg(&b.kernel);
        if let Some(i) = &b.initrd {
            cmd.arg("--initrd").arg(i);
        }
        cmd.arg("--cmdline").arg(&b.cmdline);
    }
    cmd.arg("--mem").arg(format!("{}M", spec.mem_mib));
    cmd.arg("--vcpus").arg(spec.vcpus.to_string());
    if let Some(t) = &spec.cpu_template {
        cmd.arg("--cpu-template").arg(t);
    }
    // Each disk gets the vm's own empty qcow2 top layer; the base (the
    // image's root filesystem first) is never written.
    for (i, base) in plan.bases.iter().enumerate() {
        let top = vm.disk_layer(i);
        disk::create_overlay(base, &top)
            .with_context(|| format!("cannot create the top layer {}", top.display()))?;
        cmd.arg("--disk").arg(&top);
    }
    if spec.net {
        pass_tap(&mut cmd, &tap_name(&spec.name))?;
    }
    if plan.vsock {
        cmd.arg("--vsock").arg(vm.vsock());
    }
    detach(vm, &mut cmd)?;
    Ok((cmd, plan.bases.len()))
}

/// `tine-vmm` with the vm's own console, exit file, control socket,
/// cgroup (made here with `limits`; the VMM joins it first thing) and
/// the uid of its process tree.
fn base_command(h: &Host, vm: &VmDir, limits: cgroup::Limits) -> crate::Result<Command> {
    let mut cmd = Command::new(&h.bins.vmm);
    cmd.arg("--name").arg(&vm.name);
    // A run or a wake starts a tree: its group holds this one vm.
    for dir in cgroup::prepare(&h.home, &cgroup::group_of(vm), limits)? {
        cmd.arg("--cgroup").arg(dir);
    }
    cmd.arg("--uid")
        .arg(crate::jail::uid_for(&h.home, &vm.name).to_string());
    if let Some(tree) = vm.tree() {
        // All of the home's vms and layers its jail shows.
        cmd.arg("--tree").arg(tree);
    }
    cmd.arg("--console-log").arg(vm.console_log());
    cmd.arg("--console-socket").arg(vm.console_socket());
    cmd.arg("--exit-file").arg(vm.exit_path());
    cmd.arg("--api-socket").arg(vm.api_socket());
    // Which home a VMM belongs to, for reconcile's sweep of orphans
    // (fork children inherit it).
    cmd.env("TINE_HOME", &h.home);
    Ok(cmd)
}

/// How long a new VMM may take to report its pid from its namespace.
const PID_REPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Asks `tine-vmm` for a PID namespace of its own (`--pid-report FD`);
/// returns our end of a socket pair where its tree's init writes the
/// VMM's host pid. The other end is the command's until it is dropped.
fn pid_report(cmd: &mut Command) -> crate::Result<std::os::unix::net::UnixStream> {
    let (ours, theirs) =
        std::os::unix::net::UnixStream::pair().context("cannot make a socket pair")?;
    let fd = inherit(cmd, theirs.into());
    cmd.arg("--pid-report").arg(fd.to_string());
    Ok(ours)
}

/// The host pid a tree's init reported on `r`: None when the VMM runs
/// without a namespace (its end closed with nothing said), an error when
/// nothing came within `timeout` or the init could not tell.
fn read_pid_report(
    r: std::os::unix::net::UnixStream,
    timeout: Duration,
) -> crate::Result<Option<u32>> {
    use std::io::{BufRead, Read};
    r.set_read_timeout(Some(timeout))
        .context("cannot set a read timeout")?;
    let mut line = String::new();
    std::io::BufReader::new(r.take(64))
        .read_line(&mut line)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                Error::failed(format!(
                    "the VMM did not report its pid within {} s",
                    timeout.as_secs()
                ))
            }
            _ => Error::from(e).context("cannot read the VMM's pid"),
        })?;
    if line.trim().is_empty() {
        return Ok(None);
    }
    match line.trim().parse::<u32>() {
        Ok(p) if p > 0 => Ok(Some(p)),
        _ => bail!(
            "the tree's init could not tell the VMM's pid ({:?})",
            line.trim()
        ),
    }
}

/// Hands `fd` to the command's process as an inherited fd (its number is
/// returned for the command line); the command holds our copy until it
/// is dropped.
fn inherit(cmd: &mut Command, fd: std::os::fd::OwnedFd) -> i32 {
    let raw = fd.as_raw_fd();
    // SAFETY: fcntl(2) is async-signal-safe; the closure owns `fd`, which
    // is open until the command is dropped.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    raw
}

/// Opens (creates) the tap `name` here, in the host's network namespace,
/// and hands it to the VMM as an inherited fd (`--net NAME,fd=N`): the
/// VMM then needs neither CAP_NET_ADMIN nor the host's network, and gets
/// an empty network namespace of its own. The command holds the host's
/// copy (close-on-exec in tined) until it is dropped.
fn pass_tap(cmd: &mut Command, name: &str) -> crate::Result<()> {
    let fd = inherit(cmd, open_tap(name)?);
    cmd.arg("--net").arg(format!("{name},fd={fd}"));
    Ok(())
}

/// Opens (creating it) the tap `name`, configured for a VMM to adopt.
pub(crate) fn open_tap(name: &str) -> crate::Result<std::os::fd::OwnedFd> {
    vmm::devices::virtio::net::Tap::open(name)
        .map(|t| t.into_fd())
        .map_err(|e| {
            let mut msg = e.to_string();
            let mut cause = std::error::Error::source(&e);
            while let Some(c) = cause {
                msg = format!("{msg}: {c}");
                cause = c.source();
            }
            Error::failed(msg)
        })
}

/// The VMM's output goes to its log; it runs in its own session so a
/// signal to tined's process group does not reach it.
fn detach(vm: &VmDir, cmd: &mut Command) -> crate::Result<()> {
    let log = std::fs::File::create(vm.vmm_log())
        .with_context(|| format!("cannot create {}", vm.vmm_log().display()))?;
    let log_err = log.try_clone().context("cannot open the VMM log")?;
    cmd.stdin(Stdio::null()).stdout(log).stderr(log_err);
    cmd.current_dir(&vm.dir);
    // SAFETY: setsid is async-signal-safe and touches no memory of ours.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    Ok(())
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

/// One vm as `ls` and `GET /v1/vms` show it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VmInfo {
    pub name: String,
    pub state: VmState,
    pub pid: Option<u32>,
    pub image: String,
    pub mem_mib: u64,
    pub vcpus: u8,
    /// Resident memory of the VMM process (guest pages it touched included).
    pub rss_mib: Option<u64>,
    pub uptime_s: Option<u64>,
    /// Why it ended (stopped, crashed).
    pub exit: Option<String>,
    /// The vm (or stored snapshot's vm) it continues from.
    #[serde(default)]
    pub parent: Option<String>,
    /// Its checkpoints' tags.
    #[serde(default)]
    pub checkpoints: Vec<String>,
    /// Whether its guest runs tine's agent.
    #[serde(default)]
    pub agent: bool,
    /// Its address (vms with a network: `--net`), leased by the host it
    /// runs on.
    #[serde(default)]
    pub address: Option<String>,
}

/// One vm's row.
pub fn info(h: &Host, name: &str) -> crate::Result<VmInfo> {
    state::validate_name(name)?;
    let vm = VmDir::new(&h.home, name);
    let r = vm.read_record()?;
    Ok(row(h, &vm, &r))
}

fn row(h: &Host, vm: &VmDir, r: &VmRecord) -> VmInfo {
    let st = vm.state(r);
    let running = st == VmState::Running;
    VmInfo {
        name: r.name.clone(),
        state: st,
        pid: running.then_some(r.pid),
        image: r.image.clone(),
        mem_mib: r.mem_mib,
        vcpus: r.vcpus,
        rss_mib: if running {
            crate::proc::process_rss_kib(r.pid).map(|k| k / 1024)
        } else {
            None
        },
        uptime_s: running.then(|| state::now_ms().saturating_sub(r.created_ms) / 1000),
        exit: match st {
            VmState::Stopped => vm.read_exit().map(|e| e.reason),
            VmState::Crashed => Some(vm.crash_detail(r)),
            _ => None,
        },
        parent: r.parent.clone(),
        checkpoints: crate::checkpoints::list_checkpoints(h, &vm.name)
            .map(|v| v.into_iter().map(|c| c.tag).collect())
            .unwrap_or_default(),
        agent: r.agent,
        address: r.lease.map(|l| l.ip.to_string()),
    }
}

/// Every vm of this home, by name.
pub fn list(h: &Host) -> crate::Result<Vec<VmInfo>> {
    let mut rows = Vec::new();
    for vm in state::list(&h.home)? {
        let Ok(r) = vm.read_record() else { continue };
        rows.push(row(h, &vm, &r));
    }
    Ok(rows)
}

/// Page faults served so far by the lazily woken vms that run.
pub fn pagein_faults(h: &Host) -> u64 {
    let Ok(vms) = state::list(&h.home) else {
        return 0;
    };
    vms.iter()
        .filter_map(|vm| {
            let r = vm.read_record().ok()?;
            if !r.lazy || vm.state(&r) != VmState::Running {
                return None;
            }
            let c = vmm::api::call(
                &vm.api_socket(),
                &vmm::api::Request::PageIn {
                    working_set_to: None,
                },
                Duration::from_millis(500),
            )
            .ok()?;
            c.reply.pagein.map(|p| p.faults)
        })
        .sum()
}

/// The running vm `name`, or a clear error.
pub(crate) fn running(h: &Host, name: &str) -> crate::Result<(VmDir, VmRecord)> {
    running_for(h, name, "do that")
}

/// The running vm `name`, or a conflict saying what it is instead and
/// that only a running vm can do `doing`.
pub fn running_for(h: &Host, name: &str, doing: &str) -> crate::Result<(VmDir, VmRecord)> {
    state::validate_name(name)?;
    let vm = VmDir::new(&h.home, name);
    let r = vm.read_record()?;
    match vm.state(&r) {
        VmState::Running => Ok((vm, r)),
        _ => Err(Error::conflict(format!(
            "vm {name:?} is {}; only a running vm can {doing}",
            vm.not_running(&r)
        ))),
    }
}

/// The layers of each disk of a vm, top first.
pub fn disk_layers(h: &Host, name: &str) -> crate::Result<Vec<Vec<disk::LayerInfo>>> {
    state::validate_name(name)?;
    let vm = VmDir::new(&h.home, name);
    vm.read_record()?;
    let mut disks = Vec::new();
    for i in 0.. {
        let top = vm.disk_layer(i);
        if !top.exists() {
            break;
        }
        disks.push(
            disk::chain(&top)
                .with_context(|| format!("cannot read the layers of {}", top.display()))?,
        );
    }
    Ok(disks)
}

/// The console log of a vm, and whether it still runs.
pub fn console_log(h: &Host, name: &str) -> crate::Result<(PathBuf, bool)> {
    state::validate_name(name)?;
    let vm = VmDir::new(&h.home, name);
    let r = vm.read_record()?;
    Ok((vm.console_log(), vm.state(&r) == VmState::Running))
}

/// Types `line` and a newline into a running vm's console (COM1 input).
pub fn console_send(h: &Host, name: &str, line: &str) -> crate::Result<()> {
    let (vm, _) = running(h, name)?;
    let path = vm.console_socket();
    let mut s = std::os::unix::net::UnixStream::connect(&path)
        .with_context(|| format!("cannot reach the console of {name:?} at {}", path.display()))?;
    std::io::Write::write_all(&mut s, line.as_bytes())?;
    std::io::Write::write_all(&mut s, b"\n")?;
    Ok(())
}

/// How a stop went.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Stopped {
    /// It was not running.
    Already,
    /// The guest shut down when its agent asked.
    Clean,
    /// It ended on SIGTERM.
    Terminated,
    /// It was killed (SIGKILL).
    Killed,
}

/// Stops a vm: the agent shuts the guest down, then SIGTERM, then SIGKILL.
pub fn stop(h: &Host, name: &str, timeout: Duration) -> crate::Result<Stopped> {
    state::validate_name(name)?;
    let _lock = lock::acquire(&h.home, name, lock::DEFAULT_WAIT)?;
    let vm = VmDir::new(&h.home, name);
    let r = vm.read_record()?;
    if vm.state(&r) != VmState::Running {
        return Ok(Stopped::Already);
    }
    let p = pid_of(&r);
    if r.agent
        && agent::shutdown(&vm.vsock(), Duration::from_secs(5)).is_ok()
        && p.wait_gone(timeout)
    {
        return Ok(Stopped::Clean);
    }
    p.signal(libc::SIGTERM);
    if p.wait_gone(Duration::from_secs(5)) {
        return Ok(Stopped::Terminated);
    }
    kill_now(&vm, &r)?;
    Ok(Stopped::Killed)
}

/// Kills a vm's VMM at once.
pub fn kill(h: &Host, name: &str) -> crate::Result<Stopped> {
    state::validate_name(name)?;
    let _lock = lock::acquire(&h.home, name, lock::DEFAULT_WAIT)?;
    let vm = VmDir::new(&h.home, name);
    let r = vm.read_record()?;
    if vm.state(&r) != VmState::Running {
        return Ok(Stopped::Already);
    }
    kill_now(&vm, &r)?;
    Ok(Stopped::Killed)
}

pub(crate) fn pid_of(r: &VmRecord) -> Pid {
    Pid {
        pid: r.pid,
        start: r.pid_start,
    }
}

/// SIGKILLs the VMM and returns once its main thread has exited: the
/// guest no longer runs, while the kernel may still be freeing its memory
/// (rollback does not wait for that; the vm it starts takes over the
/// socket paths and gets a new top layer file).
pub(crate) fn kill_stopped(r: &VmRecord) -> crate::Result<()> {
    let p = pid_of(r);
    p.signal(libc::SIGKILL);
    let deadline = Instant::now() + Duration::from_secs(30);
    while p.alive() {
        if Instant::now() > deadline {
            bail!("VMM pid {} of vm {:?} survived SIGKILL", r.pid, r.name);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    Ok(())
}

/// SIGKILLs the VMM and waits until it is entirely gone.
pub(crate) fn kill_quietly(r: &VmRecord) -> crate::Result<()> {
    // Generous: a loaded host takes a while to tear down a big vm.
    pid_of(r)
        .kill(Duration::from_secs(30))
        .with_context(|| format!("VMM of vm {:?}", r.name))
}

fn kill_now(vm: &VmDir, r: &VmRecord) -> crate::Result<()> {
    kill_quietly(r)?;
    let rec = state::ExitRecord {
        reason: "killed".into(),
        ended_ms: state::now_ms(),
    };
    state::write_atomic(&vm.exit_path(), &serde_json::to_vec(&rec)?)
}

/// What `rm` removed.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Removed {
    pub name: String,
    /// `vm` or `branch` (a sleeping branch of the store).
    pub what: String,
    /// Processes ended (the VMM, checkpoint templates).
    pub processes: usize,
    /// Frozen disk layers freed (folded into their vm, or deleted).
    pub layers_freed: usize,
    /// Trouble that did not stop the removal.
    pub problems: Vec<String>,
}

/// Removes a vm (with `force`, a running one too) and everything it
/// holds: its processes, checkpoints, lease, tap, gateway registration,
/// directory; then the frozen layers nothing uses any more. A name that
/// is no vm is not found ([`crate::tree::remove`] also removes branches).
pub fn remove(h: &Host, name: &str, force: bool) -> crate::Result<Removed> {
    state::validate_name(name)?;
    let vm = VmDir::new(&h.home, name);
    if !vm.exists() {
        return Err(Error::not_found(format!(
            "no vm named {name:?} (see `tine ls`)"
        )));
    }
    let lock = lock::acquire(&h.home, name, lock::DEFAULT_WAIT)?;
    let r = vm.read_record()?;
    if vm.state(&r) == VmState::Running && !force {
        return Err(Error::conflict(format!(
            "vm {name:?} is running; `tine stop {name}` first, or `tine rm --force {name}`"
        )));
    }
    let intent = Intent::begin(&h.home, Op::Remove { vm: name.into() })?;
    let mut out = remove_locked(h, &vm, &r)?;
    intent.done();
    drop(lock);
    let (freed, problems) = crate::layers::after_removal(h);
    out.layers_freed = freed;
    out.problems.extend(problems);
    Ok(out)
}

/// [`remove`] with the vm's lock held (and its intent recorded).
pub(crate) fn remove_locked(h: &Host, vm: &VmDir, r: &VmRecord) -> crate::Result<Removed> {
    let mut processes = 0;
    if vm.state(r) == VmState::Running {
        kill_quietly(r)?;
        processes += 1;
    }
    processes += crate::checkpoints::drop_checkpoints(vm);
    // Whatever the vm's processes left behind (a writer, a template the
    // records lost) ends with its group.
    processes += release_group(h, vm, Some(cgroup::Limits::of(r.mem_mib, r.vcpus)));
    gateway::unregister(h, r);
    if let Some(l) = &r.lease {
        net::forget(&tap_name(&vm.name));
        net::release(&h.home, l);
    }
    let mut problems = Vec::new();
    if let Err(e) = crate::branches::forget_vm(h, vm) {
        problems.push(format!("the store still lists branch {:?}: {e}", vm.name));
    }
    vm.remove_dir()?;
    Ok(Removed {
        name: vm.name.clone(),
        what: "vm".into(),
        processes,
        layers_freed: 0,
        problems,
    })
}
