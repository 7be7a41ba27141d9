//! Guest RAM, registered as KVM memslots, and how it is shared by a fork.
//!
//! A booted vm's RAM is one memfd mapped MAP_SHARED (one mapping per
//! region, at consecutive file offsets). fork(2) copies no page tables for a
//! shared mapping, so freezing it costs the same at 256 MiB and 4 GiB; every
//! process that continues from the frozen moment (children and the parent's
//! own continuation) then maps the memfd MAP_PRIVATE over the same
//! addresses ([`make_private`]) and the memfd is never written again
//! (docs/design/fork.md). A vm restored from a snapshot directory maps the
//! memory file MAP_PRIVATE ([`map_file_private`]); its later forks inherit
//! the private mapping copy-on-write.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;

use vm_memory::bitmap::AtomicBitmap;
use vm_memory::mmap::MmapRegion;
use vm_memory::{
    FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap as VmGuestMemoryMmap,
    GuestMemoryRegion,
};

/// Guest memory as every part of the VMM sees it. Each region carries a
/// bitmap of the pages the VMM itself wrote through vm-memory (virtio
/// devices, the generation id): KVM's dirty log sees only the guest's
/// writes (see [`crate::dirty`]).
pub type GuestMemoryMmap = VmGuestMemoryMmap<AtomicBitmap>;

/// The bitmap view of guest memory slices (virtio readers and writers).
pub type GuestBitmapSlice<'a> = vm_memory::bitmap::BS<'a, AtomicBitmap>;

/// One region of [`GuestMemoryMmap`].
pub type GuestRegionMmap = vm_memory::GuestRegionMmap<AtomicBitmap>;

/// How the guest RAM of this process is backed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RamBacking {
    /// A memfd mapped MAP_SHARED: written in place; a fork must move every
    /// continuation to a private view.
    SharedMemfd,
    /// A private copy-on-write view (of a frozen memfd or a memory file).
    Private,
}

/// Errors while creating or remapping guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// Mapping guest RAM failed.
    #[error("Cannot map {size} bytes of guest RAM at {addr:#x}")]
    Map {
        addr: u64,
        size: u64,
        #[source]
        source: vm_memory::mmap::FromRangesError,
    },
    #[error("Cannot create the guest RAM memfd of {size} bytes")]
    Memfd {
        size: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("Cannot map the memory file {path}")]
    MapFile {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("Memory file {path} has {found} bytes, the snapshot needs {want}: it is truncated or from another vm")]
    FileSize { path: String, found: u64, want: u64 },
    #[error("Cannot map {size} bytes of anonymous guest RAM")]
    Anonymous {
        size: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("Cannot remap guest RAM copy-on-write")]
    Remap(#[source] std::io::Error),
    #[error("Guest RAM region at {0:#x} is not backed by a file")]
    NoFile(u64),
}

/// Total bytes of `regions`.
fn total(regions: &[(GuestAddress, usize)]) -> u64 {
    regions.iter().map(|r| r.1 as u64).sum()
}

/// Maps guest RAM for the given (start, size) regions on one new memfd,
/// MAP_SHARED, at consecutive offsets.
pub fn create_guest_memory(
    regions: &[(GuestAddress, usize)],
) -> Result<GuestMemoryMmap, MemoryError> {
    let size = total(regions);
    let memfd = memfd(size).map_err(|source| MemoryError::Memfd { size, source })?;
    let mut offset = 0u64;
    let mut ranges = Vec::with_capacity(regions.len());
    for &(addr, len) in regions {
        let file = memfd
            .try_clone()
            .map_err(|source| MemoryError::Memfd { size, source })?;
        ranges.push((addr, len, Some(FileOffset::new(file, offset))));
        offset += len as u64;
    }
    GuestMemoryMmap::from_ranges_with_files(ranges).map_err(|source| MemoryError::Map {
        addr: regions.first().map(|r| r.0 .0).unwrap_or(0),
        size,
        source,
    })
}

/// Maps a memory file (a snapshot's `memory`) MAP_PRIVATE at the layout of
/// `regions`: pages are read from the page cache as the guest touches them
/// and copied only when written, so siblings restored from one file share it.
pub fn map_file_private(
    path: &Path,
    regions: &[(GuestAddress, usize)],
) -> Result<GuestMemoryMmap, MemoryError> {
    let shown = path.display().to_string();
    let file = File::open(path).map_err(|source| MemoryError::MapFile {
        path: shown.clone(),
        source,
    })?;
    let found = file
        .metadata()
        .map_err(|source| MemoryError::MapFile {
            path: shown.clone(),
            source,
        })?
        .len();
    let want = total(regions);
    if found != want {
        return Err(MemoryError::FileSize {
            path: shown,
            found,
            want,
        });
    }
    let mut offset = 0u64;
    let mut mapped = Vec::with_capacity(regions.len());
    for &(addr, len) in regions {
        let clone = file.try_clone().map_err(|source| MemoryError::MapFile {
            path: shown.clone(),
            source,
        })?;
        let fo = FileOffset::new(clone, offset);
        let region = MmapRegion::<AtomicBitmap>::build(
            Some(fo),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_NORESERVE,
        )
        .map_err(|e| MemoryError::MapFile {
            path: shown.clone(),
            source: std::io::Error::other(e.to_string()),
        })?;
        let region = GuestRegionMmap::new(region, addr).ok_or(MemoryError::MapFile {
            path: shown.clone(),
            source: std::io::Error::other("region overflows the address space"),
        })?;
        mapped.push(region);
        offset += len as u64;
    }
    GuestMemoryMmap::from_regions(mapped).map_err(|e| MemoryError::Map {
        addr: regions.first().map(|r| r.0 .0).unwrap_or(0),
        size: want,
        source: e.into(),
    })
}

/// Maps anonymous MAP_PRIVATE guest RAM at the layout of `regions`, with
/// nothing in it: lazy page-in ([`crate::pagein`]) registers it with a
/// userfaultfd and fills pages as they are touched. After fork(2) it is
/// ordinary copy-on-write memory, like a mapped memory file.
pub fn map_anonymous_private(
    regions: &[(GuestAddress, usize)],
) -> Result<GuestMemoryMmap, MemoryError> {
    let size = total(regions);
    let first = regions.first().map(|r| r.0 .0).unwrap_or(0);
    let mut mapped = Vec::with_capacity(regions.len());
    for &(addr, len) in regions {
        let region = MmapRegion::<AtomicBitmap>::build(
            None,
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
        )
        .map_err(|e| MemoryError::Anonymous {
            size,
            source: std::io::Error::other(e.to_string()),
        })?;
        let region = GuestRegionMmap::new(region, addr).ok_or(MemoryError::Anonymous {
            size,
            source: std::io::Error::other("region overflows the address space"),
        })?;
        mapped.push(region);
    }
    GuestMemoryMmap::from_regions(mapped).map_err(|e| MemoryError::Map {
        addr: first,
        size,
        source: e.into(),
    })
}

/// Replaces every MAP_SHARED region of `mem` by a MAP_PRIVATE mapping of
/// the same file range at the same address. Called in a freshly forked
/// process, whose page tables for the shared mapping are empty, so this
/// costs microseconds whatever the RAM size. The addresses do not change:
/// devices and KVM memslots created afterwards use `mem` as it is.
pub fn make_private(mem: &GuestMemoryMmap) -> Result<(), MemoryError> {
    for region in mem.iter() {
        let fo = region
            .file_offset()
            .ok_or(MemoryError::NoFile(region.start_addr().0))?;
        let len = region.len() as usize;
        let offset =
            libc::off_t::try_from(fo.start()).map_err(|_| MemoryError::NoFile(fo.start()))?;
        // SAFETY: the range is exactly a mapping `mem` owns; MAP_FIXED
        // replaces it atomically with a private view of the same file
        // range, so every pointer into it stays valid and sees the same
        // bytes. No other thread exists in this freshly forked process.
        let p = unsafe {
            libc::mmap(
                region.as_ptr().cast(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                fo.file().as_raw_fd(),
                offset,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(MemoryError::Remap(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// The fds that back `mem` (kept open across the fd cleanup of a fork).
pub fn backing_fds(mem: &GuestMemoryMmap) -> Vec<i32> {
    mem.iter()
        .filter_map(|r| r.file_offset().map(|f| f.file().as_raw_fd()))
        .collect()
}

fn memfd(size: u64) -> std::io::Result<File> {
    // SAFETY: a constant NUL-terminated name; the returned fd is checked.
    let fd = unsafe { libc::memfd_create(c"tine-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size)?;
    Ok(file)
}
