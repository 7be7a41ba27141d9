//! The muxer: bridges guest vsock streams to host Unix sockets (Firecracker's
//! hybrid convention) and owns the connection table.
//!
//! - Host-initiated: a host process connects to `uds_path` and writes
//!   `CONNECT <port>\n`; the muxer sends the guest an OP_REQUEST from an
//!   ephemeral host port, and on OP_RESPONSE answers `OK <host_port>\n`.
//! - Guest-initiated: a guest connection to (CID 2, port P) is bridged to a
//!   Unix connection to `<uds_path>_<P>`; if nothing listens there the guest
//!   gets OP_RST.
//!
//! Flow control follows the virtio-vsock credit scheme. Guest → host: we
//! advertise [`CONN_BUF_ALLOC`] and count in `fwd_cnt` only the bytes that
//! reached the Unix socket, so a slow host reader shrinks the guest's credit
//! and the guest stops sending; a guest that overruns its credit is reset.
//! Host → guest: we read from the Unix socket only while the guest has
//! credit left and an rx buffer to put the bytes in; otherwise the socket is
//! not polled for input (so the loop never spins) and data stays in the
//! kernel's socket buffer.

use crate::devices::virtio::queue::GuestWarnings;
use std::collections::{HashMap, VecDeque};
use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use event_manager::{EventOps, EventSet, Events};
use tracing::{debug, warn};

use super::packet::{
    TxPacket, VsockHeader, MAX_PKT_DATA, OP_CREDIT_REQUEST, OP_CREDIT_UPDATE, OP_REQUEST,
    OP_RESPONSE, OP_RST, OP_RW, OP_SHUTDOWN, SHUTDOWN_RCV, SHUTDOWN_SEND, TYPE_STREAM,
};

/// The host's CID, as the guest sees it.
pub const HOST_CID: u64 = 2;
/// Receive buffer we advertise to the guest per connection (guest → host
/// bytes we hold at most before they reach the Unix socket).
pub const CONN_BUF_ALLOC: u32 = 256 * 1024;
/// When the guest's view of our free space falls below this and we have
/// forwarded bytes it does not know about, we send a CREDIT_UPDATE.
const CREDIT_UPDATE_THRESHOLD: u32 = CONN_BUF_ALLOC / 2;
/// Connections (pending host connections included) the muxer serves at once.
pub const MAX_CONNECTIONS: usize = 256;
/// Control packets queued for the guest before we stop reading its tx queue.
const MAX_CTRL_BACKLOG: usize = 1024;
/// Longest `CONNECT <port>` line we accept.
const CONNECT_LINE_MAX: usize = 32;
/// First host-side port for host-initiated connections.
const EPHEMERAL_PORT_BASE: u32 = 1 << 30;

/// Event data tag for connection sockets (looked up by fd).
pub(super) const EVENT_CONN: u32 = 5;

/// A connection's identity: our (host) port and the guest's port.
#[derive(Debug, Clone, Copy, Hash, PartialEq, Eq)]
pub struct ConnKey {
    pub local_port: u32,
    pub peer_port: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConnState {
    /// Host-initiated, waiting for the guest's OP_RESPONSE to our
    /// OP_REQUEST (queued at the instant, and `delivered` once it went
    /// into an rx buffer).
    LocalInit { since: Instant, delivered: bool },
    /// Both sides agreed; bytes flow.
    Established,
}

struct Connection {
    stream: UnixStream,
    state: ConnState,
    /// What the stream is registered for in epoll (None: not registered).
    registered: Option<EventSet>,

    // Host → guest.
    /// Payload bytes sent to the guest.
    rx_cnt: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// The stream is readable and waits for an rx buffer.
    rx_pending: bool,
    /// The Unix side reached EOF (we told the guest SHUTDOWN_SEND).
    local_eof: bool,
    /// The guest will receive no more.
    peer_shut_rcv: bool,

    // Guest → host.
    /// Bytes waiting for the Unix socket to become writable.
    tx_buf: VecDeque<u8>,
    /// Leading bytes of `tx_buf` that are ours (the `OK` line), not guest
    /// payload, and so do not count in `fwd_cnt`.
    tx_prefix: usize,
    /// Payload bytes received from the guest.
    recv_cnt: u32,
    /// Payload bytes written to the Unix socket.
    fwd_cnt: u32,
    /// `fwd_cnt` as last told to the guest.
    last_sent_fwd_cnt: u32,
    credit_update_queued: bool,
    /// The guest will send no more.
    peer_shut_send: bool,
    /// We shut down the Unix socket's write side.
    write_shut: bool,
}

impl Connection {
    fn new(stream: UnixStream, state: ConnState, peer_buf_alloc: u32, peer_fwd_cnt: u32) -> Self {
        Self {
            stream,
            state,
            registered: None,
            rx_cnt: 0,
            peer_buf_alloc,
            peer_fwd_cnt,
            rx_pending: false,
            local_eof: false,
            peer_shut_rcv: false,
            tx_buf: VecDeque::new(),
            tx_prefix: 0,
            recv_cnt: 0,
            fwd_cnt: 0,
            last_sent_fwd_cnt: 0,
            credit_update_queued: false,
            peer_shut_send: false,
            write_shut: false,
        }
    }

    /// Bytes the guest may still send us before it overruns our buffer.
    fn peer_free(&self) -> usize {
        let in_flight = self.rx_cnt.wrapping_sub(self.peer_fwd_cnt);
        self.peer_buf_alloc.saturating_sub(in_flight) as usize
    }

    fn can_send_to_guest(&self) -> bool {
        self.state == ConnState::Established
            && !self.local_eof
            && !self.peer_shut_rcv
            && self.peer_free() > 0
    }

    fn wanted_events(&self) -> EventSet {
        if matches!(self.state, ConnState::LocalInit { .. }) {
            // Only to notice a host client that closed: gave up waiting.
            // Not READ_HANG_UP, which a client that merely shut down its
            // write side after `CONNECT` (socat on stdin EOF) raises too.
            return EventSet::HANG_UP;
        }
        let mut set = EventSet::empty();
        if self.can_send_to_guest() && !self.rx_pending {
            set |= EventSet::IN;
        }
        if !self.tx_buf.is_empty() {
            set |= EventSet::OUT;
        }
        set
    }

    /// Writes as much of `tx_buf` as the socket takes.
    fn flush(&mut self) -> io::Result<()> {
        while !self.tx_buf.is_empty() {
            let (front, _) = self.tx_buf.as_slices();
            match self.stream.write(front) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.tx_buf.drain(..n);
                    let ours = n.min(self.tx_prefix);
                    self.tx_prefix -= ours;
                    // n <= tx_buf length <= CONN_BUF_ALLOC + a short line.
                    self.fwd_cnt = self.fwd_cnt.wrapping_add((n - ours) as u32);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// A host connection closed by its client before the guest answered the
/// OP_REQUEST: the client's handshake timed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unanswered {
    pub key: ConnKey,
    /// Since the OP_REQUEST was queued.
    pub waited: Duration,
    /// Whether the OP_REQUEST went into an rx buffer (else the guest never
    /// posted one, or rx was held back).
    pub delivered: bool,
}

/// A control packet waiting for an rx buffer; its credit fields are filled
/// in when it is sent.
struct CtrlPkt {
    key: ConnKey,
    op: u16,
    flags: u32,
}

/// A host connection that has not finished its `CONNECT <port>` line.
struct PendingHost {
    stream: UnixStream,
    line: Vec<u8>,
}

/// The connection table and the host listening socket.
pub struct VsockMuxer {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    pending: HashMap<RawFd, PendingHost>,
    conns: HashMap<ConnKey, Connection>,
    fd_keys: HashMap<RawFd, ConnKey>,
    ctrl: VecDeque<CtrlPkt>,
    data_pending: VecDeque<ConnKey>,
    next_local_port: u32,
    /// Guest mistakes, logged a bounded number of times.
    warnings: GuestWarnings,
}

impl VsockMuxer {
    /// A muxer serving `guest_cid` with the (bound, non-blocking) host
    /// listener at `uds_path`.
    pub fn new(guest_cid: u64, uds_path: PathBuf, listener: UnixListener) -> Self {
        Self {
            guest_cid,
            uds_path,
            listener,
            pending: HashMap::new(),
            conns: HashMap::new(),
            fd_keys: HashMap::new(),
            ctrl: VecDeque::new(),
            data_pending: VecDeque::new(),
            next_local_port: EPHEMERAL_PORT_BASE,
            warnings: GuestWarnings::default(),
        }
    }

    /// The host port the next host-initiated connection will use.
    pub fn next_local_port(&self) -> u32 {
        self.next_local_port
    }

    /// Continues host port numbering from a saved moment. The guest may
    /// still hold sockets of connections made before the moment (closing
    /// ones linger up to 8 s in Linux, and a transport reset marks open
    /// ones closed without dropping them), and a new OP_REQUEST that
    /// matched one would be dropped or answered with a reset. Numbering
    /// on from where the saved muxer stopped never reuses such a port.
    pub fn set_next_local_port(&mut self, port: u32) {
        self.next_local_port = port.max(EPHEMERAL_PORT_BASE);
    }

    /// The host listening socket.
    pub fn listener(&self) -> &UnixListener {
        &self.listener
    }

    /// Live connections (established or waiting for the guest's answer).
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// Host connections still sending their `CONNECT` line.
    #[cfg(test)]
    pub fn pending_count(&self) -> usize {
        self.pending.len()
    }

    /// Whether a packet waits for an rx buffer.
    pub fn has_rx(&self) -> bool {
        !self.ctrl.is_empty() || !self.data_pending.is_empty()
    }

    /// Whether so many control packets wait for the guest that we should
    /// stop reading its tx queue until it posts rx buffers.
    pub fn rx_backlog_full(&self) -> bool {
        self.ctrl.len() >= MAX_CTRL_BACKLOG
    }

    fn header(&self, key: ConnKey, op: u16) -> VsockHeader {
        VsockHeader {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: key.local_port,
            dst_port: key.peer_port,
            len: 0,
            type_: TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: 0,
            fwd_cnt: 0,
        }
    }

    /// Accepts every waiting host connection.
    pub fn handle_listener(&mut self, ops: &mut EventOps) {
        loop {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if let Err(e) = crate::peer::check_peer(&stream) {
                        warn!("vsock: refusing a host connection: {e}");
                        continue;
                    }
                    if self.pending.len() + self.conns.len() >= MAX_CONNECTIONS {
                        warn!("vsock: too many connections, refusing a host connection");
                        continue;
                    }
                    if let Err(e) = stream.set_nonblocking(true) {
                        warn!("vsock: cannot make host connection non-blocking: {e}");
                        continue;
                    }
                    let fd = stream.as_raw_fd();
                    if let Err(e) = ops.add(Events::with_data(&stream, EVENT_CONN, EventSet::IN)) {
                        warn!("vsock: cannot poll host connection: {e:?}");
                        continue;
                    }
                    self.pending.insert(
                        fd,
                        PendingHost {
                            stream,
                            line: Vec::new(),
                        },
                    );
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    warn!("vsock: accept on {} failed: {e}", self.uds_path.display());
                    break;
                }
            }
        }
    }

    /// Handles readiness of a connection socket (pending or established).
    /// Returns what is known of a host connection that gave up waiting for
    /// the guest's answer, for the device to report.
    pub fn handle_fd_event(
        &mut self,
        fd: RawFd,
        events: EventSet,
        ops: &mut EventOps,
    ) -> Option<Unanswered> {
        if self.pending.contains_key(&fd) {
            self.handle_pending(fd, ops);
        } else if let Some(&key) = self.fd_keys.get(&fd) {
            if let Some(Connection {
                state: ConnState::LocalInit { since, delivered },
                ..
            }) = self.conns.get(&key)
            {
                // EPOLLERR comes unasked too; it ends the wait as well.
                if !events.intersects(EventSet::HANG_UP | EventSet::ERROR) {
                    return None;
                }
                let gave_up = Unanswered {
                    key,
                    waited: since.elapsed(),
                    delivered: *delivered,
                };
                // The guest may still hold a half-open socket for it.
                self.kill(key, true, ops);
                return Some(gave_up);
            }
            if let Some(conn) = self.conns.get_mut(&key) {
                let registered = conn.registered.unwrap_or(EventSet::empty());
                if registered.contains(EventSet::IN) && !conn.rx_pending {
                    conn.rx_pending = true;
                    self.data_pending.push_back(key);
                }
            }
            self.step(key, ops);
        } else {
            warn!("vsock: event on unknown fd {fd}");
        }
        None
    }

    fn handle_pending(&mut self, fd: RawFd, ops: &mut EventOps) {
        let Some(p) = self.pending.get_mut(&fd) else {
            return;
        };
        let mut port = None;
        let mut drop_it = false;
        loop {
            // One byte at a time: bytes after the line belong to the guest.
            let mut b = [0u8; 1];
            match p.stream.read(&mut b) {
                Ok(0) => {
                    drop_it = true;
                    break;
                }
                Ok(_) if b[0] == b'\n' => {
                    port = parse_connect(&p.line);
                    drop_it = port.is_none();
                    if drop_it {
                        warn!(
                            "vsock: bad host command {:?}",
                            String::from_utf8_lossy(&p.line)
                        );
                    }
                    break;
                }
                Ok(_) => {
                    p.line.push(b[0]);
                    if p.line.len() > CONNECT_LINE_MAX {
                        warn!("vsock: host command too long");
                        drop_it = true;
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    drop_it = true;
                    break;
                }
            }
        }
        if !drop_it && port.is_none() {
            return;
        }
        let Some(p) = self.pending.remove(&fd) else {
            return;
        };
        if let Err(e) = ops.remove(Events::empty(&p.stream)) {
            warn!("vsock: cannot unregister host connection: {e:?}");
        }
        if let Some(port) = port {
            self.host_connect(p.stream, port, ops);
        }
    }

    fn host_connect(&mut self, stream: UnixStream, peer_port: u32, ops: &mut EventOps) {
        let key = loop {
            let local_port = self.next_local_port;
            self.next_local_port = self
                .next_local_port
                .wrapping_add(1)
                .max(EPHEMERAL_PORT_BASE);
            let key = ConnKey {
                local_port,
                peer_port,
            };
            if !self.conns.contains_key(&key) {
                break key;
            }
        };
        debug!(
            "vsock: host connects to guest port {peer_port} from {}",
            key.local_port
        );
        self.fd_keys.insert(stream.as_raw_fd(), key);
        let state = ConnState::LocalInit {
            since: Instant::now(),
            delivered: false,
        };
        let mut conn = Connection::new(stream, state, 0, 0);
        sync_interest(&mut conn, ops);
        self.conns.insert(key, conn);
        self.ctrl.push_back(CtrlPkt {
            key,
            op: OP_REQUEST,
            flags: 0,
        });
    }

    fn guest_connect(&mut self, key: ConnKey, hdr: &VsockHeader, ops: &mut EventOps) {
        if self.pending.len() + self.conns.len() >= MAX_CONNECTIONS {
            self.warnings.warn(
                "vsock",
                format_args!(
                    "too many connections, refusing guest port {}",
                    key.peer_port
                ),
            );
            self.queue_rst(key);
            return;
        }
        let path = port_path(&self.uds_path, key.local_port);
        match connect_nonblocking(&path) {
            Ok(stream) => {
                debug!(
                    "vsock: guest port {} connected to {}",
                    key.peer_port,
                    path.display()
                );
                self.fd_keys.insert(stream.as_raw_fd(), key);
                self.conns.insert(
                    key,
                    Connection::new(stream, ConnState::Established, hdr.buf_alloc, hdr.fwd_cnt),
                );
                self.ctrl.push_back(CtrlPkt {
                    key,
                    op: OP_RESPONSE,
                    flags: 0,
                });
                self.step(key, ops);
            }
            Err(e) => {
                debug!("vsock: guest connection to {} refused: {e}", path.display());
                self.queue_rst(key);
            }
        }
    }

    fn queue_rst(&mut self, key: ConnKey) {
        self.ctrl.push_back(CtrlPkt {
            key,
            op: OP_RST,
            flags: 0,
        });
    }

    /// Answers an invalid guest packet with OP_RST (never a RST with a RST),
    /// and tears down the connection it names if the header is otherwise
    /// addressed correctly.
    pub fn reject(&mut self, hdr: &VsockHeader, ops: &mut EventOps) {
        let key = ConnKey {
            local_port: hdr.dst_port,
            peer_port: hdr.src_port,
        };
        let addressed = hdr.src_cid == self.guest_cid && hdr.dst_cid == HOST_CID;
        if addressed && self.conns.contains_key(&key) {
            self.kill(key, hdr.op != OP_RST, ops);
        } else if hdr.op != OP_RST {
            self.queue_rst(key);
        }
    }

    /// Handles one packet from the guest's tx queue.
    pub fn handle_tx(&mut self, pkt: TxPacket, ops: &mut EventOps) {
        let hdr = pkt.hdr;
        if hdr.src_cid != self.guest_cid
            || hdr.dst_cid != HOST_CID
            || hdr.type_ != TYPE_STREAM
            || !(OP_REQUEST..=OP_CREDIT_REQUEST).contains(&hdr.op)
        {
            self.warnings.warn(
                "vsock",
                format_args!(
                    "invalid packet from guest (src_cid {}, dst_cid {}, type {}, op {})",
                    hdr.src_cid, hdr.dst_cid, hdr.type_, hdr.op
                ),
            );
            self.reject(&hdr, ops);
            return;
        }
        let key = ConnKey {
            local_port: hdr.dst_port,
            peer_port: hdr.src_port,
        };
        let Some(conn) = self.conns.get_mut(&key) else {
            match hdr.op {
                OP_REQUEST => self.guest_connect(key, &hdr, ops),
                OP_RST => {}
                _ => self.queue_rst(key),
            }
            return;
        };
        conn.peer_buf_alloc = hdr.buf_alloc;
        conn.peer_fwd_cnt = hdr.fwd_cnt;
        match (conn.state, hdr.op) {
            (_, OP_RST) => {
                self.kill(key, false, ops);
                return;
            }
            (ConnState::LocalInit { .. }, OP_RESPONSE) => {
                conn.state = ConnState::Established;
                let line = format!("OK {}\n", key.local_port);
                conn.tx_prefix = line.len();
                conn.tx_buf.extend(line.as_bytes());
            }
            (ConnState::Established, OP_RW) => {
                let outstanding = conn.recv_cnt.wrapping_sub(conn.fwd_cnt) as usize;
                if conn.peer_shut_send || outstanding + pkt.data.len() > CONN_BUF_ALLOC as usize {
                    self.warnings.warn(
                        "vsock",
                        format_args!(
                            "guest port {} sent data beyond its credit or after shutdown",
                            key.peer_port
                        ),
                    );
                    self.kill(key, true, ops);
                    return;
                }
                // Bounded by MAX_PKT_DATA.
                conn.recv_cnt = conn.recv_cnt.wrapping_add(pkt.data.len() as u32);
                conn.tx_buf.extend(&pkt.data);
            }
            (ConnState::Established, OP_CREDIT_UPDATE) => {}
            (ConnState::Established, OP_CREDIT_REQUEST) => self.queue_credit_update(key),
            (ConnState::Established, OP_SHUTDOWN) => {
                conn.peer_shut_rcv |= hdr.flags & SHUTDOWN_RCV != 0;
                conn.peer_shut_send |= hdr.flags & SHUTDOWN_SEND != 0;
            }
            _ => {
                self.warnings.warn(
                    "vsock",
                    format_args!("unexpected op {} on guest port {}", hdr.op, key.peer_port),
                );
                self.kill(key, true, ops);
                return;
            }
        }
        self.step(key, ops);
    }

    fn queue_credit_update(&mut self, key: ConnKey) {
        if let Some(conn) = self.conns.get_mut(&key) {
            if !conn.credit_update_queued {
                conn.credit_update_queued = true;
                self.ctrl.push_back(CtrlPkt {
                    key,
                    op: OP_CREDIT_UPDATE,
                    flags: 0,
                });
            }
        }
    }

    /// Moves a connection forward after anything changed: flushes pending
    /// bytes to the Unix side, finishes shutdowns, grants credit and updates
    /// what the socket is polled for.
    fn step(&mut self, key: ConnKey, ops: &mut EventOps) {
        let Some(conn) = self.conns.get_mut(&key) else {
            return;
        };
        if let Err(e) = conn.flush() {
            debug!(
                "vsock: host side of guest port {} failed: {e}",
                key.peer_port
            );
            self.kill(key, true, ops);
            return;
        }
        if conn.tx_buf.is_empty() && conn.peer_shut_send {
            if (conn.peer_shut_rcv || conn.local_eof) && conn.state == ConnState::Established {
                // Neither side will send again: close, and tell the guest.
                self.kill(key, true, ops);
                return;
            }
            if !conn.write_shut {
                conn.write_shut = true;
                // The host reader may have gone already; nothing to do then.
                let _ = conn.stream.shutdown(std::net::Shutdown::Write);
            }
        }
        let visible_free =
            CONN_BUF_ALLOC.saturating_sub(conn.recv_cnt.wrapping_sub(conn.last_sent_fwd_cnt));
        let wants_credit = conn.state == ConnState::Established
            && !conn.peer_shut_send
            && conn.fwd_cnt != conn.last_sent_fwd_cnt
            && visible_free < CREDIT_UPDATE_THRESHOLD;
        if wants_credit {
            self.queue_credit_update(key);
        }
        if let Some(conn) = self.conns.get_mut(&key) {
            sync_interest(conn, ops);
        }
    }

    /// Closes a connection (the Unix stream is closed, so the host sees
    /// EOF) and optionally tells the guest with OP_RST.
    fn kill(&mut self, key: ConnKey, send_rst: bool, ops: &mut EventOps) {
        if let Some(conn) = self.conns.remove(&key) {
            if conn.registered.is_some() {
                if let Err(e) = ops.remove(Events::empty(&conn.stream)) {
                    warn!("vsock: cannot unregister connection: {e:?}");
                }
            }
            self.fd_keys.remove(&conn.stream.as_raw_fd());
            debug!(
                "vsock: closed connection {}:{}",
                key.local_port, key.peer_port
            );
        }
        if send_rst {
            self.queue_rst(key);
        }
    }

    /// The next packet for the guest, with at most `max_data` payload bytes;
    /// None when nothing is ready. Control packets go first.
    pub fn next_rx_packet(
        &mut self,
        max_data: usize,
        ops: &mut EventOps,
    ) -> Option<(VsockHeader, Vec<u8>)> {
        loop {
            if let Some(c) = self.ctrl.pop_front() {
                let mut hdr = self.header(c.key, c.op);
                hdr.flags = c.flags;
                if let Some(conn) = self.conns.get_mut(&c.key) {
                    hdr.buf_alloc = CONN_BUF_ALLOC;
                    hdr.fwd_cnt = conn.fwd_cnt;
                    conn.last_sent_fwd_cnt = conn.fwd_cnt;
                    if let ConnState::LocalInit { delivered, .. } = &mut conn.state {
                        *delivered = true;
                    }
                    if c.op == OP_CREDIT_UPDATE {
                        conn.credit_update_queued = false;
                    }
                } else if c.op != OP_RST {
                    // Stale packet of a connection that is gone.
                    continue;
                }
                return Some((hdr, Vec::new()));
            }
            if max_data == 0 {
                return None;
            }
            let key = self.data_pending.pop_front()?;
            let Some(conn) = self.conns.get_mut(&key) else {
                continue;
            };
            if !conn.rx_pending {
                continue;
            }
            conn.rx_pending = false;
            if !conn.can_send_to_guest() {
                sync_interest(conn, ops);
                continue;
            }
            let n = max_data.min(conn.peer_free()).min(MAX_PKT_DATA);
            let mut data = vec![0u8; n];
            match conn.stream.read(&mut data) {
                Ok(0) => {
                    conn.local_eof = true;
                    let mut hdr = self.header(key, OP_SHUTDOWN);
                    hdr.flags = SHUTDOWN_SEND;
                    self.fill_credit(key, &mut hdr);
                    self.step(key, ops);
                    return Some((hdr, Vec::new()));
                }
                Ok(k) => {
                    data.truncate(k);
                    // k <= MAX_PKT_DATA.
                    conn.rx_cnt = conn.rx_cnt.wrapping_add(k as u32);
                    conn.rx_pending = true;
                    self.data_pending.push_back(key);
                    let mut hdr = self.header(key, OP_RW);
                    hdr.len = k as u32;
                    self.fill_credit(key, &mut hdr);
                    return Some((hdr, data));
                }
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::Interrupted =>
                {
                    sync_interest(conn, ops);
                }
                Err(e) => {
                    debug!(
                        "vsock: read from host side of guest port {} failed: {e}",
                        key.peer_port
                    );
                    self.kill(key, true, ops);
                }
            }
        }
    }

    fn fill_credit(&mut self, key: ConnKey, hdr: &mut VsockHeader) {
        if let Some(conn) = self.conns.get_mut(&key) {
            hdr.buf_alloc = CONN_BUF_ALLOC;
            hdr.fwd_cnt = conn.fwd_cnt;
            conn.last_sent_fwd_cnt = conn.fwd_cnt;
        }
    }
}

/// Registers, modifies or unregisters `conn`'s socket so epoll reports
/// exactly what the connection can act on now. A socket with nothing to do
/// is not in epoll at all, so a hung-up peer cannot make the loop spin.
fn sync_interest(conn: &mut Connection, ops: &mut EventOps) {
    let want = conn.wanted_events();
    let result = match conn.registered {
        Some(have) if have == want => return,
        Some(_) if want.is_empty() => ops.remove(Events::empty(&conn.stream)),
        Some(_) => ops.modify(Events::with_data(&conn.stream, EVENT_CONN, want)),
        None if want.is_empty() => return,
        None => ops.add(Events::with_data(&conn.stream, EVENT_CONN, want)),
    };
    match result {
        Ok(()) => conn.registered = (!want.is_empty()).then_some(want),
        Err(e) => warn!("vsock: cannot update connection polling: {e:?}"),
    }
}

/// Parses `CONNECT <port>` (an optional trailing `\r` is accepted).
fn parse_connect(line: &[u8]) -> Option<u32> {
    let line = std::str::from_utf8(line).ok()?;
    let port = line.trim_end_matches('\r').strip_prefix("CONNECT ")?;
    port.trim().parse().ok()
}

/// `<uds_path>_<port>`.
pub fn port_path(uds_path: &Path, port: u32) -> PathBuf {
    let mut s = OsString::from(uds_path.as_os_str());
    s.push(format!("_{port}"));
    PathBuf::from(s)
}

/// Connects to a Unix stream socket without blocking: a listener whose
/// backlog is full refuses (EAGAIN) instead of stalling the device thread.
fn connect_nonblocking(path: &Path) -> io::Result<UnixStream> {
    let bytes = path.as_os_str().as_bytes();
    // SAFETY: sockaddr_un is plain old data; all zeroes is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    if bytes.len() >= addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket path too long",
        ));
    }
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (dst, src) in addr.sun_path.iter_mut().zip(bytes) {
        *dst = *src as libc::c_char;
    }
    // SAFETY: plain syscall with constant arguments; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a socket we just created and nobody else owns.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: `addr` is a valid sockaddr_un and `len` is within its size
    // (checked above); `owned` is a valid socket.
    let rc = unsafe {
        libc::connect(
            owned.as_raw_fd(),
            std::ptr::addr_of!(addr).cast::<libc::sockaddr>(),
            len as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(UnixStream::from(owned))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_parse_connect_valid_and_invalid() {
        assert_eq!(parse_connect(b"CONNECT 52"), Some(52));
        assert_eq!(parse_connect(b"CONNECT 52\r"), Some(52));
        assert_eq!(parse_connect(b"CONNECT x"), None);
        assert_eq!(parse_connect(b"connect 52"), None);
        assert_eq!(parse_connect(b"CONNECT 99999999999"), None);
    }

    #[test]
    fn test_port_path_appends_port() {
        assert_eq!(
            port_path(Path::new("/tmp/v.sock"), 52),
            PathBuf::from("/tmp/v.sock_52")
        );
    }
}
