//! tine's VMM: one KVM microVM per process.

pub mod devices;
pub mod exit;
pub mod memory;
