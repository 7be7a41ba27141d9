//! Emulated devices: legacy PC devices and virtio-mmio devices, all in userspace.

pub mod bus;
pub mod legacy;
pub mod park;
pub mod persist;
pub mod virtio;

pub use bus::{Bus, BusDevice, BusError};
