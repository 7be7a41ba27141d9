//! tine guest images: the Debian cloud kernel plus a busybox initramfs that
//! loads the virtio modules, cached under `<home>/images/<name>-<hash>/`.
//!
//! [`build`] gathers its inputs (kernel .deb or a given kernel, busybox, the
//! /init script, the module list), hashes them, and returns the cached image
//! when one with that hash exists. The .deb files are cached under
//! `<home>/cache/debs/`; apt is consulted only when that cache has no kernel
//! (or busybox) package, or on `force`.

mod deb;
pub mod debian;
mod elf;
pub mod initramfs;
pub mod modules;
mod resolve;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

pub use debian::DEBIAN_IMAGE_NAME;
pub use initramfs::READY_MARKER;
pub use resolve::{resolve, Resolved, MICRO_IMAGES};

/// Bumped whenever the builder's output changes for the same inputs.
pub const BUILDER_VERSION: u32 = 2;
/// The minimal image (initramfs only).
pub const IMAGE_NAME: &str = "minimal";
/// What the image's /init needs on the kernel command line: the console
/// (where the ready marker and the shell go), plus reboot via the keyboard
/// controller and reboot on panic so a failed boot ends the VMM.
/// `pci=off`: the VMM has no PCI; the i8042 options skip probing an absent
/// keyboard and mouse (only its reset line is emulated).
pub const DEFAULT_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=1 pci=off i8042.noaux i8042.nomux i8042.nopnp i8042.dumbkbd quiet";
const MANIFEST: &str = "manifest.json";
const HINT_APT: &str = "run `apt-get update` (and check the network), or pass --kernel PATH";
const HINT_BUSYBOX: &str =
    "install busybox-static (apt-get install busybox-static) or run `apt-get update`";

/// Errors while building or opening an image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A command-line tool is not installed.
    #[error("{tool} not found: {hint}")]
    ToolMissing { tool: String, hint: String },
    /// A command failed.
    #[error("{command} failed: {detail}; {hint}")]
    Command {
        command: String,
        detail: String,
        hint: String,
    },
    /// Neither TINE_HOME nor HOME is set.
    #[error("Cannot find tine's home: set TINE_HOME or HOME")]
    NoHome,
    /// A file could not be read or written.
    #[error("Cannot access {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The kernel given with --kernel does not exist.
    #[error("Kernel {0} does not exist: pass --kernel with the path of a vmlinux or bzImage")]
    KernelMissing(PathBuf),
    /// The kernel given with --kernel is neither an ELF vmlinux nor a bzImage.
    #[error("{0} is neither an ELF vmlinux nor a bzImage")]
    NotAKernel(PathBuf),
    /// The kernel package lacks something the image needs.
    #[error("Package {deb} has no {what}; delete it from the .deb cache and rebuild with --force")]
    Package { deb: PathBuf, what: &'static str },
    /// A kernel module cannot be used.
    #[error("Kernel module {name}: {reason}")]
    Module { name: String, reason: String },
    /// The busybox binary found is not statically linked.
    #[error(
        "{0} is not a static busybox: install busybox-static (apt-get install busybox-static)"
    )]
    BusyboxNotStatic(PathBuf),
    /// The agent given is not a static executable.
    #[error("agent {0} is not a static executable; build it with scripts/build-agent")]
    AgentNotStatic(PathBuf),
    /// An image manifest cannot be read.
    #[error("Bad image manifest {path}")]
    Manifest {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    /// No image of that name has been built.
    #[error("No image {name} in {dir}: run `tine image build`")]
    UnknownImage { name: String, dir: PathBuf },
}

impl ImageError {
    fn io(path: &Path, source: std::io::Error) -> Self {
        ImageError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// What to build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildOptions {
    /// tine's home (see [`default_home`]); images go to `<home>/images/`.
    pub home: PathBuf,
    /// Use this kernel (ELF vmlinux or bzImage) instead of Debian's; the
    /// image then has no modules (the kernel must have its drivers built in).
    pub kernel: Option<PathBuf>,
    /// Ask apt again for the newest packages and rebuild even if cached.
    pub force: bool,
    /// The guest agent (a static binary, see scripts/build-agent), installed
    /// as /bin/tine-agent.
    pub agent: Option<PathBuf>,
}

impl BuildOptions {
    /// Default options for `home`.
    pub fn new(home: PathBuf) -> Self {
        Self {
            home,
            kernel: None,
            force: false,
            agent: None,
        }
    }
}

/// How the kernel file is to be loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KernelKind {
    /// An uncompressed ELF vmlinux.
    Elf,
    /// A compressed bzImage (Linux x86 boot protocol).
    BzImage,
}

/// A built image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    /// Image name ("minimal").
    pub name: String,
    /// The image's directory.
    #[serde(skip)]
    pub dir: PathBuf,
    /// Kernel file (absolute).
    pub kernel: PathBuf,
    /// Whether the kernel is an ELF vmlinux or a bzImage.
    pub kernel_kind: KernelKind,
    /// Initramfs (uncompressed newc cpio, absolute path).
    pub initramfs: PathBuf,
    /// Kernel command line the image's /init expects (see [`DEFAULT_CMDLINE`]).
    pub cmdline: String,
    /// Kernel release, e.g. `6.1.0-48-cloud-amd64`, or "unknown".
    pub kernel_version: String,
    /// Hash of the build inputs (also in the directory name).
    pub hash: String,
    /// Modules in the initramfs, in load order.
    pub modules: Vec<String>,
    /// Where the kernel came from (the .deb file name or the given path).
    pub kernel_source: String,
    /// A copy of the guest agent in the initramfs (the nested test host runs
    /// the same binary), when the image has one.
    #[serde(default)]
    pub agent: Option<PathBuf>,
    /// The root filesystem (raw ext4) to attach as the first virtio-blk
    /// disk (/dev/vda), for images that boot from disk ("debian").
    #[serde(default)]
    pub rootfs: Option<PathBuf>,
    /// Size of `rootfs` in bytes (its apparent size; the file is sparse).
    #[serde(default)]
    pub rootfs_size: Option<u64>,
}

/// The images `tine image build` makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImageKind {
    /// Kernel + busybox initramfs.
    #[default]
    Minimal,
    /// Debian bookworm on an ext4 root disk (see [`debian`]).
    Debian,
}

impl ImageKind {
    /// The image's name (its directory prefix under `<home>/images/`).
    pub fn name(self) -> &'static str {
        match self {
            ImageKind::Minimal => IMAGE_NAME,
            ImageKind::Debian => DEBIAN_IMAGE_NAME,
        }
    }
}

/// Builds the image of `kind` (see [`build`] and [`build_debian`]).
pub fn build_kind(kind: ImageKind, opts: &BuildOptions) -> Result<Image, ImageError> {
    match kind {
        ImageKind::Minimal => build(opts),
        ImageKind::Debian => build_debian(opts),
    }
}

impl Image {
    /// Reads the image in `dir` from its manifest.
    pub fn load(dir: &Path) -> Result<Image, ImageError> {
        let path = dir.join(MANIFEST);
        let text = std::fs::read_to_string(&path).map_err(|e| ImageError::io(&path, e))?;
        let mut image: Image =
            serde_json::from_str(&text).map_err(|source| ImageError::Manifest { path, source })?;
        image.dir = dir.to_path_buf();
        image.kernel = dir.join(&image.kernel);
        image.initramfs = dir.join(&image.initramfs);
        image.agent = image.agent.map(|a| dir.join(a));
        image.rootfs = image.rootfs.map(|r| dir.join(r));
        Ok(image)
    }
}

/// tine's home: `$TINE_HOME`, else `$HOME/.cache/tine`.
pub fn default_home() -> Result<PathBuf, ImageError> {
    if let Some(h) = std::env::var_os("TINE_HOME").filter(|h| !h.is_empty()) {
        return Ok(PathBuf::from(h));
    }
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(".cache").join("tine"))
        .ok_or(ImageError::NoHome)
}

/// The most recently built image called `name` under `home`.
pub fn open(home: &Path, name: &str) -> Result<Image, ImageError> {
    let dir = home.join("images");
    let unknown = || ImageError::UnknownImage {
        name: name.to_string(),
        dir: dir.clone(),
    };
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(unknown()),
        Err(e) => return Err(ImageError::io(&dir, e)),
    };
    let prefix = format!("{name}-");
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in entries.flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let manifest = entry.path().join(MANIFEST);
        if !file_name.starts_with(&prefix) {
            continue;
        }
        if let Ok(mtime) = manifest.metadata().and_then(|m| m.modified()) {
            if best.as_ref().is_none_or(|(t, _)| mtime > *t) {
                best = Some((mtime, entry.path()));
            }
        }
    }
    let (_, path) = best.ok_or_else(unknown)?;
    Image::load(&path)
}

/// Where a build input comes from.
#[derive(Debug)]
enum Source {
    /// A file used as is.
    File(PathBuf),
    /// A Debian package to unpack.
    Deb(PathBuf),
}

impl Source {
    fn path(&self) -> &Path {
        match self {
            Source::File(p) | Source::Deb(p) => p,
        }
    }
}

fn hash_file(path: &Path) -> Result<String, ImageError> {
    let file = std::fs::File::open(path).map_err(|e| ImageError::io(path, e))?;
    let mut hasher = blake3::Hasher::new();
    hasher
        .update_reader(std::io::BufReader::new(file))
        .map_err(|e| ImageError::io(path, e))?;
    Ok(hasher.finalize().to_hex().to_string())
}

/// Builds the "minimal" image, or returns the cached one with the same inputs.
pub fn build(opts: &BuildOptions) -> Result<Image, ImageError> {
    let debs = opts.home.join("cache").join("debs");
    let kernel = kernel_source(opts, &debs)?;
    let busybox = busybox_source(opts, &debs)?;
    let init = initramfs::init_script();
    let agent = read_agent(opts)?;
    let module_list = module_list(&kernel);

    let inputs = format!(
        "builder={BUILDER_VERSION}\nkernel={}\nbusybox={}\ninit={}\nmodules={}\ncmdline={DEFAULT_CMDLINE}\nagent={}\n",
        hash_file(kernel.path())?,
        hash_file(busybox.path())?,
        blake3::hash(init.as_bytes()).to_hex(),
        module_list.join(","),
        agent.as_deref().map(|a| blake3::hash(a).to_hex().to_string()).unwrap_or_default(),
    );
    let hash = blake3::hash(inputs.as_bytes()).to_hex()[..16].to_string();
    let images = opts.home.join("images");
    let dir = images.join(format!("{IMAGE_NAME}-{hash}"));
    if !opts.force {
        if let Ok(image) = Image::load(&dir) {
            tracing::info!("image {IMAGE_NAME} {hash} is up to date: {}", dir.display());
            return Ok(image);
        }
    }

    tracing::info!("building image {IMAGE_NAME} {hash}");
    static BUILDS: AtomicU64 = AtomicU64::new(0);
    let scratch = images.join(format!(
        ".build-{hash}-{}-{}",
        std::process::id(),
        BUILDS.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::remove_dir_all(&scratch).ok();
    let parts = Parts {
        name: IMAGE_NAME,
        init: &init,
        cmdline: DEFAULT_CMDLINE,
        agent_in_initramfs: true,
    };
    let result = assemble(
        &scratch,
        &kernel,
        &busybox,
        &parts,
        module_list,
        agent.as_deref(),
        &hash,
    )
    .and_then(|image| write_manifest(&scratch.join("out"), &image))
    .and_then(|()| publish(&scratch.join("out"), &dir, opts.force));
    std::fs::remove_dir_all(&scratch).ok();
    result?;
    let image = Image::load(&dir)?;
    tracing::info!("image {IMAGE_NAME} {hash} built: {}", dir.display());
    Ok(image)
}

fn read_agent(opts: &BuildOptions) -> Result<Option<Vec<u8>>, ImageError> {
    match &opts.agent {
        Some(path) => {
            let bytes = std::fs::read(path).map_err(|e| ImageError::io(path, e))?;
            if !elf::is_static_executable(&bytes) {
                return Err(ImageError::AgentNotStatic(path.clone()));
            }
            Ok(Some(bytes))
        }
        None => Ok(None),
    }
}

fn module_list(kernel: &Source) -> &'static [&'static str] {
    match kernel {
        Source::File(_) => &[],
        Source::Deb(_) => modules::GUEST_MODULES,
    }
}

/// Whether `tool` is an executable in $PATH (or in /usr/sbin, /sbin).
fn have_tool(tool: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .any(|d| d.join(tool).is_file())
}

/// Builds the "debian" image (see [`debian`]): the minimal image's kernel
/// and modules with an initramfs that mounts root=/dev/vda, and a Debian
/// root filesystem in `debian.ext4`, or returns the cached one with the same
/// inputs. The agent, when given, is installed as /usr/local/bin/tine-agent
/// and started at boot. Runs debootstrap (as root; takes minutes).
pub fn build_debian(opts: &BuildOptions) -> Result<Image, ImageError> {
    use debian::{Recipe, DEBIAN_IMAGE_NAME as NAME};
    for (tool, package) in [("debootstrap", "debootstrap"), ("mkfs.ext4", "e2fsprogs")] {
        if !have_tool(tool) {
            return Err(ImageError::ToolMissing {
                tool: tool.into(),
                hint: format!("install it with `apt-get install {package}`"),
            });
        }
    }
    let debs = opts.home.join("cache").join("debs");
    let kernel = kernel_source(opts, &debs)?;
    let busybox = busybox_source(opts, &debs)?;
    let agent = read_agent(opts)?;
    let modules = module_list(&kernel);
    let as_root = {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
    };
    let mirror = debian::apt_mirror(Path::new("/etc/apt"), debian::DEBIAN_SUITE)
        .unwrap_or_else(|| debian::DEFAULT_MIRROR.to_string());
    let mut recipe = Recipe::new(&mirror);
    recipe.kernel_hash = hash_file(kernel.path())?;
    recipe.busybox_hash = hash_file(busybox.path())?;
    recipe.agent_hash = agent
        .as_deref()
        .map(|a| blake3::hash(a).to_hex().to_string())
        .unwrap_or_default();
    recipe.modules = modules.iter().map(|m| m.to_string()).collect();
    let hash = debian::cache_key(&recipe);
    let images = opts.home.join("images");
    let dir = images.join(format!("{NAME}-{hash}"));
    if !opts.force {
        if let Ok(image) = Image::load(&dir) {
            tracing::info!("image {NAME} {hash} is up to date: {}", dir.display());
            return Ok(image);
        }
    }

    if !as_root {
        return Err(ImageError::Command {
            command: "debootstrap".into(),
            detail: "it must run as root".into(),
            hint: "build the debian image as root (e.g. sudo tine image build debian)".into(),
        });
    }
    tracing::info!("building image {NAME} {hash}");
    static BUILDS: AtomicU64 = AtomicU64::new(0);
    let scratch = images.join(format!(
        ".build-{NAME}-{hash}-{}-{}",
        std::process::id(),
        BUILDS.fetch_add(1, Ordering::Relaxed)
    ));
    if debian::unmount_under(&scratch) {
        std::fs::remove_dir_all(&scratch).ok();
    }
    let init = debian::root_init_script();
    let cmdline = debian::cmdline();
    let parts = Parts {
        name: NAME,
        init: &init,
        cmdline: &cmdline,
        agent_in_initramfs: false,
    };
    let out = scratch.join("out");
    let result = (|| {
        let mut image = assemble(
            &scratch,
            &kernel,
            &busybox,
            &parts,
            modules,
            agent.as_deref(),
            &hash,
        )?;
        let root = scratch.join("root");
        debian::debootstrap(&recipe, &root, &opts.home.join("cache").join("debootstrap"))?;
        let busybox_bytes = read_busybox(&busybox, &scratch.join("busybox-rootfs"))?;
        debian::customize(&root, &busybox_bytes, agent.as_deref())?;
        if !debian::unmount_under(&root) {
            return Err(ImageError::Command {
                command: "umount".into(),
                detail: format!("something stays mounted under {}", root.display()),
                hint: "unmount it by hand".into(),
            });
        }
        let size = debian::make_ext4(&root, &out.join(debian::ROOTFS_FILE))?;
        image.rootfs = Some(debian::ROOTFS_FILE.into());
        image.rootfs_size = Some(size);
        write_manifest(&out, &image)?;
        publish(&out, &dir, opts.force)
    })();
    // Never delete through a mount debootstrap left behind.
    if debian::unmount_under(&scratch) {
        std::fs::remove_dir_all(&scratch).ok();
    } else {
        tracing::warn!(
            "left {} in place: something is mounted under it",
            scratch.display()
        );
    }
    result?;
    let image = Image::load(&dir)?;
    tracing::info!("image {NAME} {hash} built: {}", dir.display());
    Ok(image)
}

/// What distinguishes one image kind's kernel + initramfs from another's.
struct Parts<'a> {
    name: &'a str,
    init: &'a str,
    cmdline: &'a str,
    /// Put the agent into the initramfs (as /bin/tine-agent).
    agent_in_initramfs: bool,
}

fn write_manifest(out: &Path, image: &Image) -> Result<(), ImageError> {
    let manifest = out.join(MANIFEST);
    let json = serde_json::to_string_pretty(image).map_err(|source| ImageError::Manifest {
        path: manifest.clone(),
        source,
    })?;
    std::fs::write(&manifest, json + "\n").map_err(|e| ImageError::io(&manifest, e))
}

/// Moves a finished image directory into place (atomically, by rename).
/// An image already there is kept unless `replace` (a forced rebuild).
fn publish(out: &Path, dir: &Path, replace: bool) -> Result<(), ImageError> {
    if dir.exists() {
        if !replace && Image::load(dir).is_ok() {
            // A concurrent build with the same inputs finished first.
            return Ok(());
        }
        let old = dir.with_extension(format!("old-{}", std::process::id()));
        std::fs::rename(dir, &old).map_err(|e| ImageError::io(dir, e))?;
        std::fs::remove_dir_all(&old).ok();
    }
    std::fs::rename(out, dir).map_err(|e| ImageError::io(dir, e))
}

fn kernel_source(opts: &BuildOptions, debs: &Path) -> Result<Source, ImageError> {
    if let Some(path) = &opts.kernel {
        if !path.is_file() {
            return Err(ImageError::KernelMissing(path.clone()));
        }
        kernel_kind(path)?;
        return Ok(Source::File(path.clone()));
    }
    if !opts.force {
        if let Some(deb) = deb::find_debs(debs, deb::is_kernel_package)? {
            return Ok(Source::Deb(deb));
        }
    }
    let package = deb::resolve_kernel_package(HINT_APT)?;
    Ok(Source::Deb(deb::download(debs, &package, HINT_APT)?))
}

fn busybox_source(opts: &BuildOptions, debs: &Path) -> Result<Source, ImageError> {
    let installed = Path::new("/bin/busybox");
    if let Ok(bytes) = std::fs::read(installed) {
        if elf::is_static_executable(&bytes) {
            return Ok(Source::File(installed.to_path_buf()));
        }
    }
    if !opts.force {
        if let Some(deb) = deb::find_deb(debs, deb::BUSYBOX_PACKAGE)? {
            return Ok(Source::Deb(deb));
        }
    }
    Ok(Source::Deb(deb::download(
        debs,
        deb::BUSYBOX_PACKAGE,
        HINT_BUSYBOX,
    )?))
}

/// Which kind of kernel `path` is.
pub fn kernel_kind(path: &Path) -> Result<KernelKind, ImageError> {
    use std::io::Read;
    let mut head = [0u8; 0x210];
    let mut f = std::fs::File::open(path).map_err(|e| ImageError::io(path, e))?;
    let n = f.read(&mut head).map_err(|e| ImageError::io(path, e))?;
    let head = &head[..n];
    if elf::is_elf(head) {
        Ok(KernelKind::Elf)
    } else if head.get(0x202..0x206) == Some(b"HdrS") {
        Ok(KernelKind::BzImage)
    } else {
        Err(ImageError::NotAKernel(path.to_path_buf()))
    }
}

/// The kernel release in a bzImage header or an ELF vmlinux's banner.
fn kernel_release(bytes: &[u8], kind: KernelKind) -> Option<String> {
    let text = match kind {
        KernelKind::BzImage => {
            let ptr = u16::from_le_bytes(bytes.get(0x20e..0x210)?.try_into().ok()?);
            bytes.get(0x200 + usize::from(ptr)..)?
        }
        KernelKind::Elf => {
            const BANNER: &[u8] = b"Linux version ";
            let at = bytes.windows(BANNER.len()).position(|w| w == BANNER)?;
            &bytes[at + BANNER.len()..]
        }
    };
    let end = text.iter().position(|&c| c == 0 || c == b' ')?;
    let release = std::str::from_utf8(&text[..end]).ok()?;
    (!release.is_empty()).then(|| release.to_string())
}

fn assemble(
    scratch: &Path,
    kernel: &Source,
    busybox: &Source,
    parts: &Parts,
    module_list: &[&str],
    agent: Option<&[u8]>,
    hash: &str,
) -> Result<Image, ImageError> {
    let out = scratch.join("out");
    std::fs::create_dir_all(&out).map_err(|e| ImageError::io(&out, e))?;

    let busybox_bytes = read_busybox(busybox, &scratch.join("busybox"))?;

    let (kernel_file, version, mods) = match kernel {
        Source::File(p) => (p.clone(), None, Vec::new()),
        Source::Deb(deb) => {
            tracing::info!("unpacking {}", deb.display());
            let root = scratch.join("kernel");
            deb::extract(deb, &root)?;
            let (vmlinuz, version) = find_vmlinuz(&root.join("boot"), deb)?;
            let mod_dir = root.join("lib/modules").join(&version);
            let mods = modules::resolve(&mod_dir, module_list)?;
            (vmlinuz, Some(version), mods)
        }
    };
    let kind = kernel_kind(&kernel_file)?;
    let kernel_bytes = std::fs::read(&kernel_file).map_err(|e| ImageError::io(&kernel_file, e))?;
    let version = version
        .or_else(|| kernel_release(&kernel_bytes, kind))
        .unwrap_or_else(|| "unknown".into());
    let kernel_name = match kind {
        KernelKind::BzImage => format!("vmlinuz-{version}"),
        KernelKind::Elf => format!("vmlinux-{version}"),
    };
    let dest = out.join(&kernel_name);
    std::fs::write(&dest, &kernel_bytes).map_err(|e| ImageError::io(&dest, e))?;

    tracing::info!("writing initramfs ({} modules)", mods.len());
    initramfs::write(
        &out.join("initramfs.cpio"),
        &busybox_bytes,
        &mods,
        parts.init,
        agent.filter(|_| parts.agent_in_initramfs),
    )?;

    let image = Image {
        name: parts.name.into(),
        dir: PathBuf::new(),
        kernel: kernel_name.into(),
        kernel_kind: kind,
        initramfs: "initramfs.cpio".into(),
        cmdline: parts.cmdline.into(),
        kernel_version: version,
        hash: hash.into(),
        modules: mods.iter().map(|m| m.name.clone()).collect(),
        kernel_source: kernel
            .path()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        agent: agent.map(|_| PathBuf::from("tine-agent")),
        rootfs: None,
        rootfs_size: None,
    };
    if let Some(bytes) = agent {
        let dest = out.join("tine-agent");
        std::fs::write(&dest, bytes).map_err(|e| ImageError::io(&dest, e))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| ImageError::io(&dest, e))?;
    }
    Ok(image)
}

/// The static busybox binary from `source`, unpacking a package into `scratch`.
fn read_busybox(source: &Source, scratch: &Path) -> Result<Vec<u8>, ImageError> {
    let bytes = match source {
        Source::File(p) => std::fs::read(p).map_err(|e| ImageError::io(p, e))?,
        Source::Deb(deb) => {
            deb::extract(deb, scratch)?;
            std::fs::read(scratch.join("bin/busybox")).map_err(|_| ImageError::Package {
                deb: deb.clone(),
                what: "bin/busybox",
            })?
        }
    };
    if !elf::is_static_executable(&bytes) {
        return Err(ImageError::BusyboxNotStatic(source.path().to_path_buf()));
    }
    Ok(bytes)
}

/// The `vmlinuz-<version>` in an unpacked package's /boot, and its version.
fn find_vmlinuz(boot: &Path, deb: &Path) -> Result<(PathBuf, String), ImageError> {
    let missing = || ImageError::Package {
        deb: deb.to_path_buf(),
        what: "boot/vmlinuz-*",
    };
    let entries = std::fs::read_dir(boot).map_err(|_| missing())?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(version) = name.strip_prefix("vmlinuz-") {
            return Ok((entry.path(), version.to_string()));
        }
    }
    Err(missing())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_busybox_from_package_is_static() {
        // The host may have busybox installed; exercise the package path anyway.
        let debs = std::env::var_os("TINE_TEST_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| default_home().expect("home").join("cache/debs"));
        let deb = match deb::find_deb(&debs, deb::BUSYBOX_PACKAGE).expect("scan cache") {
            Some(deb) => deb,
            None => deb::download(&debs, deb::BUSYBOX_PACKAGE, HINT_BUSYBOX).expect("download"),
        };
        let scratch =
            std::env::temp_dir().join(format!("tine-busybox-test-{}", std::process::id()));
        let bytes = read_busybox(&Source::Deb(deb), &scratch).expect("busybox from package");
        assert!(bytes.len() > 100_000);
        std::fs::remove_dir_all(&scratch).ok();
    }

    #[test]
    fn test_dynamic_busybox_rejected() {
        let err = read_busybox(
            &Source::File("/proc/self/exe".into()),
            Path::new("/nonexistent"),
        )
        .expect_err("a dynamic executable");
        assert!(err.to_string().contains("busybox-static"), "{err}");
    }

    #[test]
    fn test_kernel_release_from_elf_banner() {
        let mut elf = b"\x7fELF".to_vec();
        elf.extend_from_slice(b"....Linux version 6.1.0-48-cloud-amd64 (debian-kernel@lists)");
        assert_eq!(
            kernel_release(&elf, KernelKind::Elf).as_deref(),
            Some("6.1.0-48-cloud-amd64")
        );
        assert_eq!(kernel_release(b"garbage", KernelKind::BzImage), None);
    }
}
