//! "The moment" (ARCHITECTURE.md): everything but memory and disk that a
//! vm needs to continue elsewhere, as one plain serde value. Memory is the
//! frozen RAM (shared copy-on-write, or a memory file); disks are frozen
//! layers. `tine-snapshot` frames it with magic, version and CRC.

use serde::{Deserialize, Serialize};
use vm_memory::GuestAddress;

use crate::arch::x86_64::layout;
use crate::config::VmConfig;
use crate::devices::persist::DeviceStates;
use crate::state::MachineState;

/// A paused vm's CPU, VM-level and device state.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Moment {
    pub machine: MachineState,
    pub devices: DeviceStates,
    /// Guest RAM in MiB (the regions follow from it).
    pub mem_mib: u64,
    /// Which virtio devices sit in which slots.
    pub layout: DeviceLayout,
}

impl Moment {
    /// The guest RAM regions (start, size) of this vm.
    pub fn ram_regions(&self) -> Vec<(GuestAddress, usize)> {
        ram_regions(self.mem_mib)
    }
}

/// The guest RAM regions (start, size) of a vm with `mem_mib` MiB.
pub fn ram_regions(mem_mib: u64) -> Vec<(GuestAddress, usize)> {
    layout::ram_regions(mem_mib << 20)
        .into_iter()
        .map(|(start, size)| (GuestAddress(start), size as usize))
        .collect()
}

/// The guest-visible device layout: virtio slots are disks, then nets,
/// then the vsock, so counts say everything.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceLayout {
    pub disks: usize,
    pub nets: usize,
    pub vsock: bool,
}

impl DeviceLayout {
    /// The layout `config` builds.
    pub fn of(config: &VmConfig) -> Self {
        Self {
            disks: config.disks.len(),
            nets: config.nets.len(),
            vsock: config.vsock.is_some(),
        }
    }

    /// Number of virtio slots.
    pub fn count(&self) -> usize {
        self.disks + self.nets + usize::from(self.vsock)
    }

    /// Device kinds in slot order (for the compatibility manifest).
    pub fn kinds(&self) -> Vec<String> {
        let mut k = vec!["virtio-blk".to_string(); self.disks];
        k.extend(std::iter::repeat_n("virtio-net".to_string(), self.nets));
        if self.vsock {
            k.push("virtio-vsock".into());
        }
        k
    }
}

impl std::fmt::Display for DeviceLayout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} disk(s), {} net(s), {}",
            self.disks,
            self.nets,
            if self.vsock { "vsock" } else { "no vsock" }
        )
    }
}
