//! Dirty tracking on real KVM with the memtouch micro guest: between two
//! moments the dirty set holds exactly the pages the guest touched (its
//! region at 16 MiB, plus the few pages of its own stack and data below
//! it) and the pages the VMM wrote itself; the set survives being read,
//! empties on a rebase, and a memory layer written from it reads back.

mod micro;

use std::time::Instant;

use micro::{config, scratch, Console};
use vm_memory::{Bytes, GuestAddress};
use vmm::dirty::{PageBitmap, PAGE_SIZE};
use vmm::layer::{self, LayerReader, Record, Selection};

const MIB: u64 = 1 << 20;
const REGION: u64 = 16 * MIB;

/// Pages of `set` in `lo..hi`.
fn count_in(set: &PageBitmap, lo: u64, hi: u64) -> u64 {
    set.runs()
        .iter()
        .map(|&(s, l)| {
            let a = s.max(lo);
            let b = (s + l).min(hi);
            b.saturating_sub(a) / PAGE_SIZE
        })
        .sum()
}

#[test]
fn test_dirty_log_names_exactly_the_touched_pages() {
    let dir = scratch("dirty", "touched");
    let console = Console::in_dir(&dir, "memtouch");
    let running = vmm::build(&config(guests::memtouch_path(), 256, &console))
        .expect("build")
        .start()
        .expect("start");
    let h = running.handle();
    console.wait_nth("READY", 1);
    console.command("touch 8 1", "TOUCHED", 1);

    // Moment 1: tracking on, the set emptied with a base.
    h.enable_dirty_tracking().expect("enable");
    h.pause().expect("pause");
    h.rebase_dirty(Some("m1".into())).expect("rebase");
    h.resume().expect("resume");

    // Between the moments the guest rewrites the first 4 of its 8 MiB,
    // and the VMM writes one page itself (as a virtio device would).
    console.command("touch 4 2", "TOUCHED", 2);
    h.guest_memory()
        .write_slice(&[0xabu8; 16], GuestAddress(100 * MIB + 0x10))
        .expect("VMM write");

    // Moment 2.
    h.pause().expect("pause");
    let t = Instant::now();
    let log = h.dirty_log().expect("dirty log");
    let took = t.elapsed();
    assert_eq!(log.base.as_deref(), Some("m1"));
    let set = &log.pages;
    let touched = count_in(set, REGION, REGION + 4 * MIB);
    assert_eq!(touched, 4 * MIB / PAGE_SIZE, "every touched page is dirty");
    assert_eq!(
        count_in(set, REGION + 4 * MIB, REGION + 8 * MIB),
        0,
        "pages touched before the base are not"
    );
    assert!(set.contains(100 * MIB), "the VMM's own write is dirty");
    let below = count_in(set, 0, REGION);
    let elsewhere = set.count() - touched - below;
    assert_eq!(elsewhere, 1, "nothing else above 16 MiB: {:?}", set.runs());
    assert!(
        below > 0 && below <= 16,
        "the guest's own stack/data pages below 16 MiB: {below} ({:?})",
        set.runs()
    );
    println!(
        "dirty between the moments: {} pages ({touched} touched, {below} guest-internal below 16 MiB, 1 VMM write); dirty_log took {took:?}",
        set.count()
    );

    // Reading the log does not empty it.
    let again = h.dirty_log().expect("dirty log again");
    assert_eq!(again.pages, log.pages);

    // A diff layer of exactly that set reads back with the guest's bytes.
    let path = dir.join("diff.layer");
    let info = layer::write(h.guest_memory(), Selection::Pages(set), Some("m1"), &path)
        .expect("write layer");
    assert_eq!(info.pages, set.count());
    assert_eq!(info.base.as_deref(), Some("m1"));
    let mut r = LayerReader::open(&path).expect("open layer");
    let mut buf = Vec::new();
    let mut named = PageBitmap::empty_for(h.guest_memory());
    while let Some(rec) = r.next_record(&mut buf).expect("record") {
        let (gpa, len) = match rec {
            Record::Data { gpa, len } => {
                let mut want = vec![0u8; len as usize];
                h.guest_memory()
                    .read_slice(&mut want, GuestAddress(gpa))
                    .expect("read");
                assert!(
                    buf == want,
                    "layer bytes at {gpa:#x} differ from guest memory"
                );
                (gpa, len)
            }
            Record::Zero { gpa, len } => (gpa, len),
        };
        named.insert(gpa, len);
    }
    assert_eq!(&named, set, "the layer names exactly the dirty set");

    // Moment 3: after a rebase, a guest that only answers a ping dirties
    // nothing in its region.
    h.rebase_dirty(Some("m2".into())).expect("rebase");
    h.resume().expect("resume");
    console.command("ping", "PONG", 1);
    h.pause().expect("pause");
    let log = h.dirty_log().expect("dirty log");
    assert_eq!(log.base.as_deref(), Some("m2"));
    assert_eq!(count_in(&log.pages, REGION, 256 * MIB), 0);
    assert!(log.pages.count() <= 16, "{:?}", log.pages.runs());

    // Pages written before the rebase are protected again by it (with
    // manual protection, by KVM_CLEAR_DIRTY_LOG): rewriting them counts.
    h.resume().expect("resume");
    console.command("touch 2 3", "TOUCHED", 3);
    h.pause().expect("pause");
    let log = h.dirty_log().expect("dirty log");
    assert_eq!(count_in(&log.pages, REGION, 256 * MIB), 2 * MIB / PAGE_SIZE);
    println!(
        "manual dirty-log protection: {}",
        h.vm().manual_dirty_protect()
    );
    h.resume().expect("resume");
    running.handle().stop();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn test_dirty_log_needs_a_paused_vm() {
    let dir = scratch("dirty", "paused");
    let console = Console::in_dir(&dir, "memtouch");
    let running = vmm::build(&config(guests::memtouch_path(), 64, &console))
        .expect("build")
        .start()
        .expect("start");
    let h = running.handle();
    console.wait_nth("READY", 1);
    h.enable_dirty_tracking().expect("enable");
    assert!(matches!(h.dirty_log(), Err(vmm::ControlError::NotPaused)));
    assert!(matches!(
        h.rebase_dirty(None),
        Err(vmm::ControlError::NotPaused)
    ));
    running.handle().stop();
    let _ = std::fs::remove_dir_all(dir);
}

fn identity(dir: &std::path::Path, name: &str) -> vmm::api::Identity {
    vmm::api::Identity {
        name: name.into(),
        console_log: dir.join(format!("{name}.log")),
        console_socket: Some(dir.join(format!("{name}.sock"))),
        log: dir.join(format!("{name}.vmm.log")),
        api_socket: dir.join(format!("{name}.api")),
        exit_file: dir.join(format!("{name}.exit.json")),
        ..Default::default()
    }
}

fn snapshot_layer(api: &std::path::Path, dir: &std::path::Path, rebase: &str) -> vmm::api::Reply {
    snapshot_layer_over(api, dir, rebase, None)
}

/// [`snapshot_layer`] that wants a diff only over `expect_base`.
fn snapshot_layer_over(
    api: &std::path::Path,
    dir: &std::path::Path,
    rebase: &str,
    expect_base: Option<&str>,
) -> vmm::api::Reply {
    let call = vmm::api::call(
        api,
        &vmm::api::Request::SnapshotLayer {
            dir: dir.join(format!("snap-{rebase}")),
            layers_dir: dir.join("layers"),
            contract: None,
            full: false,
            rebase: Some(rebase.into()),
            expect_base: expect_base.map(str::to_string),
        },
        micro::WAIT,
    )
    .expect("snapshot layer");
    assert!(call.reply.error.is_none(), "{:?}", call.reply.error);
    call.reply
}

/// Every process that continues a moment tracks on its own: a child
/// keeps the base of its parent's moment and the pages dirtied before it,
/// the parent's continuation starts anew from the snapshot it stored.
#[test]
fn test_dirty_set_follows_forks_and_snapshots() {
    let dir = scratch("dirty", "forks");
    let console = Console::in_dir(&dir, "parent");
    let cfg = config(guests::memtouch_path(), 128, &console);
    let p = micro::VmmProcess::spawn(&dir, "parent", move || {
        let mut vmm = vmm::build(&cfg).expect("build");
        vmm.track_dirty(vmm::dirty::DirtyTracking {
            enabled: true,
            base: None,
        });
        vmm
    });
    console.wait_nth("READY", 1);
    console.command("touch 8 1", "TOUCHED", 1);

    // No base yet: the first layer is full; the vm now tracks against s0.
    let r = snapshot_layer(&p.api, &dir, "s0");
    let l = r.layer.expect("layer");
    assert_eq!(l.base, None, "a vm without a base stores a full layer");
    assert!(l.pages >= 2048, "{l:?}");
    assert!(r.continuation_pid.is_some(), "a booted vm moves on");

    // The parent dirties 2 MiB, then forks a child that dirties 6 MiB.
    console.command("touch 2 2", "TOUCHED", 2);
    let call = vmm::api::call(
        &p.api,
        &vmm::api::Request::Fork {
            children: vec![identity(&dir, "child")],
            layers_dir: dir.join("layers"),
        },
        micro::WAIT,
    )
    .expect("fork");
    assert!(call.reply.error.is_none(), "{:?}", call.reply.error);
    let child_pid = call.reply.children[0];
    drop(call);
    let child = Console::in_dir(&dir, "child");
    // The child tracks on its own, against its parent's base.
    let t = vmm::api::call(
        &dir.join("child.api"),
        &vmm::api::Request::TrackDirty,
        micro::WAIT,
    )
    .expect("track dirty");
    assert_eq!(
        t.reply.dirty,
        Some(vmm::dirty::DirtyTracking {
            enabled: true,
            base: Some("s0".into())
        })
    );
    drop(t);
    child.command("touch 6 5", "TOUCHED", 1);

    // The child's diff against s0 holds its 6 MiB (which cover the
    // parent's 2 MiB); the parent's, only its 2 MiB.
    let c = snapshot_layer(&dir.join("child.api"), &dir, "c1")
        .layer
        .expect("child layer");
    assert_eq!(c.base.as_deref(), Some("s0"));
    assert!((1536..1536 + 64).contains(&c.pages), "child: {c:?}");
    let pl = snapshot_layer(&p.api, &dir, "s1")
        .layer
        .expect("parent layer");
    assert_eq!(pl.base.as_deref(), Some("s0"));
    assert!((512..512 + 64).contains(&pl.pages), "parent: {pl:?}");

    // Right after its rebase to s1 the parent has dirtied nothing of its
    // region.
    console.command("ping", "PONG", 1);
    let q = snapshot_layer(&p.api, &dir, "s2").layer.expect("layer");
    assert_eq!(q.base.as_deref(), Some("s1"));
    assert!(q.pages < 64, "{q:?}");
    // A caller that expects another base (it lost track of a rebase) gets
    // a full layer, never a diff it would read over the wrong base.
    let f = snapshot_layer_over(&p.api, &dir, "s3", Some("s1"))
        .layer
        .expect("layer");
    assert_eq!(f.base, None, "the vm's base is s2: {f:?}");
    assert!(f.pages >= 2048, "{f:?}");
    let d = snapshot_layer_over(&p.api, &dir, "s4", Some("s3"))
        .layer
        .expect("layer");
    assert_eq!(d.base.as_deref(), Some("s3"), "{d:?}");
    println!("layers: full {l:?}, child {c:?}, parent {pl:?}, idle {q:?}");

    let ping = vmm::api::call(&p.api, &vmm::api::Request::Ping, micro::WAIT).expect("ping");
    micro::kill(ping.reply.pid as i32);
    micro::kill(child_pid as i32);
    let _ = std::fs::remove_dir_all(dir);
}
