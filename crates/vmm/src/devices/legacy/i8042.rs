//! The i8042 keyboard controller, kept for one job: its CPU-reset command
//! (`reboot=k`) ends the vm.

use std::sync::Arc;

use vm_superio::{I8042Device, Trigger};

use crate::devices::BusDevice;
use crate::exit::{ExitNotifier, GuestExit};

/// I/O port base (data at 0x60, command/status at 0x64).
pub const I8042_PORT: u64 = 0x60;
/// Ports 0x60..=0x64.
pub const I8042_LEN: u64 = 5;

/// Reports a guest reset to the VMM.
#[derive(Debug)]
pub struct ResetTrigger(Arc<ExitNotifier>);

impl Trigger for ResetTrigger {
    type E = std::convert::Infallible;
    fn trigger(&self) -> Result<(), Self::E> {
        self.0.notify(GuestExit::Reset);
        Ok(())
    }
}

/// The keyboard controller as a bus device.
pub struct I8042 {
    dev: I8042Device<ResetTrigger>,
}

impl I8042 {
    /// A controller whose reset command ends the vm through `exit`.
    pub fn new(exit: Arc<ExitNotifier>) -> Self {
        Self {
            dev: I8042Device::new(ResetTrigger(exit)),
        }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if data.len() == 1 {
            data[0] = self.dev.read(offset as u8);
        } else {
            data.fill(0xff);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if data.len() == 1 {
            let _ = self.dev.write(offset as u8, data[0]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_i8042_reset_command_reports_reset() {
        let exit = Arc::new(ExitNotifier::new());
        let mut dev = I8042::new(exit.clone());
        dev.write(4, &[0x00]);
        assert_eq!(exit.get(), None);
        dev.write(4, &[0xfe]);
        assert_eq!(exit.get(), Some(GuestExit::Reset));
    }
}
