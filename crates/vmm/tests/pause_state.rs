//! Pause/resume and vCPU + VM-level state on real KVM, with the `counter`
//! micro guest (it prints `CNT <n>` every 100 ms).

mod common;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::copy_memory;
use serde_json::Value;
use vmm::arch::x86_64::layout;
use vmm::devices::legacy::serial::{COM1_LEN, COM1_PORT};
use vmm::devices::legacy::{ConsoleOutput, SerialDevice};
use vmm::devices::Bus;
use vmm::exit::ExitNotifier;
use vmm::memory::GuestMemoryMmap;
use vmm::vstate::restore_machine;
use vmm::{MachineState, RunningVmm, VmConfig};
use vmm_sys_util::eventfd::EventFd;

const WAIT: Duration = Duration::from_secs(10);

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tine-state-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn boot_counter(log: &Path) -> RunningVmm {
    boot_counter_with(log, 1)
}

fn boot_counter_with(log: &Path, vcpus: u8) -> RunningVmm {
    let config = VmConfig {
        kernel: guests::counter_path().into(),
        mem_mib: 64,
        vcpus,
        console_log: Some(log.to_path_buf()),
        ..Default::default()
    };
    vmm::build(&config).expect("build").start().expect("start")
}

fn read(log: &Path) -> String {
    String::from_utf8_lossy(&std::fs::read(log).unwrap_or_default()).into_owned()
}

/// `CNT <n>` values of the complete lines of `text`, in order.
fn counts(text: &str) -> Vec<u64> {
    let complete = match text.rfind('\n') {
        Some(i) => &text[..=i],
        None => "",
    };
    complete
        .lines()
        .filter_map(|l| l.strip_prefix("CNT "))
        .filter_map(|n| n.trim().parse().ok())
        .collect()
}

fn wait_for_count(log: &Path, at_least: u64) -> Vec<u64> {
    let deadline = Instant::now() + WAIT;
    loop {
        let c = counts(&read(log));
        if c.last().is_some_and(|&n| n >= at_least) {
            return c;
        }
        assert!(
            Instant::now() < deadline,
            "no CNT {at_least} in {}: {:?}",
            log.display(),
            read(log)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn assert_consecutive(c: &[u64]) {
    for w in c.windows(2) {
        assert_eq!(w[1], w[0] + 1, "counter skipped or repeated: {c:?}");
    }
}

/// Every path where `a` and `b` differ, as `a.b[3].c`.
fn diff(path: &str, a: &Value, b: &Value, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            for (k, v) in x {
                match y.get(k) {
                    Some(w) => diff(&format!("{path}.{k}"), v, w, out),
                    None => out.push(format!("{path}.{k} (missing)")),
                }
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (v, w)) in x.iter().zip(y).enumerate() {
                diff(&format!("{path}[{i}]"), v, w, out);
            }
        }
        _ if a != b => out.push(path.to_string()),
        _ => {}
    }
}

#[test]
fn test_pause_stops_guest_and_resume_continues() {
    let dir = scratch("pause");
    let log = dir.join("console.log");
    let running = boot_counter(&log);
    let h = running.handle();
    wait_for_count(&log, 2);

    let took = h.pause().expect("pause");
    assert!(h.is_paused());
    assert!(matches!(h.pause(), Err(vmm::ControlError::AlreadyPaused)));
    let at_pause = read(&log);
    let n = *counts(&at_pause).last().expect("a count");
    std::thread::sleep(Duration::from_millis(350));
    assert_eq!(read(&log), at_pause, "console grew while paused");

    h.resume().expect("resume");
    assert!(matches!(h.resume(), Err(vmm::ControlError::NotPaused)));
    let after = wait_for_count(&log, n + 2);
    assert_consecutive(&after);
    println!("pause took {took:?}");
    running.handle().stop();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn test_save_while_running_is_refused() {
    let dir = scratch("refuse");
    let log = dir.join("console.log");
    let running = boot_counter(&log);
    wait_for_count(&log, 1);
    assert!(matches!(
        running.handle().save_state(),
        Err(vmm::ControlError::NotPaused)
    ));
    running.handle().stop();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn test_pause_latency_median() {
    let dir = scratch("latency");
    let log = dir.join("console.log");
    let running = boot_counter(&log);
    let h = running.handle();
    wait_for_count(&log, 1);
    let mut pauses = Vec::with_capacity(100);
    let mut cycles = Vec::with_capacity(100);
    for _ in 0..100 {
        let start = Instant::now();
        pauses.push(h.pause().expect("pause"));
        h.resume().expect("resume");
        cycles.push(start.elapsed());
        std::thread::sleep(Duration::from_millis(1));
    }
    pauses.sort();
    cycles.sort();
    println!(
        "pause_us_p50={} pause_us_p90={} pause_resume_us_p50={} (100 cycles, counter guest, 64 MiB)",
        pauses[50].as_micros(),
        pauses[90].as_micros(),
        cycles[50].as_micros()
    );
    // The guest still runs and counts in order.
    let n = *counts(&read(&log)).last().expect("a count");
    assert_consecutive(&wait_for_count(&log, n + 1));
    running.handle().stop();
    let _ = std::fs::remove_dir_all(dir);
}

/// Fields that legitimately differ between a save and a save right after
/// restoring it into a new VM, because they are clocks that keep moving:
/// - `vm.clock`: kvmclock advances between set and get (and `flags`,
///   `realtime`, `host_tsc` describe the host at the read);
/// - the IA32_TSC MSR value: the guest TSC runs while the vm is built;
/// - `vm.pit.channels[*].count_load_time`: host ktime at the last load;
/// - the LAPIC timer current count (TMCCT, 0x390): remaining time.
fn strip_moving_clocks(state: &MachineState) -> Value {
    let mut v = serde_json::to_value(state).expect("to json");
    v["vm"]["clock"] = Value::Null;
    // kvm_pit_state2 serialises as bytes: 3 channels of 24 bytes, each
    // ending with count_load_time (i64).
    let pit = v["vm"]["pit"].as_array_mut().expect("pit bytes");
    for channel in 0..3 {
        for b in &mut pit[channel * 24 + 16..channel * 24 + 24] {
            *b = Value::Null;
        }
    }
    for vcpu in v["vcpus"].as_array_mut().expect("vcpus") {
        let msrs = vcpu["msrs"].as_array_mut().expect("msrs");
        // kvm_msr_entry serialises as 16 bytes: index (u32 LE), reserved, data.
        for m in msrs.iter_mut() {
            let b = m.as_array().expect("msr bytes");
            let index = (0..4).fold(0u32, |acc, i| {
                acc | ((b[i].as_u64().unwrap_or(0) as u32) << (8 * i))
            });
            if index == 0x10 {
                *m = Value::Null;
            }
        }
        let lapic = vcpu["lapic"].as_array_mut().expect("lapic bytes");
        for b in &mut lapic[0x390..0x394] {
            *b = Value::Null;
        }
    }
    v
}

fn save_restored(mem: &GuestMemoryMmap, state: &MachineState) -> MachineState {
    let (vm, vcpus) = restore_machine(Path::new("/dev/kvm"), mem, state).expect("restore");
    MachineState {
        vcpus: vcpus
            .iter()
            .map(|v| v.save_state().expect("save restored vcpu"))
            .collect(),
        vm: vm.save_state().expect("save restored vm"),
    }
}

#[test]
fn test_state_save_restore_save_is_equal() {
    let dir = scratch("roundtrip");
    let log = dir.join("console.log");
    let running = boot_counter(&log);
    let h = running.handle();
    wait_for_count(&log, 3);
    h.pause().expect("pause");
    let saved = h.save_state().expect("save");
    let bytes = snapshot::encode(&saved).expect("encode");
    let decoded: MachineState = snapshot::decode(&bytes).expect("decode");
    let mem = copy_memory(h.guest_memory());
    h.resume().expect("resume");

    let again = save_restored(&mem, &decoded);
    let (a, b) = (strip_moving_clocks(&saved), strip_moving_clocks(&again));
    let mut differ = Vec::new();
    diff("", &a, &b, &mut differ);
    assert!(
        differ.is_empty(),
        "state differs after a round trip at {differ:?}"
    );
    let saved_msrs: Vec<u32> = saved.vcpus[0].msrs.iter().map(|m| m.index).collect();
    assert!(saved_msrs.contains(&0x10), "TSC not saved: {saved_msrs:x?}");
    // kvmclock MSRs (new and old numbers) are saved whenever KVM lists them.
    for kvmclock in [0x4b56_4d00, 0x4b56_4d01, 0x11, 0x12] {
        if vmm::vm::msr_index_list().contains(&kvmclock) {
            assert!(saved_msrs.contains(&kvmclock), "{kvmclock:#x} not saved");
        }
    }
    // The boot path sets MTRR_DEF_TYPE; it must survive a snapshot.
    assert!(saved_msrs.contains(&0x2ff), "MTRR default type not saved");
    println!("saved MSRs: {saved_msrs:x?}");
    assert!(saved.vcpus[0].xsave.is_some() || saved.vcpus[0].fpu.is_some());
    running.handle().stop();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn test_restored_vm_continues_counting() {
    let dir = scratch("continue");
    let log = dir.join("console.log");
    let running = boot_counter(&log);
    let h = running.handle();
    wait_for_count(&log, 3);
    h.pause().expect("pause");
    let saved: MachineState =
        snapshot::decode(&snapshot::encode(&h.save_state().expect("save")).expect("encode"))
            .expect("decode");
    let parent_at_pause = read(&log);
    let n = *counts(&parent_at_pause).last().expect("a count");
    let mem = copy_memory(h.guest_memory());

    // A new VM on the copy, with its own serial port writing to its own log.
    let started = Instant::now();
    let (vm, vcpus) = restore_machine(Path::new("/dev/kvm"), &mem, &saved).expect("restore");
    let restore_took = started.elapsed();
    let child_log = dir.join("child.log");
    let irq = EventFd::new(libc::EFD_NONBLOCK).expect("eventfd");
    vm.fd()
        .register_irqfd(&irq, layout::SERIAL_GSI)
        .expect("irqfd");
    let file = std::fs::File::create(&child_log).expect("child log");
    let serial = SerialDevice::new(irq, ConsoleOutput::new(Some(file), false));
    let mut pio = Bus::new();
    pio.insert(Arc::new(Mutex::new(serial)), COM1_PORT, COM1_LEN)
        .expect("serial on bus");
    let child = vmm::RunningVcpus::start(
        vm,
        mem,
        vcpus,
        Arc::new(pio),
        Arc::new(Bus::new()),
        Arc::new(ExitNotifier::new()),
        true,
    )
    .expect("start child");
    // Started parked (as a fork child waiting for its wake-up): it runs
    // nothing until resumed.
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(read(&child_log), "", "a child started paused ran");
    child.handle().resume().expect("resume the child");

    // The parent stays paused; the child picks up exactly where it was: the
    // parent's output up to the pause followed by the child's is one
    // unbroken count (a line cut by the pause is finished by the child).
    println!("restore_machine into a new VM: {restore_took:?}");
    wait_for_count(&child_log, n + 3);
    let joined = format!("{parent_at_pause}{}", read(&child_log));
    let c = counts(&joined);
    assert_consecutive(&c);
    assert!(c.contains(&(n + 1)));
    assert_eq!(read(&log), parent_at_pause, "parent ran while paused");

    // Both can run on: the child pauses too, the parent resumes.
    child.handle().pause().expect("pause child");
    h.resume().expect("resume parent");
    assert_consecutive(&wait_for_count(&log, n + 2));
    child.handle().stop();
    running.handle().stop();
    assert!(matches!(
        h.pause(),
        Err(vmm::ControlError::Exited(vmm::exit::GuestExit::Stopped))
    ));
    let _ = std::fs::remove_dir_all(dir);
}

fn restore_err(kvm: &Path, mem: &GuestMemoryMmap, state: &MachineState, what: &str) -> String {
    match restore_machine(kvm, mem, state) {
        Ok(_) => panic!("restore accepted a state with {what}"),
        Err(e) => {
            let mut msg = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                msg.push_str(&format!(": {s}"));
                source = s.source();
            }
            msg
        }
    }
}

#[test]
fn test_restore_refuses_invalid_state() {
    let dir = scratch("invalid");
    let log = dir.join("console.log");
    let running = boot_counter(&log);
    let h = running.handle();
    wait_for_count(&log, 1);
    h.pause().expect("pause");
    let saved = h.save_state().expect("save");
    let mem = copy_memory(h.guest_memory());
    h.resume().expect("resume");
    let kvm = Path::new("/dev/kvm");

    let mut bad = saved.clone();
    bad.vm.ioapic.chip_id = 0;
    let err = restore_err(kvm, &mem, &bad, "swapped irqchip");
    assert!(err.to_string().contains("irqchip"), "{err}");

    let mut bad = saved.clone();
    if let Some(x) = bad.vcpus[0].xsave.as_mut() {
        x.region.truncate(10);
    }
    bad.vcpus[0].fpu = None;
    let err = restore_err(kvm, &mem, &bad, "short xsave");
    assert!(err.to_string().contains("XSAVE"), "{err}");

    let mut bad = saved.clone();
    bad.vcpus[0].index = 1;
    restore_err(kvm, &mem, &bad, "wrong vCPU index");

    let mut bad = saved;
    bad.vcpus[0].msrs.push(kvm_bindings::kvm_msr_entry {
        index: 0xdead_beef,
        ..Default::default()
    });
    let err = restore_err(kvm, &mem, &bad, "unknown MSR");
    assert!(err.to_string().contains("0xdeadbeef"), "{err}");
    running.handle().stop();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn test_state_round_trip_with_parked_application_processors() {
    // The counter runs on vCPU 0; vCPUs 1 and 2 wait for INIT/SIPI inside
    // KVM_RUN. Pausing must kick them out too, and their MP state survives.
    let dir = scratch("aps");
    let log = dir.join("console.log");
    let running = boot_counter_with(&log, 3);
    let h = running.handle();
    wait_for_count(&log, 2);
    h.pause().expect("pause");
    let saved = h.save_state().expect("save");
    let mem = copy_memory(h.guest_memory());
    h.resume().expect("resume");
    assert_eq!(saved.vcpus.len(), 3);
    let again = save_restored(&mem, &saved);
    let mut differ = Vec::new();
    diff(
        "",
        &strip_moving_clocks(&saved),
        &strip_moving_clocks(&again),
        &mut differ,
    );
    assert!(
        differ.is_empty(),
        "state differs after a round trip at {differ:?}"
    );
    let n = *counts(&read(&log)).last().expect("a count");
    assert_consecutive(&wait_for_count(&log, n + 1));
    running.handle().stop();
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn test_pause_right_after_start() {
    // The kick may arrive before the vCPU thread reached KVM_RUN: the request
    // is then found before the first entry, and the guest has not run yet.
    let dir = scratch("early");
    let log = dir.join("console.log");
    let running = boot_counter(&log);
    let h = running.handle();
    h.pause().expect("pause right after start");
    h.resume().expect("resume");
    wait_for_count(&log, 1);
    running.handle().stop();
    let _ = std::fs::remove_dir_all(dir);
}
