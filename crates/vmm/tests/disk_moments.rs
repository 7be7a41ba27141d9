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

/// Held while this process forks a VMM, and while it has a disk open
/// itself: a VMM forked meanwhile would inherit the open layers' fds, and
/// with them their locks, for as long as it runs.
static FORKING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn forking() -> std::sync::MutexGuard<'static, ()> {
    FORKING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Boots blkio on `top` as `name`.
fn boot(dir: &Path, name: &str, top: &Path) -> (VmmProcess, Console) {
    let console = Console::in_dir(dir, name);
    let mut cfg = config(guests::blkio_path(), 64, &console);
    cfg.disks = vec![DiskConfig {
        path: top.into(),
        read_only: false,
    }];
    let p = {
        let _forking = forking();
        VmmProcess::spawn(dir, name, move || vmm::build(&cfg).expect("build"))
    };
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

/// Bytes the files in `dir` occupy on the host.
fn disk_use(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if let Ok(m) = e.metadata() {
            total += if m.is_dir() {
                disk_use(&e.path())
            } else {
                m.blocks() * 512
            };
        }
    }
    total
}

/// Removes every file of vm `name` in `dir` (logs, sockets, its top).
fn remove_vm_files(dir: &Path, name: &str) {
    let prefix = format!("{name}.");
    let disk = format!("{name}-disk");
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with(&prefix) || n.starts_with(&disk) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn fold(api: &Path, layers: &[PathBuf]) -> Result<vmm::api::Reply, String> {
    let call = vmm::api::call(
        api,
        &Request::FoldLayers {
            layers: layers.to_vec(),
        },
        micro::WAIT,
    )
    .map_err(|e| e.to_string())?;
    match call.reply.error.clone() {
        Some(e) => Err(e),
        None => Ok(call.reply),
    }
}

/// 1,000 cycles of fork one child, remove it, fold the layer it freed
/// into the vm's top: the chain stays at two layers, the disk use stays
/// bounded, the guest's data reads back, and the top passes
/// `qemu-img check`. Folds work in the booted vm's continuation and in a
/// forked child too, and bad requests are refused.
#[test]
fn test_a_thousand_forks_fold_back_into_a_short_chain() {
    let cycles: usize = std::env::var("TINE_FOLD_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let dir = scratch("diskm", "fold");
    let top = disk_chain(&dir);
    let base = dir.join("base.raw");
    let layers = dir.join("layers");
    let (p, c) = boot(&dir, "vm", &top);
    let mut model = std::collections::BTreeMap::new();
    let mut fold_ms = Vec::new();
    let mut copied = 0u64;
    let mut max_use = 0u64;
    let t0 = Instant::now();
    for i in 0..cycles {
        // Within 1 MiB: each fold copies what the vm wrote (at most that).
        let block = (i as u64 * 7) % 255;
        assert!(write(&c, block, i as u64).starts_with("WROTE"), "cycle {i}");
        model.insert(block, i as u64);
        let name = format!("c{i}");
        let r = p
            .call(&Request::Fork {
                children: vec![identity(&dir, &name)],
                layers_dir: layers.clone(),
            })
            .unwrap_or_else(|e| panic!("fork {i}: {e}"));
        micro::kill(r.children[0] as i32);
        if i == 0 {
            let _ = p.wait(Duration::from_secs(10));
        }
        let chain: Vec<PathBuf> = disk::chain(&top)
            .expect("chain")
            .into_iter()
            .map(|l| l.path)
            .collect();
        assert_eq!(chain.len(), 3, "cycle {i}: {chain:?}");
        let freed = chain[1].clone();
        // The guest writes while the layer is folded.
        let before = c.lines().iter().filter(|l| l.starts_with("WROTE")).count();
        c.send(&format!("write {} {}", block + 1, i + 1));
        model.insert(block + 1, i as u64 + 1);
        let reply =
            fold(&p.api, std::slice::from_ref(&freed)).unwrap_or_else(|e| panic!("fold {i}: {e}"));
        c.wait_nth("WROTE", before + 1);
        let f = &reply.fold[0];
        assert_eq!(f.folded, vec![freed.clone()]);
        assert_eq!(f.depth, 2, "cycle {i}");
        fold_ms.push(f.ms);
        copied += f.bytes_copied;
        remove_vm_files(&dir, &name);
        std::fs::remove_file(&freed).expect("the folded layer can go");
        assert_eq!(disk::chain(&top).expect("chain").len(), 2);
        max_use = max_use.max(disk_use(&dir));
    }
    let elapsed = t0.elapsed();
    for (&b, &s) in &model {
        assert_eq!(read(&c, b), format!("READ {b} SUM {}", block_sum(b, s)));
    }
    c.command("flush", "FLUSHED", 1);
    let check = std::process::Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(&top)
        .output()
        .expect("qemu-img");
    let out = String::from_utf8_lossy(&check.stdout);
    assert!(check.status.success(), "qemu-img check: {out}");
    assert_eq!(
        disk::chain(&top).expect("chain")[1].path,
        std::fs::canonicalize(&base).expect("base")
    );
    // The top holds at most the whole disk, plus its metadata.
    assert!(
        max_use < (DISK_MIB + 4) << 20,
        "disk use up to {max_use} bytes"
    );
    fold_ms.sort_by(f64::total_cmp);
    println!(
        "{cycles} cycles in {:.1} s: fold median {:.2} ms, max {:.2} ms, {copied} bytes copied, \
         chain depth {}, disk use at most {:.1} MiB",
        elapsed.as_secs_f64(),
        fold_ms[fold_ms.len() / 2],
        fold_ms[fold_ms.len() - 1],
        disk::chain(&top).expect("chain").len(),
        max_use as f64 / (1 << 20) as f64
    );

    // Bad requests: not in the chain, the bottom, the top.
    let e = fold(&p.api, &[dir.join("nope.qcow2")]).expect_err("not a layer");
    assert!(e.contains("not a layer of any disk"), "{e}");
    let e = fold(&p.api, std::slice::from_ref(&base)).expect_err("the bottom");
    assert!(e.contains("bottom layer"), "{e}");
    let e = fold(&p.api, std::slice::from_ref(&top)).expect_err("the top");
    assert!(e.contains("writable top"), "{e}");

    // A forked child folds what its own fork froze.
    let r = p
        .call(&Request::Fork {
            children: vec![identity(&dir, "kid")],
            layers_dir: layers.clone(),
        })
        .expect("fork");
    let kid = r.children[0];
    let kid_top = dir.join("kid-disk0.qcow2");
    let kc = Console::in_dir(&dir, "kid");
    assert!(write(&kc, 5, 55).starts_with("WROTE"));
    let kid_api = dir.join("kid.api");
    let g = vmm::api::call(
        &kid_api,
        &Request::Fork {
            children: vec![identity(&dir, "grandkid")],
            layers_dir: layers.clone(),
        },
        micro::WAIT,
    )
    .expect("fork the child");
    assert!(g.reply.error.is_none(), "{:?}", g.reply.error);
    micro::kill(g.reply.children[0] as i32);
    drop(g);
    let chain: Vec<PathBuf> = disk::chain(&kid_top)
        .expect("chain")
        .into_iter()
        .map(|l| l.path)
        .collect();
    assert_eq!(chain.len(), 4, "{chain:?}");
    // Below the child's own frozen layer lies its parent's, which the
    // parent still uses: naming it alone is refused as not directly below.
    let e = fold(&kid_api, &chain[2..3]).expect_err("not directly below");
    assert!(e.contains("not directly below"), "{e}");
    let r = fold(&kid_api, &chain[1..2]).expect("fold in a child");
    assert_eq!(r.fold[0].depth, 3);
    assert_eq!(read(&kc, 5), format!("READ 5 SUM {}", block_sum(5, 55)));
    kc.command("flush", "FLUSHED", 1);
    let ok = std::process::Command::new("qemu-img")
        .args(["check", "-f", "qcow2"])
        .arg(&kid_top)
        .status()
        .expect("qemu-img");
    assert!(ok.success());
    micro::kill(kid as i32);
    let ping = vmm::api::call(&p.api, &Request::Ping, micro::WAIT).expect("ping");
    micro::kill(ping.reply.pid as i32);
    let _ = std::fs::remove_dir_all(dir);
}

/// A booted vm folds a layer below its top while it runs.
#[test]
fn test_a_booted_vm_folds_a_layer_below_its_top() {
    let dir = scratch("diskm", "bootfold");
    let mid = disk_chain(&dir);
    // The guest's pattern for block 9, seed 3, written below its top.
    let forking = forking();
    let d = disk::Disk::open(&mid, true).expect("open mid");
    let mut data = Vec::with_capacity(4096);
    for o in (9 * 4096u64..10 * 4096).step_by(8) {
        data.extend_from_slice(&((o ^ 3).wrapping_mul(0x9e37_79b9_7f4a_7c15)).to_le_bytes());
    }
    d.write_at(&data, 9 * 4096).expect("write");
    d.flush().expect("flush");
    drop(d);
    drop(forking);
    let top = dir.join("vm-top.qcow2");
    disk::create_overlay(&mid, &top).expect("top");
    let (p, c) = boot(&dir, "vm", &top);
    assert_eq!(read(&c, 9), format!("READ 9 SUM {}", block_sum(9, 3)));
    let r = fold(&p.api, std::slice::from_ref(&mid)).expect("fold");
    assert_eq!(r.fold[0].depth, 2);
    assert_eq!(r.fold[0].bytes_copied, 64 << 10, "one cluster");
    std::fs::remove_file(&mid).expect("remove the folded layer");
    assert_eq!(read(&c, 9), format!("READ 9 SUM {}", block_sum(9, 3)));
    assert!(write(&c, 10, 4).starts_with("WROTE"));
    c.command("flush", "FLUSHED", 1);
    let ok = std::process::Command::new("qemu-img")
        .args(["check", "-q", "-f", "qcow2"])
        .arg(&top)
        .status()
        .expect("qemu-img");
    assert!(ok.success());
    micro::kill(p.pid);
    let _ = p.wait(Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(dir);
}

/// A vm whose chain is at the limit is refused a fork before it pauses,
/// with a message that says it runs on and what to do; folding its
/// layers lets it fork again.
#[test]
fn test_a_fork_at_the_chain_limit_is_refused_and_folding_helps() {
    let dir = scratch("diskm", "deep");
    let mut below = disk_chain(&dir);
    for i in 1..disk::MAX_CHAIN_DEPTH - 1 {
        let p = dir.join(format!("l{i}.qcow2"));
        disk::create_overlay(&below, &p).expect("overlay");
        below = p;
    }
    let top = below;
    assert_eq!(
        disk::chain(&top).expect("chain").len(),
        disk::MAX_CHAIN_DEPTH
    );
    let (p, c) = boot(&dir, "vm", &top);
    assert!(write(&c, 2, 2).starts_with("WROTE"));
    let e = p
        .call(&Request::Fork {
            children: vec![identity(&dir, "kid")],
            layers_dir: dir.join("layers"),
        })
        .expect_err("a fork past the limit");
    assert!(e.contains("runs on unchanged"), "{e}");
    assert!(e.contains("FoldLayers"), "{e}");
    assert!(!e.contains("could not go on"), "{e}");
    assert!(write(&c, 3, 3).starts_with("WROTE"), "the vm runs on");
    let chain: Vec<PathBuf> = disk::chain(&top)
        .expect("chain")
        .into_iter()
        .map(|l| l.path)
        .collect();
    let r = fold(&p.api, &chain[1..201]).expect("fold 200 layers");
    assert_eq!(r.fold[0].depth, disk::MAX_CHAIN_DEPTH - 200);
    let r = p
        .call(&Request::Fork {
            children: vec![identity(&dir, "kid")],
            layers_dir: dir.join("layers"),
        })
        .expect("a fork after the fold");
    micro::kill(r.children[0] as i32);
    let _ = p.wait(Duration::from_secs(10));
    let ping = vmm::api::call(&p.api, &Request::Ping, micro::WAIT).expect("ping");
    micro::kill(ping.reply.pid as i32);
    let _ = std::fs::remove_dir_all(dir);
}
