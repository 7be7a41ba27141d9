//! Builds the real image: Debian's cloud kernel (apt-get download, cached),
//! busybox-static, the virtio modules. Tests share one .deb cache
//! (`$TINE_TEST_CACHE`, else the default `<home>/cache/debs`) so the kernel
//! package is downloaded once.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use image::initramfs::{self, CMDLINE_INIT_SED};
use image::{AgentChoice, BuildOptions, ImageError, KernelKind};

fn shared_debs() -> PathBuf {
    match std::env::var_os("TINE_TEST_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => image::default_home()
            .expect("home")
            .join("cache")
            .join("debs"),
    }
}

/// A fresh tine home whose .deb cache is the shared one.
fn temp_home(tag: &str) -> PathBuf {
    let home = std::env::temp_dir().join(format!("tine-image-test-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&home).ok();
    std::fs::create_dir_all(home.join("cache")).expect("home");
    let debs = shared_debs();
    std::fs::create_dir_all(&debs).expect("shared .deb cache");
    std::os::unix::fs::symlink(&debs, home.join("cache").join("debs")).expect("symlink");
    home
}

fn position(order: &[String], name: &str) -> usize {
    order
        .iter()
        .position(|m| m == name)
        .unwrap_or_else(|| panic!("{name} missing from {order:?}"))
}

/// Runs the image's own busybox on the host.
fn busybox(bin: &Path, script: &str) -> String {
    let out = Command::new(bin)
        .args(["sh", "-c", script])
        .output()
        .expect("run busybox");
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim_end().to_string()
}

#[test]
fn test_build_minimal_image_cached_and_complete() {
    let home = temp_home("minimal");
    let mut opts = BuildOptions::new(home.clone());
    opts.agent = AgentChoice::None; // tests/agent.rs covers the agent

    let image = image::build(&opts).expect("build");
    assert_eq!(image.name, "minimal");
    assert_eq!(image.kernel_kind, KernelKind::BzImage);
    assert!(image.kernel.is_file() && image.initramfs.is_file());
    assert!(
        image.kernel_version.ends_with("-cloud-amd64"),
        "{}",
        image.kernel_version
    );
    assert!(image.dir.ends_with(format!("minimal-{}", image.hash)));
    assert!(image.cmdline.contains("console=ttyS0"));
    // The pinned kernel (guests/kernel-package), not whatever is newest or cached.
    let pin = image::kernel_package().expect("pin");
    if pin != image::KERNEL_METAPACKAGE {
        assert_eq!(format!("linux-image-{}", image.kernel_version), pin);
        assert!(
            image.kernel_source.starts_with(&format!("{pin}_")),
            "{}",
            image.kernel_source
        );
    }

    // The initramfs has /init, busybox, the console node and every module.
    let entries: Vec<String> = initramfs::list(&image.initramfs)
        .expect("list")
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    for want in [
        "init",
        "bin/busybox",
        "dev/console",
        initramfs::MODULE_ORDER_PATH,
    ] {
        assert!(
            entries.iter().any(|e| e == want),
            "{want} not in {entries:?}"
        );
    }
    let needed = [
        "virtio",
        "virtio_ring",
        "virtio_mmio",
        "virtio_blk",
        "failover",
        "net_failover",
        "virtio_net",
        "vsock",
        "vmw_vsock_virtio_transport_common",
        "vmw_vsock_virtio_transport",
        "virtio_rng",
    ];
    for m in needed {
        let file = format!("lib/modules/{m}.ko");
        assert!(entries.contains(&file), "{file} not in {entries:?}");
    }
    // Dependencies load first.
    let order = &image.modules;
    for (dep, user) in [
        ("virtio", "virtio_mmio"),
        ("virtio_ring", "virtio_blk"),
        ("failover", "net_failover"),
        ("net_failover", "virtio_net"),
        ("vsock", "vmw_vsock_virtio_transport_common"),
        (
            "vmw_vsock_virtio_transport_common",
            "vmw_vsock_virtio_transport",
        ),
    ] {
        assert!(
            position(order, dep) < position(order, user),
            "{dep} after {user}: {order:?}"
        );
    }
    let listed = initramfs::read_file(&image.initramfs, initramfs::MODULE_ORDER_PATH)
        .expect("read")
        .expect("module order file");
    assert_eq!(
        String::from_utf8_lossy(&listed).lines().collect::<Vec<_>>(),
        *order
    );

    // Same inputs: instant, same image; `open` finds it.
    let start = Instant::now();
    let again = image::build(&opts).expect("second build");
    let elapsed = start.elapsed();
    assert_eq!(again, image);
    assert!(
        elapsed < Duration::from_secs(2),
        "second build took {elapsed:?}"
    );
    eprintln!("cached build: {elapsed:?}");
    assert_eq!(image::open(&home, "minimal").expect("open"), image);

    // The init script parses, and its tine.init= extraction works, with the
    // image's own busybox.
    let bb = home.join("busybox");
    let bytes = initramfs::read_file(&image.initramfs, "bin/busybox")
        .expect("read")
        .expect("busybox");
    std::fs::write(&bb, bytes).expect("write busybox");
    Command::new("chmod")
        .arg("755")
        .arg(&bb)
        .status()
        .expect("chmod");
    let init = home.join("init");
    std::fs::write(&init, initramfs::init_script()).expect("write init");
    busybox(&bb, &format!("sh -n {}", init.display()));
    for (cmdline, want) in [
        (
            r#"console=ttyS0 tine.init="dd if=/dev/zero of=/dev/vda bs=1M count=1" quiet"#,
            "dd if=/dev/zero of=/dev/vda bs=1M count=1",
        ),
        ("console=ttyS0 tine.init=poweroff quiet", "poweroff"),
        ("console=ttyS0 reboot=k panic=1 quiet", ""),
    ] {
        let file = home.join("cmdline");
        std::fs::write(&file, format!("{cmdline}\n")).expect("write cmdline");
        assert_eq!(
            busybox(&bb, &format!("{CMDLINE_INIT_SED} {}", file.display())),
            want
        );
    }

    // --kernel: the given kernel is copied, no modules, its release is read from the bzImage.
    let mut custom = opts.clone();
    custom.kernel = Some(image.kernel.clone());
    let own = image::build(&custom).expect("build with --kernel");
    assert_ne!(own.hash, image.hash);
    assert!(own.modules.is_empty());
    assert_eq!(own.kernel_kind, KernelKind::BzImage);
    assert_eq!(own.kernel_version, image.kernel_version);

    // --force rebuilds the same inputs into the same place.
    custom.force = true;
    let rebuilt = image::build(&custom).expect("forced build");
    assert_eq!(rebuilt, own);
    assert!(rebuilt.kernel.is_file());

    std::fs::remove_dir_all(&home).ok();
}

#[test]
fn test_build_missing_kernel_path_is_clear_error() {
    let home = temp_home("nokernel");
    let mut opts = BuildOptions::new(home.clone());
    opts.agent = AgentChoice::None;
    opts.kernel = Some(PathBuf::from("/nonexistent/vmlinux"));
    let err = image::build(&opts).expect_err("missing kernel");
    assert!(matches!(err, ImageError::KernelMissing(_)));
    let msg = err.to_string();
    assert!(
        msg.contains("/nonexistent/vmlinux") && msg.contains("--kernel"),
        "{msg}"
    );
    std::fs::remove_dir_all(&home).ok();
}

#[test]
fn test_build_non_kernel_file_rejected() {
    let home = temp_home("notkernel");
    let file = home.join("notes.txt");
    std::fs::write(&file, "not a kernel").expect("write");
    let mut opts = BuildOptions::new(home.clone());
    opts.agent = AgentChoice::None;
    opts.kernel = Some(file.clone());
    let err = image::build(&opts).expect_err("not a kernel");
    assert!(
        matches!(err, ImageError::NotAKernel(ref p) if *p == file),
        "{err}"
    );
    std::fs::remove_dir_all(&home).ok();
}

#[test]
fn test_open_unknown_image_says_what_to_do() {
    let home = temp_home("unknown");
    let err = image::open(&home, "minimal").expect_err("nothing built");
    assert!(err.to_string().contains("tine image build"), "{err}");
    std::fs::remove_dir_all(&home).ok();
}
