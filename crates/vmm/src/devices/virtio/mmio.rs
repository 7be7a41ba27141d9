//! The virtio-mmio transport, version 2 ("modern"), as the Linux
//! `virtio_mmio` driver drives it (virtio 1.2, section 4.2.2).
//!
//! The transport owns the register file of one device: feature
//! negotiation, queue configuration and the status state machine. Every
//! guest write is checked against the state the spec allows it in; writes in
//! the wrong state, of the wrong size or with invalid values are ignored and
//! logged (a bounded number of times per device, so a hostile guest cannot
//! flood the log). On DRIVER_OK it hands the configured queues and their
//! notification `EventFd`s to [`VirtioDevice::activate`].

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FAILED, VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET,
    VIRTIO_F_VERSION_1,
};
use virtio_bindings::virtio_ring::VIRTIO_RING_F_EVENT_IDX;
use virtio_queue::{Queue, QueueState, QueueT};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::{Interrupt, VirtioDevice, VirtioDeviceState, VIRTIO_MMIO_INT_CONFIG};
use crate::devices::bus::BusDevice;
use crate::memory::GuestMemoryMmap;

/// Size of the MMIO window of one virtio-mmio device.
pub const MMIO_LEN: u64 = 0x1000;
/// Offset of the QueueNotify register: register each queue's `EventFd` as a
/// KVM ioeventfd at `base + QUEUE_NOTIFY_OFFSET` with the queue index as
/// datamatch (4-byte access).
pub const QUEUE_NOTIFY_OFFSET: u64 = 0x50;

const MAGIC_VALUE: u32 = 0x7472_6976; // "virt"
const MMIO_VERSION: u32 = 2;
const VENDOR_ID: u32 = 0;
const CONFIG_SPACE_OFFSET: u64 = 0x100;
/// Guest-error warnings logged per transport before going quiet.
const MAX_WARNINGS: u32 = 16;

// Register offsets (virtio 1.2, table 4.1).
const REG_MAGIC: u64 = 0x000;
const REG_VERSION: u64 = 0x004;
const REG_DEVICE_ID: u64 = 0x008;
const REG_VENDOR_ID: u64 = 0x00c;
const REG_DEVICE_FEATURES: u64 = 0x010;
const REG_DEVICE_FEATURES_SEL: u64 = 0x014;
const REG_DRIVER_FEATURES: u64 = 0x020;
const REG_DRIVER_FEATURES_SEL: u64 = 0x024;
const REG_QUEUE_SEL: u64 = 0x030;
const REG_QUEUE_NUM_MAX: u64 = 0x034;
const REG_QUEUE_NUM: u64 = 0x038;
const REG_QUEUE_READY: u64 = 0x044;
const REG_INTERRUPT_STATUS: u64 = 0x060;
const REG_INTERRUPT_ACK: u64 = 0x064;
const REG_STATUS: u64 = 0x070;
const REG_QUEUE_DESC_LOW: u64 = 0x080;
const REG_QUEUE_DESC_HIGH: u64 = 0x084;
const REG_QUEUE_DRIVER_LOW: u64 = 0x090;
const REG_QUEUE_DRIVER_HIGH: u64 = 0x094;
const REG_QUEUE_DEVICE_LOW: u64 = 0x0a0;
const REG_QUEUE_DEVICE_HIGH: u64 = 0x0a4;
const REG_SHM_SEL: u64 = 0x0ac;
const REG_SHM_LEN_LOW: u64 = 0x0b0;
const REG_SHM_BASE_HIGH: u64 = 0x0bc;
const REG_CONFIG_GENERATION: u64 = 0x0fc;

/// Errors while building a transport.
#[derive(Debug, thiserror::Error)]
pub enum MmioError {
    /// Creating an eventfd failed.
    #[error("Cannot create an eventfd for a virtio-mmio device")]
    EventFd(#[source] std::io::Error),
    /// The device offers a queue of size 0 or above the virtio maximum.
    #[error("Device queue {index} has invalid maximum size {size}")]
    QueueSize { index: usize, size: u16 },
    /// The device offers no queue.
    #[error("Device has no queue")]
    NoQueues,
    /// A saved state does not fit this device.
    #[error("Saved transport state does not fit this device: {0}")]
    State(String),
}

/// Registers of one queue, as saved in [`MmioState`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueRegs {
    pub max_size: u16,
    pub size: u16,
    pub ready: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
    pub next_avail: u16,
    pub next_used: u16,
    pub event_idx: bool,
}

impl From<QueueState> for QueueRegs {
    fn from(s: QueueState) -> Self {
        Self {
            max_size: s.max_size,
            size: s.size,
            ready: s.ready,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx: s.event_idx_enabled,
        }
    }
}

impl From<&QueueRegs> for QueueState {
    fn from(r: &QueueRegs) -> Self {
        Self {
            max_size: r.max_size,
            next_avail: r.next_avail,
            next_used: r.next_used,
            event_idx_enabled: r.event_idx,
            size: r.size,
            ready: r.ready,
            desc_table: r.desc_table,
            avail_ring: r.avail_ring,
            used_ring: r.used_ring,
        }
    }
}

/// The transport's register state (device state is saved separately).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MmioState {
    /// virtio device type behind the transport (checked on restore).
    pub device_type: u32,
    pub device_status: u32,
    pub features_select: u32,
    pub acked_features_select: u32,
    pub acked_features: u64,
    pub queue_select: u32,
    pub config_generation: u32,
    pub interrupt_status: u32,
    pub queues: Vec<QueueRegs>,
    /// What the device behind the transport keeps besides its queues
    /// ([`VirtioDevice::save_device`]).
    pub device: VirtioDeviceState,
}

/// A virtio device behind a virtio-mmio register window.
pub struct MmioTransport {
    mem: GuestMemoryMmap,
    device: Arc<Mutex<dyn VirtioDevice>>,
    device_type: u32,
    avail_features: u64,
    interrupt: Arc<Interrupt>,
    queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    device_status: u32,
    features_select: u32,
    acked_features_select: u32,
    acked_features: u64,
    queue_select: u32,
    config_generation: u32,
    warnings: u32,
}

impl fmt::Debug for MmioTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MmioTransport")
            .field("device_type", &self.device_type)
            .field("device_status", &self.device_status)
            .field("queues", &self.queues.len())
            .finish()
    }
}

impl MmioTransport {
    /// Wraps `device`; creates one notification `EventFd` per queue and the
    /// interrupt's irq `EventFd` (all non-blocking).
    pub fn new(
        mem: GuestMemoryMmap,
        device: Arc<Mutex<dyn VirtioDevice>>,
    ) -> Result<Self, MmioError> {
        let (device_type, avail_features, max_sizes) = {
            let dev = lock(&device);
            (
                dev.device_type(),
                dev.avail_features(),
                dev.queue_max_sizes().to_vec(),
            )
        };
        if max_sizes.is_empty() {
            return Err(MmioError::NoQueues);
        }
        let mut queues = Vec::with_capacity(max_sizes.len());
        let mut queue_evts = Vec::with_capacity(max_sizes.len());
        for (index, &size) in max_sizes.iter().enumerate() {
            queues.push(Queue::new(size).map_err(|_| MmioError::QueueSize { index, size })?);
            queue_evts.push(EventFd::new(EFD_NONBLOCK).map_err(MmioError::EventFd)?);
        }
        let irq_evt = EventFd::new(EFD_NONBLOCK).map_err(MmioError::EventFd)?;
        Ok(Self {
            mem,
            device,
            device_type,
            avail_features,
            interrupt: Arc::new(Interrupt::new(irq_evt)),
            queues,
            queue_evts,
            device_status: 0,
            features_select: 0,
            acked_features_select: 0,
            acked_features: 0,
            queue_select: 0,
            config_generation: 0,
            warnings: 0,
        })
    }

    /// One notification `EventFd` per queue, in queue order (register them
    /// as ioeventfds at `base + QUEUE_NOTIFY_OFFSET`, datamatch = index).
    pub fn queue_evts(&self) -> &[EventFd] {
        &self.queue_evts
    }

    /// The device's interrupt (register `irq_evt()` as an irqfd).
    pub fn interrupt(&self) -> &Arc<Interrupt> {
        &self.interrupt
    }

    /// The wrapped device.
    pub fn device(&self) -> &Arc<Mutex<dyn VirtioDevice>> {
        &self.device
    }

    /// The device status register (DRIVER_OK = 4 once the guest started it).
    pub fn device_status(&self) -> u32 {
        self.device_status
    }

    /// Saves the register state. The ring indices of a running device are
    /// the device's own (its queues moved on since activation); call with
    /// the device quiescent.
    pub fn state(&self) -> MmioState {
        let dev = lock(&self.device);
        let live = dev.active_queues();
        let queues = self
            .queues
            .iter()
            .enumerate()
            .map(|(i, q)| {
                let mut regs = QueueRegs::from(q.state());
                if let Some(active) = live.and_then(|l| l.get(i)) {
                    regs.next_avail = active.next_avail();
                    regs.next_used = active.next_used();
                }
                regs
            })
            .collect();
        let device = dev.save_device();
        drop(dev);
        MmioState {
            device,
            device_type: self.device_type,
            device_status: self.device_status,
            features_select: self.features_select,
            acked_features_select: self.acked_features_select,
            acked_features: self.acked_features,
            queue_select: self.queue_select,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt.status(),
            queues,
        }
    }

    /// Loads saved register state into a fresh transport for the same kind
    /// of device. A device the driver had started (DRIVER_OK) is activated
    /// with the restored queues, as if the driver had just started it.
    pub fn restore_state(&mut self, state: &MmioState) -> Result<(), MmioError> {
        if state.device_type != self.device_type {
            return Err(MmioError::State(format!(
                "saved device type {} where this vm has type {}",
                state.device_type, self.device_type
            )));
        }
        if state.queues.len() != self.queues.len() {
            return Err(MmioError::State(format!(
                "{} queues saved, device has {}",
                state.queues.len(),
                self.queues.len()
            )));
        }
        let mut queues = Vec::with_capacity(state.queues.len());
        for (i, (regs, q)) in state.queues.iter().zip(&self.queues).enumerate() {
            if regs.max_size != q.max_size() {
                return Err(MmioError::State(format!("queue {i} max size differs")));
            }
            let restored = Queue::try_from(QueueState::from(regs))
                .map_err(|e| MmioError::State(format!("queue {i}: {e}")))?;
            // A saved state is untrusted input: a ready queue's rings must
            // lie inside guest memory, as the driver's own setup is checked.
            if restored.ready() && !restored.is_valid(&self.mem) {
                return Err(MmioError::State(format!(
                    "queue {i}'s rings (descriptors {:#x}, driver {:#x}, device {:#x}, size {}) are not inside guest memory",
                    regs.desc_table, regs.avail_ring, regs.used_ring, regs.size
                )));
            }
            queues.push(restored);
        }
        self.queues = queues;
        self.device_status = state.device_status;
        self.features_select = state.features_select;
        self.acked_features_select = state.acked_features_select;
        self.acked_features = state.acked_features;
        self.queue_select = state.queue_select;
        self.config_generation = state.config_generation;
        if state.acked_features & !self.avail_features != 0 {
            return Err(MmioError::State(format!(
                "saved features {:#x} include some this device does not offer ({:#x})",
                state.acked_features, self.avail_features
            )));
        }
        lock(&self.device).set_acked_features(state.acked_features);
        lock(&self.device)
            .load_device(&state.device)
            .map_err(MmioError::State)?;
        let running = VIRTIO_CONFIG_S_DRIVER_OK | VIRTIO_CONFIG_S_FEATURES_OK;
        if self.device_status & running == running
            && self.device_status & (VIRTIO_CONFIG_S_NEEDS_RESET | VIRTIO_CONFIG_S_FAILED) == 0
        {
            self.activate();
            lock(&self.device).restored();
        }
        self.interrupt.ack(u32::MAX);
        if state.interrupt_status != 0 {
            // Re-raising the line is what a restored guest with pending
            // status needs anyway; an extra edge is harmless.
            let _ = self.interrupt.trigger(state.interrupt_status);
        }
        Ok(())
    }

    fn guest_error(&mut self, args: fmt::Arguments<'_>) {
        if self.warnings < MAX_WARNINGS {
            self.warnings += 1;
            tracing::warn!(device_type = self.device_type, "virtio-mmio: {args}");
            if self.warnings == MAX_WARNINGS {
                tracing::warn!(
                    device_type = self.device_type,
                    "virtio-mmio: further guest errors on this device are not logged"
                );
            }
        }
    }

    fn status_has(&self, bits: u32) -> bool {
        self.device_status & bits == bits
    }

    /// Queue registers may be written after FEATURES_OK and before DRIVER_OK.
    fn queue_config_allowed(&self) -> bool {
        self.status_has(VIRTIO_CONFIG_S_FEATURES_OK)
            && !self.status_has(VIRTIO_CONFIG_S_DRIVER_OK)
            && !self.status_has(VIRTIO_CONFIG_S_FAILED)
    }

    fn selected_queue(&self) -> Option<&Queue> {
        self.queues.get(self.queue_select as usize)
    }

    fn read_register(&mut self, offset: u64) -> u32 {
        match offset {
            REG_MAGIC => MAGIC_VALUE,
            REG_VERSION => MMIO_VERSION,
            REG_DEVICE_ID => self.device_type,
            REG_VENDOR_ID => VENDOR_ID,
            REG_DEVICE_FEATURES => match self.features_select {
                0 => self.avail_features as u32,
                1 => (self.avail_features >> 32) as u32,
                _ => 0,
            },
            REG_QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| u32::from(q.max_size())),
            REG_QUEUE_READY => self.selected_queue().map_or(0, |q| u32::from(q.ready())),
            REG_INTERRUPT_STATUS => self.interrupt.status(),
            REG_STATUS => self.device_status,
            // No shared memory regions: their length reads as -1.
            REG_SHM_LEN_LOW..=REG_SHM_BASE_HIGH => u32::MAX,
            REG_CONFIG_GENERATION => self.config_generation,
            _ => {
                self.guest_error(format_args!("read of unknown register {offset:#x}"));
                0
            }
        }
    }

    fn write_register(&mut self, offset: u64, v: u32) {
        match offset {
            REG_DEVICE_FEATURES_SEL => self.features_select = v,
            REG_DRIVER_FEATURES => self.write_driver_features(v),
            REG_DRIVER_FEATURES_SEL => self.acked_features_select = v,
            REG_QUEUE_SEL => self.queue_select = v,
            REG_QUEUE_NUM => self.write_queue_num(v),
            REG_QUEUE_READY => self.write_queue_ready(v),
            QUEUE_NOTIFY_OFFSET => self.notify(v),
            REG_INTERRUPT_ACK => self.interrupt.ack(v),
            REG_STATUS => self.write_status(v),
            REG_QUEUE_DESC_LOW..=REG_QUEUE_DEVICE_HIGH => self.write_queue_addr(offset, v),
            REG_SHM_SEL => {}
            _ => self.guest_error(format_args!(
                "write of {v:#x} to unknown register {offset:#x}"
            )),
        }
    }

    fn write_driver_features(&mut self, v: u32) {
        if !self.status_has(VIRTIO_CONFIG_S_DRIVER)
            || self.status_has(VIRTIO_CONFIG_S_FEATURES_OK)
            || self.status_has(VIRTIO_CONFIG_S_FAILED)
        {
            let status = self.device_status;
            self.guest_error(format_args!(
                "DriverFeatures written in status {status:#x}, ignored"
            ));
            return;
        }
        match self.acked_features_select {
            0 => self.acked_features = (self.acked_features & !0xffff_ffff) | u64::from(v),
            1 => self.acked_features = (self.acked_features & 0xffff_ffff) | (u64::from(v) << 32),
            sel => {
                if v != 0 {
                    self.guest_error(format_args!(
                        "DriverFeatures {v:#x} in unknown word {sel}, ignored"
                    ));
                }
            }
        }
    }

    fn write_queue_num(&mut self, v: u32) {
        let Some(idx) = self.check_queue_write("QueueNum") else {
            return;
        };
        let max = self.queues[idx].max_size();
        match u16::try_from(v) {
            Ok(n) if n != 0 && n.is_power_of_two() && n <= max => {
                // Validated above, so this cannot fail.
                let _ = self.queues[idx].try_set_size(n);
            }
            _ => self.guest_error(format_args!(
                "queue {idx}: invalid size {v} (max {max}, power of two), ignored"
            )),
        }
    }

    /// Checks that the selected queue exists and may be configured now;
    /// returns its index.
    fn check_queue_write(&mut self, what: &str) -> Option<usize> {
        let idx = self.queue_select as usize;
        if !self.queue_config_allowed() {
            let status = self.device_status;
            self.guest_error(format_args!(
                "{what} written in status {status:#x}, ignored"
            ));
            return None;
        }
        match self.queues.get(idx) {
            None => {
                self.guest_error(format_args!(
                    "{what} written for absent queue {idx}, ignored"
                ));
                None
            }
            Some(q) if q.ready() => {
                self.guest_error(format_args!(
                    "{what} written for ready queue {idx}, ignored"
                ));
                None
            }
            Some(_) => Some(idx),
        }
    }

    fn write_queue_ready(&mut self, v: u32) {
        let idx = self.queue_select as usize;
        if v == 0 {
            // Disabling a queue is allowed at any time before DRIVER_OK
            // (Linux does it while tearing queues down).
            if self.status_has(VIRTIO_CONFIG_S_DRIVER_OK) {
                self.guest_error(format_args!("QueueReady=0 after DRIVER_OK, ignored"));
            } else if let Some(q) = self.queues.get_mut(idx) {
                q.set_ready(false);
            }
            return;
        }
        if v != 1 {
            self.guest_error(format_args!("QueueReady written with {v}, ignored"));
            return;
        }
        let Some(idx) = self.check_queue_write("QueueReady") else {
            return;
        };
        let q = &mut self.queues[idx];
        q.set_ready(true);
        if !q.is_valid(&self.mem) {
            q.set_ready(false);
            self.guest_error(format_args!(
                "queue {idx}: rings misaligned or outside guest memory, not made ready"
            ));
        }
    }

    fn write_queue_addr(&mut self, offset: u64, v: u32) {
        let Some(idx) = self.check_queue_write("queue address") else {
            return;
        };
        let q = &mut self.queues[idx];
        let (cur, low) = match offset {
            REG_QUEUE_DESC_LOW | REG_QUEUE_DESC_HIGH => {
                (q.desc_table(), offset == REG_QUEUE_DESC_LOW)
            }
            REG_QUEUE_DRIVER_LOW | REG_QUEUE_DRIVER_HIGH => {
                (q.avail_ring(), offset == REG_QUEUE_DRIVER_LOW)
            }
            REG_QUEUE_DEVICE_LOW | REG_QUEUE_DEVICE_HIGH => {
                (q.used_ring(), offset == REG_QUEUE_DEVICE_LOW)
            }
            _ => {
                self.guest_error(format_args!(
                    "write of {v:#x} to unknown register {offset:#x}"
                ));
                return;
            }
        };
        let addr = if low {
            (cur & !0xffff_ffff) | u64::from(v)
        } else {
            (cur & 0xffff_ffff) | (u64::from(v) << 32)
        };
        let addr = vm_memory::GuestAddress(addr);
        // Alignment is checked here; placement in guest memory when the
        // queue is made ready (the two halves arrive separately).
        let res = match offset {
            REG_QUEUE_DESC_LOW | REG_QUEUE_DESC_HIGH => q.try_set_desc_table_address(addr),
            REG_QUEUE_DRIVER_LOW | REG_QUEUE_DRIVER_HIGH => q.try_set_avail_ring_address(addr),
            _ => q.try_set_used_ring_address(addr),
        };
        if res.is_err() {
            self.guest_error(format_args!(
                "queue {idx}: misaligned ring address {:#x}, ignored",
                addr.0
            ));
        }
    }

    fn notify(&mut self, v: u32) {
        // With an ioeventfd registered KVM handles this write; without one
        // (or for an access it does not match) signal the queue here.
        match self.queue_evts.get(v as usize) {
            Some(evt) => {
                if let Err(e) = evt.write(1) {
                    tracing::error!("virtio-mmio: cannot signal queue {v}: {e}");
                }
            }
            None => self.guest_error(format_args!("notify of absent queue {v}")),
        }
    }

    fn write_status(&mut self, v: u32) {
        if v == 0 {
            self.reset();
            return;
        }
        let old = self.device_status;
        if old & !v != 0 {
            self.guest_error(format_args!(
                "status {v:#x} clears bits of {old:#x}, ignored"
            ));
            return;
        }
        let added = v & !old;
        if added & VIRTIO_CONFIG_S_FAILED != 0 {
            self.device_status |= VIRTIO_CONFIG_S_FAILED;
            return;
        }
        let known = VIRTIO_CONFIG_S_ACKNOWLEDGE
            | VIRTIO_CONFIG_S_DRIVER
            | VIRTIO_CONFIG_S_FEATURES_OK
            | VIRTIO_CONFIG_S_DRIVER_OK;
        if added & !known != 0 {
            self.guest_error(format_args!("status {v:#x} sets unknown bits, ignored"));
            return;
        }
        // Each bit requires the previous ones (virtio 1.2, 3.1.1).
        let ok = (added & VIRTIO_CONFIG_S_DRIVER == 0 || v & VIRTIO_CONFIG_S_ACKNOWLEDGE != 0)
            && (added & VIRTIO_CONFIG_S_FEATURES_OK == 0 || v & VIRTIO_CONFIG_S_DRIVER != 0)
            && (added & VIRTIO_CONFIG_S_DRIVER_OK == 0 || old & VIRTIO_CONFIG_S_FEATURES_OK != 0);
        if !ok || self.status_has(VIRTIO_CONFIG_S_FAILED) {
            self.guest_error(format_args!(
                "status {v:#x} out of order (was {old:#x}), ignored"
            ));
            return;
        }
        if added & VIRTIO_CONFIG_S_FEATURES_OK != 0 && !self.accept_features() {
            // FEATURES_OK stays clear: the driver reads it back and gives up.
            self.device_status = v & !(VIRTIO_CONFIG_S_FEATURES_OK | VIRTIO_CONFIG_S_DRIVER_OK);
            return;
        }
        self.device_status = v;
        if added & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            self.activate();
        }
    }

    fn accept_features(&mut self) -> bool {
        let acked = self.acked_features;
        let unoffered = acked & !self.avail_features;
        if unoffered != 0 {
            self.guest_error(format_args!(
                "driver accepted features {unoffered:#x} that were not offered"
            ));
            return false;
        }
        if acked & (1 << VIRTIO_F_VERSION_1) == 0 {
            self.guest_error(format_args!(
                "driver did not accept VIRTIO_F_VERSION_1 (legacy drivers are not supported)"
            ));
            return false;
        }
        lock(&self.device).set_acked_features(acked);
        true
    }

    fn activate(&mut self) {
        if let Some(idx) = self.queues.iter().position(|q| !q.ready()) {
            self.guest_error(format_args!("DRIVER_OK with queue {idx} not ready"));
            self.needs_reset();
            return;
        }
        let event_idx = self.acked_features & (1 << VIRTIO_RING_F_EVENT_IDX) != 0;
        let mut queues = Vec::with_capacity(self.queues.len());
        let mut evts = Vec::with_capacity(self.queues.len());
        for (q, evt) in self.queues.iter().zip(&self.queue_evts) {
            let mut state = q.state();
            state.event_idx_enabled = event_idx;
            match (Queue::try_from(state), evt.try_clone()) {
                (Ok(q), Ok(evt)) => {
                    queues.push(q);
                    evts.push(evt);
                }
                (Err(e), _) => {
                    tracing::error!("virtio-mmio: cannot hand over queue: {e}");
                    self.needs_reset();
                    return;
                }
                (_, Err(e)) => {
                    tracing::error!("virtio-mmio: cannot clone queue eventfd: {e}");
                    self.needs_reset();
                    return;
                }
            }
        }
        let res =
            lock(&self.device).activate(self.mem.clone(), self.interrupt.clone(), queues, evts);
        if let Err(e) = res {
            tracing::error!(
                device_type = self.device_type,
                "virtio-mmio: activation failed: {e}"
            );
            self.needs_reset();
        }
    }

    fn needs_reset(&mut self) {
        self.device_status |= VIRTIO_CONFIG_S_NEEDS_RESET;
        if let Err(e) = self.interrupt.trigger(VIRTIO_MMIO_INT_CONFIG) {
            tracing::error!("virtio-mmio: cannot raise interrupt: {e}");
        }
    }

    fn reset(&mut self) {
        {
            let mut dev = lock(&self.device);
            if dev.is_activated() && !dev.reset() {
                drop(dev);
                tracing::warn!(
                    device_type = self.device_type,
                    "virtio-mmio: device cannot be reset while running"
                );
                self.needs_reset();
                return;
            }
        }
        self.device_status = 0;
        self.features_select = 0;
        self.acked_features_select = 0;
        self.acked_features = 0;
        self.queue_select = 0;
        for q in &mut self.queues {
            q.reset();
        }
        self.interrupt.ack(u32::MAX);
    }
}

/// Locks a device, surviving poisoning (a device thread that panicked must
/// not take the vCPU thread down with it).
fn lock(device: &Arc<Mutex<dyn VirtioDevice>>) -> MutexGuard<'_, dyn VirtioDevice + 'static> {
    device.lock().unwrap_or_else(|e| e.into_inner())
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_SPACE_OFFSET {
            if matches!(data.len(), 1 | 2 | 4 | 8) && offset < MMIO_LEN {
                lock(&self.device).read_config(offset - CONFIG_SPACE_OFFSET, data);
            } else {
                data.fill(0);
                let len = data.len();
                self.guest_error(format_args!(
                    "bad config read of {len} bytes at {offset:#x}"
                ));
            }
            return;
        }
        if data.len() != 4 || offset % 4 != 0 {
            data.fill(0);
            let len = data.len();
            self.guest_error(format_args!(
                "bad register read of {len} bytes at {offset:#x}"
            ));
            return;
        }
        let v = self.read_register(offset);
        data.copy_from_slice(&v.to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_SPACE_OFFSET {
            if matches!(data.len(), 1 | 2 | 4 | 8) && offset < MMIO_LEN {
                lock(&self.device).write_config(offset - CONFIG_SPACE_OFFSET, data);
            } else {
                let len = data.len();
                self.guest_error(format_args!(
                    "bad config write of {len} bytes at {offset:#x}"
                ));
            }
            return;
        }
        let Ok(bytes) = <[u8; 4]>::try_from(data) else {
            let len = data.len();
            self.guest_error(format_args!(
                "bad register write of {len} bytes at {offset:#x}"
            ));
            return;
        };
        if offset % 4 != 0 {
            self.guest_error(format_args!("misaligned register write at {offset:#x}"));
            return;
        }
        self.write_register(offset, u32::from_le_bytes(bytes));
    }
}

/// Drives a transport the way Linux's `virtio_mmio` driver does, for tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use crate::devices::virtio::queue::testing::TestQueue;

    pub fn rd(t: &mut MmioTransport, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read(offset, &mut b);
        u32::from_le_bytes(b)
    }

    pub fn wr(t: &mut MmioTransport, offset: u64, v: u32) {
        t.write(offset, &v.to_le_bytes());
    }

    pub fn set_status(t: &mut MmioTransport, bits: u32) {
        let s = rd(t, REG_STATUS);
        wr(t, REG_STATUS, s | bits);
    }

    /// Reset, ACKNOWLEDGE, DRIVER, feature negotiation (accepting
    /// `features & offered`), FEATURES_OK; returns whether it stuck.
    pub fn negotiate(t: &mut MmioTransport, features: u64) -> bool {
        wr(t, REG_STATUS, 0);
        assert_eq!(rd(t, REG_MAGIC), MAGIC_VALUE);
        assert_eq!(rd(t, REG_VERSION), 2);
        set_status(t, VIRTIO_CONFIG_S_ACKNOWLEDGE);
        set_status(t, VIRTIO_CONFIG_S_DRIVER);
        wr(t, REG_DEVICE_FEATURES_SEL, 1);
        let mut offered = u64::from(rd(t, REG_DEVICE_FEATURES)) << 32;
        wr(t, REG_DEVICE_FEATURES_SEL, 0);
        offered |= u64::from(rd(t, REG_DEVICE_FEATURES));
        let _ = offered;
        wr(t, REG_DRIVER_FEATURES_SEL, 1);
        wr(t, REG_DRIVER_FEATURES, (features >> 32) as u32);
        wr(t, REG_DRIVER_FEATURES_SEL, 0);
        wr(t, REG_DRIVER_FEATURES, features as u32);
        set_status(t, VIRTIO_CONFIG_S_FEATURES_OK);
        rd(t, REG_STATUS) & VIRTIO_CONFIG_S_FEATURES_OK != 0
    }

    /// Queue setup as in `vm_setup_vq`; returns QueueReady as read back.
    pub fn setup_queue(t: &mut MmioTransport, index: u32, q: &TestQueue) -> u32 {
        wr(t, REG_QUEUE_SEL, index);
        assert_eq!(rd(t, REG_QUEUE_READY), 0);
        assert!(rd(t, REG_QUEUE_NUM_MAX) >= u32::from(q.size));
        wr(t, REG_QUEUE_NUM, u32::from(q.size));
        wr(t, REG_QUEUE_DESC_LOW, q.desc as u32);
        wr(t, REG_QUEUE_DESC_HIGH, (q.desc >> 32) as u32);
        wr(t, REG_QUEUE_DRIVER_LOW, q.avail as u32);
        wr(t, REG_QUEUE_DRIVER_HIGH, (q.avail >> 32) as u32);
        wr(t, REG_QUEUE_DEVICE_LOW, q.used as u32);
        wr(t, REG_QUEUE_DEVICE_HIGH, (q.used >> 32) as u32);
        wr(t, REG_QUEUE_READY, 1);
        rd(t, REG_QUEUE_READY)
    }

    /// The whole Linux probe: negotiate VERSION_1 plus `extra` features,
    /// set up `queues`, DRIVER_OK. Returns the final status.
    pub fn linux_probe(t: &mut MmioTransport, extra: u64, queues: &[TestQueue]) -> u32 {
        assert!(negotiate(t, (1 << VIRTIO_F_VERSION_1) | extra));
        for (i, q) in queues.iter().enumerate() {
            assert_eq!(setup_queue(t, i as u32, q), 1, "queue {i} ready");
        }
        set_status(t, VIRTIO_CONFIG_S_DRIVER_OK);
        rd(t, REG_STATUS)
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;
    use crate::devices::virtio::queue::testing::TestQueue;
    use crate::devices::virtio::{DeviceBase, VIRTIO_MMIO_INT_VRING};
    use vm_memory::GuestAddress;

    const MEM_SIZE: usize = 0x40_0000;
    const FEATURE_X: u64 = 1 << 3;

    struct Dummy {
        base: DeviceBase,
        acked: u64,
        activated: Option<Vec<QueueState>>,
        evts: Vec<EventFd>,
        resettable: bool,
    }

    impl Default for Dummy {
        fn default() -> Self {
            let features = (1 << VIRTIO_F_VERSION_1) | FEATURE_X;
            Self {
                base: DeviceBase::new("dummy", 42, features, &[256, 16], &[]).expect("base"),
                acked: 0,
                activated: None,
                evts: Vec::new(),
                resettable: false,
            }
        }
    }

    impl VirtioDevice for Dummy {
        fn base(&self) -> &DeviceBase {
            &self.base
        }
        fn base_mut(&mut self) -> &mut DeviceBase {
            &mut self.base
        }
        fn set_acked_features(&mut self, features: u64) {
            self.acked = features;
        }
        fn read_config(&self, offset: u64, data: &mut [u8]) {
            for (i, b) in data.iter_mut().enumerate() {
                *b = (offset as u8).wrapping_add(i as u8);
            }
        }
        fn write_config(&mut self, _offset: u64, _data: &[u8]) {}
        fn activate(
            &mut self,
            _mem: GuestMemoryMmap,
            _interrupt: Arc<Interrupt>,
            queues: Vec<Queue>,
            queue_evts: Vec<EventFd>,
        ) -> Result<(), super::super::ActivateError> {
            self.activated = Some(queues.iter().map(|q| q.state()).collect());
            self.evts = queue_evts;
            Ok(())
        }
        fn is_activated(&self) -> bool {
            self.activated.is_some()
        }
        fn reset(&mut self) -> bool {
            if self.resettable {
                self.activated = None;
            }
            self.resettable
        }
    }

    fn setup() -> (GuestMemoryMmap, Arc<Mutex<Dummy>>, MmioTransport) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE)]).expect("mem");
        let dev = Arc::new(Mutex::new(Dummy::default()));
        let t = MmioTransport::new(mem.clone(), dev.clone()).expect("transport");
        (mem, dev, t)
    }

    fn queues(mem: &GuestMemoryMmap) -> [TestQueue; 2] {
        [
            TestQueue::new(mem, 0x10000, 256),
            TestQueue::new(mem, 0x20000, 16),
        ]
    }

    #[test]
    fn test_mmio_linux_probe_activates_device_with_configured_queues() {
        let (mem, dev, mut t) = setup();
        assert_eq!(rd(&mut t, REG_DEVICE_ID), 42);
        wr(&mut t, REG_DEVICE_FEATURES_SEL, 1);
        assert_eq!(rd(&mut t, REG_DEVICE_FEATURES), 1);
        let qs = queues(&mem);

        let status = linux_probe(&mut t, FEATURE_X, &qs);

        assert_eq!(status, 0xf);
        let d = dev.lock().expect("lock");
        assert_eq!(d.acked, (1 << VIRTIO_F_VERSION_1) | FEATURE_X);
        let states = d.activated.as_ref().expect("activated");
        assert_eq!(states.len(), 2);
        assert_eq!(states[1].size, 16);
        assert_eq!(states[1].desc_table, qs[1].desc);
        assert_eq!(states[1].avail_ring, qs[1].avail);
        assert_eq!(states[1].used_ring, qs[1].used);
        assert!(states.iter().all(|s| s.ready));
        assert_eq!(d.evts.len(), 2);
    }

    #[test]
    fn test_mmio_unoffered_feature_keeps_features_ok_clear() {
        let (_mem, dev, mut t) = setup();
        assert!(!negotiate(&mut t, (1 << VIRTIO_F_VERSION_1) | (1 << 7)));
        assert_eq!(dev.lock().expect("lock").acked, 0);
        // DRIVER_OK cannot follow.
        set_status(&mut t, VIRTIO_CONFIG_S_DRIVER_OK);
        assert_eq!(rd(&mut t, REG_STATUS) & VIRTIO_CONFIG_S_DRIVER_OK, 0);
    }

    #[test]
    fn test_mmio_legacy_driver_without_version_1_refused() {
        let (_mem, _dev, mut t) = setup();
        assert!(!negotiate(&mut t, FEATURE_X));
    }

    #[test]
    fn test_mmio_out_of_order_status_ignored() {
        let (_mem, _dev, mut t) = setup();
        wr(&mut t, REG_STATUS, VIRTIO_CONFIG_S_DRIVER);
        assert_eq!(rd(&mut t, REG_STATUS), 0);
        wr(
            &mut t,
            REG_STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER_OK,
        );
        assert_eq!(rd(&mut t, REG_STATUS), 0);
        wr(&mut t, REG_STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE);
        wr(&mut t, REG_STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE | 0x20);
        assert_eq!(rd(&mut t, REG_STATUS), VIRTIO_CONFIG_S_ACKNOWLEDGE);
    }

    #[test]
    fn test_mmio_driver_features_before_driver_ignored() {
        let (_mem, _dev, mut t) = setup();
        wr(&mut t, REG_DRIVER_FEATURES, 0xffff_ffff);
        assert_eq!(t.state().acked_features, 0);
    }

    #[test]
    fn test_mmio_queue_registers_validated() {
        let (mem, _dev, mut t) = setup();
        let q = TestQueue::new(&mem, 0x10000, 64);
        // Before FEATURES_OK: ignored.
        wr(&mut t, REG_QUEUE_NUM, 64);
        assert_eq!(t.state().queues[0].size, 256);
        assert!(negotiate(&mut t, 1 << VIRTIO_F_VERSION_1));
        for bad in [0, 3, 100, 512, 0x1_0000] {
            wr(&mut t, REG_QUEUE_NUM, bad);
            assert_eq!(t.state().queues[0].size, 256, "size {bad}");
        }
        wr(&mut t, REG_QUEUE_NUM, 64);
        assert_eq!(t.state().queues[0].size, 64);
        // Misaligned ring address: ignored.
        wr(&mut t, REG_QUEUE_DESC_LOW, 0x10008);
        assert_eq!(t.state().queues[0].desc_table, 0);
        // Rings outside guest memory: the queue does not become ready.
        wr(&mut t, REG_QUEUE_DESC_LOW, 0);
        wr(&mut t, REG_QUEUE_DESC_HIGH, 0x10);
        wr(&mut t, REG_QUEUE_DRIVER_LOW, q.avail as u32);
        wr(&mut t, REG_QUEUE_DEVICE_LOW, q.used as u32);
        wr(&mut t, REG_QUEUE_READY, 1);
        assert_eq!(rd(&mut t, REG_QUEUE_READY), 0);
        // Queue past the device's count: reads 0, writes ignored.
        wr(&mut t, REG_QUEUE_SEL, 7);
        assert_eq!(rd(&mut t, REG_QUEUE_NUM_MAX), 0);
        wr(&mut t, REG_QUEUE_NUM, 4);
        wr(&mut t, REG_QUEUE_READY, 1);
        assert_eq!(rd(&mut t, REG_QUEUE_READY), 0);
        // A good setup still works afterwards, and a ready queue is frozen.
        assert_eq!(setup_queue(&mut t, 0, &q), 1);
        wr(&mut t, REG_QUEUE_NUM, 32);
        assert_eq!(t.state().queues[0].size, 64);
    }

    #[test]
    fn test_mmio_bad_access_sizes_ignored() {
        let (_mem, _dev, mut t) = setup();
        let mut b2 = [0xaau8; 2];
        t.read(REG_MAGIC, &mut b2);
        assert_eq!(b2, [0, 0]);
        let mut b4 = [0xaau8; 4];
        t.read(REG_MAGIC + 1, &mut b4);
        assert_eq!(b4, [0; 4]);
        t.write(REG_STATUS, &[1]);
        t.write(REG_STATUS + 2, &1u32.to_le_bytes());
        t.write(REG_STATUS, &[1, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(rd(&mut t, REG_STATUS), 0);
        let mut b3 = [0u8; 3];
        t.read(0x100, &mut b3);
        assert_eq!(b3, [0; 3]);
        // Unknown registers read as 0; many bad accesses do not panic.
        for off in (0..0x100).step_by(4) {
            let _ = rd(&mut t, off);
        }
    }

    #[test]
    fn test_mmio_config_space_forwarded() {
        let (_mem, _dev, mut t) = setup();
        let mut b = [0u8; 2];
        t.read(0x105, &mut b);
        assert_eq!(b, [5, 6]);
        assert_eq!(rd(&mut t, REG_CONFIG_GENERATION), 0);
    }

    #[test]
    fn test_mmio_driver_ok_with_unready_queue_needs_reset() {
        let (mem, dev, mut t) = setup();
        let qs = queues(&mem);
        assert!(negotiate(&mut t, 1 << VIRTIO_F_VERSION_1));
        assert_eq!(setup_queue(&mut t, 0, &qs[0]), 1);
        set_status(&mut t, VIRTIO_CONFIG_S_DRIVER_OK);
        assert_ne!(rd(&mut t, REG_STATUS) & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
        assert_eq!(rd(&mut t, REG_INTERRUPT_STATUS), VIRTIO_MMIO_INT_CONFIG);
        assert!(dev.lock().expect("lock").activated.is_none());
    }

    #[test]
    fn test_mmio_notify_and_interrupt_ack() {
        let (_mem, _dev, mut t) = setup();
        wr(&mut t, QUEUE_NOTIFY_OFFSET, 1);
        assert_eq!(t.queue_evts()[1].read().expect("signalled"), 1);
        assert!(t.queue_evts()[0].read().is_err());
        wr(&mut t, QUEUE_NOTIFY_OFFSET, 9);

        t.interrupt()
            .trigger(VIRTIO_MMIO_INT_VRING | VIRTIO_MMIO_INT_CONFIG)
            .expect("irq");
        assert_eq!(t.interrupt().irq_evt().read().expect("irq"), 1);
        wr(&mut t, REG_INTERRUPT_ACK, VIRTIO_MMIO_INT_VRING);
        assert_eq!(rd(&mut t, REG_INTERRUPT_STATUS), VIRTIO_MMIO_INT_CONFIG);
    }

    #[test]
    fn test_mmio_reset_after_activation() {
        let (mem, dev, mut t) = setup();
        let qs = queues(&mem);
        assert_eq!(linux_probe(&mut t, 0, &qs), 0xf);
        // A device that cannot reset: NEEDS_RESET, state kept.
        wr(&mut t, REG_STATUS, 0);
        assert_ne!(rd(&mut t, REG_STATUS) & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
        // One that can: everything back to zero, and a new probe works.
        dev.lock().expect("lock").resettable = true;
        wr(&mut t, REG_STATUS, 0);
        assert_eq!(rd(&mut t, REG_STATUS), 0);
        assert_eq!(rd(&mut t, REG_QUEUE_READY), 0);
        assert_eq!(rd(&mut t, REG_INTERRUPT_STATUS), 0);
        assert_eq!(linux_probe(&mut t, 0, &qs), 0xf);
    }

    #[test]
    fn test_mmio_state_save_restore_save_round_trip() {
        let (mem, _dev, mut t) = setup();
        let qs = queues(&mem);
        assert!(negotiate(&mut t, (1 << VIRTIO_F_VERSION_1) | FEATURE_X));
        assert_eq!(setup_queue(&mut t, 0, &qs[0]), 1);
        wr(&mut t, REG_QUEUE_SEL, 1);
        wr(&mut t, REG_QUEUE_NUM, 8);
        let saved = t.state();

        let json = serde_json::to_string(&saved).expect("serialize");
        let loaded: MmioState = serde_json::from_str(&json).expect("deserialize");
        let (_mem2, _dev2, mut t2) = setup();
        t2.restore_state(&loaded).expect("restore");

        assert_eq!(t2.state(), saved);
        assert_eq!(rd(&mut t2, REG_QUEUE_READY), 0); // queue 1 selected
        wr(&mut t2, REG_QUEUE_SEL, 0);
        assert_eq!(rd(&mut t2, REG_QUEUE_READY), 1);
    }

    #[test]
    fn test_mmio_restore_rejects_wrong_queue_count() {
        let (_mem, _dev, mut t) = setup();
        let mut s = t.state();
        s.queues.pop();
        assert!(t.restore_state(&s).is_err());
    }

    #[test]
    fn test_mmio_restore_rejects_rings_outside_guest_memory() {
        let (mem, _dev, mut t) = setup();
        let qs = queues(&mem);
        assert!(negotiate(&mut t, 1 << VIRTIO_F_VERSION_1));
        assert_eq!(setup_queue(&mut t, 0, &qs[0]), 1);
        let good = t.state();
        for edit in [
            |q: &mut QueueRegs| q.desc_table = 1 << 63,
            |q: &mut QueueRegs| q.avail_ring = MEM_SIZE as u64 - 2,
            |q: &mut QueueRegs| q.used_ring = u64::MAX - 7,
        ] {
            let mut s = good.clone();
            edit(&mut s.queues[0]);
            let (_m, _d, mut t2) = setup();
            let e = t2.restore_state(&s).expect_err("refused");
            assert!(e.to_string().contains("not inside guest memory"), "{e}");
        }
        let (_m, _d, mut t3) = setup();
        t3.restore_state(&good)
            .expect("the unedited state restores");
    }
}
