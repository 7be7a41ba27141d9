//! ACPI power management for a hardware-reduced ACPI platform: the FADT's
//! sleep control/status registers and reset register, all in port I/O.
//!
//! Linux powers off by writing `SLP_TYP << 2 | SLP_EN` (the `SLP_TYP` from the
//! DSDT's `\_S5_` package) to the sleep control register, and resets by
//! writing the FADT's reset value to the reset register. The FADT and DSDT
//! written by `arch::x86_64::acpi` use the constants below, so the two agree.

use std::sync::Arc;

use crate::devices::BusDevice;
use crate::exit::{ExitNotifier, GuestExit};

/// First I/O port of the device.
pub const ACPI_PM_PORT: u16 = 0x600;
/// Number of I/O ports the device claims.
pub const ACPI_PM_LEN: u64 = 8;
/// Offset of the 8-bit sleep control register (FADT `SLEEP_CONTROL_REG`).
pub const SLEEP_CONTROL_OFFSET: u16 = 0;
/// Offset of the 8-bit sleep status register (FADT `SLEEP_STATUS_REG`).
pub const SLEEP_STATUS_OFFSET: u16 = 1;
/// Offset of the 8-bit reset register (FADT `RESET_REG`).
pub const RESET_OFFSET: u16 = 2;
/// Value the guest writes to the reset register to reset (FADT `RESET_VALUE`).
pub const RESET_VALUE: u8 = 0x01;
/// `SLP_TYP` for S5 (soft off), as published in the DSDT's `\_S5_` package.
pub const S5_SLEEP_TYPE: u8 = 5;
/// `SLP_EN` bit of the sleep control register.
pub const SLP_EN: u8 = 1 << 5;
const SLP_TYP_SHIFT: u8 = 2;
const SLP_TYP_MASK: u8 = 0x7;

/// The ACPI power-management registers; ends the vm on poweroff and reset.
pub struct AcpiPmDevice {
    exit: Arc<ExitNotifier>,
}

impl AcpiPmDevice {
    /// A device reporting poweroff and reset to `exit`.
    pub fn new(exit: Arc<ExitNotifier>) -> Self {
        Self { exit }
    }

    fn write_sleep_control(&self, value: u8) {
        let sleep_type = (value >> SLP_TYP_SHIFT) & SLP_TYP_MASK;
        if value & SLP_EN == 0 {
            return;
        }
        if sleep_type == S5_SLEEP_TYPE {
            self.exit.notify(GuestExit::Poweroff);
        } else {
            // Only S5 is published in the DSDT; other states are not supported.
            tracing::warn!(
                sleep_type,
                "guest asked for an unsupported ACPI sleep state"
            );
        }
    }
}

impl BusDevice for AcpiPmDevice {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // Sleep status (WAK_STS clear) and the write-only registers read as 0.
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        // The registers are 8 bits wide; a wider write only counts by its first byte.
        let Some(&value) = data.first() else {
            return;
        };
        match u16::try_from(offset) {
            Ok(SLEEP_CONTROL_OFFSET) => self.write_sleep_control(value),
            Ok(RESET_OFFSET) if value == RESET_VALUE => self.exit.notify(GuestExit::Reset),
            // Writes to the sleep status register clear status bits; nothing is latched.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device() -> (AcpiPmDevice, Arc<ExitNotifier>) {
        let exit = Arc::new(ExitNotifier::new());
        (AcpiPmDevice::new(exit.clone()), exit)
    }

    #[test]
    fn test_acpi_pm_s5_write_powers_off() {
        let (mut dev, exit) = device();
        dev.write(
            u64::from(SLEEP_CONTROL_OFFSET),
            &[(S5_SLEEP_TYPE << 2) | SLP_EN],
        );
        assert_eq!(exit.get(), Some(GuestExit::Poweroff));
    }

    #[test]
    fn test_acpi_pm_reset_value_resets() {
        let (mut dev, exit) = device();
        dev.write(u64::from(RESET_OFFSET), &[RESET_VALUE]);
        assert_eq!(exit.get(), Some(GuestExit::Reset));
    }

    #[test]
    fn test_acpi_pm_other_writes_ignored() {
        let (mut dev, exit) = device();
        // S5 type without SLP_EN, another sleep type, wrong reset value,
        // the status register, offsets past the registers, empty writes.
        dev.write(u64::from(SLEEP_CONTROL_OFFSET), &[S5_SLEEP_TYPE << 2]);
        dev.write(u64::from(SLEEP_CONTROL_OFFSET), &[(3 << 2) | SLP_EN]);
        dev.write(u64::from(RESET_OFFSET), &[RESET_VALUE + 1]);
        dev.write(u64::from(SLEEP_STATUS_OFFSET), &[0xff]);
        dev.write(7, &[RESET_VALUE]);
        dev.write(u64::MAX, &[RESET_VALUE]);
        dev.write(u64::from(RESET_OFFSET), &[]);
        assert_eq!(exit.get(), None);
        let mut b = [0xffu8; 2];
        dev.read(u64::from(SLEEP_STATUS_OFFSET), &mut b);
        assert_eq!(b, [0, 0]);
    }

    #[test]
    fn test_acpi_pm_first_exit_wins() {
        let (mut dev, exit) = device();
        dev.write(u64::from(RESET_OFFSET), &[RESET_VALUE]);
        dev.write(
            u64::from(SLEEP_CONTROL_OFFSET),
            &[(S5_SLEEP_TYPE << 2) | SLP_EN],
        );
        assert_eq!(exit.get(), Some(GuestExit::Reset));
    }
}
