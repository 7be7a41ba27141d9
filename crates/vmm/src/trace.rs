//! Small helpers every layer of the VMM uses: the fork path's clock and
//! step log, and an error with its causes on one line.

use std::time::Instant;

/// CLOCK_MONOTONIC in ns: the same clock in every process, so a forked
/// process can say when it started running and the parent can tell how
/// long the guest was paused.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: fills a valid timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000_000 + ts.tv_nsec as u64
}

/// Logs how long a step of the fork path took since `t0` (TINE_LOG=debug).
pub fn trace(t0: Instant, what: &str) {
    tracing::debug!(
        "fork path: {what} at {:.3} ms",
        t0.elapsed().as_secs_f64() * 1000.0
    );
}

/// An error and its causes on one line; a cause whose text an outer
/// message already holds (many say their source) is not repeated.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    #[derive(Debug, thiserror::Error)]
    #[error("outer: {0}")]
    struct Outer(#[source] Inner);
    #[derive(Debug, thiserror::Error)]
    #[error("inner")]
    struct Inner;
    #[derive(Debug, thiserror::Error)]
    #[error("quiet")]
    struct Quiet(#[source] Inner);

    #[test]
    fn test_chain_says_each_cause_once() {
        assert_eq!(super::chain(&Outer(Inner)), "outer: inner");
        assert_eq!(super::chain(&Quiet(Inner)), "quiet: inner");
    }
}
