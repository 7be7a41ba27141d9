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

    /// Accepts one connection.
    pub fn accept(&self) -> io::Result<VsockStream> {
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
                return Ok(VsockStream(unsafe { File::from_raw_fd(raw) }));
            }
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
    }
}

/// A connected vsock stream socket (reads and writes are plain fd I/O).
pub struct VsockStream(File);

impl io::Read for VsockStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl io::Write for VsockStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl protocol::Connection for VsockStream {
    fn try_clone(&self) -> io::Result<Self> {
        Ok(Self(self.0.try_clone()?))
    }

    fn shutdown(&self, how: std::net::Shutdown) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let how = match how {
            std::net::Shutdown::Read => libc::SHUT_RD,
            std::net::Shutdown::Write => libc::SHUT_WR,
            std::net::Shutdown::Both => libc::SHUT_RDWR,
        };
        // SAFETY: shutdown(2) on the socket fd this value owns.
        if unsafe { libc::shutdown(self.0.as_raw_fd(), how) } < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}
