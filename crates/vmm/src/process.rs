//! One VMM process: run a vm, serve its control socket, and carry out
//! forks, checkpoints, snapshots and rollbacks (the bodies of the
//! processes the fork path starts live here too).
//!
//! [`serve`] is the main loop of every VMM process, whether it booted the
//! vm, was forked from another, or restored a snapshot directory.

use std::io::Write;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::api::{Identity, Reply, Request};
use crate::config::{DiskConfig, NetConfig, VmConfig, VsockConfig};
use crate::exit::GuestExit;
use crate::fork::{self, ForkError, ForkParts, ForkSource, Offspring, Spawned};
use crate::memory::RamBacking;

pub use crate::layer::LayerMode;
pub use crate::trace::chain;
use crate::{snapshot_dir, RunError, Vmm};

/// How long a forked vm may take to report that it runs.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a snapshot writer may take.
const WRITER_TIMEOUT: Duration = Duration::from_secs(1800);

/// The process's own identity.
#[derive(Clone, Debug, Default)]
pub struct ProcessOptions {
    pub name: String,
    /// Control socket (none: the vm cannot be forked from outside).
    pub api_socket: Option<PathBuf>,
    /// Written with why the vm ended.
    pub exit_file: Option<PathBuf>,
    /// Start with the vCPUs parked until a `Resume` request.
    pub start_paused: bool,
}

/// Why a vm ended, as written to the exit file.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExitRecord {
    /// How it ended, and for an exit the VMM caused, what failed
    /// (`crashed: page-in of guest 0x…: …`).
    pub reason: String,
    /// Unix time in ms.
    pub ended_ms: u64,
    /// What failed, when the VMM ended the vm (a page it could not page
    /// in); also in `reason`.
    #[serde(default)]
    pub error: Option<String>,
}

/// Errors of a VMM process.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Run(#[from] RunError),
    #[error("Cannot listen on the control socket {path}")]
    Listen {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Runs `vmm` until it exits, serving its control socket; `on_running` is
/// called once its vCPUs run. Writes the exit file and returns why it
/// ended, with the exit record's reason (what failed, where there was a
/// cause: `shutdown: vcpu0: triple fault ... at rip ...`).
pub fn serve(
    vmm: Vmm,
    opts: ProcessOptions,
    on_running: impl FnOnce(),
) -> Result<(GuestExit, String), ServeError> {
    // A forked process still shows its parent's name and command line.
    crate::title::set(&opts.name, None);
    let running = vmm.start_as(opts.start_paused)?;
    if let (Some(path), Some(source)) = (&opts.api_socket, running.fork_source()) {
        let listener = bind(path)?;
        let opts = opts.clone();
        std::thread::Builder::new()
            .name("api".into())
            .spawn(move || {
                crate::seccomp::apply(crate::seccomp::Thread::Api);
                api_loop(listener, source, opts)
            })
            .map_err(|e| RunError::Thread("api", e))?;
    }
    crate::seccomp::apply(crate::seccomp::Thread::Main);
    on_running();
    let notifier = running.handle().exit_notifier().clone();
    let exit = running.wait();
    let reason = match notifier.detail() {
        Some(detail) => {
            let reason = format!("{exit}: {detail}");
            write_exit_detail(&opts, &reason, Some(detail));
            reason
        }
        None => {
            write_exit(&opts, &exit.to_string());
            exit.to_string()
        }
    };
    Ok((exit, reason))
}

/// Records why the vm ended (best effort: the process is ending).
pub fn write_exit(opts: &ProcessOptions, reason: &str) {
    write_exit_detail(opts, reason, None)
}

fn write_exit_detail(opts: &ProcessOptions, reason: &str, error: Option<String>) {
    if let Some(path) = &opts.exit_file {
        let rec = ExitRecord {
            reason: reason.to_string(),
            ended_ms: now_ms(),
            error,
        };
        if let Ok(bytes) = serde_json::to_vec(&rec) {
            let tmp = path.with_extension("tmp");
            if std::fs::write(&tmp, bytes).is_ok() {
                let _ = std::fs::rename(tmp, path);
            }
        }
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Listens on `path`, replacing what is there: the path is this vm's (the
/// CLI keeps names unique), and a socket file left by the process it
/// replaces (a killed vm that rollback restarts, a crashed VMM) may even
/// still accept while that process tears down.
fn bind(path: &Path) -> Result<UnixListener, ServeError> {
    let _ = std::fs::remove_file(path);
    UnixListener::bind(path).map_err(|source| ServeError::Listen {
        path: path.into(),
        source,
    })
}

use crate::api_socket::read_request;

fn send(mut conn: &UnixStream, reply: &Reply) {
    if let Ok(mut bytes) = serde_json::to_vec(reply) {
        bytes.push(b'\n');
        let _ = conn.write_all(&bytes);
    }
}

/// Waits (bounded) until the client closed the connection: it records the
/// new pids before this process goes away.
fn wait_closed(conn: &UnixStream) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
    let mut buf = [0u8; 64];
    let mut r = conn;
    while matches!(std::io::Read::read(&mut r, &mut buf), Ok(n) if n > 0) {}
}

fn api_loop(listener: UnixListener, source: Arc<ForkSource>, opts: ProcessOptions) {
    let requests = match crate::api_socket::requests(listener) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!("cannot serve the control socket: {e}");
            return;
        }
    };
    // Requests are carried out one at a time, in this thread (the one
    // that forks), whatever number of clients are connected.
    for (conn, req) in requests {
        // The fds that came with it stay open until the request is done
        // (a fork's children keep their own copies).
        let (req, _fds) = match req {
            Ok(r) => (r.request, r.fds),
            Err(e) => {
                send(&conn, &Reply::error(e));
                continue;
            }
        };
        // Children, templates and full snapshots read all of RAM: a lazily
        // paged-in vm gets it all first, while it still runs.
        let whole_ram = matches!(
            req,
            Request::Fork { .. } | Request::Checkpoint { .. } | Request::Snapshot { .. }
        );
        if whole_ram {
            if let Err(e) = source.make_resident() {
                send(&conn, &Reply::error(chain(&e)));
                continue;
            }
        }
        let reply = match req {
            Request::Ping => Reply {
                pid: std::process::id(),
                name: opts.name.clone(),
                ..Reply::default()
            },
            Request::Resume => match source.resume() {
                Ok(()) => Reply {
                    pid: std::process::id(),
                    name: opts.name.clone(),
                    ..Reply::default()
                },
                Err(e) => Reply::error(format!("cannot resume: {e}")),
            },
            Request::Fork {
                children,
                layers_dir,
            } => freeze_and(
                &source,
                &opts,
                &layers_dir,
                None,
                &children
                    .iter()
                    .flat_map(|c| c.nets.iter().filter_map(|n| n.fd))
                    .collect::<Vec<_>>(),
                |parts| spawn_children(parts, &children),
                children_running,
            ),
            Request::Checkpoint {
                tag,
                socket,
                layers_dir,
            } => freeze_and(
                &source,
                &opts,
                &layers_dir,
                None,
                &[],
                |parts| {
                    Ok(vec![fork::spawn(parts, true, |off| {
                        template_body(off, &opts.name, &tag, &socket)
                    })?])
                },
                |mut t, _| {
                    let mut reply = Reply::default();
                    for t in &mut t {
                        t.wait_ready(READY_TIMEOUT)?;
                        reply.template_pid = Some(t.pid);
                    }
                    Ok(reply)
                },
            ),
            Request::Snapshot {
                dir,
                layers_dir,
                contract,
            } => {
                let name = opts.name.clone();
                freeze_and(
                    &source,
                    &opts,
                    &layers_dir,
                    None,
                    &[],
                    |parts| {
                        Ok(vec![fork::spawn(parts, false, |off| {
                            writer_body(off, &dir, &name, contract.as_deref(), None)
                        })?])
                    },
                    |mut w, t0| {
                        let mut reply = Reply::default();
                        for w in &mut w {
                            let detail = w.wait_ready(WRITER_TIMEOUT)?;
                            reply.memory_bytes = detail.parse().ok();
                            reply.snapshot_ms = Some(ms(t0.elapsed()));
                        }
                        Ok(reply)
                    },
                )
            }
            Request::SnapshotLayer {
                dir,
                layers_dir,
                contract,
                full,
                rebase,
                expect_base,
            } => snapshot_layer(
                &source,
                &opts,
                &dir,
                &layers_dir,
                contract.as_deref(),
                full,
                rebase,
                expect_base,
            ),
            Request::TrackDirty => match source.handle().enable_dirty_tracking() {
                Ok(()) => Reply {
                    pid: std::process::id(),
                    name: opts.name.clone(),
                    dirty: Some(source.handle().dirty_tracking()),
                    ..Reply::default()
                },
                Err(e) => Reply::error(format!("cannot track dirty pages: {}", chain(&e))),
            },
            Request::PageIn { working_set_to } => {
                let written = match (source.pagein(), &working_set_to) {
                    (Some(p), Some(path)) => p.working_set().write(path).map_err(|e| chain(&e)),
                    _ => Ok(()),
                };
                match written {
                    Ok(()) => Reply {
                        pid: std::process::id(),
                        name: opts.name.clone(),
                        pagein: source.pagein().map(|p| p.stats()),
                        ..Reply::default()
                    },
                    Err(e) => Reply::error(e),
                }
            }
            Request::FoldLayers { layers } => match source.fold_layers(&layers) {
                Ok(fold) => Reply {
                    pid: std::process::id(),
                    name: opts.name.clone(),
                    fold,
                    ..Reply::default()
                },
                Err(e) => Reply::error(format!("cannot fold layers: {}", chain(&e))),
            },
            Request::Rollback { .. } | Request::Drop => {
                Reply::error("this is a running vm, not a checkpoint")
            }
        };
        let done = reply.error.is_none() && reply.continuation_pid.is_some();
        send(&conn, &reply);
        if done {
            // The vm continues in another process; this one only held the
            // frozen memory, which nobody needs from it any more.
            wait_closed(&conn);
            // SAFETY: ends the process without running destructors that
            // would remove sockets the continuation now owns.
            unsafe { libc::_exit(0) }
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// `SnapshotLayer`: the fork path with a writer that writes a memory
/// layer; the continuation rebases its dirty set if asked.
#[allow(clippy::too_many_arguments)]
fn snapshot_layer(
    source: &ForkSource,
    opts: &ProcessOptions,
    dir: &Path,
    layers_dir: &Path,
    contract: Option<&str>,
    full: bool,
    rebase: Option<String>,
    expect_base: Option<String>,
) -> Reply {
    let tracking = source.handle().dirty_tracking();
    let expected = |b: &String| expect_base.as_ref().is_none_or(|e| e == b);
    let mode = match (&tracking.base, full || !tracking.enabled) {
        (Some(b), false) if expected(b) => LayerMode::Diff(b.clone()),
        _ => LayerMode::Full,
    };
    // A full layer reads all of RAM: lazily paged-in memory must be there.
    // A diff reads only dirty pages, which are present.
    if mode == LayerMode::Full {
        if let Err(e) = source.make_resident() {
            return Reply::error(chain(&e));
        }
    }
    let name = opts.name.clone();
    let mut reply = freeze_and(
        source,
        opts,
        layers_dir,
        rebase,
        &[],
        |parts| {
            Ok(vec![fork::spawn(parts, false, |off| {
                writer_body(off, dir, &name, contract, Some(&mode))
            })?])
        },
        |mut w, t0| {
            let mut reply = Reply::default();
            for w in &mut w {
                let detail = w.wait_ready(WRITER_TIMEOUT)?;
                let info: crate::layer::LayerInfo = serde_json::from_str(&detail)
                    .map_err(|e| ForkError::Child(format!("bad layer report: {e}")))?;
                reply.memory_bytes = Some(info.data_bytes);
                reply.layer = Some(info);
                reply.snapshot_ms = Some(ms(t0.elapsed()));
            }
            Ok(reply)
        },
    );
    if reply.error.is_none() && reply.continuation_pid.is_none() {
        // The vm went on in this process: its tracking is here.
        reply.dirty = Some(source.handle().dirty_tracking());
    }
    reply
}

/// The fork path: freeze, start the continuation, then `start` the other
/// processes (children, a template, a writer) while it comes up, and
/// `finish` once it runs; say how long the guest was paused. If the
/// continuation cannot start, the others are killed and the vm thaws and
/// runs on here.
fn freeze_and(
    source: &ForkSource,
    opts: &ProcessOptions,
    layers_dir: &Path,
    rebase: Option<String>,
    keep: &[i32],
    start: impl FnOnce(&ForkParts) -> Result<Vec<Spawned>, ForkError>,
    finish: impl FnOnce(Vec<Spawned>, Instant) -> Result<Reply, ForkError>,
) -> Reply {
    let t0 = Instant::now();
    let stamp = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or(0);
    if let Err(e) = std::fs::create_dir_all(layers_dir) {
        return Reply::error(format!("cannot create {}: {e}", layers_dir.display()));
    }
    if source.backing() == RamBacking::Private {
        return freeze_in_place(
            source, opts, layers_dir, stamp, rebase, keep, start, finish, t0,
        );
    }
    // The continuation's KVM setup happens now, while the guest runs.
    let me = continuation_identity(source.config(), opts);
    let standby = source
        .prepare(|off| vm_body(off, &me, Mode::Continuation))
        .ok();
    let mut frozen = match source
        .freeze(|i| Some(layers_dir.join(format!("{}-disk{i}-{stamp}.qcow2", opts.name))))
    {
        Ok(f) => f,
        Err(e) => {
            if let Some(s) = standby {
                s.cancel();
            }
            return Reply::error(format!("{}; the vm runs on unchanged", chain(&e)));
        }
    };
    if let Some(b) = rebase {
        frozen.rebase_continuation(b);
    }
    // The continuation listens on the same control socket path.
    let api_aside = opts.api_socket.as_ref().map(|p| {
        let aside = p.with_extension(format!("frozen-{}", std::process::id()));
        let _ = std::fs::rename(p, &aside);
        (p.clone(), aside)
    });
    fork::trace(frozen.started(), "frozen");
    let mut others = Vec::new();
    let mut cont_pid = None;
    let cont = match standby {
        Some(s) => frozen.hand_over(s),
        None => fork::spawn(&frozen.continuation_parts(), true, |off| {
            vm_body(off, &me, Mode::Continuation)
        }),
    }
    .and_then(|mut c| {
        fork::trace(frozen.started(), "continuation forked");
        cont_pid = Some(c.pid);
        others = start(&frozen.parts())?;
        let running_ns = c.wait_ready(READY_TIMEOUT)?;
        Ok((c, running_ns))
    });
    let (cont, running_ns) = match cont {
        Ok(c) => c,
        Err(e) => {
            // The vm goes on here: nothing started for it may linger,
            // running or as a zombie.
            for pid in others.iter().map(|o| o.pid).chain(cont_pid) {
                kill(pid);
                fork::reap(pid, Duration::from_secs(1));
            }
            if let Some((p, aside)) = api_aside {
                let _ = std::fs::rename(aside, p);
            }
            let msg = format!("the vm could not continue after the freeze: {}", chain(&e));
            return thawed_error(frozen, msg);
        }
    };
    // The continuation says when its vCPUs started (same clock); the
    // parent may notice later, busy starting the others.
    let pause_ms = running_ns
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse::<u64>().ok())
        .map(|ns| ns.saturating_sub(frozen.started_ns()) as f64 / 1e6)
        .unwrap_or_else(|| ms(frozen.started().elapsed()));
    if let Some((_, aside)) = api_aside {
        let _ = std::fs::remove_file(aside);
    }
    let mut reply = match finish(others, t0) {
        Ok(r) => r,
        Err(e) => Reply::error(format!(
            "{} (the vm itself continues as pid {})",
            chain(&e),
            cont.pid
        )),
    };
    frozen.leave_frozen();
    reply.pid = std::process::id();
    reply.name = opts.name.clone();
    reply.continuation_pid = Some(cont.pid);
    reply.pause_ms = Some(pause_ms);
    reply
}

/// The fork path of a vm with private memory: fork(2) gives every new
/// process a copy-on-write view while this one keeps its own, so the vm
/// goes on in this process. Only one process is forked while the guest is
/// paused, a zygote holding the frozen view; it starts the others (off
/// the pause) and reports them.
#[allow(clippy::too_many_arguments)]
fn freeze_in_place(
    source: &ForkSource,
    opts: &ProcessOptions,
    layers_dir: &Path,
    stamp: u128,
    rebase: Option<String>,
    keep: &[i32],
    start: impl FnOnce(&ForkParts) -> Result<Vec<Spawned>, ForkError>,
    finish: impl FnOnce(Vec<Spawned>, Instant) -> Result<Reply, ForkError>,
    t0: Instant,
) -> Reply {
    let mut frozen = match source
        .freeze(|i| Some(layers_dir.join(format!("{}-disk{i}-{stamp}.qcow2", opts.name))))
    {
        Ok(f) => f,
        Err(e) => return Reply::error(format!("{}; the vm runs on unchanged", chain(&e))),
    };
    let started = frozen.started();
    fork::trace(started, "frozen");
    // Everything that can fail on the vm's own disks happens before any
    // process may stack on its frozen layers: until the zygote exists the
    // freeze can be undone whole.
    if let Err(e) = frozen.prepare_tops() {
        return thawed_error(frozen, chain(&e));
    }
    fork::trace(started, "new tops");
    // It keeps the fds the children take (their taps).
    let zygote = fork::spawn_keeping(&frozen.parts(), true, keep, |off| {
        let done = start(&off.parts).and_then(|spawned| finish(spawned, t0));
        match done.map(|r| serde_json::to_string(&r)) {
            Ok(Ok(json)) => {
                off.ready(&json);
                0
            }
            Ok(Err(e)) => {
                off.failed(&e.to_string());
                1
            }
            Err(e) => {
                off.failed(&chain(&e));
                1
            }
        }
    });
    let mut zygote = match zygote {
        Ok(z) => z,
        Err(e) => return thawed_error(frozen, chain(&e)),
    };
    fork::trace(started, "zygote forked");
    if let Some(b) = rebase {
        // The zygote holds the moment's dirty set; the vm going on here
        // starts an empty one relative to the moment being stored.
        frozen.rebase_continuation(b);
        if let Err(e) = frozen.rebase_here() {
            tracing::warn!("cannot rebase the dirty set: {}", chain(&e));
        }
    }
    if let Err(e) = frozen.resume_here() {
        return Reply::error(format!(
            "the vm could not go on after the fork: {}",
            chain(&e)
        ));
    }
    let pause_ms = ms(started.elapsed());
    let mut reply = match zygote.wait_ready(WRITER_TIMEOUT) {
        Ok(json) => {
            // It exits right after its report; the processes it started
            // are orphans the system reaps.
            zygote.reap(Duration::from_secs(1));
            serde_json::from_str(&json)
                .unwrap_or_else(|e| Reply::error(format!("bad report from the zygote: {e}")))
        }
        Err(e) => {
            zygote.kill_and_reap();
            Reply::error(chain(&e))
        }
    };
    reply.pid = std::process::id();
    reply.name = opts.name.clone();
    reply.pause_ms = Some(pause_ms);
    reply
}

/// Undoes a freeze that could not go on; the error reply says whether
/// the vm runs on unchanged.
fn thawed_error(frozen: fork::Frozen<'_>, msg: String) -> Reply {
    match frozen.thaw() {
        Ok(()) => Reply::error(format!("{msg}; the vm runs on unchanged")),
        Err(t) => Reply::error(format!(
            "{msg}; and the vm could not be thawed: {}",
            chain(&t)
        )),
    }
}

fn kill(pid: u32) {
    // SAFETY: kill(2) of a process this one just forked.
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGKILL);
    }
}

/// Starts one process per child.
fn spawn_children(parts: &ForkParts, children: &[Identity]) -> Result<Vec<Spawned>, ForkError> {
    let mut spawned = Vec::with_capacity(children.len());
    for id in children {
        // A child keeps only its own taps (those the host passed).
        let taps: Vec<i32> = id.nets.iter().filter_map(|n| n.fd).collect();
        match fork::spawn_keeping(parts, false, &taps, |off| vm_body(off, id, Mode::Child)) {
            Ok(s) => spawned.push(s),
            Err(e) => {
                for s in &spawned {
                    kill(s.pid);
                }
                return Err(e);
            }
        }
    }
    Ok(spawned)
}

/// Waits until every child runs.
fn children_running(mut spawned: Vec<Spawned>, t0: Instant) -> Result<Reply, ForkError> {
    let mut reply = Reply::default();
    for s in &mut spawned {
        s.wait_ready(READY_TIMEOUT)?;
        reply.children.push(s.pid);
        reply.child_running_ms.push(ms(t0.elapsed()));
    }
    reply.all_children_ms = Some(ms(t0.elapsed()));
    Ok(reply)
}

/// The parent's own identity, for its continuation (its disks are the
/// frozen disks' former top paths, see [`vm_config`]).
fn continuation_identity(config: &VmConfig, opts: &ProcessOptions) -> Identity {
    Identity {
        name: opts.name.clone(),
        start_paused: false,
        console_log: config.console_log.clone().unwrap_or_default(),
        console_socket: config.console_socket.clone(),
        log: PathBuf::new(),
        disks: Vec::new(),
        nets: Vec::new(),
        vsock: config.vsock.as_ref().map(|v| v.uds_path.clone()),
        api_socket: opts.api_socket.clone().unwrap_or_default(),
        exit_file: opts.exit_file.clone().unwrap_or_default(),
    }
}

/// Which process a [`vm_body`] is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The vm itself, going on: keeps stdio, console settings and taps.
    Continuation,
    /// A new vm with its own identity.
    Child,
    /// The vm started again from a checkpoint: its own identity, the
    /// template's taps.
    Rollback,
}

/// Body of a process that runs a vm from the frozen moment.
fn vm_body(off: &mut Offspring, id: &Identity, mode: Mode) -> i32 {
    match start_vm(off, id, mode) {
        Ok(code) => code,
        Err(e) => {
            off.failed(&e);
            1
        }
    }
}

fn start_vm(off: &mut Offspring, id: &Identity, mode: Mode) -> Result<i32, String> {
    let t = Instant::now();
    let mark = |what: &str| fork::trace(t, what);
    if mode != Mode::Continuation {
        redirect_stdio(&id.log)?;
    }
    if mode == Mode::Rollback {
        // The replaced vm was killed; its sockets may linger a moment.
        for p in id.vsock.iter().chain(&id.console_socket) {
            let _ = std::fs::remove_file(p);
        }
    }
    let prepared = off.prepared.take();
    let parts = &off.parts;
    let config = vm_config(parts, id, mode)?;
    let dirty = parts.dirty.clone();
    for d in &parts.disks {
        let top = &config
            .disks
            .get(d.index)
            .ok_or("frozen disk index out of range")?
            .path;
        disk::create_overlay(&d.frozen, top).map_err(|e| {
            format!(
                "cannot create the top layer {}: {}",
                top.display(),
                chain(&e)
            )
        })?;
    }
    mark("overlays");
    let mut vmm = crate::builder::restore_prepared(
        &config,
        parts.mem.clone(),
        RamBacking::Private,
        &parts.moment,
        prepared,
    )
    .map_err(|e| format!("cannot restore the vm: {}", chain(&e)))?;
    // Every process that continues tracks on its own (a new KVM VM), with
    // the dirty set and base of the moment it continues from.
    vmm.track_dirty(dirty);
    if mode != Mode::Continuation {
        // A new copy of the vm: a new VMGenID, so the guest kernel reseeds.
        vmm.new_generation()
            .map_err(|e| format!("cannot write a new generation id: {}", chain(&e)))?;
    }
    mark("restored");
    let opts = ProcessOptions {
        name: id.name.clone(),
        api_socket: Some(id.api_socket.clone()).filter(|p| !p.as_os_str().is_empty()),
        exit_file: Some(id.exit_file.clone()).filter(|p| !p.as_os_str().is_empty()),
        start_paused: mode == Mode::Child && id.start_paused,
    };
    let pid = std::process::id();
    let (exit, _) = serve(vmm, opts, || {
        mark("running");
        off.ready(&format!("{pid} {}", fork::monotonic_ns()))
    })
    .map_err(|e| format!("cannot run the vm: {}", chain(&e)))?;
    Ok(exit.exit_code())
}

/// The configuration of a vm continuing from `parts` as `id`.
fn vm_config(parts: &ForkParts, id: &Identity, mode: Mode) -> Result<VmConfig, String> {
    let mut c = parts.config.clone();
    if mode != Mode::Continuation {
        c.console_log = Some(id.console_log.clone());
        c.console_socket = id.console_socket.clone();
        c.console_stdout = false;
        c.console_stdin = false;
    }
    for (k, d) in parts.disks.iter().enumerate() {
        let top = match mode {
            Mode::Continuation => d.top.clone(),
            _ => id.disks.get(k).cloned().ok_or_else(|| {
                format!(
                    "the vm has {} writable disks; give a top layer for each",
                    parts.disks.len()
                )
            })?,
        };
        *c.disks
            .get_mut(d.index)
            .ok_or("frozen disk index out of range")? = DiskConfig {
            path: top,
            read_only: false,
        };
    }
    let taps = &parts.tap_fds;
    c.nets = c
        .nets
        .iter()
        .enumerate()
        .map(|(j, n)| match (mode, taps.get(j), id.nets.get(j)) {
            (Mode::Child, _, Some(ni)) => Ok(NetConfig {
                tap: ni.tap.clone(),
                mac: ni.mac,
                tap_fd: ni.fd,
            }),
            (Mode::Child, _, None) => Err(format!(
                "the vm has {} network devices; give each child a tap",
                parts.config.nets.len()
            )),
            (_, Some(&fd), _) => Ok(NetConfig {
                tap: n.tap.clone(),
                mac: n.mac,
                tap_fd: Some(fd),
            }),
            (_, None, _) => Ok(NetConfig {
                tap_fd: None,
                ..n.clone()
            }),
        })
        .collect::<Result<_, _>>()?;
    if let Some(v) = &c.vsock {
        let path = id
            .vsock
            .clone()
            .ok_or("the vm has a vsock device; give a socket path")?;
        c.vsock = Some(VsockConfig {
            guest_cid: v.guest_cid,
            uds_path: path,
        });
    }
    Ok(c)
}

/// stdin from /dev/null, stdout and stderr appended to `log`.
fn redirect_stdio(log: &Path) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let null = std::fs::File::open("/dev/null").map_err(|e| format!("/dev/null: {e}"))?;
    let out = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| format!("cannot open {}: {e}", log.display()))?;
    // SAFETY: dup2 onto the standard descriptors; both sources are open.
    unsafe {
        libc::dup2(null.as_raw_fd(), 0);
        libc::dup2(out.as_raw_fd(), 1);
        libc::dup2(out.as_raw_fd(), 2);
    }
    Ok(())
}

/// Body of a checkpoint's template: holds the frozen moment and starts the
/// vm from it again on request (rollback).
fn template_body(off: &mut Offspring, name: &str, tag: &str, socket: &Path) -> i32 {
    crate::title::set(name, Some(&format!("(checkpoint {tag})")));
    // The vms it starts are its children; one replaced by a later rollback
    // must not linger as a zombie: the kernel reaps them.
    // SAFETY: sets the disposition of one signal in this single-threaded
    // process.
    unsafe {
        libc::signal(libc::SIGCHLD, libc::SIG_IGN);
    }
    let listener = match bind(socket) {
        Ok(l) => l,
        Err(e) => {
            off.failed(&chain(&e));
            return 1;
        }
    };
    off.ready(&std::process::id().to_string());
    let parts = off.parts.clone();
    // A standby with its VM made waits for the next rollback.
    let prepare = || fork::spawn_standby(&parts, true, rollback_standby_body).ok();
    let mut standby = prepare();
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let reply = match read_request(&conn).map(|r| r.request) {
            Err(e) => Reply::error(e),
            Ok(Request::Ping) => Reply {
                pid: std::process::id(),
                name: tag.to_string(),
                ..Reply::default()
            },
            Ok(Request::Drop) => {
                send(
                    &conn,
                    &Reply {
                        pid: std::process::id(),
                        ..Reply::default()
                    },
                );
                let _ = std::fs::remove_file(socket);
                return 0;
            }
            Ok(Request::Rollback { vm }) => {
                let reply = rollback(&parts, &vm, standby.take());
                send(&conn, &reply);
                standby = prepare();
                continue;
            }
            Ok(_) => Reply::error("this is a checkpoint: it takes rollback, ping and drop"),
        };
        send(&conn, &reply);
    }
    0
}

/// Body of a template's standby: the vm's identity arrives as JSON.
fn rollback_standby_body(off: &mut Offspring, data: Vec<u8>) -> i32 {
    match serde_json::from_slice::<Identity>(&data) {
        Ok(id) => vm_body(off, &id, Mode::Rollback),
        Err(e) => {
            off.failed(&format!("bad rollback request: {e}"));
            1
        }
    }
}

/// Starts the vm `id` again from a checkpoint. The caller has stopped the
/// vm; its top layers are replaced by fresh overlays on the frozen ones.
fn rollback(parts: &ForkParts, id: &Identity, standby: Option<fork::Standby>) -> Reply {
    let t0 = Instant::now();
    for top in &id.disks {
        let _ = std::fs::remove_file(top);
    }
    let started = match standby {
        Some(s) => serde_json::to_vec(id)
            .map_err(|e| ForkError::Child(e.to_string()))
            .and_then(|data| s.start(&data)),
        None => fork::spawn(parts, true, |off| vm_body(off, id, Mode::Rollback)),
    }
    .and_then(|mut s| s.wait_ready(READY_TIMEOUT).map(|_| s));
    match started {
        Ok(s) => Reply {
            pid: std::process::id(),
            name: id.name.clone(),
            continuation_pid: Some(s.pid),
            pause_ms: Some(ms(t0.elapsed())),
            ..Reply::default()
        },
        Err(e) => Reply::error(format!(
            "cannot start the vm from the checkpoint: {}",
            chain(&e)
        )),
    }
}

/// Body of a snapshot writer: writes the frozen view and exits. With a
/// layer mode, memory goes to `memory.layer` and the report is its
/// [`crate::layer::LayerInfo`] as JSON.
fn writer_body(
    off: &mut Offspring,
    dir: &Path,
    name: &str,
    contract: Option<&str>,
    layer: Option<&LayerMode>,
) -> i32 {
    let res = match layer {
        None => snapshot_dir::write(&off.parts, dir, name, contract).map(|b| b.to_string()),
        Some(mode) => snapshot_dir::write_layer(&off.parts, dir, name, contract, mode)
            .map(|info| serde_json::to_string(&info).unwrap_or_default()),
    };
    match res {
        Ok(detail) => {
            off.ready(&detail);
            0
        }
        Err(e) => {
            off.failed(&chain(&e));
            1
        }
    }
}
