//! The virtio-net device: configuration, features, rx and tx paths.

use std::io;
use std::sync::Arc;

use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_NET;
use virtio_bindings::virtio_net::{VIRTIO_NET_F_MAC, VIRTIO_NET_F_STATUS, VIRTIO_NET_S_LINK_UP};
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::tap::{Tap, TapError};
use super::{MAX_BUFFER_LEN, QUEUE_SIZE, VNET_HDR_LEN};
use crate::devices::virtio::queue::{read_config_space, ChainBuffers, GuestWarnings};
use crate::devices::virtio::{ActivateError, Interrupt, VirtioDevice, VIRTIO_MMIO_INT_VRING};
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

/// What the device holds once the driver started it.
struct Active {
    mem: GuestMemoryMmap,
    interrupt: Arc<Interrupt>,
    queues: [Queue; 2],
    queue_evts: [EventFd; 2],
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
    avail_features: u64,
    acked_features: u64,
    config_space: [u8; 8],
    queue_max_sizes: [u16; 2],
    pub(super) activate_evt: EventFd,
    active: Option<Active>,
    /// A frame read from the tap (header included), waiting for a buffer.
    rx_frame: Vec<u8>,
    rx_pending: usize,
    tx_frame: Vec<u8>,
    /// Whether the tap fd is in the event manager (it is taken out while the
    /// guest has no rx buffers, so the device thread does not spin).
    pub(super) tap_registered: bool,
    counters: NetCounters,
    warnings: GuestWarnings,
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
        let tap = Tap::open(&config.tap_name)?;
        let avail_features = (1u64 << VIRTIO_F_VERSION_1)
            | (1u64 << VIRTIO_NET_F_MAC)
            | (1u64 << VIRTIO_NET_F_STATUS);
        // struct virtio_net_config: mac[6], status.
        let mut config_space = [0u8; 8];
        config_space[..6].copy_from_slice(&config.mac);
        config_space[6..8].copy_from_slice(&(VIRTIO_NET_S_LINK_UP as u16).to_le_bytes());
        Ok(Self {
            config,
            tap,
            avail_features,
            acked_features: 0,
            config_space,
            queue_max_sizes: [QUEUE_SIZE; 2],
            activate_evt: EventFd::new(EFD_NONBLOCK).map_err(NetError::EventFd)?,
            active: None,
            rx_frame: vec![0; MAX_BUFFER_LEN],
            rx_pending: 0,
            tx_frame: Vec::with_capacity(MAX_BUFFER_LEN),
            tap_registered: false,
            counters: NetCounters::default(),
            warnings: GuestWarnings::default(),
        })
    }

    /// The configuration the device was built from.
    pub fn config(&self) -> &NetConfig {
        &self.config
    }

    /// Features the driver accepted.
    pub fn acked_features(&self) -> u64 {
        self.acked_features
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
            let Some(chain) = queue.pop_descriptor_chain(mem) else {
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
                            self.warnings
                                .warn(DEV, format_args!("rx buffer {head} outside guest memory"));
                            0
                        }
                    }
                }
                Ok(bufs) => {
                    let (have, need) = (bufs.writable_len(), frame.len());
                    self.warnings.warn(
                        DEV,
                        format_args!("rx buffer {head} holds {have} bytes, frame needs {need}"),
                    );
                    0
                }
                Err(e) => {
                    self.warnings
                        .warn(DEV, format_args!("rx buffer {head}: {e}"));
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
                self.warnings
                    .warn(DEV, format_args!("cannot return rx buffer {head}: {e}"));
                break Rx::NoBuffers;
            }
        };
        if used_any {
            notify(queue, mem, &active.interrupt);
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
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            match ChainBuffers::parse(chain) {
                Ok(bufs) => {
                    let len = bufs.readable_len();
                    if len <= VNET_HDR_LEN || len > MAX_BUFFER_LEN {
                        self.warnings
                            .warn(DEV, format_args!("tx frame {head} of {len} bytes dropped"));
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
                                            self.warnings
                                                .warn(DEV, format_args!("writing tap: {e}"));
                                        }
                                        self.counters.tx_dropped += 1;
                                    }
                                }
                            }
                            _ => {
                                self.warnings.warn(
                                    DEV,
                                    format_args!("tx frame {head} outside guest memory"),
                                );
                                self.counters.tx_dropped += 1;
                            }
                        }
                    }
                }
                Err(e) => {
                    self.warnings
                        .warn(DEV, format_args!("tx frame {head}: {e}"));
                    self.counters.tx_dropped += 1;
                }
            }
            used_any = true;
            if let Err(e) = queue.add_used(mem, head, 0) {
                self.warnings
                    .warn(DEV, format_args!("cannot return tx buffer {head}: {e}"));
                break;
            }
        }
        if used_any {
            notify(queue, mem, &active.interrupt);
        }
    }
}

fn notify(queue: &mut Queue, mem: &GuestMemoryMmap, interrupt: &Interrupt) {
    if queue.needs_notification(mem).unwrap_or(true) {
        if let Err(e) = interrupt.trigger(VIRTIO_MMIO_INT_VRING) {
            tracing::error!("{DEV}: cannot raise interrupt: {e}");
        }
    }
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_NET
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_max_sizes
    }

    fn avail_features(&self) -> u64 {
        self.avail_features
    }

    fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features & self.avail_features;
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_space(&self.config_space, offset, data);
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        // The MAC is writable only with VIRTIO_NET_F_CTRL_MAC_ADDR's legacy
        // path, which we do not offer.
        self.warnings.warn(
            DEV,
            format_args!("write to read-only config space at {offset:#x} ignored"),
        );
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
        let got = queues.len();
        let queues: [Queue; 2] = queues
            .try_into()
            .map_err(|_| ActivateError::QueueCount { got, want: 2 })?;
        let got = queue_evts.len();
        let queue_evts: [EventFd; 2] = queue_evts
            .try_into()
            .map_err(|_| ActivateError::QueueCount { got, want: 2 })?;
        self.active = Some(Active {
            mem,
            interrupt,
            queues,
            queue_evts,
        });
        self.activate_evt.write(1).map_err(ActivateError::Signal)
    }

    fn is_activated(&self) -> bool {
        self.active.is_some()
    }
}
