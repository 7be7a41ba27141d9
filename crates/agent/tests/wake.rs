//! Quiesce and Wake against the real agent binary in its `--root` sandbox:
//! file-level steps (identity files, secrets, contract, hooks) really run
//! under a temporary root; system-wide ones are reported as skipped.
//! `TINE_AGENT_BIN` runs them against another build.

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Child;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use protocol::wake::{
    to_hex, Randomness, Role, SecretAction, StepStatus, Wake, WakeNet, WakeReport, WakeSecret,
    WakeStep,
};

/// An agent serving on a Unix socket with `--root`; killed on drop, its
/// directory removed.
struct Sandbox {
    child: Child,
    sock: PathBuf,
    dir: PathBuf,
}

impl Sandbox {
    fn start() -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tine-agent-wake-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(dir.join("root")).expect("mkdir");
        let sock = dir.join("agent.sock");
        let root = dir.join("root");
        let child = common::serve(&sock, &["--root".as_ref(), root.as_os_str()]);
        Self { child, sock, dir }
    }

    /// A path under the sandbox root.
    fn at(&self, guest: &str) -> PathBuf {
        self.dir.join("root").join(guest.trim_start_matches('/'))
    }

    fn put(&self, guest: &str, data: &str, mode: u32) {
        let p = self.at(guest);
        fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        fs::write(&p, data).expect("write");
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).expect("chmod");
    }

    fn conn(&self) -> UnixStream {
        let mut s = UnixStream::connect(&self.sock).expect("connect");
        protocol::hello(&mut s).expect("hello");
        s
    }

    fn wake(&self, w: Wake) -> WakeReport {
        protocol::wake(&mut self.conn(), w).expect("wake")
    }

    fn quiesce(&self, timeout_ms: u64) -> protocol::QuiesceReport {
        protocol::quiesce(&mut self.conn(), timeout_ms).expect("quiesce")
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn base_wake() -> Wake {
    Wake {
        role: Role::Child,
        vm_id: "web-3".into(),
        parent_id: Some("web".into()),
        hostname: "web-3".into(),
        machine_id: Some("0123456789abcdef0123456789abcdef".into()),
        net: Some(WakeNet {
            interface: None,
            mac: "52:54:00:12:34:56".into(),
            ip: "10.213.0.5/24".into(),
            gateway: "10.213.0.1".into(),
        }),
        randomness: Randomness::Secure,
        entropy_hex: to_hex(&[0x5a; 32]),
        host_time_ns: Some(1_800_000_000_000_000_000),
        reset_connections: true,
        secrets: Vec::new(),
        run_hooks: true,
        hook_timeout_ms: 10_000,
        contract_toml: "randomness = \"secure\"\n".into(),
        ca_pem: None,
    }
}

fn step<'a>(r: &'a WakeReport, name: &str) -> &'a WakeStep {
    r.steps
        .iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no step {name} in {:#?}", r.steps))
}

fn names(r: &WakeReport) -> Vec<&str> {
    r.steps.iter().map(|s| s.name.as_str()).collect()
}

fn kernel_hostname() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname")
}

#[test]
fn test_full_wake_in_sandbox() {
    let a = Sandbox::start();
    let host_name = kernel_hostname();
    let log = a.dir.join("hooks.log");
    a.put("/run/secrets/keep", "kept-value", 0o600);
    a.put("/run/secrets/db", "hunter2-very-secret", 0o600);
    a.put("/run/secrets/api", "old-api-token", 0o644);
    // The revoke hook sees the file already gone.
    a.put(
        "/usr/lib/app/revoked",
        &format!(
            "#!/bin/sh\n[ -e \"$TINE_SECRET_PATH\" ] && echo present >> {log}\necho \"revoke $TINE_SECRET $(basename $TINE_SECRET_PATH)\" >> {log}\n",
            log = log.display()
        ),
        0o755,
    );
    let hook = |name: &str| {
        format!(
            "#!/bin/sh\necho \"{name} $TINE_VM_ID $TINE_PARENT_ID $TINE_ROLE $TINE_HOSTNAME $TINE_IP $TINE_MAC $TINE_RANDOMNESS\" >> {}\n",
            log.display()
        )
    };
    a.put("/etc/tine/wake.d/20-second", &hook("20"), 0o755);
    a.put("/etc/tine/wake.d/10-first", &hook("10"), 0o755);
    a.put(
        "/etc/tine/wake.d/30-fails",
        "#!/bin/sh\necho 'cannot reach the database' >&2\nexit 1\n",
        0o755,
    );
    a.put("/etc/tine/wake.d/40-last", &hook("40"), 0o700);
    a.put("/etc/tine/wake.d/50-not-executable", &hook("50"), 0o644);
    a.put("/etc/hosts", "127.0.0.1 localhost\n127.0.1.1 web\n", 0o644);

    let mut w = base_wake();
    w.secrets = vec![
        WakeSecret {
            name: "keep".into(),
            path: "/run/secrets/keep".into(),
            action: SecretAction::Keep,
        },
        WakeSecret {
            name: "db".into(),
            path: "/run/secrets/db".into(),
            action: SecretAction::Revoke {
                hook: Some("/usr/lib/app/revoked".into()),
            },
        },
        WakeSecret {
            name: "gone".into(),
            path: "/run/secrets/never-there".into(),
            action: SecretAction::Revoke { hook: None },
        },
        WakeSecret {
            name: "api".into(),
            path: "/run/secrets/new/api".into(),
            action: SecretAction::Rotate {
                value_hex: to_hex(b"fresh\0token"),
            },
        },
    ];
    let r = a.wake(w);

    assert_eq!(
        names(&r),
        [
            "randomness",
            "clock",
            "hostname",
            "machine_id",
            "identity",
            "connections",
            "network",
            "secret:keep",
            "secret:db",
            "secret:gone",
            "secret:api",
            "contract",
            "ca",
            "thaw",
            "hook:10-first",
            "hook:20-second",
            "hook:30-fails",
            "hook:40-last",
        ]
    );
    assert!(r.randomness_ok, "{r:#?}");
    for sys in ["randomness", "clock", "connections", "network"] {
        let s = step(&r, sys);
        assert_eq!(s.status, StepStatus::Skipped, "{s:?}");
        assert!(s.detail.starts_with("sandbox"), "{s:?}");
    }
    assert!(step(&r, "randomness").detail.contains("32 bytes"));
    assert_eq!(step(&r, "thaw").status, StepStatus::Skipped);
    let failed: Vec<&str> = r.failed().map(|s| s.name.as_str()).collect();
    assert_eq!(failed, ["hook:30-fails"], "{r:#?}");
    assert_eq!(
        step(&r, "hook:30-fails").detail,
        "exit 1: cannot reach the database"
    );
    assert!(r.wall_micros > 0 && r.wall_micros < 10_000_000);

    // Identity.
    assert_eq!(
        fs::read_to_string(a.at("/etc/hostname")).expect("hostname"),
        "web-3\n"
    );
    assert_eq!(
        fs::read_to_string(a.at("/etc/machine-id")).expect("machine-id"),
        "0123456789abcdef0123456789abcdef\n"
    );
    assert_eq!(
        fs::read_to_string(a.at("/etc/hosts")).expect("hosts"),
        "127.0.0.1 localhost\n127.0.1.1\tweb-3\n"
    );
    assert_eq!(kernel_hostname(), host_name, "the sandbox set the hostname");

    // Secrets.
    assert_eq!(
        fs::read_to_string(a.at("/run/secrets/keep")).expect("kept"),
        "kept-value"
    );
    assert!(
        !a.at("/run/secrets/db").exists(),
        "revoked file still there"
    );
    assert!(step(&r, "secret:db").detail.contains("19 bytes zeroed"));
    assert_eq!(step(&r, "secret:gone").detail, "already absent");
    let api = a.at("/run/secrets/new/api");
    assert_eq!(fs::read(&api).expect("rotated"), b"fresh\0token");
    assert_eq!(
        fs::metadata(&api).expect("meta").permissions().mode() & 0o777,
        0o600
    );
    // The old file at the old path is untouched: rotate writes its path.
    assert!(a.at("/run/secrets/api").exists());

    // Contract and facts.
    assert_eq!(
        fs::read_to_string(a.at("/run/tine/contract.toml")).expect("contract"),
        "randomness = \"secure\"\n"
    );
    assert_eq!(
        fs::read_to_string(a.at("/run/tine/wake.env")).expect("wake.env"),
        "TINE_VM_ID=web-3\nTINE_PARENT_ID=web\nTINE_ROLE=child\nTINE_HOSTNAME=web-3\n\
         TINE_IP=10.213.0.5\nTINE_MAC=52:54:00:12:34:56\nTINE_RANDOMNESS=secure\n"
    );
    assert!(!a.at("/run/tine/seed").exists(), "secure wrote a seed");

    // Hooks: revoke hook first (secrets come before hooks), then wake.d by
    // name, each with the facts; the failing one does not stop the rest.
    let facts = "web-3 web child web-3 10.213.0.5 52:54:00:12:34:56 secure";
    assert_eq!(
        fs::read_to_string(&log).expect("log"),
        format!("revoke db db\n10 {facts}\n20 {facts}\n40 {facts}\n")
    );
}

#[test]
fn test_reproducible_writes_seed_and_keeps_time() {
    let a = Sandbox::start();
    let mut w = base_wake();
    w.randomness = Randomness::Reproducible;
    w.host_time_ns = None;
    w.entropy_hex = "00ff".repeat(16);
    w.machine_id = None;
    w.net = None;
    w.run_hooks = false;
    w.role = Role::Boot;
    w.parent_id = None;
    let r = a.wake(w);
    assert!(r.randomness_ok);
    assert_eq!(
        fs::read_to_string(a.at("/run/tine/seed")).expect("seed"),
        "00ff".repeat(16)
    );
    assert_eq!(step(&r, "clock").detail, "virtual time kept");
    assert_eq!(step(&r, "machine_id").status, StepStatus::Skipped);
    assert_eq!(step(&r, "network").status, StepStatus::Skipped);
    assert!(!names(&r).iter().any(|n| n.starts_with("hook")));
    assert!(!a.at("/etc/machine-id").exists());
    let env = fs::read_to_string(a.at("/run/tine/wake.env")).expect("wake.env");
    assert!(env.contains("TINE_PARENT_ID=''\n"), "{env}");
    assert!(
        env.contains("TINE_ROLE=boot\nTINE_HOSTNAME=web-3\nTINE_IP=''\n"),
        "{env}"
    );
}

#[test]
fn test_bad_entropy_fails_closed_and_a_retry_thaws() {
    let a = Sandbox::start();
    assert_eq!(a.quiesce(60_000).method, "sandbox");
    for bad in ["zz", "abc", ""] {
        let mut w = base_wake();
        w.entropy_hex = bad.into();
        let r = a.wake(w);
        assert!(!r.randomness_ok, "{bad:?}: {r:#?}");
        assert_eq!(names(&r), ["randomness", "thaw"], "{bad:?}");
        assert_eq!(step(&r, "randomness").status, StepStatus::Failed);
        assert!(step(&r, "randomness").detail.contains("entropy_hex"));
        let thaw = step(&r, "thaw");
        assert_eq!(thaw.status, StepStatus::Skipped);
        assert!(thaw.detail.contains("fail closed"), "{thaw:?}");
    }
    // Nothing after randomness ran.
    assert!(!a.at("/etc/hostname").exists());
    assert!(!a.at("/run/tine").exists());
    // The freeze is still held: a good wake thaws it.
    let r = a.wake(base_wake());
    assert!(r.randomness_ok);
    let thaw = step(&r, "thaw");
    assert_eq!(thaw.status, StepStatus::Ok, "{thaw:?}");
    assert_eq!(thaw.detail, "thawed 0 processes (sandbox)");
}

#[test]
fn test_bad_input_is_a_failed_step() {
    let a = Sandbox::start();
    a.put("/run/secrets/x", "old", 0o600);
    a.put("/etc/tine/wake.d/slow", "#!/bin/sh\nsleep 30\n", 0o755);
    let mut w = base_wake();
    w.hostname = "bad host/name".into();
    w.machine_id = Some("0123".into());
    w.net = Some(WakeNet {
        interface: None,
        mac: "52:54:00:12:34".into(),
        ip: "10.213.0.5/24".into(),
        gateway: "10.213.0.1".into(),
    });
    w.hook_timeout_ms = 300;
    w.secrets = vec![
        WakeSecret {
            name: "rel".into(),
            path: "run/secrets/x".into(),
            action: SecretAction::Keep,
        },
        WakeSecret {
            name: "up".into(),
            path: "/run/../etc/passwd".into(),
            action: SecretAction::Revoke { hook: None },
        },
        WakeSecret {
            name: "hex".into(),
            path: "/run/secrets/x".into(),
            action: SecretAction::Rotate {
                value_hex: "xyz".into(),
            },
        },
        WakeSecret {
            name: "hookless".into(),
            path: "/run/secrets/x".into(),
            action: SecretAction::Revoke {
                hook: Some("/no/such/hook".into()),
            },
        },
    ];
    let t = Instant::now();
    let r = a.wake(w);
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "the hook timeout did not hold"
    );
    assert!(r.randomness_ok);
    let failed: Vec<&str> = r.failed().map(|s| s.name.as_str()).collect();
    assert_eq!(
        failed,
        [
            "hostname",
            "machine_id",
            "network",
            "secret:rel",
            "secret:up",
            "secret:hex",
            "secret:hookless",
            "hook:slow"
        ],
        "{r:#?}"
    );
    assert!(step(&r, "secret:rel")
        .detail
        .contains("not an absolute path"));
    assert!(step(&r, "secret:up").detail.contains(".."));
    assert!(step(&r, "secret:hex").detail.contains("not valid hex"));
    let hookless = &step(&r, "secret:hookless").detail;
    assert!(
        hookless.contains("revoked") && hookless.contains("cannot run hook /no/such/hook"),
        "{hookless}"
    );
    assert!(!a.at("/run/secrets/x").exists());
    assert!(step(&r, "hook:slow")
        .detail
        .starts_with("timed out after 300 ms"));
    assert!(step(&r, "network").detail.contains("not a MAC address"));
    // The good steps still ran.
    assert_eq!(step(&r, "contract").status, StepStatus::Ok);
    assert!(!a.at("/etc/hostname").exists());
}

#[test]
fn test_quiesce_wake_roundtrip_and_watchdog() {
    let a = Sandbox::start();
    let q = a.quiesce(60_000);
    assert_eq!((q.method.as_str(), q.processes), ("sandbox", 0));
    // Quiescing again only moves the deadline.
    assert_eq!(a.quiesce(60_000).method, "sandbox");
    let r = a.wake(base_wake());
    assert_eq!(step(&r, "thaw").status, StepStatus::Ok);
    let r = a.wake(base_wake());
    assert_eq!(step(&r, "thaw").detail, "not quiesced");

    // The watchdog thaws on its own after the timeout...
    a.quiesce(200);
    std::thread::sleep(Duration::from_millis(600));
    let r = a.wake(base_wake());
    assert_eq!(
        step(&r, "thaw").detail,
        "not quiesced",
        "watchdog did not thaw"
    );
    // ...unless a second Quiesce moved the deadline.
    a.quiesce(200);
    a.quiesce(60_000);
    std::thread::sleep(Duration::from_millis(600));
    let r = a.wake(base_wake());
    assert_eq!(step(&r, "thaw").status, StepStatus::Ok, "{r:#?}");
}

#[test]
fn test_exec_after_quiesce_in_sandbox_still_runs() {
    // The sandbox never sets up the workload cgroup, so Exec is unchanged.
    let a = Sandbox::start();
    a.quiesce(60_000);
    let mut out = Vec::new();
    let exit = protocol::exec(
        &mut a.conn(),
        protocol::ExecRequest::new(["sh", "-c", "echo hi"]),
        None::<std::io::Empty>,
        &mut out,
        &mut std::io::sink(),
    )
    .expect("exec");
    assert_eq!(exit.code, Some(0));
    assert_eq!(out, b"hi\n");
}

/// The effects gateway's CA (a contract with `effects.https =
/// "intercept"`): written for update-ca-certificates and added to the
/// bundle once; a child that has it already is left alone; junk is a
/// failed step, not a trust-store entry.
#[test]
fn test_gateway_ca_goes_into_the_trust_store_once() {
    let a = Sandbox::start();
    let bundle = "/etc/ssl/certs/ca-certificates.crt";
    a.put(
        bundle,
        "-----BEGIN CERTIFICATE-----\nSYSTEM\n-----END CERTIFICATE-----\n",
        0o644,
    );
    let pem = "-----BEGIN CERTIFICATE-----\nTINECA\n-----END CERTIFICATE-----\n";
    let w = Wake {
        ca_pem: Some(pem.into()),
        ..base_wake()
    };
    let r = a.wake(w.clone());
    let s = step(&r, "ca");
    assert_eq!(s.status, StepStatus::Ok, "{s:?}");
    let file = "/usr/local/share/ca-certificates/tine-effects.crt";
    assert_eq!(fs::read_to_string(a.at(file)).expect("ca file"), pem);
    let b = fs::read_to_string(a.at(bundle)).expect("bundle");
    assert!(b.starts_with("-----BEGIN CERTIFICATE-----\nSYSTEM"), "{b}");
    assert_eq!(b.matches("TINECA").count(), 1, "{b}");
    let r = a.wake(w);
    assert_eq!(
        step(&r, "ca").status,
        StepStatus::Skipped,
        "installed already"
    );
    let b = fs::read_to_string(a.at(bundle)).expect("bundle");
    assert_eq!(b.matches("TINECA").count(), 1, "not added twice: {b}");
    let r = a.wake(Wake {
        ca_pem: Some("#!/bin/sh\nrm -rf /\n".into()),
        ..base_wake()
    });
    assert_eq!(step(&r, "ca").status, StepStatus::Failed);
    let r = a.wake(base_wake());
    assert_eq!(step(&r, "ca").status, StepStatus::Skipped, "not asked for");
}

#[test]
fn test_a_copy_gets_new_ssh_host_keys_dbus_id_and_no_random_seed() {
    let a = Sandbox::start();
    // An image's identity, as a clone inherits it.
    fs::create_dir_all(a.at("/etc/ssh")).expect("mkdir");
    let st = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(a.at("/etc/ssh/ssh_host_ed25519_key"))
        .status()
        .expect("ssh-keygen (openssh-client) is installed by scripts/setup");
    assert!(st.success());
    let old_pub = fs::read_to_string(a.at("/etc/ssh/ssh_host_ed25519_key.pub")).expect("pub");
    a.put(
        "/var/lib/dbus/machine-id",
        "ffffffffffffffffffffffffffffffff\n",
        0o444,
    );
    a.put("/var/lib/systemd/random-seed", "the parent's seed", 0o600);
    let r = a.wake(base_wake());
    let s = step(&r, "identity");
    assert_eq!(s.status, StepStatus::Ok, "{s:?}");
    let new_pub = fs::read_to_string(a.at("/etc/ssh/ssh_host_ed25519_key.pub")).expect("new pub");
    assert_ne!(old_pub, new_pub, "the host key was not renewed");
    // The reported fingerprint is ssh-keygen's own.
    let shown = std::process::Command::new("ssh-keygen")
        .arg("-lf")
        .arg(a.at("/etc/ssh/ssh_host_ed25519_key.pub"))
        .output()
        .expect("ssh-keygen -l");
    let shown = String::from_utf8_lossy(&shown.stdout);
    let print = shown.split_whitespace().nth(1).expect("fingerprint");
    assert!(s.detail.contains(print), "{} lacks {print}", s.detail);
    assert_eq!(
        fs::read_to_string(a.at("/var/lib/dbus/machine-id")).expect("dbus"),
        "0123456789abcdef0123456789abcdef\n"
    );
    assert!(
        !a.at("/var/lib/systemd/random-seed").exists(),
        "the seed was kept"
    );
    // A copy whose contract keeps the machine id keeps the rest too.
    let r = a.wake(Wake {
        machine_id: None,
        ..base_wake()
    });
    assert_eq!(step(&r, "identity").status, StepStatus::Skipped);
}
