//! VMGenID: every new copy of a vm (a restored moment, a fork child) gets a
//! new random generation id in guest memory, the vm going on keeps its
//! own, and the copy runs on (the GED interrupt raised for it breaks
//! nothing). Micro guest on this machine's /dev/kvm.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::copy_memory;
use vmm::builder::restore_prepared;
use vmm::devices::legacy::vmgenid::{read_id, VMGENID_LEN};
use vmm::memory::RamBacking;
use vmm::VmConfig;

const WAIT: Duration = Duration::from_secs(10);
const ZERO: [u8; VMGENID_LEN] = [0; VMGENID_LEN];

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tine-vmgenid-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn config(log: &Path) -> VmConfig {
    VmConfig {
        kernel: guests::counter_path().into(),
        mem_mib: 64,
        vcpus: 1,
        console_log: Some(log.to_path_buf()),
        ..Default::default()
    }
}

fn read(log: &Path) -> String {
    String::from_utf8_lossy(&std::fs::read(log).unwrap_or_default()).into_owned()
}

fn counts(log: &Path) -> usize {
    read(log).lines().filter(|l| l.starts_with("CNT ")).count()
}

/// Waits until the counter guest has printed `lines` `CNT` lines.
fn wait_for_counts(log: &Path, lines: usize) {
    let deadline = Instant::now() + WAIT;
    while counts(log) < lines {
        assert!(
            Instant::now() < deadline,
            "{} has no {lines} counts: {:?}",
            log.display(),
            read(log)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn test_vmgenid_new_copies_get_new_ids_and_run() {
    let dir = scratch("copies");
    let log = dir.join("parent.log");
    let parent_config = config(&log);
    let running = vmm::build(&parent_config)
        .expect("build")
        .start()
        .expect("start");
    let h = running.handle();
    let parent_id = read_id(h.guest_memory()).expect("read id");
    assert_ne!(parent_id, ZERO, "a booted vm has a generation id");
    wait_for_counts(&log, 2);

    let source = running.fork_source().expect("fork source");
    let frozen = source.freeze(|_| None).expect("freeze");
    let moment = frozen.moment().clone();
    let frozen_mem = copy_memory(h.guest_memory());
    assert_eq!(read_id(&frozen_mem).expect("read id"), parent_id);

    // A restored moment (a snapshot restore) is a new copy: a new id.
    let restored_mem = copy_memory(&frozen_mem);
    let child_log = dir.join("child.log");
    let child = vmm::restore(
        &config(&child_log),
        restored_mem.clone(),
        RamBacking::Private,
        &moment,
    )
    .expect("restore");
    let child_id = read_id(&restored_mem).expect("read id");
    assert_ne!(child_id, ZERO);
    assert_ne!(child_id, parent_id, "a restored copy keeps the parent's id");

    // The vm going on in a new process keeps its id; a fork child (the
    // same restore, then new_generation) gets a new one, different again.
    let going_on_mem = copy_memory(&frozen_mem);
    let going_on = restore_prepared(
        &config(&dir.join("going-on.log")),
        going_on_mem.clone(),
        RamBacking::Private,
        &moment,
        None,
    )
    .expect("restore the continuation");
    assert_eq!(read_id(&going_on_mem).expect("read id"), parent_id);
    let forked_id = going_on.new_generation().expect("new generation");
    assert_eq!(read_id(&going_on_mem).expect("read id"), forked_id);
    assert!(forked_id != parent_id && forked_id != child_id && forked_id != ZERO);
    drop(going_on);

    // The restored copy runs on from the moment, with its GED interrupt
    // already raised.
    let child = child.start().expect("start child");
    wait_for_counts(&child_log, 2);
    assert_eq!(read_id(&restored_mem).expect("read id"), child_id);

    // The parent goes on with the id it had.
    frozen.thaw().expect("thaw");
    let before = counts(&log);
    wait_for_counts(&log, before + 1);
    assert_eq!(read_id(h.guest_memory()).expect("read id"), parent_id);

    child.handle().stop();
    running.handle().stop();
    let _ = std::fs::remove_dir_all(dir);
}
