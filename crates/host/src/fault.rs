//! Crash points for tests: `TINE_HOST_FAULT=POINT[,POINT...]` makes the
//! process that reaches a named point of an operation kill itself with
//! SIGKILL, as `kill -9` of tined would at exactly that moment (no
//! destructor, no unwinding, no intent finished). The next tined
//! reconciles what it left (crates/cli/tests/crash.rs). Unset, each point
//! costs one look at a cached value.
//!
//! | point | where |
//! | --- | --- |
//! | `fork:prepared` | the fork's intent and children's directories exist; the VMM not asked |
//! | `fork:answered` | the VMM started the children and the continuation; nothing of it recorded |
//! | `fork:recorded` | children and continuation recorded; the old VMM not let go, nobody woken |
//! | `fork:done` | the fork is finished and every copy woken; its answer not sent |
//! | `checkpoint:answered` | the template runs; its record not written |
//! | `rollback:killed` | the vm's VMM was killed; the template not asked |
//! | `snapshot:answered` | the snapshot directory is written; the vm's new process not recorded |
//! | `sleep:answered` | the moment is staged; the vm's new process not recorded |
//! | `sleep:stored` | the store committed the snapshot (the branch sleeps); the intent not marked committed |
//! | `sleep:committed` | the intent is marked committed; the vm not yet ended |
//! | `precopy:answered`, `precopy:stored`, `precopy:committed` | the same in a move's pre-copy round (the vm runs on) |
//! | `wake:materialized` | the snapshot is a directory; no VMM started |
//! | `wake:started` | the woken vm runs and is recorded; its branch not marked running |
//!
//! It is in [`crate::CONFIG_ENV`]: a `tine` command run with it restarts
//! tined with it, and the next command without it restarts tined again.

use std::sync::OnceLock;

/// The environment variable.
pub const ENV: &str = "TINE_HOST_FAULT";

fn armed() -> &'static [String] {
    static ARMED: OnceLock<Vec<String>> = OnceLock::new();
    ARMED.get_or_init(|| {
        std::env::var(ENV)
            .map(|v| {
                v.split(',')
                    .map(|p| p.trim().to_string())
                    .filter(|p| !p.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    })
}

/// Kills this process if `TINE_HOST_FAULT` names `point`.
pub fn point(point: &str) {
    if armed().iter().any(|p| p == point) {
        tracing::error!("{ENV}: killing this process at {point}");
        // SAFETY: kill(2) of this process with a plain signal number.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
        // SIGKILL to oneself is delivered before kill(2) returns; never
        // go on past a crash point regardless.
        std::process::abort();
    }
}
