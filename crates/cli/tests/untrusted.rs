//! Snapshot directories are untrusted input (they move between hosts) and
//! the host is closed to other users: each finding of issue 16 as a test
//! on micro guests. A snapshot is edited the way an attacker would, with
//! its seal recomputed (the seal is a checksum unless a host key is
//! configured), so the checks behind the seal are what is tested.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use common::procs::pids_group;
use common::{kvm_available, Home, TempDir};

fn console(h: &Home, vm: &str) -> String {
    std::fs::read_to_string(h.0.path().join("vms").join(vm).join("console.log")).unwrap_or_default()
}

fn wait_console(h: &Home, vm: &str, needle: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !console(h, vm).contains(needle) {
        assert!(Instant::now() < deadline, "{vm} never printed {needle:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn err(h: &Home, args: &[&str]) -> String {
    let out = h.out(args);
    assert!(!out.status.success(), "tine {args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A copy of snapshot `good` in `dir/name`, with `edit` applied to its
/// manifest and its state's payload (as JSON), sealed again unkeyed.
fn forged(
    good: &Path,
    dir: &Path,
    name: &str,
    edit: impl Fn(&mut serde_json::Value, &mut serde_json::Value),
) -> std::path::PathBuf {
    let d = dir.join(name);
    std::fs::create_dir_all(&d).expect("mkdir");
    std::fs::copy(good.join("memory"), d.join("memory")).expect("memory");
    let text = std::fs::read(good.join("manifest.json")).expect("manifest");
    let state = std::fs::read(good.join("state")).expect("state");
    let mut moment: serde_json::Value =
        snapshot::decode_sealed(&state, &snapshot::Seal::of_manifest(&text, None)).expect("state");
    let mut manifest: serde_json::Value = serde_json::from_slice(&text).expect("json");
    edit(&mut manifest, &mut moment);
    let text = serde_json::to_vec_pretty(&manifest).expect("json");
    let state =
        snapshot::encode_sealed(&moment, &snapshot::Seal::of_manifest(&text, None)).expect("seal");
    std::fs::write(d.join("state"), state).expect("state");
    std::fs::write(d.join("manifest.json"), text).expect("manifest");
    d
}

#[test]
fn test_forged_snapshots_are_refused_before_anything_runs() {
    if !kvm_available() {
        return;
    }
    let h = Home::new("untrusted");
    let dir = TempDir::new("untrusteddir");
    h.ok(&[
        "run",
        "--name",
        "m",
        "--image",
        "micro-memtouch",
        "--mem",
        "64M",
    ]);
    wait_console(&h, "m", "READY");
    let good = dir.path().join("good");
    h.ok(&["snapshot", "m", "--to", good.to_str().expect("utf8")]);
    let run_from = |d: &Path| {
        let name = d.file_name().and_then(|n| n.to_str()).expect("name");
        err(
            &h,
            &["run", "--name", name, "--from", d.to_str().expect("utf8")],
        )
    };

    // The manifest edited without its seal: the state names another one.
    let d = dir.path().join("edited");
    std::fs::create_dir_all(&d).expect("mkdir");
    for f in ["memory", "state", "manifest.json"] {
        std::fs::copy(good.join(f), d.join(f)).expect("copy");
    }
    let p = d.join("manifest.json");
    let text = std::fs::read_to_string(&p).expect("manifest");
    std::fs::write(&p, text.replace("\"mem_mib\": 64", "\"mem_mib\": 65")).expect("write");
    let e = run_from(&d);
    assert!(e.contains("manifest.json was altered"), "{e}");

    // A newer format, in the manifest and in the state's header.
    let d = forged(&good, dir.path(), "newer", |m, _| {
        m["format_version"] = "99.0".into()
    });
    let e = run_from(&d);
    assert!(e.contains("format 99.0"), "{e}");
    let d = dir.path().join("v2");
    std::fs::create_dir_all(&d).expect("mkdir");
    for f in ["memory", "state", "manifest.json"] {
        std::fs::copy(good.join(f), d.join(f)).expect("copy");
    }
    let mut b = std::fs::read(d.join("state")).expect("state");
    b[8..12].copy_from_slice(&2u32.to_le_bytes());
    std::fs::write(d.join("state"), b).expect("write");
    let e = run_from(&d);
    assert!(e.contains("State format 2.0 cannot be read"), "{e}");

    // Machines a boot would refuse.
    for (name, vcpus) in [("vcpus0", 0), ("vcpus64", 64)] {
        let d = forged(&good, dir.path(), name, |m, s| {
            m["vcpus"] = vcpus.into();
            let v = s["machine"]["vcpus"].as_array_mut().expect("vcpus");
            let one = v[0].clone();
            v.clear();
            v.extend(std::iter::repeat_n(one, vcpus));
        });
        let e = run_from(&d);
        assert!(e.contains(&format!("{vcpus} vCPUs")), "{name}: {e}");
    }
    let d = forged(&good, dir.path(), "huge", |m, s| {
        m["mem_mib"] = (1u64 << 20).into();
        s["mem_mib"] = (1u64 << 20).into();
    });
    let e = run_from(&d);
    assert!(e.contains("1048576 MiB of memory"), "{e}");
    let d = forged(&good, dir.path(), "unknown", |m, _| {
        m["run_this"] = "id".into()
    });
    let e = run_from(&d);
    assert!(e.contains("unknown field `run_this`"), "{e}");
    let d = forged(&good, dir.path(), "unknownstate", |_, s| {
        s["machine"]["extra"] = 1.into()
    });
    let e = run_from(&d);
    assert!(e.contains("Cannot decode state"), "{e}");

    // A contract whose rotate provider would run a command on the host.
    let pwned = dir.path().join("PWNED");
    let d = forged(&good, dir.path(), "provider", |m, _| {
        m["contract"] = format!(
            "[secrets.token]\npath = \"/run/t\"\non_fork = \"rotate\"\nprovider = \"id > {}\"\n",
            pwned.display()
        )
        .into();
    });
    let e = run_from(&d);
    assert!(e.contains("is not one this host runs"), "{e}");
    assert!(!pwned.exists(), "the provider ran");

    let rows = h.ls();
    assert_eq!(rows.len(), 1, "only m: {rows:?}");
}

/// Runs micro guest `image` as `name` (64 MiB) with a fresh 8 MiB raw disk
/// in `dir`, and waits for `ready` on its console.
fn run_with_disk(h: &Home, dir: &Path, name: &str, image: &str, ready: &str) {
    let disk = dir.join(format!("{name}.raw"));
    std::fs::File::create(&disk)
        .and_then(|f| f.set_len(8 << 20))
        .expect("disk");
    h.ok(&[
        "run",
        "--name",
        name,
        "--image",
        image,
        "--mem",
        "64M",
        "--disk",
        disk.to_str().expect("utf8"),
    ]);
    wait_console(h, name, ready);
}

#[test]
fn test_a_snapshot_cannot_name_a_host_file_as_its_disk() {
    if !kvm_available() {
        return;
    }
    let h = Home::new("untrusteddisk");
    let dir = TempDir::new("untrusteddiskdir");
    run_with_disk(&h, dir.path(), "d", "micro-memtouch", "READY");
    let good = dir.path().join("good");
    h.ok(&["snapshot", "d", "--to", good.to_str().expect("utf8")]);
    // The snapshot as taken restores (its disk is a frozen layer in the home).
    h.ok(&[
        "run",
        "--name",
        "ok",
        "--from",
        good.to_str().expect("utf8"),
    ]);
    let secret = dir.path().join("host-secret");
    std::fs::write(&secret, vec![b's'; 8 << 20]).expect("secret");
    let d = forged(&good, dir.path(), "shadow", |m, _| {
        m["disks"][0]["path"] = secret.to_str().expect("utf8").into();
        m["disks"][0]["frozen"] = false.into();
    });
    let e = err(
        &h,
        &[
            "run",
            "--name",
            "shadow",
            "--from",
            d.to_str().expect("utf8"),
        ],
    );
    assert!(e.contains("which is not a disk file under"), "{e}");
}

#[test]
fn test_the_home_is_closed_to_other_users_whatever_the_umask() {
    if !kvm_available() {
        return;
    }
    let h = Home::new("closed");
    let dir = TempDir::new("closeddir");
    // SAFETY: umask(2) only changes this process's mask; the tine
    // processes started below inherit it, as a careless shell would give.
    let old = unsafe { libc::umask(0) };
    h.ok(&[
        "run",
        "--name",
        "c",
        "--image",
        "micro-memtouch",
        "--mem",
        "64M",
    ]);
    wait_console(&h, "c", "READY");
    let snap = dir.path().join("snap");
    h.ok(&["snapshot", "c", "--to", snap.to_str().expect("utf8")]);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    let mode = |p: &Path| {
        std::fs::symlink_metadata(p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode(h.0.path()), 0o700, "TINE_HOME");
    let vm = h.0.path().join("vms/c");
    for f in ["api.sock", "console.log", "vmm.log", "vm.json"] {
        assert_eq!(mode(&vm.join(f)) & 0o077, 0, "{f} is open to others");
    }
    for f in ["memory", "state", "manifest.json"] {
        assert_eq!(
            mode(&snap.join(f)) & 0o077,
            0,
            "snapshot {f} is open to others"
        );
    }
    assert_eq!(
        mode(&h.0.path().join("tined.sock")) & 0o077,
        0,
        "tined.sock"
    );

    // Even with the modes opened by hand, the sockets check who connects.
    let setpriv = "setpriv";
    let open = |p: &Path, m: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).expect("chmod")
    };
    open(h.0.path(), 0o755);
    open(&h.0.path().join("vms"), 0o755);
    // `vms/c` leads to the vm's directory in its tree's (`t/TREE/c`).
    let real = std::fs::canonicalize(&vm).expect("the vm's directory");
    for d in real.ancestors().skip(1).take(2) {
        open(d, 0o755);
    }
    open(&vm, 0o755);
    open(&vm.join("api.sock"), 0o777);
    open(&h.0.path().join("tined.sock"), 0o777);
    let as_nobody = |script: &str| {
        std::process::Command::new(setpriv)
            .args([
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "sh",
                "-c",
                script,
            ])
            .output()
            .expect("setpriv")
    };
    let out = as_nobody(&format!(
        "curl -sS --max-time 5 --unix-socket {} http://t/v1/vms",
        h.0.path().join("tined.sock").display()
    ));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success() && !said.contains("\"c\""),
        "nobody listed the vms through tined.sock: {said}"
    );
    let out = as_nobody(&format!(
        "echo '{{\"op\":\"ping\"}}' | socat -t 15 - UNIX-CONNECT:{}",
        vm.join("api.sock").display()
    ));
    let reply = String::from_utf8_lossy(&out.stdout);
    assert!(
        reply.contains("may not use this vm's sockets"),
        "nobody pinged the VMM: {reply:?} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Nor type on its console (a Linux guest's vsock.sock is refused the
    // same way: crates/vmm's vsock tests).
    open(&vm.join("console.sock"), 0o777);
    let out = as_nobody(&format!(
        "echo 'ping' | socat -t 2 - UNIX-CONNECT:{}",
        vm.join("console.sock").display()
    ));
    let log_says = |what: &str| {
        std::fs::read_to_string(vm.join("vmm.log"))
            .unwrap_or_default()
            .contains(what)
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !log_says("console socket: refusing a connection: uid 65534") {
        assert!(
            Instant::now() < deadline,
            "nobody's console connection was not refused: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The owner still can.
    h.ok(&["fork", "c", "-n", "1"]);
}

/// Bytes allocated on disk under `dir` (symlinks not followed).
fn disk_use(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    for e in entries.flatten() {
        let Ok(m) = std::fs::symlink_metadata(e.path()) else {
            continue;
        };
        total += m.blocks() * 512;
        if m.is_dir() {
            total += disk_use(&e.path());
        }
    }
    total
}

fn ping(sock: &Path) -> Result<Duration, String> {
    use std::io::{BufRead, Write};
    let t = Instant::now();
    let mut s = std::os::unix::net::UnixStream::connect(sock).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    s.write_all(b"{\"op\":\"ping\"}\n")
        .map_err(|e| e.to_string())?;
    let mut line = String::new();
    std::io::BufReader::new(&s)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    if line.contains("\"error\":null") || !line.contains("error") {
        Ok(t.elapsed())
    } else {
        Err(line)
    }
}

#[test]
fn test_a_guest_flooding_its_devices_cannot_fill_the_disk_or_stall_the_vmm() {
    if !kvm_available() {
        return;
    }
    let h = Home::new("flood");
    let dir = TempDir::new("flooddir");
    run_with_disk(&h, dir.path(), "f", "micro-blkio", "DISK ");
    let before = disk_use(h.0.path());
    h.ok(&["console", "f", "--send", "flood 10"]);
    // An idle client holds a connection open throughout: it must not
    // stall the others.
    let api = h.0.path().join("vms/f/api.sock");
    let _idle = std::os::unix::net::UnixStream::connect(&api).expect("idle client");
    let t0 = Instant::now();
    let mut worst = Duration::ZERO;
    let mut pings = 0;
    while t0.elapsed() < Duration::from_secs(9) {
        let took =
            ping(&api).unwrap_or_else(|e| panic!("the VMM did not answer during the flood: {e}"));
        worst = worst.max(took);
        pings += 1;
        std::thread::sleep(Duration::from_millis(250));
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !console(&h, "f").contains("FLOODED")
        && !std::fs::read_to_string(h.0.path().join("vms/f/console.log.1"))
            .unwrap_or_default()
            .contains("FLOODED")
    {
        assert!(Instant::now() < deadline, "the flood never ended");
        std::thread::sleep(Duration::from_millis(100));
    }
    let grew = disk_use(h.0.path()).saturating_sub(before);
    eprintln!("flood: {pings} pings, slowest {worst:?}; the home grew {grew} bytes");
    assert!(worst < Duration::from_secs(2), "a ping took {worst:?}");
    assert!(
        grew < 1 << 20,
        "the home grew {grew} bytes during the flood"
    );
    // (The UART moves ~16 KB/s here, so the console's cap is not reached
    // in 10 s; crates/vmm's serial tests fill it directly.)
    let log = std::fs::read_to_string(h.0.path().join("vms/f/vmm.log")).unwrap_or_default();
    assert!(
        log.lines().count() < 100,
        "vmm.log has {} lines",
        log.lines().count()
    );
    // The vm goes on: it still answers on its console.
    let from = console(&h, "f").len();
    h.ok(&["console", "f", "--send", "ping"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !console(&h, "f").get(from..).unwrap_or("").contains("PONG") {
        assert!(Instant::now() < deadline, "no PONG after the flood");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A field of /proc/PID/status.
fn status_field(pid: u32, field: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")))
        .unwrap_or_else(|| panic!("no {field} in the status of {pid}"))
        .trim()
        .to_string()
}

fn pid_of(h: &Home, vm: &str) -> u32 {
    h.ls()
        .iter()
        .find(|v| v["name"] == vm)
        .and_then(|v| v["pid"].as_u64())
        .unwrap_or_else(|| panic!("{vm} has no pid")) as u32
}

#[test]
fn test_every_vmm_runs_jailed_in_its_own_cgroup_and_rm_ends_what_it_holds() {
    if !kvm_available() {
        return;
    }
    let h = Home::new("jail");
    h.ok(&[
        "run",
        "--name",
        "a",
        "--image",
        "micro-counter",
        "--mem",
        "128M",
    ]);
    h.ok(&["fork", "a", "--names", "b"]);
    h.ok(&[
        "run",
        "--name",
        "other",
        "--image",
        "micro-counter",
        "--mem",
        "64M",
    ]);
    let (a, b) = (pid_of(&h, "a"), pid_of(&h, "b"));
    for (vm, pid) in [("a", a), ("b", b)] {
        // No capability (no --net), no new privileges, seccomp filtering.
        assert_eq!(status_field(pid, "CapEff"), "0000000000000000", "{vm}");
        assert_eq!(status_field(pid, "CapBnd"), "0000000000000000", "{vm}");
        assert_eq!(status_field(pid, "NoNewPrivs"), "1", "{vm}");
        assert_eq!(status_field(pid, "Seccomp"), "2", "{vm}");
        // Not root: the tree's own uid and gid (real, effective, saved),
        // files reached as root's (fsuid 0), no supplementary groups.
        let uid = status_field(pid, "Uid");
        let ids: Vec<u32> = uid
            .split_whitespace()
            .map(|f| f.parse().expect("uid"))
            .collect();
        assert!(ids[0] >= 0x7A00_0000, "{vm} runs as {uid}");
        assert_eq!(ids, [ids[0], ids[0], ids[0], 0], "{vm}: Uid {uid}");
        assert_eq!(status_field(pid, "Gid"), uid, "{vm}");
        assert_eq!(status_field(pid, "Groups"), "", "{vm}");
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
        let line = |what: &str| {
            limits
                .lines()
                .find(|l| l.starts_with(what))
                .unwrap_or_default()
                .split_whitespace()
                .rev()
                .nth(1)
                .map(str::to_string)
        };
        assert_eq!(
            line("Max core file size").as_deref(),
            Some("0"),
            "{vm}: {limits}"
        );
        assert_eq!(
            line("Max open files").as_deref(),
            Some("4096"),
            "{vm}: {limits}"
        );
        // Its own mount, network, IPC and UTS namespaces (no tap: no
        // network at all), and a root without the host's files.
        for ns in ["mnt", "net", "ipc", "uts", "pid"] {
            let theirs = std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).expect("ns");
            let ours = std::fs::read_link(format!("/proc/self/ns/{ns}")).expect("ns");
            assert_ne!(theirs, ours, "{vm} shares the host's {ns} namespace");
        }
        let root = format!("/proc/{pid}/root");
        for absent in [
            "etc/shadow",
            "etc/passwd",
            "root/.ssh",
            "proc/1",
            "sys/fs/cgroup",
            "bin/sh",
        ] {
            assert!(
                !Path::new(&root).join(absent).exists(),
                "{vm}'s VMM sees /{absent}"
            );
        }
        // Of the home, its own tree's directory only: its vm's, its
        // sibling's (a fork child appears there by itself), and not
        // another tree's vm, the links of `vms/`, the frozen layers of
        // other trees, nor any of the home's state (the fleet database,
        // tined's socket, the store, intents, locks, the effects journal).
        let seen = |p: &Path| Path::new(&root).join(p.strip_prefix("/").expect("absolute"));
        let dir = |n: &str| std::fs::canonicalize(h.0.path().join("vms").join(n)).expect("vm dir");
        let own = dir(vm);
        assert!(
            seen(&own).is_dir(),
            "{vm}'s VMM does not see {}",
            own.display()
        );
        let sibling = dir(if vm == "a" { "b" } else { "a" });
        assert_eq!(
            sibling.parent(),
            own.parent(),
            "a fork child is in its parent's tree"
        );
        assert!(
            seen(&sibling).is_dir(),
            "{vm}'s VMM does not see {}",
            sibling.display()
        );
        let other = dir("other");
        assert_ne!(
            other.parent(),
            own.parent(),
            "a run makes a tree of its own"
        );
        assert!(!seen(&other).exists(), "{vm}'s VMM sees another tree's vm");
        for what in [
            "vms",
            "store",
            "intents",
            "locks",
            "effects",
            "fleet.db",
            "tined.sock",
        ] {
            let p = h.0.path().join(what);
            assert!(p.exists(), "no {what} in the home");
            assert!(!seen(&p).exists(), "{vm}'s VMM sees $TINE_HOME/{what}");
        }
        // Its tree's group (a fork child is born in it), with the limits
        // of the tree's two vms.
        let group = pids_group(pid);
        let tree = std::fs::canonicalize(h.0.path().join("vms").join(vm))
            .expect("vm dir")
            .parent()
            .and_then(|t| t.file_name())
            .map(|t| format!("_tree-{}", t.to_string_lossy()))
            .expect("a tree");
        assert!(group.ends_with(&tree), "{vm} runs in {}", group.display());
        let max = std::fs::read_to_string(group.join("pids.max")).expect("pids.max");
        assert_eq!(max.trim(), "2048", "{vm}: two vms' worth");
    }
    // A fork child keeps its tree's uid and PID namespace; another tree
    // has its own of both. In it, pid 1 is the tree's init, whose parent
    // is outside (no VMM is the init: a child outlives its parent).
    assert_eq!(status_field(a, "Uid"), status_field(b, "Uid"));
    let pid_ns = |pid: u32| std::fs::read_link(format!("/proc/{pid}/ns/pid")).expect("ns");
    assert_eq!(pid_ns(a), pid_ns(b));
    assert_ne!(pid_ns(a), pid_ns(pid_of(&h, "other")));
    for pid in [a, b] {
        let nspid = status_field(pid, "NSpid");
        let inner: u32 = nspid
            .split_whitespace()
            .last()
            .and_then(|p| p.parse().ok())
            .expect("NSpid");
        assert!(inner > 1, "a VMM is its namespace's pid {inner}");
    }
    let other = pid_of(&h, "other");
    let other_group = pids_group(other);
    let ppid: u32 = status_field(other, "PPid").parse().expect("PPid");
    let comm = std::fs::read_to_string(format!("/proc/{ppid}/comm")).unwrap_or_default();
    assert_eq!(comm.trim(), "tine-init", "the parent of a tree's first VMM");
    assert_eq!(
        status_field(ppid, "NSpid").split_whitespace().last(),
        Some("1"),
        "the tree's init is its namespace's pid 1"
    );
    assert_eq!(pid_ns(other), pid_ns(ppid));
    assert_ne!(
        status_field(a, "Uid"),
        status_field(pid_of(&h, "other"), "Uid")
    );
    h.ok(&["rm", "--force", "other"]);
    // A snapshot directory outside the home is mounted into the VMM's
    // namespace for the snapshot, and restores.
    let out = TempDir::new("jailsnap");
    let snap = out.path().join("b");
    h.ok(&["snapshot", "b", "--to", snap.to_str().expect("utf-8")]);
    h.ok(&[
        "run",
        "--name",
        "c",
        "--from",
        snap.to_str().expect("utf-8"),
    ]);
    wait_console(&h, "c", "CNT ");
    h.ok(&["rm", "--force", "c"]);
    let group = pids_group(a);
    assert_eq!(
        group,
        pids_group(b),
        "a and its child share their tree's group"
    );
    assert_ne!(group, other_group, "another tree has its own");
    // A process left in the tree's group (as a lost writer would be) ends
    // with the `rm` of the tree's last vm, and the group goes; the `rm`
    // of another lowers the group's limits to what is left.
    let mut stray = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .expect("sleep");
    std::fs::write(group.join("cgroup.procs"), stray.id().to_string()).expect("join the group");
    let out = h.ok(&["rm", "--force", "a"]);
    assert!(out.contains("removed"), "{out}");
    assert!(
        stray.try_wait().expect("wait").is_none(),
        "b's tree still runs"
    );
    let max = std::fs::read_to_string(group.join("pids.max")).expect("pids.max");
    assert_eq!(max.trim(), "1024", "one vm's worth is left");
    wait_console(&h, "b", "CNT ");
    h.ok(&["rm", "--force", "b"]);
    let t0 = Instant::now();
    let st = loop {
        if let Some(st) = stray.try_wait().expect("wait") {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "rm left a process of the tree's group running"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!st.success(), "{st:?}");
    assert!(!group.exists(), "{} is left", group.display());
}
