//! The KVM VM: /dev/kvm, the VM fd, guest memory slots, in-kernel irqchip and PIT.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use kvm_bindings::{
    kvm_clear_dirty_log, kvm_clock_data, kvm_enable_cap, kvm_irqchip, kvm_pit_config,
    kvm_userspace_memory_region, CpuId, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
    KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KVM_MAX_CPUID_ENTRIES, KVM_MEM_LOG_DIRTY_PAGES, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryRegion};

use crate::arch::x86_64::layout::KVM_TSS_ADDRESS;
use crate::memory::GuestMemoryMmap;
use crate::state::VmState;

/// KVM_GET_MSR_INDEX_LIST of this host's /dev/kvm, read once by the first
/// [`Vm::new`] (a system ioctl: vCPUs cannot ask for it themselves).
static MSR_INDEX_LIST: OnceLock<Vec<u32>> = OnceLock::new();

/// The MSR indices KVM reports as saved/emulated on this host, if a VM was
/// created in this process. vCPU state saves those among them it can read.
pub fn msr_index_list() -> &'static [u32] {
    MSR_INDEX_LIST.get().map(Vec::as_slice).unwrap_or(&[])
}

/// Errors while opening KVM and creating the VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// /dev/kvm does not exist.
    #[error("{path} does not exist: this host has no KVM. Load kvm_intel or kvm_amd, or run inside the nested test host (testhost/run)")]
    KvmMissing { path: String },
    /// /dev/kvm exists but we may not open it.
    #[error("{path}: permission denied. Add your user to the group that owns it (usually `kvm`) or run as root")]
    KvmDenied { path: String },
    /// Opening /dev/kvm failed otherwise.
    #[error("Cannot open {path}")]
    KvmOpen {
        path: String,
        #[source]
        source: kvm_ioctls::Error,
    },
    /// A KVM ioctl failed.
    #[error("{0} failed")]
    Kvm(&'static str, #[source] kvm_ioctls::Error),
    /// A saved state that cannot be what KVM wrote.
    #[error("Saved VM state is invalid: {0}")]
    InvalidState(&'static str),
    /// More memory regions than KVM has slots.
    #[error("Guest memory has more regions than KVM memory slots")]
    TooManyRegions,
}

/// Opens the KVM device at `kvm_path`, naming what is wrong when it cannot.
pub fn open_kvm(kvm_path: &Path) -> Result<Kvm, VmError> {
    let path = kvm_path.display().to_string();
    let cpath = std::ffi::CString::new(kvm_path.as_os_str().as_encoded_bytes())
        .map_err(|_| VmError::KvmMissing { path: path.clone() })?;
    Kvm::new_with_path(cpath.as_c_str()).map_err(|source| match source.errno() {
        libc::ENOENT => VmError::KvmMissing { path },
        libc::EACCES | libc::EPERM => VmError::KvmDenied { path },
        _ => VmError::KvmOpen { path, source },
    })
}

/// An open VM with its memory and interrupt controllers.
pub struct Vm {
    fd: VmFd,
    kvm: Kvm,
    /// Read on first use: a restore never needs it, and it costs time on
    /// the fork path.
    supported_cpuid: OnceLock<CpuId>,
    /// KVM's manual dirty-log protection is on: KVM_GET_DIRTY_LOG leaves
    /// pages writable, only [`Vm::clear_dirty_log`] protects them again.
    manual_dirty: AtomicBool,
}

// KVM_CLEAR_DIRTY_LOG, which kvm-ioctls does not wrap.
vmm_sys_util::ioctl_iowr_nr!(
    KVM_CLEAR_DIRTY_LOG,
    kvm_bindings::KVMIO,
    0xc0,
    kvm_clear_dirty_log
);

impl Vm {
    /// Opens `kvm_path` and creates a VM.
    pub fn new(kvm_path: &Path) -> Result<Self, VmError> {
        let kvm = open_kvm(kvm_path)?;
        let fd = kvm
            .create_vm()
            .map_err(|e| VmError::Kvm("KVM_CREATE_VM", e))?;
        fd.set_tss_address(KVM_TSS_ADDRESS)
            .map_err(|e| VmError::Kvm("KVM_SET_TSS_ADDR", e))?;
        if MSR_INDEX_LIST.get().is_none() {
            let list = kvm
                .get_msr_index_list()
                .map_err(|e| VmError::Kvm("KVM_GET_MSR_INDEX_LIST", e))?;
            let _ = MSR_INDEX_LIST.set(list.as_slice().to_vec());
        }
        Ok(Self {
            fd,
            kvm,
            supported_cpuid: OnceLock::new(),
            manual_dirty: AtomicBool::new(false),
        })
    }

    /// Registers every guest memory region as a KVM memory slot (slot =
    /// region index). Must run before [`Vm::setup_irqchip`]: KVM is several
    /// ms slower the other way.
    pub fn register_memory(&self, mem: &GuestMemoryMmap) -> Result<(), VmError> {
        self.set_memslots(mem, 0)
    }

    /// Turns KVM's dirty log (KVM_MEM_LOG_DIRTY_PAGES) on or off for every
    /// memslot registered by [`Vm::register_memory`]: a flags-only change of
    /// each slot, allowed while vCPUs run. Turning it on write-protects the
    /// slot, so the guest's next write to each page is logged.
    ///
    /// Where KVM offers it, manual protection (KVM_CAP_MANUAL_DIRTY_LOG_
    /// PROTECT2) is turned on first: reading the log then leaves pages
    /// writable, so a tracked vm whose set is collected at every fork or
    /// checkpoint takes a write fault per page once per base, not once per
    /// collection ([`Vm::clear_dirty_log`] protects them again).
    pub fn set_dirty_logging(&self, mem: &GuestMemoryMmap, on: bool) -> Result<(), VmError> {
        if on && !self.manual_dirty.load(Ordering::Acquire) {
            let wanted = u64::from(KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE);
            let offered = self
                .fd
                .check_extension_raw(u64::from(KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2));
            if offered > 0 && (offered as u64) & wanted != 0 {
                let cap = kvm_enable_cap {
                    cap: KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2,
                    args: [wanted, 0, 0, 0],
                    ..Default::default()
                };
                // Without it the log works as before (each read protects).
                if self.fd.enable_cap(&cap).is_ok() {
                    self.manual_dirty.store(true, Ordering::Release);
                }
            }
        }
        self.set_memslots(mem, if on { KVM_MEM_LOG_DIRTY_PAGES } else { 0 })
    }

    /// Whether reading the dirty log leaves pages writable (manual
    /// protection; see [`Vm::set_dirty_logging`]).
    pub fn manual_dirty_protect(&self) -> bool {
        self.manual_dirty.load(Ordering::Acquire)
    }

    /// KVM_CLEAR_DIRTY_LOG: clears the bits of `bitmap` (as read from
    /// memslot `slot`) in KVM's log and write-protects those pages again,
    /// so their next write is logged. Only with manual protection.
    pub fn clear_dirty_log(
        &self,
        slot: u32,
        len: usize,
        bitmap: &mut [u64],
    ) -> Result<(), VmError> {
        let pages = (len as u64).div_ceil(4096);
        let arg = kvm_clear_dirty_log {
            slot,
            num_pages: u32::try_from(pages).map_err(|_| VmError::TooManyRegions)?,
            first_page: 0,
            __bindgen_anon_1: kvm_bindings::kvm_clear_dirty_log__bindgen_ty_1 {
                dirty_bitmap: bitmap.as_mut_ptr().cast(),
            },
        };
        if bitmap.len() as u64 * 64 < pages {
            return Err(VmError::InvalidState(
                "dirty bitmap shorter than the memslot",
            ));
        }
        // SAFETY: a VM fd, and a kvm_clear_dirty_log whose bitmap holds a
        // bit for each of its num_pages pages.
        let rc =
            unsafe { vmm_sys_util::ioctl::ioctl_with_ref(&self.fd, KVM_CLEAR_DIRTY_LOG(), &arg) };
        if rc < 0 {
            return Err(VmError::Kvm(
                "KVM_CLEAR_DIRTY_LOG",
                kvm_ioctls::Error::last(),
            ));
        }
        Ok(())
    }

    fn set_memslots(&self, mem: &GuestMemoryMmap, flags: u32) -> Result<(), VmError> {
        for (slot, region) in mem.iter().enumerate() {
            let slot = u32::try_from(slot).map_err(|_| VmError::TooManyRegions)?;
            let region = kvm_userspace_memory_region {
                slot,
                flags,
                guest_phys_addr: region.start_addr().raw_value(),
                memory_size: region.len(),
                userspace_addr: region.as_ptr() as u64,
            };
            // SAFETY: the region is a live mapping owned by `mem`, which the
            // Vmm keeps alive for as long as the VM fd exists.
            unsafe { self.fd.set_user_memory_region(region) }
                .map_err(|e| VmError::Kvm("KVM_SET_USER_MEMORY_REGION", e))?;
        }
        Ok(())
    }

    /// KVM_GET_DIRTY_LOG of memslot `slot` (`len` bytes): one bit per 4 KiB
    /// page the guest wrote since the last call (or since logging was
    /// turned on). KVM clears its log and write-protects those pages again.
    pub fn dirty_log(&self, slot: u32, len: usize) -> Result<Vec<u64>, VmError> {
        self.fd
            .get_dirty_log(slot, len)
            .map_err(|e| VmError::Kvm("KVM_GET_DIRTY_LOG", e))
    }

    /// In-kernel PIC/IOAPIC/LAPIC and PIT.
    pub fn setup_irqchip(&self) -> Result<(), VmError> {
        self.fd
            .create_irq_chip()
            .map_err(|e| VmError::Kvm("KVM_CREATE_IRQCHIP", e))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        self.fd
            .create_pit2(pit)
            .map_err(|e| VmError::Kvm("KVM_CREATE_PIT2", e))
    }

    /// The VM fd.
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }

    /// CPUID entries KVM supports on this host.
    pub fn supported_cpuid(&self) -> Result<&CpuId, VmError> {
        if let Some(c) = self.supported_cpuid.get() {
            return Ok(c);
        }
        let c = self
            .kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(|e| VmError::Kvm("KVM_GET_SUPPORTED_CPUID", e))?;
        Ok(self.supported_cpuid.get_or_init(|| c))
    }

    /// The guest's kvmclock now (KVM_GET_CLOCK).
    pub fn clock(&self) -> Result<u64, VmError> {
        self.fd
            .get_clock()
            .map(|c| c.clock)
            .map_err(|e| VmError::Kvm("KVM_GET_CLOCK", e))
    }

    /// Sets the guest's kvmclock (KVM_SET_CLOCK); with no vCPU running.
    pub fn set_clock(&self, ns: u64) -> Result<(), VmError> {
        let clock = kvm_clock_data {
            clock: ns,
            ..Default::default()
        };
        self.fd
            .set_clock(&clock)
            .map_err(|e| VmError::Kvm("KVM_SET_CLOCK", e))
    }

    /// Saves the irqchip (PIC master, PIC slave, IOAPIC), PIT and kvmclock.
    /// Call with every vCPU paused.
    pub fn save_state(&self) -> Result<VmState, VmError> {
        let chip = |chip_id, what| {
            let mut c = kvm_irqchip {
                chip_id,
                ..Default::default()
            };
            self.fd
                .get_irqchip(&mut c)
                .map(|()| c)
                .map_err(|e| VmError::Kvm(what, e))
        };
        Ok(VmState {
            pic_master: chip(KVM_IRQCHIP_PIC_MASTER, "KVM_GET_IRQCHIP (PIC master)")?,
            pic_slave: chip(KVM_IRQCHIP_PIC_SLAVE, "KVM_GET_IRQCHIP (PIC slave)")?,
            ioapic: chip(KVM_IRQCHIP_IOAPIC, "KVM_GET_IRQCHIP (IOAPIC)")?,
            pit: self
                .fd
                .get_pit2()
                .map_err(|e| VmError::Kvm("KVM_GET_PIT2", e))?,
            clock: self
                .fd
                .get_clock()
                .map_err(|e| VmError::Kvm("KVM_GET_CLOCK", e))?,
        })
    }

    /// Restores what [`Vm::save_state`] took. The VM must have its memslots,
    /// irqchip and PIT ([`Vm::register_memory`], [`Vm::setup_irqchip`]) and
    /// no running vCPU. kvmclock continues from the saved value (see
    /// [`VmState`]).
    pub fn restore_state(&self, state: &VmState) -> Result<(), VmError> {
        if state.pic_master.chip_id != KVM_IRQCHIP_PIC_MASTER
            || state.pic_slave.chip_id != KVM_IRQCHIP_PIC_SLAVE
            || state.ioapic.chip_id != KVM_IRQCHIP_IOAPIC
        {
            return Err(VmError::InvalidState("irqchip ids out of place"));
        }
        self.fd
            .set_pit2(&state.pit)
            .map_err(|e| VmError::Kvm("KVM_SET_PIT2", e))?;
        self.set_clock(state.clock.clock)?;
        for (chip, what) in [
            (&state.pic_master, "KVM_SET_IRQCHIP (PIC master)"),
            (&state.pic_slave, "KVM_SET_IRQCHIP (PIC slave)"),
            (&state.ioapic, "KVM_SET_IRQCHIP (IOAPIC)"),
        ] {
            self.fd
                .set_irqchip(chip)
                .map_err(|e| VmError::Kvm(what, e))?;
        }
        Ok(())
    }
}

/// The VM-level KVM state: irqchip, PIT and kvmclock ([`Vm::save_state`]);
/// a restore loads it into a fresh VM with its irqchip set up.
impl crate::persist::Persist for Vm {
    type State = VmState;
    type ConstructorArgs = Vm;
    type Error = VmError;

    fn save(&self) -> Result<VmState, VmError> {
        self.save_state()
    }

    fn restore(fresh: Vm, state: &VmState) -> Result<Self, VmError> {
        fresh.restore_state(state)?;
        Ok(fresh)
    }
}
