//! What the VMM's test binaries share.

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm::memory::{create_guest_memory, GuestMemoryMmap};

/// A private copy of guest memory with the same layout (a restore target
/// that shares nothing with the vm it was copied from).
pub fn copy_memory(mem: &GuestMemoryMmap) -> GuestMemoryMmap {
    let regions: Vec<(GuestAddress, usize)> = mem
        .iter()
        .map(|r| (r.start_addr(), r.len() as usize))
        .collect();
    let copy = create_guest_memory(&regions).expect("guest memory");
    for (addr, len) in regions {
        let mut buf = vec![0u8; len];
        mem.read_slice(&mut buf, addr).expect("read guest memory");
        copy.write_slice(&buf, addr).expect("write guest memory");
    }
    copy
}
