//! One virtio-blk request: parse the header, move the data, write the
//! status byte last.
//!
//! With VIRTIO_F_VERSION_1 the driver may frame a request any way it likes
//! (ANY_LAYOUT), so the request is read as byte streams: the 16-byte header
//! and OUT data from the readable buffers, IN data and the status byte
//! (the last writable byte) into the writable ones.

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES,
};

use super::SECTOR_SIZE;
use crate::devices::virtio::queue::{ChainBuffers, GuestWarnings};
use crate::memory::GuestMemoryMmap;

/// Size of struct virtio_blk_outhdr (type, reserved, sector).
const HEADER_LEN: usize = 16;
/// Bounce buffer size: data moves between the file and guest memory in
/// pieces of at most this size, whatever the request length.
const CHUNK: usize = 128 * 1024;
const DEV: &str = "virtio-blk";
/// Largest range one DISCARD or WRITE_ZEROES segment may cover (1 GiB).
pub(super) const MAX_DISCARD_SECTORS: u32 = 1 << 21;
/// Most segments in one DISCARD or WRITE_ZEROES request.
pub(super) const MAX_DISCARD_SEGMENTS: u32 = 64;
/// struct virtio_blk_discard_write_zeroes: sector, num_sectors, flags.
const SEGMENT_LEN: usize = 16;
/// The only flag: the device may unmap while zeroing.
const WRITE_ZEROES_FLAG_UNMAP: u32 = 1;

/// The disk image and what the guest may do with it.
pub(super) struct Disk {
    pub image: disk::Disk,
    pub nsectors: u64,
    pub read_only: bool,
    pub id: [u8; 20],
    pub buf: Vec<u8>,
}

/// Why a request failed: the status byte to return.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    IoErr,
    Unsupp,
}

impl Status {
    fn byte(self) -> u8 {
        match self {
            Status::IoErr => VIRTIO_BLK_S_IOERR as u8,
            Status::Unsupp => VIRTIO_BLK_S_UNSUPP as u8,
        }
    }
}

/// Executes the request in `bufs`; returns the number of bytes written to
/// the chain (data and status), for the used ring. 0 means the chain had
/// no usable status byte: nothing could be reported.
pub(super) fn execute(
    disk: &mut Disk,
    mem: &GuestMemoryMmap,
    bufs: &ChainBuffers,
    warnings: &mut GuestWarnings,
) -> u32 {
    let writable = bufs.writable_len();
    if writable == 0 {
        warnings.warn(
            DEV,
            format_args!("request {} has no status byte", bufs.head_index),
        );
        return 0;
    }
    let status_offset = writable - 1;
    let (status, data_written) = match run(disk, mem, bufs, status_offset) {
        Ok(n) => (VIRTIO_BLK_S_OK as u8, n),
        Err((status, why)) => {
            warnings.warn(
                DEV,
                format_args!("request {} failed: {why}", bufs.head_index),
            );
            (status.byte(), 0)
        }
    };
    match bufs.write_at(mem, status_offset, &[status]) {
        Ok(1) => u32::try_from(data_written + 1).unwrap_or(u32::MAX),
        _ => {
            warnings.warn(
                DEV,
                format_args!(
                    "request {}: status byte outside guest memory",
                    bufs.head_index
                ),
            );
            0
        }
    }
}

type Failure = (Status, String);

fn ioerr(why: impl Into<String>) -> Failure {
    (Status::IoErr, why.into())
}

/// Runs the request; returns the data bytes written into the chain.
fn run(
    disk: &mut Disk,
    mem: &GuestMemoryMmap,
    bufs: &ChainBuffers,
    status_offset: usize,
) -> Result<usize, Failure> {
    let mut header = [0u8; HEADER_LEN];
    match bufs.read_at(mem, 0, &mut header) {
        Ok(HEADER_LEN) => {}
        Ok(n) => return Err(ioerr(format!("header is {n} bytes, need {HEADER_LEN}"))),
        Err(e) => return Err(ioerr(e.to_string())),
    }
    let kind = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let mut sector = [0u8; 8];
    sector.copy_from_slice(&header[8..16]);
    let sector = u64::from_le_bytes(sector);

    match kind {
        VIRTIO_BLK_T_IN => {
            let len = status_offset;
            let offset = check_range(disk, sector, len)?;
            copy_in(disk, mem, bufs, offset, len)?;
            Ok(len)
        }
        VIRTIO_BLK_T_OUT => {
            if disk.read_only {
                return Err(ioerr("write to a read-only disk"));
            }
            let len = bufs.readable_len() - HEADER_LEN;
            let offset = check_range(disk, sector, len)?;
            copy_out(disk, mem, bufs, offset, len)?;
            Ok(0)
        }
        VIRTIO_BLK_T_FLUSH => {
            if !disk.read_only {
                disk.image
                    .flush()
                    .map_err(|e| ioerr(format!("flush: {e}")))?;
            }
            Ok(0)
        }
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            if disk.read_only {
                return Err(ioerr("discard or write-zeroes on a read-only disk"));
            }
            discard_or_zero(disk, mem, bufs, kind == VIRTIO_BLK_T_WRITE_ZEROES)?;
            Ok(0)
        }
        VIRTIO_BLK_T_GET_ID => {
            let n = status_offset.min(disk.id.len());
            match bufs.write_at(mem, 0, &disk.id[..n]) {
                Ok(w) if w == n => Ok(n),
                _ => Err(ioerr("id buffer outside guest memory")),
            }
        }
        other => Err((Status::Unsupp, format!("unsupported request type {other}"))),
    }
}

/// Checks that `len` bytes from `sector` are whole sectors on the disk;
/// returns the byte offset.
fn check_range(disk: &Disk, sector: u64, len: usize) -> Result<u64, Failure> {
    let len = len as u64;
    if len % SECTOR_SIZE != 0 {
        return Err(ioerr(format!("length {len} is not a multiple of 512")));
    }
    let end = sector.checked_add(len / SECTOR_SIZE);
    match end {
        Some(end) if end <= disk.nsectors => Ok(sector * SECTOR_SIZE),
        _ => Err(ioerr(format!(
            "sectors {sector}+{} beyond the disk's {}",
            len / SECTOR_SIZE,
            disk.nsectors
        ))),
    }
}

/// DISCARD or WRITE_ZEROES: the segments follow the header in the
/// readable buffers; each is checked before any is applied.
fn discard_or_zero(
    disk: &mut Disk,
    mem: &GuestMemoryMmap,
    bufs: &ChainBuffers,
    zero: bool,
) -> Result<(), Failure> {
    let len = bufs.readable_len() - HEADER_LEN;
    if len == 0 || len % SEGMENT_LEN != 0 || len / SEGMENT_LEN > MAX_DISCARD_SEGMENTS as usize {
        return Err(ioerr(format!("{len} bytes of discard segments")));
    }
    let mut raw = vec![0u8; len];
    match bufs.read_at(mem, HEADER_LEN, &mut raw) {
        Ok(n) if n == len => {}
        _ => return Err(ioerr("discard segments outside guest memory")),
    }
    let mut ranges = Vec::with_capacity(len / SEGMENT_LEN);
    for seg in raw.chunks_exact(SEGMENT_LEN) {
        let mut sector = [0u8; 8];
        sector.copy_from_slice(&seg[0..8]);
        let sector = u64::from_le_bytes(sector);
        let num = u32::from_le_bytes([seg[8], seg[9], seg[10], seg[11]]);
        let flags = u32::from_le_bytes([seg[12], seg[13], seg[14], seg[15]]);
        let allowed = if zero { WRITE_ZEROES_FLAG_UNMAP } else { 0 };
        if flags & !allowed != 0 || num > MAX_DISCARD_SECTORS {
            return Err((
                Status::Unsupp,
                format!("discard segment flags {flags:#x}, {num} sectors"),
            ));
        }
        let bytes = u64::from(num) * SECTOR_SIZE;
        let offset = check_range(disk, sector, bytes as usize)?;
        ranges.push((offset, bytes));
    }
    for (offset, bytes) in ranges {
        let r = if zero {
            disk.image.write_zeroes(offset, bytes)
        } else {
            disk.image.discard(offset, bytes)
        };
        r.map_err(|e| {
            ioerr(format!(
                "{}: {e}",
                if zero { "write zeroes" } else { "discard" }
            ))
        })?;
    }
    Ok(())
}

/// Image → guest (IN).
fn copy_in(
    disk: &mut Disk,
    mem: &GuestMemoryMmap,
    bufs: &ChainBuffers,
    offset: u64,
    len: usize,
) -> Result<(), Failure> {
    let mut done = 0;
    while done < len {
        let n = (len - done).min(CHUNK);
        disk.buf.resize(n, 0);
        disk.image
            .read_at(&mut disk.buf[..n], offset + done as u64)
            .map_err(|e| ioerr(format!("read: {e}")))?;
        match bufs.write_at(mem, done, &disk.buf[..n]) {
            Ok(w) if w == n => {}
            _ => return Err(ioerr("data buffer outside guest memory")),
        }
        done += n;
    }
    Ok(())
}

/// Guest → image (OUT).
fn copy_out(
    disk: &mut Disk,
    mem: &GuestMemoryMmap,
    bufs: &ChainBuffers,
    offset: u64,
    len: usize,
) -> Result<(), Failure> {
    let mut done = 0;
    while done < len {
        let n = (len - done).min(CHUNK);
        disk.buf.resize(n, 0);
        match bufs.read_at(mem, HEADER_LEN + done, &mut disk.buf[..n]) {
            Ok(r) if r == n => {}
            _ => return Err(ioerr("data buffer outside guest memory")),
        }
        disk.image
            .write_at(&disk.buf[..n], offset + done as u64)
            .map_err(|e| ioerr(format!("write: {e}")))?;
        done += n;
    }
    Ok(())
}
