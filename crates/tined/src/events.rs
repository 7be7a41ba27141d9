//! Lifecycle events (`GET /v1/events`, server-sent events): a vm started,
//! forked, checkpointed, rolled back, slept, woke, was removed, exited.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

/// One lifecycle event.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Event {
    /// Increasing per tined process.
    pub seq: u64,
    pub ts_ms: u64,
    /// vm.started, vm.forked, vm.checkpointed, vm.rolled_back,
    /// vm.snapshotted, vm.slept, vm.removed, vm.exited, vm.stopped,
    /// branch.woken, branch.removed, checkpoint.removed, gc.done,
    /// operation.finished.
    #[serde(rename = "type")]
    pub kind: String,
    /// The vm, branch or operation it is about.
    pub subject: String,
    /// Details (the children of a fork, an exit status, ...).
    #[schema(value_type = Object)]
    pub detail: serde_json::Value,
}

/// The event bus: every SSE client gets its own receiver.
pub struct Events {
    tx: broadcast::Sender<Event>,
    seq: AtomicU64,
}

impl Default for Events {
    fn default() -> Self {
        let (tx, _) = broadcast::channel(1024);
        Events {
            tx,
            seq: AtomicU64::new(0),
        }
    }
}

impl Events {
    pub fn emit(&self, kind: &str, subject: &str, detail: serde_json::Value) {
        let e = Event {
            seq: self.seq.fetch_add(1, Ordering::Relaxed) + 1,
            ts_ms: host::state::now_ms(),
            kind: kind.into(),
            subject: subject.into(),
            detail,
        };
        tracing::info!(event = %e.kind, subject = %e.subject, "event");
        // No receiver is not an error.
        let _ = self.tx.send(e);
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.tx.subscribe()
    }
}
