//! Builds a vm from its configuration: KVM VM, memory, kernel, devices, vCPUs.
//! Read top-down, [`build`] is the boot path.

use std::sync::{Arc, Mutex};

use event_manager::{EventManager, MutEventSubscriber, SubscriberOps};
use kvm_bindings::{kvm_cpuid_entry2, CpuId};
use kvm_ioctls::IoEventAddress;
use snapshot::compat::CpuidEntry;

use vmm_sys_util::eventfd::EventFd;

use crate::arch::x86_64::acpi::{self, AcpiError, VirtioMmioSlot, VmGenIdSlot};
use crate::arch::x86_64::{boot, layout};
use crate::config::{ConfigError, VmConfig};
use crate::devices::legacy::acpi_pm::{AcpiPmDevice, ACPI_PM_LEN, ACPI_PM_PORT};
use crate::devices::legacy::i8042::{I8042_LEN, I8042_PORT};
use crate::devices::legacy::serial::{SerialError, SerialState};
use crate::devices::legacy::serial::{COM1_LEN, COM1_PORT};
use crate::devices::legacy::vmgenid::{self, VmGenId, VmGenIdError, VMGENID_ADDR, VMGENID_LEN};
use crate::devices::legacy::{ConsoleOutput, SerialDevice, I8042};
use crate::devices::park::{device_park, ParkControl};
use crate::devices::persist::{DeviceStates, Persist};
use crate::devices::virtio::block::{Block, BlockConfig, BlockError};
use crate::devices::virtio::mmio::MmioState;
use crate::devices::virtio::mmio::{MmioError, MmioTransport, MMIO_LEN, QUEUE_NOTIFY_OFFSET};
use crate::devices::virtio::net::{Net, NetConfig, NetError};
use crate::devices::virtio::vsock::{Vsock, VsockConfig, VsockError};
use crate::devices::virtio::VirtioDevice;
use crate::devices::{Bus, BusError};
use crate::exit::ExitNotifier;
use crate::memory::{create_guest_memory, GuestMemoryMmap, MemoryError, RamBacking};
use crate::moment::{DeviceLayout, Moment};
use crate::vcpu::{Vcpu, VcpuError};
use crate::vm::{Vm, VmError};
use crate::vstate::{load_machine, restore_machine, RestoreError};
use crate::Vmm;

/// Errors while building a vm.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Vm(#[from] VmError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error("Cannot place a device on the bus")]
    Bus(#[from] BusError),
    #[error("Cannot open console log {path}: {source}")]
    ConsoleLog {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Block(#[from] BlockError),
    #[error(transparent)]
    Net(#[from] NetError),
    #[error(transparent)]
    Vsock(#[from] VsockError),
    #[error("Cannot set up the virtio-mmio transport")]
    Mmio(#[from] MmioError),
    #[error("Cannot create the device event loop")]
    EventManager(#[source] event_manager::Error),
    #[error("KVM refused an ioeventfd at {addr:#x}")]
    IoEvent {
        addr: u64,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error(transparent)]
    Acpi(#[from] AcpiError),
    #[error("Cannot create an eventfd")]
    EventFd(#[source] std::io::Error),
    #[error(transparent)]
    Restore(#[from] RestoreError),
    #[error("Cannot restore the serial port")]
    Serial(#[from] SerialError),
    #[error("The saved state has a different number of devices than this vm")]
    DeviceCount,
    #[error("The snapshot's devices are {saved}, but the vm asks for {asked}: give it the same disks, nets and vsock")]
    Layout { saved: String, asked: String },
    #[error("KVM refused an irqfd for GSI {gsi}")]
    IrqFd {
        gsi: u32,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error(transparent)]
    VmGenId(#[from] VmGenIdError),
    #[error("This host does not satisfy CPU template {template}: {gaps}. Run without --cpu-template, or under a template this host satisfies (tine cpu-templates)")]
    CpuTemplate { template: String, gaps: String },
    #[error("Cannot read this host's CPU offer for the CPU template")]
    HostCompat(#[from] crate::compat::CompatCollectError),
}

/// Builds everything a vm needs, ready for [`Vmm::run`].
pub fn build(config: &VmConfig) -> Result<Vmm, BuildError> {
    config.validate()?;
    let vm = Vm::new(&config.kvm_device)?;
    let mem = guest_memory(config.mem_mib)?;
    vm.register_memory(&mem)?;
    vm.setup_irqchip()?;

    let kernel = boot::load_kernel(&mem, &config.kernel)?;
    let initrd = match &config.initrd {
        Some(path) => Some(boot::load_initrd(&mem, path, &kernel)?),
        None => None,
    };

    let devices = Devices::attach(&vm, &mem, config, None)?;
    vmgenid::write_new_id(&mem)?;
    let rsdp = acpi::create_acpi_tables(
        &mem,
        config.vcpus,
        &devices.slots,
        Some(devices.vmgenid_slot()),
    )?;
    let cmdline = boot::cmdline(&config.cmdline)?;
    boot::configure_system(&mem, &kernel, &cmdline, initrd, Some(rsdp))?;

    let cpuid = guest_cpuid(&vm, config)?;
    let mut vcpus = Vec::with_capacity(usize::from(config.vcpus));
    for index in 0..config.vcpus {
        let vcpu = Vcpu::new(vm.fd(), index)?;
        vcpu.configure_boot(
            &mem,
            &cpuid,
            config.cpu_template.as_ref(),
            config.vcpus,
            kernel.entry.0,
        )?;
        vcpus.push(vcpu);
    }
    if let (Some(t), Some(v)) = (&config.cpu_template, vcpus.first()) {
        warn_unapplied(t, v)?;
    }
    Ok(Vmm::assemble(
        vm,
        mem,
        RamBacking::SharedMemfd,
        vcpus,
        devices,
        config.clone(),
    ))
}

/// The CPUID every vCPU starts from (before its topology is set): KVM's
/// supported list, normalized to the vm's CPU template if it has one.
/// A host whose offer does not satisfy the template is refused, naming
/// every feature it lacks, rather than showing the guest a feature the
/// hardware does not have.
fn guest_cpuid(vm: &Vm, config: &VmConfig) -> Result<CpuId, BuildError> {
    let supported = vm.supported_cpuid()?;
    let Some(template) = &config.cpu_template else {
        return Ok(supported.clone());
    };
    let host = crate::compat::host_compat(&config.kvm_device)?;
    if let Err(gaps) = host.satisfies(template) {
        return Err(BuildError::CpuTemplate {
            template: template.name.clone(),
            gaps: gaps
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        });
    }
    let mut entries: Vec<CpuidEntry> = supported
        .as_slice()
        .iter()
        .map(crate::compat::entry)
        .collect();
    template.apply_cpuid(&mut entries);
    let kvm: Vec<kvm_cpuid_entry2> = entries
        .iter()
        .map(|e| kvm_cpuid_entry2 {
            function: e.function,
            index: e.index,
            flags: e.flags,
            eax: e.eax,
            ebx: e.ebx,
            ecx: e.ecx,
            edx: e.edx,
            ..Default::default()
        })
        .collect();
    CpuId::from_entries(&kvm).map_err(|_| BuildError::CpuTemplate {
        template: template.name.clone(),
        gaps: format!("it makes {} CPUID entries, more than KVM takes", kvm.len()),
    })
}

/// Logs the template bits KVM did not give the vCPU. KVM may change what
/// it is given: kvm_pvm passes the hardware's leaves 7 and 0xD through
/// (the guest runs with the host's XCR0), and VME, so there a template cannot hide
/// AVX-512 and the like. The snapshot's manifest records the CPUID the
/// vCPU really has, and restore checks those bits too, so this costs
/// portability, never correctness.
fn warn_unapplied(template: &snapshot::template::Template, vcpu: &Vcpu) -> Result<(), BuildError> {
    let got: Vec<CpuidEntry> = vcpu.cpuid()?.iter().map(crate::compat::entry).collect();
    let wrong = template.differences(&got);
    if !wrong.is_empty() {
        let bits: Vec<String> = wrong
            .iter()
            .map(|&b| match snapshot::compat::feature_name(b) {
                Some(n) => format!("{n} ({b})"),
                None => b.to_string(),
            })
            .collect();
        tracing::warn!(
            "this host's KVM did not apply CPU template {} to {} bit(s); the guest sees the host's value: {}",
            template.name,
            bits.len(),
            bits.join(", ")
        );
    }
    Ok(())
}

/// Rebuilds a vm from a saved [`Moment`] on guest memory that already
/// holds its RAM (a fork's copy-on-write view or a mapped memory file):
/// a new KVM VM with the saved CPU and VM state, and devices in their
/// saved state on the host side `config` names (its own disks, tap,
/// socket and console). A restored snapshot is a new copy of the vm, so
/// it gets a new generation id ([`Vmm::new_generation`]). Nothing runs yet.
pub fn restore(
    config: &VmConfig,
    mem: GuestMemoryMmap,
    backing: RamBacking,
    moment: &Moment,
) -> Result<Vmm, BuildError> {
    let vmm = restore_prepared(config, mem, backing, moment, None)?;
    vmm.new_generation()?;
    Ok(vmm)
}

/// [`restore`] into a VM and vCPUs made by
/// [`crate::vstate::prepare_machine`] on `mem`, if given. The generation
/// id stays as saved (the vm going on in a new process); a new copy (a
/// fork child, a rollback) calls [`Vmm::new_generation`] before it runs.
pub fn restore_prepared(
    config: &VmConfig,
    mem: GuestMemoryMmap,
    backing: RamBacking,
    moment: &Moment,
    prepared: Option<(Vm, Vec<Vcpu>)>,
) -> Result<Vmm, BuildError> {
    let layout = DeviceLayout::of(config);
    if layout != moment.layout {
        return Err(BuildError::Layout {
            saved: moment.layout.to_string(),
            asked: layout.to_string(),
        });
    }
    let t = std::time::Instant::now();
    let (vm, vcpus) = match prepared {
        Some((vm, vcpus)) => {
            load_machine(&vm, &vcpus, &moment.machine)?;
            (vm, vcpus)
        }
        None => restore_machine(&config.kvm_device, &mem, &moment.machine)?,
    };
    crate::trace::trace(t, "machine restored");
    let devices = Devices::attach(&vm, &mem, config, Some(&moment.devices))?;
    Ok(Vmm::assemble(
        vm,
        mem,
        backing,
        vcpus,
        devices,
        config.clone(),
    ))
}

impl Vmm {
    /// Makes this vm a new generation: writes a fresh random VMGenID into
    /// guest memory and raises the Generic Event Device's interrupt, so a
    /// kernel with a VMGenID driver reseeds its RNG. For a vm built by
    /// [`restore_prepared`] before it runs (the machine state is in KVM
    /// already, which keeps the interrupt pending until the guest runs).
    /// Returns the new id.
    pub fn new_generation(&self) -> Result<[u8; VMGENID_LEN], VmGenIdError> {
        let id = self.devices.vmgenid.new_generation(&self.mem)?;
        tracing::debug!(gsi = self.devices.vmgenid.gsi(), "new VMGenID written");
        Ok(id)
    }
}

fn guest_memory(mem_mib: u64) -> Result<GuestMemoryMmap, MemoryError> {
    create_guest_memory(&crate::moment::ram_regions(mem_mib))
}

/// COM1 (in its saved state, if any), the i8042 and the ACPI PM device on
/// the port-I/O bus.
fn legacy_devices(
    vm: &Vm,
    config: &VmConfig,
    exit: &Arc<ExitNotifier>,
    saved: Option<&SerialState>,
) -> Result<(Bus, Arc<Mutex<SerialDevice>>), BuildError> {
    let out = match &config.console_log {
        Some(path) => {
            ConsoleOutput::with_log_path(path, config.console_stdout).map_err(|source| {
                BuildError::ConsoleLog {
                    path: path.clone(),
                    source,
                }
            })?
        }
        None => ConsoleOutput::new(None, config.console_stdout),
    };
    let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(BuildError::EventFd)?;
    vm.fd()
        .register_irqfd(&irq, layout::SERIAL_GSI)
        .map_err(|source| BuildError::IrqFd {
            gsi: layout::SERIAL_GSI,
            source,
        })?;
    let serial = match saved {
        Some(state) => SerialDevice::restore((irq, out), state)?,
        None => SerialDevice::new(irq, out),
    };
    let serial = Arc::new(Mutex::new(serial));
    let mut pio = Bus::new();
    pio.insert(serial.clone(), COM1_PORT, COM1_LEN)?;
    pio.insert(
        Arc::new(Mutex::new(I8042::new(exit.clone()))),
        I8042_PORT,
        I8042_LEN,
    )?;
    pio.insert(
        Arc::new(Mutex::new(AcpiPmDevice::new(exit.clone()))),
        u64::from(ACPI_PM_PORT),
        ACPI_PM_LEN,
    )?;
    Ok((pio, serial))
}

/// The device thread's subscribers.
pub type DeviceEventManager = EventManager<Arc<Mutex<dyn MutEventSubscriber + Send>>>;

/// virtio-mmio devices as they are attached: each gets the next 4 KiB slot
/// and GSI, its queue notifications as ioeventfds, its interrupt as an irqfd.
struct VirtioDevices<'a> {
    vm: &'a Vm,
    mem: &'a GuestMemoryMmap,
    mmio: Bus,
    event_manager: DeviceEventManager,
    slots: Vec<VirtioMmioSlot>,
    transports: Vec<Arc<Mutex<MmioTransport>>>,
    /// Saved transport states, one per slot, when restoring.
    saved: Option<&'a [MmioState]>,
}

impl<'a> VirtioDevices<'a> {
    fn new(
        vm: &'a Vm,
        mem: &'a GuestMemoryMmap,
        saved: Option<&'a [MmioState]>,
    ) -> Result<Self, BuildError> {
        Ok(Self {
            vm,
            mem,
            mmio: Bus::new(),
            event_manager: EventManager::new().map_err(BuildError::EventManager)?,
            slots: Vec::new(),
            transports: Vec::new(),
            saved,
        })
    }

    fn attach<D>(&mut self, device: D) -> Result<(), BuildError>
    where
        D: VirtioDevice + MutEventSubscriber + Send + 'static,
    {
        let n = self.slots.len() as u64;
        let base = layout::VIRTIO_MMIO_START + n * layout::VIRTIO_MMIO_SLOT;
        let gsi = layout::VIRTIO_GSI_START + n as u32;
        let device = Arc::new(Mutex::new(device));
        let args = (
            self.mem.clone(),
            device.clone() as Arc<Mutex<dyn VirtioDevice>>,
        );
        let transport = match self.saved {
            Some(saved) => {
                let state = saved.get(n as usize).ok_or(BuildError::DeviceCount)?;
                MmioTransport::restore(args, state)?
            }
            None => MmioTransport::new(args.0, args.1)?,
        };
        let notify = base + QUEUE_NOTIFY_OFFSET;
        for (i, evt) in transport.queue_evts().iter().enumerate() {
            self.vm
                .fd()
                .register_ioevent(evt, &IoEventAddress::Mmio(notify), i as u32)
                .map_err(|source| BuildError::IoEvent {
                    addr: notify,
                    source,
                })?;
        }
        self.vm
            .fd()
            .register_irqfd(transport.interrupt().irq_evt(), gsi)
            .map_err(|source| BuildError::IrqFd { gsi, source })?;
        let transport = Arc::new(Mutex::new(transport));
        self.mmio.insert(transport.clone(), base, MMIO_LEN)?;
        self.transports.push(transport);
        self.event_manager.add_subscriber(device);
        self.slots.push(VirtioMmioSlot {
            base,
            len: MMIO_LEN,
            gsi,
        });
        Ok(())
    }
}

/// Every device of a vm, wired to the VM and the device thread.
pub(crate) struct Devices {
    pub pio: Bus,
    pub mmio: Bus,
    pub event_manager: DeviceEventManager,
    /// (base, GSI) of every virtio slot, for the ACPI tables.
    pub slots: Vec<VirtioMmioSlot>,
    pub exit: Arc<ExitNotifier>,
    pub serial: Arc<Mutex<SerialDevice>>,
    pub transports: Vec<Arc<Mutex<MmioTransport>>>,
    pub park: ParkControl,
    /// Tap fds, kept open across a fork for the parent's continuation.
    pub tap_fds: Vec<i32>,
    /// The generation id's notify interrupt, on the GSI after the last
    /// virtio slot's (so it follows from the device layout).
    pub vmgenid: VmGenId,
}

impl Devices {
    /// Creates the devices `config` asks for, in the fixed order disks,
    /// nets, vsock (the order is the guest-visible layout), in the saved
    /// state `saved` if given.
    fn attach(
        vm: &Vm,
        mem: &GuestMemoryMmap,
        config: &VmConfig,
        saved: Option<&DeviceStates>,
    ) -> Result<Self, BuildError> {
        let exit = Arc::new(ExitNotifier::new());
        let (pio, serial) = legacy_devices(vm, config, &exit, saved.map(|s| &s.serial))?;
        if let Some(s) = saved {
            if s.virtio.len() != DeviceLayout::of(config).count() {
                return Err(BuildError::DeviceCount);
            }
        }
        let mut devices = VirtioDevices::new(vm, mem, saved.map(|s| s.virtio.as_slice()))?;
        for d in &config.disks {
            devices.attach(Block::new(BlockConfig {
                path: d.path.clone(),
                read_only: d.read_only,
                id: None,
            })?)?;
        }
        let mut tap_fds = Vec::new();
        for n in &config.nets {
            let net = Net::new(NetConfig {
                tap_name: n.tap.clone(),
                mac: n.mac,
                tap_fd: n.tap_fd,
            })?;
            tap_fds.push(net.tap_fd());
            devices.attach(net)?;
        }
        if let Some(v) = &config.vsock {
            devices.attach(Vsock::new(VsockConfig {
                guest_cid: v.guest_cid,
                uds_path: v.uds_path.clone(),
            })?)?;
        }
        let vmgenid_gsi = layout::VIRTIO_GSI_START + devices.slots.len() as u32;
        let vmgenid = VmGenId::new(vm, vmgenid_gsi)?;
        let (parker, park) = device_park().map_err(BuildError::EventFd)?;
        devices
            .event_manager
            .add_subscriber(Arc::new(Mutex::new(parker)));
        Ok(Self {
            pio,
            mmio: devices.mmio,
            event_manager: devices.event_manager,
            slots: devices.slots,
            exit,
            serial,
            transports: devices.transports,
            park,
            tap_fds,
            vmgenid,
        })
    }

    /// Where the DSDT tells the guest to find the generation id.
    fn vmgenid_slot(&self) -> VmGenIdSlot {
        VmGenIdSlot {
            addr: VMGENID_ADDR,
            gsi: self.vmgenid.gsi(),
        }
    }
}
