//! Builds a vm from its configuration: KVM VM, memory, kernel, devices, vCPUs.
//! Read top-down, [`build`] is the boot path.

use std::fs::OpenOptions;
use std::sync::{Arc, Mutex};

use vm_memory::GuestAddress;
use vmm_sys_util::eventfd::EventFd;

use crate::arch::x86_64::{boot, layout};
use crate::config::{ConfigError, VmConfig};
use crate::devices::legacy::i8042::{I8042_LEN, I8042_PORT};
use crate::devices::legacy::serial::{COM1_LEN, COM1_PORT};
use crate::devices::legacy::{ConsoleOutput, SerialDevice, I8042};
use crate::devices::{Bus, BusError};
use crate::exit::ExitNotifier;
use crate::memory::{create_guest_memory, GuestMemoryMmap, MemoryError};
use crate::vcpu::{Vcpu, VcpuError};
use crate::vm::{Vm, VmError};
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
    #[error("Cannot create an eventfd")]
    EventFd(#[source] std::io::Error),
    #[error("KVM refused an irqfd for GSI {gsi}")]
    IrqFd {
        gsi: u32,
        #[source]
        source: kvm_ioctls::Error,
    },
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

    let exit = Arc::new(ExitNotifier::new());
    let (pio, serial) = legacy_devices(&vm, config, &exit)?;
    let mmio = Bus::new();

    let cmdline = boot::cmdline(&config.cmdline)?;
    boot::configure_system(&mem, &kernel, &cmdline, initrd, None)?;

    let mut vcpus = Vec::with_capacity(usize::from(config.vcpus));
    for index in 0..config.vcpus {
        let vcpu = Vcpu::new(vm.fd(), index)?;
        vcpu.configure_boot(&mem, vm.supported_cpuid(), config.vcpus, kernel.entry.0)?;
        vcpus.push(vcpu);
    }

    Ok(Vmm {
        vm,
        mem,
        vcpus,
        pio: Arc::new(pio),
        mmio: Arc::new(mmio),
        exit,
        serial,
        console_stdin: config.console_stdin,
    })
}

fn guest_memory(mem_mib: u64) -> Result<GuestMemoryMmap, MemoryError> {
    let regions: Vec<(GuestAddress, usize)> = layout::ram_regions(mem_mib << 20)
        .into_iter()
        .map(|(start, size)| (GuestAddress(start), size as usize))
        .collect();
    create_guest_memory(&regions)
}

/// COM1 and the i8042 on the port-I/O bus.
fn legacy_devices(
    vm: &Vm,
    config: &VmConfig,
    exit: &Arc<ExitNotifier>,
) -> Result<(Bus, Arc<Mutex<SerialDevice>>), BuildError> {
    let log = match &config.console_log {
        Some(path) => Some(
            OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|source| BuildError::ConsoleLog {
                    path: path.clone(),
                    source,
                })?,
        ),
        None => None,
    };
    let irq = EventFd::new(libc::EFD_NONBLOCK).map_err(BuildError::EventFd)?;
    vm.fd()
        .register_irqfd(&irq, layout::SERIAL_GSI)
        .map_err(|source| BuildError::IrqFd {
            gsi: layout::SERIAL_GSI,
            source,
        })?;
    let serial = Arc::new(Mutex::new(SerialDevice::new(
        irq,
        ConsoleOutput::new(log, config.console_stdout),
    )));
    let mut pio = Bus::new();
    pio.insert(serial.clone(), COM1_PORT, COM1_LEN)?;
    pio.insert(Arc::new(Mutex::new(I8042::new(exit.clone()))), I8042_PORT, I8042_LEN)?;
    Ok((pio, serial))
}
