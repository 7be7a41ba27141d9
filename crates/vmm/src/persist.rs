//! One pause/save/restore trait for every part of a vm that has state:
//! vCPUs, the VM-level KVM state, every legacy device, every virtio
//! transport, queue and device ("The moment", ARCHITECTURE.md).
//!
//! Each part names its typed, plain-serde state and what a restore needs
//! besides it (the host side: a fresh KVM object, an fd, a config), so
//! nothing is saved as untyped JSON. The moment is the parts' states put
//! together ([`crate::Moment`]); `tine-snapshot` frames it with magic,
//! format version and CRC, and a change of any state's layout bumps that
//! version. Every implementation runs through one round trip test
//! (save, restore, save: equal), in this module's tests.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A part of a vm whose guest-visible state can be saved while the vm is
/// paused and rebuilt elsewhere.
pub trait Persist: Sized {
    /// Plain serde data.
    type State: Serialize + DeserializeOwned + Clone + std::fmt::Debug;
    /// What a restore needs besides the state: the host side, which is
    /// never state (each fork child gets its own disk, tap, socket, KVM
    /// objects).
    type ConstructorArgs;
    type Error: std::fmt::Display;
    /// The part's state; call while it is quiescent (vCPUs paused, the
    /// device thread parked).
    fn save(&self) -> Result<Self::State, Self::Error>;
    /// The part in the saved state, on the host side in `args`.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error>;
}

/// The state of a part that keeps none: its behaviour is fixed and its
/// host side is new each time (the i8042 and the ACPI PM device only cause
/// exits; the generation id lives in guest memory).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoState {}

#[cfg(test)]
mod tests {
    //! crosvm's `suspendable_tests!` idea: every implementation, made in a
    //! state that is not its default, goes through save, restore (on a
    //! fresh host side), save, and both states must be equal. KVM parts
    //! run on this host's /dev/kvm.

    use std::path::Path;
    use std::sync::{Arc, Mutex};

    use vmm_sys_util::eventfd::EventFd;

    use super::*;
    use crate::devices::legacy::acpi_pm::AcpiPmDevice;
    use crate::devices::legacy::vmgenid::VmGenId;
    use crate::devices::legacy::{ConsoleOutput, SerialDevice, I8042};
    use crate::devices::virtio::block::{Block, BlockConfig};
    use crate::devices::virtio::mmio::testing::linux_probe;
    use crate::devices::virtio::mmio::MmioTransport;
    use crate::devices::virtio::queue::testing::TestQueue;
    use crate::devices::virtio::vsock::{Vsock, VsockConfig};
    use crate::devices::virtio::VirtioDevice;
    use crate::exit::ExitNotifier;
    use crate::memory::GuestMemoryMmap;
    use crate::vcpu::Vcpu;
    use crate::vm::Vm;

    /// Saves `part`, restores it with `args`, saves again: the two states
    /// must be equal (as serde data, after `normalize` drops what moves on
    /// by itself, like a running clock). Returns the restored part.
    fn round_trip<T: Persist>(
        what: &str,
        part: &T,
        args: T::ConstructorArgs,
        normalize: fn(&mut serde_json::Value),
    ) -> T {
        let first = part.save().unwrap_or_else(|e| panic!("{what}: save: {e}"));
        // The state survives its own encoding (what a snapshot does).
        let json = serde_json::to_string(&first).expect("encode");
        let decoded: T::State = serde_json::from_str(&json).expect("decode");
        let restored =
            T::restore(args, &decoded).unwrap_or_else(|e| panic!("{what}: restore: {e}"));
        let second = restored
            .save()
            .unwrap_or_else(|e| panic!("{what}: save after restore: {e}"));
        let (mut a, mut b) = (
            serde_json::to_value(&first).expect("value"),
            serde_json::to_value(&second).expect("value"),
        );
        normalize(&mut a);
        normalize(&mut b);
        let diff = differences(&a, &b, "");
        assert!(
            diff.is_empty(),
            "{what}: state changed through save, restore, save at {diff:?}"
        );
        restored
    }

    fn keep(_: &mut serde_json::Value) {}

    /// Paths (and values) where two states differ.
    fn differences(a: &serde_json::Value, b: &serde_json::Value, at: &str) -> Vec<String> {
        use serde_json::Value;
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
                keys.sort();
                keys.dedup();
                keys.into_iter()
                    .flat_map(|k| {
                        let n = Value::Null;
                        differences(
                            x.get(k).unwrap_or(&n),
                            y.get(k).unwrap_or(&n),
                            &format!("{at}.{k}"),
                        )
                    })
                    .collect()
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => x
                .iter()
                .zip(y)
                .enumerate()
                .flat_map(|(i, (p, q))| differences(p, q, &format!("{at}[{i}]")))
                .collect(),
            _ if a == b => Vec::new(),
            _ => vec![format!("{at}: {a} != {b}")],
        }
    }

    /// Every implementation of [`Persist`], once: `name: part, args[, normalize];`.
    macro_rules! persist_round_trips {
        ($($name:ident: $part:expr, $args:expr $(, $norm:expr)?;)*) => {
            $(
                #[test]
                fn $name() {
                    let part = $part;
                    #[allow(unused_variables)]
                    let norm: fn(&mut serde_json::Value) = keep;
                    $(let norm: fn(&mut serde_json::Value) = $norm;)?
                    round_trip(stringify!($name), &part, $args, norm);
                }
            )*
        };
    }

    fn evt() -> EventFd {
        EventFd::new(libc::EFD_NONBLOCK).expect("eventfd")
    }

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(vm_memory::GuestAddress(0), 0x40_0000)]).expect("mem")
    }

    fn vm() -> Vm {
        let vm = Vm::new(Path::new("/dev/kvm")).expect("vm");
        vm.setup_irqchip().expect("irqchip");
        vm
    }

    /// A serial port the guest has configured and written to.
    fn serial() -> SerialDevice {
        let mut s = SerialDevice::new(evt(), ConsoleOutput::new(None, false));
        // LCR: 8N1 with DLAB, divisor 3, then IER = RX interrupt; input
        // waiting in the FIFO.
        for (off, v) in [(3u8, 0x83u8), (0, 3), (3, 0x03), (1, 1), (7, 0x5a)] {
            crate::devices::BusDevice::write(&mut s, u64::from(off), &[v]);
        }
        s.enqueue_input(b"hi");
        s
    }

    fn disk_file() -> vmm_sys_util::tempfile::TempFile {
        let f = vmm_sys_util::tempfile::TempFile::new().expect("temp file");
        f.as_file().set_len(1 << 20).expect("size");
        f
    }

    fn block_config(f: &vmm_sys_util::tempfile::TempFile) -> BlockConfig {
        BlockConfig {
            path: f.as_path().to_path_buf(),
            read_only: false,
            id: Some("rt".into()),
        }
    }

    /// A block device behind a transport the guest driver has started.
    fn started_transport(
        f: &vmm_sys_util::tempfile::TempFile,
    ) -> (MmioTransport, Arc<Mutex<dyn VirtioDevice>>, GuestMemoryMmap) {
        let mem = mem();
        let blk: Arc<Mutex<dyn VirtioDevice>> =
            Arc::new(Mutex::new(Block::new(block_config(f)).expect("block")));
        let mut t = MmioTransport::new(mem.clone(), blk.clone()).expect("transport");
        let q = TestQueue::new(&mem, 0x1_0000, crate::devices::virtio::block::QUEUE_SIZE);
        let flush = 1u64 << virtio_bindings::virtio_blk::VIRTIO_BLK_F_FLUSH;
        assert_eq!(linux_probe(&mut t, flush, std::slice::from_ref(&q)), 0xf);
        (t, blk, mem)
    }

    fn vsock_config(dir: &Path) -> VsockConfig {
        VsockConfig {
            guest_cid: 7,
            uds_path: dir.join("v.sock"),
        }
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("tine-persist-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("scratch");
        d
    }

    /// The vCPU's TSC and the VM's kvmclock and PIT run on by themselves.
    fn drop_clocks(v: &mut serde_json::Value) {
        if let Some(msrs) = v.get_mut("msrs").and_then(|m| m.as_array_mut()) {
            // kvm_msr_entry as its 16 bytes: index (u32 LE), reserved, data.
            // IA32_TSC counts on while the vCPU waits.
            msrs.retain(|m| {
                let b = |i: usize| m.get(i).and_then(|x| x.as_u64()).unwrap_or(0);
                b(0) | b(1) << 8 | b(2) << 16 | b(3) << 24 != 0x10
            });
        }
        if let Some(c) = v.get_mut("clock") {
            *c = serde_json::Value::Null;
        }
        if let Some(p) = v.get_mut("pit") {
            *p = serde_json::Value::Null;
        }
    }

    persist_round_trips! {
        test_serial_round_trips: serial(), (evt(), ConsoleOutput::new(None, false));
        test_i8042_round_trips: I8042::new(Arc::new(ExitNotifier::new())), Arc::new(ExitNotifier::new());
        test_acpi_pm_round_trips:
            AcpiPmDevice::new(Arc::new(ExitNotifier::new())), Arc::new(ExitNotifier::new());
        test_queue_round_trips: {
            use virtio_queue::QueueT;
            let mut q = virtio_queue::Queue::new(64).expect("queue");
            q.set_size(32);
            q.set_desc_table_address(Some(0x1_0000), Some(0));
            q.set_avail_ring_address(Some(0x1_1000), Some(0));
            q.set_used_ring_address(Some(0x1_2000), Some(0));
            q.set_event_idx(true);
            q.set_next_avail(7);
            q.set_next_used(5);
            q.set_ready(true);
            q
        }, ();
    }

    #[test]
    fn test_vmgenid_round_trips() {
        let vm = vm();
        let dev = VmGenId::new(&vm, 9).expect("vmgenid");
        let irq = evt();
        vm.fd().register_irqfd(&irq, 10).expect("irqfd");
        let back = round_trip("vmgenid", &dev, (irq, 10), keep);
        assert_eq!(back.gsi(), 10);
    }

    #[test]
    fn test_block_round_trips() {
        let f = disk_file();
        let blk = Block::new(block_config(&f)).expect("block");
        let g = disk_file();
        round_trip("block", &blk, block_config(&g), keep);
    }

    #[test]
    fn test_vsock_round_trips() {
        let d = scratch("vsock");
        let mut v = Vsock::new(vsock_config(&d)).expect("vsock");
        v.load_device(&crate::devices::virtio::VirtioDeviceState::Vsock(
            crate::devices::virtio::vsock::VsockState {
                next_local_port: (1 << 30) + 4242,
            },
        ))
        .expect("load");
        let e = scratch("vsock2");
        let back = round_trip("vsock", &v, vsock_config(&e), keep);
        assert_eq!(back.save().expect("save").next_local_port, (1 << 30) + 4242);
        let _ = std::fs::remove_dir_all(d);
        let _ = std::fs::remove_dir_all(e);
    }

    #[test]
    fn test_mmio_transport_round_trips() {
        let f = disk_file();
        let (t, _, mem) = started_transport(&f);
        let g = disk_file();
        let dev: Arc<Mutex<dyn VirtioDevice>> =
            Arc::new(Mutex::new(Block::new(block_config(&g)).expect("block")));
        let back = round_trip("mmio transport", &t, (mem, dev.clone()), keep);
        assert_eq!(back.device_status() & 4, 4, "the restored device runs");
        assert!(dev.lock().expect("lock").is_activated());
    }

    #[test]
    fn test_vm_round_trips() {
        let vm = vm();
        round_trip("vm", &vm, self::vm(), drop_clocks);
    }

    #[test]
    fn test_vcpu_round_trips() {
        let vm = vm();
        let vcpu = Vcpu::new(vm.fd(), 0).expect("vcpu");
        // Not the reset state: registers a guest would have changed.
        let mut s = vcpu.save_state().expect("save");
        s.regs.rax = 0x1234_5678;
        s.regs.rip = 0x10_0000;
        s.sregs.cr0 |= 1;
        vcpu.restore_state(&s).expect("set");
        let other = self::vm();
        let fresh = Vcpu::new(other.fd(), 0).expect("vcpu");
        round_trip("vcpu", &vcpu, fresh, drop_clocks);
    }
}
