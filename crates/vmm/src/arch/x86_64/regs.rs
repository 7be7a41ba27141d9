//! Boot-time vCPU registers for the Linux 64-bit boot protocol: long mode,
//! identity-mapped first GiB, flat GDT, RSI pointing at the zero page.

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_segment, kvm_sregs};
use vm_memory::{Bytes, GuestAddress};

use super::layout::*;
use crate::memory::GuestMemoryMmap;

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_ET: u64 = 0x10;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;

/// Errors while writing boot structures into guest memory.
#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    /// Guest memory too small for the boot structures.
    #[error("Cannot write the boot {0} into guest memory")]
    Write(&'static str),
}

/// A GDT entry from flags, base and limit (Intel SDM 3A 3.4.5).
const fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((base as u64 & 0xff00_0000) << 32)
        | ((base as u64 & 0x00ff_ffff) << 16)
        | (limit as u64 & 0x0000_ffff)
        | (((limit as u64 & 0x000f_0000) >> 16) << 48)
        | ((flags as u64 & 0x0000_f0ff) << 40)
}

fn segment_from_gdt(entry: u64, index: u8) -> kvm_segment {
    let limit = ((entry & 0x000f_0000_0000_0000) >> 32) | (entry & 0xffff);
    let g = ((entry >> 55) & 1) as u8;
    kvm_segment {
        base: ((entry & 0xff00_0000_0000_0000) >> 32) | ((entry & 0x0000_00ff_ffff_0000) >> 16),
        // With granularity set the limit counts 4 KiB pages.
        limit: if g == 1 {
            ((limit << 12) | 0xfff) as u32
        } else {
            limit as u32
        },
        selector: u16::from(index) * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        padding: 0,
        unusable: if (entry >> 47) & 1 == 1 { 0 } else { 1 },
    }
}

/// General registers at the kernel entry point.
pub fn boot_regs(entry: u64) -> kvm_regs {
    kvm_regs {
        rflags: 0x2,
        rip: entry,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_START,
        ..Default::default()
    }
}

/// FPU state as after FNINIT, with the default MXCSR.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

/// Writes the GDT and identity page tables, and returns `sregs` set to long mode.
pub fn setup_long_mode(
    mem: &GuestMemoryMmap,
    mut sregs: kvm_sregs,
) -> Result<kvm_sregs, RegsError> {
    let gdt: [u64; 4] = [
        gdt_entry(0, 0, 0),            // null
        gdt_entry(0xa09b, 0, 0xfffff), // code, 64-bit
        gdt_entry(0xc093, 0, 0xfffff), // data
        gdt_entry(0x808b, 0, 0xfffff), // TSS
    ];
    for (i, e) in gdt.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(BOOT_GDT_START + 8 * i as u64))
            .map_err(|_| RegsError::Write("GDT"))?;
    }
    let code = segment_from_gdt(gdt[1], 1);
    let data = segment_from_gdt(gdt[2], 2);
    let tss = segment_from_gdt(gdt[3], 3);
    sregs.gdt.base = BOOT_GDT_START;
    sregs.gdt.limit = (std::mem::size_of_val(&gdt) - 1) as u16;
    sregs.idt.base = 0;
    sregs.idt.limit = 0;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;

    // One PML4 entry → one PDPT entry → 512 × 2 MiB pages.
    mem.write_obj(PDPTE_START | 0x03, GuestAddress(PML4_START))
        .map_err(|_| RegsError::Write("PML4"))?;
    mem.write_obj(PDE_START | 0x03, GuestAddress(PDPTE_START))
        .map_err(|_| RegsError::Write("PDPT"))?;
    let mut pd = [0u64; 512];
    for (i, e) in pd.iter_mut().enumerate() {
        *e = ((i as u64) << 21) | 0x83; // present, writable, 2 MiB page
    }
    let bytes: Vec<u8> = pd.iter().flat_map(|e| e.to_le_bytes()).collect();
    mem.write_slice(&bytes, GuestAddress(PDE_START))
        .map_err(|_| RegsError::Write("page directory"))?;

    sregs.cr3 = PML4_START;
    sregs.cr4 |= X86_CR4_PAE;
    sregs.cr0 |= X86_CR0_PE | X86_CR0_ET | X86_CR0_PG;
    sregs.efer |= EFER_LME | EFER_LMA;
    Ok(sregs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_gdt_entry_roundtrip_segment() {
        let s = segment_from_gdt(gdt_entry(0xa09b, 0, 0xfffff), 1);
        assert_eq!(s.selector, 8);
        assert_eq!(s.l, 1);
        assert_eq!(s.present, 1);
        assert_eq!(s.limit, 0xffff_ffff);
        assert_eq!(s.type_, 0xb);
    }

    #[test]
    fn test_setup_long_mode_writes_tables() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).expect("mem");
        let sregs = setup_long_mode(&mem, kvm_sregs::default()).expect("long mode");
        assert_eq!(sregs.cr3, PML4_START);
        assert_ne!(sregs.efer & EFER_LMA, 0);
        let pde: u64 = mem.read_obj(GuestAddress(PDE_START + 8)).expect("read");
        assert_eq!(pde, (1 << 21) | 0x83);
    }
}
