//! The virtio-vsock packet: a 44-byte little-endian header followed by
//! `len` payload bytes, and how packets move in and out of guest descriptor
//! chains.
//!
//! Every chain the guest offers is checked through virtio-queue's
//! [`Reader`]/[`Writer`], which refuse buffers outside guest memory.

use std::io::{Read, Write};

use virtio_queue::{DescriptorChain, Reader, Writer};

use crate::memory::GuestMemoryMmap;

/// Size of the packet header in bytes.
pub const HDR_SIZE: usize = 44;
/// Largest payload we accept from, or send to, the guest in one packet
/// (Linux's `VIRTIO_VSOCK_MAX_PKT_BUF_SIZE`).
pub const MAX_PKT_DATA: usize = 64 * 1024;

/// The only socket type virtio-vsock defines: a stream.
pub const TYPE_STREAM: u16 = 1;

/// Connection request.
pub const OP_REQUEST: u16 = 1;
/// Connection accepted.
pub const OP_RESPONSE: u16 = 2;
/// Connection refused or torn down.
pub const OP_RST: u16 = 3;
/// Sender will not receive and/or send any more.
pub const OP_SHUTDOWN: u16 = 4;
/// Payload.
pub const OP_RW: u16 = 5;
/// The sender's buf_alloc/fwd_cnt changed.
pub const OP_CREDIT_UPDATE: u16 = 6;
/// The sender asks for a credit update.
pub const OP_CREDIT_REQUEST: u16 = 7;

/// SHUTDOWN flag: the sender will receive no more data.
pub const SHUTDOWN_RCV: u32 = 1;
/// SHUTDOWN flag: the sender will send no more data.
pub const SHUTDOWN_SEND: u32 = 2;

/// A decoded packet header (`struct virtio_vsock_hdr`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VsockHeader {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

fn le_u64(b: &[u8; HDR_SIZE], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

fn le_u32(b: &[u8; HDR_SIZE], at: usize) -> u32 {
    let mut v = [0u8; 4];
    v.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(v)
}

fn le_u16(b: &[u8; HDR_SIZE], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

impl VsockHeader {
    /// Decodes the wire format.
    pub fn from_bytes(b: &[u8; HDR_SIZE]) -> Self {
        Self {
            src_cid: le_u64(b, 0),
            dst_cid: le_u64(b, 8),
            src_port: le_u32(b, 16),
            dst_port: le_u32(b, 20),
            len: le_u32(b, 24),
            type_: le_u16(b, 28),
            op: le_u16(b, 30),
            flags: le_u32(b, 32),
            buf_alloc: le_u32(b, 36),
            fwd_cnt: le_u32(b, 40),
        }
    }

    /// Encodes the wire format.
    pub fn to_bytes(&self) -> [u8; HDR_SIZE] {
        let mut b = [0u8; HDR_SIZE];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }
}

/// One line per packet for traces: `REQUEST 2:1073741824>3:10000 len 0
/// flags 0 credit 262144/0` (buf_alloc/fwd_cnt).
impl std::fmt::Display for VsockHeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let op = match self.op {
            OP_REQUEST => "REQUEST",
            OP_RESPONSE => "RESPONSE",
            OP_RST => "RST",
            OP_SHUTDOWN => "SHUTDOWN",
            OP_RW => "RW",
            OP_CREDIT_UPDATE => "CREDIT_UPDATE",
            OP_CREDIT_REQUEST => "CREDIT_REQUEST",
            _ => "op?",
        };
        write!(
            f,
            "{op}({}) {}:{}>{}:{} len {} flags {} credit {}/{}",
            self.op,
            self.src_cid,
            self.src_port,
            self.dst_cid,
            self.dst_port,
            self.len,
            self.flags,
            self.buf_alloc,
            self.fwd_cnt
        )
    }
}

/// A packet the guest put on the tx queue.
#[derive(Debug)]
pub struct TxPacket {
    pub hdr: VsockHeader,
    pub data: Vec<u8>,
}

/// Why a tx chain could not be turned into a packet.
#[derive(Debug, thiserror::Error)]
pub enum PacketError {
    /// The chain points outside guest memory (or overflows).
    #[error("Descriptor chain is not in guest memory")]
    Memory(#[source] virtio_queue::Error),
    /// The readable part of the chain is shorter than a header.
    #[error("Descriptor chain holds {0} bytes, less than a vsock header")]
    ShortHeader(usize),
    /// The header's `len` is larger than the chain or than [`MAX_PKT_DATA`];
    /// the header itself is valid and the peer gets a RST.
    #[error("Header length {len} does not fit the chain ({avail} bytes) or the packet limit")]
    BadLength {
        hdr: VsockHeader,
        len: u32,
        avail: usize,
    },
    /// The rx chain cannot hold even a header.
    #[error("Rx descriptor chain has {0} writable bytes, less than a vsock header")]
    RxTooSmall(usize),
    /// Copying from or to guest memory failed.
    #[error("Cannot copy packet to or from guest memory")]
    Io(#[source] std::io::Error),
}

/// Reads one tx packet (header and payload) from `chain`.
pub fn read_tx_packet(
    mem: &GuestMemoryMmap,
    chain: DescriptorChain<&GuestMemoryMmap>,
) -> Result<TxPacket, PacketError> {
    let mut reader = Reader::new(mem, chain).map_err(PacketError::Memory)?;
    let avail = reader.available_bytes();
    if avail < HDR_SIZE {
        return Err(PacketError::ShortHeader(avail));
    }
    let mut raw = [0u8; HDR_SIZE];
    reader.read_exact(&mut raw).map_err(PacketError::Io)?;
    let hdr = VsockHeader::from_bytes(&raw);
    let len = hdr.len as usize;
    let data_avail = avail - HDR_SIZE;
    if len > data_avail || len > MAX_PKT_DATA {
        return Err(PacketError::BadLength {
            hdr,
            len: hdr.len,
            avail: data_avail,
        });
    }
    let mut data = vec![0u8; len];
    reader.read_exact(&mut data).map_err(PacketError::Io)?;
    Ok(TxPacket { hdr, data })
}

/// A writable rx chain ready to receive one packet.
pub struct RxBuffer<'a> {
    writer: Writer<'a, crate::memory::GuestBitmapSlice<'a>>,
}

impl<'a> RxBuffer<'a> {
    /// Wraps `chain`; fails if it is outside guest memory or smaller than a
    /// header.
    pub fn new(
        mem: &'a GuestMemoryMmap,
        chain: DescriptorChain<&'a GuestMemoryMmap>,
    ) -> Result<Self, PacketError> {
        let writer = Writer::new(mem, chain).map_err(PacketError::Memory)?;
        let avail = writer.available_bytes();
        if avail < HDR_SIZE {
            return Err(PacketError::RxTooSmall(avail));
        }
        Ok(Self { writer })
    }

    /// How many payload bytes fit after the header.
    pub fn data_capacity(&self) -> usize {
        self.writer.available_bytes() - HDR_SIZE
    }

    /// Writes the packet; returns the number of bytes written (the used
    /// length). `data.len()` must not exceed [`Self::data_capacity`] and
    /// must equal `hdr.len`.
    pub fn write(mut self, hdr: &VsockHeader, data: &[u8]) -> Result<u32, PacketError> {
        self.writer
            .write_all(&hdr.to_bytes())
            .map_err(PacketError::Io)?;
        self.writer.write_all(data).map_err(PacketError::Io)?;
        // HDR_SIZE + MAX_PKT_DATA fits in u32.
        Ok((HDR_SIZE + data.len()) as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_header_roundtrip_bytes_equal() {
        let hdr = VsockHeader {
            src_cid: 2,
            dst_cid: 3,
            src_port: 0x1234_5678,
            dst_port: 99,
            len: 7,
            type_: TYPE_STREAM,
            op: OP_RW,
            flags: SHUTDOWN_SEND,
            buf_alloc: 1 << 18,
            fwd_cnt: 0xdead_beef,
        };
        let bytes = hdr.to_bytes();
        assert_eq!(VsockHeader::from_bytes(&bytes), hdr);
        assert_eq!(&bytes[28..30], &[1, 0]);
        assert_eq!(&bytes[30..32], &[5, 0]);
    }
}
