//! The "debian" image: a Debian bookworm root filesystem made with
//! `debootstrap` (minbase plus a few packages) in an ext4 file (`mkfs.ext4
//! -d`), booted with root on the first virtio-blk disk.
//!
//! Boot: the kernel and initramfs are the minimal image's (same kernel,
//! busybox, virtio modules) with a different /init ([`root_init_script`]):
//! it loads the modules, mounts `root=` and `switch_root`s into
//! `/sbin/tine-init` ([`tine_init_script`]) on the disk.
//!
//! Why no systemd: minbase has none, and systemd would add seconds to every
//! boot (10x more in the nested test host) for services a benchmark guest
//! does not need. `/sbin/tine-init` mounts the API filesystems, brings lo up,
//! starts the agent, prints the ready marker and hands PID 1 to busybox init
//! (a static busybox is copied into the rootfs), which reaps orphans,
//! respawns the console shell and turns `poweroff`/`reboot` (and the signals
//! they send) into a clean shutdown. No udev or kmod either: the initramfs
//! has loaded every module the guest needs before the switch.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::ImageError;

/// Image name.
pub const DEBIAN_IMAGE_NAME: &str = "debian";
/// Bumped whenever the debian builder's output changes for the same inputs.
pub const DEBIAN_BUILDER_VERSION: u32 = 1;
/// The Debian release.
pub const DEBIAN_SUITE: &str = "bookworm";
/// debootstrap's variant: essential packages plus apt, no init system.
pub const DEBIAN_VARIANT: &str = "minbase";
/// Packages added to minbase (fio is for the disk benchmark, procps for
/// ps/top/free in demos).
pub const DEBIAN_PACKAGES: &[&str] = &[
    "python3",
    "curl",
    "iproute2",
    "ca-certificates",
    "fio",
    "procps",
];
/// Used when the host's apt sources name no mirror for [`DEBIAN_SUITE`].
pub const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";
/// The root filesystem file in the image directory.
pub const ROOTFS_FILE: &str = "debian.ext4";
/// The ext4 volume label.
pub const ROOTFS_LABEL: &str = "tine-root";
/// Appended to the minimal command line: the root disk (the VMM's first
/// virtio-blk device), mounted read-write.
pub const ROOT_CMDLINE: &str = "root=/dev/vda rw";
/// Free space in the filesystem beyond its contents: this plus 25% of them.
pub const FREE_BYTES: u64 = 1 << 30;
/// Where the agent goes in the rootfs.
pub const AGENT_PATH: &str = "usr/local/bin/tine-agent";
/// Where the static busybox goes in the rootfs (init, poweroff, reboot).
pub const BUSYBOX_PATH: &str = "usr/local/lib/tine/busybox";
/// The init the initramfs switches to.
pub const TINE_INIT_PATH: &str = "sbin/tine-init";

const HINT_DEBOOTSTRAP: &str = "install it with `apt-get install debootstrap`";
const HINT_MKFS: &str = "install it with `apt-get install e2fsprogs`";

/// The initramfs /init of the debian image (busybox sh): load the modules,
/// mount the root device and switch to its `/sbin/tine-init`.
pub fn root_init_script() -> String {
    format!(
        r#"#!/bin/busybox sh
# tine root-on-disk guest: load the virtio modules, mount the device named
# by tine.root= or root= (a path, LABEL= or UUID=) and switch_root into its
# /{tine_init}. On failure: a shell on the console, then power off.
/bin/busybox --install -s
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TERM=linux
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
fail() {{
    echo "tine: $*"
    echo "tine: starting a shell; leaving it powers off"
    setsid cttyhack sh
    sync
    poweroff -f
}}
for m in $(cat /{order}); do
    insmod "/lib/modules/$m.ko" || echo "tine: cannot load module $m"
done
root=
troot=
flags=rw
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        tine.root=*) troot=${{arg#tine.root=}} ;;
        root=*) root=${{arg#root=}} ;;
        ro) flags=ro ;;
        rw) flags=rw ;;
    esac
done
[ -n "$troot" ] && root=$troot
[ -n "$root" ] || fail "no root= on the kernel command line"
dev=
i=0
while [ $i -lt 200 ]; do
    case "$root" in
        LABEL=*|UUID=*) dev=$(findfs "$root" 2>/dev/null) ;;
        *) dev=$root ;;
    esac
    [ -n "$dev" ] && [ -b "$dev" ] && break
    dev=
    i=$((i + 1))
    sleep 0.05
done
[ -n "$dev" ] || fail "root device $root did not appear"
mkdir -p /newroot
mount -t ext4 -o "$flags" "$dev" /newroot || fail "cannot mount $dev ($root)"
[ -x /newroot/{tine_init} ] || fail "$root has no /{tine_init}"
umount /proc /sys /dev
exec switch_root /newroot /{tine_init}
"#,
        order = crate::initramfs::MODULE_ORDER_PATH,
        tine_init = TINE_INIT_PATH,
    )
}

/// `/sbin/tine-init` in the rootfs (POSIX sh). Without arguments it is PID 1
/// after switch_root: set up, start the agent, print the ready marker, exec
/// busybox init. busybox init calls it back as `tine-init console` (the
/// console shell, or the `tine.init=` command followed by poweroff) and
/// `tine-init shutdown`.
pub fn tine_init_script() -> String {
    format!(
        r#"#!/bin/sh
# tine debian guest init (see crates/image/src/debian.rs).
BB=/{busybox}
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TERM=linux
case "$1" in
console)
    cmd=$({sed} /proc/cmdline)
    if [ -n "$cmd" ]; then
        cd /root
        sh -c "$cmd"
        echo "tine: exit $?"
        sync
        $BB poweroff
        exec sleep infinity
    fi
    cd /root
    exec $BB cttyhack /bin/bash -l
    ;;
shutdown)
    sync
    $BB mount -o remount,ro / 2>/dev/null
    sync
    exit 0
    ;;
esac
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs -o mode=755 tmpfs /run
mount -t tmpfs -o mode=1777 tmpfs /tmp
mkdir -p /run/lock
$BB hostname -F /etc/hostname 2>/dev/null || $BB hostname tine
ip link set lo up
if [ -x /{agent} ]; then
    setsid /{agent} serve </dev/null >/dev/console 2>&1 &
fi
echo "{ready}"
exec $BB init
"#,
        busybox = BUSYBOX_PATH,
        sed = crate::initramfs::CMDLINE_INIT_SED,
        agent = AGENT_PATH,
        ready = crate::READY_MARKER,
    )
}

/// busybox init's table: the console, and shutdown via `tine-init shutdown`.
pub fn inittab() -> String {
    format!(
        "# tine: busybox init (see /{t})\n\
         ::respawn:/{t} console\n\
         ::ctrlaltdel:/{bb} reboot\n\
         ::shutdown:/{t} shutdown\n",
        t = TINE_INIT_PATH,
        bb = BUSYBOX_PATH,
    )
}

/// One apt source: its URI and suites.
#[derive(Debug, Clone, PartialEq, Eq)]
struct AptSource {
    uris: Vec<String>,
    suites: Vec<String>,
}

/// Sources in one-line format (`deb [options] URI suite [component...]`).
fn parse_list(text: &str) -> Vec<AptSource> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let mut rest = match line.strip_prefix("deb") {
            Some(r) if r.starts_with([' ', '\t']) => r.trim_start(),
            _ => continue,
        };
        if rest.starts_with('[') {
            match rest.find(']') {
                Some(end) => rest = rest[end + 1..].trim_start(),
                None => continue,
            }
        }
        let mut words = rest.split_whitespace();
        if let (Some(uri), Some(suite)) = (words.next(), words.next()) {
            out.push(AptSource {
                uris: vec![uri.to_string()],
                suites: vec![suite.to_string()],
            });
        }
    }
    out
}

/// Sources in deb822 format (paragraphs of `Field: value`).
fn parse_sources(text: &str) -> Vec<AptSource> {
    let mut out = Vec::new();
    for para in text.split("\n\n").flat_map(|p| p.split("\r\n\r\n")) {
        let mut types = Vec::new();
        let mut uris = Vec::new();
        let mut suites = Vec::new();
        let mut enabled = true;
        let mut field = String::new();
        for line in para.lines() {
            if line.trim_start().starts_with('#') || line.trim().is_empty() {
                continue;
            }
            // Continuation lines (leading space) extend the previous field.
            let (name, value) = if line.starts_with([' ', '\t']) {
                (field.clone(), line.trim())
            } else if let Some((n, v)) = line.split_once(':') {
                field = n.trim().to_ascii_lowercase();
                (field.clone(), v.trim())
            } else {
                continue;
            };
            let words = value.split_whitespace().map(str::to_string);
            match name.as_str() {
                "types" => types.extend(words),
                "uris" => uris.extend(words),
                "suites" => suites.extend(words),
                "enabled" => enabled = !value.eq_ignore_ascii_case("no"),
                _ => {}
            }
        }
        if enabled && types.iter().any(|t| t == "deb") && !uris.is_empty() {
            out.push(AptSource { uris, suites });
        }
    }
    out
}

/// The Debian mirror the host's apt uses for `suite`: the first `deb`
/// source (http, https or file) listing that suite in `<apt_dir>/sources.list`,
/// then `<apt_dir>/sources.list.d/*.list` and `*.sources` in name order.
/// Disabled files (any other extension) and `Enabled: no` are skipped.
pub fn apt_mirror(apt_dir: &Path, suite: &str) -> Option<String> {
    let mut sources = Vec::new();
    if let Ok(text) = std::fs::read_to_string(apt_dir.join("sources.list")) {
        sources.extend(parse_list(&text));
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(apt_dir.join("sources.list.d"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    files.sort();
    for file in files {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        match file.extension().and_then(|e| e.to_str()) {
            Some("list") => sources.extend(parse_list(&text)),
            Some("sources") => sources.extend(parse_sources(&text)),
            _ => {}
        }
    }
    sources
        .into_iter()
        .filter(|s| s.suites.iter().any(|x| x == suite))
        .flat_map(|s| s.uris)
        .find(|u| {
            ["http://", "https://", "file:/"]
                .iter()
                .any(|p| u.starts_with(p))
        })
        .map(|u| u.trim_end_matches('/').to_string())
}

/// Everything the root filesystem depends on; [`cache_key`] hashes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recipe {
    pub suite: String,
    pub variant: String,
    /// Extra packages (order does not matter).
    pub packages: Vec<String>,
    pub mirror: String,
    /// blake3 of the agent binary, or empty without one.
    pub agent_hash: String,
    /// blake3 of the kernel file.
    pub kernel_hash: String,
    /// blake3 of the busybox binary.
    pub busybox_hash: String,
    /// Modules in the initramfs.
    pub modules: Vec<String>,
}

impl Recipe {
    /// The default recipe for `mirror` and the given file hashes.
    pub fn new(mirror: &str) -> Self {
        Self {
            suite: DEBIAN_SUITE.into(),
            variant: DEBIAN_VARIANT.into(),
            packages: DEBIAN_PACKAGES.iter().map(|p| p.to_string()).collect(),
            mirror: mirror.into(),
            agent_hash: String::new(),
            kernel_hash: String::new(),
            busybox_hash: String::new(),
            modules: Vec::new(),
        }
    }
}

/// The kernel command line of the debian image.
pub fn cmdline() -> String {
    format!("{} {ROOT_CMDLINE}", crate::DEFAULT_CMDLINE)
}

/// The image hash (16 hex digits) for a recipe: its fields, the builder
/// versions and the boot scripts.
pub fn cache_key(r: &Recipe) -> String {
    let mut packages = r.packages.clone();
    packages.sort();
    packages.dedup();
    let inputs = format!(
        "debian-builder={DEBIAN_BUILDER_VERSION}\nbuilder={}\nsuite={}\nvariant={}\npackages={}\n\
         mirror={}\nagent={}\nkernel={}\nbusybox={}\nmodules={}\ncmdline={}\n\
         initramfs-init={}\ntine-init={}\ninittab={}\n",
        crate::BUILDER_VERSION,
        r.suite,
        r.variant,
        packages.join(","),
        r.mirror,
        r.agent_hash,
        r.kernel_hash,
        r.busybox_hash,
        r.modules.join(","),
        cmdline(),
        blake3::hash(root_init_script().as_bytes()).to_hex(),
        blake3::hash(tine_init_script().as_bytes()).to_hex(),
        blake3::hash(inittab().as_bytes()).to_hex(),
    );
    blake3::hash(inputs.as_bytes()).to_hex()[..16].to_string()
}

/// Runs debootstrap into `target` (output to our stderr: it takes minutes).
pub(crate) fn debootstrap(r: &Recipe, target: &Path, cache: &Path) -> Result<(), ImageError> {
    std::fs::create_dir_all(cache).map_err(|e| ImageError::io(cache, e))?;
    let cache = std::fs::canonicalize(cache).map_err(|e| ImageError::io(cache, e))?;
    let mut packages = r.packages.clone();
    packages.sort();
    let mut cmd = Command::new("debootstrap");
    cmd.arg(format!("--variant={}", r.variant))
        .arg(format!("--include={}", packages.join(",")))
        .arg(format!("--cache-dir={}", cache.display()))
        .arg(&r.suite)
        .arg(target)
        .arg(&r.mirror)
        .stdin(Stdio::null());
    if let Ok(fd) = std::os::fd::AsFd::as_fd(&std::io::stderr()).try_clone_to_owned() {
        cmd.stdout(Stdio::from(fd));
    }
    tracing::info!(
        "debootstrap {} {} from {} (takes minutes)",
        r.variant,
        r.suite,
        r.mirror
    );
    let status = cmd.status().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            ImageError::ToolMissing {
                tool: "debootstrap".into(),
                hint: HINT_DEBOOTSTRAP.into(),
            }
        } else {
            ImageError::io(Path::new("debootstrap"), e)
        }
    })?;
    if !status.success() {
        let log = target.join("debootstrap/debootstrap.log");
        let tail = std::fs::read_to_string(&log)
            .map(|t| {
                let lines: Vec<&str> = t.lines().filter(|l| !l.trim().is_empty()).collect();
                lines[lines.len().saturating_sub(5)..].join("; ")
            })
            .unwrap_or_default();
        return Err(ImageError::Command {
            command: format!("debootstrap {} {}", r.suite, r.mirror),
            detail: format!("{status}: {tail}"),
            hint: format!(
                "check that {} is reachable (apt-get update works) and see {}",
                r.mirror,
                log.display()
            ),
        });
    }
    Ok(())
}

fn write_file(path: &Path, data: &[u8], mode: u32) -> Result<(), ImageError> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| ImageError::io(dir, e))?;
    }
    std::fs::remove_file(path).ok();
    std::fs::write(path, data).map_err(|e| ImageError::io(path, e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| ImageError::io(path, e))
}

/// Adds tine's pieces to a debootstrapped tree: busybox (init, poweroff,
/// reboot, halt), /sbin/tine-init, /etc/inittab, the agent, the hostname;
/// and removes the downloaded packages.
pub(crate) fn customize(
    root: &Path,
    busybox: &[u8],
    agent: Option<&[u8]>,
) -> Result<(), ImageError> {
    write_file(&root.join(BUSYBOX_PATH), busybox, 0o755)?;
    for applet in ["poweroff", "reboot", "halt"] {
        let link = root.join("usr/local/sbin").join(applet);
        std::fs::create_dir_all(root.join("usr/local/sbin"))
            .map_err(|e| ImageError::io(&link, e))?;
        std::fs::remove_file(&link).ok();
        std::os::unix::fs::symlink(format!("/{BUSYBOX_PATH}"), &link)
            .map_err(|e| ImageError::io(&link, e))?;
    }
    write_file(
        &root.join(TINE_INIT_PATH),
        tine_init_script().as_bytes(),
        0o755,
    )?;
    write_file(&root.join("etc/inittab"), inittab().as_bytes(), 0o644)?;
    write_file(&root.join("etc/hostname"), b"tine\n", 0o644)?;
    write_file(
        &root.join("etc/hosts"),
        b"127.0.0.1\tlocalhost\n127.0.1.1\ttine\n::1\tlocalhost ip6-localhost ip6-loopback\n",
        0o644,
    )?;
    write_file(
        &root.join("etc/fstab"),
        format!("LABEL={ROOTFS_LABEL} / ext4 rw,relatime 0 1\n").as_bytes(),
        0o644,
    )?;
    if let Some(agent) = agent {
        write_file(&root.join(AGENT_PATH), agent, 0o755)?;
    }
    let archives = root.join("var/cache/apt/archives");
    if let Ok(entries) = std::fs::read_dir(&archives) {
        for e in entries.flatten() {
            if e.path().extension().is_some_and(|x| x == "deb") {
                std::fs::remove_file(e.path()).ok();
            }
        }
    }
    Ok(())
}

/// Bytes a tree takes (files rounded up to 4 KiB, one block per directory
/// and symlink).
fn tree_bytes(dir: &Path) -> Result<(u64, u64), ImageError> {
    let mut bytes = 0u64;
    let mut inodes = 0u64;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).map_err(|e| ImageError::io(&d, e))? {
            let entry = entry.map_err(|e| ImageError::io(&d, e))?;
            let meta = entry
                .path()
                .symlink_metadata()
                .map_err(|e| ImageError::io(&entry.path(), e))?;
            inodes += 1;
            bytes += meta.len().div_ceil(4096).max(1) * 4096;
            if meta.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    Ok((bytes, inodes))
}

/// Makes the ext4 file `dest` from the tree `root`, sized to fit with
/// [`FREE_BYTES`] + 25% free. Returns its size.
pub(crate) fn make_ext4(root: &Path, dest: &Path) -> Result<u64, ImageError> {
    let (used, inodes) = tree_bytes(root)?;
    const MIB: u64 = 1 << 20;
    let size = (used + used / 4 + FREE_BYTES).div_ceil(64 * MIB) * 64 * MIB;
    // Room for twice today's files, at least the mkfs default density.
    let inode_count = (inodes * 2).max(size / 16384);
    let file = std::fs::File::create(dest).map_err(|e| ImageError::io(dest, e))?;
    file.set_len(size).map_err(|e| ImageError::io(dest, e))?;
    drop(file);
    tracing::info!(
        "mkfs.ext4 -d: {} MiB of files into {} MiB",
        used / MIB,
        size / MIB
    );
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0", "-L", ROOTFS_LABEL])
        .arg("-N")
        .arg(inode_count.to_string())
        .arg("-d")
        .arg(root)
        .arg(dest)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                ImageError::ToolMissing {
                    tool: "mkfs.ext4".into(),
                    hint: HINT_MKFS.into(),
                }
            } else {
                ImageError::io(Path::new("mkfs.ext4"), e)
            }
        })?;
    if !out.status.success() {
        return Err(ImageError::Command {
            command: format!("mkfs.ext4 -d {}", root.display()),
            detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            hint: "mkfs.ext4 -d needs e2fsprogs 1.43 or newer".into(),
        });
    }
    Ok(size)
}

/// Unmounts anything mounted under `dir` (debootstrap mounts /proc and /sys
/// in its target and may leave them after a failure), deepest first, so a
/// scratch directory can be removed safely. Returns false if a mount stays.
pub(crate) fn unmount_under(dir: &Path) -> bool {
    let Ok(dir) = std::fs::canonicalize(dir) else {
        return true;
    };
    let mounts = |d: &Path| -> Vec<PathBuf> {
        let text = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
        let mut v: Vec<PathBuf> = text
            .lines()
            .filter_map(|l| l.split_whitespace().nth(1))
            .map(|m| PathBuf::from(m.replace("\\040", " ")))
            .filter(|m| m.starts_with(d))
            .collect();
        v.sort();
        v.reverse();
        v
    };
    for m in mounts(&dir) {
        let _ = Command::new("umount").arg("-l").arg(&m).status();
    }
    mounts(&dir).is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_parse_one_line_sources() {
        let s = parse_list(
            "# comment\ndeb [arch=amd64 signed-by=/k.gpg] http://m.example/debian bookworm main\n\
             deb-src http://src.example/debian bookworm main\ndeb http://x/y sid main # tail\n",
        );
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].uris, ["http://m.example/debian"]);
        assert_eq!(s[0].suites, ["bookworm"]);
        assert_eq!(s[1].suites, ["sid"]);
    }

    #[test]
    fn test_parse_deb822_sources() {
        let s = parse_sources(
            "Types: deb deb-src\nURIs: http://a/debian\n  http://b/debian\nSuites: bookworm bookworm-updates\n\n\
             Types: deb\nEnabled: no\nURIs: http://off/debian\nSuites: bookworm\n\n\
             Types: deb-src\nURIs: http://src/debian\nSuites: bookworm\n",
        );
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].uris, ["http://a/debian", "http://b/debian"]);
    }
}
