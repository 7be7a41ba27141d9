//! x86_64: memory layout, boot protocol, vCPU boot registers, CPUID, MSRs, ACPI.

pub mod acpi;
pub mod boot;
pub mod cpuid;
pub mod layout;
pub mod msr;
pub mod regs;
