//! AF_VSOCK stream sockets. std has no vsock support and the vsock crates
//! pull in nix and more; this is the few calls the agent needs.

use std::fs::File;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};

/// VMADDR_CID_ANY: accept connections addressed to any of our CIDs.
const VMADDR_CID_ANY: u32 = u32::MAX;

/// A listening vsock stream socket.
pub struct VsockListener {
    fd: OwnedFd,
}

impl VsockListener {
    /// Listens on `port` for connections from the host.
    pub fn bind(port: u32) -> io::Result<Self> {
        // SAFETY: plain socket(2) call; the result is checked before use.
        let raw =
            unsafe { libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh socket fd that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let addr = libc::sockaddr_vm {
            svm_family: libc::AF_VSOCK as libc::sa_family_t,
            svm_reserved1: 0,
            svm_port: port,
            svm_cid: VMADDR_CID_ANY,
            svm_zero: [0; 4],
        };
        // SAFETY: `addr` is a valid sockaddr_vm and the length matches it.
        let rc = unsafe {
            libc::bind(
                raw,
                (&addr as *const libc::sockaddr_vm).cast(),
                std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: listen(2) on the socket we own.
        if unsafe { libc::listen(raw, 16) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { fd })
    }

    /// Accepts one connection, as a File (reads and writes are plain I/O).
    pub fn accept(&self) -> io::Result<File> {
        use std::os::fd::AsRawFd;
        loop {
            // SAFETY: accept4 on our listening socket; peer address not wanted.
            let raw = unsafe {
                libc::accept4(
                    self.fd.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC,
                )
            };
            if raw >= 0 {
                // SAFETY: `raw` is a fresh connected socket fd that we now own.
                return Ok(unsafe { File::from_raw_fd(raw) });
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}
