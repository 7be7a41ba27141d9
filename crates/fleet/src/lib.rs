//! The fleet: every tined registers its host in the metadata database
//! (`TINE_META`) with what it offers (CPU, KVM, tine's format) and what it
//! has free, and renews a heartbeat lease; a sleeping branch wakes on the
//! host [`place`] picks. With SQLite the fleet is this one host; with
//! PostgreSQL it is every host on that database (docs/design/fleet.md).

mod db;
pub mod hosts;
pub mod place;

pub use db::{redact, MetaUrl};
pub use hosts::{Capacity, Fleet, HostRow, HostState, Registration, VmRow};
pub use place::{place, place_many, Need, Placement, Refusal};

/// An error of the fleet's database or configuration.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("fleet metadata {at}: {what}: {message}")]
    Db {
        at: String,
        what: &'static str,
        message: String,
    },
    #[error("fleet metadata {at} has schema version {found}, newer than this tine knows ({known}); use a newer tine")]
    SchemaTooNew { at: String, found: i64, known: i64 },
    #[error("{0}")]
    Config(String),
    #[error("host id {id:?} is held by a live tined ({address}, heartbeat {age_ms} ms ago); give this one another id (TINE_HOST_ID or `tined --host-id`)")]
    HostIdTaken {
        id: String,
        address: String,
        age_ms: i64,
    },
    #[error("fleet metadata: corrupt row: {0}")]
    Corrupt(String),
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
