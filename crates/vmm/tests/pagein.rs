//! Lazy page-in (userfaultfd) on real KVM with micro guests: a vm woken
//! from a memory file it has not read continues exactly; its working set
//! is recorded and a later wake prefetches it; a source that fails ends
//! the vm with an exit record naming what failed (no hang); a lazily
//! woken vm can be forked; and a diff layer taken from it, applied to its
//! base, wakes into the same memory.

mod micro;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use micro::{config, scratch, touch_sum, Console, VmmProcess};
use vm_memory::GuestAddress;
use vmm::api::{Identity, Request};
use vmm::dirty::DirtyTracking;
use vmm::layer::{self, LayerReader, Record, Selection};
use vmm::pagein::{self, FileSource, Fill, LazyOptions, PageSource, SourceError, WorkingSet};
use vmm::Moment;

const MIB: u64 = 1 << 20;

/// Boots `kernel`, runs `prepare` on its console, freezes it and writes
/// its RAM to `dir/memory` (a sparse file at the RAM layout, as a
/// snapshot's). Returns the moment and the console text at the freeze.
fn frozen_vm(
    dir: &Path,
    kernel: &Path,
    mem_mib: u64,
    prepare: impl FnOnce(&Console),
) -> (Moment, String) {
    let console = Console::in_dir(dir, "origin");
    let running = vmm::build(&config(kernel, mem_mib, &console))
        .expect("build")
        .start()
        .expect("start");
    console.wait_nth("READY", 1);
    prepare(&console);
    let source = running.fork_source().expect("fork source");
    let frozen = source.freeze(|_| None).expect("freeze");
    let moment = frozen.moment().clone();
    let text = console.text();
    write_memory(running.handle().guest_memory(), &dir.join("memory"));
    // The origin stays paused (a frozen vm dropped without thaw) and is
    // stopped: only its copies run from here.
    drop(frozen);
    running.handle().stop();
    (moment, text)
}

/// Writes guest RAM as a sparse file at the RAM layout.
fn write_memory(mem: &vmm::memory::GuestMemoryMmap, path: &Path) {
    use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
    let file = File::create(path).expect("memory file");
    let mut offsets = Vec::new();
    let mut off = 0;
    for r in mem.iter() {
        offsets.push((r.start_addr().0, r.len(), off));
        off += r.len();
    }
    file.set_len(off).expect("size");
    layer::windows(
        mem,
        Selection::Populated,
        |w| -> Result<(), layer::LayerError> {
            if let layer::Window::Data { gpa, bytes } = w {
                let (s, _, o) = offsets
                    .iter()
                    .find(|(s, l, _)| gpa >= *s && gpa < s + l)
                    .expect("in RAM");
                file.write_all_at(bytes, o + (gpa - s)).expect("write");
            }
            Ok(())
        },
    )
    .expect("windows");
}

fn file_source(dir: &Path, moment: &Moment) -> FileSource {
    FileSource::open(&dir.join("memory"), &moment.ram_regions()).expect("memory file")
}

/// A copy's configuration: same guest, its own console.
fn copy_config(kernel: &Path, moment: &Moment, console: &Console) -> vmm::VmConfig {
    config(kernel, moment.mem_mib, console)
}

#[test]
fn test_lazily_woken_counter_continues_exactly() {
    let dir = scratch("pagein", "counter");
    let (moment, at_freeze) = frozen_vm(&dir, guests::counter_path(), 64, |c| {
        c.wait_nth("CNT ", 3);
    });
    let console = Console::in_dir(&dir, "woken");
    let vmm = pagein::restore_lazy(
        &copy_config(guests::counter_path(), &moment, &console),
        &moment,
        Arc::new(file_source(&dir, &moment)),
        LazyOptions::default(),
    )
    .expect("lazy restore");
    let pagein = vmm.pagein().expect("page-in").clone();
    let running = vmm.start().expect("start");
    let last = *Console {
        log: dir.join("origin.log"),
        socket: dir.join("none"),
    }
    .counts()
    .last()
    .expect("a count");
    console.wait_nth("CNT ", 3);
    // One unbroken count across the wake (a line cut by the freeze is
    // finished by the copy).
    let joined = format!("{at_freeze}{}", console.text());
    let counts: Vec<u64> = joined
        .lines()
        .filter_map(|l| l.strip_prefix("CNT "))
        .filter_map(|n| n.trim().parse().ok())
        .collect();
    for w in counts.windows(2) {
        assert_eq!(
            w[1],
            w[0] + 1,
            "the count broke across the wake: {counts:?}"
        );
    }
    assert!(counts.contains(&(last + 1)), "{counts:?}");
    // A VMM thread (here the test's, as a virtio device's would) reading
    // guest memory nobody touched yet is served by the handler thread,
    // not deadlocked: the counter wrote u64 `a` at every address `a` of
    // its 32 MiB at 16 MiB.
    let addr = 40 * MIB + 0x1238;
    let v: u64 = vm_memory::Bytes::read_obj(running.handle().guest_memory(), GuestAddress(addr))
        .expect("read guest memory from a VMM thread");
    assert_eq!(v, addr);
    let stats = pagein.stats();
    assert!(stats.fault_units > 0, "nothing was paged in: {stats:?}");
    assert!(stats.error.is_none());
    // Only what the guest touched came in: far less than its 64 MiB.
    let touched = stats.fault_units * vmm::pagein::DEFAULT_UNIT as u64;
    assert!(touched < 16 * MIB, "paged in {touched} bytes: {stats:?}");
    println!("counter woken lazily: {stats:?}");
    running.handle().stop();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn test_working_set_is_recorded_and_prefetched() {
    let dir = scratch("pagein", "workingset");
    let (moment, _) = frozen_vm(&dir, guests::memtouch_path(), 256, |c| {
        c.command("touch 16 7", "TOUCHED", 1);
    });
    let want = format!("SUM {}", touch_sum(16, 7));
    let ws_path = dir.join("working-set.json");

    // Wake 1: nothing prefetched; the guest sums its 16 MiB, so those
    // pages are its working set.
    let console = Console::in_dir(&dir, "wake1");
    let vmm = pagein::restore_lazy(
        &copy_config(guests::memtouch_path(), &moment, &console),
        &moment,
        Arc::new(file_source(&dir, &moment)),
        LazyOptions {
            record_for: Duration::from_millis(1500),
            working_set_out: Some(ws_path.clone()),
            ..LazyOptions::default()
        },
    )
    .expect("lazy restore");
    let p1 = vmm.pagein().expect("page-in").clone();
    let running = vmm.start().expect("start");
    assert_eq!(console.command("sum 16", "SUM", 1), want);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ws_path.exists() {
        assert!(Instant::now() < deadline, "no working set written");
        std::thread::sleep(Duration::from_millis(20));
    }
    let ws = WorkingSet::read(&ws_path).expect("working set");
    let mut covered = vmm::dirty::PageBitmap::empty(
        &moment
            .ram_regions()
            .iter()
            .map(|r| (r.0 .0, r.1 as u64))
            .collect::<Vec<_>>(),
    );
    for &(gpa, len) in &ws.ranges {
        covered.insert(gpa, len);
    }
    for a in (16 * MIB..32 * MIB).step_by(4096) {
        assert!(
            covered.contains(a),
            "working set misses {a:#x}: {:?}",
            ws.ranges
        );
    }
    assert!(
        ws.bytes() < 20 * MIB,
        "working set of {} bytes for a 16 MiB sum",
        ws.bytes()
    );
    let s1 = p1.stats();
    println!(
        "wake 1 (no prefetch): {s1:?}, working set {} bytes",
        ws.bytes()
    );
    running.handle().stop();

    // Wake 2: the working set is prefetched while the vCPUs start; the
    // same sum then faults (almost) nothing in.
    let console = Console::in_dir(&dir, "wake2");
    let vmm = pagein::restore_lazy(
        &copy_config(guests::memtouch_path(), &moment, &console),
        &moment,
        Arc::new(file_source(&dir, &moment)),
        LazyOptions {
            prefetch: Some(ws.clone()),
            ..LazyOptions::default()
        },
    )
    .expect("lazy restore with prefetch");
    let p2 = vmm.pagein().expect("page-in").clone();
    let running = vmm.start().expect("start");
    assert!(
        p2.wait_prefetch(Duration::from_secs(10)),
        "prefetch did not end"
    );
    assert_eq!(console.command("sum 16", "SUM", 1), want);
    let s2 = p2.stats();
    println!("wake 2 (prefetch): {s2:?}");
    assert!(s2.prefetch_done);
    assert!(
        s2.prefetch_units * vmm::pagein::DEFAULT_UNIT as u64
            >= 16 * MIB - 2 * s2.fault_units * vmm::pagein::DEFAULT_UNIT as u64,
        "{s2:?}"
    );
    assert!(
        s2.fault_units * 10 < s1.fault_units,
        "prefetch did not spare faults: {s1:?} vs {s2:?}"
    );
    // The prefetched set carries over into this wake's working set.
    assert!(p2.working_set().bytes() >= ws.bytes());
    running.handle().stop();
    let _ = std::fs::remove_dir_all(dir);
}

/// A store whose chunks above 16 MiB are corrupt.
struct CorruptAbove16(FileSource);

impl PageSource for CorruptAbove16 {
    fn fill(&self, gpa: u64, buf: &mut [u8]) -> Result<Fill, SourceError> {
        if (16 * MIB..64 * MIB).contains(&gpa) {
            return Err("snapshot s1, chunk 5f3a…e1: hash mismatch".into());
        }
        self.0.fill(gpa, buf)
    }
}

#[test]
fn test_failing_source_ends_the_vm_with_what_failed() {
    let dir = scratch("pagein", "failing");
    let (moment, _) = frozen_vm(&dir, guests::memtouch_path(), 128, |c| {
        c.command("touch 8 3", "TOUCHED", 1);
    });
    let console = Console::in_dir(&dir, "woken");
    let cfg = copy_config(guests::memtouch_path(), &moment, &console);
    let source = CorruptAbove16(file_source(&dir, &moment));
    let p = VmmProcess::spawn(&dir, "woken", move || {
        pagein::restore_lazy(&cfg, &moment, Arc::new(source), LazyOptions::default())
            .expect("lazy restore")
    });
    // The guest runs (its own pages are below 16 MiB) until it reads its
    // region: that fault cannot be served.
    console.command("ping", "PONG", 1);
    console.send("sum 8");
    let status = p.wait(Duration::from_secs(20));
    assert_eq!(status, Some(1), "the VMM did not end as crashed");
    let rec: vmm::process::ExitRecord =
        serde_json::from_slice(&std::fs::read(&p.exit_file).expect("exit record"))
            .expect("exit record json");
    println!("exit record: {rec:?}");
    let err = rec.error.expect("an error in the exit record");
    assert!(err.contains("page-in of guest 0x1000000"), "{err}");
    assert!(err.contains("chunk 5f3a…e1: hash mismatch"), "{err}");
    assert!(rec.reason.starts_with("crashed: "), "{}", rec.reason);
    // It printed "SUM " and then blocked on its region: no sum came out.
    assert!(
        !console.lines().iter().any(|l| l.starts_with("SUM")),
        "the guest read memory that was not there: {:?}",
        console.text()
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A store whose chunk holding the generation id (written by every
/// restore) is corrupt.
struct CorruptVmGenId(FileSource);

impl PageSource for CorruptVmGenId {
    fn fill(&self, gpa: u64, buf: &mut [u8]) -> Result<Fill, SourceError> {
        let id = vmm::devices::legacy::vmgenid::VMGENID_ADDR;
        if (gpa..gpa + buf.len() as u64).contains(&id) {
            return Err("snapshot s1, chunk 77aa…: hash mismatch".into());
        }
        self.0.fill(gpa, buf)
    }
}

#[test]
fn test_failure_during_the_restore_is_an_error_not_a_hang() {
    let dir = scratch("pagein", "restorefail");
    let (moment, _) = frozen_vm(&dir, guests::counter_path(), 64, |c| {
        c.wait_nth("CNT ", 1);
    });
    let console = Console::in_dir(&dir, "woken");
    let cfg = copy_config(guests::counter_path(), &moment, &console);
    let source = CorruptVmGenId(file_source(&dir, &moment));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let r = pagein::restore_lazy(&cfg, &moment, Arc::new(source), LazyOptions::default());
        let _ = tx.send(r.map(|_| ()).map_err(|e| vmm::process::chain(&e)));
    });
    let res = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the restore hung on a page it could not get");
    let err = res.expect_err("a vm whose page-in failed was restored");
    assert!(err.contains("chunk 77aa…: hash mismatch"), "{err}");
    assert!(err.contains("page-in of guest 0xc0000"), "{err}");
    assert!(!console.text().contains("CNT"), "the vm ran");
    let _ = std::fs::remove_dir_all(dir);
}

fn identity(dir: &Path, name: &str) -> Identity {
    Identity {
        name: name.into(),
        console_log: dir.join(format!("{name}.log")),
        console_socket: Some(dir.join(format!("{name}.sock"))),
        log: dir.join(format!("{name}.vmm.log")),
        api_socket: dir.join(format!("{name}.api")),
        exit_file: dir.join(format!("{name}.exit.json")),
        ..Identity::default()
    }
}

#[test]
fn test_lazily_woken_vm_can_be_forked() {
    let dir = scratch("pagein", "fork");
    let (moment, _) = frozen_vm(&dir, guests::memtouch_path(), 128, |c| {
        c.command("touch 8 3", "TOUCHED", 1);
    });
    let want = format!("SUM {}", touch_sum(8, 3));
    let console = Console::in_dir(&dir, "woken");
    let cfg = copy_config(guests::memtouch_path(), &moment, &console);
    let source = file_source(&dir, &moment);
    let p = VmmProcess::spawn(&dir, "woken", move || {
        pagein::restore_lazy(&cfg, &moment, Arc::new(source), LazyOptions::default())
            .expect("lazy restore")
    });
    console.command("ping", "PONG", 1);
    let before = p
        .call(&Request::PageIn {
            working_set_to: None,
        })
        .expect("page-in status")
        .pagein
        .expect("a lazy vm");
    assert!(!before.resident);

    let reply = p
        .call(&Request::Fork {
            children: vec![identity(&dir, "child")],
            layers_dir: dir.join("layers"),
        })
        .expect("fork a lazily woken vm");
    assert_eq!(reply.children.len(), 1);
    let child = Console::in_dir(&dir, "child");
    assert_eq!(child.command("sum 8", "SUM", 1), want, "the child's memory");
    assert_eq!(
        console.command("sum 8", "SUM", 1),
        want,
        "the parent's memory"
    );
    // The parent went on in its own process, its RAM now resident and
    // unregistered (what made the fork safe).
    let after = p
        .call(&Request::PageIn {
            working_set_to: None,
        })
        .expect("page-in status")
        .pagein
        .expect("a lazy vm");
    assert!(after.resident, "{after:?}");
    assert!(after.resident_units > 0, "{after:?}");
    micro::kill(reply.children[0] as i32);
    micro::kill(p.pid);
    let _ = p.wait(Duration::from_secs(5));
    let _ = std::fs::remove_dir_all(dir);
}

/// Applies a layer to a copy of `base` (a memory file at `regions`).
fn apply_layer(base: &Path, layer_path: &Path, out: &Path, regions: &[(GuestAddress, usize)]) {
    std::fs::copy(base, out).expect("copy base");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(out)
        .expect("open out");
    let mut r = LayerReader::open(layer_path).expect("open layer");
    let offset = |gpa: u64| {
        let mut off = 0;
        for &(s, l) in regions {
            if gpa >= s.0 && gpa < s.0 + l as u64 {
                return off + gpa - s.0;
            }
            off += l as u64;
        }
        panic!("{gpa:#x} outside RAM")
    };
    let mut buf = Vec::new();
    while let Some(rec) = r.next_record(&mut buf).expect("record") {
        match rec {
            Record::Data { gpa, .. } => f.write_all_at(&buf, offset(gpa)).expect("write"),
            Record::Zero { gpa, len } => f
                .write_all_at(&vec![0u8; len as usize], offset(gpa))
                .expect("write zeros"),
        }
    }
}

#[test]
fn test_diff_layer_of_a_lazily_woken_vm_wakes_into_the_same_memory() {
    let dir = scratch("pagein", "difflayer");
    let (moment, _) = frozen_vm(&dir, guests::memtouch_path(), 128, |c| {
        c.command("touch 8 3", "TOUCHED", 1);
    });
    let console = Console::in_dir(&dir, "woken");
    let cfg = copy_config(guests::memtouch_path(), &moment, &console);
    let source = file_source(&dir, &moment);
    let m = moment.clone();
    // Woken as snapshot "s0": its dirty set is relative to it.
    let p = VmmProcess::spawn(&dir, "woken", move || {
        let mut vmm = pagein::restore_lazy(&cfg, &m, Arc::new(source), LazyOptions::default())
            .expect("lazy restore");
        vmm.track_dirty(DirtyTracking {
            enabled: true,
            base: Some("s0".into()),
        });
        vmm
    });
    // The guest rewrites the first 4 of its 8 MiB with another seed.
    console.command("touch 4 9", "TOUCHED", 1);
    let snap = dir.join("s1");
    let reply = p
        .call(&Request::SnapshotLayer {
            dir: snap.clone(),
            layers_dir: dir.join("layers"),
            contract: None,
            full: false,
            rebase: Some("s1".into()),
            expect_base: None,
        })
        .expect("snapshot layer");
    let info = reply.layer.expect("layer info");
    println!("diff layer: {info:?}, {:?} ms", reply.snapshot_ms);
    assert_eq!(info.base.as_deref(), Some("s0"));
    assert!(info.pages >= 1024 && info.pages < 1024 + 64, "{info:?}");
    assert_eq!(reply.dirty.expect("tracking").base.as_deref(), Some("s1"));
    let manifest: vmm::snapshot_dir::Manifest =
        serde_json::from_slice(&std::fs::read(snap.join("manifest.json")).expect("manifest"))
            .expect("manifest json");
    assert_eq!(manifest.memory_layer.as_ref(), Some(&info));
    // No full memory was read: the vm is still lazy.
    let st = p
        .call(&Request::PageIn {
            working_set_to: None,
        })
        .expect("status")
        .pagein
        .expect("lazy");
    assert!(!st.resident, "a diff layer made memory resident: {st:?}");
    micro::kill(p.pid);
    let _ = p.wait(Duration::from_secs(5));

    // Base + diff = the memory of the moment s1: a new lazy wake from it
    // sees 4 MiB of seed 9 then 4 MiB of seed 3.
    let regions = moment.ram_regions();
    apply_layer(
        &dir.join("memory"),
        &snap.join("memory.layer"),
        &dir.join("memory-s1"),
        &regions,
    );
    let state = std::fs::read(snap.join("state")).expect("state");
    let text = std::fs::read(snap.join("manifest.json")).expect("manifest");
    let m1: Moment = snapshot::decode_sealed(&state, &snapshot::Seal::of_manifest(&text, None))
        .expect("decode state");
    let console = Console::in_dir(&dir, "s1");
    let src = FileSource::open(&dir.join("memory-s1"), &regions).expect("memory-s1");
    let running = pagein::restore_lazy(
        &copy_config(guests::memtouch_path(), &m1, &console),
        &m1,
        Arc::new(src),
        LazyOptions::default(),
    )
    .expect("wake s1")
    .start()
    .expect("start");
    assert_eq!(
        console.command("sum 4", "SUM", 1),
        format!("SUM {}", touch_sum(4, 9))
    );
    // The second half: sum 8 over both halves, computed from the pattern.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for a in (16 * MIB..24 * MIB).step_by(8) {
        let seed = if a < 20 * MIB { 9 } else { 3 };
        let v = (a ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for b in v.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    assert_eq!(console.command("sum 8", "SUM", 2), format!("SUM {h:016x}"));
    running.handle().stop();
    let _ = std::fs::remove_dir_all(dir);
}
