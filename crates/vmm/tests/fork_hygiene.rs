//! What forking a vm again and again must not leave behind: zombie
//! processes under its VMM.

mod micro;

use std::path::Path;
use std::time::Duration;

use micro::{config, scratch, Console, VmmProcess};
use vmm::api::{Identity, Request};

fn identity(dir: &Path, name: &str) -> Identity {
    Identity {
        name: name.into(),
        console_log: dir.join(format!("{name}.log")),
        console_socket: Some(dir.join(format!("{name}.sock"))),
        log: dir.join(format!("{name}.vmm.log")),
        api_socket: dir.join(format!("{name}.api")),
        exit_file: dir.join(format!("{name}.exit.json")),
        ..Identity::default()
    }
}

/// Pids of zombie processes whose parent is `ppid` (from /proc/*/stat:
/// state and ppid follow the `(comm)` field).
fn zombies_of(ppid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut f = rest.split_whitespace();
        let (state, parent) = (f.next(), f.next().and_then(|p| p.parse::<u32>().ok()));
        if state == Some("Z") && parent == Some(ppid) {
            out.push(pid);
        }
    }
    out
}

/// A vm forked from an already-forked vm goes on in its own process (its
/// RAM is private); each fork's zygote is collected, so 40 forks of it
/// leave no zombie under its VMM, nor 5 forks of one of its children under
/// the child's.
#[test]
fn test_forks_of_a_forked_vm_leave_no_zombies() {
    let dir = scratch("hygiene", "zombies");
    let console = Console::in_dir(&dir, "parent");
    let cfg = config(guests::memtouch_path(), 64, &console);
    let p = VmmProcess::spawn(&dir, "parent", move || vmm::build(&cfg).expect("build"));
    console.wait_nth("READY", 1);
    let layers = dir.join("layers");

    // The first fork moves the booted vm (shared memfd RAM) to a
    // continuation process with private RAM.
    let first = p
        .call(&Request::Fork {
            children: vec![identity(&dir, "c0")],
            layers_dir: layers.clone(),
        })
        .expect("first fork");
    let vm = first.continuation_pid.expect("a booted vm moves on");
    micro::kill(first.children[0] as i32);
    let _ = p.wait(Duration::from_secs(10));

    let mut last = 0;
    for i in 1..=40 {
        let r = p
            .call(&Request::Fork {
                children: vec![identity(&dir, &format!("c{i}"))],
                layers_dir: layers.clone(),
            })
            .unwrap_or_else(|e| panic!("fork {i}: {e}"));
        assert_eq!(r.pid, vm, "fork {i}: the forked vm goes on in place");
        assert_eq!(r.continuation_pid, None);
        if last != 0 {
            micro::kill(last as i32);
        }
        last = r.children[0];
        let z = zombies_of(vm);
        assert!(
            z.is_empty(),
            "after fork {i}: zombies {z:?} under the VMM {vm}"
        );
    }
    // A child forked again leaves none either.
    let c = last;
    let child = Console::in_dir(&dir, "c40");
    child.command("ping", "PONG", 1);
    for j in 0..5 {
        let r = micro::VmmProcess {
            pid: c as i32,
            api: dir.join("c40.api"),
            exit_file: dir.join("c40.exit.json"),
        }
        .call(&Request::Fork {
            children: vec![identity(&dir, &format!("g{j}"))],
            layers_dir: layers.clone(),
        })
        .unwrap_or_else(|e| panic!("fork of the child {j}: {e}"));
        micro::kill(r.children[0] as i32);
    }
    for pid in [vm, c] {
        let z = zombies_of(pid);
        assert!(z.is_empty(), "zombies {z:?} under the VMM {pid}");
    }
    console.command("ping", "PONG", 1);
    micro::kill(c as i32);
    micro::kill(vm as i32);
    let _ = std::fs::remove_dir_all(dir);
}

fn comm(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .unwrap_or_default()
        .trim_end()
        .to_string()
}

fn cmdline(pid: u32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&raw)
        .trim_end_matches('\0')
        .replace('\0', " ")
}

/// Every VMM process is named after its own vm in `ps`: the booted vm,
/// its continuation, a child, and a checkpoint's template.
#[test]
fn test_each_vmm_process_is_named_after_its_vm() {
    let dir = scratch("hygiene", "names");
    let console = Console::in_dir(&dir, "parent-with-a-long-name");
    let cfg = config(guests::memtouch_path(), 64, &console);
    let p = VmmProcess::spawn(&dir, "parent-with-a-long-name", move || {
        vmm::build(&cfg).expect("build")
    });
    console.wait_nth("READY", 1);
    // comm is 15 bytes at most.
    assert_eq!(comm(p.pid as u32), "vmm:parent-with");
    assert_eq!(cmdline(p.pid as u32), "tine-vmm parent-with-a-long-name");

    let r = p
        .call(&Request::Fork {
            children: vec![identity(&dir, "kid")],
            layers_dir: dir.join("layers"),
        })
        .expect("fork");
    let (cont, kid) = (r.continuation_pid.expect("continuation"), r.children[0]);
    let _ = p.wait(Duration::from_secs(10));
    assert_eq!(comm(cont), "vmm:parent-with");
    assert_eq!(cmdline(cont), "tine-vmm parent-with-a-long-name");
    assert_eq!(comm(kid), "vmm:kid");
    assert_eq!(cmdline(kid), "tine-vmm kid");

    let r = vmm::api::call(
        &p.api,
        &Request::Checkpoint {
            tag: "t1".into(),
            socket: dir.join("t1.sock"),
            layers_dir: dir.join("layers"),
        },
        micro::WAIT,
    )
    .expect("checkpoint");
    assert!(r.reply.error.is_none(), "{:?}", r.reply.error);
    let template = r.reply.template_pid.expect("template");
    drop(r);
    assert_eq!(comm(template), "vmm:parent-with");
    assert_eq!(
        cmdline(template),
        "tine-vmm parent-with-a-long-name (checkpoint t1)"
    );
    let _ = vmm::api::call(&dir.join("t1.sock"), &Request::Drop, micro::WAIT);
    // The vm went on in place through the checkpoint.
    let ping = vmm::api::call(&p.api, &Request::Ping, micro::WAIT).expect("ping");
    assert_eq!(ping.reply.pid, cont);
    for pid in [cont, kid] {
        micro::kill(pid as i32);
    }
    let _ = std::fs::remove_dir_all(dir);
}
