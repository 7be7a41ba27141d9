//! How a vm ends: the guest asks (reset, poweroff) or KVM stops it (triple fault).
//!
//! Devices and vCPU threads report through one shared [`ExitNotifier`]; the
//! VMM's main thread waits on it. The first reason reported wins.

use std::sync::{Condvar, Mutex};

/// Why the guest stopped running.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GuestExit {
    /// The guest reset the machine (i8042 pulse, ACPI reset register, `reboot`).
    Reset,
    /// The guest powered off (ACPI S5 through the sleep control register, `poweroff`).
    Poweroff,
    /// KVM reported a shutdown (triple fault) or a system event without a reason.
    Shutdown,
    /// A vCPU stopped on an error the VMM cannot continue from.
    Crashed,
    /// The host asked the VMM to stop (signal).
    Stopped,
}

impl GuestExit {
    /// Process exit status of the VMM for this reason: clean guest-initiated
    /// exits are 0, a crash is 1; reset is 0 too (one VMM process per boot).
    pub fn exit_code(self) -> i32 {
        match self {
            GuestExit::Reset | GuestExit::Poweroff | GuestExit::Stopped => 0,
            GuestExit::Shutdown => 2,
            GuestExit::Crashed => 1,
        }
    }
}

impl std::fmt::Display for GuestExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            GuestExit::Reset => "reset",
            GuestExit::Poweroff => "poweroff",
            GuestExit::Shutdown => "shutdown",
            GuestExit::Crashed => "crashed",
            GuestExit::Stopped => "stopped",
        };
        f.write_str(s)
    }
}

/// Shared by everything that can end the vm.
#[derive(Debug, Default)]
pub struct ExitNotifier {
    reason: Mutex<Option<GuestExit>>,
    /// What failed, for an exit the VMM caused (e.g. a page that could not
    /// be paged in); written to the exit record.
    detail: Mutex<Option<String>>,
    cond: Condvar,
}

impl ExitNotifier {
    /// A notifier with no exit reported yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reports an exit; later reports are ignored.
    pub fn notify(&self, exit: GuestExit) {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            *r = Some(exit);
            self.cond.notify_all();
        }
    }

    /// Reports an exit the VMM caused, with what failed (kept only if this
    /// is the first exit reported).
    pub fn fail(&self, exit: GuestExit, detail: String) {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            *self.detail.lock().unwrap_or_else(|e| e.into_inner()) = Some(detail);
            *r = Some(exit);
            self.cond.notify_all();
        }
    }

    /// What failed, if the exit was reported by [`ExitNotifier::fail`].
    pub fn detail(&self) -> Option<String> {
        self.detail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The exit reported so far, if any.
    pub fn get(&self) -> Option<GuestExit> {
        *self.reason.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks until an exit is reported.
    pub fn wait(&self) -> GuestExit {
        let mut r = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(exit) = *r {
                return exit;
            }
            r = self.cond.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }
}
