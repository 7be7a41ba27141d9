//! What a VMM's own root holds (`vmm::jail`): of `$TINE_HOME`, its own
//! tree's directory (`--tree`: the vms forked from one `run` or wake and
//! their frozen layers) and the images; every file its command line names
//! (with a disk's backing chain, which may reach another tree's frozen
//! layers: read-only); the device nodes it opens; for a lazy wake the
//! store and what the store's network client reads (resolver and CA
//! files). Nothing else of the host is there: no other tree's vms or
//! layers, nor the home's state (the fleet database, the effects journal,
//! intents, locks, tined's socket). A VMM of a vm from before trees (no
//! `--tree`) sees the home with its state masked.

use std::path::{Path, PathBuf};

use vmm::jail::{Bind, Mounts};

use crate::args::VmmArgs;

/// Device nodes a VMM opens (lazy page-in opens the userfaultfd device).
const DEVICES: &[&str] = &["/dev/null", "/dev/userfaultfd", "/dev/urandom"];

/// Read by the store's clients (S3, PostgreSQL): the resolver, its
/// modules and the CA roots.
const NETWORK_FILES: &[&str] = &[
    "/etc/resolv.conf",
    "/etc/hosts",
    "/etc/nsswitch.conf",
    "/etc/gai.conf",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/usr/share/ca-certificates",
    "/usr/lib",
];

/// Whether the VMM talks to the network itself: a lazy wake pages in
/// from the store, which may be S3 (and its forks inherit the need).
/// A tap's traffic is the guest's, not the VMM's.
pub fn needs_network(args: &VmmArgs) -> bool {
    args.lazy_snapshot.is_some()
}

/// The jail's mounts for a VMM started with `args` in `home`.
pub fn mounts(home: &Path, args: &VmmArgs) -> Mounts {
    // One mount for the vms and the frozen layers: a fork renames a vm's
    // top layer into `.layers`, which rename(2) does only within a mount.
    let mut binds = match &args.tree {
        Some(tree) => vec![Bind::rw(tree)],
        None => vec![Bind::rw(home)],
    };
    if args.tree.is_some() && needs_network(args) {
        // Page-in reads and caches the store's chunks.
        binds.push(Bind::rw(home.join("store")));
    }
    // `images` is often a link to the shared image cache.
    binds.push(Bind::ro(home.join("images")));
    binds.push(Bind::rw(&args.kvm_device));
    binds.extend(DEVICES.iter().map(|d| Bind::rw(*d)));
    if args.nets.iter().any(|n| !crate::args::net_passed(n)) {
        // A tap opened by name (and its fork children's taps).
        binds.push(Bind::rw("/dev/net/tun"));
    }
    if needs_network(args) {
        binds.extend(NETWORK_FILES.iter().map(|f| Bind::ro(*f)));
    }
    for f in [&args.kernel, &args.initrd, &args.from]
        .into_iter()
        .flatten()
    {
        binds.push(Bind::ro(f));
    }
    if let Some(t) = args.cpu_template.as_deref().filter(|t| t.starts_with('/')) {
        binds.push(Bind::ro(t));
    }
    if let Some(key) = std::env::var_os(snapshot::KEY_ENV) {
        binds.push(Bind::ro(PathBuf::from(key)));
    }
    for d in &args.disks {
        let (path, ro) = match d.strip_suffix(",ro") {
            Some(p) => (p, true),
            None => (d.as_str(), false),
        };
        binds.push(if ro { Bind::ro(path) } else { Bind::rw(path) });
        // A qcow2 layer opens its backing files by path.
        if let Ok(chain) = disk::chain(Path::new(path)) {
            binds.extend(chain.into_iter().skip(1).map(|l| Bind::ro(l.path)));
        }
    }
    // Files the VMM creates: their directories.
    let made = [
        &args.console_log,
        &args.console_socket,
        &args.exit_file,
        &args.api_socket,
        &args.working_set_out,
    ];
    let vsock = args
        .vsock
        .as_deref()
        .map(|v| PathBuf::from(v.split(',').next().unwrap_or(v)));
    for f in made.into_iter().flatten().chain(vsock.as_ref()) {
        if let Some(dir) = f.parent().filter(|d| !d.as_os_str().is_empty()) {
            binds.push(Bind::rw(dir));
        }
    }
    // A link resolves inside the jail only if every hop of it is there:
    // the canonical path is bound, and the links on the way are made.
    let mut links = Vec::new();
    let mut all = Vec::new();
    for b in binds {
        links.extend(hops(&b.path));
        if let Ok(c) = b.path.canonicalize() {
            if c != b.path {
                all.push(Bind {
                    path: c,
                    writable: b.writable,
                });
            }
        }
        all.push(b);
    }
    Mounts {
        root: home.join(".jail"),
        binds: all,
        links,
        masks: if args.tree.is_some() {
            // The home itself is not there.
            Vec::new()
        } else {
            masks(home, args)
        },
    }
}

/// What of `$TINE_HOME` a VMM needs: the vms' directories, the frozen
/// layers, the images and its own root's mount point; a lazy wake also
/// pages in from the store.
const HOME_SHOWN: &[&str] = &["vms", "layers", "images", ".jail"];

/// Everything else in the home, masked: the fleet database, the store
/// (every sleeping branch's memory), the effects journal, intents, locks,
/// leases, tined's socket and logs. The host makes the home's directories
/// when it opens the home (`host::state::close_home`), so they exist to
/// be masked; a file made later in the home's top is not.
fn masks(home: &Path, args: &VmmArgs) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(home) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| {
            let name = e.file_name();
            let name = name.to_string_lossy();
            let shown =
                HOME_SHOWN.contains(&name.as_ref()) || (name == "store" && needs_network(args));
            !shown
        })
        .map(|e| e.path())
        .collect();
    out.sort();
    out
}

/// The symbolic links resolving `path` goes through, anywhere in it
/// (`/var/lib/tine/images/x` → `/tmp/h/images/x` → the image cache's
/// `x`), as (link, target) pairs; at most 16, as the kernel's limit is
/// 40 and these are tine's own homes and caches.
fn hops(path: &Path) -> Vec<(PathBuf, PathBuf)> {
    use std::path::Component;
    let mut out = Vec::new();
    // Components still to walk, last first.
    let mut todo: Vec<std::ffi::OsString> = Vec::new();
    let push = |todo: &mut Vec<std::ffi::OsString>, p: &Path| {
        for c in p.components().rev() {
            match c {
                Component::Normal(n) => todo.push(n.to_os_string()),
                Component::ParentDir => todo.push("..".into()),
                _ => {}
            }
        }
    };
    push(&mut todo, path);
    let mut cur = PathBuf::from("/");
    while let Some(name) = todo.pop() {
        if name == ".." {
            cur.pop();
            continue;
        }
        let next = cur.join(&name);
        match std::fs::read_link(&next) {
            Ok(to) if out.len() < 16 => {
                out.push((next, to.clone()));
                if to.is_absolute() {
                    cur = PathBuf::from("/");
                }
                push(&mut todo, &to);
            }
            _ => cur = next,
        }
    }
    out
}
