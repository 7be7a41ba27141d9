//! `tine image build`: builds (or finds in the cache) a guest image, here
//! in this process (an image is a file cache, no vm state; tined builds
//! them too, for API clients: `POST /v1/images`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Subcommand, ValueEnum};

#[derive(Subcommand, Debug)]
pub enum ImageCommand {
    /// Build (or find in the cache) a Linux guest image: `minimal` (kernel +
    /// busybox initramfs) or `debian` (Debian bookworm on an ext4 root disk,
    /// made with debootstrap; needs root, takes minutes the first time).
    Build(BuildArgs),
}

/// The images `tine image build` makes.
#[derive(ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Kind {
    /// Kernel + busybox initramfs.
    #[default]
    Minimal,
    /// Debian bookworm (python3, curl, iproute2, ca-certificates, fio) on an ext4 disk.
    Debian,
}

impl From<Kind> for image::ImageKind {
    fn from(k: Kind) -> Self {
        match k {
            Kind::Minimal => image::ImageKind::Minimal,
            Kind::Debian => image::ImageKind::Debian,
        }
    }
}

#[derive(Args, Debug)]
pub struct BuildArgs {
    /// Which image.
    #[arg(value_enum, default_value_t = Kind::Minimal)]
    kind: Kind,
    /// Use this kernel (ELF vmlinux or bzImage) instead of Debian's linux-image-cloud-amd64.
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Ask apt again and rebuild even when a cached image matches.
    #[arg(long)]
    force: bool,
    /// Guest agent (a static binary), installed as /bin/tine-agent
    /// (minimal) or /usr/local/bin/tine-agent (debian). Default: the one
    /// scripts/build-agent builds in this tine's target directory.
    #[arg(long, env = "TINE_AGENT")]
    agent: Option<PathBuf>,
    /// Build an image without the guest agent (overrides --agent and
    /// TINE_AGENT): its vms can only run with `tine run --no-agent`.
    #[arg(long)]
    no_agent: bool,
    /// Print the image manifest as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(cmd: ImageCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        ImageCommand::Build(args) => build(args),
    }
}

fn build(args: BuildArgs) -> anyhow::Result<ExitCode> {
    let home = image::default_home()?;
    let mut opts = image::BuildOptions::new(home);
    opts.kernel = args.kernel;
    opts.force = args.force;
    opts.agent = match (args.no_agent, args.agent) {
        (true, _) => image::AgentChoice::None,
        (false, Some(path)) => image::AgentChoice::Path(path),
        (false, None) => image::AgentChoice::Default,
    };
    let started = std::time::Instant::now();
    // What the build is doing, on stderr (stdout keeps the result).
    let mut progress = |step: image::Step| {
        eprintln!(
            "tine image: [{:5.1}s] {step}",
            started.elapsed().as_secs_f64()
        );
    };
    let img = image::build_kind_with(args.kind.into(), &opts, &mut progress)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&img)?);
    } else {
        println!(
            "image {} ({}) in {:.1}s\n  kernel    {} ({})\n  initramfs {} ({})\n  cmdline   {}",
            img.name,
            img.kernel_version,
            started.elapsed().as_secs_f64(),
            img.kernel.display(),
            file_size(&img.kernel),
            img.initramfs.display(),
            file_size(&img.initramfs),
            img.cmdline
        );
        match &img.agent {
            Some(agent) => println!("  agent     {} ({})", agent.display(), file_size(agent)),
            None => println!("  agent     none (built with --no-agent)"),
        }
        if let Some(rootfs) = &img.rootfs {
            println!(
                "  rootfs    {} ({}, attach as the first virtio-blk disk)",
                rootfs.display(),
                crate::render::human_bytes(img.rootfs_size.unwrap_or(0))
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn file_size(path: &Path) -> String {
    std::fs::metadata(path).map_or_else(
        |_| "missing".into(),
        |m| crate::render::human_bytes(m.len()),
    )
}
