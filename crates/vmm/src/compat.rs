//! Fills the compatibility manifest (`snapshot::compat`): what this host's
//! KVM offers ([`host_compat`]) and what a saved machine needs
//! ([`snapshot_compat`]).

use std::path::Path;

use kvm_bindings::{kvm_cpuid_entry2, CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::{Cap, Kvm};
use snapshot::compat::{merge_features, Compat, CpuidEntry, HostCompat, KvmCap};

use crate::state::MachineState;

/// The KVM capabilities tine's restore path uses, with their KVM names.
/// Restore needs them all except KVMCLOCK_CTRL (its failure is ignored)
/// and the conditional ones (see [`needed_caps`]).
const CAPS: &[(&str, Cap)] = &[
    ("KVM_CAP_USER_MEMORY", Cap::UserMemory),
    ("KVM_CAP_SET_TSS_ADDR", Cap::SetTssAddr),
    ("KVM_CAP_IRQCHIP", Cap::Irqchip),
    ("KVM_CAP_PIT2", Cap::Pit2),
    ("KVM_CAP_ADJUST_CLOCK", Cap::AdjustClock),
    ("KVM_CAP_VCPU_EVENTS", Cap::VcpuEvents),
    ("KVM_CAP_DEBUGREGS", Cap::Debugregs),
    ("KVM_CAP_IMMEDIATE_EXIT", Cap::ImmediateExit),
    ("KVM_CAP_XSAVE", Cap::Xsave),
    ("KVM_CAP_XSAVE2", Cap::Xsave2),
    ("KVM_CAP_XCRS", Cap::Xcrs),
    ("KVM_CAP_TSC_CONTROL", Cap::TscControl),
    ("KVM_CAP_KVMCLOCK_CTRL", Cap::KvmclockCtrl),
];

// The check looks the TSC scaling capability up by this number.
const _: () = assert!(snapshot::compat::CAP_TSC_CONTROL == Cap::TscControl as u32);

/// Errors while reading this host's KVM.
#[derive(Debug, thiserror::Error)]
pub enum CompatCollectError {
    #[error(transparent)]
    Open(#[from] crate::vm::VmError),
    #[error("{0} failed")]
    Kvm(&'static str, #[source] kvm_ioctls::Error),
}

/// What this host's KVM (at `kvm_path`) and this tine offer. Creates a
/// throwaway VM and vCPU to learn the CPUID a guest here gets.
pub fn host_compat(kvm_path: &Path) -> Result<HostCompat, CompatCollectError> {
    let kvm = crate::vm::open_kvm(kvm_path)?;
    let supported = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| CompatCollectError::Kvm("KVM_GET_SUPPORTED_CPUID", e))?;
    let mut cpuid: Vec<CpuidEntry> = supported.as_slice().iter().map(entry).collect();
    let probe = probe_vcpu(&kvm, &supported)?;
    merge_features(&mut cpuid, &probe.cpuid);
    clear_apic_ids(&mut cpuid);
    let msrs = kvm
        .get_msr_index_list()
        .map_err(|e| CompatCollectError::Kvm("KVM_GET_MSR_INDEX_LIST", e))?
        .as_slice()
        .to_vec();
    let caps = CAPS
        .iter()
        .filter(|(_, c)| kvm.check_extension(*c))
        .map(|&(name, c)| cap(name, c))
        .collect();
    Ok(HostCompat {
        tine_version: env!("CARGO_PKG_VERSION").to_string(),
        format_version: snapshot::FORMAT_VERSION,
        kernel: kernel_release(),
        cpu_vendor: vendor(&cpuid).unwrap_or_default(),
        cpuid,
        msrs,
        caps,
        tsc_khz: probe.tsc_khz,
    })
}

/// Zeroes the APIC ID fields (leaf 1 EBX[31:24], the x2APIC ID in EDX of
/// leaves 0xB and 0x1F). PVM passes the physical CPU's CPUID through, so
/// they name whichever core the caller ran on and two reads of one host
/// would differ; tine sets them per vCPU anyway, so they say nothing about
/// what the host offers.
fn clear_apic_ids(cpuid: &mut [CpuidEntry]) {
    for e in cpuid {
        match e.function {
            1 => e.ebx &= 0x00ff_ffff,
            0xb | 0x1f => e.edx = 0,
            _ => {}
        }
    }
}

/// What a new vCPU here reports.
struct Probe {
    /// Read back after KVM_SET_CPUID2 of the supported list.
    cpuid: Vec<CpuidEntry>,
    tsc_khz: Option<u32>,
}

/// Creates a throwaway VM and vCPU. The CPUID it reads back after
/// KVM_SET_CPUID2 of the supported list is what a guest here really gets. Upstream KVM hands back what it
/// was given; PVM (kvm_pvm) passes the hardware's features through and
/// lists far fewer in KVM_GET_SUPPORTED_CPUID (on the test host, leaf 1
/// ECX 0x81202000 supported, 0xf7f83203 read back), so the supported list
/// alone would refuse a snapshot on the host that took it.
fn probe_vcpu(kvm: &Kvm, supported: &CpuId) -> Result<Probe, CompatCollectError> {
    let vm = kvm
        .create_vm()
        .map_err(|e| CompatCollectError::Kvm("KVM_CREATE_VM", e))?;
    let vcpu = vm
        .create_vcpu(0)
        .map_err(|e| CompatCollectError::Kvm("KVM_CREATE_VCPU", e))?;
    vcpu.set_cpuid2(supported)
        .map_err(|e| CompatCollectError::Kvm("KVM_SET_CPUID2", e))?;
    let back = vcpu
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| CompatCollectError::Kvm("KVM_GET_CPUID2", e))?;
    Ok(Probe {
        cpuid: back.as_slice().iter().map(entry).collect(),
        tsc_khz: vcpu.get_tsc_khz().ok(),
    })
}

/// The manifest of `machine`, saved on the host described by `host`.
///
/// CPUID is the boot vCPU's (tine gives every vCPU the same features).
/// MSRs are the saved ones `host`'s KVM lists: those tine saves beyond
/// that list (MTRRs) KVM emulates on every host, so they constrain nothing.
pub fn snapshot_compat(
    machine: &MachineState,
    devices: Vec<String>,
    mem_mib: u64,
    host: &HostCompat,
) -> Compat {
    let cpuid: Vec<CpuidEntry> = machine
        .vcpus
        .first()
        .map(|v| v.cpuid.iter().map(entry).collect())
        .unwrap_or_default();
    let mut msrs: Vec<u32> = Vec::new();
    for index in machine
        .vcpus
        .iter()
        .flat_map(|v| v.msrs.iter().map(|m| m.index))
    {
        if host.msrs.contains(&index) && !msrs.contains(&index) {
            msrs.push(index);
        }
    }
    Compat {
        tine_version: host.tine_version.clone(),
        format_version: snapshot::FORMAT_VERSION,
        host_kernel: host.kernel.clone(),
        cpu_vendor: vendor(&cpuid).unwrap_or_else(|| host.cpu_vendor.clone()),
        cpuid,
        msrs,
        caps: needed_caps(machine),
        tsc_khz: machine.vcpus.first().and_then(|v| v.tsc_khz),
        devices,
        mem_mib,
        vcpus: u8::try_from(machine.vcpus.len()).unwrap_or(u8::MAX),
        cpu_template: None,
    }
}

/// The capabilities restoring `machine` uses: the fixed set, plus XSAVE,
/// XSAVE2 (an area beyond 4 KiB) and XCRS when the state holds them.
/// TSC_CONTROL is left out: restore only needs it when the TSC rates
/// differ, which the check compares itself (`tsc_khz`).
fn needed_caps(machine: &MachineState) -> Vec<KvmCap> {
    let vcpus = &machine.vcpus;
    let xsave = vcpus.iter().any(|v| v.xsave.is_some());
    let xsave2 = vcpus
        .iter()
        .any(|v| v.xsave.as_ref().is_some_and(|x| !x.extra.is_empty()));
    let xcrs = vcpus.iter().any(|v| v.xcrs.is_some());
    CAPS.iter()
        .filter(|(_, c)| match c {
            Cap::Xsave => xsave,
            Cap::Xsave2 => xsave2,
            Cap::Xcrs => xcrs,
            Cap::TscControl | Cap::KvmclockCtrl => false,
            _ => true,
        })
        .map(|&(name, c)| cap(name, c))
        .collect()
}

fn cap(name: &str, c: Cap) -> KvmCap {
    KvmCap {
        name: name.to_string(),
        number: c as u32,
    }
}

pub(crate) fn entry(e: &kvm_cpuid_entry2) -> CpuidEntry {
    CpuidEntry {
        function: e.function,
        index: e.index,
        flags: e.flags,
        eax: e.eax,
        ebx: e.ebx,
        ecx: e.ecx,
        edx: e.edx,
    }
}

/// The vendor string of CPUID leaf 0 (EBX, EDX, ECX).
fn vendor(cpuid: &[CpuidEntry]) -> Option<String> {
    let leaf0 = cpuid.iter().find(|e| e.function == 0)?;
    let bytes: Vec<u8> = [leaf0.ebx, leaf0.edx, leaf0.ecx]
        .iter()
        .flat_map(|r| r.to_le_bytes())
        .collect();
    Some(
        String::from_utf8_lossy(&bytes)
            .trim_end_matches('\0')
            .to_string(),
    )
}

/// `uname -r` (informational: recorded, never compared).
fn kernel_release() -> String {
    // uname(2), not /proc: a jailed VMM has no /proc.
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown".to_string())
}
