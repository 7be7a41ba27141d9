//! The wake-up step: a copy of a vm becomes itself. Steps run in this
//! order, each reported: randomness, clock, hostname, machine_id,
//! connections, network, secret:NAME..., contract, thaw, hook:FILE...
//!
//! Randomness fails closed: when it fails nothing after it runs and the
//! workload stays frozen (until a retried Wake or the quiesce timeout).
//! Identity, secrets and the contract are in place before the thaw, so no
//! application sees the old ones; hooks run last, on a running guest.
//!
//! Commands the agent runs itself (`ip`, revoke hooks, wake hooks) stay in
//! the agent's cgroup, so those before the thaw do not freeze; a revoke
//! hook therefore runs while the workload is still frozen. Hooks get
//! stdin and stdout on /dev/null; a failure reports the tail of stderr.
//! `TINE_SECRET_PATH` is the file's real path (under DIR in the sandbox).
//!
//! With `--root DIR` (tests on a host) file paths are re-rooted under DIR
//! and the system-wide calls (RNG ioctls, clock, kernel hostname, `ip`,
//! connection resets, the freezer) are skipped with a "sandbox" detail.

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::net::IpAddr;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Component, Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use protocol::wake::{
    from_hex, to_hex, Randomness, Role, SecretAction, StepStatus, Wake, WakeNet, WakeReport,
    WakeSecret, WakeStep,
};

use crate::{conns, quiesce};

/// Guest directory whose executables run last.
pub const HOOK_DIR: &str = "/etc/tine/wake.d";
/// Where the agent leaves the wake's facts for applications.
pub const RUN_DIR: &str = "/run/tine";
/// How long one `ip` command may take.
const IP_TIMEOUT: Duration = Duration::from_secs(5);
/// How much of a failing command's stderr a step reports.
const STDERR_TAIL: usize = 512;

/// `_IOW('R', 0x03, int[2])`: add bytes to the input pool and credit them.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;

/// Where the wake applies its changes.
#[derive(Clone, Debug, Default)]
pub struct Ctx {
    /// `Some`: the sandbox; guest paths live under this directory and no
    /// system-wide state is touched.
    pub root: Option<PathBuf>,
}

impl Ctx {
    fn sandbox(&self) -> bool {
        self.root.is_some()
    }

    /// The real path of an absolute guest path (re-rooted in the sandbox).
    fn path(&self, guest: &str) -> Result<PathBuf, String> {
        let p = Path::new(guest);
        if !p.is_absolute() {
            return Err(format!("{guest:?} is not an absolute path"));
        }
        if p.components().any(|c| c == Component::ParentDir) {
            return Err(format!("{guest:?} contains \"..\""));
        }
        Ok(match &self.root {
            None => p.to_path_buf(),
            Some(r) => r.join(p.strip_prefix("/").unwrap_or(p)),
        })
    }
}

/// What a step that did not fail did.
enum Done {
    Ok(String),
    Skipped(String),
}

type StepResult = Result<Done, String>;

fn step(steps: &mut Vec<WakeStep>, name: String, f: impl FnOnce() -> StepResult) -> StepStatus {
    let t = Instant::now();
    let (status, detail) = match f() {
        Ok(Done::Ok(d)) => (StepStatus::Ok, d),
        Ok(Done::Skipped(d)) => (StepStatus::Skipped, d),
        Err(d) => (StepStatus::Failed, d),
    };
    steps.push(WakeStep {
        name,
        status,
        detail,
        micros: t.elapsed().as_micros() as u64,
    });
    status
}

/// This process's CPU time (user + system), in µs.
fn cpu_micros() -> u64 {
    // SAFETY: getrusage fills the zeroed struct we pass and keeps nothing.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid `who` and a pointer to a live rusage.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return 0;
    }
    let us = |t: libc::timeval| (t.tv_sec as u64) * 1_000_000 + t.tv_usec as u64;
    us(ru.ru_utime) + us(ru.ru_stime)
}

/// Applies a wake and reports every step. Never panics on bad input: each
/// problem is a failed step with a detail.
pub fn wake(w: &Wake, ctx: &Ctx) -> WakeReport {
    let (t0, cpu0) = (Instant::now(), cpu_micros());
    let frozen = quiesce::take();
    let mut steps = Vec::new();
    let randomness = step(&mut steps, "randomness".into(), || randomness(w, ctx));
    // The sandbox skips the ioctls but still checks the input.
    let randomness_ok = randomness != StepStatus::Failed;
    if !randomness_ok {
        let detail = match frozen {
            Some(f) => {
                quiesce::put_back(f);
                "workload stays frozen: randomness failed (fail closed)"
            }
            None => "not quiesced (and randomness failed)",
        };
        steps.push(WakeStep {
            name: "thaw".into(),
            status: StepStatus::Skipped,
            detail: detail.into(),
            micros: 0,
        });
        return report(steps, false, t0, cpu0, String::new(), None);
    }
    // Drawn right after the randomness step, before anything else runs,
    // so the host can check what a copy's kernel hands out.
    let (sample, seed) = if ctx.sandbox() {
        (String::new(), None)
    } else {
        (crate::crng::sample(), crate::crng::seed_age())
    };
    step(&mut steps, "clock".into(), || clock(w, t0, ctx));
    step(&mut steps, "hostname".into(), || hostname(w, ctx));
    step(&mut steps, "machine_id".into(), || machine_id(w, ctx));
    step(&mut steps, "identity".into(), || identity(w, ctx));
    step(&mut steps, "connections".into(), || connections(w, ctx));
    step(&mut steps, "network".into(), || {
        network(w.net.as_ref(), ctx)
    });
    for s in &w.secrets {
        step(&mut steps, format!("secret:{}", s.name), || {
            secret(s, w.hook_timeout_ms, ctx)
        });
    }
    step(&mut steps, "contract".into(), || contract(w, ctx));
    // Before the thaw: the workload never runs without the gateway's CA.
    step(&mut steps, "ca".into(), || ca(w, ctx));
    step(&mut steps, "thaw".into(), || match frozen {
        Some(f) => quiesce::thaw(f).map(Done::Ok),
        None => Ok(Done::Skipped("not quiesced".into())),
    });
    if w.run_hooks {
        hooks(&mut steps, w, ctx);
    }
    report(steps, true, t0, cpu0, sample, seed)
}

fn report(
    steps: Vec<WakeStep>,
    randomness_ok: bool,
    t0: Instant,
    cpu0: u64,
    sample_hex: String,
    seed: Option<(u64, u64)>,
) -> WakeReport {
    WakeReport {
        steps,
        randomness_ok,
        cpu_micros: cpu_micros().saturating_sub(cpu0),
        wall_micros: t0.elapsed().as_micros() as u64,
        sample_hex,
        seed_age_ms: seed.map(|s| s.0),
        crng_window_ms: seed.map(|s| s.1),
    }
}

fn ioctl_random(req: libc::c_ulong, arg: *const libc::c_void, what: &str) -> Result<(), String> {
    let f = File::open("/dev/urandom").map_err(|e| format!("/dev/urandom: {e}"))?;
    use std::os::fd::AsRawFd;
    // SAFETY: RNDADDENTROPY reads a rand_pool_info whose buf_size bytes
    // follow its header (`arg` points at such a live buffer);
    // RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(f.as_raw_fd(), req, arg) } < 0 {
        return Err(format!("{what}: {}", io::Error::last_os_error()));
    }
    Ok(())
}

/// Mixes `bytes` into the kernel's input pool, credited as `8 * len` bits.
fn add_entropy(bytes: &[u8]) -> Result<(), String> {
    let len = i32::try_from(bytes.len()).map_err(|_| "too much entropy".to_string())?;
    let bits = len.saturating_mul(8);
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut words: Vec<u32> = vec![bits as u32, len as u32];
    words.extend(bytes.chunks(4).map(|c| {
        let mut w = [0u8; 4];
        w[..c.len()].copy_from_slice(c);
        u32::from_ne_bytes(w)
    }));
    ioctl_random(RNDADDENTROPY, words.as_ptr().cast(), "RNDADDENTROPY")
}

fn randomness(w: &Wake, ctx: &Ctx) -> StepResult {
    let bytes = from_hex(&w.entropy_hex)
        .ok_or_else(|| "entropy_hex is not valid hex; nothing mixed in".to_string())?;
    if bytes.is_empty() {
        return Err("entropy_hex is empty; nothing mixed in".into());
    }
    let n = bytes.len();
    let vmgenid = if Path::new("/sys/bus/acpi/drivers/vmgenid").exists() {
        "kernel VMGenID driver present"
    } else {
        "no kernel VMGenID driver"
    };
    let mut seed_note = String::new();
    if w.randomness == Randomness::Reproducible {
        let seed = ctx.path(&format!("{RUN_DIR}/seed"))?;
        write_atomic(&seed, to_hex(&bytes).as_bytes(), 0o644)?;
        seed_note = format!("; seed in {RUN_DIR}/seed");
    }
    if ctx.sandbox() {
        return Ok(Done::Skipped(format!(
            "sandbox: {n} bytes decoded, not mixed in{seed_note}"
        )));
    }
    add_entropy(&bytes)?;
    match w.randomness {
        Randomness::Secure => {
            let age = match crate::crng::seed_age() {
                Some((age, _)) => format!("; the inherited seed was {:.2} s old", age as f64 / 1e3),
                None => String::new(),
            };
            crate::crng::reseed()?;
            Ok(Done::Ok(format!(
                "secure: {n} bytes mixed in (RNDADDENTROPY), CRNG reseeded (RNDRESEEDCRNG){age}; {vmgenid}"
            )))
        }
        Randomness::Reproducible => Ok(Done::Ok(format!(
            "reproducible: {n}-byte seed mixed in (RNDADDENTROPY), no reseed{seed_note}; {}; {vmgenid}",
            window_note(crate::crng::seed_age())
        ))),
    }
}

/// How long a reproducible copy's kernel randomness stays its siblings':
/// the inherited seed's age against the kernel's reseed interval.
fn window_note(seed: Option<(u64, u64)>) -> String {
    match seed {
        None => "no CRNG reseed before the moment: kernel randomness may differ from the siblings'".into(),
        Some((age, window)) if age < window => format!(
            "CRNG seed {:.2} s old, the kernel keeps it {:.0} s: kernel randomness matches the siblings' for {:.1} s more",
            age as f64 / 1e3,
            window as f64 / 1e3,
            (window - age) as f64 / 1e3
        ),
        Some((age, window)) => format!(
            "CRNG seed {:.2} s old, past the kernel's {:.0} s: it reseeds on its own at the next draw, and kernel randomness differs from the siblings'",
            age as f64 / 1e3,
            window as f64 / 1e3
        ),
    }
}

fn realtime_ns() -> i128 {
    match std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(e) => -(e.duration().as_nanos() as i128),
    }
}

/// Steps to the host's time as sent, plus how long this wake has run so
/// far (the randomness step comes first and can take a while).
fn clock(w: &Wake, received: Instant, ctx: &Ctx) -> StepResult {
    let Some(host) = w.host_time_ns else {
        return Ok(Done::Skipped("virtual time kept".into()));
    };
    let host = host.saturating_add(u64::try_from(received.elapsed().as_nanos()).unwrap_or(0));
    let step_s = (i128::from(host) - realtime_ns()) as f64 / 1e9;
    if ctx.sandbox() {
        return Ok(Done::Skipped(format!("sandbox: would step {step_s:+.3} s")));
    }
    let ts = libc::timespec {
        tv_sec: (host / 1_000_000_000) as libc::time_t,
        tv_nsec: (host % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: clock_settime reads the timespec we pass and keeps nothing.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } < 0 {
        return Err(format!("clock_settime: {}", io::Error::last_os_error()));
    }
    Ok(Done::Ok(format!("stepped {step_s:+.3} s")))
}

fn hostname(w: &Wake, ctx: &Ctx) -> StepResult {
    let h = &w.hostname;
    let valid = !h.is_empty()
        && h.len() <= 64
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if !valid {
        return Err(format!(
            "{h:?} is not a valid hostname (1-64 of a-z, 0-9, '-', '.')"
        ));
    }
    let kernel = if ctx.sandbox() {
        "sandbox: kernel hostname not set"
    } else {
        // SAFETY: sethostname reads `len` bytes of the string we pass.
        if unsafe { libc::sethostname(h.as_ptr().cast(), h.len()) } < 0 {
            return Err(format!("sethostname: {}", io::Error::last_os_error()));
        }
        "kernel hostname set"
    };
    write_atomic(
        &ctx.path("/etc/hostname")?,
        format!("{h}\n").as_bytes(),
        0o644,
    )?;
    let hosts = ctx.path("/etc/hosts")?;
    let old = match fs::read_to_string(&hosts) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            "127.0.0.1\tlocalhost\n::1\tlocalhost\n".into()
        }
        Err(e) => return Err(format!("/etc/hosts: {e}")),
    };
    let mut new: String = old
        .lines()
        .filter(|l| l.split_whitespace().next() != Some("127.0.1.1"))
        .map(|l| format!("{l}\n"))
        .collect();
    new.push_str(&format!("127.0.1.1\t{h}\n"));
    write_atomic(&hosts, new.as_bytes(), 0o644)?;
    Ok(Done::Ok(format!(
        "{h}: {kernel}, /etc/hostname written, /etc/hosts maps it to 127.0.1.1"
    )))
}

fn machine_id(w: &Wake, ctx: &Ctx) -> StepResult {
    let Some(id) = &w.machine_id else {
        return Ok(Done::Skipped("kept".into()));
    };
    if id.len() != 32 || !id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(format!("{id:?} is not 32 lowercase hex digits"));
    }
    write_atomic(
        &ctx.path("/etc/machine-id")?,
        format!("{id}\n").as_bytes(),
        0o444,
    )?;
    Ok(Done::Ok(format!("/etc/machine-id is {id}")))
}

/// What else names a machine, renewed with its machine id: the D-Bus
/// machine id (a file of its own on some systems), systemd's random seed
/// (two clones must not credit the same seed), the SSH host keys (clones
/// elsewhere shipped identical ones; the new fingerprints are reported),
/// and the boot id the guest sees (a new one bound over
/// /proc/sys/kernel/random/boot_id).
fn identity(w: &Wake, ctx: &Ctx) -> StepResult {
    let Some(id) = &w.machine_id else {
        return Ok(Done::Skipped("kept (the machine id is kept)".into()));
    };
    let mut did = Vec::new();
    let dbus = ctx.path("/var/lib/dbus/machine-id")?;
    if fs::symlink_metadata(&dbus).is_ok_and(|m| m.is_file()) {
        write_atomic(&dbus, format!("{id}\n").as_bytes(), 0o444)?;
        did.push("D-Bus machine id renewed".to_string());
    }
    let seed = ctx.path("/var/lib/systemd/random-seed")?;
    if seed.exists() {
        fs::remove_file(&seed).map_err(|e| format!("{}: {e}", seed.display()))?;
        did.push("systemd random-seed discarded".into());
    }
    did.extend(ssh_host_keys(ctx)?);
    if !ctx.sandbox() {
        did.push(new_boot_id()?);
    }
    if did.is_empty() {
        return Ok(Done::Skipped("nothing else names this machine".into()));
    }
    Ok(Done::Ok(did.join("; ")))
}

const SSH_KEYGEN_TIMEOUT: Duration = Duration::from_secs(30);

/// New SSH host keys where sshd has some: the old ones go, `ssh-keygen
/// -A` makes every default type anew. Returns the new fingerprints.
fn ssh_host_keys(ctx: &Ctx) -> Result<Vec<String>, String> {
    let dir = ctx.path("/etc/ssh")?;
    let old: Vec<PathBuf> = fs::read_dir(&dir)
        .map(|d| {
            d.filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                        n.starts_with("ssh_host_")
                            && (n.ends_with("_key") || n.ends_with("_key.pub"))
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    if old.is_empty() {
        return Ok(Vec::new());
    }
    let tool = ["/usr/bin/ssh-keygen", "/bin/ssh-keygen"]
        .into_iter()
        .map(Path::new)
        .find(|p| p.exists())
        .ok_or("the vm has SSH host keys but no ssh-keygen to renew them")?;
    for p in &old {
        fs::remove_file(p).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    let mut cmd = Command::new(tool);
    cmd.arg("-A");
    if let Some(root) = &ctx.root {
        cmd.arg("-f").arg(root);
    }
    let out =
        run(&mut cmd, SSH_KEYGEN_TIMEOUT).map_err(|e| format!("cannot run ssh-keygen: {e}"))?;
    if !out.success() {
        return Err(format!("ssh-keygen -A failed: {}", out.describe()));
    }
    let mut prints: Vec<String> = fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with("ssh_host_") && n.ends_with(".pub"))
        })
        .filter_map(|e| fs::read_to_string(e.path()).ok())
        .filter_map(|line| fingerprint(&line))
        .collect();
    prints.sort();
    Ok(vec![format!(
        "SSH host keys renewed: {}",
        prints.join(", ")
    )])
}

/// `TYPE SHA256:...` of a public key line, as `ssh-keygen -l` prints it.
fn fingerprint(pub_line: &str) -> Option<String> {
    use base64::Engine;
    use sha2::Digest;
    let mut f = pub_line.split_whitespace();
    let kind = f.next()?;
    let blob = base64::engine::general_purpose::STANDARD
        .decode(f.next()?)
        .ok()?;
    let sum = sha2::Sha256::digest(&blob);
    Some(format!(
        "{kind} SHA256:{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(sum)
    ))
}

/// A new boot id for the guest's programs, bound over the kernel's.
fn new_boot_id() -> Result<String, String> {
    let mut b = [0u8; 16];
    File::open("/dev/urandom")
        .and_then(|mut f| io::Read::read_exact(&mut f, &mut b))
        .map_err(|e| format!("/dev/urandom: {e}"))?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = to_hex(&b);
    let uuid = format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    );
    fs::create_dir_all("/run/tine").map_err(|e| format!("/run/tine: {e}"))?;
    let file = Path::new("/run/tine/boot_id");
    write_atomic(file, format!("{uuid}\n").as_bytes(), 0o444)?;
    let target = "/proc/sys/kernel/random/boot_id";
    // A bind mount left by an earlier wake is replaced, not stacked.
    let c = |s: &str| std::ffi::CString::new(s).map_err(|e| e.to_string());
    let (src, dst) = (c("/run/tine/boot_id")?, c(target)?);
    // SAFETY: two NUL-terminated paths that outlive the calls.
    unsafe {
        libc::umount2(dst.as_ptr(), libc::MNT_DETACH);
        if libc::mount(
            src.as_ptr(),
            dst.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND,
            std::ptr::null(),
        ) != 0
        {
            return Err(format!(
                "cannot bind a new boot id over {target}: {}",
                io::Error::last_os_error()
            ));
        }
    }
    Ok(format!("boot id {uuid}"))
}

fn connections(w: &Wake, ctx: &Ctx) -> StepResult {
    if !w.reset_connections {
        return Ok(Done::Skipped("kept (not asked to reset)".into()));
    }
    if ctx.sandbox() {
        return Ok(Done::Skipped("sandbox: no connection reset".into()));
    }
    let s = conns::reset_all().map_err(|e| format!("cannot list TCP sockets: {e}"))?;
    let unowned = if s.unowned > 0 {
        format!(" ({} held by no process)", s.unowned)
    } else {
        String::new()
    };
    if s.errors.is_empty() {
        Ok(Done::Ok(format!(
            "reset {} TCP connections to non-loopback peers{unowned}",
            s.reset
        )))
    } else {
        Err(format!(
            "reset {} TCP connections{unowned}; could not reset: {}",
            s.reset,
            s.errors.join("; ")
        ))
    }
}

fn valid_mac(m: &str) -> bool {
    let parts: Vec<&str> = m.split(':').collect();
    parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn valid_cidr(s: &str) -> bool {
    let Some((ip, len)) = s.split_once('/') else {
        return false;
    };
    let Ok(ip) = ip.parse::<IpAddr>() else {
        return false;
    };
    let max = if ip.is_ipv4() { 32 } else { 128 };
    len.parse::<u8>().is_ok_and(|l| l <= max)
}

/// The first interface with a MAC address that is not loopback, by name.
fn default_interface() -> Result<String, String> {
    let mut names: Vec<String> = fs::read_dir("/sys/class/net")
        .map_err(|e| format!("/sys/class/net: {e}"))?
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n != "lo")
        .filter(|n| {
            fs::read_to_string(format!("/sys/class/net/{n}/address"))
                .is_ok_and(|a| valid_mac(a.trim()) && a.trim() != "00:00:00:00:00:00")
        })
        .collect();
    names.sort();
    names
        .into_iter()
        .next()
        .ok_or_else(|| "no network interface with a MAC address".into())
}

fn ip_binary() -> PathBuf {
    ["/bin/ip", "/sbin/ip", "/usr/sbin/ip", "/usr/bin/ip"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("ip"))
}

fn network(net: Option<&WakeNet>, ctx: &Ctx) -> StepResult {
    let Some(net) = net else {
        return Ok(Done::Skipped("left alone".into()));
    };
    if !valid_mac(&net.mac) {
        return Err(format!("{:?} is not a MAC address", net.mac));
    }
    if !valid_cidr(&net.ip) {
        return Err(format!("{:?} is not an address/prefix", net.ip));
    }
    if net.gateway.parse::<IpAddr>().is_err() {
        return Err(format!("{:?} is not an address", net.gateway));
    }
    if let Some(i) = &net.interface {
        if i.is_empty() || i.starts_with('-') || i.contains('/') || i.len() > 15 {
            return Err(format!("{i:?} is not an interface name"));
        }
    }
    if ctx.sandbox() {
        return Ok(Done::Skipped(format!(
            "sandbox: would set {} {} via {}",
            net.mac, net.ip, net.gateway
        )));
    }
    let dev = match &net.interface {
        Some(i) => i.clone(),
        None => default_interface()?,
    };
    // tine's networks are IPv4 (the host drops IPv6 from taps). IPv6 off on
    // the interface also means no link-local address from the old MAC and
    // no autoconf timers firing at random moments after the wake: those
    // draw kernel randomness and make reproducible children diverge.
    let v6 = PathBuf::from(format!("/proc/sys/net/ipv6/conf/{dev}/disable_ipv6"));
    let v6_note = if v6.exists() {
        fs::write(&v6, "1").map_err(|e| format!("cannot turn IPv6 off on {dev}: {e}"))?;
        ", IPv6 off"
    } else {
        ""
    };
    let ip = ip_binary();
    let d = dev.as_str();
    let cmds: [&[&str]; 6] = [
        &["link", "set", "dev", d, "down"],
        &["link", "set", "dev", d, "address", &net.mac],
        &["addr", "flush", "dev", d],
        &["addr", "add", &net.ip, "dev", d],
        &["link", "set", "dev", d, "up"],
        &["route", "replace", "default", "via", &net.gateway, "dev", d],
    ];
    for args in cmds {
        let out = run(Command::new(&ip).args(args), IP_TIMEOUT)
            .map_err(|e| format!("cannot run {}: {e}", ip.display()))?;
        if !out.success() {
            return Err(format!(
                "`ip {}` failed: {}",
                args.join(" "),
                out.describe()
            ));
        }
    }
    Ok(Done::Ok(format!(
        "{d}: {} {} via {}{v6_note}",
        net.mac, net.ip, net.gateway
    )))
}

fn secret(s: &WakeSecret, hook_timeout_ms: u64, ctx: &Ctx) -> StepResult {
    let path = ctx.path(&s.path)?;
    match &s.action {
        SecretAction::Keep => Ok(Done::Ok("kept".into())),
        SecretAction::Rotate { value_hex } => {
            let value = from_hex(value_hex)
                .ok_or_else(|| "value_hex is not valid hex; file left as it was".to_string())?;
            write_atomic(&path, &value, 0o600)?;
            Ok(Done::Ok(format!(
                "rotated: {} bytes written to {} (mode 600)",
                value.len(),
                s.path
            )))
        }
        SecretAction::Revoke { hook } => {
            let wiped = wipe(&path).map_err(|e| format!("cannot revoke {}: {e}", s.path))?;
            let done = match wiped {
                Some(n) => format!("revoked: {n} bytes zeroed, synced and removed"),
                None => "already absent".to_string(),
            };
            let Some(hook) = hook else {
                return Ok(Done::Ok(done));
            };
            let prog = ctx.path(hook).map_err(|e| format!("{done}; hook: {e}"))?;
            let mut cmd = Command::new(&prog);
            cmd.env("TINE_SECRET", &s.name)
                .env("TINE_SECRET_PATH", &path);
            let out = run(&mut cmd, Duration::from_millis(hook_timeout_ms))
                .map_err(|e| format!("{done}; cannot run hook {hook}: {e}"))?;
            if out.success() {
                Ok(Done::Ok(format!("{done}; hook {hook} ok")))
            } else {
                Err(format!("{done}; hook {hook} failed: {}", out.describe()))
            }
        }
    }
}

/// Overwrites a file with zeros, syncs it and unlinks it; `None` when it
/// was not there.
fn wipe(path: &Path) -> io::Result<Option<u64>> {
    let mut f = match OpenOptions::new().write(true).open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let meta = f.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    let zeros = vec![0u8; 64 * 1024];
    let mut left = meta.len();
    while left > 0 {
        let n = left.min(zeros.len() as u64) as usize;
        f.write_all(&zeros[..n])?;
        left -= n as u64;
    }
    f.sync_all()?;
    fs::remove_file(path)?;
    Ok(Some(meta.len()))
}

/// The wake's facts, as hooks see them and wake.env holds them.
fn facts(w: &Wake) -> Vec<(&'static str, String)> {
    let role = match w.role {
        Role::Boot => "boot",
        Role::Parent => "parent",
        Role::Child => "child",
        Role::Restored => "restored",
        Role::Rollback => "rollback",
    };
    let randomness = match w.randomness {
        Randomness::Secure => "secure",
        Randomness::Reproducible => "reproducible",
    };
    let net = w.net.as_ref();
    vec![
        ("TINE_VM_ID", w.vm_id.clone()),
        ("TINE_PARENT_ID", w.parent_id.clone().unwrap_or_default()),
        ("TINE_ROLE", role.into()),
        ("TINE_HOSTNAME", w.hostname.clone()),
        // The address without its prefix length.
        (
            "TINE_IP",
            net.map(|n| n.ip.split('/').next().unwrap_or("").to_string())
                .unwrap_or_default(),
        ),
        ("TINE_MAC", net.map(|n| n.mac.clone()).unwrap_or_default()),
        ("TINE_RANDOMNESS", randomness.into()),
    ]
}

/// A value safe to source from sh: as is when plain, else single-quoted.
fn sh_quote(v: &str) -> String {
    let plain = !v.is_empty()
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:/-@".contains(&b));
    if plain {
        v.to_string()
    } else {
        format!("'{}'", v.replace('\'', r"'\''"))
    }
}

fn contract(w: &Wake, ctx: &Ctx) -> StepResult {
    write_atomic(
        &ctx.path(&format!("{RUN_DIR}/contract.toml"))?,
        w.contract_toml.as_bytes(),
        0o644,
    )?;
    let env: String = facts(w)
        .iter()
        .map(|(k, v)| format!("{k}={}\n", sh_quote(v)))
        .collect();
    write_atomic(
        &ctx.path(&format!("{RUN_DIR}/wake.env"))?,
        env.as_bytes(),
        0o644,
    )?;
    Ok(Done::Ok(format!(
        "{RUN_DIR}/contract.toml ({} bytes) and {RUN_DIR}/wake.env written",
        w.contract_toml.len()
    )))
}

/// Where the effects gateway's CA goes (Debian's local CA directory,
/// which `update-ca-certificates` reads).
pub const CA_FILE: &str = "/usr/local/share/ca-certificates/tine-effects.crt";
/// The system bundle most TLS clients read (OpenSSL, curl, Go, Python).
pub const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";
const CA_TIMEOUT: Duration = Duration::from_secs(30);

/// Installs the effects gateway's CA into the guest's trust store when the
/// gateway intercepts HTTPS: the file for `update-ca-certificates`, run
/// where it is installed, else appended to the bundle. A copy that has it
/// already (a fork's child) is left alone.
fn ca(w: &Wake, ctx: &Ctx) -> StepResult {
    let Some(pem) = &w.ca_pem else {
        return Ok(Done::Skipped("the gateway does not intercept HTTPS".into()));
    };
    let pem = pem.trim();
    if !pem.starts_with("-----BEGIN CERTIFICATE-----")
        || !pem.ends_with("-----END CERTIFICATE-----")
        || pem.len() > 64 << 10
    {
        return Err("ca_pem is not one PEM certificate".into());
    }
    let pem = format!("{pem}\n");
    let file = ctx.path(CA_FILE)?;
    let bundle = ctx.path(CA_BUNDLE)?;
    let in_bundle = || fs::read_to_string(&bundle).is_ok_and(|b| b.contains(pem.trim()));
    if fs::read_to_string(&file).is_ok_and(|f| f == pem) && (in_bundle() || !bundle.exists()) {
        return Ok(Done::Skipped(format!("{CA_FILE} is installed already")));
    }
    if let Some(dir) = file.parent() {
        fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    write_atomic(&file, pem.as_bytes(), 0o644)?;
    let tool = [
        "/usr/sbin/update-ca-certificates",
        "/usr/bin/update-ca-certificates",
    ]
    .into_iter()
    .map(|p| ctx.path(p))
    .filter_map(Result::ok)
    .find(|p| p.exists());
    if let (Some(tool), false) = (&tool, ctx.sandbox()) {
        let out = run(&mut Command::new(tool), CA_TIMEOUT)
            .map_err(|e| format!("cannot run {}: {e}", tool.display()))?;
        if !out.success() {
            return Err(format!("update-ca-certificates failed: {}", out.describe()));
        }
        if in_bundle() || !bundle.exists() {
            return Ok(Done::Ok(format!(
                "{CA_FILE} written, update-ca-certificates ran"
            )));
        }
    }
    if in_bundle() {
        return Ok(Done::Ok(format!("{CA_FILE} written ({CA_BUNDLE} has it)")));
    }
    if !bundle.exists() {
        return Ok(Done::Ok(format!(
            "{CA_FILE} written; there is no {CA_BUNDLE} to add it to"
        )));
    }
    let mut f = OpenOptions::new()
        .append(true)
        .open(&bundle)
        .map_err(|e| format!("{CA_BUNDLE}: {e}"))?;
    f.write_all(format!("\n{pem}").as_bytes())
        .and_then(|_| f.sync_all())
        .map_err(|e| format!("{CA_BUNDLE}: {e}"))?;
    Ok(Done::Ok(format!(
        "{CA_FILE} written, appended to {CA_BUNDLE}"
    )))
}

/// Runs every executable regular file in the hook directory, by name.
fn hooks(steps: &mut Vec<WakeStep>, w: &Wake, ctx: &Ctx) {
    let dir = match ctx.path(HOOK_DIR) {
        Ok(d) => d,
        Err(e) => {
            step(steps, "hooks".into(), || Err(e));
            return;
        }
    };
    let entries = match fs::read_dir(&dir) {
        Ok(d) => d,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return,
        Err(e) => {
            step(steps, "hooks".into(), || Err(format!("{HOOK_DIR}: {e}")));
            return;
        }
    };
    let mut files: Vec<(std::ffi::OsString, PathBuf)> = entries
        .flatten()
        .filter(|e| {
            fs::metadata(e.path()).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .map(|e| (e.file_name(), e.path()))
        .collect();
    files.sort();
    let facts = facts(w);
    let timeout = Duration::from_millis(w.hook_timeout_ms);
    for (name, path) in files {
        let name = name.to_string_lossy().into_owned();
        step(steps, format!("hook:{name}"), || {
            let mut cmd = Command::new(&path);
            cmd.envs(facts.iter().map(|(k, v)| (OsStr::new(k), OsStr::new(v))));
            let out = run(&mut cmd, timeout).map_err(|e| format!("cannot run: {e}"))?;
            if out.success() {
                Ok(Done::Ok("exit 0".into()))
            } else {
                Err(out.describe())
            }
        });
    }
}

/// How a command the agent ran ended.
struct Ran {
    status: ExitStatus,
    timed_out: Option<Duration>,
    stderr_tail: String,
}

impl Ran {
    fn success(&self) -> bool {
        self.timed_out.is_none() && self.status.success()
    }

    fn describe(&self) -> String {
        let how = match (self.timed_out, self.status.code(), self.status.signal()) {
            (Some(t), _, _) => format!("timed out after {} ms, killed", t.as_millis()),
            (None, Some(c), _) => format!("exit {c}"),
            (None, None, Some(s)) => format!("killed by signal {s}"),
            (None, None, None) => "ended oddly".into(),
        };
        if self.stderr_tail.is_empty() {
            how
        } else {
            format!("{how}: {}", self.stderr_tail)
        }
    }
}

/// Runs a command with stdin and stdout on /dev/null, in its own process
/// group (killed whole after `timeout`), keeping the tail of its stderr.
fn run(cmd: &mut Command, timeout: Duration) -> io::Result<Ran> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child = cmd.spawn()?;
    let (tx, rx) = mpsc::channel();
    if let Some(mut err) = child.stderr.take() {
        std::thread::spawn(move || {
            let mut tail = Vec::new();
            let mut buf = [0u8; 4096];
            loop {
                match err.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        tail.extend_from_slice(&buf[..n]);
                        if tail.len() > 4 * STDERR_TAIL {
                            tail.drain(..tail.len() - STDERR_TAIL);
                        }
                    }
                }
            }
            let _ = tx.send(tail);
        });
    }
    let t = Instant::now();
    let mut nap = Duration::from_micros(100);
    let (status, timed_out) = loop {
        if let Some(st) = child.try_wait()? {
            break (st, None);
        }
        if t.elapsed() >= timeout {
            // SAFETY: killpg on the group the child leads; the child is
            // not reaped yet, so its pid (the group id) is not reused.
            unsafe { libc::killpg(child.id() as libc::pid_t, libc::SIGKILL) };
            break (child.wait()?, Some(timeout));
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(Duration::from_millis(10));
    };
    // A background process it left may hold stderr open: do not wait long.
    let tail = rx
        .recv_timeout(Duration::from_millis(200))
        .unwrap_or_default();
    let tail = &tail[tail.len().saturating_sub(STDERR_TAIL)..];
    Ok(Ran {
        status,
        timed_out,
        stderr_tail: String::from_utf8_lossy(tail).trim().to_string(),
    })
}

/// Writes a file atomically: a temporary file in the same directory
/// (created with its parents), synced, then renamed over `path`.
fn write_atomic(path: &Path, data: &[u8], mode: u32) -> Result<(), String> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let fail = |what: &str, e: io::Error| format!("{what} {}: {e}", path.display());
    let dir = path
        .parent()
        .ok_or_else(|| format!("{} has no directory", path.display()))?;
    fs::create_dir_all(dir).map_err(|e| fail("cannot create the directory of", e))?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(
        ".{name}.tine-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let done = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(data)?;
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if let Err(e) = done {
        let _ = fs::remove_file(&tmp);
        return Err(fail("cannot write", e));
    }
    // The rename itself survives a crash once the directory is synced.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_ctx_paths() {
        let real = Ctx::default();
        assert_eq!(real.path("/etc/x").expect("abs"), PathBuf::from("/etc/x"));
        assert!(real.path("etc/x").is_err());
        assert!(real.path("/etc/../x").is_err());
        let sb = Ctx {
            root: Some(PathBuf::from("/tmp/r")),
        };
        assert_eq!(
            sb.path("/etc/x").expect("abs"),
            PathBuf::from("/tmp/r/etc/x")
        );
    }

    #[test]
    fn test_validators_and_quoting() {
        assert!(valid_mac("52:54:00:ab:CD:01"));
        assert!(!valid_mac("52:54:00:ab:cd"));
        assert!(!valid_mac("-52:54:00:ab:cd:0"));
        assert!(valid_cidr("10.213.0.5/24"));
        assert!(valid_cidr("fd00::5/64"));
        assert!(!valid_cidr("10.213.0.5"));
        assert!(!valid_cidr("10.213.0.5/33"));
        assert_eq!(sh_quote("vm-1"), "vm-1");
        assert_eq!(sh_quote(""), "''");
        assert_eq!(sh_quote("a b'c"), r"'a b'\''c'");
    }

    #[test]
    fn test_run_reports_exit_stderr_and_timeout() {
        let r = run(
            Command::new("sh").args(["-c", "echo oops >&2; exit 3"]),
            Duration::from_secs(5),
        )
        .expect("run");
        assert!(!r.success());
        assert_eq!(r.describe(), "exit 3: oops");
        let t = Instant::now();
        let r = run(
            Command::new("sh").args(["-c", "sleep 30 & sleep 30"]),
            Duration::from_millis(100),
        )
        .expect("run");
        assert!(
            r.describe().starts_with("timed out after 100 ms"),
            "{}",
            r.describe()
        );
        assert!(t.elapsed() < Duration::from_secs(5), "waited for the group");
    }
}
