//! Guest physical memory layout, the same map a PC (and Firecracker) uses.
//!
//! ```text
//! 0x0000_0500  GDT                 0x0000_7000  zero page (boot_params)
//! 0x0000_8ff0  boot stack top      0x0000_9000  PML4, PDPT, PD (identity map, 1 GiB)
//! 0x0002_0000  kernel command line 0x0009_fc00  end of low RAM (EBDA above)
//! 0x000e_0000  ACPI tables (RSDP)  0x0010_0000  kernel load address (1 MiB)
//! 0xc000_0000  32-bit MMIO gap: virtio-mmio slots, IOAPIC, LAPIC, up to 4 GiB
//! 0x1_0000_0000 RAM above the gap, when the guest has more than 3 GiB
//! ```

/// GDT used at boot.
pub const BOOT_GDT_START: u64 = 0x500;
/// Linux zero page.
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack pointer.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Page-map level 4 table.
pub const PML4_START: u64 = 0x9000;
/// Page-directory-pointer table.
pub const PDPTE_START: u64 = 0xa000;
/// Page directory (512 × 2 MiB pages = 1 GiB identity map).
pub const PDE_START: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// Longest command line we pass (the kernel accepts 2048 on x86 by default).
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// End of conventional low memory; the EBDA and BIOS area follow.
pub const EBDA_START: u64 = 0x9fc00;
/// Where the ACPI tables live (RSDP first), inside the BIOS read-only area.
pub const ACPI_START: u64 = 0xe0000;
/// Start of high memory, where kernels load.
pub const HIMEM_START: u64 = 0x10_0000;
/// Start of the 32-bit MMIO gap.
pub const MMIO_GAP_START: u64 = 0xc000_0000;
/// End of the 32-bit MMIO gap.
pub const MMIO_GAP_END: u64 = 0x1_0000_0000;
/// First virtio-mmio slot; each device takes 4 KiB.
pub const VIRTIO_MMIO_START: u64 = 0xd000_0000;
/// Size of one virtio-mmio slot.
pub const VIRTIO_MMIO_SLOT: u64 = 0x1000;
/// First GSI given to virtio-mmio devices (0–4 are the PC's legacy lines).
pub const VIRTIO_GSI_START: u32 = 5;
/// Legacy IRQ of COM1.
pub const SERIAL_GSI: u32 = 4;
/// IOAPIC base address.
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// LAPIC base address.
pub const LAPIC_START: u64 = 0xfee0_0000;
/// KVM's TSS needs three pages inside the 32-bit space, outside RAM.
pub const KVM_TSS_ADDRESS: usize = 0xfffb_d000;

/// The RAM regions for a guest of `mem_size` bytes: low RAM below the MMIO
/// gap, and the remainder above 4 GiB.
pub fn ram_regions(mem_size: u64) -> Vec<(u64, u64)> {
    if mem_size <= MMIO_GAP_START {
        vec![(0, mem_size)]
    } else {
        vec![
            (0, MMIO_GAP_START),
            (MMIO_GAP_END, mem_size - MMIO_GAP_START),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_ram_regions_split_around_gap() {
        assert_eq!(ram_regions(1 << 30), vec![(0, 1 << 30)]);
        let r = ram_regions(4 << 30);
        assert_eq!(
            r,
            vec![
                (0, MMIO_GAP_START),
                (MMIO_GAP_END, (4 << 30) - MMIO_GAP_START)
            ]
        );
        assert_eq!(r.iter().map(|r| r.1).sum::<u64>(), 4 << 30);
    }
}
