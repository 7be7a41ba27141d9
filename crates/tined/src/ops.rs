//! Operations: long work (sleep, wake, snapshot, image build, gc, verify)
//! answered at once with an id (202); its status, progress and result are
//! polled (`GET /v1/operations/{id}`) or streamed (`.../events`, SSE).
//! Kept in memory, the last [`KEEP`] of them; an operation that a restart
//! of tined interrupted was reconciled by its intent (crates/host) and is
//! simply not known any more.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::error::ErrorBody;

/// How many finished operations are remembered.
const KEEP: usize = 1000;

/// Where an operation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum OpState {
    Running,
    Succeeded,
    Failed,
}

/// Progress of the step being done.
#[derive(Clone, Debug, Default, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Progress {
    /// What is being done ("memory", "disk0", "gc", ...).
    pub what: String,
    /// Bytes (or items) done, of `total` (0: unknown).
    pub done: u64,
    pub total: u64,
}

/// An operation as the API shows it.
#[derive(Clone, Debug, Serialize, Deserialize, utoipa::ToSchema)]
pub struct Operation {
    pub id: String,
    /// sleep, wake, snapshot, image_build, gc, verify.
    pub kind: String,
    /// What it works on (a vm, a branch, an image).
    pub target: String,
    pub state: OpState,
    pub created_ms: u64,
    pub finished_ms: Option<u64>,
    pub progress: Progress,
    /// The report, once it succeeded.
    #[schema(value_type = Option<Object>)]
    pub result: Option<serde_json::Value>,
    /// Why it failed.
    pub error: Option<ErrorBody>,
    /// The HTTP status the synchronous form of the call would have had.
    pub status: Option<u16>,
}

/// One operation's live state: watchers get every change.
pub struct Handle {
    tx: watch::Sender<Operation>,
}

impl Handle {
    pub fn get(&self) -> Operation {
        self.tx.borrow().clone()
    }
    pub fn subscribe(&self) -> watch::Receiver<Operation> {
        self.tx.subscribe()
    }
    fn update(&self, f: impl FnOnce(&mut Operation)) {
        self.tx.send_modify(f);
    }
    pub fn finish(&self, result: Result<serde_json::Value, (u16, ErrorBody)>) {
        self.update(|o| {
            o.finished_ms = Some(host::state::now_ms());
            match result {
                Ok(v) => {
                    o.state = OpState::Succeeded;
                    o.result = Some(v);
                    o.status = Some(200);
                }
                Err((status, e)) => {
                    o.state = OpState::Failed;
                    o.error = Some(e);
                    o.status = Some(status);
                }
            }
        });
    }
}

/// Progress reports of the engine go into the operation (throttled by
/// the watch channel: readers see the latest).
impl store::Progress for Handle {
    fn start(&self, what: &str, total: u64) {
        self.update(|o| {
            o.progress = Progress {
                what: what.into(),
                done: 0,
                total,
            }
        });
    }
    fn advance(&self, n: u64) {
        self.update(|o| o.progress.done = o.progress.done.saturating_add(n));
    }
}

/// Every operation known.
#[derive(Default)]
pub struct Operations {
    list: Mutex<VecDeque<Arc<Handle>>>,
}

impl Operations {
    /// A new running operation.
    pub fn start(&self, kind: &str, target: &str) -> Arc<Handle> {
        let id = format!(
            "op-{}",
            effects::random_id().unwrap_or_else(|_| host::state::now_ms().to_string())
        );
        let (tx, _) = watch::channel(Operation {
            id,
            kind: kind.into(),
            target: target.into(),
            state: OpState::Running,
            created_ms: host::state::now_ms(),
            finished_ms: None,
            progress: Progress::default(),
            result: None,
            error: None,
            status: None,
        });
        let h = Arc::new(Handle { tx });
        let mut list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        list.push_back(h.clone());
        while list.len() > KEEP {
            // Drop the oldest finished one; running ones stay.
            match list.iter().position(|o| o.get().state != OpState::Running) {
                Some(i) => {
                    list.remove(i);
                }
                None => break,
            }
        }
        h
    }

    pub fn get(&self, id: &str) -> Option<Arc<Handle>> {
        let list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        list.iter().find(|o| o.get().id == id).cloned()
    }

    pub fn all(&self) -> Vec<Operation> {
        let list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        list.iter().map(|o| o.get()).collect()
    }

    pub fn running(&self) -> usize {
        let list = self.list.lock().unwrap_or_else(|e| e.into_inner());
        list.iter()
            .filter(|o| o.get().state == OpState::Running)
            .count()
    }
}
