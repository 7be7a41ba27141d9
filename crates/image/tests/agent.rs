//! Images carry tine's guest agent unless built without one, which the
//! manifest records: where the default agent is looked for, the error when
//! it is not there, a no-agent build, and that the agent is part of the
//! cache key. The real kernel (apt-get download, shared .deb cache as in
//! tests/build.rs); a static busybox stands in for the agent binary.

use std::path::{Path, PathBuf};

use image::initramfs;
use image::{AgentChoice, BuildOptions, ImageError, Step};

fn shared_debs() -> PathBuf {
    match std::env::var_os("TINE_TEST_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => image::default_home()
            .expect("home")
            .join("cache")
            .join("debs"),
    }
}

fn temp_home(tag: &str) -> PathBuf {
    let home = std::env::temp_dir().join(format!("tine-agent-test-{tag}-{}", std::process::id()));
    std::fs::remove_dir_all(&home).ok();
    std::fs::create_dir_all(home.join("cache")).expect("home");
    let debs = shared_debs();
    std::fs::create_dir_all(&debs).expect("shared .deb cache");
    std::os::unix::fs::symlink(&debs, home.join("cache").join("debs")).expect("symlink");
    home
}

/// A static executable to stand in for the agent (busybox-static, which
/// scripts/setup installs).
fn stand_in_agent() -> PathBuf {
    let bb = PathBuf::from("/bin/busybox");
    assert!(
        bb.is_file(),
        "/bin/busybox missing: run scripts/setup (busybox-static)"
    );
    bb
}

#[test]
fn test_default_agent_is_where_build_agent_puts_it() {
    assert_eq!(
        image::agent_paths_near(Path::new("/src/tine/target/release/tine")),
        [
            PathBuf::from("/src/tine/target/release/tine-agent"),
            PathBuf::from("/src/tine/target/agent/x86_64-unknown-linux-gnu/release/tine-agent"),
        ]
    );
    assert_eq!(
        image::resolve_agent(&AgentChoice::Path("/a/b".into())).expect("a path"),
        Some(PathBuf::from("/a/b"))
    );
    assert_eq!(
        image::resolve_agent(&AgentChoice::None).expect("none"),
        None
    );
}

#[test]
fn test_missing_agent_fails_first_and_says_what_to_do() {
    // This test binary lives in target/debug/deps/: nothing is built there.
    let searched = image::default_agent_paths();
    assert!(
        !searched.is_empty() && searched.iter().all(|p| !p.exists()),
        "{searched:?}"
    );
    let home = temp_home("missing");
    let opts = BuildOptions::new(home.clone());
    assert_eq!(opts.agent, AgentChoice::Default, "the agent is the default");
    let mut steps = Vec::new();
    let err = image::build_with(&opts, &mut |s: Step| steps.push(s)).expect_err("no agent");
    assert!(
        matches!(err, ImageError::AgentNotFound { searched: ref s } if *s == searched),
        "{err:?}"
    );
    let msg = err.to_string();
    for want in ["scripts/build-agent", "--agent PATH", "--no-agent"] {
        assert!(msg.contains(want), "{want:?} not in: {msg}");
    }
    assert!(msg.contains(&searched[1].display().to_string()), "{msg}");
    // Before anything else (no download, nothing built).
    assert!(steps.is_empty(), "{steps:?}");
    assert!(!home.join("images").exists());

    // The debian build too (before any download or root check).
    let err = image::build_debian(&opts).expect_err("no agent");
    assert!(matches!(err, ImageError::AgentNotFound { .. }), "{err:?}");
    std::fs::remove_dir_all(&home).ok();
}

#[test]
fn test_bad_agent_paths_are_clear_errors() {
    let home = temp_home("bad");
    let mut opts = BuildOptions::new(home.clone());
    opts.agent = AgentChoice::Path(home.join("no-such-agent"));
    let err = image::build(&opts).expect_err("unreadable");
    assert!(matches!(err, ImageError::AgentUnreadable { .. }), "{err:?}");
    assert!(err.to_string().contains("scripts/build-agent"), "{err}");
    // A dynamically linked program (this test) is refused.
    let exe = std::env::current_exe().expect("exe");
    opts.agent = AgentChoice::Path(exe.clone());
    let err = image::build(&opts).expect_err("dynamic");
    assert!(
        matches!(err, ImageError::AgentNotStatic(ref p) if *p == exe),
        "{err:?}"
    );
    std::fs::remove_dir_all(&home).ok();
}

#[test]
fn test_no_agent_build_is_recorded_and_keyed_apart() {
    let home = temp_home("noagent");
    let mut opts = BuildOptions::new(home.clone());
    opts.agent = AgentChoice::None;
    let mut steps = Vec::new();
    let bare = image::build_with(&opts, &mut |s: Step| steps.push(s)).expect("no-agent build");
    assert_eq!(
        steps.first(),
        Some(&Step::Agent { path: None }),
        "{steps:?}"
    );
    assert!(
        matches!(steps.last(), Some(Step::Built { .. })),
        "{steps:?}"
    );
    assert!(steps.iter().any(|s| matches!(s, Step::Initramfs { .. })));
    assert!(!bare.has_agent());
    assert_eq!(bare.agent, None);
    assert_eq!(bare.agent_hash, None);
    let err = bare.require_agent().expect_err("no agent");
    assert!(matches!(err, ImageError::NoAgent { .. }), "{err:?}");
    let msg = err.to_string();
    for want in ["no guest agent", "tine image build minimal", "--no-agent"] {
        assert!(msg.contains(want), "{want:?} not in: {msg}");
    }
    // The manifest says so explicitly; the initramfs has no agent.
    let manifest = std::fs::read_to_string(bare.dir.join("manifest.json")).expect("manifest");
    assert!(manifest.contains("\"agent\": null"), "{manifest}");
    let names: Vec<String> = initramfs::list(&bare.initramfs)
        .expect("list")
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert!(!names.iter().any(|n| n.contains("tine-agent")), "{names:?}");

    // With an agent: another cache key, the agent's hash recorded, the
    // agent in the initramfs.
    let agent = stand_in_agent();
    let mut with = opts.clone();
    with.agent = AgentChoice::Path(agent.clone());
    let full = image::build(&with).expect("build with agent");
    assert_ne!(full.hash, bare.hash);
    assert_ne!(full.dir, bare.dir);
    assert!(full.has_agent());
    full.require_agent().expect("has an agent");
    let bytes = std::fs::read(&agent).expect("read agent");
    assert_eq!(
        full.agent_hash.as_deref(),
        Some(blake3::hash(&bytes).to_hex().as_str())
    );
    assert_eq!(
        initramfs::read_file(&full.initramfs, "bin/tine-agent").expect("read"),
        Some(bytes.clone())
    );
    assert_eq!(
        std::fs::read(full.agent.as_ref().expect("copy")).expect("copy"),
        bytes
    );
    assert!(bare.dir.is_dir(), "both stay cached");

    // `open` picks the image last asked for: a cached build counts.
    assert_eq!(image::open(&home, "minimal").expect("open"), full);
    let mut steps = Vec::new();
    let again = image::build_with(&opts, &mut |s: Step| steps.push(s)).expect("cached");
    assert_eq!(again, bare);
    assert!(
        matches!(steps.last(), Some(Step::UpToDate { .. })),
        "{steps:?}"
    );
    assert_eq!(image::open(&home, "minimal").expect("open"), bare);
    assert_eq!(image::build(&with).expect("cached"), full);
    assert_eq!(image::open(&home, "minimal").expect("open"), full);
    std::fs::remove_dir_all(&home).ok();
}

/// An image built before agents were recorded by hash still says whether it
/// has one.
#[test]
fn test_old_manifest_without_agent_hash() {
    let dir = std::env::temp_dir().join(format!("tine-agent-test-old-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let manifest = r#"{"name": "debian", "kernel": "vmlinuz", "kernel_kind": "bzimage",
        "initramfs": "initramfs.cpio", "cmdline": "", "kernel_version": "6.1",
        "hash": "0123456789abcdef", "modules": [], "kernel_source": "x.deb"}"#;
    std::fs::write(dir.join("manifest.json"), manifest).expect("write");
    let img = image::Image::load(&dir).expect("load");
    assert!(!img.has_agent());
    assert_eq!(img.agent_hash, None);
    let msg = img.require_agent().expect_err("no agent").to_string();
    assert!(msg.contains("tine image build debian"), "{msg}");
    let with = manifest.replace("\"modules\"", "\"agent\": \"tine-agent\", \"modules\"");
    std::fs::write(dir.join("manifest.json"), with).expect("write");
    assert!(image::Image::load(&dir).expect("load").has_agent());
    std::fs::remove_dir_all(&dir).ok();
}
