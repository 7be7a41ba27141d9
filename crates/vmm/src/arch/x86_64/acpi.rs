//! ACPI tables for a hardware-reduced x86_64 microVM.
//!
//! The Debian cloud kernel finds CPUs and the IOAPIC only through the MADT
//! (no MP tables) and virtio-mmio devices only through DSDT devices with
//! `_HID "LNRO0005"` (no command-line devices). Tables written here:
//! RSDP (at [`RSDP_ADDR`], inside the BIOS search area), XSDT, FADT
//! (HW_REDUCED_ACPI, sleep and reset registers on the ACPI PM device), MADT
//! and DSDT (virtio-mmio devices, COM1, i8042, `\_S5_`, and the VMGenID
//! device with the Generic Event Device that announces a new id).

use acpi_tables::aml::{
    self, Arg, Device, EISAName, Equal, If, Interrupt, Memory32Fixed, Method, Name, Notify,
    Package, Path, ResourceTemplate, Scope, IO,
};
use acpi_tables::fadt::{FADTBuilder, Flags};
use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
use acpi_tables::madt::{EnabledStatus, IoApic, ProcessorLocalApic};
use acpi_tables::rsdp::Rsdp;
use acpi_tables::sdt::Sdt;
use acpi_tables::xsdt::XSDT;
use acpi_tables::Aml;
use vm_memory::{Bytes, GuestAddress, GuestMemoryError};

use crate::devices::legacy::acpi_pm::{
    ACPI_PM_PORT, RESET_OFFSET, RESET_VALUE, S5_SLEEP_TYPE, SLEEP_CONTROL_OFFSET,
    SLEEP_STATUS_OFFSET,
};
use crate::devices::legacy::vmgenid::VMGENID_ADDR;
use crate::memory::GuestMemoryMmap;

/// Guest-physical address of the RSDP; the other tables follow it.
pub const RSDP_ADDR: u64 = 0x000E_0000;
/// End (exclusive) of the area the tables may use: the VMGenID page follows.
pub const ACPI_AREA_END: u64 = VMGENID_ADDR;
/// Guest-physical address of the IOAPIC.
pub const IOAPIC_ADDR: u32 = 0xFEC0_0000;
/// Number of IOAPIC pins (KVM's in-kernel IOAPIC), i.e. the usable GSIs.
pub const IOAPIC_PINS: u32 = 24;
/// Guest-physical address of the local APICs.
pub const LAPIC_ADDR: u32 = 0xFEE0_0000;
/// GSI the MADT routes ISA IRQ 0 (the PIT) to, as on a PC. The VMM's KVM
/// GSI routing must deliver the PIT (GSI 0) to this IOAPIC pin.
pub const PIT_IOAPIC_PIN: u32 = 2;
/// ISA IRQ of COM1 (0x3f8) as published in the DSDT.
pub const COM1_IRQ: u32 = 4;
/// ISA IRQ of the i8042 keyboard port as published in the DSDT.
pub const I8042_IRQ: u32 = 1;
/// Most vCPUs the MADT describes (APIC IDs 0..=254; 255 is broadcast).
pub const MAX_VCPUS: u8 = 254;

const OEM_ID: [u8; 6] = *b"TINE  ";
const OEM_REVISION: u32 = 1;
const TABLE_ALIGN: u64 = 16;
/// MADT flag: the system also has dual 8259 PICs (Linux masks them).
const MADT_PCAT_COMPAT: u32 = 1;
const MADT_TYPE_INTERRUPT_SOURCE_OVERRIDE: u8 = 2;
/// FADT IA-PC boot architecture flags.
const IAPC_BOOT_8042: u16 = 1 << 1;
const IAPC_BOOT_VGA_NOT_PRESENT: u16 = 1 << 2;
const IAPC_BOOT_MSI_NOT_SUPPORTED: u16 = 1 << 3;
const IAPC_BOOT_PCIE_ASPM_CONTROLS: u16 = 1 << 4;
const IAPC_BOOT_CMOS_RTC_NOT_PRESENT: u16 = 1 << 5;

/// One virtio-mmio device to describe in the DSDT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VirtioMmioSlot {
    /// Guest-physical base of the device's MMIO window (below 4 GiB).
    pub base: u64,
    /// Length of the MMIO window.
    pub len: u64,
    /// IOAPIC pin (GSI) of the device's edge-triggered interrupt.
    pub gsi: u32,
}

/// The VMGenID device to describe in the DSDT.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmGenIdSlot {
    /// Guest-physical address of the 16-byte generation id (below 4 GiB,
    /// outside RAM and the tables).
    pub addr: u64,
    /// IOAPIC pin (GSI) of the Generic Event Device's edge-triggered
    /// interrupt, raised after a new id is written.
    pub gsi: u32,
}

/// Errors while writing ACPI tables.
#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    /// A virtio-mmio window is not a non-empty range below 4 GiB.
    #[error("virtio-mmio window {base:#x}+{len:#x} is not a non-empty range below 4 GiB")]
    MmioWindow { base: u64, len: u64 },
    /// A device GSI is past the IOAPIC, reserved for a legacy device, or used twice.
    #[error("device GSI {gsi} is out of range, reserved or used twice")]
    Gsi { gsi: u32 },
    /// The generation id is not inside the reserved page after the tables.
    #[error("VMGenID address {0:#x} is not in the reserved page at {VMGENID_ADDR:#x}")]
    VmGenIdAddr(u64),
    /// The vCPU count is zero or above what the MADT can describe.
    #[error("vCPU count {0} is not in 1..={MAX_VCPUS}")]
    VcpuCount(u8),
    /// The tables do not fit below 1 MiB.
    #[error("ACPI tables need {size:#x} bytes at {RSDP_ADDR:#x}, more than the area holds")]
    TooLarge { size: u64 },
    /// Guest memory does not cover the ACPI area.
    #[error("Writing ACPI table {table} to guest memory")]
    Write {
        table: &'static str,
        #[source]
        source: GuestMemoryError,
    },
}

/// Writes RSDP, XSDT, FADT, MADT and DSDT into `mem` and returns the RSDP's
/// address (also to be put into `boot_params.acpi_rsdp_addr`).
pub fn create_acpi_tables(
    mem: &GuestMemoryMmap,
    vcpus: u8,
    virtio: &[VirtioMmioSlot],
    vmgenid: Option<VmGenIdSlot>,
) -> Result<GuestAddress, AcpiError> {
    if vcpus == 0 || vcpus > MAX_VCPUS {
        return Err(AcpiError::VcpuCount(vcpus));
    }
    validate_slots(virtio, vmgenid)?;

    let dsdt = dsdt(virtio, vmgenid);
    let madt = madt(vcpus);

    let xsdt_addr = align(RSDP_ADDR + Rsdp::len() as u64);
    let xsdt_len = 36 + 2 * 8;
    let fadt_addr = align(xsdt_addr + xsdt_len);
    let madt_addr = align(fadt_addr + acpi_tables::fadt::FADT::len() as u64);
    let dsdt_addr = align(madt_addr + madt.len() as u64);
    let end = dsdt_addr + dsdt.len() as u64;
    if end > ACPI_AREA_END {
        return Err(AcpiError::TooLarge {
            size: end - RSDP_ADDR,
        });
    }

    let fadt = to_bytes(&fadt(dsdt_addr));
    let mut xsdt = XSDT::new(OEM_ID, *b"TINEXSDT", OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    let xsdt = to_bytes(&xsdt);
    debug_assert_eq!(xsdt.len() as u64, xsdt_len);
    let rsdp = to_bytes(&Rsdp::new(OEM_ID, xsdt_addr));

    write(mem, "DSDT", dsdt_addr, &dsdt)?;
    write(mem, "MADT", madt_addr, &madt)?;
    write(mem, "FADT", fadt_addr, &fadt)?;
    write(mem, "XSDT", xsdt_addr, &xsdt)?;
    write(mem, "RSDP", RSDP_ADDR, &rsdp)?;
    Ok(GuestAddress(RSDP_ADDR))
}

fn validate_slots(
    virtio: &[VirtioMmioSlot],
    vmgenid: Option<VmGenIdSlot>,
) -> Result<(), AcpiError> {
    const RESERVED_GSIS: [u32; 4] = [0, I8042_IRQ, PIT_IOAPIC_PIN, COM1_IRQ];
    if let Some(g) = vmgenid {
        // The id must sit in the page the tables leave free (not RAM in
        // the e820 map), 8-byte aligned as the spec asks.
        let page = VMGENID_ADDR..=VMGENID_ADDR + 0x1000 - 16;
        if !page.contains(&g.addr) || g.addr % 8 != 0 {
            return Err(AcpiError::VmGenIdAddr(g.addr));
        }
        let taken = virtio.iter().any(|s| s.gsi == g.gsi);
        if g.gsi >= IOAPIC_PINS || RESERVED_GSIS.contains(&g.gsi) || taken {
            return Err(AcpiError::Gsi { gsi: g.gsi });
        }
    }
    for (i, slot) in virtio.iter().enumerate() {
        let fits = slot.len > 0
            && slot.len <= u64::from(u32::MAX)
            && slot
                .base
                .checked_add(slot.len)
                .is_some_and(|end| end <= 1 << 32);
        if !fits {
            return Err(AcpiError::MmioWindow {
                base: slot.base,
                len: slot.len,
            });
        }
        let duplicate = virtio[..i].iter().any(|s| s.gsi == slot.gsi);
        if slot.gsi >= IOAPIC_PINS || RESERVED_GSIS.contains(&slot.gsi) || duplicate {
            return Err(AcpiError::Gsi { gsi: slot.gsi });
        }
    }
    Ok(())
}

fn align(addr: u64) -> u64 {
    addr.next_multiple_of(TABLE_ALIGN)
}

fn to_bytes(aml: &dyn Aml) -> Vec<u8> {
    let mut v = Vec::new();
    aml.to_aml_bytes(&mut v);
    v
}

fn write(
    mem: &GuestMemoryMmap,
    table: &'static str,
    addr: u64,
    bytes: &[u8],
) -> Result<(), AcpiError> {
    mem.write_slice(bytes, GuestAddress(addr))
        .map_err(|source| AcpiError::Write { table, source })
}

fn io_reg(offset: u16) -> GAS {
    GAS::new(
        AddressSpace::SystemIo,
        8,
        0,
        AccessSize::ByteAccess,
        u64::from(ACPI_PM_PORT + offset),
    )
}

fn fadt(dsdt_addr: u64) -> acpi_tables::fadt::FADT {
    let mut fadt = FADTBuilder::new(OEM_ID, *b"TINEFACP", OEM_REVISION)
        .flag(Flags::HwReducedAcpi)
        .flag(Flags::ResetRegSup)
        .dsdt_64(dsdt_addr);
    fadt.iapc_boot_arch = (IAPC_BOOT_8042
        | IAPC_BOOT_VGA_NOT_PRESENT
        | IAPC_BOOT_MSI_NOT_SUPPORTED
        | IAPC_BOOT_PCIE_ASPM_CONTROLS
        | IAPC_BOOT_CMOS_RTC_NOT_PRESENT)
        .into();
    fadt.reset_reg = io_reg(RESET_OFFSET);
    fadt.reset_value = RESET_VALUE;
    fadt.sleep_control_reg = io_reg(SLEEP_CONTROL_OFFSET);
    fadt.sleep_status_reg = io_reg(SLEEP_STATUS_OFFSET);
    fadt.finalize()
}

fn madt(vcpus: u8) -> Vec<u8> {
    // Header (36 bytes), local APIC address, flags.
    let mut madt = Sdt::new(*b"APIC", 44, 5, OEM_ID, *b"TINEAPIC", OEM_REVISION);
    madt.write_bytes(36, &LAPIC_ADDR.to_le_bytes());
    madt.write_bytes(40, &MADT_PCAT_COMPAT.to_le_bytes());
    let mut body = Vec::new();
    for id in 0..vcpus {
        ProcessorLocalApic::new(id, id, EnabledStatus::Enabled).to_aml_bytes(&mut body);
    }
    IoApic::new(0, IOAPIC_ADDR, 0).to_aml_bytes(&mut body);
    // Interrupt source override: ISA IRQ 0 -> GSI 2, bus-conforming polarity/trigger.
    body.extend_from_slice(&[MADT_TYPE_INTERRUPT_SOURCE_OVERRIDE, 10, 0, 0]);
    body.extend_from_slice(&PIT_IOAPIC_PIN.to_le_bytes());
    body.extend_from_slice(&0u16.to_le_bytes());
    madt.append_slice(&body);
    madt.as_slice().to_vec()
}

/// Edge-triggered, active-high, exclusive interrupt consumed by the device.
fn edge_irq(gsi: u32) -> Interrupt {
    Interrupt::new(true, true, false, false, gsi)
}

/// The VMGenID device (`\_SB_.VGEN`) and the Generic Event Device whose
/// interrupt makes the guest re-read the id: its `_EVT` method gets the
/// GSI that fired and sends `Notify(VGEN, 0x80)`, which the Linux driver
/// takes as "read the id again and reseed".
fn vmgenid_devices(g: VmGenIdSlot, sb: &mut Vec<u8>) {
    // Validated by `validate_slots`: below 4 GiB.
    let (low, high) = (g.addr as u32, (g.addr >> 32) as u32);
    Device::new(
        "VGEN".into(),
        vec![
            &Name::new("_HID".into(), &"QEMUVGID"),
            &Name::new("_CID".into(), &"VM_GEN_COUNTER"),
            &Name::new("_DDN".into(), &"VM_Gen_Counter"),
            &Name::new("ADDR".into(), &Package::new(vec![&low, &high])),
        ],
    )
    .to_aml_bytes(sb);

    let irq = edge_irq(g.gsi);
    let vgen = Path::new("\\_SB_.VGEN");
    let notify = Notify::new(&vgen, &0x80u8);
    let is_ours = Equal::new(&Arg(0), &g.gsi);
    let on_ours = If::new(&is_ours, vec![&notify]);
    Device::new(
        "GED_".into(),
        vec![
            &Name::new("_HID".into(), &"ACPI0013"),
            &Name::new("_UID".into(), &aml::ZERO),
            &Name::new("_CRS".into(), &ResourceTemplate::new(vec![&irq])),
            &Method::new("_EVT".into(), 1, true, vec![&on_ours]),
        ],
    )
    .to_aml_bytes(sb);
}

fn dsdt(virtio: &[VirtioMmioSlot], vmgenid: Option<VmGenIdSlot>) -> Vec<u8> {
    let mut sb = Vec::new();
    for (i, slot) in virtio.iter().enumerate() {
        // Validated by `validate_slots`: both fit in 32 bits.
        let (base, len) = (slot.base as u32, slot.len as u32);
        let mem = Memory32Fixed::new(true, base, len);
        let irq = edge_irq(slot.gsi);
        let crs = ResourceTemplate::new(vec![&mem, &irq]);
        let name = format!("V{i:03X}");
        let uid = i as u32;
        Device::new(
            name.as_str().into(),
            vec![
                &Name::new("_HID".into(), &"LNRO0005"),
                &Name::new("_UID".into(), &uid),
                &Name::new("_CRS".into(), &crs),
            ],
        )
        .to_aml_bytes(&mut sb);
    }

    let com1_io = IO::new(0x3f8, 0x3f8, 1, 8);
    let com1_irq = edge_irq(COM1_IRQ);
    Device::new(
        "COM1".into(),
        vec![
            &Name::new("_HID".into(), &EISAName::new("PNP0501")),
            &Name::new("_UID".into(), &aml::ZERO),
            &Name::new(
                "_CRS".into(),
                &ResourceTemplate::new(vec![&com1_io, &com1_irq]),
            ),
        ],
    )
    .to_aml_bytes(&mut sb);

    let kbd_data = IO::new(0x60, 0x60, 1, 1);
    let kbd_cmd = IO::new(0x64, 0x64, 1, 1);
    let kbd_irq = edge_irq(I8042_IRQ);
    Device::new(
        "PS2_".into(),
        vec![
            &Name::new("_HID".into(), &EISAName::new("PNP0303")),
            &Name::new("_UID".into(), &aml::ZERO),
            &Name::new(
                "_CRS".into(),
                &ResourceTemplate::new(vec![&kbd_data, &kbd_cmd, &kbd_irq]),
            ),
        ],
    )
    .to_aml_bytes(&mut sb);

    if let Some(g) = vmgenid {
        vmgenid_devices(g, &mut sb);
    }

    // \_S5_: SLP_TYPa, SLP_TYPb, reserved, reserved.
    let s5 = Name::new(
        "_S5_".into(),
        &Package::new(vec![&S5_SLEEP_TYPE, &S5_SLEEP_TYPE, &aml::ZERO, &aml::ZERO]),
    );

    let mut body = to_bytes(&s5);
    body.extend(Scope::raw("\\_SB_".into(), sb));
    let mut dsdt = Sdt::new(*b"DSDT", 36, 2, OEM_ID, *b"TINEDSDT", OEM_REVISION);
    dsdt.append_slice(&body);
    dsdt.as_slice().to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::create_guest_memory;
    use std::path::Path;
    use std::process::Command;

    const SLOTS: [VirtioMmioSlot; 3] = [
        VirtioMmioSlot {
            base: 0xd000_0000,
            len: 0x1000,
            gsi: 5,
        },
        VirtioMmioSlot {
            base: 0xd000_1000,
            len: 0x1000,
            gsi: 6,
        },
        VirtioMmioSlot {
            base: 0xd000_2000,
            len: 0x1000,
            gsi: 7,
        },
    ];

    const VGEN: VmGenIdSlot = VmGenIdSlot {
        addr: VMGENID_ADDR,
        gsi: 8,
    };

    fn guest_mem() -> GuestMemoryMmap {
        create_guest_memory(&[(GuestAddress(0), 2 << 20)]).expect("guest memory")
    }

    fn read(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        mem.read_slice(&mut v, GuestAddress(addr)).expect("read");
        v
    }

    fn u32_at(b: &[u8], off: usize) -> u32 {
        u32::from_le_bytes(b[off..off + 4].try_into().expect("4 bytes"))
    }

    fn u64_at(b: &[u8], off: usize) -> u64 {
        u64::from_le_bytes(b[off..off + 8].try_into().expect("8 bytes"))
    }

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |a, &x| a.wrapping_add(x))
    }

    /// Reads a table at `addr`, checks its checksum, returns its bytes.
    fn table(mem: &GuestMemoryMmap, addr: u64) -> Vec<u8> {
        let len = u32_at(&read(mem, addr, 8), 4) as usize;
        let t = read(mem, addr, len);
        assert_eq!(
            sum(&t),
            0,
            "checksum of {}",
            String::from_utf8_lossy(&t[..4])
        );
        t
    }

    /// All tables reachable from the RSDP, by signature.
    fn tables(mem: &GuestMemoryMmap, rsdp: GuestAddress) -> Vec<(String, Vec<u8>)> {
        let r = read(mem, rsdp.0, 36);
        assert_eq!(&r[..8], b"RSD PTR ");
        assert_eq!(sum(&r[..20]), 0);
        assert_eq!(sum(&r), 0);
        let xsdt = table(mem, u64_at(&r, 24));
        assert_eq!(&xsdt[..4], b"XSDT");
        let mut out = vec![("XSDT".to_string(), xsdt.clone())];
        for entry in xsdt[36..].chunks(8) {
            let t = table(mem, u64_at(entry, 0));
            if &t[..4] == b"FACP" {
                let d = table(mem, u64_at(&t, 140));
                out.push(("DSDT".to_string(), d));
            }
            out.push((String::from_utf8_lossy(&t[..4]).into_owned(), t));
        }
        out
    }

    fn find<'a>(t: &'a [(String, Vec<u8>)], sig: &str) -> &'a [u8] {
        &t.iter().find(|(s, _)| s == sig).expect(sig).1
    }

    #[test]
    fn test_acpi_tables_parse_back() {
        let mem = guest_mem();
        let rsdp = create_acpi_tables(&mem, 2, &SLOTS, Some(VGEN)).expect("tables");
        assert_eq!(rsdp, GuestAddress(RSDP_ADDR));
        let t = tables(&mem, rsdp);

        let fadt = find(&t, "FACP");
        assert_ne!(u32_at(fadt, 112) & (Flags::HwReducedAcpi as u32), 0);
        // Reset register: GAS at 116 (I/O space, port), value at 128.
        assert_eq!(fadt[116], 1);
        assert_eq!(u64_at(fadt, 120), u64::from(ACPI_PM_PORT + RESET_OFFSET));
        assert_eq!(fadt[128], RESET_VALUE);
        // Sleep control and status registers at 244 and 256.
        assert_eq!(
            u64_at(fadt, 248),
            u64::from(ACPI_PM_PORT + SLEEP_CONTROL_OFFSET)
        );
        assert_eq!(
            u64_at(fadt, 260),
            u64::from(ACPI_PM_PORT + SLEEP_STATUS_OFFSET)
        );

        let madt = find(&t, "APIC");
        assert_eq!(u32_at(madt, 36), LAPIC_ADDR);
        assert_eq!(u32_at(madt, 40), MADT_PCAT_COMPAT);
        let mut kinds = Vec::new();
        let mut off = 44;
        while off < madt.len() {
            kinds.push(madt[off]);
            off += usize::from(madt[off + 1]);
        }
        assert_eq!(off, madt.len());
        assert_eq!(kinds, [0, 0, 1, 2]);

        let dsdt = find(&t, "DSDT");
        let hits = dsdt.windows(8).filter(|w| w == b"LNRO0005").count();
        assert_eq!(hits, SLOTS.len());
        let count = |needle: &[u8]| dsdt.windows(needle.len()).filter(|w| *w == needle).count();
        assert_eq!(count(b"QEMUVGID"), 1);
        assert_eq!(count(b"VM_GEN_COUNTER"), 1);
        assert_eq!(count(b"ACPI0013"), 1);
        // ADDR: Package (2) { DWord low, Zero high }.
        let mut addr = b"ADDR\x12".to_vec();
        addr.extend_from_slice(&[8, 2, 0x0c]);
        addr.extend_from_slice(&(VMGENID_ADDR as u32).to_le_bytes());
        addr.push(0x00);
        assert_eq!(count(&addr), 1, "ADDR package");
        // The tables end before the id's page.
        let dsdt_addr = u64_at(find(&t, "FACP"), 140);
        assert!(dsdt_addr + dsdt.len() as u64 <= VMGENID_ADDR);

        // Without the device, none of it.
        let mem = guest_mem();
        let t = tables(
            &mem,
            create_acpi_tables(&mem, 1, &SLOTS, None).expect("tables"),
        );
        let dsdt = find(&t, "DSDT");
        assert!(!dsdt
            .windows(8)
            .any(|w| w == b"QEMUVGID" || w == b"ACPI0013"));
    }

    #[test]
    fn test_acpi_tables_bad_input_rejected() {
        let mem = guest_mem();
        assert!(matches!(
            create_acpi_tables(&mem, 0, &[], None),
            Err(AcpiError::VcpuCount(0))
        ));
        let high = VirtioMmioSlot {
            base: 0xffff_f000,
            len: 0x2000,
            gsi: 5,
        };
        assert!(matches!(
            create_acpi_tables(&mem, 1, &[high], None),
            Err(AcpiError::MmioWindow { .. })
        ));
        for gsi in [COM1_IRQ, PIT_IOAPIC_PIN, IOAPIC_PINS] {
            let slot = VirtioMmioSlot {
                base: 0xd000_0000,
                len: 0x1000,
                gsi,
            };
            assert!(matches!(
                create_acpi_tables(&mem, 1, &[slot], None),
                Err(AcpiError::Gsi { .. })
            ));
        }
        let dup = [
            SLOTS[0],
            VirtioMmioSlot {
                gsi: SLOTS[0].gsi,
                ..SLOTS[1]
            },
        ];
        assert!(matches!(
            create_acpi_tables(&mem, 1, &dup, None),
            Err(AcpiError::Gsi { .. })
        ));
        // The VMGenID GSI must be free and valid, its address in its page.
        for gsi in [SLOTS[1].gsi, COM1_IRQ, IOAPIC_PINS] {
            let g = VmGenIdSlot { gsi, ..VGEN };
            assert!(matches!(
                create_acpi_tables(&mem, 1, &SLOTS, Some(g)),
                Err(AcpiError::Gsi { .. })
            ));
        }
        for addr in [RSDP_ADDR, VMGENID_ADDR + 4, VMGENID_ADDR + 0xff8, 1 << 32] {
            let g = VmGenIdSlot { addr, ..VGEN };
            assert!(matches!(
                create_acpi_tables(&mem, 1, &SLOTS, Some(g)),
                Err(AcpiError::VmGenIdAddr(a)) if a == addr
            ));
        }
        let small = create_guest_memory(&[(GuestAddress(0), 0x80000)]).expect("guest memory");
        assert!(matches!(
            create_acpi_tables(&small, 1, &[], None),
            Err(AcpiError::Write { .. })
        ));
    }

    fn iasl_available() -> bool {
        Command::new("iasl").arg("-v").output().is_ok()
    }

    /// Disassembles a table with `iasl -d`, returning the .dsl text.
    fn disassemble(dir: &Path, name: &str, bytes: &[u8]) -> String {
        let dat = dir.join(format!("{name}.dat"));
        std::fs::write(&dat, bytes).expect("write table");
        let out = Command::new("iasl")
            .arg("-d")
            .arg(&dat)
            .output()
            .expect("run iasl");
        assert!(
            out.status.success(),
            "iasl -d {name} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read_to_string(dir.join(format!("{name}.dsl"))).expect("read .dsl")
    }

    #[test]
    fn test_acpi_tables_iasl_disassembles() {
        if !iasl_available() {
            eprintln!(
                "NOTE: iasl not found (apt package acpica-tools); skipping disassembly check"
            );
            return;
        }
        let mem = guest_mem();
        let rsdp = create_acpi_tables(&mem, 4, &SLOTS, Some(VGEN)).expect("tables");
        let t = tables(&mem, rsdp);
        let dir = std::env::temp_dir().join(format!("tine-acpi-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");

        let dsl = disassemble(&dir, "dsdt", find(&t, "DSDT"));
        assert_eq!(dsl.matches("\"LNRO0005\"").count(), SLOTS.len(), "{dsl}");
        for slot in SLOTS {
            assert!(dsl.contains(&format!("0x{:08X}", slot.base)), "{dsl}");
        }
        assert!(dsl.contains("_S5_"), "{dsl}");
        assert!(dsl.contains("PNP0501") && dsl.contains("PNP0303"), "{dsl}");
        assert!(dsl.contains("Device (VGEN)"), "{dsl}");
        assert!(
            dsl.contains("\"QEMUVGID\"") && dsl.contains("\"VM_GEN_COUNTER\""),
            "{dsl}"
        );
        assert!(dsl.contains("0x000EF000"), "{dsl}");
        assert!(
            dsl.contains("Device (GED)") && dsl.contains("\"ACPI0013\""),
            "{dsl}"
        );
        assert!(dsl.contains("Method (_EVT, 1, Serialized)"), "{dsl}");
        assert!(dsl.contains("If ((Arg0 == 0x08))"), "{dsl}");
        assert!(dsl.contains("Notify (\\_SB.VGEN, 0x80)"), "{dsl}");
        let facp = disassemble(&dir, "facp", find(&t, "FACP"));
        assert!(facp.contains("Hardware Reduced (V5) : 1"), "{facp}");
        let apic = disassemble(&dir, "apic", find(&t, "APIC"));
        assert_eq!(apic.matches("Processor Local APIC").count(), 4, "{apic}");
        assert!(apic.contains("Interrupt Source Override"), "{apic}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
