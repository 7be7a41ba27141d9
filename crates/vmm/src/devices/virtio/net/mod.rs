//! virtio-net over a tap device, emulated on the device thread.
//!
//! No offloads are offered: every frame crosses as a plain Ethernet frame
//! behind a 12-byte `virtio_net_hdr_v1` whose fields are zero (num_buffers
//! is 1 on receive). Layout as for every device: `device.rs`, `tap.rs`,
//! `event_handler.rs`.

mod device;
mod event_handler;
mod tap;

pub use device::{Net, NetConfig, NetCounters, NetError, NetState};
pub use tap::{Tap, TapError};

/// Size of each of the two queues (rx, tx) offered to the driver.
pub const QUEUE_SIZE: u16 = 256;
/// Size of `struct virtio_net_hdr_v1`, in front of every frame both ways.
pub const VNET_HDR_LEN: usize = 12;
/// Largest frame (with its header) the device moves: 64 KiB of Ethernet
/// payload plus header and VLAN tag.
pub const MAX_BUFFER_LEN: usize = VNET_HDR_LEN + 65550;
