//! Loading a kernel (uncompressed ELF or bzImage) and an initramfs, and
//! writing the Linux zero page that the 64-bit boot protocol hands the kernel.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use linux_loader::bootparam::{boot_e820_entry, boot_params, setup_header};
use linux_loader::cmdline::Cmdline;
use linux_loader::loader::bzimage::BzImage;
use linux_loader::loader::elf::Elf;
use linux_loader::loader::{load_cmdline, KernelLoader};
use vm_memory::{Address, ByteValued, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::layout::*;
use crate::memory::GuestMemoryMmap;

const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
const KERNEL_MIN_ALIGNMENT_BYTES: u32 = 0x100_0000;
/// xloadflags bit: the kernel has a 64-bit entry point at load address + 0x200.
const XLF_KERNEL_64: u16 = 1;
const E820_RAM: u32 = 1;
/// Highest initrd end for kernels that do not say (ELF kernels have no header).
const DEFAULT_INITRD_ADDR_MAX: u64 = 0x3800_0000;
const PAGE_SIZE: u64 = 4096;

/// Errors while loading the kernel, initramfs or command line.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The kernel file cannot be opened.
    #[error("Cannot open kernel {path}: {source}; pass an existing vmlinux (ELF) or bzImage")]
    KernelOpen {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The file is neither ELF nor bzImage.
    #[error("{path} is not a kernel: expected an uncompressed ELF vmlinux or a bzImage")]
    NotAKernel { path: PathBuf },
    /// linux-loader refused the image.
    #[error("Cannot load kernel {path}: {source}")]
    KernelLoad {
        path: PathBuf,
        source: linux_loader::loader::Error,
    },
    /// A bzImage without the 64-bit entry point.
    #[error(
        "{path} has no 64-bit entry point (xloadflags lacks XLF_KERNEL_64); use a 64-bit kernel"
    )]
    Not64Bit { path: PathBuf },
    /// The initramfs cannot be read.
    #[error("Cannot read initramfs {path}: {source}")]
    InitrdOpen {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The initramfs does not fit in low memory.
    #[error(
        "Initramfs {path} ({size} bytes) does not fit in guest memory; give the vm more memory"
    )]
    InitrdTooBig { path: PathBuf, size: u64 },
    /// The command line is invalid or too long.
    #[error("Invalid kernel command line: {0}")]
    Cmdline(linux_loader::cmdline::Error),
    /// Writing boot data failed.
    #[error("Cannot write the {0} into guest memory")]
    Write(&'static str),
    /// Guest memory has no region at 0.
    #[error("Guest memory layout has no low RAM")]
    NoLowRam,
}

/// Where the loaded kernel starts, and its boot header when it has one.
#[derive(Debug)]
pub struct LoadedKernel {
    /// Guest physical address of the 64-bit entry point.
    pub entry: GuestAddress,
    /// The bzImage setup header, copied into the zero page.
    pub setup_header: Option<setup_header>,
    /// End of the loaded image.
    pub end: u64,
}

/// Loads an ELF vmlinux or bzImage at 1 MiB, choosing by the file's magic.
pub fn load_kernel(mem: &GuestMemoryMmap, path: &Path) -> Result<LoadedKernel, BootError> {
    let open = || {
        File::open(path).map_err(|source| BootError::KernelOpen {
            path: path.to_path_buf(),
            source,
        })
    };
    let mut file = open()?;
    let mut head = [0u8; 0x206];
    let n = read_up_to(&mut file, &mut head).map_err(|source| BootError::KernelOpen {
        path: path.to_path_buf(),
        source,
    })?;
    let is_elf = n >= 4 && head[..4] == *b"\x7fELF";
    let is_bzimage = n >= 0x206
        && u32::from_le_bytes([head[0x202], head[0x203], head[0x204], head[0x205]])
            == KERNEL_HDR_MAGIC;
    let mut file = open()?;
    let load_err = |source| BootError::KernelLoad {
        path: path.to_path_buf(),
        source,
    };
    if is_elf {
        let r =
            Elf::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START))).map_err(load_err)?;
        Ok(LoadedKernel {
            entry: r.kernel_load,
            setup_header: None,
            end: r.kernel_end,
        })
    } else if is_bzimage {
        let r = BzImage::load(mem, None, &mut file, Some(GuestAddress(HIMEM_START)))
            .map_err(load_err)?;
        let hdr = r.setup_header.ok_or(BootError::NotAKernel {
            path: path.to_path_buf(),
        })?;
        if hdr.xloadflags & XLF_KERNEL_64 == 0 {
            return Err(BootError::Not64Bit {
                path: path.to_path_buf(),
            });
        }
        Ok(LoadedKernel {
            entry: r.kernel_load.unchecked_add(0x200),
            setup_header: Some(hdr),
            end: r.kernel_end,
        })
    } else {
        Err(BootError::NotAKernel {
            path: path.to_path_buf(),
        })
    }
}

fn read_up_to(file: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// An initramfs loaded into guest memory.
#[derive(Debug, Clone, Copy)]
pub struct LoadedInitrd {
    pub addr: GuestAddress,
    pub size: u64,
}

/// Loads the initramfs at the top of low RAM, page aligned, below the
/// kernel's `initrd_addr_max`.
pub fn load_initrd(
    mem: &GuestMemoryMmap,
    path: &Path,
    kernel: &LoadedKernel,
) -> Result<LoadedInitrd, BootError> {
    let err = |source| BootError::InitrdOpen {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(err)?;
    let size = file.metadata().map_err(err)?.len();
    let low = mem
        .find_region(GuestAddress(0))
        .ok_or(BootError::NoLowRam)?;
    let low_end = low.len();
    let max = kernel
        .setup_header
        .map(|h| u64::from(h.initrd_addr_max) + 1)
        .filter(|m| *m > 1)
        .unwrap_or(DEFAULT_INITRD_ADDR_MAX);
    let top = low_end.min(max);
    let too_big = || BootError::InitrdTooBig {
        path: path.to_path_buf(),
        size,
    };
    let addr = top.checked_sub(size).ok_or_else(too_big)? & !(PAGE_SIZE - 1);
    if addr < kernel.end {
        return Err(too_big());
    }
    mem.read_exact_volatile_from(GuestAddress(addr), &mut file, size as usize)
        .map_err(|_| too_big())?;
    Ok(LoadedInitrd {
        addr: GuestAddress(addr),
        size,
    })
}

/// Builds the command line, checking its length.
pub fn cmdline(s: &str) -> Result<Cmdline, BootError> {
    let mut c = Cmdline::new(CMDLINE_MAX_SIZE).map_err(BootError::Cmdline)?;
    c.insert_str(s).map_err(BootError::Cmdline)?;
    Ok(c)
}

/// Writes the command line and the zero page (boot_params with the e820
/// map) for the 64-bit boot protocol.
pub fn configure_system(
    mem: &GuestMemoryMmap,
    kernel: &LoadedKernel,
    cmdline: &Cmdline,
    initrd: Option<LoadedInitrd>,
    rsdp: Option<GuestAddress>,
) -> Result<(), BootError> {
    load_cmdline(mem, GuestAddress(CMDLINE_START), cmdline)
        .map_err(|_| BootError::Write("command line"))?;
    let cmdline_len = cmdline
        .as_cstring()
        .map_err(BootError::Cmdline)?
        .as_bytes()
        .len();

    let mut params = boot_params::default();
    if let Some(hdr) = kernel.setup_header {
        params.hdr = hdr;
    }
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = CMDLINE_START as u32;
    params.hdr.cmdline_size = cmdline_len as u32;
    params.hdr.kernel_alignment = KERNEL_MIN_ALIGNMENT_BYTES;
    if let Some(initrd) = initrd {
        params.hdr.ramdisk_image = initrd.addr.raw_value() as u32;
        params.hdr.ramdisk_size = initrd.size as u32;
    }
    if let Some(rsdp) = rsdp {
        params.acpi_rsdp_addr = rsdp.raw_value();
    }

    let mut e820 = Vec::new();
    e820.push((0, EBDA_START));
    for region in mem.iter() {
        let start = region.start_addr().raw_value();
        let end = start + region.len();
        let start = start.max(HIMEM_START);
        if end > start {
            e820.push((start, end - start));
        }
    }
    for (i, (addr, size)) in e820.iter().enumerate() {
        params.e820_table[i] = boot_e820_entry {
            addr: *addr,
            size: *size,
            r#type: E820_RAM,
        };
    }
    params.e820_entries = e820.len() as u8;

    mem.write_obj(BootParams(params), GuestAddress(ZERO_PAGE_START))
        .map_err(|_| BootError::Write("zero page"))?;
    Ok(())
}

/// boot_params is plain data; the wrapper lets vm-memory write it.
#[derive(Clone, Copy, Default)]
struct BootParams(#[allow(dead_code)] boot_params);
// SAFETY: boot_params is a repr(C) struct of integers and arrays of
// integers generated by bindgen; every byte pattern is a valid value.
unsafe impl ByteValued for BootParams {}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 64 << 20)]).expect("mem")
    }

    #[test]
    fn test_load_kernel_rejects_non_kernel() {
        let dir = std::env::temp_dir().join(format!("tine-boot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let f = dir.join("not-a-kernel");
        std::fs::write(&f, b"hello world").expect("write");
        let e = load_kernel(&mem(), &f).expect_err("must fail");
        assert!(matches!(e, BootError::NotAKernel { .. }), "{e}");
        let e = load_kernel(&mem(), &dir.join("missing")).expect_err("must fail");
        assert!(matches!(e, BootError::KernelOpen { .. }), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn test_configure_system_writes_e820_and_cmdline() {
        let m = mem();
        let k = LoadedKernel {
            entry: GuestAddress(HIMEM_START),
            setup_header: None,
            end: HIMEM_START + 4096,
        };
        configure_system(
            &m,
            &k,
            &cmdline("console=ttyS0").expect("cmdline"),
            None,
            None,
        )
        .expect("configure");
        let p: BootParams = m.read_obj(GuestAddress(ZERO_PAGE_START)).expect("read");
        assert_eq!(p.0.e820_entries, 2);
        assert_eq!({ p.0.e820_table[1].addr }, HIMEM_START);
        assert_eq!({ p.0.hdr.cmd_line_ptr }, CMDLINE_START as u32);
        let mut b = [0u8; 14];
        m.read_slice(&mut b, GuestAddress(CMDLINE_START))
            .expect("read");
        assert_eq!(&b[..13], b"console=ttyS0");
        assert_eq!(b[13], 0);
    }
}
