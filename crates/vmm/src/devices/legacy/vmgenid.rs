//! Virtual Machine Generation ID (VMGenID): a 128-bit random value in guest
//! memory that changes whenever the vm becomes a new copy of itself (a fork
//! child, a restored snapshot, a rollback), so a kernel with
//! `CONFIG_VMGENID` (drivers/virt/vmgenid.c) reseeds its RNG on its own.
//!
//! The guest finds the id through the DSDT (`arch::x86_64::acpi`): a device
//! with `_HID "QEMUVGID"`, `_CID "VM_GEN_COUNTER"` and an `ADDR` package
//! holding [`VMGENID_ADDR`]. The id lives in its own page between the ACPI
//! tables and the BIOS area, which the e820 map leaves out of RAM, so the
//! guest never allocates it. A change is announced with an ACPI Generic
//! Event Device (GED, `ACPI0013`): one edge-triggered GSI whose `_EVT`
//! method does `Notify(VGEN, 0x80)`; the driver then reads the new id.
//!
//! The device has no state besides guest memory (saved with RAM) and its
//! GSI, which follows from the device layout, so nothing is added to the
//! saved device states.

use vm_memory::{Bytes, GuestAddress, GuestMemoryError};
use vmm_sys_util::eventfd::EventFd;

use crate::memory::GuestMemoryMmap;
use crate::vm::Vm;

/// Guest-physical address of the 16-byte generation id: the last page below
/// the 0xf0000 BIOS area (which Linux scans for SMBIOS signatures), above
/// the ACPI tables, outside RAM in the e820 map.
pub const VMGENID_ADDR: u64 = 0x000e_f000;
/// Length of the generation id.
pub const VMGENID_LEN: usize = 16;

/// Errors of the VMGenID device.
#[derive(Debug, thiserror::Error)]
pub enum VmGenIdError {
    #[error("Cannot get random bytes for the generation id")]
    Random(#[source] std::io::Error),
    #[error("Cannot write the generation id at {VMGENID_ADDR:#x}")]
    Write(#[source] GuestMemoryError),
    #[error("Cannot create the generation id's eventfd")]
    EventFd(#[source] std::io::Error),
    #[error("KVM refused an irqfd for the generation id's GSI {gsi}")]
    IrqFd {
        gsi: u32,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("Cannot raise the generation id's interrupt")]
    Notify(#[source] std::io::Error),
}

/// The generation id device: its GED interrupt.
pub struct VmGenId {
    gsi: u32,
    irq: EventFd,
}

impl VmGenId {
    /// The device on `gsi`, wired to `vm` with an irqfd. Guest memory is
    /// left as it is (a restored vm keeps the id its memory holds).
    pub fn new(vm: &Vm, gsi: u32) -> Result<Self, VmGenIdError> {
        let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(VmGenIdError::EventFd)?;
        vm.fd()
            .register_irqfd(&irq, gsi)
            .map_err(|source| VmGenIdError::IrqFd { gsi, source })?;
        Ok(Self { gsi, irq })
    }

    /// The device on `gsi` whose irqfd `irq` is registered already.
    pub fn from_irq(irq: EventFd, gsi: u32) -> Self {
        Self { gsi, irq }
    }

    /// The GSI of the GED interrupt that announces a new id.
    pub fn gsi(&self) -> u32 {
        self.gsi
    }

    /// Writes a fresh random id into `mem` and raises the GED interrupt;
    /// returns the id.
    ///
    /// Call after the machine state is loaded into KVM and before the
    /// vCPUs run: the in-kernel IOAPIC passes the edge to the local APIC,
    /// which holds it pending until the guest runs with interrupts enabled
    /// (a later KVM_SET_IRQCHIP or KVM_SET_LAPIC would drop it). A guest
    /// that has not bound the GED (pin masked) just reads the id whenever
    /// it looks.
    pub fn new_generation(&self, mem: &GuestMemoryMmap) -> Result<[u8; VMGENID_LEN], VmGenIdError> {
        let id = write_new_id(mem)?;
        self.irq.write(1).map_err(VmGenIdError::Notify)?;
        Ok(id)
    }
}

/// Writes a fresh random id at [`VMGENID_ADDR`] and returns it.
pub fn write_new_id(mem: &GuestMemoryMmap) -> Result<[u8; VMGENID_LEN], VmGenIdError> {
    let id = random_id()?;
    mem.write_slice(&id, GuestAddress(VMGENID_ADDR))
        .map_err(VmGenIdError::Write)?;
    Ok(id)
}

/// The id currently in `mem`.
pub fn read_id(mem: &GuestMemoryMmap) -> Result<[u8; VMGENID_LEN], GuestMemoryError> {
    let mut id = [0u8; VMGENID_LEN];
    mem.read_slice(&mut id, GuestAddress(VMGENID_ADDR))?;
    Ok(id)
}

/// 16 bytes from the kernel's CSPRNG (getrandom(2), blocking only until it
/// is first seeded). An all-zero id would read as "no id", so it is drawn
/// again (probability 2^-128, but the loop costs nothing).
fn random_id() -> Result<[u8; VMGENID_LEN], VmGenIdError> {
    loop {
        let mut id = [0u8; VMGENID_LEN];
        let mut filled = 0;
        while filled < id.len() {
            let rest = &mut id[filled..];
            // SAFETY: getrandom writes at most `rest.len()` bytes into the
            // live buffer `rest`.
            let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
            match usize::try_from(n) {
                Ok(n) => filled += n,
                Err(_) => {
                    let e = std::io::Error::last_os_error();
                    if e.kind() != std::io::ErrorKind::Interrupted {
                        return Err(VmGenIdError::Random(e));
                    }
                }
            }
        }
        if id != [0u8; VMGENID_LEN] {
            return Ok(id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::create_guest_memory;
    use std::os::fd::AsRawFd;
    use std::path::Path;

    fn mem() -> GuestMemoryMmap {
        create_guest_memory(&[(GuestAddress(0), 2 << 20)]).expect("guest memory")
    }

    #[test]
    fn test_vmgenid_new_ids_are_random_and_written() {
        let m = mem();
        assert_eq!(read_id(&m).expect("read"), [0u8; VMGENID_LEN]);
        let a = write_new_id(&m).expect("write");
        assert_eq!(read_id(&m).expect("read"), a);
        assert_ne!(a, [0u8; VMGENID_LEN]);
        let b = write_new_id(&m).expect("write");
        assert_ne!(a, b);
        assert_eq!(read_id(&m).expect("read"), b);
    }

    #[test]
    fn test_vmgenid_write_outside_memory_fails() {
        let small = create_guest_memory(&[(GuestAddress(0), 0x80000)]).expect("guest memory");
        assert!(matches!(write_new_id(&small), Err(VmGenIdError::Write(_))));
        assert!(read_id(&small).is_err());
    }

    #[test]
    fn test_vmgenid_new_generation_writes_and_raises_the_irq() {
        let vm = Vm::new(Path::new("/dev/kvm")).expect("vm");
        let m = mem();
        vm.register_memory(&m).expect("memslots");
        vm.setup_irqchip().expect("irqchip");
        let dev = VmGenId::new(&vm, 9).expect("device");
        assert_eq!(dev.gsi(), 9);
        let before = read_id(&m).expect("read");
        let id = dev.new_generation(&m).expect("new id");
        assert_ne!(id, before);
        assert_eq!(read_id(&m).expect("read"), id);
        // KVM took the edge off the irqfd (it consumes the counter).
        let mut left = 0u64;
        // SAFETY: reads 8 bytes into a live u64 from an fd this test owns.
        let n = unsafe { libc::read(dev.irq.as_raw_fd(), (&mut left as *mut u64).cast(), 8) };
        assert!(n < 0, "the irqfd counter was not consumed by KVM: {left}");
    }
}
