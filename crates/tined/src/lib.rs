//! tined: one control plane per host. An HTTP API ([`router::app`]) over the
//! engine library (crates/host), on `$TINE_HOME/tined.sock` (and
//! optionally TCP with a bearer token); the subreaper of every VMM it
//! starts; reconcile on start. See ARCHITECTURE.md, "The control plane",
//! and docs/design/tined.md.

pub mod agent_io;
pub mod app;
pub mod e2b;
pub mod error;
pub mod events;
pub mod fleet;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzz;
pub mod idem;
pub mod images;
pub mod keep;
pub mod keys;
pub mod logfile;
pub mod metrics;
pub mod openapi;
pub mod ops;
pub mod router;
pub mod serve;
pub mod state;
pub mod stream;

/// What a scrape of `/metrics` reads from the engine.
pub fn metrics_sample(h: &host::Host) -> metrics::Sample {
    let mut by_state: std::collections::BTreeMap<String, i64> = Default::default();
    let lineage = host::tree::lineage(h).ok();
    if let Some(l) = &lineage {
        for n in &l.nodes {
            match n.kind.as_str() {
                "vm" => *by_state.entry(n.state.clone()).or_default() += 1,
                "branch" => *by_state.entry("sleeping".into()).or_default() += 1,
                _ => {}
            }
        }
    }
    metrics::Sample {
        vms_by_state: by_state.into_iter().collect(),
        store_bytes: lineage.and_then(|l| l.store).map(|t| t.stored_bytes),
        pagein_faults: host::vm::pagein_faults(h),
    }
}
