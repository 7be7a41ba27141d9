//! A real PostgreSQL 15 for the tests: one throwaway cluster per test
//! binary (started on first use, on a free port), a fresh database per
//! test. A watchdog process (its own process group, so Ctrl-C does not
//! reach it) waits for the end of its stdin, a pipe only this test
//! process holds, i.e. for the test process to exit however it exits
//! (success, panic, SIGKILL), then stops the cluster (`pg_ctl stop -m
//! immediate`) and removes its directory.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Debian's PostgreSQL 15 (package postgresql-15).
pub const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

pub struct Cluster {
    pub port: u16,
    pub dir: PathBuf,
    /// Held open until the process exits: its end is the watchdog's cue.
    _watchdog: Child,
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `cmd` as the postgres user when we are root (initdb refuses root).
fn as_pg(bin: &str) -> Command {
    let path = Path::new(PG_BIN).join(bin);
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(path);
        c
    } else {
        Command::new(path)
    }
}

fn run(mut c: Command, what: &str) {
    let out = c
        .output()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("no free port: {e}"))
}

impl Cluster {
    /// Starts a cluster. `durable`: fsync on (for measurements); the
    /// tests run with fsync off.
    pub fn start(durable: bool) -> Cluster {
        let initdb = Path::new(PG_BIN).join("initdb");
        assert!(
            initdb.exists(),
            "PostgreSQL 15 is not installed ({} is missing): run scripts/setup \
             (it installs the Debian package postgresql-15)",
            initdb.display()
        );
        let dir = tempfile::Builder::new()
            .prefix("tine-pg-")
            .tempdir()
            .unwrap_or_else(|e| panic!("temp dir: {e}"))
            .keep();
        let data = dir.join("data");
        let sock = dir.join("sock");
        std::fs::create_dir(&sock).unwrap_or_else(|e| panic!("{}: {e}", sock.display()));
        if is_root() {
            let mut c = Command::new("chown");
            c.args(["-R", "postgres:postgres"]).arg(&dir);
            run(c, "chown");
        }
        let port = free_port();
        // The watchdog first: from here on, whatever happens to this
        // process, the cluster and its directory go away.
        let script = format!(
            "read _ignored; {pg_ctl} -D '{data}' stop -m immediate >/dev/null 2>&1; rm -rf '{dir}'",
            pg_ctl = if is_root() {
                format!("runuser -u postgres -- {PG_BIN}/pg_ctl")
            } else {
                format!("{PG_BIN}/pg_ctl")
            },
            data = data.display(),
            dir = dir.display(),
        );
        let watchdog = {
            use std::os::unix::process::CommandExt;
            Command::new("sh")
                .args(["-c", &script])
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0)
                .spawn()
                .unwrap_or_else(|e| panic!("cannot start the watchdog: {e}"))
        };
        let mut c = as_pg("initdb");
        c.arg("-D")
            .arg(&data)
            .args(["--auth=trust", "-U", "tine", "-E", "UTF8", "--no-sync"]);
        run(c, "initdb");
        let mut c = as_pg("pg_ctl");
        c.arg("-D").arg(&data).arg("-o").arg(format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync={}",
            sock.display(),
            if durable { "on" } else { "off" }
        ));
        c.arg("-l")
            .arg(dir.join("postgres.log"))
            .args(["-w", "start"]);
        let out = c
            .output()
            .unwrap_or_else(|e| panic!("cannot run pg_ctl: {e}"));
        if !out.status.success() {
            let log = std::fs::read_to_string(dir.join("postgres.log")).unwrap_or_default();
            panic!(
                "pg_ctl start failed ({}): {}{}\n{log}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Cluster {
            port,
            dir,
            _watchdog: watchdog,
        }
    }

    pub fn url(&self, db: &str) -> String {
        format!("postgres://tine@127.0.0.1:{}/{db}", self.port)
    }

    /// A fresh, empty database; its URL.
    pub fn database(&self, tag: &str) -> String {
        static N: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "t_{}_{}",
            tag.replace(|c: char| !c.is_ascii_alphanumeric(), "_"),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let mut c = postgres::Client::connect(&self.url("postgres"), postgres::NoTls)
            .unwrap_or_else(|e| panic!("connect to the test cluster: {e}"));
        c.batch_execute(&format!("CREATE DATABASE {name}"))
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name}: {e}"));
        self.url(&name)
    }

    /// Stops it now (the watchdog's job, done early; for a test that
    /// wants its measurements undisturbed by a later cleanup).
    pub fn stop(mut self) {
        if let Some(mut w) = self._watchdog.stdin.take() {
            let _ = w.write_all(b"\n");
        }
        let _ = self._watchdog.wait();
    }
}

/// This test binary's cluster (fsync off), started on first use.
pub fn cluster() -> &'static Cluster {
    static C: OnceLock<Cluster> = OnceLock::new();
    C.get_or_init(|| Cluster::start(false))
}

/// A fresh database in this binary's cluster: its URL.
pub fn database(tag: &str) -> String {
    cluster().database(tag)
}
