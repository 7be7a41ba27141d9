//! `tine image build`, and turning `--image NAME` into kernel, initramfs
//! and command line.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};

/// Micro guests that `--image` knows by name (built into this binary).
pub const MICRO_IMAGES: &[&str] = &["micro-counter", "micro-memtouch"];

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
    /// Guest agent (a static binary; see scripts/build-agent), installed as
    /// /bin/tine-agent (minimal) or /usr/local/bin/tine-agent (debian).
    #[arg(long, env = "TINE_AGENT")]
    agent: Option<PathBuf>,
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
    opts.agent = args.agent;
    let started = std::time::Instant::now();
    let img = image::build_kind(args.kind.into(), &opts)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&img)?);
    } else {
        println!(
            "image {} ({}) in {:.1}s\n  kernel    {}\n  initramfs {}\n  cmdline   {}",
            img.name,
            img.kernel_version,
            started.elapsed().as_secs_f64(),
            img.kernel.display(),
            img.initramfs.display(),
            img.cmdline
        );
        if let Some(rootfs) = &img.rootfs {
            println!(
                "  rootfs    {} ({} MiB, attach as the first virtio-blk disk)",
                rootfs.display(),
                img.rootfs_size.unwrap_or(0) >> 20
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// What `--image` resolves to.
#[derive(Debug)]
pub struct Resolved {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
    /// The image's root disk (debian), to attach as the first virtio-blk
    /// device (/dev/vda, which its cmdline mounts as root).
    pub rootfs: Option<PathBuf>,
}

/// Resolves an image name (`minimal`, `debian`, `micro-counter`, `micro-memtouch`) or
/// an image directory (one that holds a manifest).
pub fn resolve(name: &str) -> anyhow::Result<Resolved> {
    let home = image::default_home()?;
    if let Some(micro) = name.strip_prefix("micro-") {
        let bytes = guests::by_name(micro).with_context(|| {
            format!(
                "unknown micro guest image {name:?}; known: {}",
                MICRO_IMAGES.join(", ")
            )
        })?;
        let kernel = materialize(&home, name, bytes)?;
        return Ok(Resolved {
            kernel,
            initrd: None,
            cmdline: String::new(),
            rootfs: None,
        });
    }
    let dir = Path::new(name);
    let img = if name.contains('/') && dir.is_dir() {
        image::Image::load(dir)?
    } else {
        image::open(&home, name)?
    };
    Ok(Resolved {
        kernel: img.kernel,
        initrd: Some(img.initramfs),
        cmdline: img.cmdline,
        rootfs: img.rootfs,
    })
}

/// Writes an embedded micro guest to the image cache (once per content).
fn materialize(home: &Path, name: &str, bytes: &[u8]) -> anyhow::Result<PathBuf> {
    let hash = blake3::hash(bytes).to_hex();
    let dir = home.join("images");
    let path = dir.join(format!("{name}-{}.elf", &hash[..16]));
    if !path.is_file() {
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, bytes).with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(path)
}
