//! A userfaultfd in missing mode: the few ioctls lazy page-in uses.
//!
//! Written by hand on `linux-raw-sys`'s pre-generated kernel ABI rather
//! than with the `userfaultfd` crate: that crate's `-sys` part runs
//! bindgen at build time, which needs libclang, and the project's machines
//! (and CI's fresh ones) have none. The ABI is six ioctls and one message
//! struct; nothing here interprets more than that.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use linux_raw_sys::general::{
    uffd_msg, uffdio_api, uffdio_copy, uffdio_range, uffdio_register, uffdio_zeropage,
    UFFDIO_REGISTER_MODE_MISSING, UFFD_API, UFFD_EVENT_PAGEFAULT,
};
use linux_raw_sys::ioctl::{
    UFFDIO_API, UFFDIO_COPY, UFFDIO_REGISTER, UFFDIO_UNREGISTER, UFFDIO_WAKE, UFFDIO_ZEROPAGE,
};

/// A userfaultfd handling missing-page faults of registered ranges,
/// kernel-mode faults included (KVM reaches guest RAM through
/// get_user_pages, which is a kernel-mode fault).
#[derive(Debug)]
pub struct Uffd {
    file: File,
}

/// What a fault message says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The faulting host address (page aligned by the kernel's default).
    pub addr: u64,
    pub write: bool,
}

/// How a UFFDIO_COPY or UFFDIO_ZEROPAGE ended.
#[derive(Debug)]
pub enum Resolve {
    /// All of it is now present.
    Done,
    /// Part of the range was already present (someone else filled it):
    /// `done` bytes from the start were filled by this call.
    Exists { done: usize },
}

impl Uffd {
    /// A new non-blocking, close-on-exec userfaultfd that handles
    /// kernel-mode faults too (KVM's). The syscall needs CAP_SYS_PTRACE
    /// (vm.unprivileged_userfaultfd=0), which a jailed VMM has not:
    /// then `/dev/userfaultfd` (Linux 6.1+), whose file mode is the check.
    pub fn new() -> io::Result<Self> {
        let flags = libc::O_CLOEXEC | libc::O_NONBLOCK;
        // SAFETY: the userfaultfd syscall takes one flags argument and
        // returns a new fd or -1.
        let mut fd = unsafe { libc::syscall(libc::SYS_userfaultfd, flags) };
        if fd < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() != Some(libc::EPERM) {
                return Err(err);
            }
            let dev = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC)
                .open("/dev/userfaultfd")
                .map_err(|_| err)?;
            // USERFAULTFD_IOC_NEW = _IO(0xAA, 0x00).
            const USERFAULTFD_IOC_NEW: libc::c_ulong = 0xAA00;
            // SAFETY: USERFAULTFD_IOC_NEW takes the flags by value and
            // returns a new fd or -1; `dev` is open for the call.
            fd = unsafe { libc::ioctl(dev.as_raw_fd(), USERFAULTFD_IOC_NEW, flags) } as i64;
            if fd < 0 {
                return Err(io::Error::last_os_error());
            }
        }
        // SAFETY: a fresh fd nobody else owns.
        let file = unsafe { File::from_raw_fd(fd as RawFd) };
        let mut api = uffdio_api {
            api: u64::from(UFFD_API),
            features: 0,
            ioctls: 0,
        };
        // SAFETY: UFFDIO_API with a valid uffdio_api the kernel fills.
        ioctl(file.as_raw_fd(), UFFDIO_API, &mut api)?;
        Ok(Self { file })
    }

    /// Registers `len` bytes at `start` (page aligned, an anonymous private
    /// mapping) for missing-page faults.
    pub fn register(&self, start: u64, len: u64) -> io::Result<()> {
        let mut reg = uffdio_register {
            range: uffdio_range { start, len },
            mode: u64::from(UFFDIO_REGISTER_MODE_MISSING),
            ioctls: 0,
        };
        ioctl(self.fd(), UFFDIO_REGISTER, &mut reg)
    }

    /// Unregisters a range: later missing faults there are ordinary
    /// anonymous faults (zero pages).
    pub fn unregister(&self, start: u64, len: u64) -> io::Result<()> {
        let mut range = uffdio_range { start, len };
        ioctl(self.fd(), UFFDIO_UNREGISTER, &mut range)
    }

    /// Installs `src` at `dst` (UFFDIO_COPY) and wakes the threads waiting
    /// on the range.
    ///
    /// # Safety
    /// `dst..dst+src.len()` must lie in a range registered on this uffd.
    pub unsafe fn copy(&self, dst: u64, src: &[u8]) -> io::Result<Resolve> {
        let mut c = uffdio_copy {
            dst,
            src: src.as_ptr() as u64,
            len: src.len() as u64,
            mode: 0,
            copy: 0,
        };
        resolved(ioctl(self.fd(), UFFDIO_COPY, &mut c), c.copy)
    }

    /// Maps the zero page over `len` bytes at `dst` (UFFDIO_ZEROPAGE) and
    /// wakes the waiters: no memory is used until the guest writes.
    ///
    /// # Safety
    /// The range must lie in a range registered on this uffd.
    pub unsafe fn zeropage(&self, dst: u64, len: u64) -> io::Result<Resolve> {
        let mut z = uffdio_zeropage {
            range: uffdio_range { start: dst, len },
            mode: 0,
            zeropage: 0,
        };
        resolved(ioctl(self.fd(), UFFDIO_ZEROPAGE, &mut z), z.zeropage)
    }

    /// Wakes threads waiting on a range that someone else filled.
    pub fn wake(&self, start: u64, len: u64) -> io::Result<()> {
        let mut range = uffdio_range { start, len };
        ioctl(self.fd(), UFFDIO_WAKE, &mut range)
    }

    /// Reads the pending page-fault messages into `out` (cleared first);
    /// other events are not asked for and are skipped. Returns at once
    /// when nothing is pending (the fd is non-blocking; poll it).
    pub fn read_faults(&self, out: &mut Vec<Fault>) -> io::Result<()> {
        out.clear();
        const N: usize = 32;
        // SAFETY: uffd_msg is plain data; all-zero is a valid value.
        let mut msgs: [uffd_msg; N] = unsafe { std::mem::zeroed() };
        let size = std::mem::size_of::<uffd_msg>();
        // SAFETY: reads at most N messages into the array.
        let n = unsafe { libc::read(self.fd(), msgs.as_mut_ptr().cast(), N * size) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.kind() {
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(()),
                _ => Err(e),
            };
        }
        for m in msgs.iter().take(n as usize / size) {
            if u32::from(m.event) != UFFD_EVENT_PAGEFAULT {
                continue;
            }
            // SAFETY: for a page-fault event the union holds `pagefault`.
            let pf = unsafe { m.arg.pagefault };
            out.push(Fault {
                addr: pf.address,
                write: pf.flags & u64::from(linux_raw_sys::general::UFFD_PAGEFAULT_FLAG_WRITE) != 0,
            });
        }
        Ok(())
    }

    fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

impl AsRawFd for Uffd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}

fn ioctl<T>(fd: RawFd, req: u32, arg: &mut T) -> io::Result<()> {
    // SAFETY: every caller passes the argument struct its request expects.
    let rc = unsafe { libc::ioctl(fd, libc::c_ulong::from(req), arg as *mut T) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// EEXIST means part of the range was present already; the kernel then
/// reports in `done` how much this call filled (or -EEXIST).
fn resolved(rc: io::Result<()>, done: i64) -> io::Result<Resolve> {
    match rc {
        Ok(()) => Ok(Resolve::Done),
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(Resolve::Exists {
            done: usize::try_from(done).unwrap_or(0),
        }),
        Err(e) => Err(e),
    }
}
