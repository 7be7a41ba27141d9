//! Progress of long work (puts, gets, verify), for the CLI's bars.

/// Receives progress of one long operation, in bytes. Called from worker
/// threads, hence `Sync`. Every method has a do-nothing default.
pub trait Progress: Sync {
    /// The operation starts; `total` bytes are expected (0: unknown).
    fn start(&self, _what: &str, _total: u64) {}
    /// `n` more bytes are done.
    fn advance(&self, _n: u64) {}
    /// The operation ended (successfully or not).
    fn finish(&self) {}
}

/// No reporting.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {}

/// Any `Fn(done, total)` closure: called after each step with the bytes
/// done so far and the total.
#[derive(Debug)]
pub struct FnProgress<F> {
    f: F,
    total: std::sync::atomic::AtomicU64,
    done: std::sync::atomic::AtomicU64,
}

impl<F: Fn(u64, u64) + Sync> FnProgress<F> {
    pub fn new(f: F) -> FnProgress<F> {
        FnProgress {
            f,
            total: 0.into(),
            done: 0.into(),
        }
    }
}

impl<F: Fn(u64, u64) + Sync> Progress for FnProgress<F> {
    fn start(&self, _what: &str, total: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.total.store(total, Relaxed);
        self.done.store(0, Relaxed);
        (self.f)(0, total);
    }
    fn advance(&self, n: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let done = self.done.fetch_add(n, Relaxed) + n;
        (self.f)(done, self.total.load(Relaxed));
    }
}

/// An indicatif bar: `start` sets its length and message, `advance`
/// increments it, `finish` finishes it (the CLI chooses the style and
/// when to show it).
#[cfg(feature = "indicatif")]
impl Progress for indicatif::ProgressBar {
    fn start(&self, what: &str, total: u64) {
        self.set_length(total);
        self.set_position(0);
        self.set_message(what.to_owned());
    }
    fn advance(&self, n: u64) {
        self.inc(n);
    }
    fn finish(&self) {
        indicatif::ProgressBar::finish(self);
    }
}
