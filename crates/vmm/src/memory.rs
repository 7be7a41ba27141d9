//! Guest RAM: one anonymous MAP_PRIVATE mapping per region, registered as KVM memslots.
//!
//! The alias lives here so that every device and loader names one type; when
//! dirty tracking of VMM writes arrives (the store issue) only this line changes.

use vm_memory::{GuestAddress, GuestMemoryMmap as VmGuestMemoryMmap};

/// Guest memory as every part of the VMM sees it.
pub type GuestMemoryMmap = VmGuestMemoryMmap<()>;

/// Errors while creating guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// Mapping guest RAM failed.
    #[error("Cannot map {size} bytes of guest RAM at {addr:#x}")]
    Map {
        addr: u64,
        size: u64,
        #[source]
        source: vm_memory::mmap::FromRangesError,
    },
}

/// Maps guest RAM for the given (start, size) regions.
pub fn create_guest_memory(
    regions: &[(GuestAddress, usize)],
) -> Result<GuestMemoryMmap, MemoryError> {
    GuestMemoryMmap::from_ranges(regions).map_err(|source| MemoryError::Map {
        addr: regions.first().map(|r| r.0 .0).unwrap_or(0),
        size: regions.iter().map(|r| r.1 as u64).sum(),
        source,
    })
}
