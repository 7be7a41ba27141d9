//! virtio-mmio transport and the blk, net and vsock devices, emulated in
//! userspace (there is no vhost on our hosts).
//!
//! How the VMM wires one device (see `builder.rs` for the real code):
//! 1. build the device (`Block::new`, `Net::new`, `Vsock::new`) as
//!    `Arc<Mutex<D>>`;
//! 2. wrap it in an [`mmio::MmioTransport`] with guest memory and an
//!    [`Interrupt`]; put the transport on the MMIO bus at its slot;
//! 3. register each of the transport's queue `EventFd`s as a KVM ioeventfd at
//!    `base + QUEUE_NOTIFY` with the queue index as datamatch, and the
//!    interrupt's `EventFd` as a KVM irqfd on the slot's GSI;
//! 4. add the device to the device thread's `EventManager` as a subscriber.
//!
//! On DRIVER_OK the transport calls [`VirtioDevice::activate`]; the device
//! then registers its queue events with the event manager (through an
//! activate `EventFd` it subscribed at init) and starts serving queues.

pub mod block;
pub mod device_common;
pub mod mmio;
pub mod net;
pub mod queue;
pub mod vsock;

use std::sync::atomic::{AtomicU32, Ordering};

use virtio_queue::Queue;
use vmm_sys_util::eventfd::EventFd;

pub use device_common::DeviceBase;

use crate::memory::GuestMemoryMmap;

/// Interrupt status bit: a used buffer was added to a queue.
pub const VIRTIO_MMIO_INT_VRING: u32 = 0x01;
/// Interrupt status bit: the device configuration changed.
pub const VIRTIO_MMIO_INT_CONFIG: u32 = 0x02;

/// The interrupt line of one virtio-mmio device: a status register the
/// guest reads and acknowledges, and an irqfd that KVM turns into an edge on
/// the device's GSI.
#[derive(Debug)]
pub struct Interrupt {
    status: AtomicU32,
    irq_evt: EventFd,
}

impl Interrupt {
    /// An interrupt line signalled through `irq_evt`.
    pub fn new(irq_evt: EventFd) -> Self {
        Self {
            status: AtomicU32::new(0),
            irq_evt,
        }
    }

    /// Sets `bits` in the status register and raises the line.
    pub fn trigger(&self, bits: u32) -> std::io::Result<()> {
        self.status.fetch_or(bits, Ordering::SeqCst);
        self.irq_evt.write(1)
    }

    /// Current interrupt status (InterruptStatus register).
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::SeqCst)
    }

    /// Clears acknowledged bits (InterruptACK register).
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::SeqCst);
    }

    /// The eventfd to register as a KVM irqfd.
    pub fn irq_evt(&self) -> &EventFd {
        &self.irq_evt
    }
}

/// Errors while activating a device.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    /// The driver configured a different number of queues than the device has.
    #[error("Driver set up {got} queues, device needs {want}")]
    QueueCount { got: usize, want: usize },
    /// Signalling the device thread failed.
    #[error("Cannot signal the device thread")]
    Signal(#[source] std::io::Error),
    /// The device rejected its configuration.
    #[error("Device rejected activation: {0}")]
    Device(String),
}

/// The typed state of the device behind a virtio-mmio transport.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum VirtioDeviceState {
    /// A device with no state of its own (test devices).
    None,
    Block(block::BlockState),
    Net(net::NetState),
    Vsock(vsock::VsockState),
}

impl VirtioDeviceState {
    /// What kind of device saved it.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::None => "no device",
            Self::Block(_) => "virtio-blk",
            Self::Net(_) => "virtio-net",
            Self::Vsock(_) => "virtio-vsock",
        }
    }
}

/// What every virtio device offers its transport. The bookkeeping all
/// devices share lives in their [`DeviceBase`]; the provided methods read it.
pub trait VirtioDevice: Send {
    /// The device's shared bookkeeping.
    fn base(&self) -> &DeviceBase;
    /// The device's shared bookkeeping, mutably.
    fn base_mut(&mut self) -> &mut DeviceBase;
    /// virtio device type (1 = net, 2 = block, 19 = vsock).
    fn device_type(&self) -> u32 {
        self.base().device_type()
    }
    /// Maximum size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16] {
        self.base().queue_max_sizes()
    }
    /// Feature bits the device offers (VIRTIO_F_VERSION_1 included).
    fn avail_features(&self) -> u64 {
        self.base().avail_features()
    }
    /// Records the features the driver accepted (a subset of `avail_features`).
    fn set_acked_features(&mut self, features: u64) {
        self.base_mut().set_acked_features(features);
    }
    /// Reads the device configuration space.
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        self.base().read_config(offset, data);
    }
    /// Writes the device configuration space. No device here offers a
    /// writable field, so a write is a guest mistake.
    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        self.base_mut().warn(format_args!(
            "write to read-only config space at {offset:#x} ignored"
        ));
    }
    /// Starts the device with the queues the driver configured.
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        interrupt: std::sync::Arc<Interrupt>,
        queues: Vec<Queue>,
        queue_evts: Vec<EventFd>,
    ) -> Result<(), ActivateError>;
    /// Whether the device is running.
    fn is_activated(&self) -> bool;
    /// The queues the device works on once activated (the transport's
    /// copies stop at activation; these hold the current ring indices).
    fn active_queues(&self) -> Option<&[Queue]> {
        None
    }
    /// The disk behind the device, if it is a block device: a fork
    /// freezes its top layer.
    fn host_disk(&mut self) -> Option<&mut disk::Disk> {
        None
    }
    /// Called once after a restore activated the device: the host side of
    /// the device is new (another process, other sockets), so a device
    /// whose guest state refers to host connections tells the driver here.
    fn restored(&mut self) {}
    /// The device's own state beyond the transport's registers and
    /// queues (its [`crate::persist::Persist`] state), saved with the
    /// transport's.
    fn save_device(&self) -> VirtioDeviceState {
        VirtioDeviceState::None
    }
    /// Takes back what [`VirtioDevice::save_device`] gave, before the
    /// device is activated; another device's state is an error.
    fn load_device(&mut self, state: &VirtioDeviceState) -> Result<(), String> {
        match state {
            VirtioDeviceState::None => Ok(()),
            other => Err(format!("saved {} state for this device", other.kind())),
        }
    }
    /// Handles a driver reset; returns false if the device cannot be reset
    /// (the transport then marks it as needing a reset).
    fn reset(&mut self) -> bool {
        false
    }
}
