//! How a VMM process shows in `ps`: after its own vm, not after the
//! command line of the process it was forked from.
//!
//! The thread-group name (`/proc/PID/comm`, 15 bytes) is set always; the
//! command line (`/proc/PID/cmdline`) is pointed at a new text with
//! `PR_SET_MM_ARG_START`/`ARG_END`, which needs CAP_SYS_RESOURCE (root in
//! a container may lack it); without it the new text is written over the
//! original argument strings, cut to their length.

/// Names this process after vm `name`: comm `vmm:NAME` (truncated), and
/// command line `tine-vmm NAME` plus `detail` words, if any (e.g.
/// `(checkpoint TAG)`).
pub fn set(name: &str, detail: Option<&str>) {
    set_comm(&format!("vmm:{name}"));
    let mut args = vec!["tine-vmm".to_string(), name.to_string()];
    if let Some(d) = detail {
        args.push(d.to_string());
    }
    set_cmdline(&args);
}

/// Names this process as the init of the VMM process tree `tree` (the
/// pid 1 of its PID namespace, which is not a VMM): comm `tine-init`,
/// command line `tine-init TREE`.
pub fn set_tree_init(tree: &str) {
    set_comm("tine-init");
    set_cmdline(&["tine-init".to_string(), tree.to_string()]);
}

/// The thread-group leader's name: `/proc/self/comm` names it whatever
/// thread writes (PR_SET_NAME would name only the calling thread).
fn set_comm(comm: &str) {
    let bytes: Vec<u8> = comm.bytes().filter(|&b| b != 0).take(15).collect();
    // A name cut inside a UTF-8 sequence is still valid for the kernel.
    // (No newline: the kernel would keep it as part of the name.)
    if std::fs::write("/proc/self/comm", &bytes).is_err() {
        let mut c = bytes;
        c.push(0);
        // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most
        // 16 bytes from a live buffer.
        unsafe { libc::prctl(libc::PR_SET_NAME, c.as_ptr() as libc::c_ulong, 0, 0, 0) };
    }
}

/// Points the process's argument area at `args` (NUL-separated) with
/// PR_SET_MM; without CAP_SYS_RESOURCE, writes them over the original
/// argument strings instead, cut to fit (the classic setproctitle).
fn set_cmdline(args: &[String]) {
    let mut text = Vec::new();
    for a in args {
        text.extend(a.bytes().filter(|&b| b != 0));
        text.push(0);
    }
    if !point_args_at(text.clone()) {
        overwrite_args(&text);
    }
}

/// The buffer is leaked: the kernel reads it for as long as the process
/// lives.
fn point_args_at(text: Vec<u8>) -> bool {
    let buf: &'static [u8] = Box::leak(text.into_boxed_slice());
    let start = buf.as_ptr() as libc::c_ulong;
    let end = start + buf.len() as libc::c_ulong;
    let set = |what: libc::c_int, addr: libc::c_ulong| {
        // SAFETY: PR_SET_MM only changes where the kernel reads the
        // command line from; `addr` lies in (or just past) a live,
        // leaked buffer of this process.
        unsafe { libc::prctl(libc::PR_SET_MM, what as libc::c_ulong, addr, 0, 0) == 0 }
    };
    // The kernel keeps start <= end after each call: which one moves
    // first depends on where the new buffer lies relative to the old area.
    (set(libc::PR_SET_MM_ARG_START, start) && set(libc::PR_SET_MM_ARG_END, end))
        || (set(libc::PR_SET_MM_ARG_END, end) && set(libc::PR_SET_MM_ARG_START, start))
}

/// Writes `text` over the process's argument strings, NUL-padded, cut to
/// their length. The area is this process's own (the initial stack,
/// between `arg_start` and `arg_end` of /proc/self/stat). Only std's
/// `env::args` reads it, which a VMM does not call once it serves a vm.
fn overwrite_args(text: &[u8]) {
    let Some((start, end)) = arg_area() else {
        return;
    };
    let Some(len) = end.checked_sub(start).filter(|&l| l > 1) else {
        return;
    };
    let n = text.len().min(len - 1);
    let bytes = text[..n].iter().copied().chain(std::iter::repeat(0));
    for (i, b) in bytes.take(len).enumerate() {
        // SAFETY: [start, end) is this process's argument area, mapped
        // and writable for the whole life of the process; bytes are
        // written one by one, so no reference to it is created here.
        unsafe { std::ptr::write_volatile((start + i) as *mut u8, b) };
    }
}

/// Reads what naming needs from /proc while it is there (a jailed VMM
/// has none once it pivots; fork children inherit the argument area).
pub fn prepare() {
    let _ = ARG_AREA.get_or_init(read_arg_area);
}

static ARG_AREA: std::sync::OnceLock<Option<(usize, usize)>> = std::sync::OnceLock::new();

fn arg_area() -> Option<(usize, usize)> {
    *ARG_AREA.get_or_init(read_arg_area)
}

/// `arg_start` and `arg_end` (fields 48 and 49 of /proc/self/stat).
fn read_arg_area() -> Option<(usize, usize)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after `(comm)` start at field 3.
    let (_, rest) = stat.rsplit_once(')')?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let start = f.get(48 - 3)?.parse().ok()?;
    let end = f.get(49 - 3)?.parse().ok()?;
    (start != 0 && end > start).then_some((start, end))
}
