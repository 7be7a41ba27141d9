//! The control socket's guard: who may connect (the VMM's own user or
//! root, by SO_PEERCRED), how long a request may take to arrive and how
//! large it may be, and readers per connection so that one idle or slow
//! client does not stall the forks of every other.

use std::io::{BufRead, BufReader, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use crate::api::Request;

/// Largest request line (a fork of 100 named children is a few KiB).
pub const MAX_REQUEST: u64 = 1 << 20;
/// How long a client may take to send its request.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections being read at once; more are refused as busy.
pub const MAX_READERS: usize = 16;

use crate::peer::check_peer;

/// Most fds a request may carry (a fork's taps; the kernel's own limit
/// per message, SCM_MAX_FD, is 253).
pub const MAX_FDS: usize = 253;

/// A request and the fds that came with it, closed when it is dropped.
#[derive(Debug)]
pub struct Received {
    pub request: Request,
    pub fds: Vec<OwnedFd>,
}

/// Reads one request line from an allowed peer, within [`READ_TIMEOUT`]
/// and [`MAX_REQUEST`], with the fds sent along with its first bytes;
/// the taps a fork names by index get their fd.
pub fn read_request(conn: &UnixStream) -> Result<Received, String> {
    if let Err(e) = check_peer(conn) {
        // What it sends is read (and dropped) first, within a second: a
        // refusal sent before the request meets a client still writing,
        // which then fails (EPIPE) without reading why.
        let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
        let mut sink = Vec::new();
        let _ = BufReader::new(conn.take(MAX_REQUEST)).read_until(b'\n', &mut sink);
        return Err(e);
    }
    conn.set_read_timeout(Some(READ_TIMEOUT))
        .map_err(|e| format!("cannot set a read timeout: {e}"))?;
    let (mut line, fds) = first_bytes(conn)?;
    if line.last() != Some(&b'\n') && !line.is_empty() {
        BufReader::new(conn.take(MAX_REQUEST - line.len() as u64))
            .read_until(b'\n', &mut line)
            .map_err(|e| format!("cannot read the request: {e}"))?;
    }
    if line.last() != Some(&b'\n') {
        return Err(if line.len() as u64 >= MAX_REQUEST {
            format!("the request is larger than {MAX_REQUEST} bytes")
        } else {
            "the request ended before its newline".into()
        });
    }
    // Replies go out on the same connection without a deadline of ours.
    let _ = conn.set_read_timeout(None);
    let mut request: Request =
        serde_json::from_slice(&line).map_err(|e| format!("bad request: {e}"))?;
    if let Request::Fork { children, .. } = &mut request {
        for net in children.iter_mut().flat_map(|c| c.nets.iter_mut()) {
            net.fd = match net.fd_index {
                None => None,
                Some(i) => Some(fds.get(i).map(|f| f.as_raw_fd()).ok_or_else(|| {
                    format!(
                        "bad request: tap {} is fd {i} of the request, which came with {}",
                        net.tap,
                        fds.len()
                    )
                })?),
            };
        }
    }
    Ok(Received { request, fds })
}

/// The request's first bytes (up to its first newline, within one
/// recvmsg) and the fds that came with them.
fn first_bytes(conn: &UnixStream) -> Result<(Vec<u8>, Vec<OwnedFd>), String> {
    use vmm_sys_util::sock_ctrl_msg::ScmSocket;
    let mut buf = vec![0u8; 64 << 10];
    let mut raw = [-1; MAX_FDS];
    let mut iov = [libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    }];
    // SAFETY: the one iovec points into `buf`, which outlives the call and
    // may hold any bytes.
    let (n, nfds) = unsafe { conn.recv_with_fds(&mut iov, &mut raw) }
        .map_err(|e| format!("cannot read the request: {e}"))?;
    let fds = raw[..nfds.min(MAX_FDS)]
        .iter()
        // SAFETY: recvmsg(2) just made these fds, and nothing else owns them.
        .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    let end = buf[..n]
        .iter()
        .position(|&b| b == b'\n')
        .map_or(n, |i| i + 1);
    buf.truncate(end);
    Ok((buf, fds))
}

/// Accepts on `listener` in a thread of its own and reads each request in
/// a reader thread (at most [`MAX_READERS`]); the requests, or why one
/// could not be read, arrive in order of completion.
pub fn requests(
    listener: UnixListener,
) -> std::io::Result<mpsc::Receiver<(UnixStream, Result<Received, String>)>> {
    let (tx, rx) = mpsc::channel();
    let readers = Arc::new(AtomicUsize::new(0));
    std::thread::Builder::new()
        .name("api-accept".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else {
                    // Out of fds (EMFILE) repeats at once: do not spin on it.
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                };
                if readers.fetch_add(1, Ordering::SeqCst) >= MAX_READERS {
                    readers.fetch_sub(1, Ordering::SeqCst);
                    if tx
                        .send((conn, Err("the vm's control socket is busy; retry".into())))
                        .is_err()
                    {
                        return;
                    }
                    continue;
                }
                let tx = tx.clone();
                let readers = readers.clone();
                let spawned =
                    std::thread::Builder::new()
                        .name("api-read".into())
                        .spawn(move || {
                            let req = read_request(&conn);
                            readers.fetch_sub(1, Ordering::SeqCst);
                            let _ = tx.send((conn, req));
                        });
                if spawned.is_err() {
                    // The reader count stays raised: the process is out
                    // of threads, and refusing more is right.
                    tracing::warn!("cannot start a control socket reader");
                }
            }
        })?;
    Ok(rx)
}
