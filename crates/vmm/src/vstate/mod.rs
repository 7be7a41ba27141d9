//! Running, pausing and rebuilding a vm's CPUs: the control of a running vm
//! ([`VmmHandle`]) and the restore of a [`MachineState`] into a new VM.

pub mod control;

use std::path::Path;

pub use control::{ControlError, RunningVmm, VmmHandle};

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
    /// The state lists vCPUs out of order or with gaps.
    #[error("Saved vCPU {found} is at position {position}")]
    VcpuOrder { position: usize, found: u8 },
}

/// Creates a new VM on `mem` and restores `state` into it: memslots, then
/// the irqchip and PIT (memslots first: KVM is several ms slower the other
/// way), the VM-level state, then each vCPU. The vCPUs are returned ready
/// to start; nothing runs yet.
pub fn restore_machine(
    kvm_path: &Path,
    mem: &GuestMemoryMmap,
    state: &MachineState,
) -> Result<(Vm, Vec<Vcpu>), RestoreError> {
    let t = std::time::Instant::now();
    let tr = |w: &str| crate::fork::trace(t, w);
    let vm = Vm::new(kvm_path)?;
    tr("vm");
    vm.register_memory(mem)?;
    tr("memslots");
    vm.setup_irqchip()?;
    tr("irqchip");
    vm.restore_state(&state.vm)?;
    tr("vmstate");
    let mut vcpus = Vec::with_capacity(state.vcpus.len());
    for (position, saved) in state.vcpus.iter().enumerate() {
        if usize::from(saved.index) != position {
            return Err(RestoreError::VcpuOrder {
                position,
                found: saved.index,
            });
        }
        let vcpu = Vcpu::new(vm.fd(), saved.index)?;
        tr("vcpu created");
        vcpu.restore_state(saved)?;
        tr("vcpu restored");
        vcpus.push(vcpu);
    }
    Ok((vm, vcpus))
}
