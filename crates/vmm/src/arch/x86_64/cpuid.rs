//! CPUID the guest sees: KVM's supported list, with per-vCPU topology fixed up.

use kvm_bindings::CpuId;

const LEAF_FEATURES: u32 = 0x1;
const LEAF_EXT_TOPOLOGY: u32 = 0xb;
const LEAF_EXT_TOPOLOGY_V2: u32 = 0x1f;
/// CPUID.1:ECX bit 31 tells the guest it runs on a hypervisor.
const ECX_HYPERVISOR: u32 = 1 << 31;

/// Adjusts `cpuid` (a copy of KVM_GET_SUPPORTED_CPUID) for vCPU `index` of `count`.
pub fn filter_cpuid(cpuid: &mut CpuId, index: u8, count: u8) {
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            LEAF_FEATURES => {
                // EBX[31:24] initial APIC id, EBX[23:16] logical processors per package.
                entry.ebx =
                    (entry.ebx & 0x0000_ffff) | (u32::from(index) << 24) | (u32::from(count) << 16);
                entry.ecx |= ECX_HYPERVISOR;
                // HTT: more than one logical processor per package.
                if count > 1 {
                    entry.edx |= 1 << 28;
                }
            }
            LEAF_EXT_TOPOLOGY | LEAF_EXT_TOPOLOGY_V2 => {
                // x2APIC id of this vCPU; one thread per core, all cores in one package.
                entry.edx = u32::from(index);
                match entry.index {
                    0 => {
                        entry.eax = 0;
                        entry.ebx = 1;
                        entry.ecx = 1 << 8; // level type: SMT
                    }
                    1 => {
                        entry.eax = 8u32.max(u32::from(count).next_power_of_two().trailing_zeros());
                        entry.ebx = u32::from(count);
                        entry.ecx = (2 << 8) | 1; // level type: core
                    }
                    n => {
                        entry.eax = 0;
                        entry.ebx = 0;
                        entry.ecx = n;
                    }
                }
            }
            _ => {}
        }
    }
}
