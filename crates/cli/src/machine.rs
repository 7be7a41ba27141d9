//! `tine machine`: a long-lived nested host for machines without hardware
//! virtualization, the way `podman machine` works.
//!
//! The machine is the nested test host of `testhost/run` (QEMU-TCG,
//! `-cpu EPYC,+svm`, kvm_amd inside, the host's `/` shared read-only over
//! virtiofs with a RAM overlay), started with `--detach` so QEMU and
//! virtiofsd outlive the CLI call, and with QEMU user-mode networking
//! forwarding `127.0.0.1:<port>` to the agent inside. The machine's command
//! is `tine-agent serve --tcp 0.0.0.0:10000`; verbs run inside through the
//! agent's `Exec`, as the same `tine` binary (same absolute path, seen through
//! the shared root) with `TINE_HOME=/var/lib/tine`, a machine-local writable
//! home whose image cache links to the host's.
//!
//! State lives in `$TINE_HOME/machine/`: `state.json` (port, pids, agent,
//! start time), `run/` (the testhost run directory: pid files, cmd.sh,
//! console, QEMU and virtiofsd logs, the agent's stdout/stderr), `scripts/`
//! (testhost's scripts, embedded in this binary so an installed `tine` needs
//! no checkout) and `lock` (start/stop serialize on it).

use std::fs;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use protocol::{ExecRequest, Hello};
use serde::{Deserialize, Serialize};

use host::proc::ProcStat;
use host::state::now_ms;

/// The testhost scripts, one source of truth for the QEMU/initramfs recipe,
/// and the kernel pin that `run` reads beside itself.
const SCRIPTS: [(&str, &str); 4] = [
    ("run", include_str!("../../../testhost/run")),
    ("init", include_str!("../../../testhost/init")),
    ("stage2", include_str!("../../../testhost/stage2")),
    (
        "kernel-package",
        include_str!("../../../guests/kernel-package"),
    ),
];
/// Port the agent listens on inside the machine.
const GUEST_PORT: u16 = 10_000;
/// TINE_HOME of the commands run inside (the machine's overlay, in its RAM).
pub const INSIDE_HOME: &str = "/var/lib/tine";
/// Subdirectories of the host's TINE_HOME the inside home links to (caches).
const SHARED_SUBDIRS: [&str; 3] = ["images", "cache", "testhost"];
/// How long start waits for the agent after QEMU is up.
const AGENT_WAIT: Duration = Duration::from_secs(90);
/// How long stop waits for the agent's shutdown before killing QEMU.
const STOP_WAIT: Duration = Duration::from_secs(15);
/// Timeout of each protocol step of status/ping/shutdown.
const PING_TIMEOUT: Duration = Duration::from_secs(3);

/// `TINE_MACHINE`: whether verbs go through the machine.
// Policy, hardware_virtualization and needed are for main.rs's dispatch.
#[allow(dead_code)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Never (run directly, even without hardware virtualization).
    Never,
    /// Always (even with hardware virtualization).
    Always,
    /// When there is no hardware virtualization (the default).
    Auto,
}

#[allow(dead_code)]
impl Policy {
    /// From `TINE_MACHINE` (`never|always|auto`, default auto).
    pub fn from_env() -> anyhow::Result<Self> {
        match std::env::var("TINE_MACHINE").as_deref() {
            Err(_) | Ok("") | Ok("auto") => Ok(Policy::Auto),
            Ok("never") => Ok(Policy::Never),
            Ok("always") => Ok(Policy::Always),
            Ok(other) => bail!("TINE_MACHINE must be never, always or auto, not '{other}'"),
        }
    }
}

/// kvm_intel or kvm_amd is loaded: Linux guests run directly on /dev/kvm.
pub fn hardware_virtualization() -> bool {
    Path::new("/sys/module/kvm_intel").exists() || Path::new("/sys/module/kvm_amd").exists()
}

#[allow(dead_code)]
/// Whether Linux-guest verbs must go through the machine (`TINE_MACHINE`
/// and the hardware decide).
pub fn needed() -> anyhow::Result<bool> {
    Ok(match Policy::from_env()? {
        Policy::Never => false,
        Policy::Always => true,
        Policy::Auto => !hardware_virtualization(),
    })
}

/// What `tine machine status` reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MachineState {
    /// QEMU runs.
    Running,
    /// No machine.
    Stopped,
    /// State is left but its QEMU is gone (crashed or killed).
    Stale,
}

/// The machine's status (`tine machine status --json`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct MachineStatus {
    pub state: MachineState,
    /// Host port forwarded to the agent (127.0.0.1).
    pub port: Option<u16>,
    pub qemu_pid: Option<u32>,
    pub virtiofsd_pid: Option<u32>,
    pub uptime_ms: Option<u64>,
    /// The agent binary the machine runs.
    pub agent: Option<PathBuf>,
    /// The agent completed a Hello exchange just now.
    pub agent_answers: bool,
    /// The agent's software version, from its Hello.
    pub agent_version: Option<String>,
    /// `$TINE_HOME/machine`.
    pub dir: PathBuf,
}

/// `state.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct SavedState {
    port: u16,
    qemu_pid: u32,
    virtiofsd_pid: u32,
    agent: PathBuf,
    started_unix_ms: u64,
}

/// `tine machine ...` (the integrator adds `Machine(machine::MachineCommand)`).
#[derive(clap::Subcommand, Debug)]
pub enum MachineCommand {
    /// Start the nested host (does nothing if it runs).
    Start {
        #[arg(long)]
        json: bool,
    },
    /// Stop the nested host and every vm in it.
    Stop,
    /// Running, stopped or stale; port, pids, uptime, whether the agent answers.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Debugging: run CMD inside the nested host (stdin/stdout/stderr and the
    /// exit code pass through).
    #[command(hide = true)]
    Exec {
        /// Do not forward this process's stdin.
        #[arg(long)]
        no_stdin: bool,
        #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
        argv: Vec<String>,
    },
    /// Debugging: run `tine ARGS...` inside the nested host, as verbs are forwarded.
    #[command(hide = true)]
    Forward {
        #[arg(long)]
        no_stdin: bool,
        #[arg(trailing_var_arg = true, required = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

/// Runs a `tine machine` verb.
pub fn run(home: &Path, cmd: MachineCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        MachineCommand::Start { json } => {
            let t = Instant::now();
            let st = start(home)?;
            if json {
                println!("{}", serde_json::to_string_pretty(&st)?);
            } else {
                println!(
                    "machine running (port {}, qemu pid {}) after {:.1} s",
                    st.port.unwrap_or(0),
                    st.qemu_pid.unwrap_or(0),
                    t.elapsed().as_secs_f64()
                );
            }
        }
        MachineCommand::Stop => {
            stop(home)?;
            println!("machine stopped");
        }
        MachineCommand::Status { json } => {
            let st = status(home);
            if json {
                println!("{}", serde_json::to_string_pretty(&st)?);
            } else {
                println!("{}", describe(&st));
            }
        }
        MachineCommand::Exec { no_stdin, argv } => {
            ensure_started(home)?;
            let cwd = std::env::current_dir()
                .ok()
                .map(|d| d.display().to_string());
            let input: Option<Box<dyn io::Read + Send>> = if no_stdin {
                None
            } else {
                Some(Box::new(io::stdin()))
            };
            let code = exec_inside(home, &argv, &inside_env(&[]), cwd, input, &mut io::stdout())?;
            return Ok(exit_code(code));
        }
        MachineCommand::Forward { no_stdin, args } => {
            return Ok(exit_code(forward(home, &args, &[], !no_stdin)?));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// An exit status (0..=255) as an ExitCode.
pub fn exit_code(code: i32) -> ExitCode {
    ExitCode::from(u8::try_from(code.clamp(0, 255)).unwrap_or(1))
}

fn describe(st: &MachineStatus) -> String {
    match st.state {
        MachineState::Stopped => "machine stopped".into(),
        MachineState::Stale => format!(
            "machine stale: its QEMU (pid {}) is gone; `tine machine stop` cleans up, `tine machine start` restarts",
            st.qemu_pid.unwrap_or(0)
        ),
        MachineState::Running => format!(
            "machine running: qemu pid {}, virtiofsd pid {}, port {}, up {}, agent {}",
            st.qemu_pid.unwrap_or(0),
            st.virtiofsd_pid.unwrap_or(0),
            st.port.unwrap_or(0),
            human_ms(st.uptime_ms.unwrap_or(0)),
            if st.agent_answers {
                format!("answers ({})", st.agent_version.as_deref().unwrap_or("?"))
            } else {
                "does not answer".into()
            }
        ),
    }
}

fn human_ms(ms: u64) -> String {
    let s = ms / 1000;
    if s >= 3600 {
        format!("{}h{}m", s / 3600, s % 3600 / 60)
    } else if s >= 60 {
        format!("{}m{}s", s / 60, s % 60)
    } else {
        format!("{}.{}s", s, ms % 1000 / 100)
    }
}

fn dir(home: &Path) -> PathBuf {
    home.join("machine")
}

fn load(home: &Path) -> Option<SavedState> {
    let text = fs::read(dir(home).join("state.json")).ok()?;
    serde_json::from_slice(&text).ok()
}

/// `pid` is alive (not a zombie) and its command name starts with `comm`
/// (so a reused pid of another program is never taken for ours).
fn alive(pid: u32, comm: &str) -> bool {
    ProcStat::read(pid).is_some_and(|s| !s.is_exited() && s.comm.starts_with(comm))
}

const QEMU_COMM: &str = "qemu-system";
const VIRTIOFSD_COMM: &str = "virtiofsd";

/// The machine's status; asks the agent (a Hello exchange) when QEMU runs.
pub fn status(home: &Path) -> MachineStatus {
    let mut st = MachineStatus {
        state: MachineState::Stopped,
        port: None,
        qemu_pid: None,
        virtiofsd_pid: None,
        uptime_ms: None,
        agent: None,
        agent_answers: false,
        agent_version: None,
        dir: dir(home),
    };
    let Some(saved) = load(home) else {
        return st;
    };
    st.port = Some(saved.port);
    st.qemu_pid = Some(saved.qemu_pid);
    st.virtiofsd_pid = Some(saved.virtiofsd_pid);
    st.agent = Some(saved.agent.clone());
    if !alive(saved.qemu_pid, QEMU_COMM) {
        st.state = MachineState::Stale;
        return st;
    }
    st.state = MachineState::Running;
    st.uptime_ms = Some(now_ms().saturating_sub(saved.started_unix_ms));
    if let Ok((_, hello)) = connect(saved.port, Some(PING_TIMEOUT)) {
        st.agent_answers = true;
        st.agent_version = Some(hello.software);
    }
    st
}

/// Holds `$TINE_HOME/machine/lock` (flock) while alive.
struct Lock(fs::File);

impl Lock {
    fn take(home: &Path) -> anyhow::Result<Self> {
        let d = dir(home);
        fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
        let f = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(d.join("lock"))
            .with_context(|| format!("opening {}/lock", d.display()))?;
        use std::os::fd::AsRawFd;
        // SAFETY: flock on a file descriptor we own; no memory is involved.
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        if rc != 0 {
            return Err(io::Error::last_os_error()).context("locking the machine state");
        }
        Ok(Lock(f))
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        use std::os::fd::AsRawFd;
        // SAFETY: unlocking our own descriptor.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// The agent binary for the machine: `$TINE_AGENT`, else the copy kept with
/// the minimal image, else `tine-agent` next to this `tine`.
pub fn find_agent(home: &Path) -> anyhow::Result<PathBuf> {
    if let Some(a) = std::env::var_os("TINE_AGENT").filter(|a| !a.is_empty()) {
        let a = PathBuf::from(a);
        if !a.is_file() {
            bail!("TINE_AGENT={} is not a file", a.display());
        }
        return Ok(fs::canonicalize(&a)?);
    }
    // `tine image build --agent` keeps a copy next to the image.
    if let Some(a) = image::open(home, image::IMAGE_NAME)
        .ok()
        .and_then(|img| img.agent)
        .filter(|a| a.is_file())
    {
        return Ok(a);
    }
    let exe = std::env::current_exe().context("finding this tine binary")?;
    if let Some(a) = exe
        .parent()
        .map(|d| d.join("tine-agent"))
        .filter(|a| a.is_file())
    {
        return Ok(a);
    }
    bail!(
        "no tine-agent for the machine: run `tine image build --agent \"$(scripts/build-agent)\"`, or set TINE_AGENT"
    )
}

/// Starts the machine unless it runs; returns when its agent answers.
pub fn start(home: &Path) -> anyhow::Result<MachineStatus> {
    let _lock = Lock::take(home)?;
    start_locked(home)
}

fn start_locked(home: &Path) -> anyhow::Result<MachineStatus> {
    let st = status(home);
    match st.state {
        MachineState::Running if st.agent_answers => return Ok(st),
        MachineState::Running => {
            // QEMU runs but the agent does not answer: give a machine that is
            // still booting (started by a crashed `tine`) a moment, else restart.
            if let Some(port) = st.port {
                if wait_agent(port, Duration::from_secs(10)).is_ok() {
                    return Ok(status(home));
                }
            }
            teardown(home)?;
        }
        MachineState::Stale => teardown(home)?,
        MachineState::Stopped => {}
    }
    let agent = find_agent(home)?;
    let d = dir(home);
    let scripts = d.join("scripts");
    write_scripts(&scripts)?;
    let rundir = d.join("run");
    let port = free_port()?;

    let home_s = home.display().to_string();
    let agent_s = agent.display().to_string();
    for s in [&home_s, &agent_s] {
        if s.contains('\'') {
            bail!("{s}: a path with a single quote cannot be used for the machine");
        }
    }
    // The machine's command: a writable home whose caches are the host's, then the agent.
    let mut script = format!("mkdir -p {INSIDE_HOME} && ");
    for sub in SHARED_SUBDIRS {
        script.push_str(&format!(
            "{{ [ ! -d '{home_s}/{sub}' ] || ln -sfn '{home_s}/{sub}' {INSIDE_HOME}/{sub}; }} && "
        ));
    }
    script.push_str(&format!(
        "exec '{agent_s}' serve --tcp 0.0.0.0:{GUEST_PORT}"
    ));

    let mut cmd = Command::new(scripts.join("run"));
    cmd.arg("--detach")
        .arg(&rundir)
        .arg("--forward")
        .arg(format!("{port}:{GUEST_PORT}"))
        .arg("--mem")
        .arg(env_or("TINE_MACHINE_MEM", "4G"))
        .arg("--cpus")
        .arg(env_or("TINE_MACHINE_CPUS", "2"))
        .args(["--", "/bin/sh", "-c", &script])
        .current_dir("/")
        .env_clear()
        .env("TINE_HOME", home)
        .env("TINE_MACHINE", "never")
        .env("RUST_BACKTRACE", "1")
        .stdin(Stdio::null());
    for (k, v) in std::env::vars_os() {
        let keep = k == "PATH"
            || k == "HOME"
            || k.to_str().is_some_and(|k| k.starts_with("TINE_TESTHOST_"));
        if keep {
            cmd.env(k, v);
        }
    }
    let out = cmd
        .output()
        .with_context(|| format!("running {}", scripts.join("run").display()))?;
    if !out.status.success() {
        bail!(
            "the nested host did not start ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr).trim_end()
        );
    }
    let pid = |name: &str| -> anyhow::Result<u32> {
        let p = rundir.join(name);
        fs::read_to_string(&p)
            .with_context(|| format!("reading {}", p.display()))?
            .trim()
            .parse()
            .with_context(|| format!("{} holds no pid", p.display()))
    };
    let saved = SavedState {
        port,
        qemu_pid: pid("qemu.pid")?,
        virtiofsd_pid: pid("virtiofsd.pid")?,
        agent,
        started_unix_ms: now_ms(),
    };
    let tmp = d.join("state.json.tmp");
    fs::write(&tmp, serde_json::to_vec_pretty(&saved)?)?;
    fs::rename(&tmp, d.join("state.json"))?;
    if let Err(e) = wait_agent(port, AGENT_WAIT) {
        let log = fs::read_to_string(rundir.join("stderr")).unwrap_or_default();
        let _ = teardown(home);
        bail!(
            "the machine's agent did not answer on port {port}: {e:#}\nagent stderr:\n{}",
            log.trim_end()
        );
    }
    Ok(status(home))
}

fn env_or(k: &str, default: &str) -> String {
    std::env::var(k)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.into())
}

fn write_scripts(dir: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, text) in SCRIPTS {
        let p = dir.join(name);
        if fs::read(&p).is_ok_and(|old| old == text.as_bytes()) {
            continue;
        }
        let tmp = dir.join(format!(".{name}.tmp"));
        fs::write(&tmp, text)?;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755))?;
        fs::rename(&tmp, &p)?;
    }
    Ok(())
}

fn free_port() -> anyhow::Result<u16> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

fn wait_agent(port: u16, limit: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        match connect(port, Some(PING_TIMEOUT)) {
            Ok(_) => return Ok(()),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Starts the machine if it does not run, saying so in one line on stderr
/// (once, even when several `tine` calls race to start it).
pub fn ensure_started(home: &Path) -> anyhow::Result<()> {
    let answers = |home: &Path| {
        load(home).is_some_and(|saved| {
            alive(saved.qemu_pid, QEMU_COMM) && connect(saved.port, Some(PING_TIMEOUT)).is_ok()
        })
    };
    if answers(home) {
        return Ok(());
    }
    let _lock = Lock::take(home)?;
    if answers(home) {
        return Ok(());
    }
    let why = if hardware_virtualization() {
        "TINE_MACHINE=always"
    } else {
        "no hardware virtualization here"
    };
    eprintln!("tine: {why}; starting the nested test host (tine machine start)...");
    start_locked(home).map(|_| ())
}

/// Stops the machine: the agent's Shutdown, then QEMU is killed after a
/// timeout; virtiofsd goes too and the runtime state is removed.
pub fn stop(home: &Path) -> anyhow::Result<MachineStatus> {
    let _lock = Lock::take(home)?;
    teardown(home)?;
    Ok(status(home))
}

fn teardown(home: &Path) -> anyhow::Result<()> {
    let d = dir(home);
    if let Some(saved) = load(home) {
        if alive(saved.qemu_pid, QEMU_COMM) {
            if shutdown(saved.port).is_ok() {
                wait_gone(saved.qemu_pid, QEMU_COMM, STOP_WAIT);
            }
            if alive(saved.qemu_pid, QEMU_COMM) {
                kill(saved.qemu_pid, libc::SIGTERM);
                wait_gone(saved.qemu_pid, QEMU_COMM, Duration::from_secs(3));
            }
            if alive(saved.qemu_pid, QEMU_COMM) {
                kill(saved.qemu_pid, libc::SIGKILL);
                wait_gone(saved.qemu_pid, QEMU_COMM, Duration::from_secs(3));
            }
        }
        // virtiofsd exits when QEMU closes its socket; make sure.
        wait_gone(saved.virtiofsd_pid, VIRTIOFSD_COMM, Duration::from_secs(2));
        if alive(saved.virtiofsd_pid, VIRTIOFSD_COMM) {
            kill(saved.virtiofsd_pid, libc::SIGKILL);
            wait_gone(saved.virtiofsd_pid, VIRTIOFSD_COMM, Duration::from_secs(2));
        }
        if alive(saved.qemu_pid, QEMU_COMM) || alive(saved.virtiofsd_pid, VIRTIOFSD_COMM) {
            bail!(
                "could not stop the machine (qemu pid {}, virtiofsd pid {})",
                saved.qemu_pid,
                saved.virtiofsd_pid
            );
        }
    }
    // A start that failed before writing state.json may have left pid files.
    for (f, comm) in [("qemu.pid", QEMU_COMM), ("virtiofsd.pid", VIRTIOFSD_COMM)] {
        if let Some(pid) = fs::read_to_string(d.join("run").join(f))
            .ok()
            .and_then(|p| p.trim().parse::<u32>().ok())
        {
            if alive(pid, comm) {
                kill(pid, libc::SIGKILL);
                wait_gone(pid, comm, Duration::from_secs(2));
            }
        }
    }
    let _ = fs::remove_file(d.join("state.json"));
    match fs::remove_dir_all(d.join("run")) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).context("removing the machine's run directory"),
    }
    Ok(())
}

fn kill(pid: u32, sig: i32) {
    let Ok(pid) = i32::try_from(pid) else { return };
    // SAFETY: kill(2) takes plain integers; the pid was checked to be ours (comm).
    unsafe { libc::kill(pid, sig) };
}

fn wait_gone(pid: u32, comm: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while alive(pid, comm) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Connects to the agent on the forwarded port and exchanges Hello (QEMU's
/// slirp accepts before the guest does, so Hello is the real check).
fn connect(port: u16, timeout: Option<Duration>) -> anyhow::Result<(TcpStream, Hello)> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut s = TcpStream::connect_timeout(&addr, timeout.unwrap_or(PING_TIMEOUT))
        .with_context(|| format!("connecting to the machine's agent at {addr}"))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout.unwrap_or(Duration::from_secs(30))))?;
    s.set_write_timeout(timeout)?;
    let hello = protocol::hello(&mut s).context("the machine's agent")?;
    s.set_read_timeout(timeout)?;
    Ok((s, hello))
}

fn shutdown(port: u16) -> anyhow::Result<()> {
    let (s, _) = connect(port, Some(PING_TIMEOUT))?;
    protocol::shutdown(s)?;
    Ok(())
}

/// The environment of a forwarded `tine`: the machine-local home, never nest.
fn inside_env(extra: &[(String, String)]) -> Vec<(String, String)> {
    let mut env = vec![
        ("TINE_HOME".to_string(), INSIDE_HOME.to_string()),
        ("TINE_MACHINE".to_string(), "never".to_string()),
    ];
    env.extend(extra.iter().cloned());
    env
}

/// Runs `<this tine> ARGS...` inside the machine (started first if needed):
/// stdout/stderr stream back byte for byte, this process's stdin streams in
/// when `stdin`; `TINE_HOME` inside is [`INSIDE_HOME`], the cwd is this
/// process's (the host's / is visible inside). Returns the exit code, 128+n
/// for death by signal n.
pub fn forward(
    home: &Path,
    args: &[String],
    env: &[(String, String)],
    stdin: bool,
) -> anyhow::Result<i32> {
    let input: Option<Box<dyn io::Read + Send>> = if stdin {
        Some(Box::new(io::stdin()))
    } else {
        None
    };
    forward_io(home, args, env, input, &mut io::stdout())
}

/// [`forward`] with the command's stdin and stdout given by the caller
/// (`tine cp` streams files through them).
pub fn forward_io(
    home: &Path,
    args: &[String],
    env: &[(String, String)],
    stdin: Option<Box<dyn io::Read + Send>>,
    stdout: &mut dyn io::Write,
) -> anyhow::Result<i32> {
    ensure_started(home)?;
    let exe = std::env::current_exe().context("finding this tine binary")?;
    let mut argv = vec![exe.display().to_string()];
    argv.extend(args.iter().cloned());
    let cwd = std::env::current_dir()
        .ok()
        .map(|d| d.display().to_string());
    exec_inside(home, &argv, &inside_env(env), cwd, stdin, stdout)
}

/// Runs ARGV inside the running machine through the agent's Exec.
pub fn exec_inside(
    home: &Path,
    argv: &[String],
    env: &[(String, String)],
    cwd: Option<String>,
    stdin: Option<Box<dyn io::Read + Send>>,
    stdout: &mut dyn io::Write,
) -> anyhow::Result<i32> {
    let saved = load(home).ok_or_else(|| anyhow!("the machine is not running"))?;
    let (mut s, _) = connect(saved.port, Some(PING_TIMEOUT))?;
    // The command may run for as long as it likes.
    s.set_read_timeout(None)?;
    s.set_write_timeout(None)?;
    let req = ExecRequest {
        argv: argv.to_vec(),
        env: env.to_vec(),
        cwd,
        timeout: None,
        ..ExecRequest::default()
    };
    let exit = protocol::exec(&mut s, req, stdin, stdout, io::stderr())
        .context("running the command inside the machine")?;
    if exit.timed_out {
        return Ok(124);
    }
    Ok(exit.exit_code())
}

/// The vms in the machine, when it runs and this host needs it.
pub fn rows(home: &Path) -> anyhow::Result<Vec<crate::render::LsRow>> {
    if !needed()? || status(home).state != MachineState::Running {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    let code = forward_io(home, &["ls".into(), "--json".into()], &[], None, &mut out)?;
    anyhow::ensure!(code == 0, "`tine ls` inside the machine failed ({code})");
    serde_json::from_slice(&out).context("bad `tine ls --json` output from the machine")
}

/// The machine's `tine tree --json`, when it runs and this host needs it.
pub fn tree(home: &Path) -> anyhow::Result<Option<serde_json::Value>> {
    if !needed()? || status(home).state != MachineState::Running {
        return Ok(None);
    }
    let mut out = Vec::new();
    let code = forward_io(home, &["tree".into(), "--json".into()], &[], None, &mut out)?;
    anyhow::ensure!(code == 0, "`tine tree` inside the machine failed ({code})");
    Ok(Some(serde_json::from_slice(&out).context(
        "bad `tine tree --json` output from the machine",
    )?))
}
