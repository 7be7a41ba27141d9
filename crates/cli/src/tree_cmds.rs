//! The snapshot tree verbs: sleep, wake, fork of a sleeping branch, tree,
//! gc, store verify. A branch sleeps as a snapshot in the store
//! (crates/store: chunks + `$TINE_HOME/store/tree.db`) and wakes as a vm
//! restored from it (the same path as `tine run --from DIR`).
//!
//! - `sleep`: quiesce, take a snapshot into a staging directory, store
//!   its layers (memory, each disk's contents) and state, commit it with
//!   the branch now sleeping, then end the vm. Until the commit the vm is
//!   still there; a failure wakes it again.
//! - `wake`: materialize the snapshot once per host into
//!   `store/wake/SNAPSHOT/` (its manifest written last), then restore a
//!   new vm from it. Copies of one snapshot map the same memory file
//!   MAP_PRIVATE, so they share its page cache.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use store::{BranchChange, BranchState, Dirty, LayerKind, SnapshotId, Store, StoreConfig};
use vmm::api::{self, Request};
use vmm::snapshot_dir::{self, Manifest};

use crate::state::{self, VmDir, VmRecord, VmState};
use crate::wake;
use protocol::wake::Role;

/// How long the VMM may take to write a snapshot for `sleep`.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(300);

/// Which stored snapshot a vm was woken from (`vms/NAME/branch.json`):
/// its next sleep stores only what changed since.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BranchLink {
    pub branch: String,
    pub snapshot: i64,
}

fn link_path(vm: &VmDir) -> PathBuf {
    vm.dir.join("branch.json")
}

fn read_link(vm: &VmDir) -> Option<BranchLink> {
    let text = std::fs::read_to_string(link_path(vm)).ok()?;
    serde_json::from_str(&text).ok()
}

/// The store of this host (`TINE_STORE` picks a backend, see crates/store).
pub fn open(home: &Path) -> anyhow::Result<Store> {
    let cfg = StoreConfig::from_env(home)?;
    Store::open(cfg).context("cannot open the snapshot store")
}

/// Size limit of the local chunk cache in front of a remote store
/// (`TINE_STORE_CACHE`, e.g. `20G`; default 16 GiB).
pub const CACHE_ENV: &str = "TINE_STORE_CACHE";
const DEFAULT_CACHE_MIB: u64 = 16 << 10;

/// Keeps the chunk cache within its budget, least recently used chunks
/// first (they stay in the backend). Run after the work of a sleep, wake
/// or gc, so it costs the command, not the vm's time to ready. A bad
/// budget or a failed trim is reported, never fatal: the cache is only
/// a cache.
fn trim_cache(store: &Store) {
    let budget_mib = match std::env::var(CACHE_ENV) {
        Ok(v) => match crate::size::parse_mib(&v) {
            Ok(m) => m,
            Err(e) => {
                eprintln!("tine: {CACHE_ENV}={v:?} is not a size ({e}); the cache keeps {DEFAULT_CACHE_MIB} MiB");
                DEFAULT_CACHE_MIB
            }
        },
        Err(_) => DEFAULT_CACHE_MIB,
    };
    match store.trim_cache(budget_mib << 20) {
        Ok((0, _)) => {}
        Ok((n, bytes)) => tracing::debug!("chunk cache: {n} chunks ({bytes} bytes) dropped"),
        Err(e) => eprintln!("tine: cannot trim the chunk cache: {e}"),
    }
}

/// A progress bar on stderr for work that lasts more than a second (and
/// only on a terminal).
struct Bar {
    bar: indicatif::ProgressBar,
    t0: Mutex<Option<Instant>>,
    shown: std::sync::atomic::AtomicBool,
}

impl Bar {
    fn new() -> Bar {
        let bar = indicatif::ProgressBar::hidden();
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {eta}",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
        );
        Bar {
            bar,
            t0: Mutex::new(None),
            shown: false.into(),
        }
    }
}

impl store::Progress for Bar {
    fn start(&self, what: &str, total: u64) {
        self.bar.set_message(what.to_string());
        self.bar.set_length(total);
        self.bar.set_position(0);
        if let Ok(mut t) = self.t0.lock() {
            t.get_or_insert_with(Instant::now);
        }
    }
    fn advance(&self, n: u64) {
        self.bar.inc(n);
        let late = self
            .t0
            .lock()
            .ok()
            .and_then(|t| *t)
            .is_some_and(|t| t.elapsed() > Duration::from_secs(1));
        if late
            && std::io::stderr().is_terminal()
            && !self.shown.swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            self.bar
                .set_draw_target(indicatif::ProgressDrawTarget::stderr());
        }
    }
    fn finish(&self) {
        if self.shown.load(std::sync::atomic::Ordering::Relaxed) {
            self.bar.finish_and_clear();
        }
    }
}

/// What `sleep` reports.
#[derive(Debug, Serialize)]
struct SleepReport {
    name: String,
    branch: String,
    snapshot: i64,
    parent: Option<i64>,
    pause_ms: f64,
    snapshot_ms: f64,
    store_ms: f64,
    total_ms: f64,
    /// Logical bytes of the memory layer this snapshot records itself
    /// (windows not inherited from its parent).
    memory_logical: u64,
    /// Bytes that went to the backend (new chunks, compressed).
    new_stored: u64,
    /// Each disk layer, in manifest order.
    disks: Vec<DiskReport>,
}

/// How `sleep` stored one disk.
#[derive(Debug, Serialize)]
struct DiskReport {
    size: u64,
    /// Stored as a diff over the parent snapshot's layer: only the windows
    /// the qcow2 layers above the woken snapshot's disk map were read.
    diff: bool,
    /// Bytes read from the disk chain (and hashed).
    read_bytes: u64,
    /// Logical bytes this snapshot records itself.
    logical: u64,
}

/// `tine sleep NAME`: the vm becomes a sleeping branch of the tree.
pub fn sleep(home: &Path, name: &str, json: bool) -> anyhow::Result<ExitCode> {
    state::validate_name(name)?;
    let vm = VmDir::new(home, name);
    let mut r = vm.read_record()?;
    match vm.state(&r) {
        VmState::Running => {}
        s => bail!("vm {name:?} is {s}: only a running vm can be put to sleep"),
    }
    if !crate::fork_cmds::list_checkpoints(home, name)?.is_empty() {
        bail!("vm {name:?} has checkpoints; they live in processes and cannot sleep with it (remove them with `tine rm` of the vm, or roll back first)");
    }
    let store = open(home)?;
    let link = read_link(&vm);
    let parent = match &link {
        Some(l) => store.snapshot(SnapshotId(l.snapshot)).ok().map(|s| s.id),
        None => None,
    };
    if let Some(b) = store.branch(name)? {
        if b.state == BranchState::Sleeping {
            bail!("a sleeping branch named {name:?} exists already; wake it under another name or `tine gc` after removing it");
        }
    }
    let staging = store
        .dir()
        .join("staging")
        .join(format!("sleep-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    let t0 = Instant::now();

    // The moment: quiesced, recorded by the effects gateway (the branch's
    // effects up to here are its wakers' past), written to the staging
    // directory; the vm goes on (in a new process) until the commit.
    crate::effects_cmds::ensure_branch(&vm, &mut r)?;
    let mut moment = crate::effects_cmds::Moment::new(&r, effects::MomentKind::Snapshot)?;
    let quiesced = wake::quiesce(&vm, &r)?;
    if let Err(e) = moment.begin(home, &vm, &r) {
        wake_again(&vm, &r, quiesced.is_some());
        return Err(e);
    }
    let contract = vm.read_contract()?;
    // A vm woken from a stored snapshot tracks the pages it dirtied since
    // (KVM's dirty log and the VMM's own writes): only those are written
    // and stored, as a diff layer over that snapshot's.
    let req = match parent {
        Some(_) => Request::SnapshotLayer {
            dir: staging.clone(),
            layers_dir: state::layers_dir(home),
            contract: Some(contract.to_toml()),
            full: false,
            rebase: None,
        },
        None => Request::Snapshot {
            dir: staging.clone(),
            layers_dir: state::layers_dir(home),
            contract: Some(contract.to_toml()),
        },
    };
    let res = api::call(&vm.api_socket(), &req, SNAPSHOT_TIMEOUT);
    let taken = matches!(&res, Ok(c) if c.reply.error.is_none());
    for p in moment.end(home, taken, &[]) {
        eprintln!("tine: {p}");
    }
    let reply = match res {
        Ok(c) if c.reply.error.is_none() => c.reply.clone(),
        Ok(c) => {
            let e = c.reply.error.clone().unwrap_or_default();
            wake_again(&vm, &r, quiesced.is_some());
            bail!("cannot snapshot {name:?}: {e}");
        }
        Err(e) => {
            wake_again(&vm, &r, quiesced.is_some());
            return Err(anyhow::Error::new(e).context(format!("cannot snapshot {name:?}")));
        }
    };
    if let Some(pid) = reply.continuation_pid {
        r.pid = pid;
        r.pid_start = state::process_start(pid).unwrap_or(0);
        vm.write_record(&r)?;
    }
    // The vm runs on until the commit (its workload stays frozen where an
    // agent quiesced it); the branch continues from the moment. Not held
    // stopped: a sleep killed midway must leave a running vm (a quiesced
    // guest thaws itself when no wake comes).
    let snapshot_ms = t0.elapsed().as_secs_f64() * 1000.0;

    let t1 = Instant::now();
    crate::effects_cmds::write_snapshot_lineage(&staging, &r, &moment)?;
    let _ = std::fs::copy(
        vm.dir.join(crate::vm_cmds::WORKING_SET),
        staging.join(crate::vm_cmds::WORKING_SET),
    );
    let stored = store_snapshot(&store, &staging, parent, name);
    let _ = std::fs::remove_dir_all(&staging);
    let (snap, logical, new_stored, disks) = match stored {
        Ok(s) => s,
        Err(e) => {
            wake_again(&vm, &r, quiesced.is_some());
            return Err(e.context(format!("{name:?} did not go to sleep; it runs on")));
        }
    };
    let store_ms = t1.elapsed().as_secs_f64() * 1000.0;
    // Committed: the vm ends, its branch sleeps in the store.
    crate::vm_cmds::remove(home, name, true)?;
    let report = SleepReport {
        name: name.into(),
        branch: name.into(),
        snapshot: snap.0,
        parent: parent.map(|p| p.0),
        pause_ms: reply.pause_ms.unwrap_or_default(),
        snapshot_ms,
        store_ms,
        total_ms: t0.elapsed().as_secs_f64() * 1000.0,
        memory_logical: logical,
        new_stored,
        disks,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let disk_read: u64 = report.disks.iter().map(|d| d.read_bytes).sum();
        println!(
            "{name}: sleeping in snapshot {} ({} MiB of memory recorded, {} MiB of disk read, {} KiB new in the store) in {:.0} ms",
            snap,
            logical >> 20,
            disk_read >> 20,
            new_stored >> 10,
            report.total_ms
        );
    }
    trim_cache(&store);
    Ok(ExitCode::SUCCESS)
}

/// The vm was quiesced for a sleep that did not happen: it goes on.
fn wake_again(vm: &VmDir, r: &VmRecord, quiesced: bool) {
    if !quiesced {
        return;
    }
    let msg = vm
        .read_contract()
        .and_then(|c| wake::Round::new(&c)?.message(Role::Parent, r, &[]));
    match msg {
        Ok(w) => {
            let woken = wake::wake_one(vm, w);
            for p in woken.failures() {
                eprintln!("tine: {p}");
            }
        }
        Err(e) => eprintln!("tine: cannot wake {:?} again: {e:#}", vm.name),
    }
}

/// Stores a snapshot directory as snapshot `name` (child of `parent`) and
/// commits it with branch `name` sleeping in it. Returns the snapshot,
/// the memory bytes it records itself, the bytes new in the backend and
/// how each disk was stored.
fn store_snapshot(
    store: &Store,
    dir: &Path,
    parent: Option<SnapshotId>,
    name: &str,
) -> anyhow::Result<(SnapshotId, u64, u64, Vec<DiskReport>)> {
    let manifest_text = std::fs::read_to_string(dir.join(snapshot_dir::MANIFEST))
        .context("the staged snapshot has no manifest")?;
    let manifest: Manifest = serde_json::from_str(&manifest_text)?;
    let state_bytes = std::fs::read(dir.join(snapshot_dir::STATE))?;
    let before = store.counters();
    let mut w = store.begin(parent, &manifest_text)?;
    let bar = Bar::new();
    let mem = match (parent, dir.join(snapshot_dir::MEMORY_LAYER)) {
        (Some(p), layer) if layer.is_file() => {
            let file = vmm::layer::LayerFile::open(&layer)?;
            match file.base() {
                Some(b) if file.is_diff() && b == p.0.to_string() => {
                    let source = DiffSource {
                        base: store.layer(p, LayerKind::Memory)?,
                        bitmap: file.flat_bitmap(),
                        file,
                    };
                    let dirty = Dirty::Pages {
                        bitmap: &source.bitmap,
                        page_size: 4096,
                    };
                    w.put_layer(LayerKind::Memory, &source, &dirty, &bar)?
                }
                // A full layer (the VMM had no complete dirty set).
                _ => w.put_layer(LayerKind::Memory, &FullSource(file), &Dirty::All, &bar)?,
            }
        }
        _ => {
            let memory = std::fs::File::open(dir.join(snapshot_dir::MEMORY))?;
            w.put_layer(LayerKind::Memory, &memory, &Dirty::All, &bar)?
        }
    };
    let mut disks = Vec::with_capacity(manifest.disks.len());
    for (i, d) in manifest.disks.iter().enumerate() {
        let disk = disk::Disk::open(&d.path, false)
            .with_context(|| format!("cannot read disk {}", d.path.display()))?;
        let read_bytes = std::sync::atomic::AtomicU64::new(0);
        let source = store::FnSource {
            len: disk.size(),
            read: |buf: &mut [u8], off: u64| {
                read_bytes.fetch_add(buf.len() as u64, std::sync::atomic::Ordering::Relaxed);
                disk.read_at(buf, off)
                    .map_err(|e| std::io::Error::other(e.to_string()))
            },
        };
        let i = u32::try_from(i).context("too many disks")?;
        let changed = disk_changed_windows(store, parent, i, &disk)
            .with_context(|| format!("cannot map disk {}", d.path.display()))?;
        let dirty = match &changed {
            Some(w) => Dirty::Windows(w),
            None => Dirty::All,
        };
        let st = w.put_layer(LayerKind::Disk(i), &source, &dirty, &bar)?;
        disks.push(DiskReport {
            size: disk.size(),
            diff: changed.is_some(),
            read_bytes: read_bytes.into_inner(),
            logical: st.logical_bytes,
        });
    }
    w.put_blob(snapshot_dir::STATE, state_bytes);
    if let Ok(l) = std::fs::read(dir.join(crate::effects_cmds::SNAPSHOT_LINEAGE)) {
        w.put_blob(crate::effects_cmds::SNAPSHOT_LINEAGE, l);
    }
    if let Some(pages) = working_set_pages(dir, &manifest) {
        w.set_working_set(pages);
    }
    let change = match store.branch(name)? {
        Some(b) => BranchChange::Update {
            id: b.id,
            state: BranchState::Sleeping,
        },
        None => BranchChange::Create {
            name: name.into(),
            state: BranchState::Sleeping,
        },
    };
    let (snap, _) = w.commit_branch(change)?;
    let after = store.counters();
    Ok((
        snap,
        mem.logical_bytes,
        after.put_bytes.saturating_sub(before.put_bytes),
        disks,
    ))
}

/// The store windows of disk `i` that can differ from the `parent`
/// snapshot's disk layer `i`, when the chain bottoms out at that layer as
/// materialized by a wake (`store/wake/PARENT[-lazy]/disk<i>.raw`): the
/// windows touched by whatever the qcow2 layers above it map (data, zero
/// and discarded clusters). None (read the whole disk) for any other
/// chain: a window wrongly left out would lose the guest's data.
fn disk_changed_windows(
    store: &Store,
    parent: Option<SnapshotId>,
    i: u32,
    disk: &disk::Disk,
) -> anyhow::Result<Option<Vec<u64>>> {
    use std::os::unix::fs::MetadataExt;
    let Some(p) = parent else {
        return Ok(None);
    };
    let chain = disk.chain();
    let Some(bottom) = chain.last() else {
        return Ok(None);
    };
    if chain.len() < 2 || bottom.format != disk::Format::Raw {
        return Ok(None);
    }
    // Same file by identity, however the chain spells its path.
    let Ok(b) = std::fs::metadata(&bottom.path) else {
        return Ok(None);
    };
    let wake = store.dir().join("wake");
    let is_base = [p.0.to_string(), format!("{}-lazy", p.0)].iter().any(|n| {
        std::fs::metadata(wake.join(n).join(format!("disk{i}.raw")))
            .is_ok_and(|m| (m.dev(), m.ino()) == (b.dev(), b.ino()))
    });
    if !is_base {
        return Ok(None);
    }
    let base = match store.layer(p, LayerKind::Disk(i)) {
        Ok(v) => v,
        Err(store::StoreError::NoLayer { .. }) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    if base.size() != disk.size() || bottom.virtual_size != base.size() {
        return Ok(None);
    }
    let ws = base.window_size();
    let mut windows: Vec<u64> = Vec::new();
    for r in disk.changed_above(chain.len() - 1)? {
        let first = r.start / ws;
        let last = (r.end - 1) / ws;
        let from = match windows.last() {
            Some(&l) if l >= first => l + 1,
            _ => first,
        };
        windows.extend(from..=last);
    }
    Ok(Some(windows))
}

/// A diff memory layer read as a whole image: the parent snapshot's
/// memory (from the store) with the layer's pages over it. Only the
/// windows holding dirty pages are read.
struct DiffSource {
    base: store::LayerView,
    file: vmm::layer::LayerFile,
    bitmap: Vec<u64>,
}

impl store::Source for DiffSource {
    fn len(&self) -> u64 {
        self.file.layout().len()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.base
            .read_at(buf, offset)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        self.file
            .overlay(buf, offset)
            .map_err(|e| std::io::Error::other(e.to_string()))
    }
}

/// A full memory layer file read as an image.
struct FullSource(vmm::layer::LayerFile);

impl store::Source for FullSource {
    fn len(&self) -> u64 {
        self.0.layout().len()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.0
            .read_at(buf, offset)
            .map_err(|e| std::io::Error::other(e.to_string()))
    }
}

/// Writes committed snapshot `id` as a snapshot directory (once per host;
/// later wakes reuse it) and returns the directory. For a lazy wake
/// (`lazy`) its `memory` file is only a size (a hole): the VMM pages RAM
/// in from the store instead.
fn materialize(store: &Store, id: SnapshotId, lazy: bool) -> anyhow::Result<PathBuf> {
    let name = if lazy {
        format!("{}-lazy", id.0)
    } else {
        id.0.to_string()
    };
    let dir = store.dir().join("wake").join(&name);
    if dir.join(snapshot_dir::MANIFEST).is_file() {
        return Ok(dir);
    }
    let info = store.snapshot(id)?;
    let mut manifest: Manifest = serde_json::from_str(&info.manifest)
        .with_context(|| format!("snapshot {id} has no vm manifest"))?;
    // The memory is a plain file here, whatever layer it came from.
    manifest.memory_layer = None;
    let tmp = store
        .dir()
        .join("wake")
        .join(format!("{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let bar = Bar::new();
    let memory = store.layer(id, LayerKind::Memory)?;
    let f = std::fs::File::create(tmp.join(snapshot_dir::MEMORY))?;
    f.set_len(memory.size())?;
    if !lazy {
        memory
            .restore(&f, true, &bar)
            .with_context(|| format!("cannot read the memory of snapshot {id}"))?;
        f.sync_all()?;
    }
    for (i, d) in manifest.disks.iter_mut().enumerate() {
        let kind = LayerKind::Disk(u32::try_from(i).context("too many disks")?);
        let layer = store.layer(id, kind)?;
        let f = std::fs::File::create(tmp.join(format!("disk{i}.raw")))?;
        f.set_len(layer.size())?;
        layer
            .restore(&f, true, &bar)
            .with_context(|| format!("cannot read disk {i} of snapshot {id}"))?;
        f.sync_all()?;
        // The woken vm stacks its own top layer on the restored contents.
        d.path = dir.join(format!("disk{i}.raw"));
        d.frozen = true;
    }
    let state_bytes = store
        .blob(id, snapshot_dir::STATE)?
        .with_context(|| format!("snapshot {id} has no vCPU and device state"))?;
    std::fs::write(tmp.join(snapshot_dir::STATE), state_bytes)?;
    // Whose moment it is: a woken branch continues its effects lineage.
    if let Some(l) = store.blob(id, crate::effects_cmds::SNAPSHOT_LINEAGE)? {
        std::fs::write(tmp.join(crate::effects_cmds::SNAPSHOT_LINEAGE), l)?;
    }
    std::fs::write(
        tmp.join(snapshot_dir::MANIFEST),
        serde_json::to_vec_pretty(&manifest)?,
    )?;
    match std::fs::rename(&tmp, &dir) {
        Ok(()) => Ok(dir),
        // Another wake of the same snapshot got there first.
        Err(_) if dir.join(snapshot_dir::MANIFEST).is_file() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(dir)
        }
        Err(e) => Err(e).with_context(|| format!("cannot create {}", dir.display())),
    }
}

/// The working set a lazy wake of this vm recorded (copied into the
/// staged snapshot `dir`), as 4 KiB page numbers of the memory layer in
/// the order they were first touched.
fn working_set_pages(dir: &Path, manifest: &Manifest) -> Option<Vec<u64>> {
    let ws = vmm::pagein::WorkingSet::read(&dir.join(crate::vm_cmds::WORKING_SET)).ok()?;
    let layout = vmm::layer::RamLayout::of(&vmm::moment::ram_regions(manifest.mem_mib));
    let mut pages = Vec::new();
    for (gpa, len) in ws.ranges {
        for p in (gpa..gpa.saturating_add(len)).step_by(4096) {
            if let Some(off) = layout.offset(p) {
                pages.push(off / 4096);
            }
        }
    }
    Some(pages)
}

/// Serves a lazily woken vm's page faults from a memory layer of the
/// store (its local cache first, then the backend; every chunk's hash is
/// checked).
struct StoreSource {
    view: store::LayerView,
    layout: vmm::layer::RamLayout,
    /// Chunks come from a remote backend (through the local cache).
    remote: bool,
    /// The working-set pack being fetched into the cache, if any.
    pack: Option<std::sync::Arc<PackGate>>,
}

/// A working-set pack fetch in flight: fills of the windows it covers
/// wait for their chunk to arrive from it (it streams in, in working-set
/// order) rather than each GET its chunk, which would put the
/// per-request cost the pack avoids back (docs/design/store.md,
/// "working-set packs").
struct PackGate {
    /// Windows whose chunk the pack should bring.
    windows: std::collections::HashMap<u64, store::ChunkId>,
    /// Chunks checked and cached so far, and whether the fetch ended.
    state: std::sync::Mutex<(std::collections::HashSet<store::ChunkId>, bool)>,
    cv: std::sync::Condvar,
}

/// How long a fill waits for the pack before it fetches its chunk itself.
const PACK_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

impl PackGate {
    fn ready(&self, id: &store::ChunkId) {
        let mut g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        g.0.insert(*id);
        drop(g);
        self.cv.notify_all();
    }

    fn finish(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.cv.notify_all();
    }

    fn wait(&self, windows: std::ops::RangeInclusive<u64>) {
        let ids: Vec<store::ChunkId> = windows
            .filter_map(|w| self.windows.get(&w).copied())
            .collect();
        if ids.is_empty() {
            return;
        }
        let g = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let _ = self
            .cv
            .wait_timeout_while(g, PACK_WAIT, |(have, done)| {
                !*done && !ids.iter().all(|i| have.contains(i))
            })
            .unwrap_or_else(|e| e.into_inner());
    }
}

/// Prefetch requests in flight for a remote store.
const REMOTE_PREFETCH_THREADS: usize = 16;
/// Windows read ahead of a fault on a remote store (4 MiB).
const REMOTE_READAHEAD: usize = 16;

impl vmm::pagein::PageSource for StoreSource {
    fn fill(
        &self,
        gpa: u64,
        buf: &mut [u8],
    ) -> Result<vmm::pagein::Fill, vmm::pagein::SourceError> {
        let off = self
            .layout
            .offset(gpa)
            .ok_or_else(|| format!("guest address {gpa:#x} is not RAM"))?;
        let len = buf.len() as u64;
        let first = self.view.window_of(off);
        let last = self.view.window_of(off + len.saturating_sub(1));
        if (first..=last).all(|w| matches!(self.view.window(w), Some(store::Window::Zero) | None)) {
            return Ok(vmm::pagein::Fill::Zero);
        }
        if let Some(g) = &self.pack {
            g.wait(first..=last);
        }
        // A chunk that cannot be read (corrupt, missing) ends the vm; the
        // error names the snapshot, window and chunk. A fill of exactly one
        // window (the page-in unit is the window size) is read straight
        // into `buf`, without read_at's bounce buffer.
        if self.view.window_range(first) == (off..off + len) {
            self.view.read_window(first, buf)?;
        } else {
            self.view.read_at(buf, off)?;
        }
        Ok(vmm::pagein::Fill::Data)
    }

    /// A remote store answers each 256 KiB GET after a round trip (tens
    /// of ms on S3), so the working set is fetched with many requests in
    /// flight. bench/store against an S3 server taking ~35 ms per GET:
    /// 4 threads fetched ~110 windows a second, 16 the whole 64.8 MiB
    /// (259 windows) in 0.5-0.9 s.
    fn prefetch_threads(&self) -> usize {
        if self.remote {
            REMOTE_PREFETCH_THREADS
        } else {
            vmm::pagein::DEFAULT_PREFETCH_THREADS
        }
    }

    /// For the same reason a fault on a remote store reads the next
    /// windows in the background: a guest reading on through memory no
    /// working set covers (a cold wake, a set cut short by its window)
    /// otherwise waits for one round trip per window.
    fn readahead(&self) -> usize {
        if self.remote {
            REMOTE_READAHEAD
        } else {
            0
        }
    }
}

/// The page source and the prefetch list for a lazy wake of store
/// snapshot `id` (the VMM process side of `tine wake --lazy`).
pub fn lazy_source(
    id: i64,
    layout: vmm::layer::RamLayout,
) -> anyhow::Result<(
    std::sync::Arc<dyn vmm::pagein::PageSource>,
    Option<vmm::pagein::WorkingSet>,
)> {
    let home = image::default_home()?;
    let store = open(&home)?;
    let id = SnapshotId(id);
    let view = store.layer(id, LayerKind::Memory)?;
    anyhow::ensure!(
        layout.len() == view.size(),
        "snapshot {id}'s memory layer has {} bytes, the vm's RAM {}",
        view.size(),
        layout.len()
    );
    let pages = store.snapshot(id)?.working_set;
    let prefetch = (!pages.is_empty()).then(|| vmm::pagein::WorkingSet {
        ranges: pages
            .iter()
            .filter_map(|p| layout.gpa(p * 4096).map(|g| (g, 4096)))
            .collect(),
        window_ms: 0,
    });
    let remote = store.chunks().cache().is_some();
    // Windows of the working set whose chunk is not in the local cache:
    // when there are none (this host slept or woke it lately) the pack is
    // not fetched at all.
    let ws = view.window_size();
    let uncached: std::collections::HashMap<u64, store::ChunkId> = match store.chunks().cache() {
        // One cache lookup (a stat) per window, not per page.
        Some(cache) if remote => pages
            .iter()
            .map(|p| p * 4096 / ws)
            .collect::<std::collections::BTreeSet<u64>>()
            .into_iter()
            .filter_map(|w| match view.window(w) {
                Some(store::Window::Chunk { id, .. })
                    if !store::Backend::exists(cache, &id).unwrap_or(false) =>
                {
                    Some((w, id))
                }
                _ => None,
            })
            .collect(),
        _ => Default::default(),
    };
    let pack = (!uncached.is_empty()).then(|| {
        let gate = std::sync::Arc::new(PackGate {
            windows: uncached,
            state: std::sync::Mutex::new(Default::default()),
            cv: std::sync::Condvar::new(),
        });
        let g = gate.clone();
        let store = store.clone();
        // Fetched while the VMM restores the machine; a pack that is
        // missing or corrupt is logged and its chunks come one GET each
        // as without a pack (every cached chunk was checked).
        let spawned = std::thread::Builder::new()
            .name("pack-fetch".into())
            .spawn(move || {
                let t = std::time::Instant::now();
                match store.fetch_pack_with(id, &|c| g.ready(c)) {
                    Ok(Some(f)) => tracing::info!(
                        "working-set pack of snapshot {id}: {} chunks, {} bytes in {} ms",
                        f.chunks,
                        f.stored_bytes,
                        t.elapsed().as_millis()
                    ),
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!("{e}; prefetching the working set chunk by chunk instead")
                    }
                }
                g.finish();
            });
        if let Err(e) = spawned {
            tracing::warn!("cannot start the working-set pack fetch ({e}); chunk by chunk instead");
            gate.finish();
        }
        gate
    });
    Ok((
        std::sync::Arc::new(StoreSource {
            view,
            layout,
            remote,
            pack,
        }),
        prefetch,
    ))
}

/// `tine wake BRANCH [--name X]`: a vm continues from the branch's
/// snapshot. Without `--name` the branch itself wakes (it must be
/// sleeping); with it, a new branch starts from the same snapshot.
pub fn wake(
    home: &Path,
    branch: &str,
    name: Option<&str>,
    net: bool,
    lazy: bool,
) -> anyhow::Result<ExitCode> {
    Ok(wake_branch(home, branch, name, net, lazy, None)?.report())
}

/// [`wake`] without printing, with an optional fork contract over the
/// snapshot's own.
fn wake_branch(
    home: &Path,
    branch: &str,
    name: Option<&str>,
    net: bool,
    lazy: bool,
    contract: Option<&Path>,
) -> anyhow::Result<crate::vm_cmds::Started> {
    let store = open(home)?;
    let b = store
        .branch(branch)?
        .with_context(|| format!("no branch named {branch:?} in the store (see `tine tree`)"))?;
    let name = name.unwrap_or(branch);
    state::validate_name(name)?;
    if name == branch && b.state != BranchState::Sleeping {
        bail!(
            "branch {branch:?} is {}; wake a copy of it with --name",
            b.state
        );
    }
    if store
        .branch(name)?
        .is_some_and(|x| x.state != BranchState::Gone)
        && name != branch
    {
        bail!("a branch named {name:?} exists already; pick another --name");
    }
    let args = if lazy {
        let dir = materialize(&store, b.snapshot, true)?;
        crate::vm_cmds::RunArgs::restore_lazy(name, &dir, net, b.snapshot.0)
    } else {
        let dir = materialize(&store, b.snapshot, false)?;
        crate::vm_cmds::RunArgs::restore(name, &dir, net)
    }
    .dirty_base(b.snapshot.0)
    .contract(contract);
    let started = crate::vm_cmds::start(home, args)?;
    let vm = VmDir::new(home, name);
    if vm
        .read_record()
        .is_ok_and(|r| vm.state(&r) == VmState::Running)
    {
        let link = BranchLink {
            branch: name.into(),
            snapshot: b.snapshot.0,
        };
        state::write_atomic(&link_path(&vm), &serde_json::to_vec(&link)?)?;
        if name == branch {
            store.set_branch(b.id, None, BranchState::Running)?;
        } else {
            store.create_branch(name, b.snapshot, BranchState::Running)?;
        }
    }
    trim_cache(&store);
    Ok(started)
}

/// Children of a fork of a vm woken from the store descend from the same
/// stored snapshot: their VMMs inherit the parent's dirty tracking
/// (relative to that snapshot), so their sleeps store diff layers under it
/// and `tine tree` draws them there. Without a link, nothing to do.
pub fn link_children(home: &Path, parent: &VmDir, children: &[&VmDir]) -> Vec<String> {
    let Some(link) = read_link(parent) else {
        return Vec::new();
    };
    let store = match open(home) {
        Ok(s) => s,
        Err(e) => return vec![format!("the children are not linked into the tree: {e:#}")],
    };
    let snapshot = SnapshotId(link.snapshot);
    let mut problems = Vec::new();
    for c in children {
        let res = (|| -> anyhow::Result<()> {
            if let Some(b) = store.branch(&c.name)? {
                if b.state != BranchState::Gone {
                    bail!("a {} branch of that name is in the store", b.state);
                }
            }
            let l = BranchLink {
                branch: c.name.clone(),
                snapshot: link.snapshot,
            };
            state::write_atomic(&link_path(c), &serde_json::to_vec(&l)?)?;
            store.create_branch(&c.name, snapshot, BranchState::Running)?;
            Ok(())
        })();
        if let Err(e) = res {
            problems.push(format!(
                "{}: not linked under snapshot {snapshot} (its sleep will store a new root): {e:#}",
                c.name
            ));
        }
    }
    problems
}

/// `tine fork BRANCH -n K [--contract FILE] [--json]` of a sleeping
/// branch: K new branches wake from its snapshot, one after another (they
/// share its materialized memory file). An invalid contract is refused
/// before any of them starts; a copy that fails to start stops the fork
/// with the ones started so far left running.
pub fn fork_sleeping(
    home: &Path,
    branch: &str,
    names: &[String],
    net: bool,
    contract: Option<&Path>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    if let Some(f) = contract {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("cannot read the contract {}", f.display()))?;
        contract::Contract::parse(&text)
            .with_context(|| format!("in {}; nothing was woken", f.display()))?;
    }
    let t0 = std::time::Instant::now();
    let mut copies = Vec::with_capacity(names.len());
    for n in names {
        let s = wake_branch(home, branch, Some(n), net, false, contract)?;
        if !json {
            println!(
                "{}: woke from {branch} in {:.0} ms (pid {})",
                s.name, s.ready_ms, s.pid
            );
        }
        copies.push(s);
    }
    let problems: Vec<&String> = copies.iter().flat_map(|c| &c.problems).collect();
    if json {
        let v = serde_json::json!({
            "branch": branch,
            "names": names,
            "total_ms": t0.elapsed().as_secs_f64() * 1000.0,
            "copies": copies,
            "problems": problems,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        for p in &problems {
            eprintln!("tine: {p}");
        }
    }
    Ok(if problems.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Whether `name` is a sleeping branch of this host's store (and not a vm).
pub fn is_sleeping(home: &Path, name: &str) -> bool {
    !VmDir::new(home, name).exists()
        && branch_row(home, name).is_some_and(|b| b.state == BranchState::Sleeping)
}

/// Whether this host's store knows a branch `name` (in any state).
pub fn has_branch(home: &Path, name: &str) -> bool {
    branch_row(home, name).is_some()
}

/// Branch `name` of this host's store, if there is a store and it has one.
fn branch_row(home: &Path, name: &str) -> Option<store::BranchRow> {
    if !store_exists(home) {
        return None;
    }
    open(home).ok()?.branch(name).ok().flatten()
}

fn store_exists(home: &Path) -> bool {
    home.join("store").exists() || std::env::var_os(store::BACKEND_ENV).is_some()
}

/// Branches whose vm is gone are marked gone (they keep nothing alive).
fn reap_branches(home: &Path, store: &Store) -> anyhow::Result<()> {
    for b in store.branches()? {
        if b.state != BranchState::Running {
            continue;
        }
        let vm = VmDir::new(home, &b.name);
        let alive = vm
            .read_record()
            .is_ok_and(|r| vm.state(&r) == VmState::Running)
            && read_link(&vm).is_some_and(|l| l.snapshot == b.snapshot.0);
        if !alive {
            store.set_branch(b.id, None, BranchState::Gone)?;
        }
    }
    Ok(())
}

/// `tine tree [--json]`.
pub fn tree(home: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let store = open(home)?;
    reap_branches(home, &store)?;
    let t = store.tree()?;
    if json {
        println!("{}", serde_json::to_string_pretty(&t)?);
    } else {
        print!("{}", t.render());
    }
    Ok(ExitCode::SUCCESS)
}

/// `tine gc [--json]`.
pub fn gc(home: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let store = open(home)?;
    reap_branches(home, &store)?;
    let report = store.gc(&store::GcOptions::default(), &Bar::new())?;
    // Materialized snapshots nothing can wake any more.
    let live: std::collections::HashSet<i64> = store.snapshots()?.iter().map(|s| s.id.0).collect();
    if let Ok(rd) = std::fs::read_dir(store.dir().join("wake")) {
        for e in rd.flatten() {
            let keep = e
                .file_name()
                .to_str()
                .and_then(|n| n.trim_end_matches("-lazy").parse::<i64>().ok())
                .is_some_and(|id| live.contains(&id));
            if !keep {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "gc: {} chunks deleted ({} KiB freed), {} unfinished snapshots reaped, {} leftovers removed",
            report.chunks_deleted,
            report.stored_bytes_freed >> 10,
            report.pending_reaped.len(),
            report.leftovers_removed
        );
    }
    trim_cache(&store);
    Ok(ExitCode::SUCCESS)
}

/// `tine store verify [--json]`.
pub fn verify(home: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let store = open(home)?;
    let report = store.verify(&Bar::new())?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    Ok(if report.is_ok() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
