//! Legacy PC devices: 8250 serial, i8042 reset, ACPI power management,
//! and the VMGenID generation id (an ACPI device, no I/O registers).

pub mod acpi_pm;
pub mod i8042;
pub mod serial;
pub mod vmgenid;

pub use i8042::I8042;
pub use serial::{ConsoleOutput, SerialDevice};
