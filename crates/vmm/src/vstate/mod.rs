//! Running, pausing and rebuilding a vm's CPUs: the control of a running vm
//! ([`VmmHandle`]) and the restore of a [`MachineState`] into a new VM.

pub mod control;

use std::path::Path;

pub use control::{ControlError, RunningVcpus, VmmHandle};

use crate::memory::GuestMemoryMmap;
pub use crate::state::MachineState;
use crate::vcpu::{Vcpu, VcpuError};
use crate::vm::{Vm, VmError};

/// Errors while rebuilding a vm from a [`MachineState`].
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// The saved state has another number of vCPUs than the VM.
    #[error("The saved state has {saved} vCPUs, the VM {prepared}")]
    VcpuCount { saved: usize, prepared: usize },
    /// The state lists vCPUs out of order or with gaps.
    #[error("Saved vCPU {found} is at position {position}")]
    VcpuOrder { position: usize, found: u8 },
}

/// Creates a new VM on `mem` and restores `state` into it: memslots, then
/// the irqchip and PIT (memslots first: KVM is several ms slower the other
/// way) and the vCPUs ([`prepare_machine`]), then the VM-level state and
/// each vCPU's ([`load_machine`]). The vCPUs are returned ready to start;
/// nothing runs yet.
pub fn restore_machine(
    kvm_path: &Path,
    mem: &GuestMemoryMmap,
    state: &MachineState,
) -> Result<(Vm, Vec<Vcpu>), RestoreError> {
    let count = u8::try_from(state.vcpus.len()).map_err(|_| RestoreError::VcpuCount {
        saved: state.vcpus.len(),
        prepared: usize::from(u8::MAX),
    })?;
    let (vm, vcpus) = prepare_machine(kvm_path, mem, count)?;
    load_machine(&vm, &vcpus, state)?;
    Ok((vm, vcpus))
}

/// The part of a restore that needs no saved state: a VM with `mem` as
/// its memslots, the irqchip and PIT, and `vcpus` vCPUs. The fork path
/// does this before the pause, in the process that will continue the vm.
pub fn prepare_machine(
    kvm_path: &Path,
    mem: &GuestMemoryMmap,
    vcpus: u8,
) -> Result<(Vm, Vec<Vcpu>), RestoreError> {
    let t = std::time::Instant::now();
    let tr = |w: &str| crate::trace::trace(t, w);
    let vm = Vm::new(kvm_path)?;
    tr("vm");
    vm.register_memory(mem)?;
    tr("memslots");
    vm.setup_irqchip()?;
    tr("irqchip");
    let mut out = Vec::with_capacity(usize::from(vcpus));
    for index in 0..vcpus {
        out.push(Vcpu::new(vm.fd(), index)?);
    }
    tr("vcpus created");
    Ok((vm, out))
}

/// Loads `state` into a prepared VM and its vCPUs.
pub fn load_machine(vm: &Vm, vcpus: &[Vcpu], state: &MachineState) -> Result<(), RestoreError> {
    if vcpus.len() != state.vcpus.len() {
        return Err(RestoreError::VcpuCount {
            saved: state.vcpus.len(),
            prepared: vcpus.len(),
        });
    }
    let t = std::time::Instant::now();
    vm.restore_state(&state.vm)?;
    for (position, (vcpu, saved)) in vcpus.iter().zip(&state.vcpus).enumerate() {
        if usize::from(saved.index) != position {
            return Err(RestoreError::VcpuOrder {
                position,
                found: saved.index,
            });
        }
        vcpu.restore_state(saved)?;
    }
    crate::trace::trace(t, "state loaded");
    Ok(())
}
