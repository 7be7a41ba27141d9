//! virtio-blk over a disk image: raw, or a qcow2 backing chain (crates/disk).
//!
//! Requests are served synchronously on the device thread; FLUSH flushes
//! the top layer (its metadata, then fsync). Layout as for every device:
//! `device.rs` (what the device is), `request.rs` (one request),
//! `event_handler.rs` (how it reacts to events).

mod device;
mod event_handler;
mod request;

pub use device::{Block, BlockConfig, BlockError, BlockState};

/// Sector size of the virtio-blk protocol.
pub const SECTOR_SIZE: u64 = 512;
/// Size of the request queue offered to the driver.
pub const QUEUE_SIZE: u16 = 256;
