//! Runtime shared by the micro guests: the ring-0 shim (assembly) and the
//! CPL3 helpers (serial port, LAPIC/IOAPIC, boot_params, waiting).
//!
//! Ring-0 code is emulated instruction by instruction on kvm_pvm, so the CPL0
//! part is about 30 instructions: print `READY`, load our GDT/IDT/TSS,
//! enable SSE in CR4, switch to our page tables (everything
//! user-accessible), mask the legacy PIC and LAPIC LINT0, and `iretq` to
//! CPL3 with IOPL=3 and IF=1.
//!
//! What kvm_pvm does at CPL3 (measured): IOPL is ignored (`out` raises #GP),
//! `int n` raises #UD, and `syscall` jumps to LSTAR without leaving CPL3.
//! Exceptions and interrupts are delivered to ring 0 properly. So the #GP
//! handler emulates the three privileged one-byte instructions the guests
//! use: `out %al,%dx`, `in %dx,%al` and `hlt` (wait for an interrupt; see
//! [`wait`]). On hardware KVM, IOPL=3 makes port I/O native and only `hlt`
//! traps. The LAPIC and IOAPIC are programmed from CPL3 through MMIO.
//! Exceptions and unexpected vectors are bounced to a CPL3 routine that
//! prints `PANIC <vector> <rip>` and halts.
//!
//! Fixed layout (see link.ld): image at 1 MiB, interrupt stubs at 0x101000
//! (16 bytes per vector), TSS at 0x102000.

#![allow(dead_code)] // each guest uses a subset

use core::arch::{asm, global_asm};

global_asm!(
    r#"
    .equ STUBS, 0x101000
    .equ TSS_ADDR, 0x102000
    .equ KERNEL_CS, 0x08
    .equ USER_DS, 0x1b
    .equ USER_CS, 0x23
    .equ TSS_SEL, 0x28
    .equ LAPIC_EOI, 0xfee000b0
    .equ LAPIC_LINT0, 0xfee00350
    /* IF set, IOPL=3 (honoured by hardware KVM; kvm_pvm ignores it and
       gp_isr emulates the port access). Nothing interrupts before the CPL3
       code enables the LAPIC: the PIC and LINT0 are masked in _start and
       the IOAPIC pins are masked at reset. */
    .equ USER_RFLAGS, 0x3202

    /* ---------------------------------------------------------------- */
    .section .boot.entry, "awx"
    .code64
    .global _start
_start:
    /* READY first: boot time to READY is what VMM benchmarks measure, and
       every instruction from here to CPL3 is emulated on kvm_pvm (READY
       from CPL3 would come ~1 ms later). */
    movw $0x3f8, %dx
    movb $'R', %al
    outb %al, %dx
    movb $'E', %al
    outb %al, %dx
    movb $'A', %al
    outb %al, %dx
    movb $'D', %al
    outb %al, %dx
    movb $'Y', %al
    outb %al, %dx
    movb $'\n', %al
    outb %al, %dx
    lgdt gdt_ptr(%rip)
    lidt idt_ptr(%rip)
    movw $TSS_SEL, %ax
    ltr %ax
    clts                        /* CR0.TS off: SSE must not trap */
    movq %cr4, %rax
    orl $0x600, %eax            /* OSFXSR | OSXMMEXCPT: SSE at CPL3 */
    andl $~0x300000, %eax       /* no SMEP/SMAP: all pages are user pages */
    movq %rax, %cr4
    leaq pml4(%rip), %rax
    movq %rax, %cr3
    movb $0xff, %al             /* mask the legacy PIC */
    outb %al, $0x21
    outb %al, $0xa1
    movl $LAPIC_LINT0, %eax     /* mask LAPIC LINT0 (ExtINT) */
    movl $0x10000, (%rax)
    leaq iret_frame(%rip), %rsp
    iretq                       /* to user_entry at CPL3; RSI still = zero page */

    .section .boot, "awx"
user_entry:
    movq %rsi, %rdi
    call guest_main
    ud2

user_panic_entry:               /* rdi = vector, rsi = rip */
    call guest_panic
    ud2

    /* Referenced by the prebuilt libcore's unwind tables; never called
       (panic=abort). */
    .global rust_eh_personality
rust_eh_personality:
    ud2

    /* Interrupt handlers (CPL0). Keep them short: emulated on kvm_pvm. */
timer_isr:
    incq TINE_TICKS(%rip)
serial_isr:
    incq TINE_EVENTS(%rip)
    pushq %rax
    movl $LAPIC_EOI, %eax
    movl $0, (%rax)
    popq %rax
    iretq

    /* #GP: kvm_pvm ignores IOPL, so `out %al,%dx` and `in %dx,%al` at CPL3
       trap here; emulate them. `hlt` at CPL3 always traps: emulate it as
       "wait for an interrupt unless TINE_EVENTS != %rdi", or halt forever
       when %rdi == -1. Anything else is a real #GP.
       Stack: error code, rip, cs, rflags, rsp, ss. */
gp_isr:
    pushq %rsi
    movq 16(%rsp), %rsi
    movzbl (%rsi), %esi
    cmpl $0xee, %esi
    je gp_out
    cmpl $0xec, %esi
    je gp_in
    cmpl $0xf4, %esi
    je gp_hlt
    popq %rsi
    pushq $13
    jmp exc_common
gp_out:
    popq %rsi
    outb %al, %dx
    jmp gp_done
gp_in:
    popq %rsi
    inb %dx, %al
    jmp gp_done
gp_hlt:
    popq %rsi
    cmpq $-1, %rdi
    je halt_forever
    cmpq %rdi, TINE_EVENTS(%rip)
    jne gp_done
    sti
    hlt                         /* sti shadow: no wake-up is lost */
gp_done:
    incq 8(%rsp)                /* all three instructions are one byte */
    addq $8, %rsp
    iretq
halt_forever:
    cli
1:  hlt
    jmp 1b

    /* Exceptions and unexpected vectors: stack = vector, error code, rip, ... */
exc_common:
    movq (%rsp), %rdi
    movq 16(%rsp), %rsi
    leaq panic_frame(%rip), %rsp
    iretq                       /* to user_panic_entry at CPL3 */

    /* ---------------------------------------------------------------- */
    /* One 16-byte stub per vector at STUBS + 16 * vector. */
    .section .stubs, "awx"
    .set vec, 0
    .rept 256
    .balign 16
    .if vec == 13
    jmp gp_isr
    .elseif vec == 0x20
    jmp timer_isr
    .elseif vec == 0x24
    jmp serial_isr
    .elseif vec == 0xff
    iretq                       /* LAPIC spurious vector: no EOI */
    .else
    .if (vec == 8) || (vec == 10) || (vec == 11) || (vec == 12) || (vec == 13) || (vec == 14) || (vec == 17) || (vec == 21) || (vec == 29) || (vec == 30)
    .else
    pushq $0                    /* no error code: keep the frame uniform */
    .endif
    pushq $vec
    jmp exc_common
    .endif
    .set vec, vec + 1
    .endr

    /* ---------------------------------------------------------------- */
    .section .sys, "aw"
    /* TSS (must be first: TSS_ADDR). */
tss:
    .long 0
    .quad kstack_top            /* RSP0 */
    .quad 0, 0                  /* RSP1, RSP2 */
    .quad 0
    .quad 0, 0, 0, 0, 0, 0, 0   /* IST1..7 */
    .quad 0
    .word 0
    .word 104                   /* no I/O bitmap */

    .balign 16
gdt:
    .quad 0
    .quad 0x00af9a000000ffff    /* 0x08 kernel code64 */
    .quad 0x00cf92000000ffff    /* 0x10 kernel data */
    .quad 0x00cff2000000ffff    /* 0x18 user data (DPL3) */
    .quad 0x00affa000000ffff    /* 0x20 user code64 (DPL3) */
    .word 103                   /* 0x28 TSS, 16 bytes */
    .word TSS_ADDR & 0xffff
    .byte (TSS_ADDR >> 16) & 0xff
    .byte 0x89
    .byte 0
    .byte (TSS_ADDR >> 24) & 0xff
    .long TSS_ADDR >> 32
    .long 0
gdt_end:

    .balign 16
idt:
    .set vec, 0
    .rept 256
    .set addr, STUBS + 16 * vec
    .word addr & 0xffff
    .word KERNEL_CS
    .byte 0
    .byte 0x8e                  /* interrupt gate, DPL0 */
    .word (addr >> 16) & 0xffff
    .long addr >> 32
    .long 0
    .set vec, vec + 1
    .endr
idt_end:

    .balign 8
gdt_ptr:
    .word gdt_end - gdt - 1
    .quad gdt
    .balign 8
idt_ptr:
    .word idt_end - idt - 1
    .quad idt

    .balign 8
iret_frame:
    .quad user_entry, USER_CS, USER_RFLAGS, ustack_top, USER_DS
panic_frame:
    .quad user_panic_entry, USER_CS, USER_RFLAGS, pstack_top, USER_DS

    /* Page tables: first 4 GiB identity mapped with 2 MiB pages, user bit
       set; the IOAPIC (0xfec00000) and LAPIC (0xfee00000) pages uncached. */
    .balign 4096
pml4:
    .quad pdpt + 0x7
    .fill 511, 8, 0
pdpt:
    .quad pd + 0x7, pd + 0x1007, pd + 0x2007, pd + 0x3007
    .fill 508, 8, 0
pd:
    .set i, 0
    .rept 2048
    .if (i == 2038) || (i == 2039)
    .quad (i << 21) | 0x9f      /* P RW US PWT PCD PS */
    .else
    .quad (i << 21) | 0x87      /* P RW US PS */
    .endif
    .set i, i + 1
    .endr

    /* Interrupt counters: guest memory, so forks and restores keep them. */
    .section .data.counters, "aw"
    .balign 8
    .global TINE_TICKS
TINE_TICKS:
    .quad 0
    .global TINE_EVENTS
TINE_EVENTS:
    .quad 0

    .section .bss.stacks, "aw", @nobits
    .balign 16
    .skip 16384
kstack_top:
    .skip 65536
ustack_top:
    .skip 8192
pstack_top:
"#,
    options(att_syntax)
);

extern "C" {
    static TINE_TICKS: u64;
    static TINE_EVENTS: u64;
}

/// Number of LAPIC timer interrupts taken so far.
pub fn ticks() -> u64 {
    // SAFETY: TINE_TICKS is an aligned u64 defined in the assembly above.
    unsafe { core::ptr::read_volatile(&raw const TINE_TICKS) }
}

/// Number of interrupts (timer + serial) taken so far.
pub fn events() -> u64 {
    // SAFETY: TINE_EVENTS is an aligned u64 defined in the assembly above.
    unsafe { core::ptr::read_volatile(&raw const TINE_EVENTS) }
}

/// Sleeps in ring 0 (`sti; hlt`) until an interrupt arrives, unless one
/// already arrived since `seen` was read from [`events`].
pub fn wait(seen: u64) {
    // SAFETY: `hlt` at CPL3 traps to gp_isr, which only reads TINE_EVENTS.
    unsafe { asm!("hlt", in("rdi") seen, options(nomem, nostack)) }
}

/// Halts forever (cli; hlt in ring 0).
pub fn halt() -> ! {
    // SAFETY: `hlt` with rdi = -1 traps to gp_isr and never returns.
    unsafe { asm!("hlt", in("rdi") u64::MAX, options(nomem, nostack, noreturn)) }
}

pub fn outb(port: u16, val: u8) {
    // SAFETY: port I/O to a VMM-emulated device (IOPL=3, or gp_isr emulates).
    unsafe { asm!("out dx, al", in("dx") port, in("al") val, options(nomem, nostack)) }
}

pub fn inb(port: u16) -> u8 {
    let v: u8;
    // SAFETY: as for outb.
    unsafe { asm!("in al, dx", out("al") v, in("dx") port, options(nomem, nostack)) }
    v
}

pub fn mmio_write(addr: u64, val: u32) {
    // SAFETY: addr is a LAPIC/IOAPIC register, identity mapped (uncached).
    unsafe { core::ptr::write_volatile(addr as *mut u32, val) }
}

// ---------------------------------------------------------------------------
// Serial (8250 at COM1)

const COM1: u16 = 0x3f8;

/// Writes bytes to COM1's THR. The LSR is not polled: the VMMs we run under
/// always report THR empty, and every port access is a VM exit.
pub fn puts(s: &[u8]) {
    for &b in s {
        outb(COM1, b);
    }
}

pub fn put_dec(mut v: u64) {
    let mut buf = [0u8; 20];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    puts(&buf[i..]);
}

pub fn put_hex16(v: u64) {
    let mut buf = [0u8; 16];
    for (i, b) in buf.iter_mut().enumerate() {
        let nib = (v >> (60 - 4 * i)) & 0xf;
        *b = b"0123456789abcdef"[nib as usize];
    }
    puts(&buf);
}

/// Returns a received byte if the UART has one (LSR bit 0).
pub fn getc() -> Option<u8> {
    if inb(COM1 + 5) & 1 != 0 {
        Some(inb(COM1))
    } else {
        None
    }
}

/// Asks the UART for an interrupt on received data and routes IRQ 4 through
/// the IOAPIC to vector 0x24 (LAPIC 0). VMMs that do not raise the line are
/// still served by the periodic timer tick.
pub fn enable_serial_irq() {
    outb(COM1 + 1, 0x01); // IER: received data available
    outb(COM1 + 4, 0x0b); // MCR: DTR | RTS | OUT2
    mmio_write(IOAPIC, 0x10 + 2 * 4 + 1);
    mmio_write(IOAPIC + 0x10, 0); // destination APIC id 0
    mmio_write(IOAPIC, 0x10 + 2 * 4);
    mmio_write(IOAPIC + 0x10, 0x24); // fixed, edge, active high, unmasked
}

// ---------------------------------------------------------------------------
// Interrupt controllers

const LAPIC: u64 = 0xfee0_0000;
const IOAPIC: u64 = 0xfec0_0000;

/// Software-enables the LAPIC (spurious vector 0xff). The legacy PIC and
/// LINT0 were masked in ring 0 before entering CPL3.
pub fn init_interrupts() {
    mmio_write(LAPIC + 0xf0, 0x1ff);
}

/// LAPIC timer frequency with divide-by-1: KVM's APIC bus runs at 1 GHz
/// (1 ns per cycle) unless the VMM changes KVM_CAP_X86_APIC_BUS_CYCLES_NS.
const LAPIC_HZ: u64 = 1_000_000_000;

/// Starts the LAPIC timer in periodic mode at vector 0x20.
pub fn start_timer(period_us: u64) {
    let count = (LAPIC_HZ / 1_000_000 * period_us).min(u32::MAX as u64) as u32;
    mmio_write(LAPIC + 0x3e0, 0xb); // divide by 1
    mmio_write(LAPIC + 0x320, 0x2_0020); // periodic, vector 0x20
    mmio_write(LAPIC + 0x380, count);
}

/// Stops the LAPIC timer (initial count 0): the guest then wakes only for
/// the serial IRQ, and an idle guest costs the host nothing.
pub fn stop_timer() {
    mmio_write(LAPIC + 0x380, 0);
}

// ---------------------------------------------------------------------------
// Linux zero page (struct boot_params)

/// Start of the memory region the guests write: 16 MiB, above the image.
pub const REGION_BASE: u64 = 16 << 20;
/// The page tables map the first 4 GiB.
const MAPPED_END: u64 = 4 << 30;

fn rd<T: Copy>(addr: u64) -> T {
    // SAFETY: the zero page and the cmdline lie in identity-mapped low
    // memory written by the VMM; unaligned reads are fine.
    unsafe { core::ptr::read_unaligned(addr as *const T) }
}

/// Finds `key` (e.g. b"mib=") in the kernel command line and returns the
/// bytes of its value (up to the next space).
pub fn cmdline_value(zero_page: u64, key: &[u8]) -> Option<([u8; 32], usize)> {
    let ptr = rd::<u32>(zero_page + 0x228) as u64;
    if ptr == 0 {
        return None;
    }
    let mut line = [0u8; 1024];
    let mut len = 0;
    while len < line.len() {
        let b = rd::<u8>(ptr + len as u64);
        if b == 0 {
            break;
        }
        line[len] = b;
        len += 1;
    }
    for word in line[..len].split(|&b| b == b' ') {
        if let Some(val) = word.strip_prefix(key) {
            let mut out = [0u8; 32];
            let n = val.len().min(out.len());
            out[..n].copy_from_slice(&val[..n]);
            return Some((out, n));
        }
    }
    None
}

/// Checks that `[REGION_BASE, REGION_BASE + mib MiB)` is RAM in one e820
/// entry and mapped by our page tables; returns its end address, or the
/// largest size in MiB that would fit.
pub fn region_end(zero_page: u64, mib: u64) -> Result<u64, u64> {
    let max = max_region_mib(zero_page);
    if mib > max {
        return Err(max);
    }
    Ok(REGION_BASE + (mib << 20))
}

fn max_region_mib(zero_page: u64) -> u64 {
    let count = rd::<u8>(zero_page + 0x1e8).min(128) as u64;
    for i in 0..count {
        let e = zero_page + 0x2d0 + 20 * i;
        let (addr, size, kind) = (rd::<u64>(e), rd::<u64>(e + 8), rd::<u32>(e + 16));
        let end = addr.saturating_add(size).min(MAPPED_END);
        if kind == 1 && addr <= REGION_BASE && end > REGION_BASE {
            return (end - REGION_BASE) >> 20;
        }
    }
    0
}

/// Prints `ERR <mib> MiB does not fit: at most <max> MiB at 16 MiB`.
pub fn put_region_err(mib: u64, max: u64) {
    puts(b"ERR ");
    put_dec(mib);
    puts(b" MiB does not fit: at most ");
    put_dec(max);
    puts(b" MiB of RAM at 16 MiB\n");
}

/// Parses a decimal or 0x-prefixed hexadecimal u64.
pub fn parse_u64(s: &[u8]) -> Option<u64> {
    let (digits, radix) = match s.strip_prefix(b"0x") {
        Some(h) => (h, 16),
        None => (s, 10),
    };
    if digits.is_empty() {
        return None;
    }
    let mut v: u64 = 0;
    for &c in digits {
        let d = (c as char).to_digit(radix)? as u64;
        v = v.checked_mul(radix as u64)?.checked_add(d)?;
    }
    Some(v)
}

// ---------------------------------------------------------------------------
// Panics

static mut PANICKING: bool = false;

/// CPL3 target of every exception / unexpected vector (see exc_common).
#[no_mangle]
extern "C" fn guest_panic(vector: u64, rip: u64) -> ! {
    // SAFETY: single vCPU; a second fault while printing just halts.
    let again = unsafe { core::ptr::replace(&raw mut PANICKING, true) };
    if !again {
        puts(b"PANIC ");
        put_dec(vector);
        puts(b" ");
        put_hex16(rip);
        puts(b"\n");
    }
    halt()
}

#[panic_handler]
fn panic(info: &core::panic::PanicInfo) -> ! {
    puts(b"PANIC rust line ");
    put_dec(info.location().map_or(0, |l| l.line() as u64));
    puts(b"\n");
    halt()
}

// ---------------------------------------------------------------------------
// Memory functions the compiler may call (no libc here).

#[no_mangle]
unsafe extern "C" fn memcpy(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    // SAFETY: caller guarantees valid, non-overlapping ranges.
    unsafe {
        asm!("rep movsb", inout("rcx") n => _, inout("rdi") dst => _,
             inout("rsi") src => _, options(nostack))
    };
    dst
}

#[no_mangle]
unsafe extern "C" fn memmove(dst: *mut u8, src: *const u8, n: usize) -> *mut u8 {
    if (dst as usize).wrapping_sub(src as usize) >= n {
        // SAFETY: forward copy is safe when dst does not start inside src.
        return unsafe { memcpy(dst, src, n) };
    }
    // SAFETY: backward copy with the direction flag, restored after.
    unsafe {
        asm!("std", "rep movsb", "cld", inout("rcx") n => _,
             inout("rdi") dst.add(n - 1) => _, inout("rsi") src.add(n - 1) => _,
             options(nostack))
    };
    dst
}

#[no_mangle]
unsafe extern "C" fn memset(dst: *mut u8, c: i32, n: usize) -> *mut u8 {
    // SAFETY: caller guarantees a valid range.
    unsafe {
        asm!("rep stosb", inout("rcx") n => _, inout("rdi") dst => _,
             in("al") c as u8, options(nostack))
    };
    dst
}

#[no_mangle]
unsafe extern "C" fn memcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    let mut i = 0;
    while i < n {
        // SAFETY: caller guarantees valid ranges of n bytes.
        let (x, y) = unsafe {
            (
                core::ptr::read_volatile(a.add(i)),
                core::ptr::read_volatile(b.add(i)),
            )
        };
        if x != y {
            return x as i32 - y as i32;
        }
        i += 1;
    }
    0
}

#[no_mangle]
unsafe extern "C" fn bcmp(a: *const u8, b: *const u8, n: usize) -> i32 {
    // SAFETY: same contract as memcmp.
    unsafe { memcmp(a, b, n) }
}
