//! The virtio-net device: configuration, features, rx and tx paths.

use std::io;
use std::sync::Arc;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_net::{VIRTIO_NET_F_MAC, VIRTIO_NET_F_STATUS, VIRTIO_NET_S_LINK_UP};
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::EventFd;

use super::tap::{Tap, TapError};
use super::{MAX_BUFFER_LEN, QUEUE_SIZE, VNET_HDR_LEN};
use crate::devices::virtio::device_common::{signal_used, ActiveQueues, DeviceBase};
use crate::devices::virtio::queue::ChainBuffers;
use crate::devices::virtio::{ActivateError, Interrupt, VirtioDevice, VirtioDeviceState};
use crate::memory::GuestMemoryMmap;

const DEV: &str = "virtio-net";
const RX: usize = 0;
const TX: usize = 1;

/// How to build a [`Net`] device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    /// Tap interface on the host (created if absent).
    pub tap_name: String,
    /// The guest's MAC address.
    pub mac: [u8; 6],
    /// An attached fd of the tap to adopt instead of opening it.
    pub tap_fd: Option<i32>,
}

/// Errors while creating a network device.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// Creating the activation eventfd failed.
    #[error("Cannot create an eventfd for the network device")]
    EventFd(#[source] io::Error),
    /// The tap cannot be opened.
    #[error(transparent)]
    Tap(#[from] TapError),
}

/// Frame counters (monotonic).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NetCounters {
    /// Frames delivered to the guest.
    pub rx_frames: u64,
    /// Frames from the tap dropped (too large for the guest's buffer, or
    /// runt frames).
    pub rx_dropped: u64,
    /// Frames written to the tap.
    pub tx_frames: u64,
    /// Guest frames dropped (malformed, or the tap refused them).
    pub tx_dropped: u64,
}

/// Outcome of an rx pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rx {
    /// The tap has no more frames.
    TapDrained,
    /// A frame waits for the guest to post rx buffers: stop polling the tap.
    NoBuffers,
}

/// A virtio-net device backed by a tap.
pub struct Net {
    config: NetConfig,
    pub(super) tap: Tap,
    pub(super) base: DeviceBase,
    active: Option<ActiveQueues<2>>,
    /// A frame read from the tap (header included), waiting for a buffer.
    rx_frame: Vec<u8>,
    rx_pending: usize,
    tx_frame: Vec<u8>,
    /// Whether the tap fd is in the event manager (it is taken out while the
    /// guest has no rx buffers, so the device thread does not spin).
    pub(super) tap_registered: bool,
    /// The tap reported an error or hang-up: it is never polled again.
    pub(super) tap_failed: bool,
    counters: NetCounters,
}

impl std::fmt::Debug for Net {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Net")
            .field("config", &self.config)
            .field("activated", &self.active.is_some())
            .field("counters", &self.counters)
            .finish()
    }
}

impl Net {
    /// Opens (or creates) the tap.
    pub fn new(config: NetConfig) -> Result<Self, NetError> {
        let tap = match config.tap_fd {
            Some(fd) => Tap::adopt(fd, &config.tap_name),
            None => Tap::open(&config.tap_name)?,
        };
        let avail_features = (1u64 << VIRTIO_F_VERSION_1)
            | (1u64 << VIRTIO_NET_F_MAC)
            | (1u64 << VIRTIO_NET_F_STATUS);
        // struct virtio_net_config: mac[6], status.
        let mut config_space = [0u8; 8];
        config_space[..6].copy_from_slice(&config.mac);
        config_space[6..8].copy_from_slice(&(VIRTIO_NET_S_LINK_UP as u16).to_le_bytes());
        let base = DeviceBase::new(
            DEV,
            VIRTIO_ID_NET,
            avail_features,
            &[QUEUE_SIZE; 2],
            &config_space,
        )
        .map_err(NetError::EventFd)?;
        Ok(Self {
            config,
            tap,
            base,
            active: None,
            rx_frame: vec![0; MAX_BUFFER_LEN],
            rx_pending: 0,
            tx_frame: Vec::with_capacity(MAX_BUFFER_LEN),
            tap_registered: false,
            tap_failed: false,
            counters: NetCounters::default(),
        })
    }

    /// The configuration the device was built from.
    pub fn config(&self) -> &NetConfig {
        &self.config
    }

    /// Features the driver accepted.
    pub fn acked_features(&self) -> u64 {
        self.base.acked_features()
    }

    /// The tap's fd (kept open across a fork for the continuation).
    pub fn tap_fd(&self) -> i32 {
        self.tap.raw_fd()
    }

    /// Frame counters.
    pub fn counters(&self) -> NetCounters {
        self.counters
    }

    /// The rx (0) and tx (1) notification eventfds, once activated.
    pub(super) fn queue_evt(&self, index: usize) -> Option<&EventFd> {
        self.active.as_ref().and_then(|a| a.queue_evts.get(index))
    }

    /// Whether a frame from the tap waits for guest buffers.
    pub(super) fn rx_pending(&self) -> bool {
        self.rx_pending != 0
    }

    /// Moves frames from the tap into the guest's rx buffers until the tap
    /// is empty or the guest has no buffer left.
    pub(super) fn process_rx(&mut self) -> Rx {
        let Some(active) = self.active.as_mut() else {
            return Rx::NoBuffers;
        };
        let mem = &active.mem;
        let queue = &mut active.queues[RX];
        let mut used_any = false;
        let outcome = loop {
            if self.rx_pending == 0 {
                match self.tap.read_frame(&mut self.rx_frame) {
                    Ok(n) if n <= VNET_HDR_LEN => {
                        self.counters.rx_dropped += 1;
                        continue;
                    }
                    Ok(n) => self.rx_pending = n,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break Rx::TapDrained,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        tracing::error!("{DEV}: reading tap {}: {e}", self.tap.name());
                        break Rx::TapDrained;
                    }
                }
            }
            let Some(chain) = self.base.pop_chain(queue, mem) else {
                break Rx::NoBuffers;
            };
            let head = chain.head_index();
            let frame = &mut self.rx_frame[..self.rx_pending];
            // virtio_net_hdr_v1: no offload information, one buffer.
            frame[..VNET_HDR_LEN].fill(0);
            frame[10..12].copy_from_slice(&1u16.to_le_bytes());
            let written = match ChainBuffers::parse(chain) {
                Ok(bufs) if bufs.writable_len() >= frame.len() => {
                    match bufs.write_at(mem, 0, frame) {
                        Ok(n) if n == frame.len() => n,
                        _ => {
                            self.base
                                .warn(format_args!("rx buffer {head} outside guest memory"));
                            0
                        }
                    }
                }
                Ok(bufs) => {
                    let (have, need) = (bufs.writable_len(), frame.len());
                    self.base.warn(format_args!(
                        "rx buffer {head} holds {have} bytes, frame needs {need}"
                    ));
                    0
                }
                Err(e) => {
                    self.base.warn(format_args!("rx buffer {head}: {e}"));
                    0
                }
            };
            if written == 0 {
                self.counters.rx_dropped += 1;
            } else {
                self.counters.rx_frames += 1;
            }
            self.rx_pending = 0;
            used_any = true;
            // `written` fits: it is at most MAX_BUFFER_LEN.
            if let Err(e) = queue.add_used(mem, head, written as u32) {
                self.base
                    .warn(format_args!("cannot return rx buffer {head}: {e}"));
                break Rx::NoBuffers;
            }
        };
        if used_any {
            signal_used(queue, mem, &active.interrupt, DEV);
        }
        outcome
    }

    /// Sends every frame the guest queued for transmission.
    pub(super) fn process_tx(&mut self) {
        let Some(active) = self.active.as_mut() else {
            return;
        };
        let mem = &active.mem;
        let queue = &mut active.queues[TX];
        let mut used_any = false;
        while let Some(chain) = self.base.pop_chain(queue, mem) {
            let head = chain.head_index();
            match ChainBuffers::parse(chain) {
                Ok(bufs) => {
                    let len = bufs.readable_len();
                    if len <= VNET_HDR_LEN || len > MAX_BUFFER_LEN {
                        self.base
                            .warn(format_args!("tx frame {head} of {len} bytes dropped"));
                        self.counters.tx_dropped += 1;
                    } else {
                        self.tx_frame.resize(len, 0);
                        match bufs.read_at(mem, 0, &mut self.tx_frame) {
                            Ok(n) if n == len => {
                                // We offered no offloads: whatever the guest put in
                                // the header, the tap gets a plain frame.
                                self.tx_frame[..VNET_HDR_LEN].fill(0);
                                match self.tap.write_frame(&self.tx_frame) {
                                    Ok(_) => self.counters.tx_frames += 1,
                                    Err(e) => {
                                        // Like a NIC with a full ring: drop.
                                        if e.kind() != io::ErrorKind::WouldBlock {
                                            self.base.warn(format_args!("writing tap: {e}"));
                                        }
                                        self.counters.tx_dropped += 1;
                                    }
                                }
                            }
                            _ => {
                                self.base
                                    .warn(format_args!("tx frame {head} outside guest memory"));
                                self.counters.tx_dropped += 1;
                            }
                        }
                    }
                }
                Err(e) => {
                    self.base.warn(format_args!("tx frame {head}: {e}"));
                    self.counters.tx_dropped += 1;
                }
            }
            used_any = true;
            if let Err(e) = queue.add_used(mem, head, 0) {
                self.base
                    .warn(format_args!("cannot return tx buffer {head}: {e}"));
                break;
            }
        }
        if used_any {
            signal_used(queue, mem, &active.interrupt, DEV);
        }
    }
}

/// A net device keeps no guest-visible state of its own: its features are
/// in the transport and its MAC in its configuration. A frame read from the
/// tap but not yet delivered is dropped by a fork, as a network may drop it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetState {}

impl crate::persist::Persist for Net {
    type State = NetState;
    type ConstructorArgs = NetConfig;
    type Error = NetError;

    fn save(&self) -> Result<NetState, NetError> {
        Ok(NetState {})
    }

    fn restore(config: NetConfig, _: &NetState) -> Result<Self, NetError> {
        Net::new(config)
    }
}

impl VirtioDevice for Net {
    fn save_device(&self) -> VirtioDeviceState {
        VirtioDeviceState::Net(NetState {})
    }

    fn load_device(&mut self, state: &VirtioDeviceState) -> Result<(), String> {
        match state {
            VirtioDeviceState::Net(NetState {}) => Ok(()),
            other => Err(format!("net state expected, {} state saved", other.kind())),
        }
    }

    fn base(&self) -> &DeviceBase {
        &self.base
    }

    fn base_mut(&mut self) -> &mut DeviceBase {
        &mut self.base
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
        queues: Vec<Queue>,
        queue_evts: Vec<EventFd>,
    ) -> Result<(), ActivateError> {
        if self.active.is_some() {
            return Err(ActivateError::Device("already activated".into()));
        }
        self.active = Some(ActiveQueues::new(mem, interrupt, queues, queue_evts)?);
        self.base.signal_activation()
    }

    fn is_activated(&self) -> bool {
        self.active.is_some()
    }

    fn active_queues(&self) -> Option<&[Queue]> {
        self.active.as_ref().map(|a| &a.queues[..])
    }
}

#[cfg(test)]
mod tests {
    use std::ffi::CString;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::process::Command;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Mutex;

    use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::devices::virtio::mmio::testing::{linux_probe, wr};
    use crate::devices::virtio::mmio::{MmioTransport, QUEUE_NOTIFY_OFFSET};
    use crate::devices::virtio::queue::testing::{TestQueue, F_WRITE};
    use crate::devices::virtio::VIRTIO_MMIO_INT_VRING;

    type Em = EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>;

    const MAC: [u8; 6] = [0x06, 0, 0xac, 0x10, 0, 2];
    /// IEEE "local experimental" ethertype: nothing else on the tap uses it.
    const ETHERTYPE: u16 = 0x88b5;
    const TX_HDR: u64 = 0x8_0000;
    const TX_FRAME: u64 = 0x8_1000;
    const RX_BUFS: u64 = 0x10_0000;
    const RX_BUF_LEN: u32 = 12 + 1518;

    fn unique_tap_name() -> String {
        static N: AtomicU32 = AtomicU32::new(0);
        format!(
            "tvt{}x{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        )
    }

    fn frame(payload: &[u8]) -> Vec<u8> {
        let mut f = vec![0xff; 6];
        f.extend_from_slice(&MAC);
        f.extend_from_slice(&ETHERTYPE.to_be_bytes());
        f.extend_from_slice(payload);
        f.resize(f.len().max(60), 0);
        f
    }

    /// An AF_PACKET socket on the host side of the tap.
    struct PacketSocket(OwnedFd);

    impl PacketSocket {
        fn bind(ifname: &str) -> Self {
            let name = CString::new(ifname).expect("name");
            // SAFETY: `name` is a valid NUL-terminated string.
            let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
            assert_ne!(index, 0, "tap {ifname} has no ifindex");
            let proto = (libc::ETH_P_ALL as u16).to_be();
            // SAFETY: plain socket creation; the fd is checked below.
            let fd = unsafe {
                libc::socket(
                    libc::AF_PACKET,
                    libc::SOCK_RAW | libc::SOCK_CLOEXEC,
                    i32::from(proto),
                )
            };
            assert!(
                fd >= 0,
                "packet socket: {}",
                std::io::Error::last_os_error()
            );
            // SAFETY: `fd` is a new socket nobody else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: sockaddr_ll is plain data; all-zero is a valid value.
            let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
            sll.sll_family = libc::AF_PACKET as u16;
            sll.sll_protocol = proto;
            sll.sll_ifindex = index as i32;
            // SAFETY: `sll` is a valid sockaddr_ll of the size passed.
            let ret = unsafe {
                libc::bind(
                    fd.as_raw_fd(),
                    &sll as *const libc::sockaddr_ll as *const libc::sockaddr,
                    std::mem::size_of::<libc::sockaddr_ll>() as u32,
                )
            };
            assert_eq!(ret, 0, "bind: {}", std::io::Error::last_os_error());
            let tv = libc::timeval {
                tv_sec: 0,
                tv_usec: 200_000,
            };
            // SAFETY: SO_RCVTIMEO reads a timeval of the size passed.
            let ret = unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    &tv as *const libc::timeval as *const libc::c_void,
                    std::mem::size_of::<libc::timeval>() as u32,
                )
            };
            assert_eq!(ret, 0);
            Self(fd)
        }

        fn send(&self, frame: &[u8]) {
            // SAFETY: the buffer is valid for `frame.len()` bytes.
            let n =
                unsafe { libc::send(self.0.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
            assert_eq!(
                n,
                frame.len() as isize,
                "send: {}",
                std::io::Error::last_os_error()
            );
        }

        /// Next frame with our ethertype, or None after ~2 s.
        fn recv_ours(&self) -> Option<Vec<u8>> {
            let mut buf = vec![0u8; 65536];
            for _ in 0..10 {
                // SAFETY: the buffer is valid for its length.
                let n = unsafe {
                    libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0)
                };
                if n >= 14 && buf[12..14] == ETHERTYPE.to_be_bytes() {
                    return Some(buf[..n as usize].to_vec());
                }
            }
            None
        }
    }

    struct Rig {
        mem: GuestMemoryMmap,
        net: Arc<Mutex<Net>>,
        transport: MmioTransport,
        em: Em,
        rx: TestQueue,
        tx: TestQueue,
        tap_name: String,
    }

    impl Rig {
        fn new() -> Self {
            let tap_name = unique_tap_name();
            let net = Net::new(NetConfig {
                tap_name: tap_name.clone(),
                mac: MAC,
                tap_fd: None,
            })
            .expect("tap (these tests need root / CAP_NET_ADMIN and /dev/net/tun)");
            let _ = Command::new("sysctl")
                .arg("-qw")
                .arg(format!("net.ipv6.conf.{tap_name}.disable_ipv6=1"))
                .status();
            let up = Command::new("ip")
                .args(["link", "set", &tap_name, "up"])
                .status()
                .expect("ip");
            assert!(up.success(), "ip link set {tap_name} up");
            let net = Arc::new(Mutex::new(net));
            let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).expect("mem");
            let mut transport = MmioTransport::new(mem.clone(), net.clone()).expect("transport");
            let mut em = Em::new().expect("event manager");
            em.add_subscriber(net.clone());
            let rx = TestQueue::new(&mem, 0x1_0000, QUEUE_SIZE);
            let tx = TestQueue::new(&mem, 0x2_0000, QUEUE_SIZE);
            let features = (1u64 << VIRTIO_NET_F_MAC) | (1u64 << VIRTIO_NET_F_STATUS);
            let probe = linux_probe(&mut transport, features, &[rx, tx]);
            assert_eq!(probe, 0xf);
            em.run_with_timeout(100).expect("activate");
            assert!(net.lock().expect("lock").is_activated());
            Self {
                mem,
                net,
                transport,
                em,
                rx: TestQueue::new_at(0x1_0000, QUEUE_SIZE),
                tx: TestQueue::new_at(0x2_0000, QUEUE_SIZE),
                tap_name,
            }
        }

        fn run_until(&mut self, mut done: impl FnMut(&Self) -> bool) -> bool {
            for _ in 0..40 {
                if done(self) {
                    return true;
                }
                self.em.run_with_timeout(50).expect("run");
            }
            done(self)
        }

        fn post_rx_buffers(&mut self, n: u64) {
            for i in 0..n {
                let addr = RX_BUFS + i * 0x1000;
                self.rx.add_chain(&self.mem, &[(addr, RX_BUF_LEN, F_WRITE)]);
            }
            wr(&mut self.transport, QUEUE_NOTIFY_OFFSET, 0);
        }

        /// The payloads of used rx buffers that carry our ethertype.
        fn received(&self, from: u16) -> Vec<(Vec<u8>, Vec<u8>)> {
            let mut out = Vec::new();
            let mut i = from;
            while i != self.rx.used_idx(&self.mem) {
                let (id, len) = self.rx.used_elem(&self.mem, i);
                let mut buf = vec![0u8; len as usize];
                let addr = RX_BUFS + u64::from(id) * 0x1000;
                self.mem
                    .read_slice(&mut buf, GuestAddress(addr))
                    .expect("rx buf");
                if buf.len() >= 26 && buf[24..26] == ETHERTYPE.to_be_bytes() {
                    out.push((buf[..12].to_vec(), buf[12..].to_vec()));
                }
                i = i.wrapping_add(1);
            }
            out
        }
    }

    #[test]
    fn test_net_guest_frame_reaches_tap() {
        let mut rig = Rig::new();
        let sock = PacketSocket::bind(&rig.tap_name);
        let f = frame(b"hello from the guest");
        // A header the guest filled with junk: the device sends a plain frame.
        rig.mem
            .write_slice(&[0x5a; 12], GuestAddress(TX_HDR))
            .expect("hdr");
        rig.mem
            .write_slice(&f, GuestAddress(TX_FRAME))
            .expect("frame");
        rig.tx
            .add_chain(&rig.mem, &[(TX_HDR, 12, 0), (TX_FRAME, f.len() as u32, 0)]);
        wr(&mut rig.transport, QUEUE_NOTIFY_OFFSET, 1);

        assert!(rig.run_until(|r| r.tx.used_idx(&r.mem) == 1));

        assert_eq!(rig.tx.used_elem(&rig.mem, 0), (0, 0));
        assert_eq!(sock.recv_ours().expect("frame on the tap"), f);
        let c = rig.net.lock().expect("lock").counters();
        assert_eq!((c.tx_frames, c.tx_dropped), (1, 0));

        // A chain outside guest memory and a runt are dropped, not fatal.
        rig.tx.add_chain(&rig.mem, &[(0x1_0000_0000, 100, 0)]);
        rig.tx.add_chain(&rig.mem, &[(TX_HDR, 12, 0)]);
        wr(&mut rig.transport, QUEUE_NOTIFY_OFFSET, 1);
        assert!(rig.run_until(|r| r.tx.used_idx(&r.mem) == 3));
        assert_eq!(rig.net.lock().expect("lock").counters().tx_dropped, 2);
    }

    #[test]
    fn test_net_tap_frame_waits_for_guest_buffers_then_arrives() {
        let mut rig = Rig::new();
        let sock = PacketSocket::bind(&rig.tap_name);
        let f = frame(b"hello from the host");

        // No rx buffers yet: the frame is read, held, and the tap is no
        // longer polled (no busy loop).
        sock.send(&f);
        assert!(rig.run_until(|r| r.net.lock().expect("lock").rx_pending()));
        assert!(!rig.net.lock().expect("lock").tap_registered);
        let mut events = 0;
        for _ in 0..3 {
            events += rig.em.run_with_timeout(30).expect("run");
        }
        assert_eq!(
            events, 0,
            "device thread idles while the guest has no buffers"
        );

        rig.post_rx_buffers(8);
        assert!(rig.run_until(|r| !r.received(0).is_empty()));

        let got = rig.received(0);
        let (hdr, payload) = &got[0];
        let mut want_hdr = [0u8; 12];
        want_hdr[10] = 1; // num_buffers
        assert_eq!(hdr[..], want_hdr[..]);
        assert_eq!(payload, &f);
        assert!(rig.net.lock().expect("lock").tap_registered);
        assert_ne!(
            rig.transport.interrupt().status() & VIRTIO_MMIO_INT_VRING,
            0
        );

        // With buffers posted, the next frame flows straight through.
        let used_before = rig.rx.used_idx(&rig.mem);
        let f2 = frame(b"second");
        sock.send(&f2);
        assert!(rig.run_until(|r| !r.received(used_before).is_empty()));
        assert_eq!(rig.received(used_before)[0].1, f2);
    }

    #[test]
    fn test_net_frame_larger_than_rx_buffer_dropped() {
        let mut rig = Rig::new();
        let sock = PacketSocket::bind(&rig.tap_name);
        // One buffer too small for any frame.
        rig.rx.add_chain(&rig.mem, &[(RX_BUFS, 20, F_WRITE)]);
        wr(&mut rig.transport, QUEUE_NOTIFY_OFFSET, 0);
        rig.em.run_with_timeout(50).expect("run");
        sock.send(&frame(b"too big"));
        assert!(rig.run_until(|r| r.rx.used_idx(&r.mem) == 1));
        assert_eq!(rig.rx.used_elem(&rig.mem, 0), (0, 0));
        assert!(rig.net.lock().expect("lock").counters().rx_dropped >= 1);
    }

    #[test]
    fn test_net_bad_tap_name_error_names_it() {
        for name in ["", "a/b", "0123456789abcdefgh"] {
            let err = Net::new(NetConfig {
                tap_name: name.into(),
                mac: MAC,
                tap_fd: None,
            })
            .expect_err("invalid name");
            assert!(matches!(err, NetError::Tap(TapError::InvalidName(_))));
            assert!(err.to_string().contains(&format!("{name:?}")));
        }
    }

    #[test]
    fn test_net_config_space_mac_and_link_up() {
        let rig = Rig::new();
        let net = rig.net.lock().expect("lock");
        let mut b = [0u8; 8];
        net.read_config(0, &mut b);
        assert_eq!(&b[..6], &MAC);
        assert_eq!(
            u16::from_le_bytes([b[6], b[7]]),
            VIRTIO_NET_S_LINK_UP as u16
        );
        assert_eq!(net.config().tap_name, rig.tap_name);
    }
}
