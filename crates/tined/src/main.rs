//! `tined`: one per host (per `$TINE_HOME`). Started by the CLI on first
//! use, or by hand in the foreground (`tined`). See docs/design/tined.md.
//!
//! Start: take the home's lock (one tined per home), become the subreaper
//! of every VMM, reconcile (records follow the processes; unfinished
//! operations are rolled back or finished), then serve. Killed, it leaves
//! its VMMs running; the next tined adopts them.

use std::io::IsTerminal;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};

/// tine's control plane for one host.
#[derive(Parser)]
#[command(name = "tined", version, about)]
struct Cli {
    /// tine's home (default `$TINE_HOME`, else ~/.cache/tine).
    #[arg(long, env = "TINE_HOME")]
    home: Option<PathBuf>,
    /// Also listen on this TCP address (e.g. 127.0.0.1:7300); every
    /// request there needs `Authorization: Bearer TOKEN`.
    #[arg(long)]
    tcp: Option<String>,
    /// The bearer token for --tcp, read from this file (or TINED_TOKEN).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Log JSON lines (tracing) instead of text.
    #[arg(long)]
    log_json: bool,
    /// Exit after this many seconds with no vm running and no request
    /// (0: never). The CLI starts tined with 600.
    #[arg(long, default_value_t = 0)]
    idle_exit: u64,
    /// This host's id in the fleet (default TINE_HOST_ID, else kept in
    /// `$TINE_HOME/host-id`).
    #[arg(long)]
    host_id: Option<String>,
    /// How other hosts' tineds reach this one: `unix:/path/tined.sock`
    /// (default: this home's socket) or `http://host:port` (--tcp).
    #[arg(long)]
    advertise: Option<String>,
    #[command(subcommand)]
    command: Option<Sub>,
}

#[derive(Subcommand)]
enum Sub {
    /// Build an image in this process (tined runs this as a child for
    /// `POST /v1/images`); prints its manifest as JSON.
    #[command(hide = true)]
    BuildImage {
        kind: String,
        #[arg(long)]
        agent: Option<PathBuf>,
        #[arg(long)]
        kernel: Option<PathBuf>,
        #[arg(long)]
        force: bool,
        #[arg(long)]
        no_agent: bool,
    },
    /// Print the OpenAPI document and exit.
    Openapi,
}

fn main() -> std::process::ExitCode {
    host::state::private_umask();
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("TINE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let sub = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    if cli.log_json {
        sub.json().init();
    } else {
        sub.init();
    }
    let res = match cli.command {
        Some(Sub::BuildImage {
            kind,
            agent,
            kernel,
            force,
            no_agent,
        }) => build_image(&kind, agent, kernel, force, no_agent),
        Some(Sub::Openapi) => {
            print!("{}", tined::openapi::document());
            Ok(())
        }
        None => daemon(
            cli.home,
            cli.tcp,
            cli.token_file,
            cli.idle_exit,
            (cli.host_id, cli.advertise),
        ),
    };
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tined: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn build_image(
    kind: &str,
    agent: Option<PathBuf>,
    kernel: Option<PathBuf>,
    force: bool,
    no_agent: bool,
) -> anyhow::Result<()> {
    let home = image::default_home()?;
    let mut opts = image::BuildOptions::new(home);
    opts.kernel = kernel;
    opts.force = force;
    opts.agent = match (no_agent, agent) {
        (true, _) => image::AgentChoice::None,
        (false, Some(p)) => image::AgentChoice::Path(p),
        (false, None) => image::AgentChoice::Default,
    };
    let kind = match kind {
        "minimal" => image::ImageKind::Minimal,
        "debian" => image::ImageKind::Debian,
        k => anyhow::bail!("image kind {k:?}: say minimal or debian"),
    };
    let img = image::build_kind(kind, &opts)?;
    println!("{}", serde_json::to_string(&img)?);
    Ok(())
}

/// Identifies this build: the executable's path, size and time, so the
/// CLI can tell a tined of an older build and restart it.
fn build_id() -> String {
    let exe = std::env::current_exe().unwrap_or_default();
    let meta = std::fs::metadata(&exe).ok();
    let mtime = meta
        .as_ref()
        .and_then(|m| m.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{}:{}:{mtime}",
        exe.display(),
        meta.map(|m| m.len()).unwrap_or(0)
    )
}

fn daemon(
    home: Option<PathBuf>,
    tcp: Option<String>,
    token_file: Option<PathBuf>,
    idle_exit: u64,
    (host_id, advertise): (Option<String>, Option<String>),
) -> anyhow::Result<()> {
    let home = match home {
        Some(h) => h,
        None => image::default_home()?,
    };
    host::state::close_home(&home)?;
    let home = std::fs::canonicalize(&home)?;
    // One tined per home, for as long as this process lives.
    let lock_path = home.join("tined.lock");
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .with_context(|| format!("cannot open {}", lock_path.display()))?;
    // SAFETY: flock(2) on a file this function owns for the process's life.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let pid = std::fs::read_to_string(home.join("tined.pid")).unwrap_or_default();
        anyhow::bail!(
            "a tined already serves {} (pid {}); stop it with `tine daemon stop`",
            home.display(),
            pid.trim()
        );
    }
    host::state::write_atomic(
        &home.join("tined.pid"),
        std::process::id().to_string().as_bytes(),
    )?;
    let token = match (&tcp, token_file) {
        (None, _) => None,
        (Some(_), Some(f)) => Some(
            std::fs::read_to_string(&f)
                .with_context(|| format!("cannot read the token file {}", f.display()))?
                .trim()
                .to_string(),
        ),
        (Some(_), None) => std::env::var("TINED_TOKEN").ok(),
    };
    if token.as_deref().is_some_and(|t| t.len() < 16) {
        anyhow::bail!("the token for --tcp must have 16 or more characters");
    }
    let bins = host::Binaries::find()?;
    let h = host::Host::new(home.clone(), bins);
    let state = tined::state::AppState::new(h.clone(), build_id())?;
    if tcp.is_some() && token.is_none() && state.keys.list().is_empty() {
        // Closed until there is a way in: every TCP request is refused.
        tracing::warn!(
            "--tcp without a token and with no API keys: every TCP request is refused until one is made (`tine keys create NAME`)"
        );
    }
    // The subreaper: every VMM this process starts, and every fork child
    // orphaned by its VMM, is reaped here.
    let st = state.clone();
    host::proc::Reaper::install(move |pid, status| {
        st.events.emit(
            "process.exited",
            &pid.to_string(),
            serde_json::json!({ "status": status.to_string() }),
        );
        // The process a vm's record names: unless an operation moves the
        // vm to another process (a rollback) or removes it (rm, sleep),
        // that vm no longer runs. Told after the operation on it ends,
        // from a thread of its own: the reaper must not wait for a lock
        // whose holder may be waiting for the reaper.
        if let Some(name) = vm_of(&st.host.home, pid) {
            let st = st.clone();
            let _ = std::thread::Builder::new()
                .name("vm-exited".into())
                .spawn(move || {
                    let home = &st.host.home;
                    drop(host::lock::acquire(home, &name, Duration::from_secs(10)));
                    if vm_of(home, pid).as_deref() == Some(name.as_str()) {
                        // A VMM writes why it ended; one killed by a
                        // signal (an OOM kill, a crash, a host kernel
                        // that killed its vCPU thread) cannot: its wait
                        // status is all there is, so `ls` and errors say it.
                        let vm = host::state::VmDir::new(home, &name);
                        if vm.read_exit().is_none() {
                            tracing::warn!(vm = %name, pid, %status, "a VMM ended without an exit record");
                            if let Err(e) = vm.write_reaped(pid, &status.to_string()) {
                                tracing::warn!(vm = %name, "cannot record how its VMM ended: {e:#}");
                            }
                        }
                        st.events.emit(
                            "vm.exited",
                            &name,
                            serde_json::json!({ "pid": pid, "status": status.to_string() }),
                        );
                    }
                });
        }
    })?;
    // And what the inits of VMM process trees reap (each tree is a PID
    // namespace whose orphans go to its own init).
    host::proc::Reaper::serve_reports(&home)?;
    let report = host::reconcile::reconcile(&h)?;
    tracing::info!(
        home = %home.display(),
        running = report.running,
        repointed = ?report.repointed,
        intents = ?report.intents,
        strays = report.strays_ended,
        "reconciled"
    );
    // Into the fleet: a shared database (TINE_META=postgres://) must
    // take this host, or tined does not start; the host's own SQLite
    // file is the fleet of one, whose failure only costs `tine hosts`.
    match tined::fleet::join(&h, host_id, advertise) {
        Ok(m) => {
            tracing::info!(host = %m.id, address = %m.address, meta = %m.fleet.describe(), "registered in the fleet");
            let _ = state.fleet.set(Arc::new(m));
        }
        Err(e) if std::env::var_os("TINE_META").is_some() => {
            return Err(e.context("cannot join the fleet (TINE_META)"));
        }
        Err(e) => tracing::warn!("not registered as a host: {e:#}"),
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let sock = home.join("tined.sock");
        let unix = tined::serve::bind_unix(&sock)
            .with_context(|| format!("cannot listen on {}", sock.display()))?;
        let app = tined::router::app(state.clone());
        // E2B sandboxes whose time is up sleep or go.
        tokio::spawn(tined::e2b::expire(state.clone()));
        // Running vms with a keep policy are snapshotted periodically.
        tokio::spawn(tined::keep::run(state.clone()));
        if let Some(m) = state.fleet.get() {
            tokio::spawn(tined::fleet::heartbeat(state.clone(), m.clone()));
        }
        let stop = tined::serve::Stop::default();
        tokio::spawn(tined::serve::unix(unix, app.clone(), stop.watcher()));
        if let Some(addr) = tcp {
            let l = tokio::net::TcpListener::bind(&addr)
                .await
                .with_context(|| format!("cannot listen on {addr}"))?;
            let bound = l.local_addr().map(|a| a.to_string()).unwrap_or(addr);
            tracing::info!("listening on tcp {bound} (a token or an API key required)");
            let auth = Arc::new(tined::serve::Auth {
                token,
                state: state.clone(),
            });
            tokio::spawn(tined::serve::tcp(l, app, auth, stop.watcher()));
        }
        tracing::info!("listening on {}", sock.display());
        let watch = watch_home(state.clone(), sock.clone(), idle_exit);
        tokio::select! {
            _ = state.shutdown.notified() => {
                tracing::info!("shutdown asked; finishing what is in flight (the vms keep running)");
                drain(&state).await;
            }
            why = watch => tracing::info!("exiting: {why}"),
            _ = tokio::signal::ctrl_c() => tracing::info!("interrupted; the vms keep running"),
        }
        // Answers being written (the shutdown's own 202) reach their
        // clients before the process ends.
        stop.stop(Duration::from_secs(1)).await;
        if let Some(m) = state.fleet.get() {
            let m = m.clone();
            let _ = tokio::task::spawn_blocking(move || m.fleet.stop(&m.id, &m.owner)).await;
        }
        let _ = std::fs::remove_file(&sock);
        anyhow::Ok(())
    })?;
    drop(lock);
    // Blocking operations still running are abandoned with the process;
    // their intents are reconciled by the next tined.
    std::process::exit(0);
}

/// The vm whose record names `pid` as its VMM. A fork or rollback points
/// the record at the new process before the old one ends, so the old one
/// is no vm's.
fn vm_of(home: &std::path::Path, pid: u32) -> Option<String> {
    host::state::list(home)
        .ok()?
        .into_iter()
        .find(|vm| vm.read_record().is_ok_and(|r| r.pid == pid))
        .map(|vm| vm.name)
}

/// Refuses new requests and waits (at most 5 minutes) until the ones in
/// flight and the running operations are done.
async fn drain(state: &tined::state::Shared) {
    use std::sync::atomic::Ordering;
    state.draining.store(true, Ordering::Relaxed);
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    // The shutdown request itself is in flight until it is answered.
    while (state.in_flight.load(Ordering::Relaxed) > 1
        || state.ops.running() > 0
        || tined::state::engine_calls() > 0)
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Resolves when tined should exit on its own: its socket or home was
/// removed (a test's temporary home), or it was idle for `idle_exit`
/// seconds with no vm running and nothing in flight. Meanwhile it keeps
/// the log file bounded (`tined::logfile`).
async fn watch_home(state: tined::state::Shared, sock: PathBuf, idle_exit: u64) -> String {
    let log_max = tined::logfile::max_bytes();
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        // The log file the CLI gave this tined stays bounded.
        let _ = tokio::task::spawn_blocking(move || tined::logfile::bound_stdio(log_max)).await;
        if !sock.exists() {
            return format!("{} was removed", sock.display());
        }
        if idle_exit == 0 {
            continue;
        }
        let idle_ms = host::state::now_ms().saturating_sub(
            state
                .last_request
                .load(std::sync::atomic::Ordering::Relaxed),
        );
        if idle_ms < idle_exit * 1000 || state.ops.running() > 0 {
            continue;
        }
        let st = state.clone();
        let busy = tokio::task::spawn_blocking(move || {
            host::state::list(&st.host.home)
                .map(|vms| {
                    vms.iter().any(|vm| {
                        vm.read_record()
                            .is_ok_and(|r| vm.state(&r) == host::state::VmState::Running)
                    })
                })
                .unwrap_or(true)
        })
        .await
        .unwrap_or(true);
        if !busy {
            return format!("idle for {idle_exit}s with no vm running");
        }
    }
}
