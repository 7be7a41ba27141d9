//! Micro guests: freestanding 64-bit ELF programs that run their work at
//! CPL3, so they run at full speed on any `/dev/kvm` (including kvm_pvm).
//!
//! Built from `micro/*.rs` by `build.rs`; see `README.md` for the boot
//! contract and the serial protocol of each guest.

use std::path::Path;

/// `counter`: prints `READY`, writes `mib=N` MiB (default 32), prints
/// `WROTE <N>`, then `CNT <n>` every 100 ms.
pub const COUNTER: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/counter"));

/// `memtouch`: prints `READY`, then serves `touch <MiB> [seed]`,
/// `sum <MiB>` and `ping` on the serial port.
pub const MEMTOUCH: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/memtouch"));

/// `blkio`: prints `READY` and `DISK <sectors>`, then serves
/// `write <block> [seed]`, `read <block>`, `flush` and `ping` on the
/// serial port, on the first virtio-blk device.
pub const BLKIO: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/blkio"));

/// `cpuid`: prints `READY`, then serves `cpuid <leaf> [subleaf]` (the
/// CPUID the guest sees, executed at CPL3) and `ping` on the serial port.
pub const CPUID: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/cpuid"));

/// Path of the built `counter` ELF (valid on the build machine).
pub fn counter_path() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/counter"))
}

/// Path of the built `memtouch` ELF (valid on the build machine).
pub fn memtouch_path() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/memtouch"))
}

/// Path of the built `blkio` ELF (valid on the build machine).
pub fn blkio_path() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/blkio"))
}

/// Path of the built `cpuid` ELF (valid on the build machine).
pub fn cpuid_path() -> &'static Path {
    Path::new(concat!(env!("OUT_DIR"), "/cpuid"))
}

/// The guest ELF image called `name` (`"counter"`, `"memtouch"` or
/// `"blkio"`, `"cpuid"`).
pub fn by_name(name: &str) -> Option<&'static [u8]> {
    match name {
        "counter" => Some(COUNTER),
        "memtouch" => Some(MEMTOUCH),
        "blkio" => Some(BLKIO),
        "cpuid" => Some(CPUID),
        _ => None,
    }
}

/// Names accepted by [`by_name`].
pub const NAMES: &[&str] = &["counter", "memtouch", "blkio", "cpuid"];

#[cfg(test)]
mod tests {
    use super::*;

    fn check_elf(image: &[u8]) {
        assert_eq!(&image[..4], b"\x7fELF", "not an ELF file");
        assert_eq!(image[4], 2, "not ELF64");
        assert_eq!(u16::from_le_bytes([image[18], image[19]]), 62, "not x86_64");
        let entry = u64::from_le_bytes(image[24..32].try_into().expect("8 bytes"));
        assert_eq!(entry, 0x10_0000, "entry must be at 1 MiB");
    }

    #[test]
    fn test_images_are_x86_64_elfs_entered_at_1mib() {
        for name in NAMES {
            let image = by_name(name).expect("known guest");
            check_elf(image);
        }
        assert!(by_name("nope").is_none());
    }

    #[test]
    fn test_paths_hold_the_embedded_images() {
        assert_eq!(
            std::fs::read(counter_path()).expect("counter built"),
            COUNTER
        );
        assert_eq!(
            std::fs::read(memtouch_path()).expect("memtouch built"),
            MEMTOUCH
        );
    }
}
