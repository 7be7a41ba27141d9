//! One vCPU: its KVM fd, boot configuration, and the thread that runs it and
//! dispatches its exits to the buses.

use std::sync::Arc;
use std::thread::JoinHandle;

use kvm_bindings::CpuId;
use kvm_ioctls::{VcpuExit, VcpuFd, VmFd};

use crate::arch::x86_64::{cpuid, msr, regs};
use crate::devices::Bus;
use crate::exit::{ExitNotifier, GuestExit};
use crate::memory::GuestMemoryMmap;

/// KVM_SYSTEM_EVENT_SHUTDOWN / RESET (linux/kvm.h).
const KVM_SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const KVM_SYSTEM_EVENT_RESET: u32 = 2;
/// LAPIC LVT registers and delivery modes for the BSP's legacy lines.
const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_EXTINT: u32 = 0x7;
const APIC_MODE_NMI: u32 = 0x4;

/// Errors while creating or configuring a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// KVM refused an ioctl.
    #[error("vCPU {index}: {what} failed")]
    Kvm {
        index: u8,
        what: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Boot structures could not be written.
    #[error("vCPU {index}: boot setup failed")]
    Regs {
        index: u8,
        #[source]
        source: regs::RegsError,
    },
    /// The MSR list could not be built.
    #[error("vCPU {index}: cannot build the boot MSR list")]
    Msrs { index: u8 },
    /// The thread could not be started.
    #[error("vCPU {index}: cannot start its thread")]
    Spawn {
        index: u8,
        #[source]
        source: std::io::Error,
    },
}

/// A vCPU ready to run.
pub struct Vcpu {
    index: u8,
    fd: VcpuFd,
}

impl Vcpu {
    /// Creates vCPU `index` in `vm`.
    pub fn new(vm: &VmFd, index: u8) -> Result<Self, VcpuError> {
        let fd = vm
            .create_vcpu(u64::from(index))
            .map_err(|source| VcpuError::Kvm {
                index,
                what: "KVM_CREATE_VCPU",
                source,
            })?;
        Ok(Self { index, fd })
    }

    /// Sets CPUID, MSRs, registers and LAPIC for a cold boot at `entry`.
    pub fn configure_boot(
        &self,
        mem: &GuestMemoryMmap,
        supported_cpuid: &CpuId,
        vcpu_count: u8,
        entry: u64,
    ) -> Result<(), VcpuError> {
        let index = self.index;
        let kvm = |what| {
            move |source| VcpuError::Kvm {
                index,
                what,
                source,
            }
        };
        let mut cpuid = supported_cpuid.clone();
        cpuid::filter_cpuid(&mut cpuid, index, vcpu_count);
        self.fd.set_cpuid2(&cpuid).map_err(kvm("KVM_SET_CPUID2"))?;
        let msrs = msr::boot_msrs().map_err(|_| VcpuError::Msrs { index })?;
        self.fd.set_msrs(&msrs).map_err(kvm("KVM_SET_MSRS"))?;
        self.fd
            .set_regs(&regs::boot_regs(entry))
            .map_err(kvm("KVM_SET_REGS"))?;
        self.fd
            .set_fpu(&regs::boot_fpu())
            .map_err(kvm("KVM_SET_FPU"))?;
        let sregs = self.fd.get_sregs().map_err(kvm("KVM_GET_SREGS"))?;
        let sregs = regs::setup_long_mode(mem, sregs)
            .map_err(|source| VcpuError::Regs { index, source })?;
        self.fd.set_sregs(&sregs).map_err(kvm("KVM_SET_SREGS"))?;
        self.set_lint()?;
        Ok(())
    }

    /// Routes LINT0 as ExtINT and LINT1 as NMI, as a PC's firmware does.
    fn set_lint(&self) -> Result<(), VcpuError> {
        let index = self.index;
        let mut lapic = self.fd.get_lapic().map_err(|source| VcpuError::Kvm {
            index,
            what: "KVM_GET_LAPIC",
            source,
        })?;
        for (reg, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
            let bytes: &mut [u8] = bytes_of_regs(&mut lapic.regs[reg..reg + 4]);
            let v = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            let v = (v & !0x700) | (mode << 8);
            bytes.copy_from_slice(&v.to_le_bytes());
        }
        self.fd.set_lapic(&lapic).map_err(|source| VcpuError::Kvm {
            index,
            what: "KVM_SET_LAPIC",
            source,
        })
    }

    /// Starts the vCPU thread. It runs until the guest or a device reports
    /// an exit; every exit is dispatched to the port-I/O or MMIO bus.
    pub fn start(
        self,
        pio: Arc<Bus>,
        mmio: Arc<Bus>,
        exit: Arc<ExitNotifier>,
    ) -> Result<JoinHandle<()>, VcpuError> {
        let index = self.index;
        std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || self.run(&pio, &mmio, &exit))
            .map_err(|source| VcpuError::Spawn { index, source })
    }

    fn run(mut self, pio: &Bus, mmio: &Bus, exit: &ExitNotifier) {
        while exit.get().is_none() {
            match self.fd.run() {
                Ok(VcpuExit::IoIn(port, data)) => {
                    if !pio.read(u64::from(port), data) {
                        data.fill(0xff);
                    }
                }
                Ok(VcpuExit::IoOut(port, data)) => {
                    pio.write(u64::from(port), data);
                }
                Ok(VcpuExit::MmioRead(addr, data)) => {
                    if !mmio.read(addr, data) {
                        data.fill(0xff);
                    }
                }
                Ok(VcpuExit::MmioWrite(addr, data)) => {
                    mmio.write(addr, data);
                }
                Ok(VcpuExit::Hlt) => {
                    // With the in-kernel irqchip HLT is handled by KVM; an exit
                    // here means the vCPU can never wake up again.
                    tracing::info!("vcpu{}: halted for good", self.index);
                    exit.notify(GuestExit::Shutdown);
                }
                Ok(VcpuExit::Shutdown) => {
                    tracing::info!("vcpu{}: shutdown (triple fault)", self.index);
                    exit.notify(GuestExit::Shutdown);
                }
                Ok(VcpuExit::SystemEvent(kind, _)) => {
                    let reason = match kind {
                        KVM_SYSTEM_EVENT_RESET => GuestExit::Reset,
                        KVM_SYSTEM_EVENT_SHUTDOWN => GuestExit::Poweroff,
                        _ => GuestExit::Shutdown,
                    };
                    exit.notify(reason);
                }
                Ok(VcpuExit::InternalError) => {
                    let regs = self.fd.get_regs().map(|r| r.rip).unwrap_or(0);
                    tracing::error!("vcpu{}: KVM internal error at rip {regs:#x}", self.index);
                    exit.notify(GuestExit::Crashed);
                }
                Ok(VcpuExit::FailEntry(reason, cpu)) => {
                    tracing::error!(
                        "vcpu{}: VM entry failed (reason {reason:#x}, cpu {cpu})",
                        self.index
                    );
                    exit.notify(GuestExit::Crashed);
                }
                Ok(other) => {
                    tracing::warn!("vcpu{}: unexpected exit {other:?}", self.index);
                }
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {}
                Err(e) => {
                    tracing::error!("vcpu{}: KVM_RUN failed: {e}", self.index);
                    exit.notify(GuestExit::Crashed);
                }
            }
        }
    }
}

/// The LAPIC register page is `[c_char; 1024]`; view a slice of it as bytes.
fn bytes_of_regs(regs: &mut [std::os::raw::c_char]) -> &mut [u8] {
    // SAFETY: c_char and u8 have the same size and alignment, and every bit
    // pattern is valid for both; the slice borrows `regs` exclusively.
    unsafe { std::slice::from_raw_parts_mut(regs.as_mut_ptr().cast::<u8>(), regs.len()) }
}
