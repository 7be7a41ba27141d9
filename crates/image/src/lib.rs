//! tine guest images: the Debian cloud kernel plus a busybox initramfs that
//! loads the virtio modules, cached under `<home>/images/<name>-<hash>/`.
//!
//! [`build`] gathers its inputs (kernel .deb or a given kernel, busybox, the
//! /init script, the module list), hashes them, and returns the cached image
//! when one with that hash exists. The kernel is the Debian package pinned in
//! guests/kernel-package (the nested test host boots the same one), or the
//! one `TINE_KERNEL_PACKAGE` names. The .deb files are cached under
//! `<home>/cache/debs/`; apt is consulted only when that cache lacks the
//! package, or on `force`.
//!
//! Every image carries tine's guest agent unless built with
//! [`AgentChoice::None`] (recorded in the manifest: [`Image::has_agent`]); by
//! default the build takes the one scripts/build-agent leaves next to the
//! running executable's target directory ([`default_agent_paths`]). A build
//! reports what it is doing through [`Progress`]; it never prints.

mod deb;
pub mod debian;
mod elf;
pub mod initramfs;
pub mod modules;
mod resolve;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

pub use deb::{kernel_package, KERNEL_METAPACKAGE, KERNEL_PACKAGE_ENV};
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
    /// The pinned or requested kernel package is not a Debian cloud kernel.
    #[error(
        "{from} names {package:?}, which is not a Debian cloud kernel package: use \
         linux-image-<version>-cloud-amd64 (`apt-cache search linux-image-.*-cloud-amd64` \
         lists them), or linux-image-cloud-amd64 to follow the newest"
    )]
    BadKernelPackage { package: String, from: String },
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
    /// The agent given cannot be read.
    #[error("Cannot read the agent {path} ({source}): build it with scripts/build-agent, or pass --agent PATH")]
    AgentUnreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// No agent was given and none is where scripts/build-agent puts it.
    #[error(
        "No guest agent found (looked for {}): run scripts/build-agent, or pass --agent PATH \
         (or set TINE_AGENT), or --no-agent to build an image whose vms have no agent",
        display_paths(searched)
    )]
    AgentNotFound { searched: Vec<PathBuf> },
    /// The image has no agent, so nothing can talk to its vms.
    #[error(
        "Image {name} ({dir}) has no guest agent, so its vms could never answer: rebuild it \
         with `tine image build {name}` (the agent is included by default), or run the vm \
         with --no-agent"
    )]
    NoAgent { name: String, dir: PathBuf },
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

fn display_paths(paths: &[PathBuf]) -> String {
    let shown: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
    shown.join(", ")
}

impl ImageError {
    fn io(path: &Path, source: std::io::Error) -> Self {
        ImageError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Which guest agent an image build puts into the image.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum AgentChoice {
    /// tine's own, where scripts/build-agent leaves it
    /// ([`default_agent_paths`]); an error if it is not there.
    #[default]
    Default,
    /// This binary (a static executable).
    Path(PathBuf),
    /// None: the image's vms cannot be reached through an agent, and
    /// `tine run` refuses them unless told `--no-agent`.
    None,
}

/// Where [`AgentChoice::Default`] looks, for the running executable.
pub fn default_agent_paths() -> Vec<PathBuf> {
    std::env::current_exe()
        .map(|exe| agent_paths_near(&exe))
        .unwrap_or_default()
}

/// Where the agent is for a tine executable at `exe`: next to it (an
/// installed tine), or where scripts/build-agent builds it in the same
/// target directory (`<target>/{debug,release}/tine` and
/// `<target>/agent/x86_64-unknown-linux-gnu/release/tine-agent`).
pub fn agent_paths_near(exe: &Path) -> Vec<PathBuf> {
    let Some(dir) = exe.parent() else {
        return Vec::new();
    };
    let mut paths = vec![dir.join("tine-agent")];
    if let Some(target) = dir.parent() {
        paths.push(target.join("agent/x86_64-unknown-linux-gnu/release/tine-agent"));
    }
    paths
}

/// The agent binary `choice` means (None for [`AgentChoice::None`]).
pub fn resolve_agent(choice: &AgentChoice) -> Result<Option<PathBuf>, ImageError> {
    match choice {
        AgentChoice::None => Ok(None),
        AgentChoice::Path(p) => Ok(Some(p.clone())),
        AgentChoice::Default => {
            let searched = default_agent_paths();
            match searched.iter().find(|p| p.is_file()) {
                Some(p) => Ok(Some(p.clone())),
                None => Err(ImageError::AgentNotFound { searched }),
            }
        }
    }
}

/// A step of an image build, for the caller to show (see [`Progress`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Step {
    /// The agent that goes into the image (None: built without one).
    Agent { path: Option<PathBuf> },
    /// Asking apt which kernel package is the newest.
    ResolvingKernel,
    /// The pinned kernel package could not be had; the newest is used instead.
    KernelPinUnavailable { package: String, detail: String },
    /// Downloading a package with apt-get (seconds).
    Downloading { package: String },
    /// An image with the same inputs is already built.
    UpToDate { name: String, dir: PathBuf },
    /// Building an image (its inputs hash to `hash`).
    Building { name: String, hash: String },
    /// Unpacking the kernel package.
    Unpacking { deb: PathBuf },
    /// Writing the initramfs.
    Initramfs { modules: usize },
    /// Running debootstrap (minutes; its own lines go to stderr).
    Debootstrap { suite: String, mirror: String },
    /// Installing tine's init, the agent and busybox into the root tree.
    Customizing,
    /// Making the ext4 root disk.
    RootDisk,
    /// Done.
    Built { name: String, dir: PathBuf },
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Step::Agent { path: Some(p) } => write!(f, "agent {}", p.display()),
            Step::Agent { path: None } => write!(f, "no agent (--no-agent)"),
            Step::ResolvingKernel => write!(f, "asking apt for the newest cloud kernel"),
            Step::KernelPinUnavailable { package, detail } => write!(
                f,
                "warning: the pinned kernel {package} could not be downloaded ({detail}); \
                 falling back to the newest, which may not boot reliably under the nested \
                 test host (see guests/kernel-package; TINE_KERNEL_PACKAGE picks another)"
            ),
            Step::Downloading { package } => write!(f, "downloading {package}"),
            Step::UpToDate { name, dir } => write!(f, "{name} is up to date: {}", dir.display()),
            Step::Building { name, hash } => write!(f, "building {name} {hash}"),
            Step::Unpacking { deb } => write!(
                f,
                "unpacking {}",
                deb.file_name().unwrap_or(deb.as_os_str()).to_string_lossy()
            ),
            Step::Initramfs { modules } => write!(f, "writing the initramfs ({modules} modules)"),
            Step::Debootstrap { suite, mirror } => {
                write!(f, "debootstrap {suite} from {mirror} (minutes)")
            }
            Step::Customizing => write!(f, "installing tine's init and agent into the root"),
            Step::RootDisk => write!(f, "making the ext4 root disk"),
            Step::Built { name, dir } => write!(f, "{name} built: {}", dir.display()),
        }
    }
}

/// Receives an image build's steps as they start.
pub trait Progress {
    fn step(&mut self, step: Step);
}

impl<F: FnMut(Step)> Progress for F {
    fn step(&mut self, step: Step) {
        self(step)
    }
}

/// Ignores every step.
pub struct Quiet;

impl Progress for Quiet {
    fn step(&mut self, _: Step) {}
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
    /// as /bin/tine-agent (minimal) or /usr/local/bin/tine-agent (debian).
    pub agent: AgentChoice,
}

impl BuildOptions {
    /// Default options for `home`.
    pub fn new(home: PathBuf) -> Self {
        Self {
            home,
            kernel: None,
            force: false,
            agent: AgentChoice::Default,
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
    /// A copy of the guest agent in the image (the nested test host runs
    /// the same binary), when the image has one; None: built without one.
    #[serde(default)]
    pub agent: Option<PathBuf>,
    /// blake3 of the agent, when the image has one (older manifests: absent).
    #[serde(default)]
    pub agent_hash: Option<String>,
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
    build_kind_with(kind, opts, &mut Quiet)
}

/// [`build_kind`], reporting its steps to `progress`.
pub fn build_kind_with(
    kind: ImageKind,
    opts: &BuildOptions,
    progress: &mut dyn Progress,
) -> Result<Image, ImageError> {
    match kind {
        ImageKind::Minimal => build_with(opts, progress),
        ImageKind::Debian => build_debian_with(opts, progress),
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

    /// Whether the image carries a guest agent (its vms can be reached).
    pub fn has_agent(&self) -> bool {
        self.agent.is_some()
    }

    /// [`ImageError::NoAgent`] unless the image has an agent: what `tine
    /// run` checks before it creates anything, unless told `--no-agent`.
    pub fn require_agent(&self) -> Result<(), ImageError> {
        if self.has_agent() {
            return Ok(());
        }
        Err(ImageError::NoAgent {
            name: self.name.clone(),
            dir: self.dir.clone(),
        })
    }
}

/// Marks a cached image as the most recent of its name (what [`open`]
/// picks): asking for it again counts as building it.
fn touch_manifest(dir: &Path) {
    if let Ok(f) = std::fs::File::options()
        .write(true)
        .open(dir.join(MANIFEST))
    {
        let _ = f.set_modified(std::time::SystemTime::now());
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
    build_with(opts, &mut Quiet)
}

/// [`build`], reporting its steps to `progress`.
pub fn build_with(opts: &BuildOptions, progress: &mut dyn Progress) -> Result<Image, ImageError> {
    let agent = read_agent(opts, progress)?;
    let debs = opts.home.join("cache").join("debs");
    let kernel = kernel_source(opts, &debs, progress)?;
    let busybox = busybox_source(opts, &debs, progress)?;
    let init = initramfs::init_script();
    let module_list = module_list(&kernel);

    let inputs = format!(
        "builder={BUILDER_VERSION}\nkernel={}\nbusybox={}\ninit={}\nmodules={}\ncmdline={DEFAULT_CMDLINE}\nagent={}\n",
        hash_file(kernel.path())?,
        hash_file(busybox.path())?,
        blake3::hash(init.as_bytes()).to_hex(),
        module_list.join(","),
        agent.as_ref().map(|a| a.hash.as_str()).unwrap_or_default(),
    );
    let hash = blake3::hash(inputs.as_bytes()).to_hex()[..16].to_string();
    let images = opts.home.join("images");
    let dir = images.join(format!("{IMAGE_NAME}-{hash}"));
    if !opts.force {
        if let Ok(image) = Image::load(&dir) {
            tracing::info!("image {IMAGE_NAME} {hash} is up to date: {}", dir.display());
            touch_manifest(&dir);
            progress.step(Step::UpToDate {
                name: IMAGE_NAME.into(),
                dir,
            });
            return Ok(image);
        }
    }

    tracing::info!("building image {IMAGE_NAME} {hash}");
    progress.step(Step::Building {
        name: IMAGE_NAME.into(),
        hash: hash.clone(),
    });
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
        modules: module_list,
    };
    let result = assemble(
        &scratch,
        &kernel,
        &busybox,
        &parts,
        agent.as_ref(),
        &hash,
        progress,
    )
    .and_then(|image| write_manifest(&scratch.join("out"), &image))
    .and_then(|()| publish(&scratch.join("out"), &dir, opts.force));
    std::fs::remove_dir_all(&scratch).ok();
    result?;
    let image = Image::load(&dir)?;
    tracing::info!("image {IMAGE_NAME} {hash} built: {}", dir.display());
    progress.step(Step::Built {
        name: IMAGE_NAME.into(),
        dir,
    });
    Ok(image)
}

/// The agent that goes into an image.
struct Agent {
    bytes: Vec<u8>,
    /// blake3, hex.
    hash: String,
}

/// The agent `opts` asks for, checked to be a static executable; None
/// only when asked for none. First thing a build does, so a missing agent
/// fails before any download.
fn read_agent(
    opts: &BuildOptions,
    progress: &mut dyn Progress,
) -> Result<Option<Agent>, ImageError> {
    let path = resolve_agent(&opts.agent)?;
    progress.step(Step::Agent { path: path.clone() });
    let Some(path) = path else {
        return Ok(None);
    };
    let bytes = std::fs::read(&path).map_err(|source| ImageError::AgentUnreadable {
        path: path.clone(),
        source,
    })?;
    if !elf::is_static_executable(&bytes) {
        return Err(ImageError::AgentNotStatic(path));
    }
    let hash = blake3::hash(&bytes).to_hex().to_string();
    Ok(Some(Agent { bytes, hash }))
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
    build_debian_with(opts, &mut Quiet)
}

/// [`build_debian`], reporting its steps to `progress`.
pub fn build_debian_with(
    opts: &BuildOptions,
    progress: &mut dyn Progress,
) -> Result<Image, ImageError> {
    use debian::{Recipe, DEBIAN_IMAGE_NAME as NAME};
    for (tool, package) in [("debootstrap", "debootstrap"), ("mkfs.ext4", "e2fsprogs")] {
        if !have_tool(tool) {
            return Err(ImageError::ToolMissing {
                tool: tool.into(),
                hint: format!("install it with `apt-get install {package}`"),
            });
        }
    }
    let agent = read_agent(opts, progress)?;
    let debs = opts.home.join("cache").join("debs");
    let kernel = kernel_source(opts, &debs, progress)?;
    let busybox = busybox_source(opts, &debs, progress)?;
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
    recipe.agent_hash = agent.as_ref().map(|a| a.hash.clone()).unwrap_or_default();
    recipe.modules = modules.iter().map(|m| m.to_string()).collect();
    let hash = debian::cache_key(&recipe);
    let images = opts.home.join("images");
    let dir = images.join(format!("{NAME}-{hash}"));
    if !opts.force {
        if let Ok(image) = Image::load(&dir) {
            tracing::info!("image {NAME} {hash} is up to date: {}", dir.display());
            touch_manifest(&dir);
            progress.step(Step::UpToDate {
                name: NAME.into(),
                dir,
            });
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
    progress.step(Step::Building {
        name: NAME.into(),
        hash: hash.clone(),
    });
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
        modules,
    };
    let out = scratch.join("out");
    let result = (|| {
        let mut image = assemble(
            &scratch,
            &kernel,
            &busybox,
            &parts,
            agent.as_ref(),
            &hash,
            progress,
        )?;
        let root = scratch.join("root");
        progress.step(Step::Debootstrap {
            suite: recipe.suite.clone(),
            mirror: recipe.mirror.clone(),
        });
        debian::debootstrap(&recipe, &root, &opts.home.join("cache").join("debootstrap"))?;
        progress.step(Step::Customizing);
        let busybox_bytes = read_busybox(&busybox, &scratch.join("busybox-rootfs"))?;
        debian::customize(
            &root,
            &busybox_bytes,
            agent.as_ref().map(|a| a.bytes.as_slice()),
        )?;
        if !debian::unmount_under(&root) {
            return Err(ImageError::Command {
                command: "umount".into(),
                detail: format!("something stays mounted under {}", root.display()),
                hint: "unmount it by hand".into(),
            });
        }
        progress.step(Step::RootDisk);
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
    progress.step(Step::Built {
        name: NAME.into(),
        dir,
    });
    Ok(image)
}

/// What distinguishes one image kind's kernel + initramfs from another's.
struct Parts<'a> {
    name: &'a str,
    init: &'a str,
    cmdline: &'a str,
    /// Put the agent into the initramfs (as /bin/tine-agent).
    agent_in_initramfs: bool,
    /// Kernel modules for the initramfs (none for a given kernel).
    modules: &'static [&'static str],
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

fn kernel_source(
    opts: &BuildOptions,
    debs: &Path,
    progress: &mut dyn Progress,
) -> Result<Source, ImageError> {
    if let Some(path) = &opts.kernel {
        if !path.is_file() {
            return Err(ImageError::KernelMissing(path.clone()));
        }
        kernel_kind(path)?;
        return Ok(Source::File(path.clone()));
    }
    let package = deb::kernel_package()?;
    if package != deb::KERNEL_METAPACKAGE {
        if !opts.force {
            if let Some(deb) = deb::find_deb(debs, &package)? {
                return Ok(Source::Deb(deb));
            }
        }
        progress.step(Step::Downloading {
            package: package.clone(),
        });
        match deb::download(debs, &package, HINT_APT) {
            Ok(deb) => return Ok(Source::Deb(deb)),
            Err(e) => progress.step(Step::KernelPinUnavailable {
                package,
                detail: e.to_string(),
            }),
        }
    }
    progress.step(Step::ResolvingKernel);
    let newest = match deb::resolve_kernel_package(HINT_APT) {
        Ok(newest) => newest,
        Err(e) => {
            // Offline, following the newest: the newest one cached will do.
            return match deb::find_debs(debs, deb::is_kernel_package)? {
                Some(deb) if !opts.force => Ok(Source::Deb(deb)),
                _ => Err(e),
            };
        }
    };
    if !opts.force {
        if let Some(deb) = deb::find_deb(debs, &newest)? {
            return Ok(Source::Deb(deb));
        }
    }
    progress.step(Step::Downloading {
        package: newest.clone(),
    });
    Ok(Source::Deb(deb::download(debs, &newest, HINT_APT)?))
}

fn busybox_source(
    opts: &BuildOptions,
    debs: &Path,
    progress: &mut dyn Progress,
) -> Result<Source, ImageError> {
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
    progress.step(Step::Downloading {
        package: deb::BUSYBOX_PACKAGE.into(),
    });
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
    agent: Option<&Agent>,
    hash: &str,
    progress: &mut dyn Progress,
) -> Result<Image, ImageError> {
    let out = scratch.join("out");
    std::fs::create_dir_all(&out).map_err(|e| ImageError::io(&out, e))?;

    let busybox_bytes = read_busybox(busybox, &scratch.join("busybox"))?;

    let (kernel_file, version, mods) = match kernel {
        Source::File(p) => (p.clone(), None, Vec::new()),
        Source::Deb(deb) => {
            tracing::info!("unpacking {}", deb.display());
            progress.step(Step::Unpacking { deb: deb.clone() });
            let root = scratch.join("kernel");
            deb::extract(deb, &root)?;
            let (vmlinuz, version) = find_vmlinuz(&root.join("boot"), deb)?;
            let mod_dir = root.join("lib/modules").join(&version);
            let mods = modules::resolve(&mod_dir, parts.modules)?;
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
    progress.step(Step::Initramfs {
        modules: mods.len(),
    });
    initramfs::write(
        &out.join("initramfs.cpio"),
        &busybox_bytes,
        &mods,
        parts.init,
        agent
            .filter(|_| parts.agent_in_initramfs)
            .map(|a| a.bytes.as_slice()),
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
        agent_hash: agent.map(|a| a.hash.clone()),
        rootfs: None,
        rootfs_size: None,
    };
    if let Some(agent) = agent {
        let dest = out.join("tine-agent");
        std::fs::write(&dest, &agent.bytes).map_err(|e| ImageError::io(&dest, e))?;
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
