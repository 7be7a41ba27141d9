//! The debian image. The cheap pieces (mirror detection, boot script syntax,
//! cache keys, manifest compatibility) always run; the real debootstrap
//! build takes minutes and runs only with `TINE_TEST_DEBIAN=1` (as root).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use image::debian::{self, Recipe};

fn temp_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tine-debian-test-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&dir).ok();
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

#[test]
fn test_mirror_from_deb822_sources() {
    let apt = temp_dir("deb822");
    std::fs::create_dir_all(apt.join("sources.list.d")).expect("dir");
    // A disabled file (wrong extension) and a third-party source first in
    // name order; the security suite is not the release suite.
    std::fs::write(
        apt.join("sources.list.d/a-vendor.sources.disabled-by-farm"),
        "Types: deb\nURIs: https://disabled.example/apt\nSuites: bookworm\nComponents: main\n",
    )
    .expect("write");
    std::fs::write(
        apt.join("sources.list.d/b-node.sources"),
        "Types: deb\nURIs: https://deb.nodesource.com/node_20.x\nSuites: nodistro\nComponents: main\n",
    )
    .expect("write");
    std::fs::write(
        apt.join("sources.list.d/debian.sources"),
        "Types: deb\n# http://snapshot.debian.org/archive/debian/20250520T000000Z\n\
         URIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\nComponents: main\n\
         Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n\
         Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n\
         Components: main\n",
    )
    .expect("write");
    assert_eq!(
        debian::apt_mirror(&apt, "bookworm").as_deref(),
        Some("http://mirror.example/debian")
    );
    assert_eq!(
        debian::apt_mirror(&apt, "bookworm-security").as_deref(),
        Some("http://mirror.example/debian-security")
    );
    assert_eq!(debian::apt_mirror(&apt, "trixie"), None);
    std::fs::remove_dir_all(&apt).ok();
}

#[test]
fn test_mirror_from_one_line_sources_list_first() {
    let apt = temp_dir("list");
    std::fs::create_dir_all(apt.join("sources.list.d")).expect("dir");
    std::fs::write(
        apt.join("sources.list"),
        "# deb http://commented.example/debian bookworm main\n\
         deb-src http://src.example/debian bookworm main\n\
         deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] http://list.example/debian bookworm main contrib\n",
    )
    .expect("write");
    std::fs::write(
        apt.join("sources.list.d/z.sources"),
        "Types: deb\nURIs: http://later.example/debian\nSuites: bookworm\n",
    )
    .expect("write");
    assert_eq!(
        debian::apt_mirror(&apt, "bookworm").as_deref(),
        Some("http://list.example/debian")
    );
    // No apt directory at all: no mirror (the builder then uses the default).
    assert_eq!(debian::apt_mirror(&apt.join("missing"), "bookworm"), None);
    std::fs::remove_dir_all(&apt).ok();
}

#[test]
fn test_mirror_skips_disabled_and_unusable_uris() {
    let apt = temp_dir("skip");
    std::fs::create_dir_all(apt.join("sources.list.d")).expect("dir");
    std::fs::write(
        apt.join("sources.list.d/a.sources"),
        "Types: deb\nEnabled: no\nURIs: http://off.example/debian\nSuites: bookworm\n\n\
         Types: deb\nURIs: cdrom:[Debian]/ mirror+file:/etc/apt/mirrors.txt\nSuites: bookworm\n\n\
         Types: deb\nURIs: https://on.example/debian\nSuites: bookworm\n",
    )
    .expect("write");
    assert_eq!(
        debian::apt_mirror(&apt, "bookworm").as_deref(),
        Some("https://on.example/debian")
    );
    std::fs::remove_dir_all(&apt).ok();
}

/// `sh -n` of a script with the given shell (busybox sh or the host's sh).
fn syntax_ok(shell: &[&str], script: &str, tag: &str) {
    let dir = temp_dir(tag);
    let path = dir.join("script");
    std::fs::write(&path, script).expect("write");
    let out = Command::new(shell[0])
        .args(&shell[1..])
        .arg("-n")
        .arg(&path)
        .output()
        .expect("run shell");
    assert!(
        out.status.success(),
        "{shell:?} -n: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn test_boot_scripts_parse() {
    // The initramfs /init runs under busybox sh; /sbin/tine-init under the
    // rootfs's /bin/sh (dash) — check both shells where the host has them.
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).is_file());
    match busybox {
        Some(bb) => {
            syntax_ok(&[bb, "sh"], &debian::root_init_script(), "root-init");
            syntax_ok(&[bb, "sh"], &debian::tine_init_script(), "tine-init-bb");
        }
        None => println!("SKIP busybox sh -n: no busybox on this host"),
    }
    if Path::new("/bin/dash").is_file() {
        syntax_ok(
            &["/bin/dash"],
            &debian::tine_init_script(),
            "tine-init-dash",
        );
    }
    let init = debian::root_init_script();
    assert!(init.contains("switch_root /newroot /sbin/tine-init"));
    let tine_init = debian::tine_init_script();
    assert!(tine_init.contains(image::READY_MARKER));
    assert!(tine_init.contains("/usr/local/bin/tine-agent serve"));
    assert!(debian::inittab().contains("::shutdown:/sbin/tine-init shutdown"));
    assert!(debian::cmdline().ends_with("root=/dev/vda rw"));
    assert!(debian::cmdline().starts_with(image::DEFAULT_CMDLINE));
}

/// The root= parsing of the initramfs /init, run on the host with a fake
/// command line: tine.root= wins over root=, `ro` is honoured.
#[test]
fn test_root_init_reads_the_command_line() {
    let Some(bb) = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
    else {
        println!("SKIP: no busybox on this host");
        return;
    };
    let init = debian::root_init_script();
    // The argument loop and the precedence line, cut out of the script.
    let start = init.find("root=\ntroot=").expect("loop start");
    let end = init.find("[ -n \"$root\" ] ||").expect("loop end");
    let dir = temp_dir("cmdline");
    for (cmdline, want) in [
        ("console=ttyS0 root=/dev/vda rw quiet", "/dev/vda rw"),
        (
            "root=/dev/vda tine.root=LABEL=tine-root ro",
            "LABEL=tine-root ro",
        ),
        ("console=ttyS0", " rw"),
    ] {
        let file = dir.join("cmdline");
        std::fs::write(&file, format!("{cmdline}\n")).expect("write");
        let script = init[start..end].replace("/proc/cmdline", &file.to_string_lossy())
            + "echo \"$root $flags\"\n";
        let out = Command::new(bb)
            .args(["sh", "-c", &script])
            .output()
            .expect("busybox");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), want.trim());
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn test_cache_key_stable_and_sensitive() {
    let mut a = Recipe::new("http://deb.debian.org/debian");
    a.agent_hash = "aa".into();
    a.kernel_hash = "kk".into();
    a.busybox_hash = "bb".into();
    a.modules = vec!["virtio_mmio".into(), "virtio_blk".into()];
    let key = debian::cache_key(&a);
    assert_eq!(key.len(), 16);
    assert!(key.chars().all(|c| c.is_ascii_hexdigit()));
    assert_eq!(debian::cache_key(&a.clone()), key, "same inputs, same key");

    // Package order and duplicates do not matter.
    let mut b = a.clone();
    b.packages.reverse();
    b.packages.push("curl".into());
    assert_eq!(debian::cache_key(&b), key);

    // Every input that changes the rootfs changes the key.
    type Change = Box<dyn Fn(&mut Recipe)>;
    let changes: Vec<Change> = vec![
        Box::new(|r| r.mirror = "http://other.example/debian".into()),
        Box::new(|r| r.suite = "trixie".into()),
        Box::new(|r| r.variant = "buildd".into()),
        Box::new(|r| r.packages.push("strace".into())),
        Box::new(|r| r.agent_hash = "ab".into()),
        Box::new(|r| r.agent_hash.clear()),
        Box::new(|r| r.kernel_hash = "k2".into()),
        Box::new(|r| r.busybox_hash = "b2".into()),
        Box::new(|r| r.modules.pop().map(drop).unwrap_or(())),
    ];
    for (i, change) in changes.iter().enumerate() {
        let mut c = a.clone();
        change(&mut c);
        assert_ne!(debian::cache_key(&c), key, "change {i} kept the key");
    }
}

#[test]
fn test_old_manifest_without_rootfs_loads() {
    let dir = temp_dir("manifest");
    // A manifest written by builder version 2 (before rootfs existed).
    std::fs::write(
        dir.join("manifest.json"),
        r#"{
  "name": "minimal",
  "kernel": "vmlinuz-6.1.0-48-cloud-amd64",
  "kernel_kind": "bzimage",
  "initramfs": "initramfs.cpio",
  "cmdline": "console=ttyS0 reboot=k panic=1 pci=off quiet",
  "kernel_version": "6.1.0-48-cloud-amd64",
  "hash": "0123456789abcdef",
  "modules": ["virtio_mmio", "virtio_blk"],
  "kernel_source": "linux-image-6.1.0-48-cloud-amd64_6.1.170-1_amd64.deb",
  "agent": "tine-agent"
}
"#,
    )
    .expect("write");
    let img = image::Image::load(&dir).expect("old manifest loads");
    assert_eq!(img.name, "minimal");
    assert_eq!(img.rootfs, None);
    assert_eq!(img.rootfs_size, None);
    assert_eq!(img.agent, Some(dir.join("tine-agent")));
    assert_eq!(img.initramfs, dir.join("initramfs.cpio"));

    // A new manifest's rootfs is made absolute like the other files.
    let text = std::fs::read_to_string(dir.join("manifest.json")).expect("read");
    let text = text.replace(
        "\"agent\": \"tine-agent\"",
        "\"agent\": \"tine-agent\",\n  \"rootfs\": \"debian.ext4\",\n  \"rootfs_size\": 1048576",
    );
    std::fs::write(dir.join("manifest.json"), text).expect("write");
    let img = image::Image::load(&dir).expect("new manifest loads");
    assert_eq!(img.rootfs, Some(dir.join("debian.ext4")));
    assert_eq!(img.rootfs_size, Some(1 << 20));
    std::fs::remove_dir_all(&dir).ok();
}

/// The real build: debootstrap (minutes), mkfs.ext4, a clean e2fsck, the
/// expected files inside, and an instant cached second build.
#[test]
fn test_build_debian_for_real() {
    if std::env::var_os("TINE_TEST_DEBIAN").is_none_or(|v| v != "1") {
        println!(
            "SKIP test_build_debian_for_real: set TINE_TEST_DEBIAN=1 to run debootstrap (minutes, as root)"
        );
        return;
    }
    let home = temp_dir("build");
    // Share the kernel .deb cache and debootstrap's package cache.
    let shared = std::env::var_os("TINE_TEST_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            image::default_home()
                .expect("home")
                .join("cache")
                .join("debs")
        });
    std::fs::create_dir_all(&shared).expect("shared cache");
    std::fs::create_dir_all(home.join("cache")).expect("cache");
    std::os::unix::fs::symlink(&shared, home.join("cache/debs")).expect("symlink");
    let debootstrap_cache = image::default_home()
        .expect("home")
        .join("cache")
        .join("debootstrap");
    std::fs::create_dir_all(&debootstrap_cache).expect("debootstrap cache");
    std::os::unix::fs::symlink(&debootstrap_cache, home.join("cache/debootstrap"))
        .expect("symlink");
    let mut opts = image::BuildOptions::new(home.clone());
    opts.agent = match std::env::var_os("TINE_AGENT_BIN") {
        Some(agent) => image::AgentChoice::Path(agent.into()),
        None => image::AgentChoice::None,
    };

    let started = Instant::now();
    let img = image::build_debian(&opts).expect("build debian");
    println!(
        "debian image built in {:.1}s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(img.name, "debian");
    assert!(img.dir.ends_with(format!("debian-{}", img.hash)));
    assert!(img.cmdline.contains("root=/dev/vda"));
    let rootfs = img.rootfs.clone().expect("rootfs");
    let size = std::fs::metadata(&rootfs).expect("rootfs").len();
    assert_eq!(Some(size), img.rootfs_size);

    let fsck = Command::new("e2fsck")
        .args(["-fn"])
        .arg(&rootfs)
        .output()
        .expect("e2fsck");
    assert!(
        fsck.status.success(),
        "e2fsck: {}{}",
        String::from_utf8_lossy(&fsck.stdout),
        String::from_utf8_lossy(&fsck.stderr)
    );
    for file in [
        "/sbin/tine-init",
        "/etc/inittab",
        "/usr/local/lib/tine/busybox",
        "/usr/bin/python3",
        "/usr/bin/curl",
        "/usr/bin/fio",
        "/usr/sbin/ip",
        "/usr/bin/ps",
        "/usr/local/sbin/poweroff",
    ] {
        let out = Command::new("debugfs")
            .args(["-R", &format!("stat {file}")])
            .arg(&rootfs)
            .output()
            .expect("debugfs");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.contains("Inode:"), "{file} missing from the rootfs");
    }

    let started = Instant::now();
    let again = image::build_debian(&opts).expect("cached");
    assert!(started.elapsed().as_secs() < 5, "{:?}", started.elapsed());
    assert_eq!(again, img);
    std::fs::remove_dir_all(&home).ok();
}
