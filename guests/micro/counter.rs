//! `counter` micro guest: prints `READY`, fills `mib=N` MiB (default 32) of
//! memory at 16 MiB with a pattern (each u64 holds its own physical address),
//! prints `WROTE <N>`, then `CNT <n>` on every 100 ms LAPIC timer tick
//! (n = ticks taken so far; every value is printed once, in order).
#![no_std]
#![no_main]

mod rt;

const DEFAULT_MIB: u64 = 32;
const TICK_US: u64 = 100_000;

#[no_mangle]
extern "C" fn guest_main(zero_page: u64) -> ! {
    // READY was printed by _start (rt.rs), before leaving ring 0.
    rt::init_interrupts();

    let mib = match rt::cmdline_value(zero_page, b"mib=") {
        None => DEFAULT_MIB,
        Some((val, len)) => match rt::parse_u64(&val[..len]) {
            Some(v) => v,
            None => fail(b"bad mib= value"),
        },
    };
    let end = match rt::region_end(zero_page, mib) {
        Ok(end) => end,
        Err(max) => {
            rt::put_region_err(mib, max);
            rt::halt()
        }
    };
    let mut addr = rt::REGION_BASE;
    while addr < end {
        // SAFETY: [REGION_BASE, end) is RAM (e820), mapped, and not the image.
        unsafe { core::ptr::write_volatile(addr as *mut u64, addr) };
        addr += 8;
    }
    rt::puts(b"WROTE ");
    rt::put_dec(mib);
    rt::puts(b"\n");

    rt::start_timer(TICK_US);
    let mut printed = rt::ticks();
    loop {
        let seen = rt::events();
        let now = rt::ticks();
        // One line per tick, even if two ticks arrived before we got here.
        while printed < now {
            printed += 1;
            rt::puts(b"CNT ");
            rt::put_dec(printed);
            rt::puts(b"\n");
        }
        rt::wait(seen);
    }
}

fn fail(why: &[u8]) -> ! {
    rt::puts(b"ERR ");
    rt::puts(why);
    rt::puts(b"\n");
    rt::halt()
}
