//! A tap interface opened through /dev/net/tun, non-blocking, with a
//! 12-byte virtio-net header in front of every frame.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

use super::VNET_HDR_LEN;

// From <linux/if_tun.h>: _IOW('T', 202, int), _IOW('T', 208, unsigned int),
// _IOW('T', 216, int).
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
// _IOR('T', 210, unsigned int).
const TUNGETIFF: libc::c_ulong = 0x8004_54d2;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;
const IFNAMSIZ: usize = 16;

/// `struct ifreq` as TUNSETIFF reads it: the name, then the flags in the
/// union (padded to the union's 24 bytes).
#[repr(C)]
struct IfReq {
    name: [u8; IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Errors while opening a tap.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// The name cannot be an interface name.
    #[error("Invalid tap name {0:?}: use 1 to 15 bytes without '/', ':', NUL or spaces")]
    InvalidName(String),
    /// /dev/net/tun cannot be opened.
    #[error("Cannot open /dev/net/tun for tap {name} (is the tun module loaded?)")]
    OpenTun {
        name: String,
        #[source]
        source: io::Error,
    },
    /// The kernel refused to attach to or create the interface.
    #[error("Cannot create or attach tap {name} (needs CAP_NET_ADMIN or a tap owned by this user; is it in use?)")]
    Attach {
        name: String,
        #[source]
        source: io::Error,
    },
    /// Configuring the header size or offloads failed.
    #[error("Cannot configure tap {name}")]
    Configure {
        name: String,
        #[source]
        source: io::Error,
    },
}

/// An open tap interface.
#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

impl Tap {
    /// Opens (creating it if needed) the tap interface `name`.
    pub fn open(name: &str) -> Result<Self, TapError> {
        let valid = !name.is_empty()
            && name.len() < IFNAMSIZ
            && name != "."
            && name != ".."
            && !name
                .bytes()
                .any(|b| b == 0 || b == b'/' || b == b':' || b.is_ascii_whitespace());
        if !valid {
            return Err(TapError::InvalidName(name.to_owned()));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(|source| TapError::OpenTun {
                name: name.to_owned(),
                source,
            })?;
        let mut req = IfReq {
            name: [0; IFNAMSIZ],
            flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        // SAFETY: TUNSETIFF reads and writes a `struct ifreq`; `req` has its
        // layout and size (40 bytes) and outlives the call; the fd is ours.
        let ret = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETIFF, &mut req as *mut IfReq) };
        if ret < 0 {
            return Err(TapError::Attach {
                name: name.to_owned(),
                source: io::Error::last_os_error(),
            });
        }
        let hdr_len = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads one int through the pointer, which
        // is valid for the duration of the call.
        let ret = unsafe {
            libc::ioctl(
                file.as_raw_fd(),
                TUNSETVNETHDRSZ,
                &hdr_len as *const libc::c_int,
            )
        };
        if ret < 0 {
            return Err(TapError::Configure {
                name: name.to_owned(),
                source: io::Error::last_os_error(),
            });
        }
        // No offloads: the kernel hands us complete, checksummed frames.
        // SAFETY: TUNSETOFFLOAD takes its flags by value; no memory is passed.
        let ret = unsafe { libc::ioctl(file.as_raw_fd(), TUNSETOFFLOAD, 0 as libc::c_ulong) };
        if ret < 0 {
            return Err(TapError::Configure {
                name: name.to_owned(),
                source: io::Error::last_os_error(),
            });
        }
        Ok(Self {
            file,
            name: name.to_owned(),
        })
    }

    /// Takes over `fd`, a tap already attached and configured by
    /// [`Tap::open`] in the process this one was forked from.
    pub fn adopt(fd: i32, name: &str) -> Self {
        // SAFETY: the caller hands over an open tap fd it owns and never
        // uses again (it was kept open across the fork for this).
        let file = unsafe { File::from_raw_fd(fd) };
        Self {
            file,
            name: name.to_owned(),
        }
    }

    /// The name of the tap `fd` is attached to (TUNGETIFF): to check an
    /// fd handed over by another process before adopting it.
    pub fn attached_name(fd: i32) -> io::Result<String> {
        let mut req = IfReq {
            name: [0; IFNAMSIZ],
            flags: 0,
            _pad: [0; 22],
        };
        // SAFETY: TUNGETIFF writes a `struct ifreq` into `req`, which has
        // its layout and size and outlives the call; an fd that is not a
        // tap only makes it fail.
        let ret = unsafe { libc::ioctl(fd, TUNGETIFF, &mut req as *mut IfReq) };
        if ret < 0 {
            return Err(io::Error::last_os_error());
        }
        let len = req.name.iter().position(|&b| b == 0).unwrap_or(IFNAMSIZ);
        Ok(String::from_utf8_lossy(&req.name[..len]).into_owned())
    }

    /// Gives up the open tap, for another process to adopt.
    pub fn into_fd(self) -> std::os::fd::OwnedFd {
        self.file.into()
    }

    /// The fd (kept open across a fork for the continuation).
    pub fn raw_fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    /// The interface name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Reads one frame (header included); `WouldBlock` when none is queued.
    pub fn read_frame(&self, buf: &mut [u8]) -> io::Result<usize> {
        (&self.file).read(buf)
    }

    /// Writes one frame (header included) in a single write.
    pub fn write_frame(&self, buf: &[u8]) -> io::Result<usize> {
        (&self.file).write(buf)
    }
}

impl AsRawFd for Tap {
    fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}
