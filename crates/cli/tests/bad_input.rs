//! Bad input gets a one-line error that says what to do, a non-zero exit,
//! and nothing left running.

mod common;

use std::os::unix::net::UnixListener;
use std::process::Output;

use common::{kvm_available, tine, Home, TempDir};

fn counter() -> String {
    guests::counter_path().display().to_string()
}

fn vmm(args: &[&str]) -> Output {
    tine().arg("vmm").args(args).output().expect("run tine")
}

/// Asserts a failed run whose stderr is one `tine:` line containing `needle`.
fn assert_one_line_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "must fail; stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "want one error line, got: {stderr}");
    assert!(lines[0].starts_with("tine: "), "{stderr}");
    assert!(
        lines[0].to_lowercase().contains(&needle.to_lowercase()),
        "error {:?} should mention {needle:?}",
        lines[0]
    );
}

#[test]
fn test_missing_kernel_is_a_clear_error() {
    let out = vmm(&["--kernel", "/nonexistent/vmlinux"]);
    assert_one_line_error(&out, "not found");
}

#[test]
fn test_non_kernel_file_is_refused() {
    let dir = TempDir::new("badkernel");
    let f = dir.path().join("notes.txt");
    std::fs::write(&f, "this is not a kernel\n".repeat(100)).expect("write");
    if !kvm_available() {
        return;
    }
    let out = vmm(&["--kernel", f.to_str().expect("utf8")]);
    assert_one_line_error(&out, "not a kernel");
}

#[test]
fn test_memory_below_minimum_and_above_host_are_refused() {
    let out = vmm(&["--kernel", &counter(), "--mem", "16M"]);
    assert_one_line_error(&out, "below the minimum");
    let out = vmm(&["--kernel", &counter(), "--mem", "64G"]);
    assert_one_line_error(&out, "maximum");
    let out = vmm(&["--kernel", &counter(), "--mem", "lots"]);
    assert!(!out.status.success());
}

#[test]
fn test_missing_disk_is_a_clear_error() {
    let out = vmm(&["--kernel", &counter(), "--disk", "/nonexistent/disk.raw"]);
    assert_one_line_error(&out, "disk image /nonexistent/disk.raw not found");
}

#[test]
fn test_absent_kvm_device_is_a_clear_error() {
    let out = tine()
        .args(["vmm", "--kernel", &counter()])
        .env("TINE_KVM_DEVICE", "/nonexistent/kvm")
        .output()
        .expect("run");
    assert_one_line_error(&out, "has no KVM");
}

#[test]
fn test_kvm_device_not_permitted_is_a_clear_error() {
    if !kvm_available() {
        return;
    }
    // /dev/kvm is root's (0600) here; run the VMM as nobody to be refused.
    let Some(setpriv) = which("setpriv") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "setpriv (util-linux) is needed in CI"
        );
        eprintln!("skipping: setpriv missing");
        return;
    };
    let out = std::process::Command::new(setpriv)
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            env!("CARGO_BIN_EXE_tine"),
        ])
        .args(["vmm", "--kernel", &counter()])
        .output()
        .expect("run");
    assert_one_line_error(&out, "permission denied");
}

fn which(name: &str) -> Option<std::path::PathBuf> {
    std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .map(|dir| std::path::Path::new(dir).join(name))
        .find(|p| p.is_file())
}

#[test]
fn test_vsock_socket_in_use_is_a_clear_error() {
    if !kvm_available() {
        return;
    }
    let dir = TempDir::new("vsockbusy");
    let sock = dir.path().join("v.sock");
    let _listener = UnixListener::bind(&sock).expect("bind");
    let out = vmm(&[
        "--kernel",
        &counter(),
        "--vsock",
        sock.to_str().expect("utf8"),
    ]);
    assert_one_line_error(&out, "in use");
}

#[test]
fn test_vcpu_count_out_of_range_is_refused() {
    let out = vmm(&["--kernel", &counter(), "--vcpus", "9"]);
    assert_one_line_error(&out, "vcpus");
}

/// A name that would make a socket path longer than a Unix socket allows
/// (107 bytes) is refused before anything is made, naming the fix; the
/// VMM used to fail at its start with a message about SUN_LEN and leave
/// a stopped vm.
#[test]
fn test_names_too_long_for_a_socket_path_are_refused_up_front() {
    if !kvm_available() {
        return;
    }
    // A test home is about 60 bytes long: a 48-byte name cannot fit.
    let h = Home::new("sockpath");
    let long = "n".repeat(48);
    let run = |name: &str| {
        h.out(&[
            "run",
            "--name",
            name,
            "--image",
            "micro-counter",
            "--mem",
            "64M",
        ])
    };
    assert_one_line_error(&run(&long), "shorter TINE_HOME");
    let trees = std::fs::read_dir(h.0.path().join("t")).map_or(0, |d| d.count());
    assert_eq!(trees, 0, "a refused run made a tree directory");
    assert!(run("a").status.success());
    assert_one_line_error(&h.out(&["fork", "a", "--names", &long]), "shorter name");
    let tag = "t".repeat(48);
    assert_one_line_error(
        &h.out(&["checkpoint", "a", "--tag", &tag]),
        "longer than the 107",
    );
    let ls = h.ok(&["ls"]);
    assert!(!ls.contains(&long) && !ls.contains(&tag), "{ls}");
    h.ok(&["fork", "a", "--names", "b"]);
    h.ok(&["rm", "--force", "a"]);
    h.ok(&["rm", "--force", "b"]);
}
