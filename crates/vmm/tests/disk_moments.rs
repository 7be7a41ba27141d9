//! A vm with a disk through its moments (micro guest `blkio`, which
//! writes and reads its virtio-blk disk): a failed snapshot or fork
//! leaves it writable as it was, and folding freed layers into its top
//! keeps its chain short across many forks.

mod micro;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use micro::{config, scratch, Console, VmmProcess};
use vmm::api::{Identity, Request};
use vmm::config::DiskConfig;

const DISK_MIB: u64 = 16;

/// The checksum blkio prints for `write <block> <seed>`.
fn block_sum(block: u64, seed: u64) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let base = block * 4096;
    for o in (base..base + 4096).step_by(8) {
        for b in ((o ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

/// A raw base of DISK_MIB MiB and a qcow2 top on it; returns the top.
fn disk_chain(dir: &Path) -> PathBuf {
    let base = dir.join("base.raw");
    let f = std::fs::File::create(&base).expect("base");
    f.set_len(DISK_MIB << 20).expect("size");
    let top = dir.join("vm-disk0.qcow2");
    disk::create_overlay(&base, &top).expect("overlay");
    top
}

fn identity(dir: &Path, name: &str) -> Identity {
    Identity {
        name: name.into(),
        console_log: dir.join(format!("{name}.log")),
        console_socket: Some(dir.join(format!("{name}.sock"))),
        log: dir.join(format!("{name}.vmm.log")),
        api_socket: dir.join(format!("{name}.api")),
        exit_file: dir.join(format!("{name}.exit.json")),
        disks: vec![dir.join(format!("{name}-disk0.qcow2"))],
        ..Identity::default()
    }
}

/// Boots blkio on `top` as `name`.
fn boot(dir: &Path, name: &str, top: &Path) -> (VmmProcess, Console) {
    let console = Console::in_dir(dir, name);
    let mut cfg = config(guests::blkio_path(), 64, &console);
    cfg.disks = vec![DiskConfig {
        path: top.into(),
        read_only: false,
    }];
    let p = VmmProcess::spawn(dir, name, move || vmm::build(&cfg).expect("build"));
    console.wait_nth("READY", 1);
    let disk = console.wait_nth("DISK", 1);
    assert_eq!(disk, format!("DISK {}", (DISK_MIB << 20) / 512));
    (p, console)
}

/// `write <block> <seed>` (the n-th WROTE/ERR line): the reply.
fn write(c: &Console, block: u64, seed: u64) -> String {
    let n = c
        .lines()
        .iter()
        .filter(|l| l.starts_with("WROTE") || l.starts_with("ERR"))
        .count();
    c.send(&format!("write {block} {seed}"));
    let deadline = Instant::now() + micro::WAIT;
    loop {
        let replies: Vec<String> = c
            .lines()
            .into_iter()
            .filter(|l| l.starts_with("WROTE") || l.starts_with("ERR"))
            .collect();
        if replies.len() > n {
            return replies[n].clone();
        }
        assert!(Instant::now() < deadline, "no reply: {}", c.text());
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn read(c: &Console, block: u64) -> String {
    let n = c.lines().iter().filter(|l| l.starts_with("READ")).count();
    c.command(&format!("read {block}"), "READ", n + 1)
}

#[test]
fn test_blkio_writes_and_reads_its_disk() {
    let dir = scratch("diskm", "blkio");
    let top = disk_chain(&dir);
    let (p, c) = boot(&dir, "vm", &top);
    assert_eq!(write(&c, 3, 7), format!("WROTE 3 SUM {}", block_sum(3, 7)));
    assert_eq!(read(&c, 3), format!("READ 3 SUM {}", block_sum(3, 7)));
    assert_eq!(read(&c, 4), format!("READ 4 SUM {}", zero_sum()));
    micro::kill(p.pid);
    let _ = p.wait(Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(dir);
}

fn zero_sum() -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for _ in 0..4096 {
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Sets the soft RLIMIT_NOFILE of `pid`; returns the old soft limit.
fn set_nofile(pid: u32, soft: u64) -> u64 {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: prlimit(2) reads the old limits into a valid struct.
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            std::ptr::null(),
            &mut old,
        )
    };
    assert_eq!(rc, 0, "prlimit get: {}", std::io::Error::last_os_error());
    let new = libc::rlimit {
        rlim_cur: soft,
        rlim_max: old.rlim_max,
    };
    // SAFETY: as above, setting from a valid struct.
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &new,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, 0, "prlimit set: {}", std::io::Error::last_os_error());
    old.rlim_cur
}

fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count() as u64)
        .unwrap_or(0)
}

fn files_in(dir: &Path) -> usize {
    std::fs::read_dir(dir).map(|d| d.count()).unwrap_or(0)
}

/// Tries a snapshot of the vm at `api` (pid `pid`) with only `extra` fds
/// free; returns the error, if it failed.
fn snapshot_with_fds(dir: &Path, api: &Path, pid: u32, extra: u64, i: usize) -> Option<String> {
    let old = set_nofile(pid, open_fds(pid) + extra);
    let r = vmm::api::call(
        api,
        &Request::Snapshot {
            dir: dir.join(format!("snap{i}")),
            layers_dir: dir.join("layers"),
            contract: None,
        },
        micro::WAIT,
    );
    set_nofile(pid, old);
    let r = r.expect("the VMM answers");
    r.reply.error.clone()
}

/// Every failure after the pause (no fd for the new top layer, for its
/// chain, for the pipe to the zygote or to the continuation) leaves the
/// vm exactly as it was: its disk writable on the same chain, no frozen
/// layer left behind, and an error reply that says so.
#[test]
fn test_a_failed_moment_leaves_the_vm_writable() {
    let dir = scratch("diskm", "fail");
    let top = disk_chain(&dir);
    let layers = dir.join("layers");
    std::fs::create_dir_all(&layers).expect("layers dir");
    let (p, c) = boot(&dir, "vm", &top);
    let mut written = vec![(1u64, 1u64)];
    assert!(write(&c, 1, 1).starts_with("WROTE 1"));
    let check = |c: &Console, written: &[(u64, u64)]| {
        for &(b, s) in written {
            assert_eq!(read(c, b), format!("READ {b} SUM {}", block_sum(b, s)));
        }
    };

    // A booted vm (shared RAM, the continuation is a new process).
    let mut failures = 0;
    for extra in [1, 2, 3] {
        let depth = disk::chain(&top).expect("chain").len();
        let files = files_in(&layers);
        let Some(e) = snapshot_with_fds(&dir, &p.api, p.pid as u32, extra, 0) else {
            panic!("a snapshot with {extra} free fds succeeded: the test needs a failure");
        };
        assert!(e.contains("runs on unchanged"), "{e}");
        failures += 1;
        assert_eq!(disk::chain(&top).expect("chain").len(), depth, "{e}");
        assert_eq!(files_in(&layers), files, "{e}");
        let b = 10 + extra;
        assert!(write(&c, b, extra).starts_with("WROTE"), "after {e}");
        written.push((b, extra));
        check(&c, &written);
    }

    // Its first fork moves it to a continuation with private RAM, which
    // goes on in place from then on.
    let r = p
        .call(&Request::Fork {
            children: vec![identity(&dir, "c0")],
            layers_dir: layers.clone(),
        })
        .expect("fork");
    let vm = r.continuation_pid.expect("continuation");
    micro::kill(r.children[0] as i32);
    let _ = p.wait(Duration::from_secs(10));
    let mut ok = 0;
    for (i, extra) in (1..=12).enumerate() {
        let depth = disk::chain(&top).expect("chain").len();
        let files = files_in(&layers);
        match snapshot_with_fds(&dir, &p.api, vm, extra, i + 1) {
            Some(e) => {
                failures += 1;
                assert!(e.contains("runs on unchanged"), "{extra} fds: {e}");
                assert_eq!(disk::chain(&top).expect("chain").len(), depth, "{e}");
                assert_eq!(files_in(&layers), files, "{e}");
                println!("{extra} free fds: {e}");
            }
            None => {
                ok += 1;
                assert_eq!(disk::chain(&top).expect("chain").len(), depth + 1);
            }
        }
        let b = 30 + extra;
        assert!(write(&c, b, extra).starts_with("WROTE"), "{extra} fds");
        written.push((b, extra));
        check(&c, &written);
    }
    assert!(
        failures > 4 && ok > 0,
        "{failures} failures, {ok} snapshots"
    );
    // The guest's data reads the same through the whole chain.
    c.command("flush", "FLUSHED", 1);
    micro::kill(vm as i32);
    let _ = std::fs::remove_dir_all(dir);
}
