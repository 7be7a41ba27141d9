//! `memtouch` micro guest: prints `READY`, then serves line commands on COM1:
//!
//! * `touch <MiB> [seed]` writes the region, replies `TOUCHED <MiB> SUM <hex16>`
//! * `sum <MiB>` replies `SUM <hex16>` without writing
//! * `ping` replies `PONG`
//! * `notick` stops the timer tick, replies `NOTICK`: from then on the
//!   guest wakes only when a byte arrives (the VMM must raise the serial
//!   IRQ, as tine's does), so a thousand idle copies cost no CPU
//! * `reset` asks the i8042 to reset the CPU (the VMM then exits cleanly)
//! * anything else replies `ERR <reason>`
//!
//! The region starts at 16 MiB. Pattern: the u64 at physical address `a`
//! becomes `(a ^ seed) * 0x9e3779b97f4a7c15` (wrapping). Checksum: 64-bit
//! FNV-1a over the region's bytes in ascending address order.
#![no_std]
#![no_main]

mod rt;

/// Fallback poll period when the VMM raises no serial IRQ. Each wake-up
/// costs ~0.3 ms of host CPU on kvm_pvm (trap-emulated `in`/`hlt`), so a
/// 50 ms tick keeps an idle guest under 1% of a core.
const TICK_US: u64 = 50_000;
const LINE_MAX: usize = 128;

static mut ZERO_PAGE: u64 = 0;

#[no_mangle]
extern "C" fn guest_main(zero_page: u64) -> ! {
    // READY was printed by _start (rt.rs), before leaving ring 0.
    // SAFETY: single-threaded guest; written once before any reader.
    unsafe { ZERO_PAGE = zero_page };
    rt::init_interrupts();
    rt::enable_serial_irq();
    rt::start_timer(TICK_US);

    let mut line = [0u8; LINE_MAX];
    let mut len = 0usize;
    let mut overflow = false;
    loop {
        let seen = rt::events();
        while let Some(b) = rt::getc() {
            match b {
                b'\n' | b'\r' => {
                    if overflow {
                        rt::puts(b"ERR line too long\n");
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

fn command(line: &[u8]) {
    let mut words = line.split(|&b| b == b' ').filter(|w| !w.is_empty());
    let cmd = words.next().unwrap_or(b"");
    let arg1 = words.next();
    let arg2 = words.next();
    if words.next().is_some() {
        return err(b"too many arguments");
    }
    match cmd {
        b"ping" if arg1.is_none() => rt::puts(b"PONG\n"),
        b"notick" if arg1.is_none() => {
            rt::stop_timer();
            rt::puts(b"NOTICK\n");
        }
        // 0xfe on the i8042 command port pulses the CPU reset line.
        b"reset" if arg1.is_none() => rt::outb(0x64, 0xfe),
        b"touch" => {
            let Some(mib) = arg1.and_then(rt::parse_u64) else {
                return err(b"usage: touch <MiB> [seed]");
            };
            let seed = match arg2 {
                None => 0,
                Some(s) => match rt::parse_u64(s) {
                    Some(v) => v,
                    None => return err(b"bad seed"),
                },
            };
            let Some(end) = region(mib) else { return };
            let mut a = rt::REGION_BASE;
            while a < end {
                // SAFETY: the region is RAM (checked against e820), mapped.
                unsafe { core::ptr::write_volatile(a as *mut u64, pattern(a, seed)) };
                a += 8;
            }
            rt::puts(b"TOUCHED ");
            rt::put_dec(mib);
            rt::puts(b" SUM ");
            rt::put_hex16(checksum(end));
            rt::puts(b"\n");
        }
        b"sum" if arg2.is_none() => {
            let Some(mib) = arg1.and_then(rt::parse_u64) else {
                return err(b"usage: sum <MiB>");
            };
            let Some(end) = region(mib) else { return };
            rt::puts(b"SUM ");
            rt::put_hex16(checksum(end));
            rt::puts(b"\n");
        }
        _ => err(b"unknown command (touch <MiB> [seed] | sum <MiB> | ping | notick | reset)"),
    }
}

fn region(mib: u64) -> Option<u64> {
    // SAFETY: written once at start.
    let zp = unsafe { ZERO_PAGE };
    match rt::region_end(zp, mib) {
        Ok(end) => Some(end),
        Err(max) => {
            rt::put_region_err(mib, max);
            None
        }
    }
}

fn pattern(addr: u64, seed: u64) -> u64 {
    (addr ^ seed).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// FNV-1a (64-bit) over the bytes of `[REGION_BASE, end)`.
fn checksum(end: u64) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut a = rt::REGION_BASE;
    while a < end {
        // SAFETY: the region is RAM (checked against e820), mapped.
        let w = unsafe { core::ptr::read_volatile(a as *const u64) };
        for byte in w.to_le_bytes() {
            h = (h ^ byte as u64).wrapping_mul(0x100_0000_01b3);
        }
        a += 8;
    }
    h
}

fn err(why: &[u8]) {
    rt::puts(b"ERR ");
    rt::puts(why);
    rt::puts(b"\n");
}
