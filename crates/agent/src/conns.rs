//! Resetting inherited TCP connections after a fork: the remote end knows
//! only one of the copies, so every copy that must not keep them drops
//! them. For each connected socket to a non-loopback peer we take a
//! duplicate of some process's fd for it (pidfd_getfd) and connect() it to
//! AF_UNSPEC: the kernel runs tcp_disconnect, which sends an RST and makes
//! the application's next call fail with ECONNRESET.

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{FromRawFd, OwnedFd};

/// One line of /proc/net/tcp or /proc/net/tcp6 that matters to us.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpEntry {
    pub local: (IpAddr, u16),
    pub peer: (IpAddr, u16),
    /// The kernel's TCP state number (1 = ESTABLISHED, 10 = LISTEN, ...).
    pub state: u8,
    pub inode: u64,
}

impl TcpEntry {
    /// A socket with a live (or half-closed) connection to a remote peer:
    /// the ones a copy must not keep.
    pub fn needs_reset(&self) -> bool {
        // ESTABLISHED, SYN_SENT, SYN_RECV, FIN_WAIT1, FIN_WAIT2,
        // CLOSE_WAIT, LAST_ACK, CLOSING; not TIME_WAIT (6), CLOSE (7),
        // LISTEN (10), which have no peer to confuse.
        matches!(self.state, 1..=5 | 8 | 9 | 11) && self.inode != 0 && !is_loopback(self.peer.0)
    }
}

/// 127.0.0.0/8, ::1 and ::ffff:127.x.y.z.
pub fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => {
            v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        }
    }
}

/// An address as /proc/net/tcp* prints it: `0100007F:1F90` (v4) or 32 hex
/// digits and a port (v6), each 32-bit word in the kernel's byte order.
fn parse_addr(s: &str) -> Option<(IpAddr, u16)> {
    let (addr, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |h: &str| u32::from_str_radix(h, 16).ok().map(u32::to_ne_bytes);
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(addr)?)),
        32 => {
            let mut b = [0u8; 16];
            for (i, chunk) in b.chunks_mut(4).enumerate() {
                chunk.copy_from_slice(&word(addr.get(i * 8..i * 8 + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(b))
        }
        _ => return None,
    };
    Some((ip, port))
}

/// Parses the text of /proc/net/tcp or /proc/net/tcp6; malformed lines
/// (and the header) are skipped.
pub fn parse_proc_net_tcp(text: &str) -> Vec<TcpEntry> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || !f[0].ends_with(':') {
                return None;
            }
            Some(TcpEntry {
                local: parse_addr(f[1])?,
                peer: parse_addr(f[2])?,
                state: u8::from_str_radix(f[3], 16).ok()?,
                inode: f[9].parse().ok()?,
            })
        })
        .collect()
}

/// What [`reset_all`] did.
#[derive(Debug, Default)]
pub struct ResetSummary {
    /// Sockets disconnected.
    pub reset: usize,
    /// Sockets to reset that no process (but the agent) held.
    pub unowned: usize,
    /// Sockets that could not be reset, with why (first few).
    pub errors: Vec<String>,
}

/// Resets every connected TCP socket to a non-loopback peer held by any
/// process but the agent itself (its own sockets carry this very request
/// when the host talks TCP).
pub fn reset_all() -> io::Result<ResetSummary> {
    let mut targets = BTreeSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        match fs::read_to_string(table) {
            Ok(text) => targets.extend(
                parse_proc_net_tcp(&text)
                    .into_iter()
                    .filter(TcpEntry::needs_reset)
                    .map(|e| e.inode),
            ),
            // No IPv6 in this kernel.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io::Error::new(e.kind(), format!("{table}: {e}"))),
        }
    }
    let mut summary = ResetSummary::default();
    if targets.is_empty() {
        return Ok(summary);
    }
    let holders = socket_holders(&targets)?;
    for inode in &targets {
        let Some(&(pid, fd)) = holders.get(inode) else {
            summary.unowned += 1;
            continue;
        };
        match disconnect(pid, fd) {
            Ok(()) => summary.reset += 1,
            Err(e) => {
                if summary.errors.len() < 4 {
                    summary
                        .errors
                        .push(format!("socket {inode} (pid {pid} fd {fd}): {e}"));
                }
            }
        }
    }
    Ok(summary)
}

/// For each wanted socket inode, one (pid, fd) that holds it, found in
/// /proc/PID/fd; the agent's own fds are left out.
fn socket_holders(wanted: &BTreeSet<u64>) -> io::Result<HashMap<u64, (i32, i32)>> {
    let me = std::process::id() as i32;
    let mut found = HashMap::new();
    for entry in fs::read_dir("/proc")? {
        let Ok(entry) = entry else { continue };
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        // The process may be gone, or be a kernel thread with no fds.
        let Ok(fds) = fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            let Some(fdnum) = fd.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(target) = fs::read_link(fd.path()) else {
                continue;
            };
            let inode = target
                .to_str()
                .and_then(|t| t.strip_prefix("socket:["))
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse::<u64>().ok());
            if let Some(inode) = inode.filter(|i| wanted.contains(i)) {
                found.entry(inode).or_insert((pid, fdnum));
            }
        }
    }
    Ok(found)
}

fn cvt(ret: libc::c_long) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        libc::c_int::try_from(ret).map_err(|_| io::Error::other("descriptor out of range"))
    }
}

/// Disconnects the socket at `fd` of process `pid` (which may be this
/// process): duplicates it with pidfd_getfd (Linux 5.6+) and connects the
/// duplicate to AF_UNSPEC.
pub fn disconnect(pid: i32, fd: i32) -> io::Result<()> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1;
    // no memory is passed.
    let pidfd = cvt(unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) })
        .map_err(|e| io::Error::new(e.kind(), format!("pidfd_open: {e}")))?;
    // SAFETY: pidfd was just returned to us and is owned by nobody else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd) };
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_getfd takes a pidfd, a target fd number and flags and
    // returns a new fd in this process or -1; no memory is passed.
    let dup = cvt(unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) })
        .map_err(|e| io::Error::new(e.kind(), format!("pidfd_getfd: {e}")))?;
    // SAFETY: dup is a new fd owned only by us; OwnedFd closes it.
    let dup = unsafe { OwnedFd::from_raw_fd(dup) };
    let addr = libc::sockaddr {
        sa_family: libc::AF_UNSPEC as libc::sa_family_t,
        sa_data: [0; 14],
    };
    // SAFETY: connect(2) reads `addr` (a valid sockaddr of the size given)
    // and does not keep it.
    let r = unsafe {
        libc::connect(
            dup.as_raw_fd(),
            &addr,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    if r < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("connect(AF_UNSPEC): {e}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;

    const TCP4: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1001 1 0000000000000000 100 0 0 10 0
   1: 0500D50A:0016 0100D50A:C350 01 00000000:00000000 02:000A7B5A 00000000     0        0 1002 2 0000000000000000 20 4 31 10 -1
   2: 0100007F:1F90 0100007F:A000 01 00000000:00000000 00:00000000 00000000  1000        0 1003 1 0000000000000000 20 4 30 10 -1
   3: 0500D50A:8000 0100D50A:1F90 06 00000000:00000000 03:00001234 00000000     0        0 0 3 0000000000000000
   4: 0500D50A:8001 0200D50A:01BB 08 00000000:00000000 00:00000000 00000000     0        0 1004 1 0000000000000000 20 4 30 10 -1
   5: 0500D50A:8002 0200D50A:01BB 02 00000000:00000000 01:00000064 00000002     0        0 1005 1 0000000000000000 800 0 0 1 7
   6: garbage
";

    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000000000000:0016 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2001 1 0000000000000000 100 0 0 10 0
   1: 00000000000000000000000001000000:0016 00000000000000000000000001000000:B000 01 00000000:00000000 00:00000000 00000000     0        0 2002 1 0000000000000000 20 4 30 10 -1
   2: 0000000000000000FFFF00000100007F:0016 0000000000000000FFFF00000100007F:B001 01 00000000:00000000 00:00000000 00000000     0        0 2003 1 0000000000000000 20 4 30 10 -1
   3: 0000000000000000FFFF00000500D50A:0016 0000000000000000FFFF00000100D50A:B002 01 00000000:00000000 00:00000000 00000000     0        0 2004 1 0000000000000000 20 4 30 10 -1
   4: 0000000000000000000000000100000080FE:0016 0000FD20000000000000000000000001:B003 01 00000000:00000000 00:00000000 00000000     0        0 2005 1 0000000000000000 20 4 30 10 -1
   5: 000080FE00000000000000000100000A:0016 0000FD20000000000000000002000000:B004 01 00000000:00000000 00:00000000 00000000     0        0 2006 1 0000000000000000 20 4 30 10 -1
";

    #[test]
    fn test_parse_tcp4_addresses_states_and_filter() {
        let e = parse_proc_net_tcp(TCP4);
        assert_eq!(e.len(), 6, "{e:?}");
        assert_eq!(e[0].state, 10);
        assert_eq!(
            e[1].local,
            ("10.213.0.5".parse().expect("ip"), 22),
            "host byte order"
        );
        assert_eq!(e[1].peer, ("10.213.0.1".parse().expect("ip"), 50000));
        assert_eq!(e[1].inode, 1002);
        let reset: Vec<u64> = e
            .iter()
            .filter(|e| e.needs_reset())
            .map(|e| e.inode)
            .collect();
        // Not the listener, not the loopback one, not TIME_WAIT (inode 0);
        // CLOSE_WAIT and SYN_SENT are.
        assert_eq!(reset, vec![1002, 1004, 1005]);
    }

    #[test]
    fn test_parse_tcp6_and_loopback_filter() {
        let e = parse_proc_net_tcp(TCP6);
        // The line with a 36-digit address is malformed and skipped.
        assert_eq!(e.len(), 5, "{e:?}");
        assert_eq!(e[1].peer.0, "::1".parse::<IpAddr>().expect("ip"));
        assert_eq!(
            e[2].peer.0,
            "::ffff:127.0.0.1".parse::<IpAddr>().expect("ip")
        );
        assert_eq!(
            e[3].peer.0,
            "::ffff:10.213.0.1".parse::<IpAddr>().expect("ip")
        );
        assert_eq!(e[4].local.0, "fe80::a00:1".parse::<IpAddr>().expect("ip"));
        let reset: Vec<u64> = e
            .iter()
            .filter(|e| e.needs_reset())
            .map(|e| e.inode)
            .collect();
        assert_eq!(reset, vec![2004, 2006]);
    }

    /// The real mechanism on this kernel: a duplicate taken with
    /// pidfd_getfd and connected to AF_UNSPEC resets the connection for
    /// both the holder (ECONNRESET or a dead socket) and the peer (RST).
    #[test]
    fn test_disconnect_resets_both_ends() {
        let l = TcpListener::bind("127.0.0.1:0").expect("listen");
        let mut client = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (mut server, _) = l.accept().expect("accept");
        client.write_all(b"x").expect("write");
        let mut b = [0u8; 1];
        server.read_exact(&mut b).expect("read");
        disconnect(std::process::id() as i32, client.as_raw_fd()).expect("disconnect");
        let r = server.read(&mut b);
        assert!(
            matches!(&r, Err(e) if e.kind() == io::ErrorKind::ConnectionReset),
            "server saw {r:?}"
        );
        let w = client.write_all(b"y");
        assert!(w.is_err(), "the holder's socket still works");
    }

    #[test]
    fn test_disconnect_bad_targets_are_errors() {
        let e = disconnect(i32::MAX, 0).expect_err("no such pid");
        assert!(e.to_string().contains("pidfd_open"), "{e}");
        let e = disconnect(std::process::id() as i32, 1_000_000).expect_err("no such fd");
        assert!(e.to_string().contains("pidfd_getfd"), "{e}");
    }
}
