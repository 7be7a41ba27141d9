//! A real PostgreSQL 15 for the tests: one cluster per test binary (on a
//! free port, started on first use), a fresh database per test.
//!
//! A watchdog owns the cluster: a shell in its own process group (a ^C to
//! `cargo test` does not reach it) that runs initdb and pg_ctl, says
//! `ready`, then reads its stdin, a pipe whose only writer is this test
//! process. When the process ends in any way (even SIGKILL) the pipe
//! closes, the read returns, and the watchdog stops the cluster
//! (`-m immediate`) and removes its directories. Nothing is left running.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

/// Debian's PostgreSQL 15 (scripts/setup installs postgresql-15).
pub const BIN: &str = "/usr/lib/postgresql/15/bin";

/// The cluster of this test binary.
pub struct Cluster {
    pub port: u16,
    /// Held, never written: its end tells the watchdog to clean up.
    _lifeline: Mutex<ChildStdin>,
}

const WATCHDOG: &str = r#"
trap '' INT TERM HUP PIPE
B=$1 BASE=$2 PORT=$3
fail() { echo "$1"; cat "$BASE/log" "$BASE/server.log" 2>/dev/null; rm -rf "$BASE"; exit 1; }
mkdir -p "$BASE/data" "$BASE/sock" && chown postgres: "$BASE" "$BASE/data" "$BASE/sock" \
  || fail "cannot make $BASE for postgres"
runuser -u postgres -- "$B/initdb" -D "$BASE/data" --auth=trust -U postgres >"$BASE/log" 2>&1 \
  || fail "initdb failed"
runuser -u postgres -- "$B/pg_ctl" -D "$BASE/data" -l "$BASE/server.log" -w -t 60 \
  -o "-p $PORT -k $BASE/sock -c listen_addresses=127.0.0.1 -c fsync=off" start >>"$BASE/log" 2>&1 \
  || { runuser -u postgres -- "$B/pg_ctl" -D "$BASE/data" -m immediate stop >/dev/null 2>&1; fail "pg_ctl start failed"; }
echo ready
# Until the test process ends (EOF on stdin, however it ended).
cat >/dev/null
runuser -u postgres -- "$B/pg_ctl" -D "$BASE/data" -m immediate -w stop >/dev/null 2>&1
rm -rf "$BASE"
"#;

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    l.local_addr().expect("its address").port()
}

fn start() -> Result<Cluster, String> {
    for b in ["initdb", "pg_ctl", "postgres"] {
        let p = std::path::Path::new(BIN).join(b);
        if !p.exists() {
            return Err(format!(
                "{} is missing: the PostgreSQL tests need postgresql-15; run scripts/setup",
                p.display()
            ));
        }
    }
    let mut last = String::new();
    // A port taken between our probe and postgres's bind: try another.
    for _ in 0..3 {
        let port = free_port();
        let base = std::env::temp_dir().join(format!("tine-fx-pg-{}-{port}", std::process::id()));
        let mut child = Command::new("bash")
            .arg("-c")
            .arg(WATCHDOG)
            .arg("watchdog")
            .arg(BIN)
            .arg(&base)
            .arg(port.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start the postgres watchdog (bash): {e}"))?;
        let stdin = child.stdin.take().ok_or("the watchdog has no stdin")?;
        let mut out = BufReader::new(child.stdout.take().ok_or("the watchdog has no stdout")?);
        let mut line = String::new();
        let _ = out.read_line(&mut line);
        if line.trim() == "ready" {
            // The watchdog lives on, unwaited, until this process ends.
            drop(child);
            return Ok(Cluster {
                port,
                _lifeline: Mutex::new(stdin),
            });
        }
        let mut rest = String::new();
        let _ = out.read_to_string(&mut rest);
        let _ = child.wait();
        last = format!("{}{rest}", line);
    }
    Err(format!("PostgreSQL did not start:\n{last}"))
}

/// The cluster, started on first use. Panics (the test fails) with the
/// reason if it cannot run, naming scripts/setup when binaries are missing.
pub fn cluster() -> &'static Cluster {
    static C: OnceLock<Result<Cluster, String>> = OnceLock::new();
    match C.get_or_init(start) {
        Ok(c) => c,
        Err(e) => panic!("{e}"),
    }
}

/// A URL of a new, empty database of the cluster.
pub fn fresh_db(tag: &str) -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    let c = cluster();
    let name = format!("{tag}_{}", N.fetch_add(1, Ordering::Relaxed));
    let mut admin = postgres::Client::connect(
        &format!("postgres://postgres@127.0.0.1:{}/postgres", c.port),
        postgres::NoTls,
    )
    .expect("connect to the test cluster");
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .expect("create a test database");
    format!("postgres://postgres@127.0.0.1:{}/{name}", c.port)
}
