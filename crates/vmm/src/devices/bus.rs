//! Port-I/O and MMIO buses: vCPU exits are dispatched to the device that owns the address.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device reachable through a bus. Called from vCPU threads with the
/// device's lock held, so implementations must not block.
pub trait BusDevice: Send {
    /// Guest read of `data.len()` bytes at `offset` from the device's base.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Guest write of `data` at `offset` from the device's base.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Errors while building a bus.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    /// Two devices claim overlapping ranges.
    #[error("Bus range {base:#x}+{len:#x} overlaps an existing device")]
    Overlap { base: u64, len: u64 },
    /// A zero-length range.
    #[error("Bus range at {base:#x} has zero length")]
    ZeroLength { base: u64 },
}

struct Entry {
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

/// An address space of devices (either port I/O or MMIO).
#[derive(Default)]
pub struct Bus {
    devices: BTreeMap<u64, Entry>,
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Places `device` at `[base, base + len)`.
    pub fn insert(
        &mut self,
        device: Arc<Mutex<dyn BusDevice>>,
        base: u64,
        len: u64,
    ) -> Result<(), BusError> {
        if len == 0 {
            return Err(BusError::ZeroLength { base });
        }
        let end = base
            .checked_add(len)
            .ok_or(BusError::Overlap { base, len })?;
        if let Some((b, e)) = self.devices.range(..end).next_back() {
            if b + e.len > base {
                return Err(BusError::Overlap { base, len });
            }
        }
        self.devices.insert(base, Entry { len, device });
        Ok(())
    }

    fn resolve(&self, addr: u64) -> Option<(u64, &Arc<Mutex<dyn BusDevice>>)> {
        let (base, entry) = self.devices.range(..=addr).next_back()?;
        let offset = addr - base;
        (offset < entry.len).then_some((offset, &entry.device))
    }

    /// Dispatches a read; returns false when no device owns `addr`
    /// (the caller then returns all ones, as unclaimed hardware would).
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.resolve(addr) {
            Some((offset, dev)) => {
                // A poisoned lock means a device panicked; keep serving the
                // other devices rather than taking the VMM down with it.
                let mut dev = dev.lock().unwrap_or_else(|e| e.into_inner());
                dev.read(offset, data);
                true
            }
            None => false,
        }
    }

    /// Dispatches a write; returns false when no device owns `addr`.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.resolve(addr) {
            Some((offset, dev)) => {
                let mut dev = dev.lock().unwrap_or_else(|e| e.into_inner());
                dev.write(offset, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo(u8);
    impl BusDevice for Echo {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(self.0.wrapping_add(offset as u8));
        }
        fn write(&mut self, _offset: u64, data: &[u8]) {
            self.0 = data[0];
        }
    }

    #[test]
    fn test_bus_dispatch_by_offset() {
        let mut bus = Bus::new();
        bus.insert(Arc::new(Mutex::new(Echo(1))), 0x100, 0x10)
            .expect("insert");
        let mut b = [0u8; 1];
        assert!(bus.read(0x105, &mut b));
        assert_eq!(b[0], 6);
        assert!(!bus.read(0x110, &mut b));
        assert!(bus.write(0x100, &[9]));
        assert!(bus.read(0x100, &mut b));
        assert_eq!(b[0], 9);
    }

    #[test]
    fn test_bus_overlap_rejected() {
        let mut bus = Bus::new();
        bus.insert(Arc::new(Mutex::new(Echo(0))), 0x100, 0x10)
            .expect("insert");
        assert!(bus.insert(Arc::new(Mutex::new(Echo(0))), 0x10f, 1).is_err());
        assert!(bus
            .insert(Arc::new(Mutex::new(Echo(0))), 0xf8, 0x9)
            .is_err());
        assert!(bus.insert(Arc::new(Mutex::new(Echo(0))), 0xf8, 0x8).is_ok());
    }
}
