//! Just enough ELF64 parsing for the image builder: a section's bytes (a
//! module's `.modinfo`) and whether a program needs a dynamic loader.

const ELF_MAGIC: &[u8; 4] = b"\x7fELF";
const ELFCLASS64: u8 = 2;
const ELFDATA2LSB: u8 = 1;
const PT_INTERP: u32 = 3;

fn slice(b: &[u8], off: u64, len: u64) -> Option<&[u8]> {
    let start = usize::try_from(off).ok()?;
    let end = start.checked_add(usize::try_from(len).ok()?)?;
    b.get(start..end)
}

fn u16_at(b: &[u8], off: u64) -> Option<u16> {
    Some(u16::from_le_bytes(slice(b, off, 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], off: u64) -> Option<u32> {
    Some(u32::from_le_bytes(slice(b, off, 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], off: u64) -> Option<u64> {
    Some(u64::from_le_bytes(slice(b, off, 8)?.try_into().ok()?))
}

/// Whether `b` starts like an ELF file of any class.
pub fn is_elf(b: &[u8]) -> bool {
    b.starts_with(ELF_MAGIC)
}

fn is_elf64_le(b: &[u8]) -> bool {
    is_elf(b) && b.get(4) == Some(&ELFCLASS64) && b.get(5) == Some(&ELFDATA2LSB)
}

/// The contents of section `name`, or None if `b` is not a little-endian
/// ELF64 file or has no such section.
pub fn section<'a>(b: &'a [u8], name: &str) -> Option<&'a [u8]> {
    if !is_elf64_le(b) {
        return None;
    }
    let shoff = u64_at(b, 0x28)?;
    let shentsize = u64::from(u16_at(b, 0x3a)?);
    let shnum = u64::from(u16_at(b, 0x3c)?);
    let shstrndx = u64::from(u16_at(b, 0x3e)?);
    let header = |i: u64| -> Option<u64> { shoff.checked_add(i.checked_mul(shentsize)?) };
    let strtab_hdr = header(shstrndx)?;
    let strtab = slice(b, u64_at(b, strtab_hdr + 24)?, u64_at(b, strtab_hdr + 32)?)?;
    (0..shnum).find_map(|i| {
        let h = header(i)?;
        let name_off = usize::try_from(u32_at(b, h)?).ok()?;
        let rest = strtab.get(name_off..)?;
        let end = rest.iter().position(|&c| c == 0)?;
        if &rest[..end] != name.as_bytes() {
            return None;
        }
        slice(b, u64_at(b, h + 24)?, u64_at(b, h + 32)?)
    })
}

/// Whether `b` is an ELF64 program that needs no dynamic loader (no PT_INTERP).
pub fn is_static_executable(b: &[u8]) -> bool {
    if !is_elf64_le(b) {
        return false;
    }
    let program_headers = || -> Option<bool> {
        let phoff = u64_at(b, 0x20)?;
        let phentsize = u64::from(u16_at(b, 0x36)?);
        let phnum = u64::from(u16_at(b, 0x38)?);
        for i in 0..phnum {
            let h = phoff.checked_add(i.checked_mul(phentsize)?)?;
            if u32_at(b, h)? == PT_INTERP {
                return Some(false);
            }
        }
        Some(true)
    };
    program_headers().unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_elf_garbage_is_not_elf() {
        assert!(!is_static_executable(b"not an elf"));
        assert!(section(b"\x7fELF\x02\x01", ".modinfo").is_none());
        // A truncated header must not panic.
        let mut b = b"\x7fELF\x02\x01".to_vec();
        b.resize(0x40, 0xff);
        assert!(section(&b, ".modinfo").is_none());
        assert!(!is_static_executable(&b));
    }

    #[test]
    fn test_elf_dynamic_program_is_not_static() {
        // Whatever runs this test is dynamically linked (Rust test binaries are).
        let exe = std::fs::read("/proc/self/exe").expect("read own executable");
        assert!(is_elf(&exe));
        assert!(!is_static_executable(&exe));
    }
}
