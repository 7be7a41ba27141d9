//! Harnesses for everything here that a guest or a snapshot file controls,
//! shared by the coverage-guided fuzz targets (`fuzz/`, libFuzzer through
//! cargo-fuzz, with the `fuzzing` feature) and the property tests below
//! (proptest in `cargo test`). Each harness takes raw bytes, reads a
//! structured input from them with `arbitrary`, drives the real code and
//! returns; the property is that it returns (no panic, no abort, no
//! allocation beyond libFuzzer's limits). docs/design/fuzzing.md.
//!
//! The virtio harnesses play the guest driver: rings laid out with
//! virtio-queue's mock parts in a real `GuestMemoryMmap` (two regions with a
//! hole between them), the device probed through its real MMIO transport,
//! and served on a real `EventManager`, as on the device thread. Every
//! descriptor field (address, length, flags, next), the avail ring and the
//! buffers' bytes come from the input.

#![allow(clippy::unwrap_used)]

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use arbitrary::{Arbitrary, Unstructured};
use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FEATURES_OK,
};
use virtio_queue::desc::split::Descriptor as SplitDescriptor;
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::{AvailRing, DescriptorTable};
use vm_memory::{Bytes, GuestAddress};

use crate::devices::bus::BusDevice;
use crate::devices::virtio::block::{Block, BlockConfig};
use crate::devices::virtio::mmio::{MmioState, MmioTransport, QUEUE_NOTIFY_OFFSET};
use crate::devices::virtio::net::{Net, NetConfig};
use crate::devices::virtio::vsock::packet::{self, VsockHeader, HDR_SIZE};
use crate::devices::virtio::vsock::{Vsock, VsockConfig};
use crate::devices::virtio::VirtioDevice;
use crate::memory::GuestMemoryMmap;
use crate::moment::Moment;

/// Guest RAM: two regions with a hole between them, so buffers can start
/// in RAM and run out of it, or fall in the hole.
const REGION_A: (u64, usize) = (0, 0x4_0000);
const REGION_B: (u64, usize) = (0x8_0000, 0x4_0000);
/// Queue `i`'s rings: descriptors at `QUEUE_BASE + i * QUEUE_STRIDE`, the
/// avail ring 0x1000 above, the used ring 0x2000 above.
const QUEUE_BASE: u64 = 0x1000;
const QUEUE_STRIDE: u64 = 0x4000;
/// The size the driver picks for every queue (a power of two below every
/// device's maximum).
const QSIZE: u16 = 16;
/// Where the input's bytes are put: buffers usually point here.
const DATA: u64 = 0x1_0000;
const DATA_LEN: usize = 0x3_0000;
/// Bytes of an input's data area (more would only slow the harness).
const MAX_DATA: usize = 0x4000;
/// Disk of the block harness.
const DISK_SECTORS: u64 = 64;
/// Port the vsock harness listens on (host side), so a guest's REQUEST
/// can connect and its RW payload reach a real socket.
const LISTEN_PORT: u32 = 1234;

type Subscriber = Arc<Mutex<dyn MutEventSubscriber + Send>>;

fn guest_memory() -> GuestMemoryMmap {
    GuestMemoryMmap::from_ranges(&[
        (GuestAddress(REGION_A.0), REGION_A.1),
        (GuestAddress(REGION_B.0), REGION_B.1),
    ])
    .expect("guest memory")
}

/// A guest physical address, mostly in RAM.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum FuzzAddr {
    /// In the data area.
    Data(u16),
    /// In the second region (its end included).
    High(u32),
    /// Anywhere at all (the hole, past RAM, near 2^64).
    Raw(u64),
}

impl FuzzAddr {
    fn get(self) -> u64 {
        match self {
            Self::Data(o) => DATA + u64::from(o),
            Self::High(o) => REGION_B.0 + u64::from(o) % (REGION_B.1 as u64 + 0x100),
            Self::Raw(a) => a,
        }
    }
}

/// A buffer length, mostly small.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum FuzzLen {
    Small(u16),
    Raw(u32),
}

impl FuzzLen {
    fn get(self) -> u32 {
        match self {
            Self::Small(l) => u32::from(l),
            Self::Raw(l) => l,
        }
    }
}

/// One descriptor as the guest writes it (flags: NEXT = 1, WRITE = 2,
/// INDIRECT = 4, other bits too).
#[derive(Arbitrary, Debug, Clone, Copy)]
pub struct FuzzDesc {
    pub addr: FuzzAddr,
    pub len: FuzzLen,
    pub flags: u16,
    pub next: u16,
}

/// What the guest put on one queue: the descriptor table, the avail ring
/// (head indices, not checked) and the avail index it publishes (usually
/// the number of heads; anything when `bogus_idx` is set).
#[derive(Arbitrary, Debug, Default, Clone)]
pub struct FuzzQueue {
    pub descs: Vec<FuzzDesc>,
    pub heads: Vec<u16>,
    pub bogus_idx: Option<u16>,
}

/// A guest's rings and buffers for one device.
#[derive(Arbitrary, Debug)]
pub struct ChainsInput {
    /// Bytes at [`DATA`]: request headers, packets, indirect tables.
    pub data: Vec<u8>,
    pub queues: Vec<FuzzQueue>,
    /// Features the driver accepts beyond VERSION_1 (masked to the offer).
    pub features: u64,
    /// Kicks after the first pass: queue indices (the device runs after each).
    pub kicks: Vec<u8>,
}

fn write_queue(mem: &GuestMemoryMmap, index: usize, q: &FuzzQueue) {
    let base = QUEUE_BASE + index as u64 * QUEUE_STRIDE;
    let table = DescriptorTable::new(mem, GuestAddress(base), QSIZE);
    for (i, d) in q.descs.iter().take(usize::from(QSIZE)).enumerate() {
        let desc = SplitDescriptor::new(d.addr.get(), d.len.get(), d.flags, d.next);
        // In RAM by construction.
        let _ = table.store(i as u16, RawDescriptor::from(desc));
    }
    let avail = AvailRing::new(mem, GuestAddress(base + 0x1000), QSIZE);
    let mut n = 0u16;
    for (i, &h) in q.heads.iter().take(usize::from(QSIZE)).enumerate() {
        if let Ok(slot) = avail.ring().ref_at(i) {
            slot.store(h);
            n += 1;
        }
    }
    avail.idx().store(q.bogus_idx.unwrap_or(n));
}

fn wr(t: &mut MmioTransport, offset: u64, v: u32) {
    t.write(offset, &v.to_le_bytes());
}

fn rd(t: &mut MmioTransport, offset: u64) -> u32 {
    let mut b = [0u8; 4];
    t.read(offset, &mut b);
    u32::from_le_bytes(b)
}

/// The Linux driver's probe: features (VERSION_1 and `extra`, as offered),
/// every queue at its rings with [`QSIZE`] entries, DRIVER_OK.
fn probe(t: &mut MmioTransport, queues: usize, extra: u64) {
    wr(t, 0x70, 0);
    wr(t, 0x70, VIRTIO_CONFIG_S_ACKNOWLEDGE);
    wr(
        t,
        0x70,
        VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
    );
    wr(t, 0x14, 0);
    let mut offered = u64::from(rd(t, 0x10));
    wr(t, 0x14, 1);
    offered |= u64::from(rd(t, 0x10)) << 32;
    let features = offered & (extra | 1 << 32);
    wr(t, 0x24, 0);
    wr(t, 0x20, features as u32);
    wr(t, 0x24, 1);
    wr(t, 0x20, (features >> 32) as u32);
    let s = VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER;
    wr(t, 0x70, s | VIRTIO_CONFIG_S_FEATURES_OK);
    for i in 0..queues {
        let base = QUEUE_BASE + i as u64 * QUEUE_STRIDE;
        wr(t, 0x30, i as u32);
        wr(t, 0x38, u32::from(QSIZE));
        for (reg, addr) in [(0x80, base), (0x90, base + 0x1000), (0xa0, base + 0x2000)] {
            wr(t, reg, addr as u32);
            wr(t, reg + 4, (addr >> 32) as u32);
        }
        wr(t, 0x44, 1);
    }
    wr(
        t,
        0x70,
        s | VIRTIO_CONFIG_S_FEATURES_OK | VIRTIO_CONFIG_S_DRIVER_OK,
    );
}

/// Runs the device thread's loop until it has nothing left to do (a few
/// rounds at most: a device may re-arm itself).
fn settle(em: &mut EventManager<Subscriber>) {
    for _ in 0..4 {
        match em.run_with_timeout(0) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

/// Puts the input's rings in memory, probes the device, lets it serve them,
/// then replays the input's kicks.
fn drive<D: VirtioDevice + MutEventSubscriber + 'static>(
    dev: D,
    input: &ChainsInput,
) -> Arc<Mutex<D>> {
    let mem = guest_memory();
    let n = input.data.len().min(MAX_DATA).min(DATA_LEN);
    let _ = mem.write_slice(&input.data[..n], GuestAddress(DATA));
    let queues = dev.queue_max_sizes().len();
    for (i, q) in input.queues.iter().take(queues).enumerate() {
        write_queue(&mem, i, q);
    }
    let dev = Arc::new(Mutex::new(dev));
    let mut t = MmioTransport::new(mem, dev.clone()).expect("transport");
    let mut em = EventManager::<Subscriber>::new().expect("event manager");
    em.add_subscriber(dev.clone());
    probe(&mut t, queues, input.features);
    settle(&mut em);
    for &k in input.kicks.iter().take(8) {
        wr(&mut t, QUEUE_NOTIFY_OFFSET, u32::from(k) % queues as u32);
        settle(&mut em);
    }
    dev
}

/// A fresh, private scratch directory (removed by [`Scratch::drop`]).
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tine-fuzz-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn new_block(dir: &Path, read_only: bool) -> Block {
    let path = dir.join("disk.raw");
    let content: Vec<u8> = (0..DISK_SECTORS * 512).map(|i| (i / 512) as u8).collect();
    std::fs::write(&path, content).expect("disk image");
    Block::new(BlockConfig {
        path,
        read_only,
        id: Some("fuzz".into()),
    })
    .expect("block device")
}

/// A net device whose "tap" is one end of a datagram socket pair; the other
/// end is returned (frames written to it reach the guest's rx queue).
fn new_net() -> (Net, OwnedFd) {
    let mut fds = [0i32; 2];
    // SAFETY: socketpair writes two fds into the array it is given.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    assert_eq!(rc, 0, "socketpair");
    // SAFETY: fds[1] was just created and is owned by nothing else.
    let peer = unsafe { OwnedFd::from_raw_fd(fds[1]) };
    let net = Net::new(NetConfig {
        tap_name: "fuzz".into(),
        mac: [2, 0, 0, 0, 0, 1],
        tap_fd: Some(fds[0]),
    })
    .expect("net device");
    (net, peer)
}

fn new_vsock(dir: &Path) -> (Vsock, UnixListener) {
    let uds_path = dir.join("v.sock");
    let listener = UnixListener::bind(crate::devices::virtio::vsock::port_path(
        &uds_path,
        LISTEN_PORT,
    ))
    .expect("port listener");
    let dev = Vsock::new(VsockConfig {
        guest_cid: 3,
        uds_path,
    })
    .expect("vsock device");
    (dev, listener)
}

/// virtio-blk: arbitrary request chains on its queue.
pub fn virtio_blk(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(read_only) = bool::arbitrary(&mut u) else {
        return;
    };
    let Ok(input) = ChainsInput::arbitrary(&mut u) else {
        return;
    };
    let dir = Scratch::new();
    drive(new_block(dir.path(), read_only), &input);
}

/// virtio-net: arbitrary tx chains, and rx chains receiving the input's
/// frames from the "tap".
pub fn virtio_net(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(frames) = Vec::<Vec<u8>>::arbitrary(&mut u) else {
        return;
    };
    let Ok(input) = ChainsInput::arbitrary(&mut u) else {
        return;
    };
    let (net, peer) = new_net();
    for f in frames.iter().take(8) {
        // SAFETY: `peer` is a live socket; `f` is a valid buffer of its length.
        unsafe {
            libc::send(
                std::os::fd::AsRawFd::as_raw_fd(&peer),
                f.as_ptr().cast(),
                f.len().min(crate::devices::virtio::net::MAX_BUFFER_LEN),
                libc::MSG_DONTWAIT,
            );
        }
    }
    drive(net, &input);
}

/// virtio-vsock: arbitrary tx chains (packets to the host), rx and event
/// chains for what the device sends back.
pub fn virtio_vsock(data: &[u8]) {
    let Ok(input) = ChainsInput::arbitrary(&mut Unstructured::new(data)) else {
        return;
    };
    let dir = Scratch::new();
    let (dev, _listener) = new_vsock(dir.path());
    drive(dev, &input);
}

/// The vsock packet parser on one arbitrary tx chain, and the header codec.
pub fn vsock_packet(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(input) = ChainsInput::arbitrary(&mut u) else {
        return;
    };
    let mem = guest_memory();
    let n = input.data.len().min(MAX_DATA);
    let _ = mem.write_slice(&input.data[..n], GuestAddress(DATA));
    let q = input.queues.first().cloned().unwrap_or_default();
    write_queue(&mem, 0, &q);
    let mut raw = [0u8; HDR_SIZE];
    let k = input.data.len().min(HDR_SIZE);
    raw[..k].copy_from_slice(&input.data[..k]);
    let hdr = VsockHeader::from_bytes(&raw);
    assert_eq!(hdr.to_bytes(), raw, "header codec round trip");
    let _ = hdr.to_string();

    use virtio_queue::{Queue, QueueT};
    let base = QUEUE_BASE;
    let mut queue = Queue::new(QSIZE).expect("queue");
    let _ = queue.try_set_desc_table_address(GuestAddress(base));
    let _ = queue.try_set_avail_ring_address(GuestAddress(base + 0x1000));
    let _ = queue.try_set_used_ring_address(GuestAddress(base + 0x2000));
    queue.set_ready(true);
    for _ in 0..QSIZE {
        let Some(chain) = queue.pop_descriptor_chain(&mem) else {
            break;
        };
        let writable = chain.clone();
        if let Ok(p) = packet::read_tx_packet(&mem, chain) {
            assert!(p.data.len() <= packet::MAX_PKT_DATA);
            assert_eq!(p.data.len(), p.hdr.len as usize);
        }
        if let Ok(rx) = packet::RxBuffer::new(&mem, writable) {
            let cap = rx.data_capacity().min(packet::MAX_PKT_DATA);
            let mut h = hdr;
            h.len = cap as u32;
            let _ = rx.write(&h, &vec![0xa5; cap]);
        }
    }
}

/// Which device sits behind the transport in [`mmio`].
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum DeviceKind {
    Block,
    Net,
    Vsock,
}

/// One guest access to the MMIO window, or a step of the device thread.
#[derive(Arbitrary, Debug)]
pub enum MmioOp {
    Read {
        offset: u16,
        size: u8,
    },
    Write {
        offset: u16,
        size: u8,
        value: u64,
    },
    /// The whole Linux probe (so later accesses hit a running device).
    Probe {
        features: u64,
    },
    /// Guest memory written (rings, buffers), at an offset in region A.
    Poke {
        offset: u32,
        bytes: Vec<u8>,
    },
    /// The device thread runs.
    Run,
}

/// The MMIO transport: arbitrary register reads and writes, of any size at
/// any offset, in any order, around a real device.
pub fn mmio(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(kind) = DeviceKind::arbitrary(&mut u) else {
        return;
    };
    let Ok(ops) = Vec::<MmioOp>::arbitrary(&mut u) else {
        return;
    };
    let dir = Scratch::new();
    let mem = guest_memory();
    let mut em = EventManager::<Subscriber>::new().expect("event manager");
    let mut keep = None;
    let mut keep_fd = None;
    let (dev, queues): (Arc<Mutex<dyn VirtioDevice>>, usize) = match kind {
        DeviceKind::Block => {
            let d = Arc::new(Mutex::new(new_block(dir.path(), false)));
            em.add_subscriber(d.clone());
            (d, 1)
        }
        DeviceKind::Net => {
            let (net, peer) = new_net();
            keep_fd = Some(peer);
            let d = Arc::new(Mutex::new(net));
            em.add_subscriber(d.clone());
            (d, 2)
        }
        DeviceKind::Vsock => {
            let (v, l) = new_vsock(dir.path());
            keep = Some(l);
            let d = Arc::new(Mutex::new(v));
            em.add_subscriber(d.clone());
            (d, 3)
        }
    };
    let mut t = MmioTransport::new(mem.clone(), dev).expect("transport");
    for op in ops.into_iter().take(256) {
        match op {
            MmioOp::Read { offset, size } => {
                let mut buf = vec![0u8; usize::from(size % 9)];
                t.read(u64::from(offset), &mut buf);
            }
            MmioOp::Write {
                offset,
                size,
                value,
            } => {
                let bytes = value.to_le_bytes();
                t.write(u64::from(offset), &bytes[..usize::from(size % 9)]);
            }
            MmioOp::Probe { features } => probe(&mut t, queues, features),
            MmioOp::Poke { offset, bytes } => {
                let at = u64::from(offset) % REGION_A.1 as u64;
                let n = bytes.len().min(0x1000);
                let _ = mem.write_slice(&bytes[..n], GuestAddress(at));
            }
            MmioOp::Run => settle(&mut em),
        }
    }
    let _ = t.state();
    drop((keep, keep_fd));
}

/// Wraps `payload` in a valid state envelope (magic, this build's format
/// version, length, checksum), so the fuzzer reaches the decoder behind it.
pub fn envelope(payload: &[u8]) -> Vec<u8> {
    snapshot::encode_raw(payload, &snapshot::Seal::default())
}

/// A state file: the first byte says whether the rest is taken as the
/// whole file (envelope included) or as the JSON payload of a valid
/// envelope. Either way it must decode or be refused with an error.
fn state_bytes(data: &[u8]) -> Option<Vec<u8>> {
    let (&mode, rest) = data.split_first()?;
    Some(if mode & 1 == 0 {
        rest.to_vec()
    } else {
        envelope(rest)
    })
}

/// The snapshot envelope and the [`Moment`] inside it.
pub fn snapshot_state(data: &[u8]) {
    let Some(bytes) = state_bytes(data) else {
        return;
    };
    if let Ok(m) = snapshot::decode::<Moment>(&bytes) {
        // What a loader computes from it right away.
        let _ = m.layout.kinds();
        let _ = m.layout.to_string();
        // Must not overflow or allocate by the claimed size.
        let _ = crate::moment::ram_regions(m.mem_mib.min(1 << 20));
        let again = snapshot::encode(&m).expect("a decoded state encodes");
        snapshot::decode::<Moment>(&again).expect("and decodes again");
    }
}

/// A snapshot directory (manifest.json, state, memory), as `--from` and
/// the store read one: the input is split into the manifest's bytes and the
/// state file's.
#[derive(Arbitrary, Debug)]
pub struct SnapshotDirInput {
    pub manifest: Vec<u8>,
    pub state: Vec<u8>,
    /// Size of the memory file (sparse).
    pub memory_len: u32,
    pub wrap_state: bool,
}

pub fn snapshot_dir(data: &[u8]) {
    let Ok(input) = SnapshotDirInput::arbitrary_take_rest(Unstructured::new(data)) else {
        return;
    };
    let dir = Scratch::new();
    let d = dir.path();
    let state = if input.wrap_state {
        snapshot::encode_raw(
            &input.state,
            &snapshot::Seal::of_manifest(&input.manifest, None),
        )
    } else {
        input.state.clone()
    };
    std::fs::write(d.join(crate::snapshot_dir::MANIFEST), &input.manifest).expect("write");
    std::fs::write(d.join(crate::snapshot_dir::STATE), &state).expect("write");
    let f = std::fs::File::create(d.join(crate::snapshot_dir::MEMORY)).expect("create");
    f.set_len(u64::from(input.memory_len)).expect("set_len");
    let _ = crate::snapshot_dir::load(d);
}

/// The devices' saved states (what a restore loads into fresh devices):
/// each `MmioState` of a decoded moment restored into a transport around a
/// fresh device of the kind its slot has, which then runs.
pub fn persist(data: &[u8]) {
    let Some(bytes) = state_bytes(data) else {
        return;
    };
    let Ok(moment) = snapshot::decode::<Moment>(&bytes) else {
        return;
    };
    restore_devices(&moment.devices.virtio, &moment.layout.kinds());
}

/// Restores `states` into fresh devices of `kinds` (slot order); every
/// refusal must be an error, and a restored device must run.
pub fn restore_devices(states: &[MmioState], kinds: &[String]) {
    let dir = Scratch::new();
    let mem = guest_memory();
    for (state, kind) in states.iter().zip(kinds).take(4) {
        let mut em = EventManager::<Subscriber>::new().expect("event manager");
        let mut _keep = None;
        let mut _keep_fd = None;
        let dev: Arc<Mutex<dyn VirtioDevice>> = match kind.as_str() {
            "virtio-blk" => {
                let d = Arc::new(Mutex::new(new_block(dir.path(), false)));
                em.add_subscriber(d.clone());
                d
            }
            "virtio-net" => {
                let (n, peer) = new_net();
                _keep_fd = Some(peer);
                let d = Arc::new(Mutex::new(n));
                em.add_subscriber(d.clone());
                d
            }
            _ => {
                let sub = Scratch::new();
                let (v, l) = new_vsock(sub.path());
                _keep = Some((l, sub));
                let d = Arc::new(Mutex::new(v));
                em.add_subscriber(d.clone());
                d
            }
        };
        let mut t = MmioTransport::new(mem.clone(), dev).expect("transport");
        if t.restore_state(state).is_ok() {
            settle(&mut em);
            for q in 0..3 {
                wr(&mut t, QUEUE_NOTIFY_OFFSET, q);
            }
            settle(&mut em);
            let _ = t.state();
        }
    }
}

#[cfg(test)]
mod tests {
    //! The harnesses above as property tests: random inputs, plus every
    //! checked-in regression input under `fuzz/regressions/<target>/`.

    use proptest::prelude::*;

    use super::*;

    fn config(cases: u32) -> ProptestConfig {
        ProptestConfig {
            cases,
            failure_persistence: None,
            ..ProptestConfig::default()
        }
    }

    fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), 0..max)
    }

    /// Replays fuzz/regressions/`target`/* through `harness`.
    fn replay(target: &str, harness: fn(&[u8])) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fuzz/regressions")
            .join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for e in entries.flatten() {
            let bytes = std::fs::read(e.path()).expect("regression input");
            harness(&bytes);
        }
    }

    proptest! {
        #![proptest_config(config(64))]

        #[test]
        fn prop_virtio_blk_chains_never_panic(data in bytes(2048)) {
            virtio_blk(&data);
        }

        #[test]
        fn prop_virtio_net_chains_never_panic(data in bytes(2048)) {
            virtio_net(&data);
        }

        #[test]
        fn prop_virtio_vsock_chains_never_panic(data in bytes(2048)) {
            virtio_vsock(&data);
        }

        #[test]
        fn prop_mmio_any_access_order_never_panics(data in bytes(2048)) {
            mmio(&data);
        }

        #[test]
        fn prop_snapshot_dir_refuses_garbage(data in bytes(1024)) {
            snapshot_dir(&data);
        }
    }

    proptest! {
        #![proptest_config(config(256))]

        #[test]
        fn prop_vsock_packet_parse_never_panics(data in bytes(1024)) {
            vsock_packet(&data);
        }

        #[test]
        fn prop_snapshot_state_refuses_garbage(data in bytes(1024)) {
            snapshot_state(&data);
            persist(&data);
        }

        /// A well-formed header and payload in one readable buffer parse
        /// back to exactly what was written.
        #[test]
        fn prop_vsock_tx_packet_round_trip(
            src_port: u32, dst_port: u32, op: u16, flags: u32, buf_alloc: u32, fwd_cnt: u32,
            payload in bytes(512), split in 0usize..600,
        ) {
            let mem = guest_memory();
            let hdr = VsockHeader {
                src_cid: 3, dst_cid: 2, src_port, dst_port, len: payload.len() as u32,
                type_: packet::TYPE_STREAM, op, flags, buf_alloc, fwd_cnt,
            };
            let mut wire = hdr.to_bytes().to_vec();
            wire.extend_from_slice(&payload);
            mem.write_slice(&wire, GuestAddress(DATA)).unwrap();
            // Two buffers split anywhere, or one.
            let split = split.min(wire.len());
            let mut descs = vec![FuzzDesc {
                addr: FuzzAddr::Data(0), len: FuzzLen::Small(split as u16), flags: 1, next: 1,
            }];
            descs.push(FuzzDesc {
                addr: FuzzAddr::Data(split as u16),
                len: FuzzLen::Small((wire.len() - split) as u16), flags: 0, next: 0,
            });
            write_queue(&mem, 0, &FuzzQueue { descs, heads: vec![0], bogus_idx: None });
            use virtio_queue::{Queue, QueueT};
            let mut q = Queue::new(QSIZE).unwrap();
            q.try_set_desc_table_address(GuestAddress(QUEUE_BASE)).unwrap();
            q.try_set_avail_ring_address(GuestAddress(QUEUE_BASE + 0x1000)).unwrap();
            q.try_set_used_ring_address(GuestAddress(QUEUE_BASE + 0x2000)).unwrap();
            q.set_ready(true);
            let chain = q.pop_descriptor_chain(&mem).unwrap();
            let p = packet::read_tx_packet(&mem, chain).unwrap();
            prop_assert_eq!(p.hdr, hdr);
            prop_assert_eq!(p.data, payload);
        }
    }

    #[test]
    fn test_fuzz_regressions_replay() {
        for (target, harness) in [
            ("virtio_blk", virtio_blk as fn(&[u8])),
            ("virtio_net", virtio_net),
            ("virtio_vsock", virtio_vsock),
            ("vsock_packet", vsock_packet),
            ("mmio", mmio),
            ("snapshot_state", snapshot_state),
            ("snapshot_dir", snapshot_dir),
            ("persist", persist),
        ] {
            replay(target, harness);
        }
    }

    #[test]
    fn test_envelope_matches_snapshot_encode() {
        let m = serde_json::json!({"a": [1, 2, 3]});
        let payload = serde_json::to_vec(&m).unwrap();
        assert_eq!(envelope(&payload), snapshot::encode(&m).unwrap());
    }
}
