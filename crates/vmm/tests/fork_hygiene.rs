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
