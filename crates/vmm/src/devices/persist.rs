//! The devices' side of [`crate::persist::Persist`]: the legacy devices,
//! the virtio-mmio transport and its queues (each virtio device's own
//! state is next to it), and the saved state of a vm's whole device set.
//!
//! Device state is taken with the device thread parked ([`super::park`])
//! and every vCPU paused, so no handler is half way through a request. The
//! host side of a device (disk file, tap, socket, console log) is not state:
//! a restore opens its own, which is how each child of a fork gets its own.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState};
use vmm_sys_util::eventfd::EventFd;

pub use crate::persist::{NoState, Persist};

use super::legacy::acpi_pm::AcpiPmDevice;
use super::legacy::serial::{SerialError, SerialState};
use super::legacy::vmgenid::VmGenId;
use super::legacy::{ConsoleOutput, SerialDevice, I8042};
use super::virtio::mmio::{MmioError, MmioState, MmioTransport, QueueRegs};
use super::virtio::VirtioDevice;
use crate::exit::ExitNotifier;
use crate::memory::GuestMemoryMmap;

impl Persist for SerialDevice {
    type State = SerialState;
    /// The irqfd and the console output.
    type ConstructorArgs = (EventFd, ConsoleOutput);
    type Error = SerialError;

    fn save(&self) -> Result<SerialState, SerialError> {
        Ok(self.state())
    }

    fn restore(
        (irq, out): Self::ConstructorArgs,
        state: &SerialState,
    ) -> Result<Self, SerialError> {
        SerialDevice::from_state(state, irq, out)
    }
}

/// The i8042 only turns the guest's reset command into an exit.
impl Persist for I8042 {
    type State = NoState;
    type ConstructorArgs = Arc<ExitNotifier>;
    type Error = std::convert::Infallible;

    fn save(&self) -> Result<NoState, Self::Error> {
        Ok(NoState {})
    }

    fn restore(exit: Arc<ExitNotifier>, _: &NoState) -> Result<Self, Self::Error> {
        Ok(I8042::new(exit))
    }
}

/// The ACPI PM device only turns the guest's S5 request into an exit.
impl Persist for AcpiPmDevice {
    type State = NoState;
    type ConstructorArgs = Arc<ExitNotifier>;
    type Error = std::convert::Infallible;

    fn save(&self) -> Result<NoState, Self::Error> {
        Ok(NoState {})
    }

    fn restore(exit: Arc<ExitNotifier>, _: &NoState) -> Result<Self, Self::Error> {
        Ok(AcpiPmDevice::new(exit))
    }
}

/// The generation id itself lives in guest memory, which moves with the
/// moment; the device is only its interrupt.
impl Persist for VmGenId {
    type State = NoState;
    /// An eventfd registered as the irqfd of the GSI, and the GSI.
    type ConstructorArgs = (EventFd, u32);
    type Error = std::convert::Infallible;

    fn save(&self) -> Result<NoState, Self::Error> {
        Ok(NoState {})
    }

    fn restore((irq, gsi): (EventFd, u32), _: &NoState) -> Result<Self, Self::Error> {
        Ok(VmGenId::from_irq(irq, gsi))
    }
}

/// A virtqueue's registers and ring positions.
impl Persist for Queue {
    type State = QueueRegs;
    type ConstructorArgs = ();
    type Error = String;

    fn save(&self) -> Result<QueueRegs, String> {
        Ok(QueueRegs::from(Queue::state(self)))
    }

    fn restore((): (), state: &QueueRegs) -> Result<Self, String> {
        Queue::try_from(QueueState::from(state)).map_err(|e| e.to_string())
    }
}

impl Persist for MmioTransport {
    /// The transport's registers and queues, and the typed state of the
    /// device behind it.
    type State = MmioState;
    type ConstructorArgs = (GuestMemoryMmap, Arc<Mutex<dyn VirtioDevice>>);
    type Error = MmioError;

    fn save(&self) -> Result<MmioState, MmioError> {
        Ok(self.state())
    }

    fn restore((mem, device): Self::ConstructorArgs, state: &MmioState) -> Result<Self, MmioError> {
        let mut t = MmioTransport::new(mem, device)?;
        t.restore_state(state)?;
        Ok(t)
    }
}

/// The state of every device of a vm. The i8042, the ACPI PM device and
/// the generation id device hold nothing ([`NoState`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceStates {
    pub serial: SerialState,
    /// One per virtio-mmio slot, in slot order.
    pub virtio: Vec<MmioState>,
}
