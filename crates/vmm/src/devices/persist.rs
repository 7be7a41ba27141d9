//! Saving and restoring devices: one trait for every device with state, and
//! the saved state of a vm's whole device set.
//!
//! Device state is taken with the device thread parked ([`super::park`])
//! and every vCPU paused, so no handler is half way through a request. The
//! host side of a device (disk file, tap, socket, console log) is not state:
//! a restore opens its own, which is how each child of a fork gets its own.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::EventFd;

use super::legacy::serial::{SerialError, SerialState};
use super::legacy::{ConsoleOutput, SerialDevice};
use super::virtio::mmio::{MmioError, MmioState, MmioTransport};
use super::virtio::VirtioDevice;
use crate::memory::GuestMemoryMmap;

/// A device whose guest-visible state can be saved and rebuilt (the
/// shape of Firecracker's `Persist`).
pub trait Persist: Sized {
    /// Plain serde data.
    type State;
    /// What a restore needs besides the state (the host side).
    type Args;
    type Error;
    /// The device's state; call while it is quiescent.
    fn save(&self) -> Self::State;
    /// A device in the saved state, on the host side given in `args`.
    fn restore(args: Self::Args, state: &Self::State) -> Result<Self, Self::Error>;
}

impl Persist for SerialDevice {
    type State = SerialState;
    /// The irqfd and the console output.
    type Args = (EventFd, ConsoleOutput);
    type Error = SerialError;

    fn save(&self) -> SerialState {
        self.state()
    }

    fn restore((irq, out): Self::Args, state: &SerialState) -> Result<Self, SerialError> {
        SerialDevice::from_state(state, irq, out)
    }
}

impl Persist for MmioTransport {
    /// The transport's registers and queues; the device behind it keeps
    /// no other guest-visible state (its features are in the transport).
    type State = MmioState;
    type Args = (GuestMemoryMmap, Arc<Mutex<dyn VirtioDevice>>);
    type Error = MmioError;

    fn save(&self) -> MmioState {
        self.state()
    }

    fn restore((mem, device): Self::Args, state: &MmioState) -> Result<Self, MmioError> {
        let mut t = MmioTransport::new(mem, device)?;
        t.restore_state(state)?;
        Ok(t)
    }
}

/// The state of every device of a vm. The i8042 and the ACPI PM device
/// only trigger exits and hold nothing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStates {
    pub serial: SerialState,
    /// One per virtio-mmio slot, in slot order.
    pub virtio: Vec<MmioState>,
}
