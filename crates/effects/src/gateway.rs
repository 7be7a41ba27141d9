//! The gateway process: per-branch proxy listeners, the replay rule, and
//! the control socket.
//!
//! A request's way (docs/design/effects.md has the why):
//!
//! 1. The listener that accepted the connection names the branch (the
//!    guest's bytes never do). One request per connection (`Connection:
//!    close`), so "the response was written" is "the connection ended
//!    cleanly", and the VMM draining it is visible (SIOCOUTQ).
//! 2. The destination's policy (the branch's contract): `deny-in-children`
//!    refuses children; GET/HEAD/OPTIONS and `pass` are forwarded and
//!    journaled, never replayed.
//! 3. Else the key: `Idempotency-Key`, or derived from the request digest
//!    and how many such responses the lineage was already given.
//! 4. A recorded response for the key is replayed; an in-flight one is
//!    waited for; otherwise a `sent` row is committed, the destination is
//!    called by a task that outlives the guest's connection, and the
//!    response is committed (`completed`) before any byte of it is
//!    released.

use std::collections::HashMap;
use std::convert::Infallible;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{combinators::BoxBody, BodyExt, Full, Limited};
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixListener, UnixStream};
use tokio::sync::{mpsc, watch};

use crate::control::{self, Reply};
use crate::egress::{self, Denied};
use crate::journal::{EffectRow, Journal, NewEffect, State};
use crate::tls;
use crate::{EffectPolicy, Error, MomentKind, Paths, Registration};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type RespBody = BoxBody<Bytes, BoxError>;

/// The header replayed (and executed) responses carry.
pub const EFFECT_HEADER: &str = "x-tine-effect";
/// Fault injection for tests: `after-response-before-journal` aborts the
/// gateway right after a destination's response arrived, before it is
/// journaled (a kill -9 at the worst moment).
pub const FAULT_ENV: &str = "TINE_EFFECTS_FAULT";
/// How often a gateway on a shared journal says it is alive.
const HEARTBEAT: Duration = Duration::from_secs(5);
/// A gateway silent this long is gone: another host takes what it was
/// sending as in doubt (twelve missed heartbeats, so a slow database or a
/// busy host is not mistaken for a dead one).
const HOST_GONE: Duration = Duration::from_secs(60);

/// How the gateway runs.
#[derive(Clone, Debug)]
pub struct Options {
    /// `$TINE_HOME`; state in `effects/`.
    pub home: PathBuf,
    /// Largest request body accepted (it is hashed and kept in memory).
    pub max_request_bytes: usize,
    /// How long a destination may take to start its response; after that
    /// the effect is in doubt.
    pub upstream_timeout: Duration,
    pub connect_timeout: Duration,
    /// How long a moment may hold a branch's responses (a CLI that died
    /// between `moment` and `moment_done`).
    pub hold_limit: Duration,
    pub fault_after_response: bool,
    /// Host networks the gateway may reach although they are the host's
    /// own ([`egress::ALLOW_PRIVATE_ENV`]; tests only).
    pub allow_private: Vec<egress::HostRule>,
    /// Extra roots for destinations' certificates ([`tls::EXTRA_ROOTS_ENV`]).
    pub extra_roots: Option<PathBuf>,
}

impl Options {
    pub fn new(home: &Path) -> Self {
        Options {
            home: home.to_path_buf(),
            max_request_bytes: 16 << 20,
            upstream_timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(30),
            hold_limit: Duration::from_secs(300),
            fault_after_response: std::env::var(FAULT_ENV).as_deref()
                == Ok("after-response-before-journal"),
            allow_private: Vec::new(),
            extra_roots: None,
        }
    }

    /// [`Options::new`] with the host settings from the environment
    /// ([`egress::ALLOW_PRIVATE_ENV`]); a malformed one is an error, never
    /// ignored.
    pub fn from_env(home: &Path) -> Result<Self, Error> {
        let mut o = Options::new(home);
        if let Ok(v) = std::env::var(egress::ALLOW_PRIVATE_ENV) {
            o.allow_private = egress::HostRule::parse_list(&v).map_err(Error::Gateway)?;
        }
        if let Some(p) = std::env::var_os(tls::EXTRA_ROOTS_ENV).filter(|v| !v.is_empty()) {
            let p = PathBuf::from(p);
            tls::read_roots(&p)
                .map_err(|e| Error::Gateway(format!("{}: {e}", tls::EXTRA_ROOTS_ENV)))?;
            o.extra_roots = Some(p);
        }
        Ok(o)
    }
}

/// The outcome of one effect, as its waiters see it.
enum Outcome {
    Completed {
        id: i64,
        status: u16,
        head: Vec<u8>,
        body: Bytes,
        by: String,
    },
    /// Too large to keep: the rest of the body goes to the request that
    /// made it (if it still listens), the others get an error.
    TooLarge {
        id: i64,
        status: u16,
        head: Vec<u8>,
        origin_conn: u64,
        stream: Mutex<Option<mpsc::Receiver<Bytes>>>,
        /// The destination's Content-Length, if it gave one.
        length: Option<HeaderValue>,
        by: String,
    },
    InDoubt(String),
    /// Nothing reached the destination; the key is free again.
    Unsent(String),
}

type OutcomeRx = watch::Receiver<Option<Arc<Outcome>>>;

struct Store {
    journal: Journal,
    /// Effects being executed (state `sent`), by row id.
    inflight: HashMap<i64, OutcomeRx>,
}

struct Conn {
    /// A second handle on the socket: to cut it and to see what the peer
    /// has not read yet.
    stream: StdUnixStream,
    severed: bool,
    /// The digest of the derived-key request waiting on this connection.
    pending: Option<String>,
}

#[derive(Default)]
struct BranchState {
    conns: HashMap<u64, Conn>,
    /// A moment is being taken: no response is released.
    hold: bool,
    /// Responses past the hold check, not yet recorded as released.
    releasing: usize,
}

struct Branch {
    reg: Registration,
    state: Mutex<BranchState>,
    hold_tx: watch::Sender<bool>,
    accept: Mutex<Option<tokio::task::AbortHandle>>,
}

struct Shared {
    opts: Options,
    paths: Paths,
    /// HTTPS interception (CA, leaves, roots), made on first use.
    tls: tls::Tls,
    store: Mutex<Store>,
    branches: Mutex<HashMap<String, Arc<Branch>>>,
    next_conn: AtomicU64,
    shutdown: tokio::sync::Notify,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs the gateway in the foreground until `Shutdown`.
pub fn serve(opts: Options) -> Result<(), Error> {
    // A guest that goes away mid-response must be an error, not a signal
    // (`tine` sets SIGPIPE to its default for its short-lived verbs).
    // SAFETY: sets one signal's disposition to ignore; no handler runs.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    // Everything the gateway makes is its own, whatever umask it was
    // started with: sockets, journal, CA key (sockets are chmod'ed too).
    // SAFETY: umask(2) only sets this process's file-creation mask.
    unsafe {
        libc::umask(0o077);
    }
    let paths = Paths::new(&opts.home);
    std::fs::create_dir_all(&paths.dir)
        .map_err(|e| Error::Io(paths.dir.display().to_string(), e))?;
    let lockfile = std::fs::File::create(paths.lock())
        .map_err(|e| Error::Io(paths.lock().display().to_string(), e))?;
    // SAFETY: flock(2) on a file we own for the process's lifetime.
    if unsafe { libc::flock(lockfile.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return Err(Error::Gateway(format!(
            "another gateway runs for {} (it holds {})",
            opts.home.display(),
            paths.lock().display()
        )));
    }
    // SQLite here, or the fleet's PostgreSQL (TINE_META), as this host.
    let mut journal = Journal::connect(&paths.meta()?, &paths.host_id()?)?;
    // Alive before anything is sent (see HOST_GONE).
    journal.heartbeat()?;
    let doubted = journal.mark_in_doubt()?;
    if doubted > 0 {
        eprintln!(
            "tine gateway: {doubted} effect(s) were being sent when the gateway last ended: now in doubt (see `tine effects`)"
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::Io("tokio runtime".into(), e))?;
    let shared = Arc::new(Shared {
        tls: tls::Tls::new(&paths, opts.extra_roots.clone()),
        opts,
        paths: paths.clone(),
        store: Mutex::new(Store {
            journal,
            inflight: HashMap::new(),
        }),
        branches: Mutex::new(HashMap::new()),
        next_conn: AtomicU64::new(1),
        shutdown: tokio::sync::Notify::new(),
    });
    let res = rt.block_on(run(shared.clone()));
    let _ = std::fs::remove_file(paths.pidfile());
    drop(lockfile);
    res
}

async fn run(shared: Arc<Shared>) -> Result<(), Error> {
    tokio::spawn(heartbeat(shared.clone()));
    let regs = lock(&shared.store).journal.active_branches()?;
    for reg in regs {
        if let Err(e) = register(&shared, reg.clone()) {
            eprintln!(
                "tine gateway: vm {:?} (branch {}) not re-bound: {e}",
                reg.vm, reg.branch
            );
            let _ = lock(&shared.store).journal.set_active(&reg.branch, false);
        }
    }
    let control = shared.paths.control();
    // A control socket left by an earlier gateway of this home (the lock
    // says none runs); anything else there is not ours to remove.
    if let Ok(m) = std::fs::symlink_metadata(&control) {
        if !is_own_socket(&m) {
            return Err(Error::Gateway(format!(
                "{} exists and is not a socket of this gateway; not replaced",
                control.display()
            )));
        }
        let _ = std::fs::remove_file(&control);
    }
    let listener = bind_private(&control)?;
    std::fs::write(shared.paths.pidfile(), format!("{}\n", std::process::id()))
        .map_err(|e| Error::Io(shared.paths.pidfile().display().to_string(), e))?;
    eprintln!(
        "tine gateway: pid {} serving {}",
        std::process::id(),
        control.display()
    );
    loop {
        tokio::select! {
            acc = listener.accept() => match acc {
                Ok((s, _)) => {
                    tokio::spawn(control_conn(shared.clone(), s));
                }
                Err(e) => {
                    eprintln!("tine gateway: control accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            _ = shared.shutdown.notified() => break,
        }
    }
    let _ = std::fs::remove_file(&control);
    Ok(())
}

/// Keeps this host's heartbeat in a shared journal fresh.
async fn heartbeat(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(HEARTBEAT);
    loop {
        tick.tick().await;
        if let Err(e) = tokio::task::block_in_place(|| lock(&shared.store).journal.heartbeat()) {
            eprintln!("tine gateway: heartbeat: {e}");
        }
    }
}

// ---------------------------------------------------------------- control

/// Whether a peer may use the control socket: the gateway's own user, or
/// root. The socket is 0600 already; this holds even if its mode or its
/// directory's were loosened.
fn peer_allowed(s: &UnixStream) -> Result<(), String> {
    let cred = s
        .peer_cred()
        .map_err(|e| format!("cannot read the peer's credentials: {e}"))?;
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    let me = unsafe { libc::geteuid() };
    if cred.uid() == me || cred.uid() == 0 {
        Ok(())
    } else {
        Err(format!(
            "refused: uid {} is neither the gateway's user ({me}) nor root",
            cred.uid()
        ))
    }
}

async fn control_conn(shared: Arc<Shared>, mut s: UnixStream) {
    use tokio::io::AsyncBufReadExt;
    if let Err(why) = peer_allowed(&s) {
        eprintln!("tine gateway: control connection {why}");
        let reply = Reply {
            ok: false,
            error: Some(format!("effects gateway control: {why}")),
            status: None,
        };
        let mut out = serde_json::to_vec(&reply).unwrap_or_default();
        out.push(b'\n');
        let _ = s.write_all(&out).await;
        return;
    }
    let (r, mut w) = s.into_split();
    let mut lines = tokio::io::BufReader::new(r).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let (reply, stop) = match serde_json::from_str::<control::Request>(&line) {
            Ok(req) => {
                let stop = matches!(req, control::Request::Shutdown);
                (control_request(&shared, req).await, stop)
            }
            Err(e) => (
                Reply {
                    ok: false,
                    error: Some(format!("bad control request: {e}")),
                    status: None,
                },
                false,
            ),
        };
        let mut out = serde_json::to_vec(&reply).unwrap_or_else(|_| b"{\"ok\":false}".to_vec());
        out.push(b'\n');
        if w.write_all(&out).await.is_err() {
            return;
        }
        if stop {
            shared.shutdown.notify_one();
            return;
        }
    }
}

async fn control_request(shared: &Arc<Shared>, req: control::Request) -> Reply {
    use control::Request as R;
    let res: Result<Option<control::Status>, Error> = match req {
        R::Ping | R::Shutdown => Ok(None),
        R::Register { reg } => tokio::task::block_in_place(|| register(shared, reg)).map(|_| None),
        R::Unregister { branch } => {
            tokio::task::block_in_place(|| unregister(shared, &branch)).map(|_| None)
        }
        R::Moment {
            branch,
            moment,
            kind,
        } => moment_begin(shared, &branch, &moment, kind)
            .await
            .map(|_| None),
        R::MomentDone {
            branch,
            moment,
            ok,
            register: regs,
        } => tokio::task::block_in_place(|| {
            moment_end(shared, &branch, &moment, ok)?;
            for r in regs {
                register(shared, r)?;
            }
            Ok(None)
        }),
        R::Status => tokio::task::block_in_place(|| {
            let store = lock(&shared.store);
            let mut branches: Vec<(String, String)> = lock(&shared.branches)
                .values()
                .map(|b| (b.reg.vm.clone(), b.reg.branch.clone()))
                .collect();
            branches.sort();
            Ok(Some(control::Status {
                pid: std::process::id(),
                branches,
                journal: shared.paths.meta()?.shown(),
                schema_version: store.journal.schema_version()?,
                effects: store.journal.counts()?,
            }))
        }),
    };
    match res {
        Ok(status) => Reply {
            ok: true,
            error: None,
            status,
        },
        Err(e) => Reply {
            ok: false,
            error: Some(e.to_string()),
            status: None,
        },
    }
}

/// Listens for `reg` at its socket; a branch that listened there before
/// (the same vm, an earlier copy) is unregistered.
fn register(shared: &Arc<Shared>, reg: Registration) -> Result<(), Error> {
    reg.effects
        .validate()
        .map_err(|e| Error::Control(e.to_string()))?;
    let existing = check_socket_path(shared, &reg.socket)?;
    let old: Vec<String> = lock(&shared.branches)
        .values()
        .filter(|b| b.reg.socket == reg.socket || b.reg.branch == reg.branch)
        .map(|b| b.reg.branch.clone())
        .collect();
    for b in old {
        unregister(shared, &b)?;
    }
    if existing {
        // Checked above: a socket this gateway made for a branch.
        let _ = std::fs::remove_file(&reg.socket);
    }
    let listener = bind_private(&reg.socket)?;
    lock(&shared.store).journal.put_branch(&reg, true)?;
    let (hold_tx, _) = watch::channel(false);
    let branch = Arc::new(Branch {
        reg: reg.clone(),
        state: Mutex::new(BranchState::default()),
        hold_tx,
        accept: Mutex::new(None),
    });
    let task = tokio::spawn(accept_loop(shared.clone(), branch.clone(), listener));
    *lock(&branch.accept) = Some(task.abort_handle());
    lock(&shared.branches).insert(reg.branch.clone(), branch);
    Ok(())
}

/// A socket owned by the gateway's user (not a link, not a file).
fn is_own_socket(m: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    // SAFETY: geteuid(2) cannot fail and touches no memory.
    m.file_type().is_socket() && m.uid() == unsafe { libc::geteuid() }
}

/// Binds a Unix listener at `path`, mode 0600 (no wider at any moment: the
/// process's umask is 077, and the mode is set again after the bind).
fn bind_private(path: &Path) -> Result<UnixListener, Error> {
    use std::os::unix::fs::PermissionsExt;
    let io = |e| Error::Io(path.display().to_string(), e);
    let l = std::os::unix::net::UnixListener::bind(path).map_err(io)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    l.set_nonblocking(true).map_err(io)?;
    UnixListener::from_std(l).map_err(io)
}

/// Whether the gateway may listen at `path` for a branch: inside its home
/// (`$TINE_HOME`, where the CLI puts `vms/NAME/vsock.sock_3128`), and
/// either free or a socket the gateway made for a branch (one registered
/// now, or before a restart). Returns whether such a socket is there to
/// replace. Nothing else is ever removed.
fn check_socket_path(shared: &Shared, path: &Path) -> Result<bool, Error> {
    let refuse = |why: String| {
        Error::Control(format!(
            "cannot listen at {}: {why}; nothing was changed",
            path.display()
        ))
    };
    let (Some(dir), Some(_)) = (path.parent(), path.file_name()) else {
        return Err(refuse("not a file path".into()));
    };
    if !path.is_absolute() {
        return Err(refuse("not an absolute path".into()));
    }
    let home = std::fs::canonicalize(&shared.opts.home)
        .map_err(|e| Error::Io(shared.opts.home.display().to_string(), e))?;
    let real_dir = std::fs::canonicalize(dir).map_err(|e| refuse(e.to_string()))?;
    if !real_dir.starts_with(&home) {
        return Err(refuse(format!(
            "it is not inside the gateway's home {}",
            home.display()
        )));
    }
    let m = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(refuse(e.to_string())),
    };
    let ours = is_own_socket(&m)
        && (lock(&shared.branches)
            .values()
            .any(|b| b.reg.socket == path)
            || lock(&shared.store)
                .journal
                .active_branches()?
                .iter()
                .any(|r| r.socket == path));
    if !ours {
        return Err(refuse(
            "something is there that is not a socket this gateway made for a vm".into(),
        ));
    }
    Ok(true)
}

fn unregister(shared: &Arc<Shared>, branch: &str) -> Result<(), Error> {
    let b = lock(&shared.branches).remove(branch);
    if let Some(b) = b {
        if let Some(t) = lock(&b.accept).take() {
            t.abort();
        }
        sever(&b);
        let _ = std::fs::remove_file(&b.reg.socket);
    }
    lock(&shared.store).journal.set_active(branch, false)?;
    Ok(())
}

/// Cuts every connection of a branch: they belong to a VMM process that is
/// gone (a moment was taken) or to a branch that no longer exists. What
/// was waiting on them is no longer owed to anyone.
fn sever(b: &Branch) {
    let mut st = lock(&b.state);
    for c in st.conns.values_mut() {
        c.severed = true;
        c.pending = None;
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
    }
}

fn branch_by_id(shared: &Shared, id: &str) -> Result<Arc<Branch>, Error> {
    lock(&shared.branches)
        .get(id)
        .cloned()
        .ok_or_else(|| Error::Control(format!("branch {id} is not registered")))
}

async fn moment_begin(
    shared: &Arc<Shared>,
    branch: &str,
    moment: &str,
    kind: MomentKind,
) -> Result<(), Error> {
    let b = branch_by_id(shared, branch)?;
    {
        let mut st = lock(&b.state);
        st.hold = true;
    }
    b.hold_tx.send_replace(true);
    // Responses already on their way finish and are counted before the
    // barrier; bounded, a stuck one is counted after it.
    let t0 = Instant::now();
    while lock(&b.state).releasing > 0 && t0.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tokio::task::block_in_place(|| lock(&shared.store).journal.add_moment(moment, branch, kind))?;
    // A CLI that died mid-moment must not hold the branch forever.
    let (weak, limit, moment) = (
        Arc::downgrade(&b),
        shared.opts.hold_limit,
        moment.to_string(),
    );
    tokio::spawn(async move {
        tokio::time::sleep(limit).await;
        if let Some(b) = weak.upgrade() {
            if lock(&b.state).hold {
                eprintln!("tine gateway: moment {moment} was never finished; its hold ends");
                sever(&b);
                lock(&b.state).hold = false;
                b.hold_tx.send_replace(false);
            }
        }
    });
    Ok(())
}

fn moment_end(shared: &Arc<Shared>, branch: &str, moment: &str, ok: bool) -> Result<(), Error> {
    let b = branch_by_id(shared, branch)?;
    if ok {
        sever(&b);
    } else {
        lock(&shared.store).journal.delete_moment(moment)?;
    }
    lock(&b.state).hold = false;
    b.hold_tx.send_replace(false);
    Ok(())
}

// ---------------------------------------------------------------- proxy

async fn accept_loop(shared: Arc<Shared>, branch: Arc<Branch>, listener: UnixListener) {
    loop {
        let s = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                eprintln!("tine gateway: accept for vm {:?}: {e}", branch.reg.vm);
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if let Some(want) = branch.reg.peer_uid {
            let uid = s.peer_cred().map(|c| c.uid());
            if !matches!(uid, Ok(u) if u == want || u == 0) {
                // Logged at the 1st, 2nd, 4th, 8th… refusal: a peer
                // retrying in a loop does not fill the log.
                static REFUSED: AtomicU64 = AtomicU64::new(0);
                let n = REFUSED.fetch_add(1, Ordering::Relaxed) + 1;
                if n.is_power_of_two() {
                    let who = match uid {
                        Ok(u) => format!("uid {u}"),
                        Err(e) => format!("a peer of unknown uid ({e})"),
                    };
                    eprintln!(
                        "tine gateway: vm {:?}: refused a connection from {who} (its VMM runs as uid {want}; {n} refused so far)",
                        branch.reg.vm
                    );
                }
                continue;
            }
        }
        let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
        let Some((s, second)) = split_handle(s) else {
            continue;
        };
        lock(&branch.state).conns.insert(
            id,
            Conn {
                stream: second,
                severed: false,
                pending: None,
            },
        );
        tokio::spawn(serve_conn(shared.clone(), branch.clone(), id, s));
    }
}

/// A tokio stream and a std handle on the same socket.
fn split_handle(s: UnixStream) -> Option<(UnixStream, StdUnixStream)> {
    let std = s.into_std().ok()?;
    let second = std.try_clone().ok()?;
    let s = UnixStream::from_std(std).ok()?;
    Some((s, second))
}

/// A response on its way to a branch that counts once it was written.
struct Ticket {
    effect: i64,
    replay: bool,
}

struct ConnCtx {
    shared: Arc<Shared>,
    branch: Arc<Branch>,
    id: u64,
    ticket: Mutex<Option<Ticket>>,
    /// An intercepted CONNECT's inner HTTP connection (whether it ended
    /// cleanly): the connection's end, and its release, wait for it.
    inner: Mutex<Option<tokio::task::JoinHandle<bool>>>,
}

impl ConnCtx {
    /// The egress policy of this connection's branch (the listener's, never
    /// anything the guest sent).
    fn egress(&self) -> egress::Policy<'_> {
        egress::Policy {
            reg: &self.branch.reg,
            allow_private: &self.shared.opts.allow_private,
        }
    }
}

async fn serve_conn(shared: Arc<Shared>, branch: Arc<Branch>, id: u64, s: UnixStream) {
    let ctx = Arc::new(ConnCtx {
        shared: shared.clone(),
        branch: branch.clone(),
        id,
        ticket: Mutex::new(None),
        inner: Mutex::new(None),
    });
    let c2 = ctx.clone();
    let svc = hyper::service::service_fn(move |req| {
        let ctx = c2.clone();
        async move { Ok::<_, Infallible>(handle(ctx, req).await) }
    });
    let res = hyper::server::conn::http1::Builder::new()
        .keep_alive(false)
        // A client may end its sending side once the request is out (nc
        // does); it still gets its response.
        .half_close(true)
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(60))
        .serve_connection(TokioIo::new(s), svc)
        .with_upgrades()
        .await;
    let inner = take(&ctx.inner);
    let clean = match inner {
        Some(h) => h.await.unwrap_or(false),
        None => res.is_ok(),
    };
    let ticket = lock(&ctx.ticket).take();
    if let Some(t) = ticket {
        if clean {
            release(&ctx, &t).await;
        }
        let mut st = lock(&branch.state);
        st.releasing = st.releasing.saturating_sub(1);
    }
    lock(&branch.state).conns.remove(&id);
}

/// Bytes written to `s` that its peer has not read yet.
fn unread(s: &StdUnixStream) -> Option<i32> {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (SIOCOUTQ) writes one int through the pointer, which
    // points at a live local.
    let rc = unsafe { libc::ioctl(s.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    (rc == 0).then_some(n)
}

/// Records that a response went to the branch, once the VMM has taken its
/// bytes (read them into the guest); a connection cut meanwhile, or a
/// response never taken, is not counted (the side that replays rather
/// than repeats).
async fn release(ctx: &ConnCtx, t: &Ticket) {
    let t0 = Instant::now();
    loop {
        let taken = {
            let st = lock(&ctx.branch.state);
            match st.conns.get(&ctx.id) {
                Some(c) if !c.severed => unread(&c.stream).map(|n| n == 0),
                _ => None,
            }
        };
        match taken {
            Some(true) => break,
            Some(false) if t0.elapsed() < Duration::from_secs(2) => {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            _ => return,
        }
    }
    tokio::task::block_in_place(|| {
        let mut st = lock(&ctx.branch.state);
        let Some(c) = st.conns.get_mut(&ctx.id) else {
            return;
        };
        if c.severed {
            return;
        }
        let mut store = lock(&ctx.shared.store);
        match store
            .journal
            .release(t.effect, &ctx.branch.reg.branch, t.replay)
        {
            Ok(_) => c.pending = None,
            Err(e) => eprintln!("tine gateway: cannot record a release: {e}"),
        }
    });
}

fn text(status: StatusCode, msg: impl Into<String>) -> Response<RespBody> {
    let mut msg = msg.into();
    msg.push('\n');
    let mut r = Response::new(full(Bytes::from(msg)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

fn full(b: Bytes) -> RespBody {
    Full::new(b).map_err(|never| match never {}).boxed()
}

const HOP_BY_HOP: [&str; 10] = [
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authorization",
    "proxy-authenticate",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
];

/// Headers without hop-by-hop ones (and those the Connection header names).
fn end_to_end(h: &HeaderMap) -> HeaderMap {
    let named: Vec<String> = h
        .get_all(hyper::header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|s| s.trim().to_ascii_lowercase())
        .collect();
    let mut out = HeaderMap::new();
    for (k, v) in h {
        let n = k.as_str();
        if HOP_BY_HOP.contains(&n) || named.iter().any(|x| x == n) || n == EFFECT_HEADER {
            continue;
        }
        out.append(k.clone(), v.clone());
    }
    out
}

fn head_bytes(h: &HeaderMap) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in h {
        out.extend_from_slice(k.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(v.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out
}

fn parse_head(b: &[u8]) -> HeaderMap {
    let mut out = HeaderMap::new();
    for line in b.split(|&c| c == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(colon) = line.iter().position(|&c| c == b':') else {
            continue;
        };
        let (k, v) = (&line[..colon], &line[colon + 1..]);
        let v = v.strip_prefix(b" ").unwrap_or(v);
        if let (Ok(k), Ok(v)) = (HeaderName::from_bytes(k), HeaderValue::from_bytes(v)) {
            out.append(k, v);
        }
    }
    out
}

/// One proxied request. Never panics on the guest's input: every problem is
/// an HTTP error with a sentence saying what and why.
async fn handle(ctx: Arc<ConnCtx>, req: Request<Incoming>) -> Response<RespBody> {
    if req.method() == Method::CONNECT {
        return tunnel(&ctx, req).await;
    }
    let uri = req.uri().clone();
    let (host, port) = match (uri.scheme_str(), uri.host()) {
        (Some("http"), Some(h)) => (h.to_ascii_lowercase(), uri.port_u16().unwrap_or(80)),
        (Some(s), _) if s != "http" => {
            return text(
                StatusCode::BAD_REQUEST,
                format!("tine effects gateway: only http:// URLs are proxied; use CONNECT (https_proxy) for {s}://"),
            )
        }
        _ => {
            return text(
                StatusCode::BAD_REQUEST,
                "tine effects gateway: this is an HTTP proxy: send absolute URLs (GET http://host/path), e.g. through http_proxy",
            )
        }
    };
    let target = Target {
        url: uri.to_string(),
        authority: uri
            .authority()
            .map(|a| a.as_str().to_string())
            .unwrap_or_else(|| format!("{host}:{port}")),
        host,
        port,
        tls: false,
        addrs: None,
    };
    forward(ctx, req, target).await
}

/// Where a request goes: from its absolute URL (plain HTTP) or from the
/// CONNECT it came through (intercepted HTTPS).
struct Target {
    host: String,
    port: u16,
    /// The URL as journaled (and hashed): `http://...` or `https://...`.
    url: String,
    /// Host header if the request has none.
    authority: String,
    /// TLS to the destination (verified against the host's roots).
    tls: bool,
    /// Checked at the CONNECT already (the connection goes there).
    addrs: Option<Vec<std::net::SocketAddr>>,
}

/// A request inside an intercepted CONNECT to `host:port`: origin-form
/// (`GET /path`), for that destination only.
async fn handle_https(
    ctx: Arc<ConnCtx>,
    req: Request<Incoming>,
    host: String,
    port: u16,
    addrs: Vec<std::net::SocketAddr>,
) -> Response<RespBody> {
    if req.method() == Method::CONNECT {
        return text(
            StatusCode::BAD_REQUEST,
            "tine effects gateway: CONNECT inside an intercepted CONNECT",
        );
    }
    let authority = if port == 443 {
        host.clone()
    } else {
        format!("{host}:{port}")
    };
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    let target = Target {
        url: format!("https://{authority}{path}"),
        authority,
        host,
        port,
        tls: true,
        addrs: Some(addrs),
    };
    forward(ctx, req, target).await
}

/// The policy, the egress check and the effect of one request.
async fn forward(ctx: Arc<ConnCtx>, req: Request<Incoming>, target: Target) -> Response<RespBody> {
    let Target {
        host,
        port,
        url,
        authority,
        tls,
        addrs,
    } = target;
    let uri = req.uri().clone();
    let dest = format!("{host}:{port}");
    let reg = &ctx.branch.reg;
    let safe = matches!(
        *req.method(),
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    );
    let policy = reg.effects.policy_for(&host, port, safe);
    let method = req.method().to_string();
    if policy == EffectPolicy::DenyInChildren && reg.is_child() {
        return refuse(&ctx, &method, &url, &dest);
    }
    let addrs = match addrs {
        Some(a) => a,
        None => match ctx.egress().resolve(&host, port).await {
            Ok(a) => a,
            Err(d) => return denied(&ctx, &method, &url, &dest, d),
        },
    };
    let policy = match policy {
        EffectPolicy::DenyInChildren if safe => EffectPolicy::Pass,
        EffectPolicy::DenyInChildren => EffectPolicy::OncePerTree,
        p => p,
    };
    let header_key = match req.headers().get("idempotency-key") {
        None => None,
        Some(v) => {
            let ok = !v.is_empty()
                && v.len() <= 255
                && v.as_bytes()
                    .iter()
                    .all(|c| c.is_ascii_graphic() || *c == b' ');
            if !ok {
                return text(
                    StatusCode::BAD_REQUEST,
                    "tine effects gateway: Idempotency-Key must be 1-255 printable ASCII characters",
                );
            }
            Some(String::from_utf8_lossy(v.as_bytes()).trim().to_string())
        }
    };
    let (parts, body) = req.into_parts();
    let body = match Limited::new(body, ctx.shared.opts.max_request_bytes)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return text(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "tine effects gateway: request bodies over {} bytes are not proxied",
                    ctx.shared.opts.max_request_bytes
                ),
            )
        }
        Err(e) => {
            return text(
                StatusCode::BAD_REQUEST,
                format!("tine effects gateway: incomplete or malformed request body ({e}); nothing was sent"),
            )
        }
    };
    let up = Upstream {
        method: parts.method.clone(),
        path: uri
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into()),
        authority,
        tls: tls.then(|| {
            host.trim_start_matches('[')
                .trim_end_matches(']')
                .to_string()
        }),
        dest: dest.clone(),
        addrs,
        headers: end_to_end(&parts.headers),
        body,
    };
    if policy == EffectPolicy::Pass {
        return pass(&ctx, up, &method, &url).await;
    }
    let mut h = blake3::Hasher::new();
    for part in [
        method.as_bytes(),
        url.as_bytes(),
        parts
            .headers
            .get(hyper::header::CONTENT_TYPE)
            .map(|v| v.as_bytes())
            .unwrap_or(b""),
    ] {
        h.update(&(part.len() as u64).to_le_bytes());
        h.update(part);
    }
    h.update(&up.body);
    let digest = h.finalize().to_hex().to_string();
    effect(ctx, up, policy, header_key, digest, &method, &url).await
}

fn refuse(ctx: &ConnCtx, method: &str, url: &str, dest: &str) -> Response<RespBody> {
    let why = format!(
        "tine effects gateway: refused: the contract's effects policy for {dest} is deny-in-children, and vm {:?} is a child (a fork or restored copy); nothing was sent",
        ctx.branch.reg.vm
    );
    refuse_as(ctx, method, url, dest, "deny-in-children", why)
}

/// The egress policy's answer: refused (403, journaled) or unresolvable.
fn denied(ctx: &ConnCtx, method: &str, url: &str, dest: &str, d: Denied) -> Response<RespBody> {
    match d {
        Denied::Refused(why) => refuse_as(
            ctx,
            method,
            url,
            dest,
            "egress",
            format!("tine effects gateway: {why}; nothing was sent"),
        ),
        Denied::Unresolved(why) => text(
            StatusCode::BAD_GATEWAY,
            format!("tine effects gateway: {why}; nothing was sent"),
        ),
    }
}

/// Refuses a request (403) and journals the refusal under `policy`.
fn refuse_as(
    ctx: &ConnCtx,
    method: &str,
    url: &str,
    dest: &str,
    policy: &str,
    why: String,
) -> Response<RespBody> {
    let reg = &ctx.branch.reg;
    let res = tokio::task::block_in_place(|| {
        lock(&ctx.shared.store).journal.insert(&NewEffect {
            status: Some(403),
            error: Some(&why),
            ..unkeyed(reg, method, url, dest, policy, State::Refused)
        })
    });
    if let Err(e) = res {
        eprintln!("tine gateway: cannot journal a refusal: {e}");
    }
    text(StatusCode::FORBIDDEN, why)
}

/// The journal row of an effect that is never replayed (refused, passed,
/// tunneled): the branch's own, with no key and no digest; no status, no
/// bytes and no error until the caller sets them.
fn unkeyed<'a>(
    reg: &'a Registration,
    method: &'a str,
    url: &'a str,
    dest: &'a str,
    policy: &'a str,
    state: State,
) -> NewEffect<'a> {
    NewEffect {
        tree: reg.tree(),
        scope: &reg.branch,
        key: None,
        key_text: None,
        key_source: None,
        branch: &reg.branch,
        method,
        url,
        dest,
        digest: None,
        policy,
        state,
        status: None,
        req_bytes: 0,
        error: None,
    }
}

/// The answer when journaling a forwarded effect failed.
fn journal_failed(e: Error) -> Response<RespBody> {
    text(
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("tine effects gateway: the journal failed: {e}"),
    )
}

/// What goes to the destination.
struct Upstream {
    method: Method,
    path: String,
    authority: String,
    /// TLS to the destination, with this server name.
    tls: Option<String>,
    dest: String,
    /// The destination's addresses, resolved and checked (egress): the
    /// connection goes to one of these, never to a fresh resolution.
    addrs: Vec<std::net::SocketAddr>,
    headers: HeaderMap,
    body: Bytes,
}

/// Connects to the destination; `Err` means nothing was sent.
async fn connect(
    shared: &Shared,
    up: &Upstream,
) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>, String> {
    let dest = &up.dest;
    let timeout = shared.opts.connect_timeout;
    let tcp = egress::connect(&up.addrs, dest, timeout).await?;
    let _ = tcp.set_nodelay(true);
    let Some(name) = &up.tls else {
        return handshake(TokioIo::new(tcp), dest).await;
    };
    // Verified against the host's roots: a destination whose certificate
    // does not verify is never sent the request.
    let config = shared.tls.client()?;
    let server = rustls::pki_types::ServerName::try_from(name.clone())
        .map_err(|e| format!("{name:?} is not a TLS server name: {e}"))?;
    let tls = tokio::time::timeout(
        timeout,
        tokio_rustls::TlsConnector::from(config).connect(server, tcp),
    )
    .await
    .map_err(|_| format!("the TLS handshake with {dest} timed out"))?
    .map_err(|e| {
        format!(
            "TLS to {dest} failed, its certificate was not accepted or the handshake broke: {e}"
        )
    })?;
    handshake(TokioIo::new(tls), dest).await
}

async fn handshake<T>(
    io: T,
    dest: &str,
) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>, String>
where
    T: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (send, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|e| format!("cannot talk HTTP to {dest}: {e}"))?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(send)
}

fn upstream_request(up: &Upstream) -> Result<Request<Full<Bytes>>, String> {
    let mut b = Request::builder()
        .method(up.method.clone())
        .uri(up.path.as_str());
    let headers = b.headers_mut().ok_or("bad request")?;
    *headers = up.headers.clone();
    if !headers.contains_key(hyper::header::HOST) {
        let v = HeaderValue::from_str(&up.authority).map_err(|e| e.to_string())?;
        headers.insert(hyper::header::HOST, v);
    }
    if !up.body.is_empty() || !matches!(up.method, Method::GET | Method::HEAD | Method::OPTIONS) {
        headers.insert(
            hyper::header::CONTENT_LENGTH,
            HeaderValue::from(up.body.len()),
        );
    }
    b.body(Full::new(up.body.clone()))
        .map_err(|e| format!("cannot build the request: {e}"))
}

/// GET, HEAD, OPTIONS and `pass`: forwarded and journaled, never replayed.
async fn pass(ctx: &ConnCtx, up: Upstream, method: &str, url: &str) -> Response<RespBody> {
    let opts = &ctx.shared.opts;
    let reg = &ctx.branch.reg;
    let res = async {
        let mut send = connect(&ctx.shared, &up).await?;
        let req = upstream_request(&up)?;
        tokio::time::timeout(opts.upstream_timeout, send.send_request(req))
            .await
            .map_err(|_| format!("{} did not answer in time", up.dest))?
            .map_err(|e| format!("{} failed: {e}", up.dest))
    }
    .await;
    let (status, error) = match &res {
        Ok(r) => (Some(r.status().as_u16()), None),
        Err(e) => (None, Some(e.as_str())),
    };
    let row = tokio::task::block_in_place(|| {
        lock(&ctx.shared.store).journal.insert(&NewEffect {
            status,
            req_bytes: up.body.len() as u64,
            error,
            ..unkeyed(reg, method, url, &up.dest, "pass", State::Passed)
        })
    });
    let row = match row {
        Ok(r) => r,
        Err(e) => return journal_failed(e),
    };
    match res {
        Err(e) => text(
            StatusCode::BAD_GATEWAY,
            format!("tine effects gateway: {e}"),
        ),
        Ok(r) => {
            let (p, body) = r.into_parts();
            let mut out = Response::new(
                Counted {
                    inner: body,
                    bytes: 0,
                    done: row.map(|id| (id, ctx.shared.clone())),
                }
                .boxed(),
            );
            *out.status_mut() = p.status;
            *out.headers_mut() = end_to_end(&p.headers);
            if let Some(n) = p.headers.get(hyper::header::CONTENT_LENGTH) {
                out.headers_mut()
                    .insert(hyper::header::CONTENT_LENGTH, n.clone());
            }
            out.headers_mut()
                .insert(EFFECT_HEADER, HeaderValue::from_static("passed"));
            out
        }
    }
}

/// A response body passed through, whose size is journaled at its end.
struct Counted {
    inner: Incoming,
    bytes: u64,
    done: Option<(i64, Arc<Shared>)>,
}

impl Body for Counted {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(f))) = &r {
            if let Some(d) = f.data_ref() {
                self.bytes += d.len() as u64;
            }
        }
        r.map_err(|e| e.into())
    }
    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        if let Some((id, shared)) = self.done.take() {
            let bytes = self.bytes;
            tokio::task::spawn_blocking(move || {
                let _ = lock(&shared.store).journal.set_bytes(id, 0, bytes);
            });
        }
    }
}

/// A body fed by the task that reads a too-large response.
struct Streamed(mpsc::Receiver<Bytes>);

impl Body for Streamed {
    type Data = Bytes;
    type Error = BoxError;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0.poll_recv(cx).map(|o| o.map(|b| Ok(Frame::data(b))))
    }
}

enum Decision {
    Replay(Box<EffectRow>),
    Wait(OutcomeRx),
    Execute(i64, watch::Sender<Option<Arc<Outcome>>>),
    Error(StatusCode, String),
}

/// An effect's request. A request answered with an error (no response to
/// release) stops counting as waiting at once, so a retry gets its key.
async fn effect(
    ctx: Arc<ConnCtx>,
    up: Upstream,
    policy: EffectPolicy,
    header_key: Option<String>,
    digest: String,
    method: &str,
    url: &str,
) -> Response<RespBody> {
    let r = effect_inner(ctx.clone(), up, policy, header_key, digest, method, url).await;
    if lock(&ctx.ticket).is_none() {
        if let Some(c) = lock(&ctx.branch.state).conns.get_mut(&ctx.id) {
            c.pending = None;
        }
    }
    r
}

async fn effect_inner(
    ctx: Arc<ConnCtx>,
    up: Upstream,
    policy: EffectPolicy,
    header_key: Option<String>,
    digest: String,
    method: &str,
    url: &str,
) -> Response<RespBody> {
    let reg = ctx.branch.reg.clone();
    let tree = reg.tree().to_string();
    let scope = match policy {
        EffectPolicy::PerBranch => reg.branch.clone(),
        _ => String::new(),
    };
    let derived = header_key.is_none();
    let decided = tokio::task::block_in_place(|| -> Result<(String, Decision), Error> {
        let mut st = lock(&ctx.branch.state);
        let mut store = lock(&ctx.shared.store);
        let barriers = store.journal.barriers(&reg)?;
        let key = match &header_key {
            Some(k) => format!("h:{k}"),
            None => {
                let waiting = st
                    .conns
                    .values()
                    .filter(|c| !c.severed && c.pending.as_deref() == Some(digest.as_str()))
                    .count() as i64;
                let n = store
                    .journal
                    .count_released(&reg.branch, &barriers, &digest)?
                    + waiting;
                if let Some(c) = st.conns.get_mut(&ctx.id) {
                    c.pending = Some(digest.clone());
                }
                let mut h = blake3::Hasher::new();
                h.update(digest.as_bytes());
                h.update(&n.to_le_bytes());
                format!("d:{}", &h.finalize().to_hex()[..32])
            }
        };
        let found = match policy {
            EffectPolicy::PerBranch => match store.journal.find_before(&tree, &key, &barriers)? {
                Some(r) => Some(r),
                None => store.journal.find(&tree, &scope, &key)?,
            },
            _ => store.journal.find(&tree, "", &key)?,
        };
        let d = match found {
            Some(row) => decide(&mut store, row, &key, &reg.vm),
            None => {
                let id = store.journal.insert(&NewEffect {
                    tree: &tree,
                    scope: &scope,
                    key: Some(&key),
                    key_text: None,
                    key_source: Some(if derived { "derived" } else { "header" }),
                    branch: &reg.branch,
                    method,
                    url,
                    dest: &up.dest,
                    digest: Some(&digest),
                    policy: &policy.to_string(),
                    state: State::Sent,
                    status: None,
                    req_bytes: up.body.len() as u64,
                    error: None,
                })?;
                match id {
                    Some(id) => {
                        let (tx, rx) = watch::channel(None);
                        store.inflight.insert(id, rx);
                        Decision::Execute(id, tx)
                    }
                    // Another host's gateway took the key meanwhile
                    // (a shared journal): its row decides.
                    None => match store.journal.find(&tree, &scope, &key)? {
                        Some(row) => decide(&mut store, row, &key, &reg.vm),
                        None => Decision::Error(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            "the key was taken meanwhile; retry".into(),
                        ),
                    },
                }
            }
        };
        Ok((key, d))
    });
    let (key, decision) = match decided {
        Ok(x) => x,
        Err(e) => {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("tine effects gateway: the journal failed: {e}; nothing was sent"),
            )
        }
    };
    let mut origin = false;
    let rx = match decision {
        Decision::Error(s, m) => return text(s, format!("tine effects gateway: {m}")),
        Decision::Replay(row) => {
            let by = branch_vm(&ctx.shared, &row.branch);
            return deliver(
                &ctx,
                row.id,
                true,
                row.status.unwrap_or(502),
                row.resp_head.as_deref().unwrap_or_default(),
                full(Bytes::from(row.resp_body.unwrap_or_default())),
                &key,
                &by,
            )
            .await;
        }
        Decision::Wait(rx) => rx,
        Decision::Execute(id, tx) => {
            let rx = tx.subscribe();
            let shared = ctx.shared.clone();
            let max = reg.effects.max_response_bytes;
            let by = reg.vm.clone();
            let conn = ctx.id;
            origin = true;
            tokio::spawn(async move { execute(shared, id, up, max, tx, conn, by).await });
            rx
        }
    };
    let outcome = match wait_outcome(&ctx, rx).await {
        Some(o) => o,
        None => {
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                "tine effects gateway: the connection went away while the effect was pending",
            )
        }
    };
    match &*outcome {
        Outcome::Completed {
            id,
            status,
            head,
            body,
            by,
        } => {
            deliver(
                &ctx,
                *id,
                !origin,
                *status,
                head,
                full(body.clone()),
                &key,
                by,
            )
            .await
        }
        Outcome::TooLarge {
            id,
            status,
            head,
            origin_conn,
            stream,
            length,
            by,
        } if *origin_conn == ctx.id => match take(stream) {
            Some(rx) => {
                let mut r = deliver(
                    &ctx,
                    *id,
                    false,
                    *status,
                    head,
                    Streamed(rx).boxed(),
                    &key,
                    by,
                )
                .await;
                if let Some(n) = length {
                    r.headers_mut()
                        .insert(hyper::header::CONTENT_LENGTH, n.clone());
                }
                r
            }
            None => text(
                StatusCode::CONFLICT,
                too_large_msg(&key, by, &ctx.branch.reg.vm),
            ),
        },
        Outcome::TooLarge { by, .. } => text(
            StatusCode::CONFLICT,
            too_large_msg(&key, by, &ctx.branch.reg.vm),
        ),
        Outcome::InDoubt(why) => text(
            StatusCode::CONFLICT,
            in_doubt_msg(&key, why, &ctx.branch.reg.vm),
        ),
        Outcome::Unsent(why) => text(
            StatusCode::BAD_GATEWAY,
            format!("tine effects gateway: {why}; nothing was sent, a retry sends it"),
        ),
    }
}

fn take<T>(m: &Mutex<Option<T>>) -> Option<T> {
    lock(m).take()
}

fn too_large_msg(key: &str, by: &str, vm: &str) -> String {
    format!(
        "tine effects gateway: effect {key} was executed by vm {by:?}, but its response was larger than the journal keeps (effects.max_response_bytes): it cannot be replayed to vm {vm:?}, and it is not sent again"
    )
}

fn in_doubt_msg(key: &str, why: &str, vm: &str) -> String {
    format!(
        "tine effects gateway: effect {key} is in doubt ({why}); it is not sent again until a human decides: `tine effects resolve {vm} {key} --resend` (send it again) or `--fail` (treat it as failed); see `tine effects {vm}`"
    )
}

fn decide(store: &mut Store, row: EffectRow, key: &str, vm: &str) -> Decision {
    match row.state {
        State::Completed => Decision::Replay(Box::new(row)),
        State::Sent => match store.inflight.get(&row.id) {
            Some(rx) => Decision::Wait(rx.clone()),
            // Another host's gateway is sending it (a shared journal): its
            // outcome is recorded there, and the program's retry finds it;
            // unless that gateway is gone, and then nobody will.
            None if row.host.as_deref().is_some_and(|h| h != store.journal.host()) => {
                let owner = row.host.clone().unwrap_or_default();
                match store.journal.doubt_if_host_gone(&row, HOST_GONE) {
                    Ok(true) => match store.journal.get(row.id) {
                        Ok(Some(r)) => decide(store, r, key, vm),
                        _ => Decision::Error(
                            StatusCode::CONFLICT,
                            format!("effect {key} is in doubt: host {owner}'s gateway ended while sending it; see `tine effects`"),
                        ),
                    },
                    _ => Decision::Error(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            "effect {key} is being sent by the gateway of another host ({owner}); retry in a moment"
                        ),
                    ),
                }
            }
            None => Decision::Error(
                StatusCode::CONFLICT,
                format!("effect {key} is being sent by a gateway that ended; see `tine effects`"),
            ),
        },
        State::InDoubt => Decision::Error(
            StatusCode::CONFLICT,
            in_doubt_msg(key, row.error.as_deref().unwrap_or("outcome unknown"), vm)
                .trim_start_matches("tine effects gateway: ")
                .to_string(),
        ),
        State::TooLarge => Decision::Error(
            StatusCode::CONFLICT,
            format!(
                "effect {key} was executed, but its response ({} bytes) was larger than the journal keeps (effects.max_response_bytes): it cannot be replayed, and it is not sent again",
                row.resp_bytes.unwrap_or(0)
            ),
        ),
        State::Failed => Decision::Error(
            StatusCode::BAD_GATEWAY,
            format!("effect {key} was resolved as failed by `tine effects resolve`; it is not sent again"),
        ),
        State::Refused | State::Abandoned | State::Passed | State::Tunnel => Decision::Error(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("effect {key} has an unexpected state {}", row.state.as_str()),
        ),
    }
}

fn branch_vm(shared: &Shared, branch: &str) -> String {
    lock(&shared.store)
        .journal
        .branch(branch)
        .ok()
        .flatten()
        .map(|b| b.registration.vm)
        .unwrap_or_else(|| branch.to_string())
}

/// Waits for an effect's outcome while the guest's connection lives.
async fn wait_outcome(ctx: &ConnCtx, mut rx: OutcomeRx) -> Option<Arc<Outcome>> {
    let fd = {
        let st = lock(&ctx.branch.state);
        st.conns
            .get(&ctx.id)
            .and_then(|c| c.stream.try_clone().ok())
    }?;
    loop {
        tokio::select! {
            r = rx.wait_for(|o| o.is_some()) => {
                return r.ok().and_then(|o| o.clone());
            }
            _ = tokio::time::sleep(Duration::from_millis(50)) => {
                if peer_gone(&fd) {
                    // The guest gave up on this request: it no longer counts
                    // as waiting (its retry gets the same key).
                    if let Some(c) = lock(&ctx.branch.state).conns.get_mut(&ctx.id) {
                        c.pending = None;
                    }
                    return None;
                }
            }
        }
    }
}

/// The peer closed its socket or reset it. A peer that only ended its
/// sending side (POLLRDHUP) still waits for its response.
fn peer_gone(s: &StdUnixStream) -> bool {
    let mut p = libc::pollfd {
        fd: s.as_raw_fd(),
        events: 0,
        revents: 0,
    };
    // SAFETY: polls one valid pollfd without waiting.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 1 && p.revents & (libc::POLLHUP | libc::POLLERR) != 0
}

/// Releases a recorded (or streamed) response to the guest, unless a
/// moment is being taken (then it waits: the connection will be cut).
#[allow(clippy::too_many_arguments)]
async fn deliver(
    ctx: &ConnCtx,
    effect: i64,
    replay: bool,
    status: u16,
    head: &[u8],
    body: RespBody,
    key: &str,
    by: &str,
) -> Response<RespBody> {
    let mut held = ctx.branch.hold_tx.subscribe();
    loop {
        {
            let mut st = lock(&ctx.branch.state);
            if !st.hold {
                st.releasing += 1;
                break;
            }
        }
        if held.changed().await.is_err() {
            break;
        }
    }
    *lock(&ctx.ticket) = Some(Ticket { effect, replay });
    let mut r = Response::new(body);
    *r.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    *r.headers_mut() = parse_head(head);
    let what = if replay {
        format!("replayed; key={key}; from={by}")
    } else {
        format!("executed; key={key}")
    };
    if let Ok(v) = HeaderValue::from_str(&what) {
        r.headers_mut().insert(EFFECT_HEADER, v);
    }
    r
}

/// Calls the destination for effect `id` and records the outcome; runs to
/// the end even when nobody waits any more (the next retry gets it).
async fn execute(
    shared: Arc<Shared>,
    id: i64,
    up: Upstream,
    max: u64,
    tx: watch::Sender<Option<Arc<Outcome>>>,
    origin: u64,
    by: String,
) {
    let opts = shared.opts.clone();
    let finish = |o: Outcome, journal: &dyn Fn(&mut Journal) -> Result<(), Error>| {
        let o = tokio::task::block_in_place(|| {
            let mut store = lock(&shared.store);
            let o = match journal(&mut store.journal) {
                Ok(()) => o,
                Err(e) => {
                    eprintln!("tine gateway: cannot journal effect {id}: {e}");
                    // A response is released only once it is recorded (a
                    // shared journal's connection can be cut): unrecorded,
                    // it goes to nobody and the effect is in doubt (marked
                    // now over a new connection, or at the next start).
                    match o {
                        Outcome::Completed { .. } => {
                            let why = format!(
                                "the destination answered, but the journal could not record it: {e}"
                            );
                            let _ = store.journal.in_doubt(id, &why);
                            Outcome::InDoubt(why)
                        }
                        o => o,
                    }
                }
            };
            store.inflight.remove(&id);
            o
        });
        tx.send_replace(Some(Arc::new(o)));
    };
    let mut send = match connect(&shared, &up).await {
        Ok(s) => s,
        Err(e) => {
            finish(Outcome::Unsent(e), &|j| j.delete_unsent(id));
            return;
        }
    };
    let req = match upstream_request(&up) {
        Ok(r) => r,
        Err(e) => {
            finish(Outcome::Unsent(e), &|j| j.delete_unsent(id));
            return;
        }
    };
    let resp = match tokio::time::timeout(opts.upstream_timeout, send.send_request(req)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => {
            let why = format!("{} failed after the request was sent: {e}", up.dest);
            finish(Outcome::InDoubt(why.clone()), &|j| j.in_doubt(id, &why));
            return;
        }
        Err(_) => {
            let why = format!(
                "{} did not answer within {:?}",
                up.dest, opts.upstream_timeout
            );
            finish(Outcome::InDoubt(why.clone()), &|j| j.in_doubt(id, &why));
            return;
        }
    };
    let (p, mut body) = resp.into_parts();
    let status = p.status.as_u16();
    let head = head_bytes(&end_to_end(&p.headers));
    let mut buf: Vec<u8> = Vec::new();
    loop {
        match body.frame().await {
            None => break,
            Some(Ok(f)) => {
                if let Some(d) = f.data_ref() {
                    buf.extend_from_slice(d);
                    if buf.len() as u64 > max {
                        let length = p.headers.get(hyper::header::CONTENT_LENGTH).cloned();
                        let o = (origin, length, by);
                        too_large(&shared, id, status, head, buf, body, tx, o).await;
                        return;
                    }
                }
            }
            Some(Err(e)) => {
                let why = format!("{} broke off its response: {e}", up.dest);
                finish(Outcome::InDoubt(why.clone()), &|j| j.in_doubt(id, &why));
                return;
            }
        }
    }
    if opts.fault_after_response {
        eprintln!("tine gateway: fault injection: abort after the response, before the journal");
        std::process::abort();
    }
    let body = Bytes::from(buf);
    let b2 = body.clone();
    let h2 = head.clone();
    finish(
        Outcome::Completed {
            id,
            status,
            head,
            body,
            by,
        },
        &|j| j.complete(id, status, &h2, &b2),
    );
}

#[allow(clippy::too_many_arguments)]
async fn too_large(
    shared: &Arc<Shared>,
    id: i64,
    status: u16,
    head: Vec<u8>,
    first: Vec<u8>,
    mut body: Incoming,
    tx: watch::Sender<Option<Arc<Outcome>>>,
    (origin, length, by): (u64, Option<HeaderValue>, String),
) {
    let mut total = first.len() as u64;
    tokio::task::block_in_place(|| {
        let mut store = lock(&shared.store);
        if let Err(e) = store.journal.too_large(id, status, &head, total) {
            eprintln!("tine gateway: cannot journal effect {id}: {e}");
        }
        store.inflight.remove(&id);
    });
    let (stx, srx) = mpsc::channel::<Bytes>(16);
    tx.send_replace(Some(Arc::new(Outcome::TooLarge {
        id,
        status,
        head,
        origin_conn: origin,
        stream: Mutex::new(Some(srx)),
        length,
        by,
    })));
    let mut listening = stx.send(Bytes::from(first)).await.is_ok();
    while let Some(Ok(f)) = body.frame().await {
        if let Ok(d) = f.into_data() {
            total += d.len() as u64;
            if listening {
                listening = stx.send(d).await.is_ok();
            }
        }
    }
    drop(stx);
    tokio::task::block_in_place(|| {
        let _ = lock(&shared.store).journal.set_bytes(id, 0, total);
    });
}

/// CONNECT: a TLS tunnel, journaled by destination, never replayed.
async fn tunnel(ctx: &Arc<ConnCtx>, req: Request<Incoming>) -> Response<RespBody> {
    let Some(auth) = req.uri().authority().cloned() else {
        return text(
            StatusCode::BAD_REQUEST,
            "tine effects gateway: CONNECT needs host:port",
        );
    };
    let host = auth.host().to_ascii_lowercase();
    let Some(port) = auth.port_u16() else {
        return text(
            StatusCode::BAD_REQUEST,
            "tine effects gateway: CONNECT needs host:port",
        );
    };
    let dest = format!("{host}:{port}");
    let reg = &ctx.branch.reg;
    let url = format!("https://{dest}");
    if reg.effects.policy_for(&host, port, true) == EffectPolicy::DenyInChildren && reg.is_child() {
        return refuse(ctx, "CONNECT", &url, &dest);
    }
    let addrs = match ctx.egress().resolve(&host, port).await {
        Ok(a) => a,
        Err(d) => return denied(ctx, "CONNECT", &url, &dest, d),
    };
    if reg.effects.https == crate::Https::Intercept {
        return intercept(ctx, req, host, port, addrs);
    }
    let opts = &ctx.shared.opts;
    let tcp = match egress::connect(&addrs, &dest, opts.connect_timeout).await {
        Ok(t) => t,
        Err(e) => {
            return text(
                StatusCode::BAD_GATEWAY,
                format!("tine effects gateway: {e}"),
            )
        }
    };
    let row = tokio::task::block_in_place(|| {
        lock(&ctx.shared.store).journal.insert(&NewEffect {
            status: Some(200),
            ..unkeyed(reg, "CONNECT", &url, &dest, "pass", State::Tunnel)
        })
    });
    let row = match row {
        Ok(r) => r,
        Err(e) => return journal_failed(e),
    };
    let shared = ctx.shared.clone();
    tokio::spawn(async move {
        let Ok(up) = hyper::upgrade::on(req).await else {
            return;
        };
        pipe(shared, row, TokioIo::new(up), tcp).await;
    });
    Response::new(full(Bytes::new()))
}

/// Pipes a tunnel's bytes both ways; its journal row gets how many.
async fn pipe<G>(shared: Arc<Shared>, row: Option<i64>, mut guest: G, mut tcp: TcpStream)
where
    G: AsyncRead + AsyncWrite + Unpin,
{
    let (a, b) = tokio::io::copy_bidirectional(&mut guest, &mut tcp)
        .await
        .unwrap_or((0, 0));
    if let Some(id) = row {
        tokio::task::spawn_blocking(move || {
            let _ = lock(&shared.store).journal.set_bytes(id, a, b);
        });
    }
}

/// The first byte of a TLS connection (a handshake record).
const TLS_HANDSHAKE: u8 = 0x16;

/// An intercepted CONNECT (`effects.https = "intercept"`): `200`, then the
/// guest's TLS ends here with a certificate for `host` from this host's CA,
/// and each request inside goes through [`forward`] like plain HTTP (with
/// TLS to the destination, to the addresses checked now). What is not TLS
/// (the first byte says) is tunneled as before.
fn intercept(
    ctx: &Arc<ConnCtx>,
    req: Request<Incoming>,
    host: String,
    port: u16,
    addrs: Vec<std::net::SocketAddr>,
) -> Response<RespBody> {
    let name = host.trim_start_matches('[').trim_end_matches(']');
    let server = match ctx.shared.tls.server(name) {
        Ok(s) => s,
        Err(e) => {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!(
                    "tine effects gateway: cannot intercept HTTPS to {host}: {e}; nothing was sent"
                ),
            )
        }
    };
    let c = ctx.clone();
    let task = tokio::spawn(async move {
        let Ok(up) = hyper::upgrade::on(req).await else {
            return false;
        };
        let mut io = TokioIo::new(up);
        let mut first = [0u8; 1];
        let n = match tokio::time::timeout(Duration::from_secs(60), io.read(&mut first)).await {
            Ok(Ok(n)) if n > 0 => n,
            _ => return false,
        };
        let io = Prefixed {
            prefix: Bytes::copy_from_slice(&first[..n]),
            inner: io,
        };
        if first[0] != TLS_HANDSHAKE {
            tunnel_after(c, io, host, port, addrs).await;
            return false;
        }
        // A guest that does not trust the CA ends the handshake: nothing
        // was sent (and nothing is logged: a guest must not fill the log).
        let Ok(tls) = tokio_rustls::TlsAcceptor::from(server).accept(io).await else {
            return false;
        };
        let svc = hyper::service::service_fn(move |req| {
            let (c, host, addrs) = (c.clone(), host.clone(), addrs.clone());
            async move { Ok::<_, Infallible>(handle_https(c, req, host, port, addrs).await) }
        });
        hyper::server::conn::http1::Builder::new()
            .keep_alive(false)
            .timer(TokioTimer::new())
            .header_read_timeout(Duration::from_secs(60))
            .serve_connection(TokioIo::new(tls), svc)
            .await
            .is_ok()
    });
    *lock(&ctx.inner) = Some(task);
    Response::new(full(Bytes::new()))
}

/// What came through an intercepting CONNECT but is not TLS: tunneled and
/// journaled by destination, as without interception.
async fn tunnel_after<G>(
    ctx: Arc<ConnCtx>,
    guest: G,
    host: String,
    port: u16,
    addrs: Vec<std::net::SocketAddr>,
) where
    G: AsyncRead + AsyncWrite + Unpin,
{
    let dest = format!("{host}:{port}");
    let Ok(tcp) = egress::connect(&addrs, &dest, ctx.shared.opts.connect_timeout).await else {
        return;
    };
    let url = format!("https://{dest}");
    let row = tokio::task::block_in_place(|| {
        lock(&ctx.shared.store).journal.insert(&NewEffect {
            status: Some(200),
            ..unkeyed(
                &ctx.branch.reg,
                "CONNECT",
                &url,
                &dest,
                "pass",
                State::Tunnel,
            )
        })
    });
    if let Ok(row) = row {
        pipe(ctx.shared.clone(), row, guest, tcp).await;
    }
}

/// A stream with bytes already read from it put back in front.
struct Prefixed<T> {
    prefix: Bytes,
    inner: T,
}

impl<T: AsyncRead + Unpin> AsyncRead for Prefixed<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            let head = self.prefix.split_to(n);
            buf.put_slice(&head);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Prefixed<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
