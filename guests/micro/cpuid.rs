//! `cpuid` micro guest: prints `READY`, then serves line commands on COM1:
//!
//! * `cpuid <leaf> [subleaf]` executes CPUID at CPL3 and replies
//!   `CPUID <leaf> <subleaf> <eax> <ebx> <ecx> <edx>` (decimal leaf and
//!   subleaf as given, registers as 16 hex digits), so the host can compare
//!   what the guest sees with its CPU template
//! * `ping` replies `PONG`
//! * anything else replies `ERR <reason>`
#![no_std]
#![no_main]

mod rt;

const TICK_US: u64 = 50_000;
const LINE_MAX: usize = 64;

#[no_mangle]
extern "C" fn guest_main(_zero_page: u64) -> ! {
    // READY was printed by _start (rt.rs), before leaving ring 0.
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
        b"cpuid" => {
            let Some(leaf) = arg1.and_then(rt::parse_u64).filter(|&v| v <= u32::MAX as u64) else {
                return err(b"usage: cpuid <leaf> [subleaf]");
            };
            let sub = match arg2 {
                None => 0,
                Some(s) => match rt::parse_u64(s).filter(|&v| v <= u32::MAX as u64) {
                    Some(v) => v,
                    None => return err(b"bad subleaf"),
                },
            };
            // CPUID is unprivileged; under KVM it exits (or faults, with
            // CPUID faulting) and the hypervisor answers from the vCPU's
            // CPUID table.
            #[allow(unused_unsafe)]
            // SAFETY: CPUID has no side effects beyond the output registers.
            let r = unsafe { core::arch::x86_64::__cpuid_count(leaf as u32, sub as u32) };
            rt::puts(b"CPUID ");
            rt::put_dec(leaf);
            rt::puts(b" ");
            rt::put_dec(sub);
            for v in [r.eax, r.ebx, r.ecx, r.edx] {
                rt::puts(b" ");
                rt::put_hex16(v as u64);
            }
            rt::puts(b"\n");
        }
        _ => err(b"unknown command (cpuid <leaf> [subleaf] | ping)"),
    }
}

fn err(why: &[u8]) {
    rt::puts(b"ERR ");
    rt::puts(why);
    rt::puts(b"\n");
}
