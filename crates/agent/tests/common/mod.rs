//! What the agent's test binaries share: the binary under test and a way
//! to start it serving on a Unix socket.

use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The agent under test (`TINE_AGENT_BIN` runs the tests against another
/// build, e.g. the static one from scripts/build-agent).
pub fn agent_bin() -> PathBuf {
    std::env::var_os("TINE_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_tine-agent")))
}

/// `tine-agent serve --unix SOCK --exit-on-shutdown EXTRA...`, returned
/// once it accepts connections.
pub fn serve(sock: &Path, extra: &[&std::ffi::OsStr]) -> Child {
    let child = Command::new(agent_bin())
        .arg("serve")
        .arg("--unix")
        .arg(sock)
        .arg("--exit-on-shutdown")
        .args(extra)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn agent");
    let t = Instant::now();
    while UnixStream::connect(sock).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "agent did not listen"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}
