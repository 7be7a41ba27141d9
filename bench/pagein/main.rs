//! bench/pagein: the VMM half of sleep and wake, on this machine's
//! /dev/kvm with a 1 GiB micro-memtouch guest that dirtied 64 MiB.
//!
//! 1. Dirty log: time to take "pages dirtied since the base" at a moment
//!    (KVM_GET_DIRTY_LOG of every memslot folded into the VMM's bitmaps,
//!    then read): the pause time dirty tracking adds to a snapshot. With
//!    64 MiB dirtied since the base, and with none (idle). Also the
//!    guest's `touch 64` with tracking on and off (write-protect faults).
//! 2. Wake: the frozen guest's RAM in a sparse memory file (as a
//!    snapshot directory's), woken again and again:
//!    - warm: the file mapped MAP_PRIVATE, its pages in the page cache;
//!    - cold: lazy page-in (userfaultfd) from the file after its pages
//!      were dropped from the page cache (POSIX_FADV_DONTNEED), or with
//!      `--delay-us N` a source that sleeps N µs per fill (a remote
//!      store's latency);
//!    - prefetch: cold, with the working set the first cold wake
//!      recorded prefetched while the vCPUs start;
//!    - prefetch-first: the same, with the vCPUs started only after the
//!      prefetch finished.
//!
//!    wake_running = request -> vCPUs running; ttuw (time to useful
//!    work) = request -> the guest answered `sum 64` (it read its 64 MiB
//!    working set).
//! 3. Units: cold ttuw for several page-in unit sizes.
//!
//! Run: `cargo bench -p tine-vmm --bench pagein [-- --runs N --delay-us N]`.
//! Prints medians and ratios; the last line is name=value pairs.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
use vmm::layer::{self, Selection, Window};
use vmm::memory::{self, RamBacking};
use vmm::pagein::{self, FileSource, LazyOptions, WorkingSet};
use vmm::{Moment, VmConfig};

const MEM_MIB: u64 = 1024;
const DIRTY_MIB: u64 = 64;
const WAIT: Duration = Duration::from_secs(60);

struct Args {
    runs: usize,
    delay_us: u64,
}

fn args() -> Args {
    let mut a = Args {
        runs: 7,
        delay_us: 0,
    };
    let v: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < v.len() {
        match v[i].as_str() {
            "--runs" => {
                a.runs = v.get(i + 1).and_then(|x| x.parse().ok()).unwrap_or(a.runs);
                i += 1;
            }
            "--delay-us" => {
                a.delay_us = v.get(i + 1).and_then(|x| x.parse().ok()).unwrap_or(0);
                i += 1;
            }
            // `cargo bench` passes --bench; anything else is ignored.
            _ => {}
        }
        i += 1;
    }
    a
}

struct Console {
    log: PathBuf,
    socket: PathBuf,
}

impl Console {
    fn new(dir: &Path, name: &str) -> Self {
        let c = Self {
            log: dir.join(format!("{name}.log")),
            socket: dir.join(format!("{name}.sock")),
        };
        let _ = std::fs::remove_file(&c.log);
        c
    }

    fn config(&self, mem_mib: u64) -> VmConfig {
        VmConfig {
            kernel: guests::memtouch_path().into(),
            mem_mib,
            vcpus: 1,
            console_log: Some(self.log.clone()),
            console_socket: Some(self.socket.clone()),
            ..Default::default()
        }
    }

    fn count(&self, prefix: &str) -> usize {
        let t = std::fs::read(&self.log).unwrap_or_default();
        // Complete lines only: memtouch prints "SUM " before it reads.
        let end = t.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        String::from_utf8_lossy(&t[..end])
            .lines()
            .filter(|l| l.starts_with(prefix))
            .count()
    }

    fn send(&self, line: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Ok(mut s) = UnixStream::connect(&self.socket) {
                s.write_all(format!("{line}\n").as_bytes())
                    .expect("console write");
                return;
            }
            assert!(Instant::now() < deadline, "no console socket");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Sends `line`, waits for one more line starting with `reply`.
    fn command(&self, line: &str, reply: &str) {
        let n = self.count(reply);
        self.send(line);
        self.wait(reply, n + 1);
    }

    fn wait(&self, prefix: &str, n: usize) {
        let deadline = Instant::now() + WAIT;
        while self.count(prefix) < n {
            assert!(Instant::now() < deadline, "no {prefix:?} in {:?}", self.log);
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Part 1: dirty log cost. Returns (dirty ms, idle ms, touch on ms,
/// touch after a collection ms, touch off ms).
fn bench_dirty_log(dir: &Path, runs: usize) -> (f64, f64, f64, f64, f64) {
    let c = Console::new(dir, "dirty");
    let running = vmm::build(&c.config(MEM_MIB))
        .expect("build")
        .start()
        .expect("start");
    let h = running.handle();
    c.wait("READY", 1);
    // Populate the region once, so later touches measure rewrites.
    c.command(&format!("touch {DIRTY_MIB} 1"), "TOUCHED");
    let mut off = Vec::new();
    for i in 0..runs {
        let t = Instant::now();
        c.command(&format!("touch {DIRTY_MIB} {}", 100 + i), "TOUCHED");
        off.push(ms(t.elapsed()));
    }
    h.enable_dirty_tracking().expect("tracking");
    let (mut dirty, mut idle, mut on, mut again) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    println!(
        "manual dirty-log protection: {}",
        h.vm().manual_dirty_protect()
    );
    for i in 0..runs {
        h.pause().expect("pause");
        h.rebase_dirty(Some(format!("b{i}"))).expect("rebase");
        h.resume().expect("resume");
        let t = Instant::now();
        c.command(&format!("touch {DIRTY_MIB} {}", 2 + i), "TOUCHED");
        on.push(ms(t.elapsed()));
        h.pause().expect("pause");
        let t = Instant::now();
        let log = h.dirty_log().expect("dirty log");
        dirty.push(ms(t.elapsed()));
        assert!(log.pages.bytes() >= DIRTY_MIB << 20);
        // A moment taken without a rebase (a fork of a tracked vm): with
        // manual protection the pages stay writable.
        h.resume().expect("resume");
        let t = Instant::now();
        c.command(&format!("touch {DIRTY_MIB} {}", 50 + i), "TOUCHED");
        again.push(ms(t.elapsed()));
        h.pause().expect("pause");
        h.rebase_dirty(Some(format!("c{i}"))).expect("rebase");
        let t = Instant::now();
        let log = h.dirty_log().expect("dirty log");
        idle.push(ms(t.elapsed()));
        assert!(log.pages.count() < 64);
        h.resume().expect("resume");
    }
    running.handle().stop();
    (
        median(&mut dirty),
        median(&mut idle),
        median(&mut on),
        median(&mut again),
        median(&mut off),
    )
}

/// Boots the guest, touches 64 MiB, freezes it and writes its RAM to
/// `dir/memory`; returns the moment.
fn make_snapshot(dir: &Path) -> Moment {
    let c = Console::new(dir, "origin");
    let running = vmm::build(&c.config(MEM_MIB))
        .expect("build")
        .start()
        .expect("start");
    c.wait("READY", 1);
    c.command(&format!("touch {DIRTY_MIB} 7"), "TOUCHED");
    let source = running.fork_source().expect("fork source");
    let frozen = source.freeze(|_| None).expect("freeze");
    let moment = frozen.moment().clone();
    let handle = running.handle();
    let mem = handle.guest_memory();
    let file = File::create(dir.join("memory")).expect("memory file");
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
            if let Window::Data { gpa, bytes } = w {
                let &(s, _, o) = offsets
                    .iter()
                    .find(|(s, l, _)| gpa >= *s && gpa < s + l)
                    .expect("in RAM");
                file.write_all_at(bytes, o + (gpa - s)).expect("write");
            }
            Ok(())
        },
    )
    .expect("write memory");
    file.sync_all().expect("sync");
    drop(frozen);
    running.handle().stop();
    moment
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Warm,
    Cold,
    Prefetch,
    PrefetchFirst,
}

struct Wake {
    running_ms: f64,
    ttuw_ms: f64,
    stats: Option<pagein::PageInStats>,
    working_set: Option<WorkingSet>,
}

fn wake(
    dir: &Path,
    moment: &Moment,
    mode: Mode,
    unit: usize,
    delay_us: u64,
    ws: Option<&WorkingSet>,
) -> Wake {
    let c = Console::new(dir, "wake");
    let mem_path = dir.join("memory");
    let regions = moment.ram_regions();
    let source = FileSource::open(&mem_path, &regions)
        .expect("memory file")
        .with_delay(Duration::from_micros(delay_us));
    if mode == Mode::Warm {
        // The page cache holds the file: read it once.
        let mut f = File::open(&mem_path).expect("memory file");
        std::io::copy(&mut f, &mut std::io::sink()).expect("read");
    } else {
        source.evict_cache().expect("fadvise");
    }
    let t0 = Instant::now();
    let (running, p) = match mode {
        Mode::Warm => {
            let mem = memory::map_file_private(&mem_path, &regions).expect("map");
            let vmm = vmm::restore(&c.config(MEM_MIB), mem, RamBacking::Private, moment)
                .expect("restore");
            (vmm.start().expect("start"), None)
        }
        _ => {
            let opts = LazyOptions {
                unit,
                prefetch: ws.cloned().filter(|_| mode != Mode::Cold),
                ..LazyOptions::default()
            };
            let vmm = pagein::restore_lazy(&c.config(MEM_MIB), moment, Arc::new(source), opts)
                .expect("lazy restore");
            let p = vmm.pagein().expect("page-in").clone();
            if mode == Mode::PrefetchFirst {
                assert!(p.wait_prefetch(WAIT), "prefetch");
            }
            (vmm.start().expect("start"), Some(p))
        }
    };
    let running_ms = ms(t0.elapsed());
    c.command(&format!("sum {DIRTY_MIB}"), "SUM");
    let ttuw_ms = ms(t0.elapsed());
    let out = Wake {
        running_ms,
        ttuw_ms,
        stats: p.as_ref().map(|p| p.stats()),
        working_set: p.as_ref().map(|p| p.working_set()),
    };
    running.handle().stop();
    out
}

fn main() {
    let a = args();
    let dir = std::env::temp_dir().join(format!("tine-bench-pagein-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    // Not tmpfs: the cold case drops the file from the page cache.
    println!(
        "bench/pagein: {MEM_MIB} MiB micro-memtouch guest, {DIRTY_MIB} MiB dirtied, {} runs each, scratch {}",
        a.runs,
        dir.display()
    );

    let (dirty_ms, idle_ms, touch_on, touch_again, touch_off) = bench_dirty_log(&dir, a.runs);
    println!("dirty log ({DIRTY_MIB} MiB dirtied since the base): median {dirty_ms:.3} ms; idle (nothing dirtied): {idle_ms:.3} ms");
    println!(
        "guest `touch {DIRTY_MIB}` (rewrite): tracked, first since the base {touch_on:.1} ms, again after a collection {touch_again:.1} ms; untracked {touch_off:.1} ms"
    );

    let moment = make_snapshot(&dir);
    let cold_src = if a.delay_us > 0 {
        format!("a source sleeping {} µs per fill", a.delay_us)
    } else {
        "the memory file with its page cache dropped".to_string()
    };

    // Units: cold ttuw per page-in unit.
    let mut by_unit = Vec::new();
    for unit in [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20] {
        let mut v: Vec<f64> = (0..a.runs)
            .map(|_| wake(&dir, &moment, Mode::Cold, unit, a.delay_us, None).ttuw_ms)
            .collect();
        let m = median(&mut v);
        println!("cold ttuw, unit {:>4} KiB: median {m:.1} ms", unit >> 10);
        by_unit.push((unit, m));
    }
    let unit = pagein::DEFAULT_UNIT;

    // The working set the prefetching wakes use: recorded by a cold wake.
    let first = wake(&dir, &moment, Mode::Cold, unit, a.delay_us, None);
    let ws = first.working_set.expect("working set");
    println!(
        "working set recorded by a cold wake: {:.1} MiB in {} ranges",
        ws.bytes() as f64 / (1 << 20) as f64,
        ws.ranges.len()
    );

    let modes = [Mode::Warm, Mode::Cold, Mode::Prefetch, Mode::PrefetchFirst];
    let mut running = vec![Vec::new(); modes.len()];
    let mut ttuw = vec![Vec::new(); modes.len()];
    let mut last_stats = vec![None; modes.len()];
    for _ in 0..a.runs {
        // Interleaved, so load on the shared machine hits all alike.
        for (i, &m) in modes.iter().enumerate() {
            let w = wake(&dir, &moment, m, unit, a.delay_us, Some(&ws));
            running[i].push(w.running_ms);
            ttuw[i].push(w.ttuw_ms);
            last_stats[i] = w.stats;
        }
    }
    let med: Vec<(f64, f64)> = (0..modes.len())
        .map(|i| (median(&mut running[i]), median(&mut ttuw[i])))
        .collect();
    println!("wake (unit {} KiB; cold = {cold_src}):", unit >> 10);
    for (i, m) in modes.iter().enumerate() {
        println!(
            "  {:<14} running {:>7.2} ms   ttuw {:>8.1} ms   {}",
            format!("{m:?}"),
            med[i].0,
            med[i].1,
            last_stats[i]
                .as_ref()
                .map(|s| format!(
                    "(faults {} units, prefetched {}, fill {:.1} ms)",
                    s.fault_units, s.prefetch_units, s.fill_ms
                ))
                .unwrap_or_default()
        );
    }
    let warm = med[0].1;
    let ratio = med[2].1 / warm;
    let ratio_first = med[3].1 / warm;
    println!(
        "cold_vs_warm {:.2}, cold_prefetch_vs_warm {ratio:.2} (prefetch before start: {ratio_first:.2}); target <= 1.2",
        med[1].1 / warm
    );
    let best_unit = by_unit
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .map(|u| u.0 >> 10)
        .unwrap_or(0);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "dirty_log_ms={dirty_ms:.3} dirty_log_idle_ms={idle_ms:.3} touch_tracked_ms={touch_on:.1} touch_after_collect_ms={touch_again:.1} touch_untracked_ms={touch_off:.1} warm_running_ms={:.2} cold_running_ms={:.2} warm_ttuw_ms={warm:.1} cold_ttuw_ms={:.1} prefetch_ttuw_ms={:.1} prefetch_first_ttuw_ms={:.1} cold_prefetch_vs_warm={ratio:.2} unit_kib={} best_unit_kib={best_unit} delay_us={}",
        med[0].0,
        med[1].0,
        med[1].1,
        med[2].1,
        med[3].1,
        unit >> 10,
        a.delay_us
    );
}
