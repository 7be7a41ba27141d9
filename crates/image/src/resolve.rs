//! Turning `--image NAME` into what a VMM boots: kernel, initramfs,
//! command line and root disk. Names are the built images (`minimal`,
//! `debian`), an image directory, or the micro guests built into tine
//! (`micro-counter`, `micro-memtouch`, `micro-blkio`, `micro-cpuid`).

use std::path::{Path, PathBuf};

use crate::{Image, ImageError};

/// Micro guests that `--image` knows by name.
pub const MICRO_IMAGES: &[&str] = &[
    "micro-counter",
    "micro-memtouch",
    "micro-blkio",
    "micro-cpuid",
];

/// What `--image` resolves to.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
    /// The image's root disk (debian), to attach as the first virtio-blk
    /// device (/dev/vda, which its cmdline mounts as root).
    pub rootfs: Option<PathBuf>,
    /// A micro guest (no agent, runs on any /dev/kvm).
    pub micro: bool,
    /// The built image it came from (None for micro guests).
    pub image: Option<Image>,
}

/// Resolves an image name or an image directory (one that holds a manifest).
pub fn resolve(home: &Path, name: &str) -> Result<Resolved, ImageError> {
    if let Some(micro) = name.strip_prefix("micro-") {
        let bytes = guests::by_name(micro).ok_or_else(|| ImageError::UnknownImage {
            name: format!("{name} (micro guests: {})", MICRO_IMAGES.join(", ")),
            dir: home.join("images"),
        })?;
        let kernel = materialize(home, name, bytes)?;
        return Ok(Resolved {
            kernel,
            initrd: None,
            cmdline: String::new(),
            rootfs: None,
            micro: true,
            image: None,
        });
    }
    let dir = Path::new(name);
    let img = if name.contains('/') && dir.is_dir() {
        Image::load(dir)?
    } else {
        crate::open(home, name)?
    };
    Ok(Resolved {
        kernel: img.kernel.clone(),
        initrd: Some(img.initramfs.clone()),
        cmdline: img.cmdline.clone(),
        rootfs: img.rootfs.clone(),
        micro: false,
        image: Some(img),
    })
}

/// Writes an embedded micro guest to the image cache (once per content).
fn materialize(home: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf, ImageError> {
    let hash = blake3::hash(bytes).to_hex();
    let dir = home.join("images");
    let path = dir.join(format!("{name}-{}.elf", &hash[..16]));
    if !path.is_file() {
        std::fs::create_dir_all(&dir).map_err(|e| ImageError::io(&dir, e))?;
        let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
        std::fs::write(&tmp, bytes).map_err(|e| ImageError::io(&tmp, e))?;
        std::fs::rename(&tmp, &path).map_err(|e| ImageError::io(&path, e))?;
    }
    Ok(path)
}
