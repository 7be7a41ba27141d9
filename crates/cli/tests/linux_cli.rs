//! `tine run/exec/cp/ls/stop/rm` with Linux guests and the agent.
//!
//! Named `linux_*`: the cargo runner runs it inside the nested test host when
//! this machine has no hardware virtualization. The image (with the agent)
//! must be built first (scripts/test does it); vms live in a temporary
//! TINE_HOME whose `images` points at the real image cache.

mod common;

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::Stdio;

use common::{kvm_available, Home, TempDir};

#[test]
fn test_exec_cp_and_lifecycle_through_the_agent() {
    if !kvm_available() {
        return;
    }
    let _serial = common::one_linux_test_at_a_time();
    let h = Home::new("cli");
    let out = h.ok(&["run", "--name", "one", "--mem", "256M"]);
    assert!(out.contains("agent answered in"), "{out}");

    // uname -r shows the Debian kernel.
    let uname = h.ok(&["exec", "one", "--", "uname", "-r"]);
    assert!(uname.trim().ends_with("cloud-amd64"), "{uname}");

    // Exit codes and death by signal pass through.
    for (cmd, want) in [
        ("exit 0", 0),
        ("exit 1", 1),
        ("exit 42", 42),
        ("kill -9 $$", 137),
    ] {
        let st = h.out(&["exec", "one", "--", "sh", "-c", cmd]).status;
        assert_eq!(st.code(), Some(want), "sh -c {cmd:?}");
    }

    // The console shell ending does not power the vm off: /init starts
    // another (before, a shell that ended powered off the vm under its
    // agent: a fork child "stopped" right after its wake).
    h.ok(&["console", "one", "--send", "exit"]);
    let log = h.0.path().join("vms").join("one").join("console.log");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("the console shell ended")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the console shell did not end on `exit`"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert_eq!(
        h.ok(&["exec", "one", "--", "echo", "alive"]).trim(),
        "alive"
    );

    // env, cwd, stderr apart from stdout.
    let out = h.out(&[
        "exec",
        "one",
        "--env",
        "GREETING=hi",
        "--cwd",
        "/proc",
        "--",
        "sh",
        "-c",
        "echo $GREETING $(pwd); echo err >&2",
    ]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "hi /proc\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "err\n");

    // 1 MiB of stdin comes back byte-exact.
    let input: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    let cat = ["exec", "one", "--", "cat"];
    let mut child = h
        .cmd(&cat)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("spawn");
    let mut stdin = child.stdin.take().expect("stdin");
    let data = input.clone();
    // Ends with an error at the latest when a timeout kills `cat`.
    let writer = std::thread::spawn(move || stdin.write_all(&data));
    let out = h.wait_within(child, &cat, common::call_timeout());
    writer.join().expect("writer").expect("write");
    assert!(out.status.success());
    assert!(out.stdout == input, "stdin round trip must be byte-exact");

    // A command that outlives its timeout is killed and reported.
    let started = std::time::Instant::now();
    let out = h.out(&["exec", "one", "--timeout", "1", "--", "sleep", "30"]);
    assert_eq!(
        out.status.code(),
        Some(137),
        "{} {}",
        String::from_utf8_lossy(&out.stderr),
        common::file_tail(&h.0.path().join("vms/one/vmm.log"), 5)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("timed out"));
    assert!(started.elapsed().as_secs() < 20);

    // cp: 10 MiB both ways with the same hash.
    let dir = TempDir::new("cpfiles");
    let src = dir.path().join("big.bin");
    let big: Vec<u8> = (0..10u32 << 20)
        .map(|i| (i ^ (i >> 7)).wrapping_mul(31) as u8)
        .collect();
    std::fs::write(&src, &big).expect("write");
    h.ok(&["cp", src.to_str().expect("utf8"), "one:/tmp/big.bin"]);
    let sum = h.ok(&["exec", "one", "--", "md5sum", "/tmp/big.bin"]);
    let back = dir.path().join("back.bin");
    h.ok(&["cp", "one:/tmp/big.bin", back.to_str().expect("utf8")]);
    assert!(
        std::fs::read(&back).expect("read") == big,
        "cp round trip must be byte-exact"
    );
    assert_eq!(sum.split_whitespace().next().map(str::len), Some(32));

    // Bad input: cp of a missing file, either way.
    let out = h.out(&["cp", "one:/no/such/file", back.to_str().expect("utf8")]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .to_lowercase()
            .contains("no such file"),
        "{:?}",
        out
    );
    let out = h.out(&["cp", "/no/such/host/file", "one:/tmp/x"]);
    assert!(!out.status.success());

    // Agent protocol version mismatch: a client speaking version 999.
    let sock = h.0.path().join("vms/one/vsock.sock");
    let mut s = protocol::client::connect_vsock_uds(
        &sock,
        protocol::AGENT_PORT,
        std::time::Duration::from_secs(10),
    )
    .expect("connect");
    // The stream comes back without timeouts: a silent agent must fail here, not hang.
    s.set_read_timeout(Some(std::time::Duration::from_secs(60)))
        .expect("read timeout");
    s.set_write_timeout(Some(std::time::Duration::from_secs(60)))
        .expect("write timeout");
    let err =
        protocol::client::hello_as(&mut s, 999, "test").expect_err("version 999 must be refused");
    assert!(err.to_string().contains("999"), "{err}");
    // ...and the agent keeps serving.
    h.ok(&["exec", "one", "--", "true"]);

    // Two vms at once; ls --json lists both; stop then rm leaves nothing.
    h.ok(&["run", "--name", "two", "--mem", "256M"]);
    let rows = h.ls();
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r["state"] == "running"), "{rows:?}");
    let pids: Vec<u64> = rows.iter().filter_map(|r| r["pid"].as_u64()).collect();
    let out = h.out(&["run", "--name", "two"]);
    assert!(!out.status.success(), "duplicate name must be refused");
    h.ok(&["stop", "one"]);
    let out = h.out(&["exec", "one", "--", "true"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is stopped"));
    let out = h.out(&["exec", "nosuchvm", "--", "true"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no vm named"));
    h.ok(&["stop", "two"]);
    h.ok(&["rm", "one"]);
    h.ok(&["rm", "two"]);
    assert!(h.ls().is_empty());
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "VMM {pid} still running"
        );
    }
    let left: Vec<_> = std::fs::read_dir(h.0.path().join("vms"))
        .expect("vms")
        .collect();
    assert!(left.is_empty(), "state left behind: {left:?}");
}
