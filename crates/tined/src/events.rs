//! Lifecycle events (`GET /v1/events`, server-sent events): a vm started,
//! forked, checkpointed, rolled back, slept, woke, was removed, exited.

use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

/// One lifecycle event.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Event {
    /// Increasing per tined process.
    pub seq: u64,
    pub ts_ms: u64,
    /// vm.started, vm.forked, vm.checkpointed, vm.rolled_back,
    /// vm.snapshotted, vm.slept, vm.removed, vm.exited (it no longer runs:
    /// its VMM ended and no operation moved it to another process or
    /// removed it: the guest crashed, shut down or reset, or it was
    /// killed or stopped), vm.stopped, branch.woken, branch.removed,
    /// checkpoint.removed, gc.done, verify.done, image.built,
    /// operation.finished, process.exited (any child of tined).
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
    /// The last seq given; held while the event is sent, so that the
    /// stream carries events in the order of their seq (threads emit at
    /// the same time: the reaper, operations, handlers).
    seq: Mutex<u64>,
}

impl Default for Events {
    fn default() -> Self {
        let (tx, _) = broadcast::channel(1024);
        Events {
            tx,
            seq: Mutex::new(0),
        }
    }
}

impl Events {
    pub fn emit(&self, kind: &str, subject: &str, detail: serde_json::Value) {
        let mut seq = self.seq.lock().unwrap_or_else(|e| e.into_inner());
        *seq += 1;
        let e = Event {
            seq: *seq,
            ts_ms: host::state::now_ms(),
            kind: kind.into(),
            subject: subject.into(),
            detail,
        };
        tracing::info!(event = %e.kind, subject = %e.subject, "event");
        // No receiver is not an error; the send does not block.
        let _ = self.tx.send(e);
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.tx.subscribe()
    }
}
