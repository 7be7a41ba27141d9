//! The KVM VM: /dev/kvm, the VM fd, guest memory slots, in-kernel irqchip and PIT.

use std::path::Path;

use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, CpuId, KVM_MAX_CPUID_ENTRIES,
    KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::{Address, GuestMemoryBackend, GuestMemoryRegion};

use crate::arch::x86_64::layout::KVM_TSS_ADDRESS;
use crate::memory::GuestMemoryMmap;

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
    /// More memory regions than KVM has slots.
    #[error("Guest memory has more regions than KVM memory slots")]
    TooManyRegions,
}

/// An open VM with its memory and interrupt controllers.
pub struct Vm {
    fd: VmFd,
    supported_cpuid: CpuId,
}

impl Vm {
    /// Opens `kvm_path` and creates a VM.
    pub fn new(kvm_path: &Path) -> Result<Self, VmError> {
        let path = kvm_path.display().to_string();
        let cpath = std::ffi::CString::new(kvm_path.as_os_str().as_encoded_bytes())
            .map_err(|_| VmError::KvmMissing { path: path.clone() })?;
        let kvm = Kvm::new_with_path(cpath.as_c_str()).map_err(|source| match source.errno() {
            libc::ENOENT => VmError::KvmMissing { path: path.clone() },
            libc::EACCES | libc::EPERM => VmError::KvmDenied { path: path.clone() },
            _ => VmError::KvmOpen {
                path: path.clone(),
                source,
            },
        })?;
        let fd = kvm
            .create_vm()
            .map_err(|e| VmError::Kvm("KVM_CREATE_VM", e))?;
        let supported_cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(|e| VmError::Kvm("KVM_GET_SUPPORTED_CPUID", e))?;
        fd.set_tss_address(KVM_TSS_ADDRESS)
            .map_err(|e| VmError::Kvm("KVM_SET_TSS_ADDR", e))?;
        Ok(Self {
            fd,
            supported_cpuid,
        })
    }

    /// Registers every guest memory region as a KVM memory slot. Must run
    /// before [`Vm::setup_irqchip`]: KVM is several ms slower the other way.
    pub fn register_memory(&self, mem: &GuestMemoryMmap) -> Result<(), VmError> {
        for (slot, region) in mem.iter().enumerate() {
            let slot = u32::try_from(slot).map_err(|_| VmError::TooManyRegions)?;
            let region = kvm_userspace_memory_region {
                slot,
                flags: 0,
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
    pub fn supported_cpuid(&self) -> &CpuId {
        &self.supported_cpuid
    }
}
