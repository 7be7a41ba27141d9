//! Lazy page-in: a vm woken from stored memory runs before its memory is
//! read. Guest RAM is anonymous MAP_PRIVATE memory registered with a
//! userfaultfd (missing mode); a handler thread serves each first touch
//! (by a vCPU through KVM, or by a device thread of this VMM) from a
//! [`PageSource`], one unit of [`LazyOptions::unit`] bytes at a time.
//!
//! - The handler runs in its own thread and touches no guest memory, so a
//!   device thread that faults while holding a device lock cannot
//!   deadlock it (it only waits for the handler, which waits for nothing
//!   but the source).
//! - A fault the source cannot serve (a corrupt chunk, a missing file)
//!   ends the vm: the exit is reported as crashed with what failed (the
//!   exit record's reason names the guest range and the source's error),
//!   and the faulting threads stay blocked until the process exits. They
//!   are never woken onto memory that was not filled. A failure during
//!   the restore itself (before [`PageIn::attach`]) unblocks the
//!   restoring thread with zero pages instead and the attach refuses the
//!   vm, so [`restore_lazy`] returns the error and nothing runs.
//! - The working set: the units first touched during the first
//!   [`LazyOptions::record_for`] after the wake, in touch order, written
//!   to [`LazyOptions::working_set_out`] when the window closes (and
//!   readable at any time). Given back as [`LazyOptions::prefetch`] on the
//!   next wake, a prefetch thread fills them in that order while the
//!   vCPUs start; faults are served first, the prefetcher skips what they
//!   filled.
//! - fork(2): registration is not inherited by a child without
//!   UFFD_FEATURE_EVENT_FORK (its missing pages would read as zeros), and
//!   serving a child's faults from this process would tie the two. So
//!   before a vm whose RAM is lazy is forked (fork, checkpoint, full
//!   snapshot) [`PageIn::make_resident`] fills every remaining unit and
//!   unregisters: the vm then has ordinary private memory. A diff-layer
//!   snapshot needs no residency (its pages are dirty, hence present).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use crate::exit::{ExitNotifier, GuestExit};
use crate::memory::{self, GuestMemoryMmap, MemoryError};
use crate::uffd::{Resolve, Uffd};

/// Page size of every range here.
const PAGE: u64 = 4096;

/// Default unit of a fill. Each fault costs a vCPU <-> handler round trip
/// (~150-400 µs on this loaded 2-core host, bench/pagein): 4 KiB units
/// made a 64 MiB working set 7-10x slower than 64 KiB ones; 64 KiB to
/// 2 MiB were within noise for a sequential set, and larger units read
/// more that a scattered set does not need. A store-backed source may
/// set its chunk size instead (docs/design/store.md).
pub const DEFAULT_UNIT: usize = 256 << 10;

/// An error a [`PageSource`] reports (its message should name what
/// failed: the snapshot, the chunk, the file).
pub type SourceError = Box<dyn std::error::Error + Send + Sync>;

/// What a fill produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fill {
    /// `buf` holds the bytes.
    Data,
    /// The range is all zeros (`buf` is unspecified): the zero page is
    /// mapped, no memory used until the guest writes.
    Zero,
}

/// Where the bytes of a lazily woken vm's RAM come from (a local memory
/// file, the store's chunk cache, the store itself).
pub trait PageSource: Send + Sync {
    /// Fills `buf` with guest RAM from guest-physical `gpa`. `gpa` and
    /// `buf.len()` are multiples of 4 KiB and the range lies inside one
    /// RAM region. Called from the page-in threads, concurrently.
    fn fill(&self, gpa: u64, buf: &mut [u8]) -> Result<Fill, SourceError>;

    /// How many fills at once the prefetch should run when
    /// [`LazyOptions::prefetch_threads`] leaves it to the source: a
    /// source with per-request latency (a remote store) is read faster
    /// with more requests in flight than a local file is.
    fn prefetch_threads(&self) -> usize {
        DEFAULT_PREFETCH_THREADS
    }

    /// Units after a faulting one to fill in the background (on as many
    /// threads as the prefetch) when [`LazyOptions::readahead`] leaves it
    /// to the source: worth it where each fill waits for a round trip, so
    /// that a guest reading on does not wait for one unit after another.
    fn readahead(&self) -> usize {
        0
    }
}

/// Prefetch threads for a source that states no preference.
pub const DEFAULT_PREFETCH_THREADS: usize = 4;

/// How a lazy wake runs.
#[derive(Clone, Debug)]
pub struct LazyOptions {
    /// Bytes per fill (a multiple of 4 KiB): a fault fills the aligned
    /// unit around it.
    pub unit: usize,
    /// How long after the wake first touches count as the working set.
    pub record_for: Duration,
    /// Where the working set is written (JSON, [`WorkingSet`]) when the
    /// window closes.
    pub working_set_out: Option<PathBuf>,
    /// A working set recorded by an earlier wake: filled in its order
    /// while the vCPUs start.
    pub prefetch: Option<WorkingSet>,
    /// Threads filling the prefetch list, taking its units in order (a
    /// source with latency, e.g. a remote store, is read in parallel);
    /// 0: as many as the source asks for ([`PageSource::prefetch_threads`]).
    pub prefetch_threads: usize,
    /// Units after a faulting one filled in the background (in its
    /// region, those still missing); None: as many as the source asks
    /// for ([`PageSource::readahead`]), 0: none.
    pub readahead: Option<usize>,
}

impl Default for LazyOptions {
    fn default() -> Self {
        Self {
            unit: DEFAULT_UNIT,
            record_for: Duration::from_secs(5),
            working_set_out: None,
            prefetch: None,
            prefetch_threads: 0,
            readahead: None,
        }
    }
}

/// Guest ranges touched first after a wake, in the order they were
/// first touched.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkingSet {
    /// `(guest address, bytes)`, page aligned.
    pub ranges: Vec<(u64, u64)>,
    /// How long the recording window was.
    pub window_ms: u64,
}

impl WorkingSet {
    /// Bytes in the set.
    pub fn bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.1).sum()
    }

    /// Reads a working set written by a wake.
    pub fn read(path: &Path) -> Result<Self, PageInError> {
        let bytes = std::fs::read(path).map_err(|source| PageInError::WorkingSet {
            path: path.into(),
            source,
        })?;
        serde_json::from_slice(&bytes).map_err(|e| PageInError::WorkingSet {
            path: path.into(),
            source: std::io::Error::other(e),
        })
    }

    /// Writes it as JSON (atomically: a temporary file renamed).
    pub fn write(&self, path: &Path) -> Result<(), PageInError> {
        let err = |source| PageInError::WorkingSet {
            path: path.into(),
            source,
        };
        let json = serde_json::to_vec(self).map_err(|e| err(std::io::Error::other(e)))?;
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, json).map_err(err)?;
        std::fs::rename(&tmp, path).map_err(err)
    }
}

/// Counters of a lazy wake.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct PageInStats {
    /// Fault messages read.
    pub faults: u64,
    /// Units filled because of a fault.
    pub fault_units: u64,
    /// Units filled by the prefetcher.
    pub prefetch_units: u64,
    /// Units filled by the readahead after a fault.
    #[serde(default)]
    pub readahead_units: u64,
    /// Units filled by [`PageIn::make_resident`].
    pub resident_units: u64,
    /// Units the source said were zero.
    pub zero_units: u64,
    /// Time spent in the source's fill, all threads.
    pub fill_ms: f64,
    /// Prefetch done (or none asked for).
    pub prefetch_done: bool,
    /// Ms from the start of the wake to the end of the prefetch.
    pub prefetch_ms: Option<f64>,
    /// Every unit present and the ranges unregistered.
    pub resident: bool,
    /// What failed, if a fill did.
    pub error: Option<String>,
}

/// Errors setting up or running lazy page-in.
#[derive(Debug, thiserror::Error)]
pub enum PageInError {
    #[error("Cannot create a userfaultfd (needs root or CAP_SYS_PTRACE)")]
    Uffd(#[source] std::io::Error),
    #[error("Cannot register guest RAM at {addr:#x} with the userfaultfd")]
    Register {
        addr: u64,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error("Unit of {0} bytes: give a multiple of 4096, at least 4096")]
    Unit(usize),
    #[error("Cannot start the {0} thread")]
    Thread(&'static str, #[source] std::io::Error),
    #[error("{0}")]
    Failed(String),
    #[error("Cannot unregister guest RAM from the userfaultfd")]
    Unregister(#[source] std::io::Error),
    #[error("Working set {path}")]
    WorkingSet {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Unit states.
const MISSING: u8 = 0;
const BUSY: u8 = 1;
const DONE: u8 = 2;

/// Who fills a unit.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cause {
    Fault,
    Prefetch,
    Readahead,
    Resident,
}

struct Region {
    host: u64,
    gpa: u64,
    len: u64,
    /// Index of this region's first unit.
    first_unit: usize,
}

struct Recorder {
    until: Instant,
    closed: bool,
    /// Units first touched by a fault, in order.
    order: Vec<usize>,
    seen: Vec<bool>,
}

struct Shared {
    uffd: Uffd,
    regions: Vec<Region>,
    unit: u64,
    units: Vec<AtomicU8>,
    source: Arc<dyn PageSource>,
    started: Instant,
    options: LazyOptions,
    recorder: Mutex<Recorder>,
    error: Mutex<Option<String>>,
    exit: Mutex<Option<Arc<ExitNotifier>>>,
    stop: AtomicBool,
    stop_evt: EventFd,
    resident: AtomicBool,
    faults: AtomicU64,
    fault_units: AtomicU64,
    prefetch_units: AtomicU64,
    resident_units: AtomicU64,
    zero_units: AtomicU64,
    fill_ns: AtomicU64,
    prefetch_ns: AtomicU64,
    prefetch_done: AtomicBool,
    /// The prefetch list as units, in order, and the next one to take.
    prefetch_units_list: Vec<usize>,
    prefetch_next: AtomicUsize,
    prefetch_running: AtomicUsize,
    /// Units after a fault to read ahead, and the queue the readahead
    /// threads take them from, in order.
    readahead: usize,
    readahead_queue: Mutex<std::collections::VecDeque<usize>>,
    readahead_cv: Condvar,
    readahead_units: AtomicU64,
}

/// A lazily paged-in guest RAM: its userfaultfd, handler and prefetch
/// threads. Keep it alive as long as the vm runs ([`crate::Vmm`] holds it
/// once attached).
pub struct PageIn {
    shared: Arc<Shared>,
    mem: GuestMemoryMmap,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl std::fmt::Debug for PageIn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageIn")
            .field("unit", &self.shared.unit)
            .field("units", &self.shared.units.len())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl PageIn {
    /// Maps empty guest RAM at the layout of `regions`, registers it and
    /// starts the handler (and, with [`LazyOptions::prefetch`], the
    /// prefetcher). Returns with the threads running: restore the vm on
    /// [`PageIn::memory`] next (the restore itself may fault).
    pub fn start(
        regions: &[(GuestAddress, usize)],
        source: Arc<dyn PageSource>,
        options: LazyOptions,
    ) -> Result<Arc<Self>, PageInError> {
        let unit = options.unit;
        if unit == 0 || unit as u64 % PAGE != 0 {
            return Err(PageInError::Unit(unit));
        }
        let unit = unit as u64;
        let mem = memory::map_anonymous_private(regions)?;
        let uffd = Uffd::new().map_err(PageInError::Uffd)?;
        let mut regs = Vec::new();
        let mut units = 0usize;
        for r in mem.iter() {
            let host = r.as_ptr() as u64;
            uffd.register(host, r.len())
                .map_err(|source| PageInError::Register {
                    addr: r.start_addr().0,
                    source,
                })?;
            regs.push(Region {
                host,
                gpa: r.start_addr().0,
                len: r.len(),
                first_unit: units,
            });
            units += r.len().div_ceil(unit) as usize;
        }
        let started = Instant::now();
        let prefetch_units_list = match &options.prefetch {
            Some(ws) => units_of(&regs, unit, &ws.ranges, units),
            None => Vec::new(),
        };
        let workers = match options.prefetch_threads {
            0 => source.prefetch_threads().max(1),
            n => n,
        };
        let prefetchers = if options.prefetch.is_some() {
            workers
        } else {
            0
        };
        let readahead = options.readahead.unwrap_or_else(|| source.readahead());
        let readaheaders = if readahead > 0 { workers } else { 0 };
        let shared = Arc::new(Shared {
            uffd,
            regions: regs,
            unit,
            units: (0..units).map(|_| AtomicU8::new(MISSING)).collect(),
            source,
            started,
            recorder: Mutex::new(Recorder {
                until: started + options.record_for,
                closed: false,
                order: Vec::new(),
                seen: vec![false; units],
            }),
            options,
            error: Mutex::new(None),
            exit: Mutex::new(None),
            stop: AtomicBool::new(false),
            stop_evt: EventFd::new(libc::EFD_NONBLOCK)
                .map_err(|e| PageInError::Thread("page-in", e))?,
            resident: AtomicBool::new(false),
            faults: AtomicU64::new(0),
            fault_units: AtomicU64::new(0),
            prefetch_units: AtomicU64::new(0),
            resident_units: AtomicU64::new(0),
            zero_units: AtomicU64::new(0),
            fill_ns: AtomicU64::new(0),
            prefetch_ns: AtomicU64::new(0),
            prefetch_done: AtomicBool::new(false),
            prefetch_units_list,
            prefetch_next: AtomicUsize::new(0),
            prefetch_running: AtomicUsize::new(prefetchers),
            readahead,
            readahead_queue: Mutex::new(std::collections::VecDeque::new()),
            readahead_cv: Condvar::new(),
            readahead_units: AtomicU64::new(0),
        });
        let mut threads = Vec::new();
        let s = shared.clone();
        threads.push(
            std::thread::Builder::new()
                .name("page-in".into())
                .spawn(move || {
                    crate::seccomp::apply(crate::seccomp::Thread::PageIn);
                    s.handler_loop()
                })
                .map_err(|e| PageInError::Thread("page-in", e))?,
        );
        for _ in 0..prefetchers {
            let s = shared.clone();
            threads.push(spawn("prefetch", move || {
                crate::seccomp::apply(crate::seccomp::Thread::PageIn);
                s.prefetch()
            })?);
        }
        for _ in 0..readaheaders {
            let s = shared.clone();
            threads.push(spawn("readahead", move || {
                crate::seccomp::apply(crate::seccomp::Thread::PageIn);
                s.readahead_loop()
            })?);
        }
        if prefetchers == 0 {
            shared.prefetch_done.store(true, Ordering::Release);
        }
        Ok(Arc::new(Self {
            shared,
            mem,
            threads: Mutex::new(threads),
        }))
    }

    /// The guest RAM (restore the vm on a clone of it).
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    /// From now on a failed fill ends the vm through `exit`. Returns the
    /// failure if one happened already (during the restore).
    pub fn attach(&self, exit: Arc<ExitNotifier>) -> Result<(), PageInError> {
        *lock(&self.shared.exit) = Some(exit.clone());
        match lock(&self.shared.error).clone() {
            Some(e) => {
                exit.fail(GuestExit::Crashed, e.clone());
                Err(PageInError::Failed(e))
            }
            None => Ok(()),
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> PageInStats {
        let s = &self.shared;
        let ms = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1e6;
        let done = s.prefetch_done.load(Ordering::Acquire);
        PageInStats {
            faults: s.faults.load(Ordering::Relaxed),
            fault_units: s.fault_units.load(Ordering::Relaxed),
            prefetch_units: s.prefetch_units.load(Ordering::Relaxed),
            readahead_units: s.readahead_units.load(Ordering::Relaxed),
            resident_units: s.resident_units.load(Ordering::Relaxed),
            zero_units: s.zero_units.load(Ordering::Relaxed),
            fill_ms: ms(&s.fill_ns),
            prefetch_done: done,
            prefetch_ms: (done && s.options.prefetch.is_some()).then(|| ms(&s.prefetch_ns)),
            resident: s.resident.load(Ordering::Acquire),
            error: lock(&s.error).clone(),
        }
    }

    /// The working set so far: a prefetched wake's list first (those
    /// units never fault, so whether the guest used them is unknown: the
    /// set only grows), then the units first touched by a fault during
    /// the window, in touch order.
    pub fn working_set(&self) -> WorkingSet {
        self.shared.working_set()
    }

    /// Waits until the prefetch is done (or the vm failed); true if it is.
    pub fn wait_prefetch(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while !self.shared.prefetch_done.load(Ordering::Acquire) {
            if Instant::now() >= deadline || lock(&self.shared.error).is_some() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// Fills every unit not yet present (from this thread; the handler
    /// goes on serving faults meanwhile), then unregisters guest RAM and
    /// stops the threads: the memory is ordinary private memory, safe to
    /// fork(2). The working set is written first if its window is open
    /// (the memory no longer faults afterwards). Idempotent.
    pub fn make_resident(&self) -> Result<(), PageInError> {
        let s = &self.shared;
        if s.resident.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut buf = vec![0u8; s.unit as usize];
        for u in 0..s.units.len() {
            s.serve(u, Cause::Resident, &mut buf);
            if let Some(e) = lock(&s.error).clone() {
                return Err(PageInError::Failed(e));
            }
        }
        // Units the handler or the prefetcher were filling must be in
        // before the ranges are unregistered: unregistering wakes the
        // threads waiting on them, which would then fault in zero pages.
        for state in &s.units {
            while state.load(Ordering::Acquire) != DONE {
                if let Some(e) = lock(&s.error).clone() {
                    return Err(PageInError::Failed(e));
                }
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        s.close_recording();
        for r in &s.regions {
            s.uffd
                .unregister(r.host, r.len)
                .map_err(PageInError::Unregister)?;
        }
        s.resident.store(true, Ordering::Release);
        self.stop_threads();
        Ok(())
    }

    fn stop_threads(&self) {
        self.shared.stop.store(true, Ordering::Release);
        let _ = self.shared.stop_evt.write(1);
        {
            // Under the queue's lock, so no readahead thread misses it
            // between its check of `stop` and its wait.
            let _q = lock(&self.shared.readahead_queue);
            self.shared.readahead_cv.notify_all();
        }
        for t in std::mem::take(&mut *lock(&self.threads)) {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn handler_loop(&self) {
        let mut faults = Vec::new();
        let mut buf = vec![0u8; self.unit as usize];
        loop {
            let timeout = self.recording_timeout();
            let mut fds = [
                libc::pollfd {
                    fd: self.uffd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.stop_evt.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: polls two valid pollfds.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            if n == 0 {
                self.close_recording();
                continue;
            }
            if n < 0 {
                continue;
            }
            if let Err(e) = self.uffd.read_faults(&mut faults) {
                self.fail(format!("cannot read the userfaultfd: {e}"));
                return;
            }
            for f in &faults {
                self.faults.fetch_add(1, Ordering::Relaxed);
                let Some(u) = self.unit_of_host(f.addr) else {
                    self.fail(format!("fault at {:#x} outside guest RAM", f.addr));
                    return;
                };
                if lock(&self.error).is_some() {
                    if lock(&self.exit).is_some() {
                        // Stop serving: the vm is ending; the threads that
                        // faulted stay blocked until the process exits.
                        return;
                    }
                    // Failed during the restore, before the vm was
                    // attached: [`PageIn::attach`] will refuse it, so no
                    // vCPU ever runs; unblock the restoring thread.
                    self.unblock(u);
                    continue;
                }
                self.record(u);
                self.queue_readahead(u);
                self.serve(u, Cause::Fault, &mut buf);
                if lock(&self.error).is_some() && lock(&self.exit).is_none() {
                    self.unblock(u);
                }
            }
            if self.recording_due() {
                self.close_recording();
            }
        }
    }

    /// One prefetch thread: takes the next unit of the list until it is
    /// empty; the last thread to finish marks the prefetch done.
    fn prefetch(&self) {
        let mut buf = vec![0u8; self.unit as usize];
        loop {
            if self.stop.load(Ordering::Acquire) || lock(&self.error).is_some() {
                break;
            }
            let i = self.prefetch_next.fetch_add(1, Ordering::Relaxed);
            let Some(&u) = self.prefetch_units_list.get(i) else {
                break;
            };
            self.serve(u, Cause::Prefetch, &mut buf);
        }
        if self.prefetch_running.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.prefetch_ns
                .store(self.started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            self.prefetch_done.store(true, Ordering::Release);
        }
    }

    /// Queues the units after `u` (in its region, still missing) for the
    /// readahead threads; older entries beyond a few faults' worth are
    /// dropped (the guest has moved on).
    fn queue_readahead(&self, u: usize) {
        if self.readahead == 0 {
            return;
        }
        let Some(r) = self.regions.iter().rev().find(|r| r.first_unit <= u) else {
            return;
        };
        let end = r.first_unit + r.len.div_ceil(self.unit) as usize;
        let mut q = lock(&self.readahead_queue);
        let mut added = false;
        for v in (u + 1..end).take(self.readahead) {
            if self.units[v].load(Ordering::Acquire) == MISSING {
                q.push_back(v);
                added = true;
            }
        }
        while q.len() > 4 * self.readahead {
            q.pop_front();
        }
        if added {
            self.readahead_cv.notify_all();
        }
    }

    /// One readahead thread: fills queued units until the page-in stops.
    /// A unit it fills while the recording window is open joins the
    /// working set (the guest does not fault on it, so whether it is used
    /// is unknown; the set may hold a few units past where a read ended).
    fn readahead_loop(&self) {
        let mut buf = vec![0u8; self.unit as usize];
        loop {
            let next = {
                let mut q = lock(&self.readahead_queue);
                loop {
                    if self.stop.load(Ordering::Acquire) || lock(&self.error).is_some() {
                        return;
                    }
                    if let Some(v) = q.pop_front() {
                        break v;
                    }
                    q = self
                        .readahead_cv
                        .wait_timeout(q, Duration::from_millis(100))
                        .map(|(g, _)| g)
                        .unwrap_or_else(|e| e.into_inner().0);
                }
            };
            if self.units[next].load(Ordering::Acquire) == MISSING {
                self.record(next);
                self.serve(next, Cause::Readahead, &mut buf);
            }
        }
    }

    /// Fills unit `u` unless someone else has or is doing it; every
    /// UFFDIO_COPY wakes the threads waiting on its range, so a fault on
    /// a unit another thread fills is resolved by that thread.
    fn serve(&self, u: usize, cause: Cause, buf: &mut [u8]) {
        let Some(state) = self.units.get(u) else {
            return;
        };
        if state
            .compare_exchange(MISSING, BUSY, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            if state.load(Ordering::Acquire) == DONE && cause == Cause::Fault {
                // Filled between the fault and now: the fill woke it, but
                // a wake is cheap and makes sure.
                let (host, _, len) = self.unit_range(u);
                let _ = self.uffd.wake(host, len);
            }
            return;
        }
        let (host, gpa, len) = self.unit_range(u);
        let buf = &mut buf[..len as usize];
        let t = Instant::now();
        let filled = self.source.fill(gpa, buf);
        self.fill_ns
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let res = match filled {
            Ok(Fill::Data) => {
                // SAFETY: host..host+len is a unit of a registered range.
                unsafe { self.uffd.copy(host, buf) }.map(|r| (r, false))
            }
            Ok(Fill::Zero) => {
                self.zero_units.fetch_add(1, Ordering::Relaxed);
                // SAFETY: as above.
                unsafe { self.uffd.zeropage(host, len) }.map(|r| (r, true))
            }
            Err(e) => {
                self.fail(format!(
                    "page-in of guest {gpa:#x}..{:#x} failed: {}",
                    gpa + len,
                    crate::trace::chain(e.as_ref())
                ));
                return;
            }
        };
        match res {
            Ok((Resolve::Done, _)) => {}
            Ok((Resolve::Exists { done }, zero)) => {
                // Part of the unit was present already (only if something
                // bypassed these states); fill the rest page by page.
                let mut off = (done as u64 / PAGE) * PAGE;
                while off < len {
                    let r = if zero {
                        // SAFETY: one page of the unit.
                        unsafe { self.uffd.zeropage(host + off, PAGE) }
                    } else {
                        // SAFETY: one page of the unit.
                        unsafe {
                            self.uffd
                                .copy(host + off, &buf[off as usize..(off + PAGE) as usize])
                        }
                    };
                    if let Err(e) = r {
                        self.fail(format!("cannot install guest page {:#x}: {e}", gpa + off));
                        return;
                    }
                    off += PAGE;
                }
            }
            Err(e) => {
                self.fail(format!(
                    "cannot install guest {gpa:#x}..{:#x}: {e}",
                    gpa + len
                ));
                return;
            }
        }
        state.store(DONE, Ordering::Release);
        match cause {
            Cause::Fault => &self.fault_units,
            Cause::Prefetch => &self.prefetch_units,
            Cause::Readahead => &self.readahead_units,
            Cause::Resident => &self.resident_units,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    /// Maps the zero page over unit `u` so the thread faulting on it goes
    /// on: only for a vm that failed before it was attached (it will
    /// never run).
    fn unblock(&self, u: usize) {
        let Some(state) = self.units.get(u) else {
            return;
        };
        if state.swap(DONE, Ordering::AcqRel) != DONE {
            let (host, _, len) = self.unit_range(u);
            // SAFETY: host..host+len is a unit of a registered range.
            let _ = unsafe { self.uffd.zeropage(host, len) };
        }
        let (host, _, len) = self.unit_range(u);
        let _ = self.uffd.wake(host, len);
    }

    /// (host address, guest address, bytes) of unit `u`.
    fn unit_range(&self, u: usize) -> (u64, u64, u64) {
        let r = self
            .regions
            .iter()
            .rev()
            .find(|r| r.first_unit <= u)
            .unwrap_or(&self.regions[0]);
        let off = (u - r.first_unit) as u64 * self.unit;
        (r.host + off, r.gpa + off, self.unit.min(r.len - off))
    }

    fn unit_of_host(&self, addr: u64) -> Option<usize> {
        self.regions
            .iter()
            .find(|r| addr >= r.host && addr < r.host + r.len)
            .map(|r| r.first_unit + ((addr - r.host) / self.unit) as usize)
    }

    fn record(&self, u: usize) {
        let mut r = lock(&self.recorder);
        if r.closed || Instant::now() >= r.until {
            return;
        }
        if let Some(seen) = r.seen.get_mut(u) {
            if !*seen {
                *seen = true;
                r.order.push(u);
            }
        }
    }

    fn recording_due(&self) -> bool {
        let r = lock(&self.recorder);
        !r.closed && Instant::now() >= r.until
    }

    /// Poll timeout until the recording window closes (ms; -1: none).
    fn recording_timeout(&self) -> i32 {
        let r = lock(&self.recorder);
        if r.closed {
            return -1;
        }
        let left = r.until.saturating_duration_since(Instant::now());
        i32::try_from(left.as_millis() + 1).unwrap_or(i32::MAX)
    }

    /// Ends the recording window and writes the working set, once.
    fn close_recording(&self) {
        {
            let mut r = lock(&self.recorder);
            if r.closed {
                return;
            }
            r.closed = true;
        }
        if let Some(path) = &self.options.working_set_out {
            if let Err(e) = self.working_set().write(path) {
                tracing::warn!("cannot write the working set: {}", crate::trace::chain(&e));
            }
        }
    }

    fn working_set(&self) -> WorkingSet {
        let mut ranges: Vec<(u64, u64)> = self
            .options
            .prefetch
            .as_ref()
            .map(|w| w.ranges.clone())
            .unwrap_or_default();
        let order = lock(&self.recorder).order.clone();
        let in_prefetch = |gpa: u64| {
            self.options.prefetch.as_ref().is_some_and(|w| {
                w.ranges
                    .iter()
                    .any(|&(s, l)| gpa >= s && gpa < s.saturating_add(l))
            })
        };
        for u in order {
            let (_, gpa, len) = self.unit_range(u);
            if in_prefetch(gpa) {
                continue;
            }
            match ranges.last_mut() {
                Some((s, l)) if *s + *l == gpa => *l += len,
                _ => ranges.push((gpa, len)),
            }
        }
        WorkingSet {
            ranges,
            window_ms: self.options.record_for.as_millis() as u64,
        }
    }

    fn fail(&self, what: String) {
        {
            let mut e = lock(&self.error);
            if e.is_some() {
                return;
            }
            *e = Some(what.clone());
        }
        tracing::error!("{what}; the vm ends");
        if let Some(exit) = lock(&self.exit).as_ref() {
            exit.fail(GuestExit::Crashed, what);
        }
    }
}

impl Drop for PageIn {
    fn drop(&mut self) {
        self.stop_threads();
    }
}

/// The units holding `ranges` of guest addresses, in order, each once
/// (what is not RAM is skipped: a set from another layout).
fn units_of(regions: &[Region], unit: u64, ranges: &[(u64, u64)], units: usize) -> Vec<usize> {
    let mut seen = vec![false; units];
    let mut out = Vec::new();
    for &(gpa, len) in ranges {
        let end = gpa.saturating_add(len);
        let mut a = gpa;
        while a < end {
            if let Some(r) = regions.iter().find(|r| a >= r.gpa && a < r.gpa + r.len) {
                let u = r.first_unit + ((a - r.gpa) / unit) as usize;
                if let Some(s) = seen.get_mut(u) {
                    if !*s {
                        *s = true;
                        out.push(u);
                    }
                }
                a = r.gpa + ((a - r.gpa) / unit + 1) * unit;
            } else {
                a = (a / PAGE + 1) * PAGE;
            }
        }
    }
    out
}

/// A [`PageSource`] reading a memory file at the RAM layout (a snapshot
/// directory's `memory`: regions at consecutive offsets, holes for zero
/// pages), for tests, benches and local wakes.
pub struct FileSource {
    file: File,
    path: PathBuf,
    /// (guest start, bytes, file offset) per region.
    regions: Vec<(u64, u64, u64)>,
    delay: Duration,
}

impl FileSource {
    /// Opens `path` laid out as `regions`.
    pub fn open(path: &Path, regions: &[(GuestAddress, usize)]) -> std::io::Result<Self> {
        let file = File::open(path)?;
        let mut off = 0;
        let regions = regions
            .iter()
            .map(|&(a, l)| {
                let r = (a.0, l as u64, off);
                off += l as u64;
                r
            })
            .collect();
        Ok(Self {
            file,
            path: path.into(),
            regions,
            delay: Duration::ZERO,
        })
    }

    /// Sleeps this long in every fill (a deliberately slow source: a
    /// remote store's latency per request).
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Drops the file's pages from the page cache (POSIX_FADV_DONTNEED),
    /// so the next reads come from the disk: a cold source.
    pub fn evict_cache(&self) -> std::io::Result<()> {
        // SAFETY: fadvise on an open fd; offset 0, len 0 means the file.
        let rc =
            unsafe { libc::posix_fadvise(self.file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        Ok(())
    }
}

impl PageSource for FileSource {
    fn fill(&self, gpa: u64, buf: &mut [u8]) -> Result<Fill, SourceError> {
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        let (start, _, foff) = self
            .regions
            .iter()
            .find(|&&(s, l, _)| gpa >= s && gpa + buf.len() as u64 <= s + l)
            .ok_or_else(|| format!("{}: guest {gpa:#x} is outside its RAM", self.path.display()))?;
        let off = foff + (gpa - start);
        // A hole (never written) reads as zeros: map the zero page
        // without reading.
        // SAFETY: lseek on an open fd changes only its offset.
        let data =
            unsafe { libc::lseek(self.file.as_raw_fd(), off as libc::off_t, libc::SEEK_DATA) };
        let no_data_after =
            data < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO);
        if no_data_after || (data >= 0 && data as u64 >= off + buf.len() as u64) {
            return Ok(Fill::Zero);
        }
        self.file
            .read_exact_at(buf, off)
            .map_err(|e| format!("{}: read at {off:#x}: {e}", self.path.display()))?;
        if buf.iter().all(|&b| b == 0) {
            return Ok(Fill::Zero);
        }
        Ok(Fill::Data)
    }
}

/// Restores a vm from `moment` with lazily paged-in RAM: maps and
/// registers empty RAM, starts the handler (and prefetcher), restores
/// the machine on it (a new copy: new generation id) and attaches the
/// page-in to the vm. Run it with [`crate::process::serve`] or
/// [`crate::Vmm::start`]; for a diff against the stored snapshot, call
/// [`crate::Vmm::track_dirty`] with its label before it starts.
pub fn restore_lazy(
    config: &crate::config::VmConfig,
    moment: &crate::moment::Moment,
    source: Arc<dyn PageSource>,
    options: LazyOptions,
) -> Result<crate::Vmm, LazyRestoreError> {
    let pagein = PageIn::start(&moment.ram_regions(), source, options)?;
    let mut vmm = crate::builder::restore(
        config,
        pagein.memory().clone(),
        crate::memory::RamBacking::Private,
        moment,
    )?;
    vmm.attach_pagein(pagein)?;
    Ok(vmm)
}

/// Errors of [`restore_lazy`].
#[derive(Debug, thiserror::Error)]
pub enum LazyRestoreError {
    #[error(transparent)]
    PageIn(#[from] PageInError),
    #[error(transparent)]
    Build(#[from] crate::builder::BuildError),
}

/// Starts one of the page-in's named threads.
fn spawn(
    name: &'static str,
    f: impl FnOnce() + Send + 'static,
) -> Result<JoinHandle<()>, PageInError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| PageInError::Thread(name, e))
}
