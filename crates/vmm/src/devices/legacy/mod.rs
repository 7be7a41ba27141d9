//! Legacy PC devices: 8250 serial, i8042 reset, ACPI power management.
