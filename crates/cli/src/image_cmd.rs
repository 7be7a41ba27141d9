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
                size(img.rootfs_size.unwrap_or(0))
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// A size in one style: the largest binary unit that keeps it at 1 or
/// more, one decimal below 10 (`512 KiB`, `8.3 MiB`, `1.2 GiB`).
fn size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if v < 10.0 {
        format!("{v:.1} {}", UNITS[unit])
    } else {
        format!("{v:.0} {}", UNITS[unit])
    }
}

fn file_size(path: &Path) -> String {
    std::fs::metadata(path).map_or_else(|_| "missing".into(), |m| size(m.len()))
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
    /// The Linux image behind it (None for micro guests, which never
    /// have an agent); see [`Resolved::require_agent`].
    pub image: Option<image::Image>,
}

impl Resolved {
    /// An error saying what to do when this is a Linux image without a
    /// guest agent: `tine run` calls it (unless `--no-agent`) before it
    /// creates anything, instead of waiting for an agent that is not there.
    #[cfg_attr(
        not(test),
        expect(dead_code, reason = "tine run is to call it (issue 13 §3)")
    )]
    pub fn require_agent(&self) -> anyhow::Result<()> {
        match &self.image {
            Some(img) => Ok(img.require_agent()?),
            None => Ok(()),
        }
    }
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
            image: None,
        });
    }
    let dir = Path::new(name);
    let img = if name.contains('/') && dir.is_dir() {
        image::Image::load(dir)?
    } else {
        image::open(&home, name)?
    };
    Ok(Resolved {
        kernel: img.kernel.clone(),
        initrd: Some(img.initramfs.clone()),
        cmdline: img.cmdline.clone(),
        rootfs: img.rootfs.clone(),
        image: Some(img),
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

#[cfg(test)]
mod tests {
    use super::{resolve, size};

    /// `tine run` refuses a Linux image without an agent, saying what to
    /// do; micro guests never have one and pass.
    #[test]
    fn test_require_agent() {
        let dir = std::env::temp_dir().join(format!("tine-image-cmd-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let manifest = r#"{"name": "debian", "kernel": "vmlinuz", "kernel_kind": "bzimage",
            "initramfs": "initramfs.cpio", "cmdline": "", "kernel_version": "6.1",
            "hash": "0123456789abcdef", "modules": [], "kernel_source": "x.deb", "agent": null}"#;
        std::fs::write(dir.join("manifest.json"), manifest).expect("write");
        let r = resolve(&dir.to_string_lossy()).expect("resolve");
        let err = r.require_agent().expect_err("no agent").to_string();
        assert!(
            err.contains("has no guest agent") && err.contains("--no-agent"),
            "{err}"
        );
        let with = manifest.replace("null", "\"tine-agent\"");
        std::fs::write(dir.join("manifest.json"), with).expect("write");
        resolve(&dir.to_string_lossy())
            .expect("resolve")
            .require_agent()
            .expect("has an agent");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn test_sizes_in_one_style() {
        assert_eq!(size(512), "512 B");
        assert_eq!(size(262_170 * 1024), "256 MiB");
        assert_eq!(size(8_700_000), "8.3 MiB");
        assert_eq!(size(3 << 30), "3.0 GiB");
        assert_eq!(size(1024), "1.0 KiB");
    }
}
