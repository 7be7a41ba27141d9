//! The compatibility manifest on real KVM: a snapshot of the `counter`
//! micro guest checks clean against its own host, and fails naming the
//! feature or MSR when the host is made to lack one.

use std::path::Path;
use std::time::{Duration, Instant};

use snapshot::compat::{
    check, check_restore, feature_name, Compat, CpuidBit, HostCompat, Mismatch, Register,
    RestoreRequest,
};
use vmm::compat::{host_compat, snapshot_compat};
use vmm::VmConfig;

const KVM: &str = "/dev/kvm";

/// Boots `counter` with 2 vCPUs, waits for its first output, pauses and
/// saves it, and returns its manifest with this host's.
fn saved_compat() -> (Compat, HostCompat) {
    let dir = std::env::temp_dir().join(format!("tine-compat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let log = dir.join("console.log");
    let config = VmConfig {
        kernel: guests::counter_path().into(),
        mem_mib: 64,
        vcpus: 2,
        console_log: Some(log.clone()),
        ..Default::default()
    };
    let running = vmm::build(&config).expect("build").start().expect("start");
    let h = running.handle();
    // Let the guest run its own setup (CR4, XCR0) before the save.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("CNT ")
    {
        assert!(Instant::now() < deadline, "counter printed nothing");
        std::thread::sleep(Duration::from_millis(10));
    }
    h.pause().expect("pause");
    let machine = h.save_state().expect("save state");
    h.stop();
    let _ = std::fs::remove_dir_all(dir);

    let host = host_compat(Path::new(KVM)).expect("host compat");
    let started = Instant::now();
    let compat = snapshot_compat(&machine, Vec::new(), config.mem_mib, &host);
    println!("snapshot_compat took {:?}", started.elapsed());
    (compat, host)
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is this thread; `set` is a valid cpu_set_t of the given size.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    assert_eq!(rc, 0, "sched_getaffinity");
    // SAFETY: CPU_ISSET reads `set` within CPU_SETSIZE.
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// Pins the calling thread to `cpu`.
fn pin_to(cpu: usize) {
    // SAFETY: cpu_set_t is plain data.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` came from CPU_ISSET, so it is below CPU_SETSIZE.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: pid 0 is this thread; `set` is a valid cpu_set_t of the given size.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    assert_eq!(rc, 0, "sched_setaffinity to CPU {cpu}");
}

#[test]
fn test_host_compat_reads_this_host() {
    let started = Instant::now();
    let host = host_compat(Path::new(KVM)).expect("host compat");
    let first = started.elapsed();
    let started = Instant::now();
    let again = host_compat(Path::new(KVM)).expect("host compat");
    let second = started.elapsed();
    assert_eq!(again, host, "the host's offer is stable");
    // Read on every CPU: PVM passes the physical CPU's CPUID (its APIC ID)
    // through, and the offer must not depend on where the caller ran.
    for cpu in allowed_cpus() {
        let on_cpu = std::thread::spawn(move || {
            pin_to(cpu);
            host_compat(Path::new(KVM)).expect("host compat")
        })
        .join()
        .expect("pinned read");
        assert_eq!(on_cpu, host, "the host's offer read on CPU {cpu}");
    }
    println!(
        "host_compat took {first:?} (again {second:?}): {} on Linux {}, {} CPUID entries, {} MSRs, caps {:?}",
        host.cpu_vendor,
        host.kernel,
        host.cpuid.len(),
        host.msrs.len(),
        host.caps
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>()
    );
    assert!(
        ["GenuineIntel", "AuthenticAMD"].contains(&host.cpu_vendor.as_str()),
        "{}",
        host.cpu_vendor
    );
    assert!(host.cpuid.iter().any(|e| e.function == 0x7));
    assert!(host.msrs.contains(&0x10), "IA32_TSC must be listed");
    assert!(host.caps.iter().any(|c| c.name == "KVM_CAP_IRQCHIP"));
    assert!(!host.kernel.is_empty());
    let missing = host_compat(Path::new("/nonexistent/kvm")).expect_err("no such device");
    assert!(missing.to_string().contains("no KVM"), "{missing}");
}

#[test]
fn test_saved_state_checks_against_its_host() {
    let (compat, mut host) = saved_compat();
    assert_eq!(compat.vcpus, 2);
    assert_eq!(compat.cpu_vendor, host.cpu_vendor);
    assert!(!compat.cpuid.is_empty() && !compat.msrs.is_empty() && !compat.caps.is_empty());
    println!(
        "guest: {} CPUID entries, {} MSRs, TSC {:?} kHz (host {:?} kHz)",
        compat.cpuid.len(),
        compat.msrs.len(),
        compat.tsc_khz,
        host.tsc_khz
    );
    let started = Instant::now();
    let result = check(&compat, &host);
    println!("check took {:?}", started.elapsed());
    if let Err(e) = result {
        panic!("a snapshot does not restore on its own host:\n{e}");
    }
    let same = RestoreRequest {
        devices: Some(Vec::new()),
        mem_mib: Some(64),
        vcpus: Some(2),
    };
    check_restore(&compat, &host, &same).expect("same layout");

    // The manifest survives the state envelope.
    let back: Compat =
        snapshot::decode(&snapshot::encode(&compat).expect("encode")).expect("decode");
    assert_eq!(back, compat);

    // A feature this host does not offer, turned on in the guest's CPUID:
    // a clear bit of leaf 7.0 EBX, one with a known name if there is one.
    let host7 = host
        .cpuid
        .iter()
        .find(|e| e.function == 7 && e.index == 0)
        .expect("host leaf 7")
        .ebx;
    let clear = |b: &u32| host7 & (1 << b) == 0;
    let bit_of = |bit| CpuidBit {
        function: 7,
        index: 0,
        register: Register::Ebx,
        bit,
    };
    let bit = (0..32)
        .filter(clear)
        .find(|&b| feature_name(bit_of(b)).is_some())
        .or_else(|| (0..32).find(clear))
        .expect("this host offers every bit of leaf 7.0 EBX");
    let mut flipped = compat.clone();
    flipped
        .cpuid
        .iter_mut()
        .find(|e| e.function == 7 && e.index == 0)
        .expect("guest leaf 7")
        .ebx |= 1 << bit;
    let err = check(&flipped, &host).expect_err("feature the host lacks");
    let name = feature_name(bit_of(bit));
    assert_eq!(
        err.mismatches,
        vec![Mismatch::CpuFeature {
            name,
            bit: bit_of(bit)
        }]
    );
    let text = err.to_string();
    let named = match name {
        Some(n) => format!("CPU feature {n} ({})", bit_of(bit)),
        None => format!("CPU feature {}", bit_of(bit)),
    };
    assert!(text.contains(&named), "{text}");
    println!("{text}");

    // An MSR the snapshot saved, gone from this host's list.
    let msr = compat.msrs[compat.msrs.len() / 2];
    host.msrs.retain(|&i| i != msr);
    let err = check(&compat, &host).expect_err("MSR the host lacks");
    assert_eq!(err.mismatches, vec![Mismatch::Msr { index: msr }]);
    assert!(err.to_string().contains(&format!("MSR {msr:#x}")), "{err}");

    // Both at once are both named.
    let err = check(&flipped, &host).expect_err("two mismatches");
    assert_eq!(err.mismatches.len(), 2, "{err}");
}
