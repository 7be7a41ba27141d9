//! The virtio-vsock device: configuration space, features, activation and
//! the rx/tx queue loops. Connections live in the [`VsockMuxer`].

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use event_manager::EventOps;
use tracing::{debug, trace, warn};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_ids::VIRTIO_ID_VSOCK;
use virtio_queue::{Queue, QueueT};
use vm_memory::Bytes;
use vmm_sys_util::eventfd::EventFd;

use super::packet::{read_tx_packet, PacketError, RxBuffer};
use super::unix::{Unanswered, VsockMuxer};
use super::{VsockConfig, VsockError};
use crate::devices::virtio::device_common::{raise_vring, ActiveQueues, DeviceBase};
use crate::devices::virtio::{ActivateError, Interrupt, VirtioDevice, VirtioDeviceState};
use crate::memory::GuestMemoryMmap;

/// Number of queues: rx, tx, event.
pub const NUM_QUEUES: usize = 3;
/// Size of each queue.
pub const QUEUE_SIZE: u16 = 256;
/// Index of the rx queue (device → guest).
pub const RXQ: usize = 0;
/// Index of the tx queue (guest → device).
pub const TXQ: usize = 1;
/// Index of the event queue.
pub const EVQ: usize = 2;

const DEV: &str = "vsock";
/// Upper bound of tx/rx rounds per event, a guard against livelock.
const MAX_ROUNDS: usize = 64;

/// A virtio-vsock device (type 19) bridging guest streams to Unix sockets.
pub struct Vsock {
    cid: u64,
    pub(super) base: DeviceBase,
    pub(super) muxer: VsockMuxer,
    pub(super) active: Option<ActiveQueues<NUM_QUEUES>>,
    pub(super) queue_evts_registered: bool,
    tx_stalled: bool,
    /// Where the transport reset of a restore stands (see [`Reset`]).
    pub(super) reset: Reset,
    uds_path: PathBuf,
    /// (device, inode) of the socket file we bound, to remove it on drop
    /// only if it is still ours.
    uds_id: (u64, u64),
}

impl Vsock {
    /// Creates the device and starts listening on `config.uds_path`.
    ///
    /// If the path exists and something accepts connections on it, another
    /// vm uses it and this fails; a stale socket file (connection refused)
    /// is removed and replaced.
    pub fn new(config: VsockConfig) -> Result<Self, VsockError> {
        let VsockConfig {
            guest_cid,
            uds_path,
        } = config;
        if !(3..u64::from(u32::MAX)).contains(&guest_cid) {
            return Err(VsockError::InvalidCid(guest_cid));
        }
        let listener = bind_listener(&uds_path)?;
        let uds_id = std::fs::metadata(&uds_path)
            .map(|m| (m.dev(), m.ino()))
            .unwrap_or((0, 0));
        // Config space: guest_cid (le64).
        let base = DeviceBase::new(
            DEV,
            VIRTIO_ID_VSOCK,
            1u64 << VIRTIO_F_VERSION_1,
            &[QUEUE_SIZE; NUM_QUEUES],
            &guest_cid.to_le_bytes(),
        )
        .map_err(VsockError::EventFd)?;
        Ok(Self {
            cid: guest_cid,
            base,
            muxer: VsockMuxer::new(guest_cid, uds_path.clone(), listener),
            active: None,
            queue_evts_registered: false,
            tx_stalled: false,
            reset: Reset::None,
            uds_path,
            uds_id,
        })
    }

    /// The guest's CID.
    pub fn guest_cid(&self) -> u64 {
        self.cid
    }

    /// The host socket path.
    pub fn uds_path(&self) -> &Path {
        &self.uds_path
    }

    /// Live connections (for tests and diagnostics).
    pub fn connection_count(&self) -> usize {
        self.muxer.connection_count()
    }

    /// Features the driver accepted.
    pub fn acked_features(&self) -> u64 {
        self.base.acked_features()
    }

    /// Tells the driver that every connection it had is gone (the host
    /// sockets belonged to the process the vm was saved from): one
    /// VIRTIO_VSOCK_EVENT_TRANSPORT_RESET on the event queue, as Firecracker
    /// does after a snapshot restore. Waits for an event buffer if the
    /// driver has none posted.
    pub(super) fn send_transport_reset(&mut self) {
        if self.reset != Reset::Pending {
            return;
        }
        let Some(ActiveQueues {
            mem,
            queues,
            interrupt,
            ..
        }) = self.active.as_mut()
        else {
            return;
        };
        let queue = &mut queues[EVQ];
        let Some(chain) = self.base.pop_chain(queue, &*mem) else {
            return;
        };
        let head = chain.head_index();
        let mut len = 0;
        if let Some(desc) = chain.clone().find(|d| d.is_write_only() && d.len() >= 4) {
            // struct virtio_vsock_event { le32 id }; id 0 = TRANSPORT_RESET.
            if mem.write_obj(0u32.to_le(), desc.addr()).is_ok() {
                len = 4;
            }
        }
        // The driver posts an event buffer again once it has handled this
        // one; until its avail index moves past this, no rx goes out. Read
        // before the buffer is returned: a running driver may answer at once.
        let posted = queue
            .avail_idx(&*mem, std::sync::atomic::Ordering::Acquire)
            .map(|w| w.0);
        self.reset = match (len, posted) {
            (4, Ok(posted)) => {
                debug!(
                    "vsock: transport reset sent (event buffer {head}, event avail idx {posted})"
                );
                Reset::Sent { posted }
            }
            _ => {
                self.base.warn(format_args!(
                    "the driver's event buffer is unusable; transport reset not sent"
                ));
                Reset::None
            }
        };
        if let Err(e) = queue.add_used(&*mem, head, len) {
            self.base
                .warn(format_args!("cannot return event buffer: {e}"));
        }
        raise_vring(interrupt, DEV);
    }

    /// After a transport reset went out: whether the driver has handled
    /// it (it posted an event buffer since). Then rx flows again.
    pub(super) fn check_reset_handled(&mut self) -> bool {
        let Reset::Sent { posted } = self.reset else {
            return false;
        };
        let Some(ActiveQueues { mem, queues, .. }) = self.active.as_ref() else {
            return false;
        };
        let now = queues[EVQ]
            .avail_idx(mem, std::sync::atomic::Ordering::Acquire)
            .map(|w| w.0)
            .unwrap_or(posted);
        if now == posted {
            return false;
        }
        debug!("vsock: the driver handled the transport reset (event avail idx {now}); rx flows");
        self.reset = Reset::None;
        true
    }

    /// Reports a host connection whose client stopped waiting for the
    /// guest's answer, with what says why it got none: whether the
    /// OP_REQUEST reached the guest, the rx queue's indices, the reset.
    pub(super) fn report_unanswered(&self, u: &Unanswered) {
        if self.active.is_none() {
            // Normal while the guest boots: readiness probes come before
            // its driver does.
            tracing::debug!(
                "vsock: the host stopped waiting for guest port {} before the driver was up",
                u.key.peer_port
            );
            return;
        }
        let rx = self.active.as_ref().map(|a| {
            let q = &a.queues[RXQ];
            let avail = q
                .avail_idx(&a.mem, std::sync::atomic::Ordering::Acquire)
                .map(|w| w.0);
            (q.next_avail(), avail, q.next_used(), a.interrupt.status())
        });
        warn!(
            "vsock: the host stopped waiting for guest port {} (host port {}) after {:.1} s: \
             the request {}; rx queue (next avail, avail idx, next used, interrupt status) {rx:?}; \
             transport reset {:?}",
            u.key.peer_port,
            u.key.local_port,
            u.waited.as_secs_f64(),
            if u.delivered {
                "reached the guest, which did not answer"
            } else {
                "never reached the guest (no rx buffer, or rx held back)"
            },
            self.reset,
        );
    }

    /// Moves packets between the queues and the muxer until nothing more
    /// can move, then interrupts the guest if any buffer was used.
    pub(super) fn run_queues(&mut self, ops: &mut EventOps, tx_first: bool) {
        if self.active.is_none() {
            return;
        }
        let mut used = false;
        if tx_first {
            used |= self.process_tx(ops);
        }
        // Nothing reaches the guest between a restore and the driver's
        // handling of the transport reset: the driver resets every socket
        // it has then, so a connection the host opened meanwhile (a fork
        // child's wake) would die with them. Linux serves the rx queue's
        // interrupt before the event queue's, so the order of the used
        // rings alone does not protect it.
        if self.reset != Reset::None {
            if self.muxer.has_rx() {
                trace!("vsock: rx held until the driver handled the transport reset");
            }
            if used {
                if let Some(active) = &self.active {
                    raise_vring(&active.interrupt, DEV);
                }
            }
            return;
        }
        for _ in 0..MAX_ROUNDS {
            used |= self.process_rx(ops);
            if self.tx_stalled && !self.muxer.rx_backlog_full() {
                used |= self.process_tx(ops);
            } else {
                break;
            }
        }
        if used {
            // One interrupt covers every queue this round used.
            if let Some(active) = &self.active {
                raise_vring(&active.interrupt, DEV);
            }
        }
    }

    /// Fills guest rx buffers with pending packets. Returns whether any
    /// buffer was used.
    fn process_rx(&mut self, ops: &mut EventOps) -> bool {
        let Some(ActiveQueues { mem, queues, .. }) = self.active.as_mut() else {
            return false;
        };
        let queue = &mut queues[RXQ];
        let mut used = false;
        while self.muxer.has_rx() {
            let Some(chain) = self.base.pop_chain(queue, &*mem) else {
                break;
            };
            let head = chain.head_index();
            let len = match RxBuffer::new(mem, chain) {
                Ok(buf) => match self.muxer.next_rx_packet(buf.data_capacity(), ops) {
                    Some((hdr, data)) => {
                        trace!("vsock: to guest {hdr} (rx head {head})");
                        buf.write(&hdr, &data).unwrap_or_else(|e| {
                            self.base.warn(format_args!("cannot write rx packet: {e}"));
                            0
                        })
                    }
                    None => {
                        // Nothing fits this buffer after all: give it back.
                        queue.set_next_avail(queue.next_avail().wrapping_sub(1));
                        break;
                    }
                },
                Err(e) => {
                    self.base.warn(format_args!("dropping rx buffer: {e}"));
                    0
                }
            };
            if let Err(e) = queue.add_used(&*mem, head, len) {
                self.base.warn(format_args!("cannot return rx buffer: {e}"));
            }
            used = true;
        }
        used
    }

    /// Consumes guest tx packets. Returns whether any buffer was used.
    fn process_tx(&mut self, ops: &mut EventOps) -> bool {
        let Some(ActiveQueues { mem, queues, .. }) = self.active.as_mut() else {
            return false;
        };
        let queue = &mut queues[TXQ];
        let mut used = false;
        self.tx_stalled = false;
        loop {
            if self.muxer.rx_backlog_full() {
                self.tx_stalled = true;
                break;
            }
            let Some(chain) = self.base.pop_chain(queue, &*mem) else {
                break;
            };
            let head = chain.head_index();
            match read_tx_packet(mem, chain) {
                Ok(pkt) => {
                    trace!("vsock: from guest {} (tx head {head})", pkt.hdr);
                    self.muxer.handle_tx(pkt, ops)
                }
                Err(PacketError::BadLength { hdr, len, avail }) => {
                    self.base.warn(format_args!(
                        "tx packet length {len} but {avail} bytes in chain, resetting"
                    ));
                    self.muxer.reject(&hdr, ops);
                }
                Err(e) => self.base.warn(format_args!("dropping tx chain: {e}")),
            }
            if let Err(e) = queue.add_used(&*mem, head, 0) {
                self.base.warn(format_args!("cannot return tx buffer: {e}"));
            }
            used = true;
        }
        used
    }
}

impl Drop for Vsock {
    fn drop(&mut self) {
        // Remove our socket file, unless someone replaced it meanwhile.
        if let Ok(m) = std::fs::metadata(&self.uds_path) {
            if (m.dev(), m.ino()) == self.uds_id {
                let _ = std::fs::remove_file(&self.uds_path);
            }
        }
    }
}

/// Binds the host listener, replacing a stale socket file and refusing a
/// path another vm serves.
fn bind_listener(path: &Path) -> Result<UnixListener, VsockError> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(VsockError::NotASocket(path.to_path_buf()));
        }
        match UnixStream::connect(path) {
            Ok(_) => return Err(VsockError::PathInUse(path.to_path_buf())),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                std::fs::remove_file(path).map_err(|source| VsockError::RemoveStale {
                    path: path.to_path_buf(),
                    source,
                })?;
            }
            Err(source) => {
                return Err(VsockError::Probe {
                    path: path.to_path_buf(),
                    source,
                })
            }
        }
    }
    let listener = UnixListener::bind(path).map_err(|source| VsockError::Bind {
        path: path.to_path_buf(),
        source,
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| VsockError::Bind {
            path: path.to_path_buf(),
            source,
        })?;
    Ok(listener)
}

impl VirtioDevice for Vsock {
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
        // Queue count first: a wrong count is reported even when active.
        let active = ActiveQueues::new(mem, interrupt, queues, queue_evts)?;
        if self.active.is_some() {
            return Err(ActivateError::Device("vsock is already active".into()));
        }
        self.active = Some(active);
        self.base.signal_activation()
    }

    fn is_activated(&self) -> bool {
        self.active.is_some()
    }

    fn active_queues(&self) -> Option<&[Queue]> {
        self.active.as_ref().map(|a| &a.queues[..])
    }

    fn restored(&mut self) {
        self.reset = Reset::Pending;
    }

    fn save_device(&self) -> VirtioDeviceState {
        VirtioDeviceState::Vsock(self.vsock_state())
    }

    fn load_device(&mut self, state: &VirtioDeviceState) -> Result<(), String> {
        match state {
            VirtioDeviceState::Vsock(s) => {
                self.muxer.set_next_local_port(s.next_local_port);
                Ok(())
            }
            other => Err(format!(
                "vsock state expected, {} state saved",
                other.kind()
            )),
        }
    }
}

impl Vsock {
    fn vsock_state(&self) -> VsockState {
        VsockState {
            next_local_port: self.muxer.next_local_port(),
        }
    }
}

impl crate::persist::Persist for Vsock {
    type State = VsockState;
    type ConstructorArgs = VsockConfig;
    type Error = VsockError;

    fn save(&self) -> Result<VsockState, VsockError> {
        Ok(self.vsock_state())
    }

    fn restore(config: VsockConfig, state: &VsockState) -> Result<Self, VsockError> {
        let mut v = Vsock::new(config)?;
        v.muxer.set_next_local_port(state.next_local_port);
        Ok(v)
    }
}

/// The transport reset a restored vsock owes its driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reset {
    /// None owed (a booted vm, or the driver has handled it).
    None,
    /// To send once the driver has an event buffer posted.
    Pending,
    /// Sent; the event queue's avail index was `posted` then.
    Sent { posted: u16 },
}

/// The vsock's own saved state: where host port numbering continues
/// ([`VsockMuxer::set_next_local_port`] says why).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VsockState {
    pub next_local_port: u32,
}
