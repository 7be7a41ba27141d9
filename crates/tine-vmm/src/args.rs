//! The VMM's command line: one vm in the foreground, booted or restored.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use vmm::config::{DiskConfig, NetConfig, VsockConfig};
use vmm::process::{self, ProcessOptions};
use vmm::VmConfig;

/// Default command line for Linux guests: console on COM1, reset through
/// the i8042, reboot on panic, and no probing of absent PC hardware.
pub const DEFAULT_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=1 i8042.noaux i8042.nomux i8042.nopnp";

#[derive(Args, Debug)]
pub struct VmmArgs {
    /// Kernel: uncompressed ELF vmlinux, bzImage, or a micro guest ELF.
    #[arg(long, required_unless_present_any = ["image", "from"], conflicts_with_all = ["image", "from"])]
    pub(crate) kernel: Option<PathBuf>,
    /// Image: `minimal` or `debian` (built by `tine image build [debian]`),
    /// `micro-counter`, `micro-memtouch`, `micro-blkio`, or an image directory. An image
    /// with a root filesystem gets it as /dev/vda (read-only unless the
    /// first --disk replaces it).
    #[arg(long, conflicts_with = "from")]
    pub(crate) image: Option<String>,
    /// Restore a snapshot directory (`tine snapshot --to DIR`) instead of
    /// booting: memory is mapped copy-on-write from DIR/memory. Give a
    /// --disk for every disk of the snapshot, in order (a top layer on
    /// each frozen layer, or the read-only base with `,ro`).
    #[arg(long)]
    pub(crate) from: Option<PathBuf>,
    /// Initramfs to load (with --kernel).
    #[arg(long, conflicts_with = "image")]
    pub(crate) initrd: Option<PathBuf>,
    /// Kernel command line (default for --kernel: a serial console setup;
    /// for --image: the image's own).
    #[arg(long)]
    pub(crate) cmdline: Option<String>,
    /// Words appended to the command line.
    #[arg(long)]
    pub(crate) append: Option<String>,
    /// Guest memory (e.g. 256M, 1G).
    #[arg(long, default_value = "256M", value_parser = crate::size::parse_mib)]
    pub(crate) mem: u64,
    /// Number of vCPUs (1–4).
    #[arg(long, default_value_t = 1)]
    pub(crate) vcpus: u8,
    /// CPU template: `t2`, `t2s`, or a custom template's JSON file. The
    /// guest's CPUID is normalized to it and its snapshots wake on any
    /// host that satisfies it; refused on a host that does not. A
    /// restored vm keeps its snapshot's.
    #[arg(long, conflicts_with = "from")]
    pub(crate) cpu_template: Option<String>,
    /// Append the guest console (COM1) to this file.
    #[arg(long)]
    pub(crate) console_log: Option<PathBuf>,
    /// Feed bytes written to this Unix socket to the console.
    #[arg(long)]
    pub(crate) console_socket: Option<PathBuf>,
    /// Attach the console to this process's stdin/stdout.
    #[arg(long)]
    pub(crate) console: bool,
    /// Raw disk image as virtio-blk; append `,ro` for read-only. Repeatable.
    #[arg(long = "disk")]
    pub(crate) disks: Vec<String>,
    /// Tap device as virtio-net, `TAP[,mac=52:54:00:12:34:56][,fd=N]`;
    /// with `fd=N` the tap is already open on inherited fd N (the host
    /// opened it), otherwise it is opened or created by name. Repeatable.
    #[arg(long = "net")]
    pub(crate) nets: Vec<String>,
    /// virtio-vsock with a host Unix socket, `PATH[,cid=3]`.
    #[arg(long)]
    pub(crate) vsock: Option<String>,
    /// Write why the vm ended to this file (JSON) when the VMM exits.
    #[arg(long, hide = true)]
    pub(crate) exit_file: Option<PathBuf>,
    /// Serve the control socket (fork, checkpoint, snapshot) here.
    #[arg(long, hide = true)]
    pub(crate) api_socket: Option<PathBuf>,
    /// The vm's name (for frozen layer names and logs).
    #[arg(long, hide = true, default_value = "vm")]
    pub(crate) name: String,
    /// With --from: page guest RAM in lazily (userfaultfd) from this
    /// snapshot of the store instead of mapping DIR/memory (`tine wake
    /// --lazy`).
    #[arg(long, hide = true, requires = "from")]
    pub(crate) lazy_snapshot: Option<i64>,
    /// With --from: track dirty pages from the first instruction,
    /// relative to this label (the store snapshot being restored), so the
    /// next `tine sleep` stores only what changed.
    #[arg(long, hide = true, requires = "from")]
    pub(crate) dirty_base: Option<String>,
    /// Where a lazy wake writes the working set it records.
    #[arg(long, hide = true, requires = "lazy_snapshot")]
    pub(crate) working_set_out: Option<PathBuf>,
    /// Join this cgroup before anything else (repeatable: one per cgroup
    /// v1 hierarchy); the host made it with the vm's limits.
    #[arg(long = "cgroup", hide = true)]
    pub(crate) cgroups: Vec<PathBuf>,
    /// Run as this uid and gid (the host picks one per process tree; fork
    /// children keep it). Only a privileged VMM can change its uid.
    #[arg(long, hide = true, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) uid: Option<u32>,
    /// The directory of this VMM's process tree in `$TINE_HOME`
    /// (`t/TREE`: its vms and their frozen layers; the host makes it,
    /// fork children share it): all of the home's vms and layers the jail
    /// shows. Without it the jail shows the home's `vms` and `layers`
    /// whole (a vm from before trees).
    #[arg(long, hide = true)]
    pub(crate) tree: Option<PathBuf>,
    /// Start the tree's PID namespace (`tree_init`) and write the VMM's
    /// host pid to this inherited fd.
    #[arg(long, hide = true)]
    pub(crate) pid_report: Option<i32>,
    /// KVM device to open.
    #[arg(long, env = "TINE_KVM_DEVICE", default_value = "/dev/kvm")]
    pub(crate) kvm_device: PathBuf,
}

pub fn run(args: VmmArgs) -> anyhow::Result<ExitCode> {
    let opts = ProcessOptions {
        start_paused: false,
        name: args.name.clone(),
        api_socket: args.api_socket.clone(),
        exit_file: args.exit_file.clone(),
    };
    // The jail first: nothing of the guest or the snapshot is read
    // outside it (docs/design/isolation.md).
    if let Err(e) = jail(&args) {
        process::write_exit(&opts, &format!("failed to start: {e:#}"));
        return Err(e);
    }
    let vmm = match build_or_restore(args) {
        Ok(v) => v,
        Err(e) => {
            process::write_exit(&opts, &format!("failed to start: {e:#}"));
            return Err(e);
        }
    };
    let (exit, reason) = process::serve(vmm, opts, || {}).context("vm failed")?;
    eprintln!("tine: guest {reason}");
    Ok(ExitCode::from(exit.exit_code() as u8))
}

/// With `--pid-report`: this process continues as the VMM of a new PID
/// namespace (`tree_init`). Not with `TINE_JAIL=off`, where the VMM
/// stays this process (tined then reads the report's end as no pid and
/// keeps the one it started).
pub fn enter_pid_namespace(args: &VmmArgs) -> anyhow::Result<()> {
    let Some(fd) = args.pid_report else {
        return Ok(());
    };
    if std::env::var("TINE_JAIL").as_deref() == Ok("off") {
        // SAFETY: the fd the host passed for the report, closed unused.
        unsafe {
            libc::close(fd);
        }
        return Ok(());
    }
    if fd < 3 {
        anyhow::bail!("--pid-report {fd}: not an inherited fd (3 or above)");
    }
    let tree = args
        .tree
        .as_deref()
        .and_then(|t| t.file_name())
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    crate::tree_init::enter(fd, &image::default_home()?, &tree)
}

/// Enters the VMM's jail (`TINE_JAIL=off` skips it: for debugging only).
fn jail(args: &VmmArgs) -> anyhow::Result<()> {
    match std::env::var("TINE_JAIL").as_deref() {
        Err(_) | Ok("" | "on") => {}
        Ok("off") => return Ok(()),
        Ok(other) => anyhow::bail!("TINE_JAIL={other}: expected on or off"),
    }
    let home = image::default_home()?;
    let report = vmm::jail::enter(&vmm::jail::Jail {
        cgroups: args.cgroups.clone(),
        // Only a tap to open by name needs it (its forks do the same).
        net_admin: args.nets.iter().any(|n| !net_passed(n)),
        mounts: Some(crate::jail::mounts(&home, args)),
        // A lazy wake may page in from S3; its forks inherit the need.
        no_network: args.nets.iter().all(|n| net_passed(n)) && !crate::jail::needs_network(args),
        uid: args.uid,
    })?;
    tracing::debug!(?report, "jailed");
    Ok(())
}

fn build_or_restore(args: VmmArgs) -> anyhow::Result<vmm::Vmm> {
    let mut disks: Vec<DiskConfig> = args.disks.iter().map(|d| parse_disk(d)).collect();
    let nets = args
        .nets
        .iter()
        .map(|n| parse_net(n))
        .collect::<anyhow::Result<Vec<_>>>()?;
    check_passed_taps(&nets)?;
    if let Some(dir) = &args.from {
        return restore(dir, &args, disks, nets);
    }
    let (kernel, initrd, image_cmdline) = match (&args.image, args.kernel) {
        (Some(name), _) => {
            let r = image::resolve(&image::default_home()?, name)?;
            // An image with a root filesystem boots from /dev/vda. The first
            // --disk, when given, stands in for it (`tine run` passes the
            // vm's own overlay); otherwise the cached base is attached
            // read-only, so no guest ever writes it.
            if let (Some(rootfs), true) = (r.rootfs, disks.is_empty()) {
                disks.push(DiskConfig {
                    path: rootfs,
                    read_only: true,
                });
            }
            (r.kernel, r.initrd, r.cmdline)
        }
        (None, Some(kernel)) => (kernel, args.initrd, DEFAULT_CMDLINE.to_string()),
        (None, None) => anyhow::bail!("give --kernel PATH, --image NAME or --from DIR"),
    };
    let mut cmdline = args.cmdline.unwrap_or(image_cmdline);
    if let Some(extra) = &args.append {
        if !cmdline.is_empty() {
            cmdline.push(' ');
        }
        cmdline.push_str(extra);
    }
    let config = VmConfig {
        kernel,
        initrd,
        cmdline,
        mem_mib: args.mem,
        vcpus: args.vcpus,
        console_log: args.console_log,
        console_stdout: args.console,
        console_stdin: args.console,
        console_socket: args.console_socket,
        disks,
        nets,
        vsock: args.vsock.as_deref().map(parse_vsock).transpose()?,
        kvm_device: args.kvm_device,
        cpu_template: args
            .cpu_template
            .as_deref()
            .map(vmm::cpu_template::resolve)
            .transpose()?,
    };
    Ok(vmm::build(&config)?)
}

/// A vm from a snapshot directory: checked (manifest, state, host
/// compatibility, memory file) before anything is created.
fn restore(
    dir: &std::path::Path,
    args: &VmmArgs,
    disks: Vec<DiskConfig>,
    nets: Vec<NetConfig>,
) -> anyhow::Result<vmm::Vmm> {
    let (manifest, moment) = vmm::snapshot_dir::load(dir)?;
    vmm::snapshot_dir::check_host(dir, &manifest, &args.kvm_device)?;
    anyhow::ensure!(
        disks.len() == manifest.disks.len(),
        "the snapshot has {} disk(s); give one --disk for each (got {})",
        manifest.disks.len(),
        disks.len()
    );
    let vsock = match (&args.vsock, manifest.vsock_cid) {
        (Some(v), Some(cid)) => Some(VsockConfig {
            guest_cid: cid,
            ..parse_vsock(v)?
        }),
        (None, Some(_)) => anyhow::bail!("the snapshot has a vsock device; give --vsock PATH"),
        (Some(_), None) => anyhow::bail!("the snapshot has no vsock device; drop --vsock"),
        (None, None) => None,
    };
    let config = VmConfig {
        mem_mib: manifest.mem_mib,
        vcpus: u8::try_from(manifest.vcpus).unwrap_or(u8::MAX),
        console_log: args.console_log.clone(),
        console_stdout: args.console,
        console_stdin: args.console,
        console_socket: args.console_socket.clone(),
        disks,
        nets,
        vsock,
        kvm_device: args.kvm_device.clone(),
        // Its vCPUs' CPUID comes from the saved state; kept so that its
        // next snapshot records the template too.
        cpu_template: manifest
            .compat
            .cpu_template
            .as_ref()
            .map(|r| r.template.clone()),
        ..VmConfig::default()
    };
    if let Some(id) = args.lazy_snapshot {
        let (source, prefetch) =
            crate::store_source::lazy_source(id, vmm::layer::RamLayout::of(&moment.ram_regions()))?;
        let options = vmm::pagein::LazyOptions {
            working_set_out: args.working_set_out.clone(),
            prefetch,
            ..Default::default()
        };
        let mut vmm = vmm::pagein::restore_lazy(&config, &moment, source, options)?;
        track_dirty(&mut vmm, args);
        return Ok(vmm);
    }
    let mem =
        vmm::memory::map_file_private(&dir.join(vmm::snapshot_dir::MEMORY), &moment.ram_regions())?;
    let mut vmm = vmm::restore(&config, mem, vmm::memory::RamBacking::Private, &moment)?;
    track_dirty(&mut vmm, args);
    Ok(vmm)
}

fn track_dirty(vmm: &mut vmm::Vmm, args: &VmmArgs) {
    if let Some(base) = &args.dirty_base {
        vmm.track_dirty(vmm::dirty::DirtyTracking {
            enabled: true,
            base: Some(base.clone()),
        });
    }
}

fn parse_disk(s: &str) -> DiskConfig {
    match s.strip_suffix(",ro") {
        Some(path) => DiskConfig {
            path: path.into(),
            read_only: true,
        },
        None => DiskConfig {
            path: s.into(),
            read_only: false,
        },
    }
}

fn parse_net(s: &str) -> anyhow::Result<NetConfig> {
    let mut parts = s.split(',');
    let tap = parts.next().unwrap_or_default().to_string();
    anyhow::ensure!(!tap.is_empty(), "--net needs a tap name, e.g. --net tap0");
    let mut mac = [0x52, 0x54, 0x00, 0x12, 0x34, 0x56];
    let mut tap_fd = None;
    for p in parts {
        if let Some(v) = p.strip_prefix("fd=") {
            tap_fd = Some(
                v.parse::<i32>()
                    .ok()
                    .filter(|fd| *fd > 2)
                    .with_context(|| format!("--net fd={v}: expected an open fd number above 2"))?,
            );
            continue;
        }
        let v = p.strip_prefix("mac=").with_context(|| {
            format!("unknown --net option {p:?}; use mac=52:54:00:12:34:56 or fd=N")
        })?;
        mac = parse_mac(v)?;
    }
    Ok(NetConfig { tap, mac, tap_fd })
}

/// Whether `--net` names a tap the host opened (`fd=N`): the VMM then
/// needs no CAP_NET_ADMIN and no network namespace of the host's.
pub(crate) fn net_passed(s: &str) -> bool {
    s.split(',').skip(1).any(|p| p.starts_with("fd="))
}

/// Checks that each passed tap fd is open on the tap it is named after
/// (a wrong fd would otherwise show only as a dead network).
fn check_passed_taps(nets: &[NetConfig]) -> anyhow::Result<()> {
    for n in nets {
        if let Some(fd) = n.tap_fd {
            let name = vmm::devices::virtio::net::Tap::attached_name(fd)
                .with_context(|| format!("--net {},fd={fd}: fd {fd} is not an open tap", n.tap))?;
            anyhow::ensure!(
                name == n.tap,
                "--net {},fd={fd}: fd {fd} is the tap {name:?}",
                n.tap
            );
        }
    }
    Ok(())
}

fn parse_mac(s: &str) -> anyhow::Result<[u8; 6]> {
    let bytes: Vec<u8> = s
        .split(':')
        .map(|b| u8::from_str_radix(b, 16))
        .collect::<Result<_, _>>()
        .with_context(|| format!("bad MAC address {s:?}"))?;
    bytes
        .try_into()
        .map_err(|_| anyhow::anyhow!("bad MAC address {s:?}: need six bytes"))
}

fn parse_vsock(s: &str) -> anyhow::Result<VsockConfig> {
    let mut parts = s.split(',');
    let path = parts.next().unwrap_or_default();
    anyhow::ensure!(!path.is_empty(), "--vsock needs a socket path");
    let mut guest_cid = 3;
    for p in parts {
        let v = p
            .strip_prefix("cid=")
            .with_context(|| format!("unknown --vsock option {p:?}; use cid=N"))?;
        guest_cid = v.parse().with_context(|| format!("bad vsock cid {v:?}"))?;
    }
    anyhow::ensure!(
        guest_cid > 2,
        "vsock cid {guest_cid} is reserved; use 3 or more"
    );
    Ok(VsockConfig {
        guest_cid,
        uds_path: path.into(),
    })
}
