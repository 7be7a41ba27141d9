//! Linux guests: the Debian cloud kernel booted by tine's VMM.
//!
//! Named `linux_*` so the cargo runner (testhost/cargo-runner) runs this
//! binary inside the nested test host when the machine has no hardware
//! virtualization. The image must be built first (`tine image build`,
//! scripts/test does it); here it is only looked up in the cache.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::process::Command;
use std::time::Duration;

use common::{kvm_available, RunningVm, TempDir};

const BOOT: Duration = Duration::from_secs(120);
const STEP: Duration = Duration::from_secs(60);

fn boot(extra: &[&str]) -> RunningVm {
    let mut args = vec!["--image", "minimal", "--mem", "256M"];
    args.extend_from_slice(extra);
    let vm = RunningVm::start(&args);
    vm.expect_contains("tine: guest ready", BOOT);
    note_boot(&vm);
    vm
}

/// A progress line on stderr for a slow boot (CI logs show where time goes).
fn note_boot(vm: &RunningVm) {
    let took = vm.started.elapsed();
    if took > common::SLOW_CALL {
        common::progress(&format!("linux guest ready in {:.1} s", took.as_secs_f64()));
    }
}

/// Runs a shell command on the guest console; returns its exit status.
/// The console echoes input, so the marker is matched only when followed by
/// the status digits (the echoed command shows `$?` there).
fn sh(vm: &mut RunningVm, cmd: &str, marker: &str) -> i32 {
    vm.send(&format!("{cmd}; echo {marker}-$?\n"));
    let tag = format!("{marker}-");
    let status = |l: &str| {
        l.find(&tag)
            .map(|i| &l[i + tag.len()..])
            .and_then(|rest| rest.trim().parse::<i32>().ok())
    };
    let (_, line) = vm.expect_matching(&format!("with {tag}<status>"), STEP, |l| {
        status(l).is_some()
    });
    status(&line).unwrap_or(-1)
}

#[test]
fn test_linux_boots_writes_disk_and_powers_off() {
    if !kvm_available() {
        return;
    }
    let _serial = common::one_linux_test_at_a_time();
    let dir = TempDir::new("linuxdisk");
    let disk = dir.path().join("disk.raw");
    std::fs::write(&disk, vec![0u8; 8 << 20]).expect("disk");
    let mut vm = boot(&["--disk", disk.to_str().expect("utf8")]);
    let status = sh(
        &mut vm,
        "printf tine-was-here-0123456789 | dd of=/dev/vda bs=512 seek=2048 conv=fsync 2>/dev/null",
        "DDDONE",
    );
    assert_eq!(status, 0, "dd into /dev/vda failed");
    let status = sh(
        &mut vm,
        "grep -qx kvm-clock /sys/devices/system/clocksource/clocksource0/current_clocksource",
        "CLOCK",
    );
    assert_eq!(status, 0, "the guest must use kvm-clock");
    let data = std::fs::read(&disk).expect("read disk");
    assert_eq!(&data[1 << 20..(1 << 20) + 24], b"tine-was-here-0123456789");
    vm.send("poweroff -f\n");
    let status = vm.wait(STEP).expect("poweroff must end the VMM");
    assert!(status.success(), "poweroff exits 0: {status:?}");
}

#[test]
fn test_linux_vsock_round_trip_1mib_then_reboot() {
    if !kvm_available() {
        return;
    }
    let _serial = common::one_linux_test_at_a_time();
    let dir = TempDir::new("linuxvsock");
    let sock = dir.path().join("v.sock");
    let mut vm = boot(&["--vsock", sock.to_str().expect("utf8")]);
    vm.send("tine-agent vsock-echo 5000 &\n");
    vm.expect_contains("tine-agent: echo listening", STEP);

    let mut stream = UnixStream::connect(&sock).expect("connect vsock uds");
    stream.set_read_timeout(Some(STEP)).expect("timeout");
    stream.write_all(b"CONNECT 5000\n").expect("connect cmd");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut ok = String::new();
    reader.read_line(&mut ok).expect("OK line");
    assert!(ok.starts_with("OK "), "handshake: {ok:?}");

    let payload: Vec<u8> = (0..(1u32 << 20))
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let writer = {
        let mut s = stream.try_clone().expect("clone");
        let p = payload.clone();
        std::thread::spawn(move || s.write_all(&p))
    };
    let mut back = vec![0u8; payload.len()];
    reader.read_exact(&mut back).expect("echo back");
    writer.join().expect("writer").expect("write payload");
    assert!(back == payload, "vsock echo must be byte-exact");

    vm.send("reboot -f\n");
    let status = vm.wait(STEP).expect("reboot must end the VMM");
    assert!(status.success(), "reboot exits 0: {status:?}");
}

#[test]
fn test_linux_net_pings_host_tap_in_netns() {
    if !kvm_available() {
        return;
    }
    let _serial = common::one_linux_test_at_a_time();
    let ns = format!("tine-test-{}", std::process::id());
    let ip = |args: &[&str]| {
        let st = Command::new("ip").args(args).status().expect("run ip");
        assert!(st.success(), "ip {args:?} failed");
    };
    ip(&["netns", "add", &ns]);
    struct Ns(String);
    impl Drop for Ns {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
    let _ns = Ns(ns.clone());
    ip(&["-n", &ns, "tuntap", "add", "tap0", "mode", "tap"]);
    ip(&["-n", &ns, "addr", "add", "172.30.7.1/24", "dev", "tap0"]);
    ip(&["-n", &ns, "link", "set", "tap0", "up"]);

    // The VMM opens tap0 inside the namespace; everything stays in it.
    let mut vm = {
        let mut args = vec!["netns", "exec", &ns, env!("CARGO_BIN_EXE_tine"), "vmm"];
        args.extend([
            "--image",
            "minimal",
            "--mem",
            "256M",
            "--vcpus",
            "2",
            "--net",
            "tap0,mac=52:54:00:aa:bb:01",
        ]);
        RunningVm::start_command("ip", &args)
    };
    vm.expect_contains("tine: guest ready", BOOT);
    note_boot(&vm);
    let line = sh(
        &mut vm,
        "ip link set eth0 up && ip addr add 172.30.7.2/24 dev eth0 && ping -c 3 -W 5 172.30.7.1 >/dev/null",
        "PINGDONE",
    );
    assert_eq!(line, 0, "guest could not ping the host end of the tap");
    let mac = sh(
        &mut vm,
        "grep -qx 52:54:00:aa:bb:01 /sys/class/net/eth0/address",
        "MACDONE",
    );
    assert_eq!(
        mac, 0,
        "guest MAC must come from the virtio-net config space"
    );
    let cpus = sh(
        &mut vm,
        "test $(grep -c ^processor /proc/cpuinfo) -eq 2",
        "CPUS",
    );
    assert_eq!(cpus, 0, "both vCPUs must come up (ACPI MADT, INIT/SIPI)");
    vm.send("poweroff -f\n");
    let status = vm.wait(STEP).expect("poweroff must end the VMM");
    assert!(status.success());
}
