//! Descriptor-chain helpers shared by the virtio devices.
//!
//! A chain's buffers are guest-controlled: [`ChainBuffers::parse`] only
//! records them (refusing chains that break the readable-then-writable
//! order or overflow 4 GiB), and every later access goes through the
//! bounds-checked `GuestMemory` byte API, so a descriptor pointing outside
//! guest RAM turns into an error on the request, never a host fault.

use std::ops::Deref;

use virtio_queue::DescriptorChain;
use vm_memory::{Bytes, GuestAddress, GuestMemory};

use crate::memory::GuestMemoryMmap;

/// Errors in a guest's descriptor chain.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    /// A device-readable descriptor follows a device-writable one.
    #[error("Descriptor chain has a readable buffer after a writable one")]
    ReadableAfterWritable,
    /// The chain's buffers add up to more than 4 GiB.
    #[error("Descriptor chain is longer than 4 GiB")]
    TooLong,
    /// A buffer of the chain is not in guest memory.
    #[error("Descriptor buffer at {addr:#x}+{len:#x} is outside guest memory")]
    OutOfMemory { addr: u64, len: usize },
}

/// The buffers of one descriptor chain, split into the part the device
/// reads (driver → device) and the part it writes (device → driver).
#[derive(Debug, Clone)]
pub struct ChainBuffers {
    /// Index of the head descriptor, to hand back in the used ring.
    pub head_index: u16,
    readable: Vec<(GuestAddress, usize)>,
    writable: Vec<(GuestAddress, usize)>,
}

impl ChainBuffers {
    /// Collects the buffers of `chain` (indirect tables included).
    pub fn parse<M>(chain: DescriptorChain<M>) -> Result<Self, ChainError>
    where
        M: Deref,
        M::Target: GuestMemory,
    {
        let head_index = chain.head_index();
        let mut readable = Vec::new();
        let mut writable = Vec::new();
        let mut total: u32 = 0;
        for desc in chain {
            total = total.checked_add(desc.len()).ok_or(ChainError::TooLong)?;
            let buf = (desc.addr(), desc.len() as usize);
            if desc.is_write_only() {
                writable.push(buf);
            } else if writable.is_empty() {
                readable.push(buf);
            } else {
                return Err(ChainError::ReadableAfterWritable);
            }
        }
        Ok(Self {
            head_index,
            readable,
            writable,
        })
    }

    /// Total length of the device-readable buffers.
    pub fn readable_len(&self) -> usize {
        self.readable.iter().map(|b| b.1).sum()
    }

    /// Total length of the device-writable buffers.
    pub fn writable_len(&self) -> usize {
        self.writable.iter().map(|b| b.1).sum()
    }

    /// Copies readable bytes starting at `offset` into `buf`; returns how
    /// many were copied (less than `buf.len()` only at the end of the chain).
    pub fn read_at(
        &self,
        mem: &GuestMemoryMmap,
        offset: usize,
        buf: &mut [u8],
    ) -> Result<usize, ChainError> {
        let mut done = 0;
        for_each_segment(&self.readable, offset, buf.len(), |addr, len| {
            mem.read_slice(&mut buf[done..done + len], addr)
                .map_err(|_| ChainError::OutOfMemory { addr: addr.0, len })?;
            done += len;
            Ok(())
        })?;
        Ok(done)
    }

    /// Copies `buf` into the writable buffers starting at `offset`; returns
    /// how many bytes were written (less than `buf.len()` only at the end).
    pub fn write_at(
        &self,
        mem: &GuestMemoryMmap,
        offset: usize,
        buf: &[u8],
    ) -> Result<usize, ChainError> {
        let mut done = 0;
        for_each_segment(&self.writable, offset, buf.len(), |addr, len| {
            mem.write_slice(&buf[done..done + len], addr)
                .map_err(|_| ChainError::OutOfMemory { addr: addr.0, len })?;
            done += len;
            Ok(())
        })?;
        Ok(done)
    }
}

/// Calls `f(addr, len)` for the pieces of `segments` covering
/// `[offset, offset + count)`, in order, stopping at the end of the chain.
fn for_each_segment(
    segments: &[(GuestAddress, usize)],
    mut offset: usize,
    mut count: usize,
    mut f: impl FnMut(GuestAddress, usize) -> Result<(), ChainError>,
) -> Result<(), ChainError> {
    for &(addr, len) in segments {
        if count == 0 {
            break;
        }
        if offset >= len {
            offset -= len;
            continue;
        }
        let n = (len - offset).min(count);
        let start = addr
            .0
            .checked_add(offset as u64)
            .ok_or(ChainError::OutOfMemory { addr: addr.0, len })?;
        f(GuestAddress(start), n)?;
        offset = 0;
        count -= n;
    }
    Ok(())
}

/// Copies `data.len()` bytes of `space` at `offset`; bytes beyond the end
/// read as zero.
pub fn read_config_space(space: &[u8], offset: u64, data: &mut [u8]) {
    data.fill(0);
    let Ok(start) = usize::try_from(offset) else {
        return;
    };
    if start >= space.len() {
        return;
    }
    let n = data.len().min(space.len() - start);
    data[..n].copy_from_slice(&space[start..start + n]);
}

/// Logs guest mistakes a bounded number of times, then counts them and
/// logs one summary line a minute at most, so a hostile guest cannot fill
/// the host's disk through the VMM's log.
#[derive(Debug, Default)]
pub struct GuestWarnings {
    count: u64,
    /// Mistakes not logged since the last summary, and when that was.
    suppressed: u64,
    summarized: Option<std::time::Instant>,
}

impl GuestWarnings {
    /// Warnings logged per device before only summaries are.
    pub const LIMIT: u64 = 16;
    /// Least time between two summaries.
    pub const SUMMARY_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

    /// Logs `args` for device `dev` unless the limit was reached.
    pub fn warn(&mut self, dev: &str, args: std::fmt::Arguments<'_>) {
        self.count += 1;
        if self.count <= Self::LIMIT {
            tracing::warn!("{dev}: {args}");
            if self.count == Self::LIMIT {
                tracing::warn!(
                    "{dev}: further guest errors are counted, and summarized once a minute"
                );
                self.summarized = Some(std::time::Instant::now());
            }
            return;
        }
        self.suppressed += 1;
        let due = self
            .summarized
            .is_none_or(|t| t.elapsed() >= Self::SUMMARY_EVERY);
        if due {
            tracing::warn!(
                "{dev}: {} more guest errors ({} in all), the last: {args}",
                self.suppressed,
                self.count
            );
            self.suppressed = 0;
            self.summarized = Some(std::time::Instant::now());
        }
    }

    /// How many mistakes were reported in all.
    pub fn count(&self) -> u64 {
        self.count
    }
}

/// A driver-side view of one split virtqueue in guest memory, for tests:
/// it lays out the rings the way a Linux driver does and publishes chains.
#[cfg(test)]
pub(crate) mod testing {
    use vm_memory::{Address, Bytes, GuestAddress};

    use crate::memory::GuestMemoryMmap;

    /// Flag: the buffer continues in `next`.
    pub const F_NEXT: u16 = 1;
    /// Flag: the device writes this buffer.
    pub const F_WRITE: u16 = 2;

    /// Rings of one queue placed at `base` (desc table, avail, used).
    pub struct TestQueue {
        pub size: u16,
        pub desc: u64,
        pub avail: u64,
        pub used: u64,
        next_desc: u16,
        avail_idx: u16,
    }

    impl TestQueue {
        /// Places a queue of `size` entries at `base` (4 KiB-aligned areas).
        pub fn new(mem: &GuestMemoryMmap, base: u64, size: u16) -> Self {
            let q = Self::new_at(base, size);
            let zeros = vec![0u8; 0x3000 + usize::from(size) * 16];
            mem.write_slice(&zeros, GuestAddress(base))
                .expect("rings in memory");
            q
        }

        /// The driver's view of a queue already placed (and zeroed) at `base`.
        pub fn new_at(base: u64, size: u16) -> Self {
            Self {
                size,
                desc: base,
                avail: base + 0x1000 * (1 + u64::from(size) * 16 / 0x1000),
                used: base + 0x1000 * (2 + u64::from(size) * 16 / 0x1000),
                next_desc: 0,
                avail_idx: 0,
            }
        }

        /// Publishes a chain of `(addr, len, flags)` buffers (F_NEXT is
        /// added by this function); returns the head index.
        pub fn add_chain(&mut self, mem: &GuestMemoryMmap, bufs: &[(u64, u32, u16)]) -> u16 {
            let head = self.next_desc;
            for (i, &(addr, len, flags)) in bufs.iter().enumerate() {
                let idx = (self.next_desc + i as u16) % self.size;
                let next = (idx + 1) % self.size;
                let flags = if i + 1 < bufs.len() {
                    flags | F_NEXT
                } else {
                    flags
                };
                let d = GuestAddress(self.desc + u64::from(idx) * 16);
                mem.write_obj(addr, d).expect("desc");
                mem.write_obj(len, d.unchecked_add(8)).expect("desc");
                mem.write_obj(flags, d.unchecked_add(12)).expect("desc");
                mem.write_obj(next, d.unchecked_add(14)).expect("desc");
            }
            self.next_desc = (self.next_desc + bufs.len() as u16) % self.size;
            let slot = GuestAddress(self.avail + 4 + u64::from(self.avail_idx % self.size) * 2);
            mem.write_obj(head, slot).expect("avail");
            self.avail_idx = self.avail_idx.wrapping_add(1);
            mem.write_obj(self.avail_idx, GuestAddress(self.avail + 2))
                .expect("avail");
            head
        }

        /// Used ring index.
        pub fn used_idx(&self, mem: &GuestMemoryMmap) -> u16 {
            mem.read_obj(GuestAddress(self.used + 2)).expect("used")
        }

        /// Used element `n`: (head id, written length).
        pub fn used_elem(&self, mem: &GuestMemoryMmap, n: u16) -> (u32, u32) {
            let e = GuestAddress(self.used + 4 + u64::from(n % self.size) * 8);
            (
                mem.read_obj(e).expect("used"),
                mem.read_obj(e.unchecked_add(4)).expect("used"),
            )
        }
    }
}
