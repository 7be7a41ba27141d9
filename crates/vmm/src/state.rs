//! The CPU and VM-level part of "the moment" (ARCHITECTURE.md) as plain
//! serde data. The ioctl sequences that fill and apply these live next to
//! their owners ([`crate::vcpu::Vcpu`], [`crate::vm::Vm`]); framing, version
//! and CRC live in `tine-snapshot`. This module depends on nothing else in
//! the crate.

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_debugregs, kvm_fpu, kvm_irqchip, kvm_lapic_state,
    kvm_mp_state, kvm_msr_entry, kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs,
};

/// Everything needed to continue a vCPU elsewhere (the list Firecracker's
/// x86_64 `VcpuState` keeps). Restored by [`crate::vcpu::Vcpu::restore_state`]
/// in the order documented there.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VcpuState {
    /// The vCPU index (its APIC id).
    pub index: u8,
    /// CPUID as set on the vCPU (KVM_GET_CPUID2, empty tail entries dropped).
    pub cpuid: Vec<kvm_cpuid_entry2>,
    /// MSRs in restore order: everything KVM_GET_MSR_INDEX_LIST reports and
    /// this vCPU can read (TSC and kvmclock included), with
    /// IA32_TSC_DEADLINE last (KVM arms the deadline timer against the TSC,
    /// so the TSC must be restored first).
    pub msrs: Vec<kvm_msr_entry>,
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// KVM_GET_XSAVE2 (or KVM_GET_XSAVE); `None` when the host has no XSAVE.
    pub xsave: Option<XsaveState>,
    /// Only when `xsave` is `None`.
    pub fpu: Option<FpuState>,
    /// `None` when the host lacks KVM_CAP_XCRS.
    pub xcrs: Option<kvm_xcrs>,
    pub debugregs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    pub vcpu_events: kvm_vcpu_events,
    /// Guest TSC frequency, if KVM reports it.
    pub tsc_khz: Option<u32>,
}

/// The XSAVE area as KVM_GET_XSAVE2 returns it: the 4 KiB legacy region
/// and the dynamic tail (empty unless the host has larger features, AMX).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct XsaveState {
    /// 1024 words.
    pub region: Vec<u32>,
    pub extra: Vec<u32>,
}

/// `kvm_fpu` mirrored as plain data (kvm-bindings has no serde for it).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FpuState {
    pub fpr: [[u8; 16]; 8],
    pub fcw: u16,
    pub fsw: u16,
    pub ftwx: u8,
    pub last_opcode: u16,
    pub last_ip: u64,
    pub last_dp: u64,
    pub xmm: [[u8; 16]; 16],
    pub mxcsr: u32,
}

impl From<&kvm_fpu> for FpuState {
    fn from(f: &kvm_fpu) -> Self {
        Self {
            fpr: f.fpr,
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm,
            mxcsr: f.mxcsr,
        }
    }
}

impl From<&FpuState> for kvm_fpu {
    fn from(f: &FpuState) -> Self {
        kvm_fpu {
            fpr: f.fpr,
            fcw: f.fcw,
            fsw: f.fsw,
            ftwx: f.ftwx,
            last_opcode: f.last_opcode,
            last_ip: f.last_ip,
            last_dp: f.last_dp,
            xmm: f.xmm,
            mxcsr: f.mxcsr,
            ..Default::default()
        }
    }
}
/// The in-kernel interrupt controllers, PIT and kvmclock.
///
/// kvmclock: `clock` is the guest's kvmclock time in ns at the save.
/// Restore sets exactly that value with no flags, so guest time continues
/// from the moment of the save and the time spent saved does not exist for
/// the guest (the `reproducible` contract; the wake-up step steps the clock
/// for `secure`). `flags`, `realtime` and `host_tsc` are kept as KVM
/// reported them, for information only; restore ignores them.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VmState {
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
}

/// Everything KVM holds for a paused vm: every vCPU and the VM-level state.
/// Device state (serial, virtio) is saved by the devices themselves.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineState {
    /// One entry per vCPU, in index order.
    pub vcpus: Vec<VcpuState>,
    /// irqchip, PIT and kvmclock.
    pub vm: VmState,
}
