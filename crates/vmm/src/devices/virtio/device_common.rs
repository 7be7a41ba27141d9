//! What every virtio device holds alike, and the steps each repeats:
//! offering features and a read-only config space, taking the driver's
//! queues on activation, waking the device thread through the activate
//! `EventFd`, and raising the used-buffer interrupt.
//!
//! A device keeps a [`DeviceBase`] and returns it from
//! [`VirtioDevice::base`](super::VirtioDevice::base); the trait's provided
//! methods do the rest, so device files hold only what is their own.

use std::io;
use std::sync::Arc;

use event_manager::{EventOps, EventSet, Events};
use virtio_queue::{Queue, QueueT};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::queue::{read_config_space, GuestWarnings};
use super::{ActivateError, Interrupt, VIRTIO_MMIO_INT_VRING};
use crate::memory::GuestMemoryMmap;

/// Event data of the activate `EventFd`; devices number their own events
/// from 1.
pub const ACTIVATE_EVENT: u32 = 0;

/// The bookkeeping every virtio device shares.
#[derive(Debug)]
pub struct DeviceBase {
    name: &'static str,
    device_type: u32,
    avail_features: u64,
    acked_features: u64,
    queue_max_sizes: Box<[u16]>,
    config_space: Box<[u8]>,
    activate_evt: EventFd,
    /// Public to the crate so a device can lend it out while it also
    /// borrows its queues.
    pub(crate) warnings: GuestWarnings,
}

impl DeviceBase {
    /// A device named `name` in logs (e.g. "virtio-blk"), offering
    /// `avail_features`, one queue per entry of `queue_max_sizes`, and
    /// `config_space` for the driver to read.
    pub fn new(
        name: &'static str,
        device_type: u32,
        avail_features: u64,
        queue_max_sizes: &[u16],
        config_space: &[u8],
    ) -> io::Result<Self> {
        Ok(Self {
            name,
            device_type,
            avail_features,
            acked_features: 0,
            queue_max_sizes: queue_max_sizes.into(),
            config_space: config_space.into(),
            activate_evt: EventFd::new(EFD_NONBLOCK)?,
            warnings: GuestWarnings::default(),
        })
    }

    /// The device's name in logs.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// virtio device type.
    pub fn device_type(&self) -> u32 {
        self.device_type
    }

    /// Maximum size of each queue.
    pub fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_max_sizes
    }

    /// Features the device offers.
    pub fn avail_features(&self) -> u64 {
        self.avail_features
    }

    /// Features the driver accepted.
    pub fn acked_features(&self) -> u64 {
        self.acked_features
    }

    /// Records the driver's features; bits we never offered are dropped.
    pub fn set_acked_features(&mut self, features: u64) {
        self.acked_features = features & self.avail_features;
    }

    /// Reads the config space; bytes beyond it read as zero.
    pub fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_space(&self.config_space, offset, data);
    }

    /// Logs a guest mistake, within the device's warning budget.
    /// The next descriptor chain of `queue`, like virtio-queue's
    /// `pop_descriptor_chain`, whose error (a driver's avail index past
    /// the ring) it logs through the bounded warnings rather than once
    /// per notification.
    pub fn pop_chain<'m>(
        &mut self,
        queue: &mut virtio_queue::Queue,
        mem: &'m GuestMemoryMmap,
    ) -> Option<virtio_queue::DescriptorChain<&'m GuestMemoryMmap>> {
        use virtio_queue::QueueOwnedT;
        match queue.iter(mem) {
            Ok(mut it) => it.next(),
            Err(e) => {
                self.warn(format_args!("the driver's queue is broken: {e}"));
                None
            }
        }
    }

    pub fn warn(&mut self, args: std::fmt::Arguments<'_>) {
        self.warnings.warn(self.name, args);
    }

    /// Wakes the device thread, which then polls the queues (see
    /// [`DeviceBase::on_activate`]); `activate` runs on a vCPU thread.
    pub fn signal_activation(&self) -> Result<(), ActivateError> {
        self.activate_evt.write(1).map_err(ActivateError::Signal)
    }

    /// Subscribes the activate `EventFd`, from `MutEventSubscriber::init`.
    pub fn register_activation(&self, ops: &mut EventOps) {
        if let Err(e) = ops.add(self.activation_events()) {
            tracing::error!("{}: cannot register activation event: {e}", self.name);
        }
    }

    /// Consumes the activation signal and subscribes `queue_evts` (each with
    /// its event data). A device activates once, so the activate `EventFd`
    /// is unsubscribed.
    pub fn on_activate<'a>(
        &self,
        ops: &mut EventOps,
        queue_evts: impl IntoIterator<Item = (&'a EventFd, u32)>,
    ) {
        // Nothing to read means a spurious wake-up; activation proceeds.
        let _ = self.activate_evt.read();
        if let Err(e) = ops.remove(self.activation_events()) {
            tracing::error!("{}: cannot unregister activation event: {e}", self.name);
        }
        for (evt, data) in queue_evts {
            if let Err(e) = ops.add(Events::with_data(evt, data, EventSet::IN)) {
                tracing::error!("{}: cannot register queue event: {e}", self.name);
            }
        }
    }

    fn activation_events(&self) -> Events {
        Events::with_data(&self.activate_evt, ACTIVATE_EVENT, EventSet::IN)
    }
}

/// What a device with `N` queues holds once the driver started it.
pub struct ActiveQueues<const N: usize> {
    pub mem: GuestMemoryMmap,
    pub interrupt: Arc<Interrupt>,
    pub queues: [Queue; N],
    pub queue_evts: [EventFd; N],
}

impl<const N: usize> ActiveQueues<N> {
    /// Takes the queues the driver configured; any count but `N` is the
    /// driver's mistake and is refused.
    pub fn new(
        mem: GuestMemoryMmap,
        interrupt: Arc<Interrupt>,
        queues: Vec<Queue>,
        queue_evts: Vec<EventFd>,
    ) -> Result<Self, ActivateError> {
        let got = queues.len();
        let queues: [Queue; N] = queues
            .try_into()
            .map_err(|_| ActivateError::QueueCount { got, want: N })?;
        let got = queue_evts.len();
        let queue_evts: [EventFd; N] = queue_evts
            .try_into()
            .map_err(|_| ActivateError::QueueCount { got, want: N })?;
        Ok(Self {
            mem,
            interrupt,
            queues,
            queue_evts,
        })
    }
}

/// Raises the used-buffer interrupt for `queue` unless the driver
/// suppressed it; when that cannot be read, interrupt anyway (a spurious
/// interrupt is harmless, a lost one hangs the driver).
pub fn signal_used(queue: &mut Queue, mem: &GuestMemoryMmap, interrupt: &Interrupt, dev: &str) {
    if queue.needs_notification(mem).unwrap_or(true) {
        raise_vring(interrupt, dev);
    }
}

/// Raises the used-buffer interrupt; a failure is only logged, since the
/// device thread has no one to return it to.
pub fn raise_vring(interrupt: &Interrupt, dev: &str) {
    if let Err(e) = interrupt.trigger(VIRTIO_MMIO_INT_VRING) {
        tracing::error!("{dev}: cannot raise interrupt: {e}");
    }
}
