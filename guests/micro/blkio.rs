//! `blkio` micro guest: drives the first virtio-blk device (virtio-mmio
//! slot 0 at 0xd000_0000) by polling, and serves line commands on COM1:
//!
//! * `write <block> [seed]` writes 4 KiB block `<block>` with the pattern,
//!   replies `WROTE <block> SUM <hex16>` (or `ERR io <status>`)
//! * `read <block>` replies `READ <block> SUM <hex16>`
//! * `flush` replies `FLUSHED`
//! * `ping` replies `PONG`
//! * `flood <seconds>` attacks the host for that long (issue 16's flood
//!   test): console lines as fast as the UART takes them, queue notifies
//!   over an avail index far past the ring, writes to read-only and
//!   unknown transport registers; replies `FLOODED <rounds>`. The disk's
//!   queue is broken afterwards.
//!
//! After `READY` it prints `DISK <sectors>` (or `NODISK`). Pattern: the
//! u64 at byte `o` of the disk becomes `(o ^ seed) * 0x9e3779b97f4a7c15`
//! (wrapping, little-endian); checksum: 64-bit FNV-1a of the block, so the
//! host can compute both (see guests/README.md).
#![no_std]
#![no_main]

mod rt;

use core::sync::atomic::{fence, Ordering};

const TICK_US: u64 = 50_000;
const LINE_MAX: usize = 128;

const MMIO: u64 = 0xd000_0000;
const QSIZE: usize = 4;
const BLOCK: usize = 4096;

/// Split virtqueue, header, data and status, in one page-aligned static
/// (identity mapped: its address is its guest-physical address).
#[repr(C, align(4096))]
struct Ring {
    desc: [[u64; 2]; QSIZE],
    avail: [u16; 2 + QSIZE + 1],
    _pad: [u8; 4096 - 16 * QSIZE - 2 * (3 + QSIZE)],
    used: [u32; 1 + 2 * QSIZE + 1],
    _pad2: [u8; 4096 - 4 * (2 + 2 * QSIZE)],
    header: [u64; 2],
    status: u64,
    _pad3: [u8; 4096 - 24],
    data: [u8; BLOCK],
}

static mut RING: Ring = Ring {
    desc: [[0; 2]; QSIZE],
    avail: [0; 2 + QSIZE + 1],
    _pad: [0; 4096 - 16 * QSIZE - 2 * (3 + QSIZE)],
    used: [0; 1 + 2 * QSIZE + 1],
    _pad2: [0; 4096 - 4 * (2 + 2 * QSIZE)],
    header: [0; 2],
    status: 0,
    _pad3: [0; 4096 - 24],
    data: [0; BLOCK],
};

static mut READY: bool = false;
static mut NEXT_AVAIL: u16 = 0;

fn reg(off: u64) -> u32 {
    // SAFETY: a virtio-mmio register of slot 0, identity mapped.
    unsafe { core::ptr::read_volatile((MMIO + off) as *const u32) }
}

fn set(off: u64, v: u32) {
    rt::mmio_write(MMIO + off, v);
}

fn ring() -> *mut Ring {
    &raw mut RING
}

#[no_mangle]
extern "C" fn guest_main(_zero_page: u64) -> ! {
    rt::init_interrupts();
    rt::enable_serial_irq();
    rt::start_timer(TICK_US);
    init_disk();

    let mut line = [0u8; LINE_MAX];
    let mut len = 0usize;
    let mut overflow = false;
    loop {
        let seen = rt::events();
        while let Some(b) = rt::getc() {
            match b {
                b'\n' | b'\r' => {
                    if overflow {
                        err(b"line too long");
                    } else if len > 0 {
                        command(&line[..len]);
                    }
                    len = 0;
                    overflow = false;
                }
                _ if len < LINE_MAX => {
                    line[len] = b;
                    len += 1;
                }
                _ => overflow = true,
            }
        }
        rt::wait(seen);
    }
}

/// virtio 1.x over MMIO: reset, ACK, DRIVER, VERSION_1 only, FEATURES_OK,
/// one queue of QSIZE, DRIVER_OK. No interrupts are routed: completions
/// are polled.
fn init_disk() {
    if reg(0) != 0x7472_6976 || reg(4) != 2 || reg(8) != 2 {
        rt::puts(b"NODISK\n");
        return;
    }
    set(0x70, 0);
    set(0x70, 1 | 2);
    set(0x24, 0);
    set(0x20, 0);
    set(0x24, 1);
    set(0x20, 1); // VIRTIO_F_VERSION_1 (bit 32)
    set(0x70, 1 | 2 | 8);
    if reg(0x70) & 8 == 0 {
        rt::puts(b"NODISK features refused\n");
        return;
    }
    set(0x30, 0);
    if (reg(0x34) as usize) < QSIZE {
        rt::puts(b"NODISK queue too small\n");
        return;
    }
    set(0x38, QSIZE as u32);
    let r = ring();
    // SAFETY: taking field addresses of the static ring, not references.
    let (desc, avail, used) = unsafe {
        (
            &raw const (*r).desc as u64,
            &raw const (*r).avail as u64,
            &raw const (*r).used as u64,
        )
    };
    set(0x80, desc as u32);
    set(0x84, (desc >> 32) as u32);
    set(0x90, avail as u32);
    set(0x94, (avail >> 32) as u32);
    set(0xa0, used as u32);
    set(0xa4, (used >> 32) as u32);
    set(0x44, 1);
    set(0x70, 1 | 2 | 8 | 4);
    // SAFETY: single-threaded guest.
    unsafe { READY = true };
    let sectors = u64::from(reg(0x100)) | (u64::from(reg(0x104)) << 32);
    rt::puts(b"DISK ");
    rt::put_dec(sectors);
    rt::puts(b"\n");
}

/// One request: header, optional 4 KiB data (device-writable for reads),
/// status. Returns the status byte (0 = OK).
fn request(kind: u64, sector: u64, data_in: Option<bool>) -> u8 {
    let r = ring();
    // SAFETY: single-threaded guest; the device reads these only after the
    // notify below and writes only the status, data (reads) and used ring.
    unsafe {
        (*r).header = [kind, sector];
        (*r).status = 0xff;
        let hdr = &raw const (*r).header as u64;
        let st = &raw const (*r).status as u64;
        let data = &raw const (*r).data as u64;
        // desc: addr, then len | flags << 32 | next << 48.
        (*r).desc[0] = [hdr, 16 | (1 << 32) | (1 << 48)];
        let next = match data_in {
            None => 1,
            Some(write_flag) => {
                let flags = 1 | if write_flag { 2 } else { 0 };
                (*r).desc[1] = [data, BLOCK as u64 | (flags << 32) | (2 << 48)];
                2
            }
        };
        (*r).desc[next] = [st, 1 | (2 << 32)];
        let idx = NEXT_AVAIL;
        let avail = &raw mut (*r).avail as *mut u16;
        core::ptr::write_volatile(avail.add(2 + (idx as usize % QSIZE)), 0);
        fence(Ordering::SeqCst);
        NEXT_AVAIL = idx.wrapping_add(1);
        core::ptr::write_volatile(avail.add(1), NEXT_AVAIL);
        fence(Ordering::SeqCst);
        set(0x50, 0);
        let used_idx = (&raw const (*r).used as *const u16).add(1);
        while core::ptr::read_volatile(used_idx) != NEXT_AVAIL {
            core::hint::spin_loop();
        }
        fence(Ordering::SeqCst);
        core::ptr::read_volatile(&raw const (*r).status) as u8
    }
}

fn command(line: &[u8]) {
    let mut words = line.split(|&b| b == b' ').filter(|w| !w.is_empty());
    let cmd = words.next().unwrap_or(b"");
    let arg1 = words.next();
    let arg2 = words.next();
    if words.next().is_some() {
        return err(b"too many arguments");
    }
    if cmd == b"ping" && arg1.is_none() {
        return rt::puts(b"PONG\n");
    }
    // SAFETY: single-threaded guest.
    if !unsafe { READY } {
        return err(b"no disk");
    }
    match cmd {
        b"flood" if arg2.is_none() => {
            let Some(secs) = arg1.and_then(rt::parse_u64) else {
                return err(b"usage: flood <seconds>");
            };
            flood(secs);
        }
        b"write" => {
            let Some(block) = arg1.and_then(rt::parse_u64) else {
                return err(b"usage: write <block> [seed]");
            };
            let seed = match arg2.map(rt::parse_u64) {
                None => 0,
                Some(Some(s)) => s,
                Some(None) => return err(b"bad seed"),
            };
            let base = block * BLOCK as u64;
            // SAFETY: the data buffer is idle between requests.
            let data = unsafe { &mut (*ring()).data };
            for (i, w) in data.chunks_exact_mut(8).enumerate() {
                let o = base + 8 * i as u64;
                w.copy_from_slice(&(o ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
            }
            let sum = checksum(data);
            match request(1, block * 8, Some(false)) {
                0 => {
                    rt::puts(b"WROTE ");
                    rt::put_dec(block);
                    rt::puts(b" SUM ");
                    rt::put_hex16(sum);
                    rt::puts(b"\n");
                }
                s => io_err(s),
            }
        }
        b"read" if arg2.is_none() => {
            let Some(block) = arg1.and_then(rt::parse_u64) else {
                return err(b"usage: read <block>");
            };
            match request(0, block * 8, Some(true)) {
                0 => {
                    // SAFETY: the request completed; the buffer is idle.
                    let sum = checksum(unsafe { &(*ring()).data });
                    rt::puts(b"READ ");
                    rt::put_dec(block);
                    rt::puts(b" SUM ");
                    rt::put_hex16(sum);
                    rt::puts(b"\n");
                }
                s => io_err(s),
            }
        }
        b"flush" if arg1.is_none() => match request(4, 0, None) {
            0 => rt::puts(b"FLUSHED\n"),
            s => io_err(s),
        },
        _ => err(b"unknown command (write <block> [seed] | read <block> | flush | ping)"),
    }
}

fn flood(secs: u64) {
    let end = rt::ticks() + secs * 1_000_000 / TICK_US;
    let r = ring();
    let mut rounds = 0u64;
    while rt::ticks() < end {
        // SAFETY: single-threaded guest; the device reads the ring only
        // on the notify below, and finds the index broken.
        unsafe {
            let avail = &raw mut (*r).avail as *mut u16;
            core::ptr::write_volatile(avail.add(1), NEXT_AVAIL.wrapping_add(0x8000));
        }
        fence(Ordering::SeqCst);
        for _ in 0..64 {
            set(0x50, 0);
        }
        // Read-only and unknown registers.
        set(0x00, 0xdead_beef);
        set(0x0fc, 1);
        set(0x50, 77);
        for _ in 0..16 {
            rt::puts(b"FLOOD the host's disk with this console line, again and again\n");
        }
        rounds += 1;
    }
    rt::puts(b"FLOODED ");
    rt::put_dec(rounds);
    rt::puts(b"\n");
}

fn checksum(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h
}

fn io_err(status: u8) {
    rt::puts(b"ERR io ");
    rt::put_dec(status as u64);
    rt::puts(b"\n");
}

fn err(why: &[u8]) {
    rt::puts(b"ERR ");
    rt::puts(why);
    rt::puts(b"\n");
}
