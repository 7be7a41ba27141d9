//! The fork path (ARCHITECTURE.md, docs/design/fork.md): freeze a running
//! vm, then start processes that continue from the frozen moment.
//!
//! 1. [`ForkSource::freeze`]: pause every vCPU, park the device thread,
//!    save the [`Moment`], flush and freeze each writable disk's top layer
//!    (it moves to a frozen path; every continuation stacks its own
//!    overlay on it), and move the vsock socket aside so a continuation
//!    can listen on the same path.
//! 2. [`Frozen::spawn`]: fork(2) of this process. The child has one thread
//!    and this process's memory; it closes every inherited fd it was not
//!    told to keep, moves guest RAM to a private copy-on-write view (a
//!    shared memfd is remapped MAP_PRIVATE at the same addresses, which
//!    costs microseconds because fork(2) copied no page tables for it),
//!    and runs its body: restore into a new KVM VM and run (a child or the
//!    parent's continuation), wait as a template (a checkpoint), or write
//!    the frozen view to a directory (a snapshot).
//! 3. The caller ends this process once its continuation runs: guest RAM
//!    the frozen children map must never be written again, and an exiting
//!    process tears its page tables down off the path the guest waits on.
//!    [`Frozen::thaw`] undoes step 1 if no continuation could start.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::config::VmConfig;
use crate::devices::legacy::SerialDevice;
use crate::devices::park::{ParkControl, ParkError};
use crate::devices::persist::{DeviceStates, Persist};
use crate::devices::virtio::mmio::MmioTransport;
use crate::dirty::{self, DirtyTracking, PageBitmap};
use crate::memory::{self, GuestMemoryMmap, MemoryError, RamBacking};
use crate::moment::{DeviceLayout, Moment};
use crate::pagein::{PageIn, PageInError};
use crate::vcpu::Vcpu;
use crate::vm::Vm;
use crate::vstate::{prepare_machine, ControlError, VmmHandle};

pub use crate::trace::{monotonic_ns, trace};

/// Errors on the fork path.
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    #[error("Another fork, checkpoint or snapshot of this vm is in progress")]
    Busy,
    #[error("Cannot pause the vm")]
    Pause(#[source] ControlError),
    #[error("Cannot park the device thread")]
    Park(#[from] ParkError),
    #[error("Cannot save the device state: {0}")]
    DeviceState(String),
    #[error("Cannot freeze disk {index}")]
    Disk {
        index: usize,
        #[source]
        source: disk::DiskError,
    },
    #[error("Cannot create the new top layer of disk {index}")]
    NewTop {
        index: usize,
        #[source]
        source: disk::DiskError,
    },
    #[error("The chain of disk {index} has {depth} layers and a fork, checkpoint or snapshot adds one: the limit is {max}. Fold layers no other vm uses into its top (FoldLayers), after removing the children and checkpoints that keep them")]
    ChainTooDeep {
        index: usize,
        depth: usize,
        max: usize,
    },
    #[error("Disk {index} needs a path for its frozen layer")]
    NoFrozenPath { index: usize },
    #[error("Cannot move the vsock socket {path} aside")]
    Socket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("fork(2) failed")]
    Fork(#[source] std::io::Error),
    #[error("Cannot create a pipe to the new process")]
    Pipe(#[source] std::io::Error),
    #[error("The new process failed: {0}")]
    Child(String),
    #[error("The new process did not report within {0:?}")]
    ChildTimeout(Duration),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error("Cannot make the lazily paged-in memory resident before the fork")]
    PageIn(#[source] PageInError),
}

/// The devices' side of a running vm, for saving them.
pub struct DeviceControl {
    pub serial: Arc<Mutex<SerialDevice>>,
    pub transports: Vec<Arc<Mutex<MmioTransport>>>,
    pub park: ParkControl,
}

impl DeviceControl {
    fn save(&self) -> Result<DeviceStates, ForkError> {
        let state = |e: &dyn std::fmt::Display| ForkError::DeviceState(e.to_string());
        Ok(DeviceStates {
            serial: lock(&self.serial).save().map_err(|e| state(&e))?,
            virtio: self
                .transports
                .iter()
                .map(|t| lock(t).save().map_err(|e| state(&e)))
                .collect::<Result<_, _>>()?,
        })
    }

    /// Calls `f` on writable disk `index` (None: no such disk), holding
    /// its device's lock, as guest I/O does.
    fn with_disk<R>(&self, index: usize, f: impl FnOnce(&mut disk::Disk) -> R) -> Option<R> {
        let mut i = 0;
        for t in &self.transports {
            let t = lock(t);
            let mut dev = t.device().lock().unwrap_or_else(|e| e.into_inner());
            if dev.device_type() != virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK {
                continue;
            }
            if i == index {
                return dev.host_disk().map(f);
            }
            i += 1;
        }
        None
    }

    /// Calls `f` on each block device's writable disk, with its disk index.
    fn for_each_disk(
        &self,
        mut f: impl FnMut(usize, &mut disk::Disk) -> Result<(), ForkError>,
    ) -> Result<(), ForkError> {
        let mut index = 0;
        for t in &self.transports {
            let t = lock(t);
            let mut dev = t.device().lock().unwrap_or_else(|e| e.into_inner());
            if dev.device_type() != virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK {
                continue;
            }
            if let Some(d) = dev.host_disk() {
                f(index, d)?;
            }
            index += 1;
        }
        Ok(())
    }
}

fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What a running vm is forked from: its vCPU control, devices, config
/// and memory. One per VMM process.
pub struct ForkSource {
    handle: VmmHandle,
    devices: Mutex<DeviceControl>,
    config: VmConfig,
    mem: GuestMemoryMmap,
    backing: RamBacking,
    tap_fds: Vec<i32>,
    busy: Mutex<()>,
    pagein: Option<Arc<PageIn>>,
}

impl ForkSource {
    pub(crate) fn new(
        handle: VmmHandle,
        devices: DeviceControl,
        config: VmConfig,
        mem: GuestMemoryMmap,
        backing: RamBacking,
        tap_fds: Vec<i32>,
        pagein: Option<Arc<PageIn>>,
    ) -> Self {
        Self {
            handle,
            devices: Mutex::new(devices),
            config,
            mem,
            backing,
            tap_fds,
            busy: Mutex::new(()),
            pagein,
        }
    }

    /// The vm's lazy page-in, if it was woken that way.
    pub fn pagein(&self) -> Option<&Arc<PageIn>> {
        self.pagein.as_ref()
    }

    /// Makes lazily paged-in RAM resident and unregisters it (see
    /// [`crate::pagein`]), while the vm runs: needed before any fork(2)
    /// whose processes read all of RAM (children, templates, full
    /// snapshots). Nothing to do for other vms.
    pub fn make_resident(&self) -> Result<(), ForkError> {
        match &self.pagein {
            Some(p) => p.make_resident().map_err(ForkError::PageIn),
            None => Ok(()),
        }
    }

    /// How guest RAM is backed in this process.
    pub fn backing(&self) -> RamBacking {
        self.backing
    }

    /// Lets a vm started paused run (one resume; a running vm is an error).
    pub fn resume(&self) -> Result<(), crate::vstate::control::ControlError> {
        let _busy = lock(&self.busy);
        self.handle.resume()
    }

    /// The vm's configuration (its host side).
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// The vCPU control.
    pub fn handle(&self) -> &VmmHandle {
        &self.handle
    }

    /// Folds `layers` (frozen layers directly under the tops of this vm's
    /// disks, see [`crate::fold::plan`]) into the tops while the guest
    /// runs: each copy step holds the disk's device lock (guest I/O waits
    /// for at most [`disk::FOLD_STEP`] bytes of copying), the header switch
    /// too. Forks wait meanwhile. A disk that fails keeps its old chain.
    pub fn fold_layers(
        &self,
        layers: &[PathBuf],
    ) -> Result<Vec<crate::fold::FoldReport>, crate::fold::FoldError> {
        use crate::fold::{FoldError, FoldReport};
        let _busy = lock(&self.busy);
        let devices = lock(&self.devices);
        let mut chains = Vec::new();
        let _ = devices.for_each_disk(|index, d| {
            if d.writable() {
                chains.push((index, d.layer_paths()));
            }
            Ok(())
        });
        if chains.is_empty() {
            return Err(FoldError::NoDisk);
        }
        let plan = crate::fold::plan(&chains, layers)?;
        let mut reports = Vec::new();
        for (index, k) in plan {
            let t0 = Instant::now();
            let fail = |source| FoldError::Disk { index, source };
            let mut fold = devices
                .with_disk(index, |d| d.fold_start(k))
                .ok_or(FoldError::NoDisk)?
                .map_err(fail)?;
            while devices
                .with_disk(index, |d| d.fold_step(&mut fold, disk::FOLD_STEP))
                .ok_or(FoldError::NoDisk)?
                .map_err(fail)?
            {}
            // What stays below is opened off the device lock.
            fold.open_rest().map_err(fail)?;
            let done = devices
                .with_disk(index, |d| d.fold_finish(fold))
                .ok_or(FoldError::NoDisk)?
                .map_err(fail)?;
            reports.push(FoldReport {
                disk: index,
                folded: done.folded,
                bytes_copied: done.bytes_copied,
                depth: done.depth,
                ms: t0.elapsed().as_secs_f64() * 1000.0,
            });
        }
        Ok(reports)
    }

    /// Step 1 of the fork path. `frozen_path(i)` names where writable disk
    /// `i`'s top layer goes. On error the vm runs on unchanged.
    pub fn freeze(
        &self,
        frozen_path: impl Fn(usize) -> Option<PathBuf>,
    ) -> Result<Frozen<'_>, ForkError> {
        let busy = self.busy.try_lock().map_err(|_| ForkError::Busy)?;
        // A fork adds a layer to every writable disk: refuse before pausing
        // if one would pass the limit.
        lock(&self.devices).for_each_disk(|index, d| {
            if d.depth() >= disk::MAX_CHAIN_DEPTH {
                return Err(ForkError::ChainTooDeep {
                    index,
                    depth: d.depth(),
                    max: disk::MAX_CHAIN_DEPTH,
                });
            }
            Ok(())
        })?;
        let started = Instant::now();
        let started_ns = monotonic_ns();
        self.handle.pause().map_err(ForkError::Pause)?;
        let mut devices = lock(&self.devices);
        let saved = devices
            .park
            .park()
            .map_err(ForkError::from)
            .and_then(|()| self.handle.save_state().map_err(ForkError::Pause))
            .and_then(|m| {
                // The dirty set of the moment: forked processes inherit
                // it with the memory's bitmaps.
                self.handle.collect_dirty().map_err(ForkError::Pause)?;
                Ok(m)
            })
            .and_then(|m| Ok((m, devices.save()?)));
        let (machine, device_states) = match saved {
            Ok(m) => m,
            Err(e) => {
                devices.park.unpark();
                drop(devices);
                let _ = self.handle.resume();
                return Err(e);
            }
        };
        let moment = Moment {
            machine,
            devices: device_states,
            mem_mib: self.config.mem_mib,
            layout: DeviceLayout::of(&self.config),
        };
        let mut disks = Vec::new();
        let res = devices.for_each_disk(|index, d| {
            let top = d.path().to_path_buf();
            let to = frozen_path(index).ok_or(ForkError::NoFrozenPath { index })?;
            d.freeze_to(&to)
                .map_err(|source| ForkError::Disk { index, source })?;
            disks.push(FrozenDisk {
                index,
                top,
                frozen: to,
            });
            Ok(())
        });
        drop(devices);
        let mut frozen = Frozen {
            source: self,
            _busy: busy,
            moment,
            disks,
            socket_aside: None,
            started,
            started_ns,
            thawed: false,
            new_tops: Vec::new(),
            dirty: self.handle.dirty_tracking(),
            rebase: None,
        };
        if let Err(e) = res {
            let _ = frozen.thaw_in_place();
            return Err(e);
        }
        if let Some(v) = &self.config.vsock {
            let aside = aside_path(&v.uds_path);
            if let Err(source) = std::fs::rename(&v.uds_path, &aside) {
                let _ = frozen.thaw_in_place();
                return Err(ForkError::Socket {
                    path: v.uds_path.clone(),
                    source,
                });
            }
            frozen.socket_aside = Some((v.uds_path.clone(), aside));
        }
        Ok(frozen)
    }
}

impl ForkSource {
    /// Takes the KVM setup of the parent's continuation off the pause:
    /// fork(2)s a standby ([`fork_standby`]) while the guest still runs;
    /// its memslots are on the still shared memfd, at the same addresses.
    /// [`Frozen::hand_over`] sends it the moment; it then maps RAM private,
    /// loads the state and runs `body`. Only for a shared memfd: a private
    /// view forked now would hold the running, not the frozen, memory.
    ///
    /// The standby is forked while vCPU and device threads run, so it uses
    /// nothing they may have locked: no logging before the moment arrives
    /// (the stderr lock), only this source's plain data and KVM.
    pub fn prepare(&self, body: impl FnOnce(&mut Offspring) -> i32) -> Result<Standby, ForkError> {
        if self.backing != RamBacking::SharedMemfd {
            return Err(ForkError::Child(
                "only a shared memfd can be prepared for".into(),
            ));
        }
        fork_standby(
            &self.mem,
            &self.config,
            &self.tap_fds,
            |prepared, data, report| {
                let Ok(h) = serde_json::from_slice::<Handover>(&data) else {
                    return 1;
                };
                // This standby was forked before the moment: it takes the
                // moment's dirty set from the handover.
                if let Some(pages) = &h.dirty_pages {
                    dirty::replace(&self.mem, pages);
                }
                let mut off = Offspring {
                    prepared,
                    parts: ForkParts {
                        mem: self.mem.clone(),
                        backing: RamBacking::Private,
                        moment: h.moment,
                        config: self.config.clone(),
                        disks: h.disks,
                        tap_fds: self.tap_fds.clone(),
                        dirty: h.dirty,
                        reset_dirty: false,
                    },
                    report,
                };
                match memory::make_private(&self.mem) {
                    Err(e) => {
                        off.failed(&e.to_string());
                        1
                    }
                    Ok(()) => body(&mut off),
                }
            },
        )
    }
}

/// Forks a standby from `parts` whose memory nobody writes any more (a
/// checkpoint template's): it makes a VM and vCPUs at once, then waits
/// for [`Standby::start`] and runs `body` with what that sends. Rollback
/// then costs only loading the state.
pub fn spawn_standby(
    parts: &ForkParts,
    keep_taps: bool,
    body: impl FnOnce(&mut Offspring, Vec<u8>) -> i32,
) -> Result<Standby, ForkError> {
    let taps: &[i32] = if keep_taps { &parts.tap_fds } else { &[] };
    fork_standby(&parts.mem, &parts.config, taps, |prepared, data, report| {
        let mut off = Offspring {
            prepared,
            parts: ForkParts {
                tap_fds: taps.to_vec(),
                ..parts.clone()
            },
            report,
        };
        body(&mut off, data)
    })
}

/// fork(2)s a process that keeps only `mem`'s fds, `taps` and its pipes,
/// creates a VM with `mem` as memslots, an irqchip and `config.vcpus`
/// vCPUs, reports "prepared", and waits: [`Standby::start`] (or
/// [`Frozen::hand_over`]) sends it bytes and it runs `body`; a closed pipe
/// without bytes ends it. `body` gets the VM and vCPUs (if KVM made
/// them), the bytes and the report pipe.
fn fork_standby(
    mem: &GuestMemoryMmap,
    config: &VmConfig,
    taps: &[i32],
    body: impl FnOnce(Option<(Vm, Vec<Vcpu>)>, Vec<u8>, File) -> i32,
) -> Result<Standby, ForkError> {
    let (handover_read, handover_write) = pipe()?;
    let (report_read, report_write) = pipe()?;
    // SAFETY: fork(2); the child ends with _exit and never returns into
    // the parent's frames.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(ForkError::Fork(std::io::Error::last_os_error()));
    }
    if pid == 0 {
        std::mem::forget(handover_write);
        std::mem::forget(report_read);
        let mut handover = handover_read;
        let mut report = report_write;
        let mut keep = memory::backing_fds(mem);
        keep.push(handover.as_raw_fd());
        keep.push(report.as_raw_fd());
        keep.extend_from_slice(taps);
        close_fds_except(&keep);
        let prepared = prepare_machine(&config.kvm_device, mem, config.vcpus).ok();
        let _ = writeln!(report, "ok prepared");
        let mut data = Vec::new();
        let code = match std::io::Read::read_to_end(&mut handover, &mut data) {
            Ok(_) if !data.is_empty() => {
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    body(prepared, data, report)
                }))
                .unwrap_or(101)
            }
            // Called off: the fork failed, or the template ended.
            _ => 0,
        };
        // SAFETY: ends this forked process without running the parent's
        // destructors or atexit handlers.
        unsafe { libc::_exit(code) }
    }
    drop(handover_read);
    drop(report_write);
    let mut spawned = Spawned {
        pid: pid as u32,
        report: BufReader::new(report_read),
    };
    // The caller freezes only once its VM is ready, or the two compete
    // for the CPU.
    spawned.wait_ready(Duration::from_secs(2))?;
    Ok(Standby {
        spawned,
        handover: handover_write,
    })
}

/// A standby continuation (see [`ForkSource::prepare`]).
pub struct Standby {
    spawned: Spawned,
    handover: File,
}

impl Standby {
    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.spawned.pid
    }

    /// Calls it off: its pipe closes, it exits, and its status is
    /// collected (a process that goes on must not keep it as a zombie).
    pub fn cancel(self) {
        let Standby { spawned, handover } = self;
        drop(handover);
        spawned.reap(Duration::from_secs(1));
    }

    /// Sends `data` to a standby made by [`spawn_standby`]; it then runs
    /// its body.
    pub fn start(self, data: &[u8]) -> Result<Spawned, ForkError> {
        let Standby {
            spawned,
            mut handover,
        } = self;
        handover
            .write_all(data)
            .map_err(|e| ForkError::Child(format!("cannot start the standby: {e}")))?;
        drop(handover);
        Ok(spawned)
    }
}

/// What the standby gets once the vm is frozen.
#[derive(serde::Serialize, serde::Deserialize)]
struct Handover {
    moment: Moment,
    disks: Vec<FrozenDisk>,
    /// The continuation's dirty tracking.
    dirty: DirtyTracking,
    /// The dirty set of the moment (empty: reset; None: tracking off).
    dirty_pages: Option<PageBitmap>,
}

fn pipe() -> Result<(File, File), ForkError> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the two-element array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(ForkError::Pipe(std::io::Error::last_os_error()));
    }
    // SAFETY: both fds are fresh and owned here.
    Ok(unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) })
}

fn aside_path(p: &Path) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(format!(".frozen-{}", std::process::id()));
    PathBuf::from(s)
}

/// A writable disk whose top layer was frozen.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct FrozenDisk {
    /// Index among the vm's disks (`VmConfig::disks`).
    pub index: usize,
    /// Where the top layer was (the continuation's new overlay goes here).
    pub top: PathBuf,
    /// Where it is now, read-only.
    pub frozen: PathBuf,
}

/// Everything a forked process continues from: the frozen moment, its
/// memory and the parent's host side. A template (a checkpoint) keeps one
/// and forks from it again.
#[derive(Clone)]
pub struct ForkParts {
    pub mem: GuestMemoryMmap,
    pub backing: RamBacking,
    pub moment: Moment,
    pub config: VmConfig,
    pub disks: Vec<FrozenDisk>,
    pub tap_fds: Vec<i32>,
    /// Dirty tracking of the moment (the set itself is in `mem`'s
    /// bitmaps, inherited by fork(2)).
    pub dirty: DirtyTracking,
    /// Empty the dirty set in the new process (a continuation whose
    /// moment was just stored as its new base).
    pub reset_dirty: bool,
}

/// A paused vm with its moment saved and disks frozen (step 1 done).
pub struct Frozen<'a> {
    source: &'a ForkSource,
    _busy: MutexGuard<'a, ()>,
    moment: Moment,
    disks: Vec<FrozenDisk>,
    socket_aside: Option<(PathBuf, PathBuf)>,
    started: Instant,
    started_ns: u64,
    thawed: bool,
    /// New top layers opened by [`Frozen::prepare_tops`] (disk index,
    /// disk), installed by [`Frozen::resume_here`].
    new_tops: Vec<(usize, disk::Disk)>,
    /// Dirty tracking at the moment.
    dirty: DirtyTracking,
    /// The continuation's new dirty base, if the moment is being stored.
    rebase: Option<String>,
}

/// What the body of a forked process gets.
pub struct Offspring {
    /// What it continues from; guest RAM is now a private view
    /// (`parts.backing` is [`RamBacking::Private`]). `parts.tap_fds` are
    /// open here only if they were kept.
    pub parts: ForkParts,
    /// A VM and vCPUs made before the pause (see [`ForkSource::prepare`]).
    pub prepared: Option<(Vm, Vec<Vcpu>)>,
    report: File,
}

impl Offspring {
    /// Tells the parent this process is ready (`detail` is one line, e.g.
    /// JSON). The parent's [`Spawned::wait_ready`] returns it.
    pub fn ready(&mut self, detail: &str) {
        let _ = writeln!(self.report, "ok {}", detail.replace('\n', " "));
    }

    /// Tells the parent this process failed; it then exits.
    pub fn failed(&mut self, why: &str) {
        let _ = writeln!(self.report, "err {}", why.replace('\n', " "));
    }
}

/// A forked process, seen from the parent.
pub struct Spawned {
    pub pid: u32,
    report: BufReader<File>,
}

impl Spawned {
    /// Collects the process's exit status so it does not linger as a
    /// zombie of this one: a zygote or writer exits right after its
    /// report, so this waits up to `timeout` for it, then leaves the
    /// wait to a thread. Only for a process this one forked.
    pub fn reap(&self, timeout: Duration) {
        reap(self.pid, timeout)
    }

    /// Kills the process and collects its status (see [`Spawned::reap`]).
    pub fn kill_and_reap(&self) {
        // SAFETY: kill(2) of a process this one forked and has not reaped.
        unsafe {
            libc::kill(self.pid as libc::pid_t, libc::SIGKILL);
        }
        self.reap(Duration::from_secs(1));
    }

    /// Waits for the process to report ready; returns its detail line.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<String, ForkError> {
        let fd = self.report.get_ref().as_raw_fd();
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: polls one valid pollfd for the given time.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n == 0 {
            return Err(ForkError::ChildTimeout(timeout));
        }
        let mut line = String::new();
        match self.report.read_line(&mut line) {
            Ok(0) | Err(_) => Err(ForkError::Child(
                "it exited without reporting (see its log)".into(),
            )),
            Ok(_) => {
                let line = line.trim_end();
                match line.split_once(' ') {
                    Some(("ok", d)) => Ok(d.to_string()),
                    Some(("err", e)) => Err(ForkError::Child(e.to_string())),
                    _ => Err(ForkError::Child(format!("unexpected report {line:?}"))),
                }
            }
        }
    }
}

impl Frozen<'_> {
    /// The saved moment.
    pub fn moment(&self) -> &Moment {
        &self.moment
    }

    /// The frozen disks.
    pub fn disks(&self) -> &[FrozenDisk] {
        &self.disks
    }

    /// When the pause began.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// When the pause began, as [`monotonic_ns`].
    pub fn started_ns(&self) -> u64 {
        self.started_ns
    }

    /// Whether the source's RAM is a shared memfd (then this process must
    /// end once a continuation runs).
    pub fn backing(&self) -> RamBacking {
        self.source.backing
    }

    /// What a forked process continues from.
    pub fn parts(&self) -> ForkParts {
        ForkParts {
            mem: self.source.mem.clone(),
            backing: self.source.backing,
            moment: self.moment.clone(),
            config: self.source.config.clone(),
            disks: self.disks.clone(),
            tap_fds: self.source.tap_fds.clone(),
            dirty: self.dirty.clone(),
            reset_dirty: false,
        }
    }

    /// The moment is being stored as `base`: the vm's continuation starts
    /// an empty dirty set relative to it (children keep the old base).
    pub fn rebase_continuation(&mut self, base: String) {
        self.rebase = Some(base);
    }

    /// The continuation's dirty tracking.
    fn continuation_dirty(&self) -> DirtyTracking {
        match &self.rebase {
            Some(b) => DirtyTracking {
                enabled: true,
                base: Some(b.clone()),
            },
            None => self.dirty.clone(),
        }
    }

    /// What the vm's own continuation continues from.
    pub fn continuation_parts(&self) -> ForkParts {
        ForkParts {
            dirty: self.continuation_dirty(),
            reset_dirty: self.rebase.is_some(),
            ..self.parts()
        }
    }

    /// For a vm that goes on in this process ([`Frozen::resume_here`]):
    /// empties its dirty set now, before it runs again, if the moment is
    /// being stored.
    pub fn rebase_here(&self) -> Result<(), ForkError> {
        match &self.rebase {
            Some(b) => self
                .source
                .handle
                .rebase_dirty_paused(Some(b.clone()))
                .map_err(ForkError::Pause),
            None => Ok(()),
        }
    }

    /// Sends the frozen moment to a standby (step 2 for the parent's
    /// continuation when one was prepared); it then runs its body.
    pub fn hand_over(&self, standby: Standby) -> Result<Spawned, ForkError> {
        let Standby {
            spawned,
            mut handover,
        } = standby;
        let dirty = self.continuation_dirty();
        let dirty_pages = if self.rebase.is_some() {
            Some(PageBitmap::default())
        } else {
            dirty.enabled.then(|| dirty::read(&self.source.mem))
        };
        let h = Handover {
            moment: self.moment.clone(),
            disks: self.disks.clone(),
            dirty,
            dirty_pages,
        };
        let bytes = serde_json::to_vec(&h).map_err(|e| ForkError::Child(e.to_string()))?;
        handover
            .write_all(&bytes)
            .map_err(|e| ForkError::Child(format!("cannot hand the moment over: {e}")))?;
        drop(handover);
        Ok(spawned)
    }

    /// Step 2: forks a process that runs `body` (see [`spawn`]).
    pub fn spawn(
        &self,
        keep_taps: bool,
        body: impl FnOnce(&mut Offspring) -> i32,
    ) -> Result<Spawned, ForkError> {
        spawn(&self.parts(), keep_taps, body)
    }

    /// Undoes the freeze: disks and the vsock socket move back, devices
    /// and vCPUs go on. Only before any process continued the vm.
    pub fn thaw(mut self) -> Result<(), ForkError> {
        self.thaw_in_place()
    }

    fn thaw_in_place(&mut self) -> Result<(), ForkError> {
        self.drop_new_tops();
        self.go_on(|f, d| d.thaw(&f.top)).map(|_| ())
    }

    /// For a vm that goes on in this process: creates and opens a new top
    /// layer on each frozen disk, so that [`Frozen::resume_here`] cannot
    /// fail on the disks. Call before any process may stack on the frozen
    /// layers; on error nothing of it is left and the freeze can still
    /// be undone with [`Frozen::thaw`].
    pub fn prepare_tops(&mut self) -> Result<(), ForkError> {
        let mut failed = None;
        for f in &self.disks {
            let res = disk::create_overlay(&f.frozen, &f.top).and_then(|()| {
                disk::Disk::open(&f.top, true).inspect_err(|_| {
                    let _ = std::fs::remove_file(&f.top);
                })
            });
            match res {
                Ok(d) => self.new_tops.push((f.index, d)),
                Err(source) => {
                    failed = Some(ForkError::NewTop {
                        index: f.index,
                        source,
                    });
                    break;
                }
            }
        }
        match failed {
            None => Ok(()),
            Some(e) => {
                self.drop_new_tops();
                Err(e)
            }
        }
    }

    /// Closes and removes the new tops of [`Frozen::prepare_tops`].
    fn drop_new_tops(&mut self) {
        for (_, d) in self.new_tops.drain(..) {
            let path = d.path().to_path_buf();
            drop(d);
            let _ = std::fs::remove_file(path);
        }
    }

    /// Ends the freeze in this process: `per_disk` on each frozen disk,
    /// sockets back, devices and vCPUs go on. Returns the frozen disks.
    fn go_on(
        &mut self,
        mut per_disk: impl FnMut(&FrozenDisk, &mut disk::Disk) -> Result<(), disk::DiskError>,
    ) -> Result<Vec<FrozenDisk>, ForkError> {
        self.thawed = true;
        let disks = std::mem::take(&mut self.disks);
        let mut devices = lock(&self.source.devices);
        let res = devices.for_each_disk(|index, d| match disks.iter().find(|f| f.index == index) {
            Some(f) => per_disk(f, d).map_err(|source| ForkError::Disk { index, source }),
            None => Ok(()),
        });
        if let Some((path, aside)) = self.socket_aside.take() {
            let _ = std::fs::rename(aside, path);
        }
        devices.park.unpark();
        drop(devices);
        self.source.handle.resume().map_err(ForkError::Pause)?;
        res.map(|()| disks)
    }

    /// Step 3 for a vm with private memory, which goes on in this process
    /// (its forks got copy-on-write views of the frozen moment): each
    /// frozen disk gets its new top layer from [`Frozen::prepare_tops`]
    /// (which must have succeeded), sockets move back, devices and vCPUs
    /// go on. The frozen layers are fsynced after the resume.
    pub fn resume_here(mut self) -> Result<(), ForkError> {
        let mut tops = std::mem::take(&mut self.new_tops);
        let disks = self.go_on(|f, d| {
            match tops.iter().position(|(i, _)| *i == f.index) {
                Some(k) => *d = tops.swap_remove(k).1,
                None => {
                    disk::create_overlay(&f.frozen, &f.top)?;
                    *d = disk::Disk::open(&f.top, true)?;
                }
            }
            Ok(())
        })?;
        for f in &disks {
            if let Ok(file) = File::open(&f.frozen) {
                let _ = file.sync_all();
            }
        }
        Ok(())
    }

    /// Ends the freeze for a source that lives on (a private-memory source
    /// whose continuation is this process): devices and vCPUs go on.
    /// Frozen disks stay frozen: the caller reopens its own overlays.
    pub fn leave_frozen(mut self) {
        self.thawed = true;
        // The frozen layers become durable now that nobody waits on it.
        let devices = lock(&self.source.devices);
        let _ = devices.for_each_disk(|index, d| {
            d.sync_top()
                .map_err(|source| ForkError::Disk { index, source })
        });
    }
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        if !self.thawed {
            // The caller did not say: the safe default for guest RAM that
            // children may share is to stay paused, so nothing is undone.
            tracing::debug!("frozen vm dropped without thaw: it stays paused");
        }
    }
}

/// Forks a process that continues from `parts`, runs `body` and exits
/// with its return value. `keep_taps` keeps the tap fds open in it (for
/// the parent's continuation and templates only: a tap has one reader).
pub fn spawn(
    parts: &ForkParts,
    keep_taps: bool,
    body: impl FnOnce(&mut Offspring) -> i32,
) -> Result<Spawned, ForkError> {
    spawn_keeping(parts, keep_taps, &[], body)
}

/// [`spawn`], with `fds` kept open as well (a fork child's own taps, passed
/// by the host; the in-place fork's zygote keeps all the children's).
pub fn spawn_keeping(
    parts: &ForkParts,
    keep_taps: bool,
    fds: &[i32],
    body: impl FnOnce(&mut Offspring) -> i32,
) -> Result<Spawned, ForkError> {
    let mut pipe_fds = [0; 2];
    // SAFETY: pipe2 fills the two-element array.
    if unsafe { libc::pipe2(pipe_fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(ForkError::Pipe(std::io::Error::last_os_error()));
    }
    // SAFETY: both fds are fresh and owned here.
    let (read_end, write_end) = unsafe {
        (
            File::from_raw_fd(pipe_fds[0]),
            File::from_raw_fd(pipe_fds[1]),
        )
    };
    // SAFETY: fork(2); the child runs only `child_main`, which never
    // returns into the parent's frames (it ends with _exit).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(ForkError::Fork(std::io::Error::last_os_error()));
    }
    if pid == 0 {
        std::mem::forget(read_end);
        child_main(parts, write_end, keep_taps, fds, body);
    }
    drop(write_end);
    Ok(Spawned {
        pid: pid as u32,
        report: BufReader::new(read_end),
    })
}

fn child_main(
    parts: &ForkParts,
    report: File,
    keep_taps: bool,
    fds: &[i32],
    body: impl FnOnce(&mut Offspring) -> i32,
) -> ! {
    let mut keep = memory::backing_fds(&parts.mem);
    keep.push(report.as_raw_fd());
    keep.extend_from_slice(fds);
    if keep_taps {
        keep.extend_from_slice(&parts.tap_fds);
    }
    close_fds_except(&keep);
    let remapped = match parts.backing {
        RamBacking::SharedMemfd => memory::make_private(&parts.mem),
        RamBacking::Private => Ok(()),
    };
    if parts.reset_dirty {
        dirty::replace(&parts.mem, &PageBitmap::default());
    }
    let mut off = Offspring {
        prepared: None,
        parts: ForkParts {
            backing: RamBacking::Private,
            reset_dirty: false,
            tap_fds: if keep_taps {
                parts.tap_fds.clone()
            } else {
                Vec::new()
            },
            ..parts.clone()
        },
        report,
    };
    let code = match remapped {
        Err(e) => {
            off.failed(&e.to_string());
            1
        }
        Ok(()) => {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&mut off))).unwrap_or(101)
        }
    };
    // SAFETY: ends this forked process without running the parent's
    // destructors or atexit handlers.
    unsafe { libc::_exit(code) }
}

/// Collects the exit status of `pid`, a child of this process (see
/// [`Spawned::reap`]).
pub fn reap(pid: u32, timeout: Duration) {
    let pid = pid as libc::pid_t;
    let deadline = Instant::now() + timeout;
    loop {
        let mut status = 0;
        // SAFETY: waitpid on one child with a valid status pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r != 0 {
            // Reaped, or not (or no longer) a child of this process.
            return;
        }
        if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let _ = std::thread::Builder::new()
        .name("reaper".into())
        .spawn(move || {
            let mut status = 0;
            // SAFETY: as above, blocking.
            unsafe { libc::waitpid(pid, &mut status, 0) };
        });
}

/// Closes every fd of this process except 0, 1, 2 and `keep`.
fn close_fds_except(keep: &[i32]) {
    let mut keep: Vec<u32> = keep
        .iter()
        .filter_map(|&f| u32::try_from(f).ok())
        .filter(|&f| f > 2)
        .collect();
    keep.sort_unstable();
    keep.dedup();
    let mut lo = 3u32;
    for &k in &keep {
        if k > lo {
            close_range(lo, k - 1);
        }
        lo = k + 1;
    }
    close_range(lo, u32::MAX);
}

fn close_range(lo: u32, hi: u32) {
    // SAFETY: close_range(2) only closes descriptors; the objects that
    // owned them in the parent are never used or dropped in this process.
    unsafe {
        libc::syscall(libc::SYS_close_range, lo, hi, 0);
    }
}
