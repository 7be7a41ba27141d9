//! Dirty tracking: which guest pages changed since a base (the last
//! stored snapshot of this vm's line), so a snapshot can store only those
//! (docs/design/store.md, "Memory layers in the VMM").
//!
//! Two sources, merged at a moment (vm paused):
//! - KVM's dirty log (KVM_MEM_LOG_DIRTY_PAGES on every memslot,
//!   KVM_GET_DIRTY_LOG): pages the guest wrote;
//! - the [`AtomicBitmap`](vm_memory::bitmap::AtomicBitmap) vm-memory keeps
//!   per region: pages the VMM itself wrote through vm-memory (virtio
//!   devices, the generation id), which KVM does not see.
//!
//! The merged set lives in the regions' bitmaps: collecting ORs KVM's log
//! (which KVM clears) into them, so between two collections nothing is
//! lost, and a fork(2)ed process inherits the set with the memory. The
//! set is relative to [`DirtyTracking::base`], a label the caller gives
//! when it resets the set ([`rebase`]) after storing a snapshot: a
//! continuation, child, restored template or woken vm keeps the base of
//! the moment it came from and adds its own writes, so its next snapshot
//! can be stored as a diff against that base. A set without a base (a
//! booted vm, tracking just turned on) must be stored whole.

use serde::{Deserialize, Serialize};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use crate::memory::{GuestMemoryMmap, GuestRegionMmap};
use crate::vm::{Vm, VmError};

/// The VMM-write bitmap of a region (vm-memory's trait method gives only
/// a slice view of it).
fn vmm_bits(region: &GuestRegionMmap) -> &vm_memory::bitmap::AtomicBitmap {
    let mapped: &vm_memory::mmap::MmapRegion<vm_memory::bitmap::AtomicBitmap> = region;
    mapped.bitmap()
}

/// The granularity of every page set here (KVM's and vm-memory's).
pub const PAGE_SIZE: u64 = 4096;

/// Whether a vm tracks dirty pages, and since which base.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirtyTracking {
    /// KVM's dirty log is on for every memslot of this vm.
    pub enabled: bool,
    /// What the dirty set is relative to: the label given to the last
    /// [`rebase`] (e.g. the store's snapshot id). None: the set is not
    /// complete relative to anything stored; take a full layer.
    pub base: Option<String>,
}

/// Pages dirtied since [`DirtyTracking::base`], taken at a moment.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DirtyLog {
    pub base: Option<String>,
    pub pages: PageBitmap,
}

/// A set of 4 KiB guest pages, one bitmap per RAM region.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "PageRuns", from = "PageRuns")]
pub struct PageBitmap {
    pub regions: Vec<RegionPages>,
}

/// The pages of one RAM region: bit `i` of `bits[i / 64]` is the page at
/// `start + i * PAGE_SIZE`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionPages {
    /// Guest-physical start of the region.
    pub start: u64,
    /// Bytes in the region.
    pub len: u64,
    pub bits: Vec<u64>,
}

impl RegionPages {
    fn new(start: u64, len: u64) -> Self {
        let pages = len.div_ceil(PAGE_SIZE);
        Self {
            start,
            len,
            bits: vec![0; pages.div_ceil(64) as usize],
        }
    }

    fn pages(&self) -> u64 {
        self.len.div_ceil(PAGE_SIZE)
    }

    fn set(&mut self, page: u64) {
        if page < self.pages() {
            self.bits[(page / 64) as usize] |= 1 << (page % 64);
        }
    }

    fn get(&self, page: u64) -> bool {
        page < self.pages() && self.bits[(page / 64) as usize] & (1 << (page % 64)) != 0
    }
}

impl PageBitmap {
    /// An empty set over the RAM regions of `mem`.
    pub fn empty_for(mem: &GuestMemoryMmap) -> Self {
        Self {
            regions: mem
                .iter()
                .map(|r| RegionPages::new(r.start_addr().0, r.len()))
                .collect(),
        }
    }

    /// An empty set over `(start, len)` regions.
    pub fn empty(regions: &[(u64, u64)]) -> Self {
        Self {
            regions: regions
                .iter()
                .map(|&(s, l)| RegionPages::new(s, l))
                .collect(),
        }
    }

    /// Number of pages in the set.
    pub fn count(&self) -> u64 {
        self.regions
            .iter()
            .flat_map(|r| &r.bits)
            .map(|w| u64::from(w.count_ones()))
            .sum()
    }

    /// Bytes of the pages in the set.
    pub fn bytes(&self) -> u64 {
        self.count() * PAGE_SIZE
    }

    /// Whether the page holding `gpa` is in the set.
    pub fn contains(&self, gpa: u64) -> bool {
        self.regions
            .iter()
            .find(|r| gpa >= r.start && gpa < r.start + r.len)
            .is_some_and(|r| r.get((gpa - r.start) / PAGE_SIZE))
    }

    /// Adds every page overlapping `gpa..gpa+len` (parts outside RAM are
    /// ignored).
    pub fn insert(&mut self, gpa: u64, len: u64) {
        if len == 0 {
            return;
        }
        let end = gpa.saturating_add(len);
        for r in &mut self.regions {
            let lo = gpa.max(r.start);
            let hi = end.min(r.start + r.len);
            if lo >= hi {
                continue;
            }
            for p in (lo - r.start) / PAGE_SIZE..(hi - r.start).div_ceil(PAGE_SIZE) {
                r.set(p);
            }
        }
    }

    /// Adds every page of `other` (same regions; others are ignored).
    pub fn union_with(&mut self, other: &PageBitmap) {
        for (a, b) in self.regions.iter_mut().zip(&other.regions) {
            if a.start == b.start && a.len == b.len {
                for (x, y) in a.bits.iter_mut().zip(&b.bits) {
                    *x |= *y;
                }
            }
        }
    }

    /// The set as maximal runs of consecutive pages, `(guest address,
    /// bytes)`, in address order.
    pub fn runs(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for r in &self.regions {
            let mut run: Option<(u64, u64)> = None;
            for (wi, &w) in r.bits.iter().enumerate() {
                if w == 0 {
                    if let Some(x) = run.take() {
                        out.push(x);
                    }
                    continue;
                }
                for b in 0..64u64 {
                    let page = wi as u64 * 64 + b;
                    if page >= r.pages() {
                        break;
                    }
                    let gpa = r.start + page * PAGE_SIZE;
                    if w & (1 << b) != 0 {
                        run = match run {
                            Some((s, l)) if s + l == gpa => Some((s, l + PAGE_SIZE)),
                            Some(x) => {
                                out.push(x);
                                Some((gpa, PAGE_SIZE))
                            }
                            None => Some((gpa, PAGE_SIZE)),
                        };
                    } else if let Some(x) = run.take() {
                        out.push(x);
                    }
                }
            }
            if let Some(x) = run {
                out.push(x);
            }
        }
        out
    }
}

/// The serialized form of a [`PageBitmap`]: its regions and its runs (a
/// dirty set is mostly a few runs; a GiB of bits would be 32 KiB).
#[derive(Serialize, Deserialize)]
struct PageRuns {
    regions: Vec<(u64, u64)>,
    runs: Vec<(u64, u64)>,
}

impl From<PageBitmap> for PageRuns {
    fn from(b: PageBitmap) -> Self {
        PageRuns {
            regions: b.regions.iter().map(|r| (r.start, r.len)).collect(),
            runs: b.runs(),
        }
    }
}

impl From<PageRuns> for PageBitmap {
    fn from(r: PageRuns) -> Self {
        let mut b = PageBitmap::empty(&r.regions);
        for (gpa, len) in r.runs {
            b.insert(gpa, len);
        }
        b
    }
}

/// Folds KVM's dirty log into the regions' VMM-write bitmaps, so those
/// hold every page dirtied since the base. KVM clears its log and
/// protects the pages again, or, with manual protection, keeps both
/// (the OR is idempotent) until [`rebase`]. Call with the vCPUs paused
/// for a consistent moment.
pub fn collect(vm: &Vm, mem: &GuestMemoryMmap) -> Result<(), VmError> {
    for (slot, region) in mem.iter().enumerate() {
        let slot = u32::try_from(slot).map_err(|_| VmError::TooManyRegions)?;
        let log = vm.dirty_log(slot, region.len() as usize)?;
        let bitmap = vmm_bits(region);
        for (wi, &w) in log.iter().enumerate() {
            let mut w = w;
            while w != 0 {
                let b = w.trailing_zeros() as usize;
                bitmap.set_bit(wi * 64 + b);
                w &= w - 1;
            }
        }
    }
    Ok(())
}

/// The pages set in the regions' bitmaps (after [`collect`]: every page
/// dirtied since the base). Devices may write meanwhile: their bits are
/// kept (the set may only grow).
pub fn read(mem: &GuestMemoryMmap) -> PageBitmap {
    let mut out = PageBitmap::empty_for(mem);
    for (region, pages) in mem.iter().zip(&mut out.regions) {
        let bitmap = vmm_bits(region);
        // vm-memory has no plain read of the words: take them and put the
        // bits back (a concurrent device write is an OR, never lost).
        let words = bitmap.get_and_reset();
        for (wi, &w) in words.iter().enumerate() {
            let mut x = w;
            while x != 0 {
                let b = x.trailing_zeros() as usize;
                bitmap.set_bit(wi * 64 + b);
                x &= x - 1;
            }
        }
        for (dst, w) in pages.bits.iter_mut().zip(words) {
            *dst = w;
        }
    }
    out
}

/// Replaces the regions' bitmaps by `pages` (a standby continuation,
/// forked before the moment, takes the set of the moment).
pub fn replace(mem: &GuestMemoryMmap, pages: &PageBitmap) {
    for region in mem.iter() {
        let bitmap = vmm_bits(region);
        bitmap.reset();
        if let Some(p) = pages
            .regions
            .iter()
            .find(|p| p.start == region.start_addr().0 && p.len == region.len())
        {
            for (wi, &w) in p.bits.iter().enumerate() {
                let mut x = w;
                while x != 0 {
                    let b = x.trailing_zeros() as usize;
                    bitmap.set_bit(wi * 64 + b);
                    x &= x - 1;
                }
            }
        }
    }
}

/// Empties the set: KVM's log is taken and dropped, the bitmaps cleared.
/// The new base is whatever the caller just stored. Call with the vCPUs
/// paused and devices quiet (the fork path parks them), or writes made
/// meanwhile may be lost.
pub fn rebase(vm: &Vm, mem: &GuestMemoryMmap, tracking: bool) -> Result<(), VmError> {
    if tracking {
        for (slot, region) in mem.iter().enumerate() {
            let slot = u32::try_from(slot).map_err(|_| VmError::TooManyRegions)?;
            let mut log = vm.dirty_log(slot, region.len() as usize)?;
            // With manual protection the read left the pages writable:
            // protect exactly those again, so their next write counts.
            if vm.manual_dirty_protect() && log.iter().any(|&w| w != 0) {
                vm.clear_dirty_log(slot, region.len() as usize, &mut log)?;
            }
        }
    }
    for region in mem.iter() {
        vmm_bits(region).reset();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_runs_and_serde_round_trip() {
        let mut b = PageBitmap::empty(&[(0, 1 << 20), (4 << 30, 1 << 20)]);
        b.insert(0x1000, 0x3000);
        b.insert(0x3fff0, 0x20); // crosses a word boundary: pages 63 and 64
        b.insert((4 << 30) + 0xf_f000, 0x1000);
        b.insert(8 << 30, 0x1000); // outside RAM: ignored
        assert_eq!(
            b.runs(),
            vec![
                (0x1000, 0x3000),
                (0x3f000, 0x2000),
                ((4 << 30) + 0xf_f000, 0x1000)
            ]
        );
        assert_eq!(b.count(), 6);
        assert!(b.contains(0x2fff) && !b.contains(0x4000));
        let json = serde_json::to_string(&b).expect("json");
        let back: PageBitmap = serde_json::from_str(&json).expect("parse");
        assert_eq!(back, b);
        let mut u = PageBitmap::empty(&[(0, 1 << 20), (4 << 30, 1 << 20)]);
        u.insert(0x8000, 0x1000);
        u.union_with(&b);
        assert_eq!(u.count(), 7);
    }
}
