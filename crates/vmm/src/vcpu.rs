//! One vCPU: its KVM fd, boot configuration, state save/restore, and the
//! thread that runs it, dispatches its exits to the buses and parks it on
//! request.
//!
//! Pausing: the controller sends [`VcpuRequest::Pause`] on the vCPU's
//! channel, then kicks the thread with [`kick_signal`]. The signal handler
//! sets `immediate_exit` in this thread's `kvm_run`, so the request is seen
//! whether the thread was inside KVM_RUN (it returns EINTR) or about to
//! enter it (KVM returns EINTR at once). Before parking, the thread enters
//! KVM_RUN once more with `immediate_exit = 1`: KVM then completes an I/O
//! exit the thread has just emulated (the IN result lands in RAX, RIP moves
//! on) and returns without running guest code. It then parks in a blocking
//! `recv` holding no lock.

use std::cell::Cell;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

use kvm_bindings::{kvm_msr_entry, CpuId, Msrs, Xsave, KVM_MAX_CPUID_ENTRIES, KVM_MAX_MSR_ENTRIES};
use kvm_ioctls::{Cap, VcpuExit, VcpuFd, VmFd};

use snapshot::template::Template;

use crate::arch::x86_64::{cpuid, msr, regs};
use crate::devices::Bus;
use crate::exit::{ExitNotifier, GuestExit};
use crate::memory::GuestMemoryMmap;
use crate::state::{FpuState, VcpuState, XsaveState};

/// KVM_SYSTEM_EVENT_SHUTDOWN / RESET (linux/kvm.h).
const KVM_SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const KVM_SYSTEM_EVENT_RESET: u32 = 2;
/// LAPIC LVT registers and delivery modes for the BSP's legacy lines.
const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_EXTINT: u32 = 0x7;
const APIC_MODE_NMI: u32 = 0x4;
const MSR_IA32_TSC: u32 = 0x10;
/// Restored last: KVM arms the deadline timer against the current TSC.
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;
/// Machine-check bank MSRs: host-specific and not state a guest can rely
/// on across hosts (Firecracker leaves them out too).
const MSR_MC_BANKS: std::ops::RangeInclusive<u32> = 0x400..=0x47f;
/// MSRs KVM handles but may leave out of KVM_GET_MSR_INDEX_LIST, which a
/// guest (or our boot path) sets: MTRR default type, the variable-range
/// pairs and the fixed ranges (Firecracker adds these from CPUID too).
const EXTRA_MSRS: &[u32] = &[
    0x2ff, 0x200, 0x201, 0x202, 0x203, 0x204, 0x205, 0x206, 0x207, 0x208, 0x209, 0x20a, 0x20b,
    0x20c, 0x20d, 0x20e, 0x20f, 0x250, 0x258, 0x259, 0x268, 0x269, 0x26a, 0x26b, 0x26c, 0x26d,
    0x26e, 0x26f,
];
/// Bound on the immediate-exit re-entries that finish a string I/O before parking.
const MAX_PARK_REENTRIES: usize = 4096;
/// Tolerated TSC frequency difference on restore (QEMU/Firecracker use 250 ppm).
const TSC_KHZ_TOLERANCE_PPM: u64 = 250;

/// Errors while creating, configuring, saving or restoring a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// KVM refused an ioctl.
    #[error("vCPU {index}: {what} failed")]
    Kvm {
        index: u8,
        what: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    /// Boot structures could not be written.
    #[error("vCPU {index}: boot setup failed")]
    Regs {
        index: u8,
        #[source]
        source: regs::RegsError,
    },
    /// The MSR list could not be built.
    #[error("vCPU {index}: cannot build the boot MSR list")]
    Msrs { index: u8 },
    /// KVM_GET_MSRS stopped before the end of the list.
    #[error("vCPU {index}: KVM cannot read MSR {msr:#x}")]
    GetMsr { index: u8, msr: u32 },
    /// KVM_SET_MSRS stopped before the end of the list.
    #[error("vCPU {index}: KVM refused to restore MSR {msr:#x}")]
    SetMsr { index: u8, msr: u32 },
    /// The saved state does not fit this vCPU.
    #[error("vCPU {index}: saved state is invalid: {why}")]
    InvalidState { index: u8, why: &'static str },
    /// The signal handler that kicks vCPUs out of KVM_RUN could not be installed.
    #[error("Cannot install the vCPU kick signal handler")]
    KickHandler(#[source] std::io::Error),
    /// KVM would not read or take an MSR the CPU template sets.
    #[error("vCPU {index}: KVM would not {what} MSR {msr:#x}, which CPU template {template} sets")]
    TemplateMsr {
        index: u8,
        template: String,
        msr: u32,
        what: &'static str,
    },
    /// The thread could not be started.
    #[error("vCPU {index}: cannot start its thread")]
    Spawn {
        index: u8,
        #[source]
        source: std::io::Error,
    },
}

/// A request from the controller to a running vCPU thread.
#[derive(Debug)]
pub enum VcpuRequest {
    /// Leave KVM_RUN, finish any pending I/O and park.
    Pause,
    /// Continue running (only while parked).
    Resume,
    /// Save the vCPU state (only while parked).
    Save,
}

/// A vCPU thread's answer to a [`VcpuRequest`].
#[derive(Debug)]
pub enum VcpuReply {
    Paused,
    Resumed,
    Saved(Box<Result<VcpuState, VcpuError>>),
    /// The request is not valid in the thread's current state.
    Refused(&'static str),
}

/// A started vCPU thread and the channels that control it.
pub struct VcpuThread {
    pub index: u8,
    pub requests: Sender<VcpuRequest>,
    pub replies: Receiver<VcpuReply>,
    pub handle: JoinHandle<()>,
}

impl VcpuThread {
    /// Kicks the thread out of KVM_RUN (see the module docs). Send the
    /// request first: the thread looks for it when KVM_RUN returns.
    pub fn kick(&self) {
        use std::os::unix::thread::JoinHandleExt;
        // SAFETY: the pthread_t comes from a JoinHandle we still own, so the
        // thread has not been joined or detached and the id is valid; the
        // signal has a handler installed by `install_kick_handler`.
        unsafe {
            libc::pthread_kill(self.handle.as_pthread_t(), kick_signal());
        }
    }
}

/// The realtime signal used to kick vCPU threads out of KVM_RUN.
pub fn kick_signal() -> libc::c_int {
    vmm_sys_util::signal::SIGRTMIN()
}

thread_local! {
    /// This thread's `kvm_run.immediate_exit`, when it is a vCPU thread.
    static IMMEDIATE_EXIT: Cell<*mut u8> = const { Cell::new(std::ptr::null_mut()) };
}

extern "C" fn handle_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    IMMEDIATE_EXIT.with(|p| {
        let p = p.get();
        if !p.is_null() {
            // SAFETY: set by this thread's vCPU loop to its own kvm_run
            // mapping, which lives as long as the loop (cleared before it
            // ends); a single-byte volatile store is async-signal-safe.
            unsafe { std::ptr::write_volatile(p, 1) };
        }
    });
}

/// Installs the process-wide kick handler, once, before any vCPU thread
/// can be kicked (the default action of a realtime signal ends the process).
fn install_kick_handler() -> Result<(), std::io::Error> {
    static RESULT: OnceLock<Result<(), i32>> = OnceLock::new();
    let result = RESULT.get_or_init(|| {
        vmm_sys_util::signal::register_signal_handler(kick_signal(), handle_kick)
            .map_err(|e| e.errno())
    });
    result.map_err(std::io::Error::from_raw_os_error)
}

/// Unblocks the kick signal in the calling (vCPU) thread.
fn unblock_kick_signal() {
    // SAFETY: sigset_t is plain data initialised by sigemptyset/sigaddset;
    // pthread_sigmask only changes this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, kick_signal());
        libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
    }
}

/// A vCPU ready to run.
pub struct Vcpu {
    index: u8,
    fd: VcpuFd,
    /// Size of KVM_GET_XSAVE2's buffer; `None` without KVM_CAP_XSAVE2.
    xsave2_size: Option<usize>,
    has_xsave: bool,
    has_xcrs: bool,
    /// The MSRs this vCPU can read, found on the first save.
    msrs_to_save: OnceLock<Vec<u32>>,
}

impl Vcpu {
    /// Creates vCPU `index` in `vm`.
    pub fn new(vm: &VmFd, index: u8) -> Result<Self, VcpuError> {
        let fd = vm
            .create_vcpu(u64::from(index))
            .map_err(|source| VcpuError::Kvm {
                index,
                what: "KVM_CREATE_VCPU",
                source,
            })?;
        let xsave2 = vm.check_extension_int(Cap::Xsave2);
        let xsave2_size = usize::try_from(xsave2)
            .ok()
            .filter(|&n| n >= std::mem::size_of::<kvm_bindings::kvm_xsave>());
        Ok(Self {
            index,
            fd,
            xsave2_size,
            has_xsave: vm.check_extension(Cap::Xsave),
            has_xcrs: vm.check_extension(Cap::Xcrs),
            msrs_to_save: OnceLock::new(),
        })
    }

    /// This vCPU's index.
    pub fn index(&self) -> u8 {
        self.index
    }

    /// Sets CPUID, MSRs, registers and LAPIC for a cold boot at `entry`.
    pub fn configure_boot(
        &self,
        mem: &GuestMemoryMmap,
        cpuid: &CpuId,
        template: Option<&Template>,
        vcpu_count: u8,
        entry: u64,
    ) -> Result<(), VcpuError> {
        let index = self.index;
        let kvm = |what| {
            move |source| VcpuError::Kvm {
                index,
                what,
                source,
            }
        };
        let mut cpuid = cpuid.clone();
        cpuid::filter_cpuid(&mut cpuid, index, vcpu_count);
        self.fd.set_cpuid2(&cpuid).map_err(kvm("KVM_SET_CPUID2"))?;
        let msrs = msr::boot_msrs().map_err(|_| VcpuError::Msrs { index })?;
        self.fd.set_msrs(&msrs).map_err(kvm("KVM_SET_MSRS"))?;
        if let Some(t) = template {
            self.apply_msr_template(t)?;
        }
        self.fd
            .set_regs(&regs::boot_regs(entry))
            .map_err(kvm("KVM_SET_REGS"))?;
        self.fd
            .set_fpu(&regs::boot_fpu())
            .map_err(kvm("KVM_SET_FPU"))?;
        let sregs = self.fd.get_sregs().map_err(kvm("KVM_GET_SREGS"))?;
        let sregs = regs::setup_long_mode(mem, sregs)
            .map_err(|source| VcpuError::Regs { index, source })?;
        self.fd.set_sregs(&sregs).map_err(kvm("KVM_SET_SREGS"))?;
        self.set_lint()?;
        Ok(())
    }

    /// The CPUID KVM holds for this vCPU (KVM_GET_CPUID2, without the
    /// zeroed entries after the valid ones).
    pub fn cpuid(&self) -> Result<Vec<kvm_bindings::kvm_cpuid_entry2>, VcpuError> {
        let mut cpuid = self
            .fd
            .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
            .map_err(self.kvm_err("KVM_GET_CPUID2"))?;
        cpuid.retain(|e| !(e.function == 0 && e.index == 0 && e.flags == 0 && e.eax == 0));
        Ok(cpuid.as_slice().to_vec())
    }

    /// Sets the MSRs a CPU template modifies: each one's value as KVM
    /// initialized it, with the template's bits replaced. KVM must take
    /// every one (KVM_SET_MSRS reports how many it set).
    fn apply_msr_template(&self, template: &Template) -> Result<(), VcpuError> {
        for m in &template.msr_modifiers {
            let mut one = Msrs::from_entries(&[kvm_msr_entry {
                index: m.addr,
                ..Default::default()
            }])
            .map_err(|_| VcpuError::Msrs { index: self.index })?;
            let read = self
                .fd
                .get_msrs(&mut one)
                .map_err(self.kvm_err("KVM_GET_MSRS"))?;
            if read != 1 {
                return Err(self.template_msr(template, m.addr, "read"));
            }
            let Some(e) = one.as_mut_slice().first_mut() else {
                return Err(self.template_msr(template, m.addr, "read"));
            };
            e.data = m.bitmap.apply(e.data);
            let set = self
                .fd
                .set_msrs(&one)
                .map_err(self.kvm_err("KVM_SET_MSRS"))?;
            if set != 1 {
                return Err(self.template_msr(template, m.addr, "set"));
            }
        }
        Ok(())
    }

    fn template_msr(&self, template: &Template, addr: u32, what: &'static str) -> VcpuError {
        VcpuError::TemplateMsr {
            index: self.index,
            template: template.name.clone(),
            msr: addr,
            what,
        }
    }

    /// Routes LINT0 as ExtINT and LINT1 as NMI, as a PC's firmware does.
    fn set_lint(&self) -> Result<(), VcpuError> {
        let index = self.index;
        let mut lapic = self.fd.get_lapic().map_err(|source| VcpuError::Kvm {
            index,
            what: "KVM_GET_LAPIC",
            source,
        })?;
        for (reg, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
            let bytes: &mut [u8] = bytes_of_regs(&mut lapic.regs[reg..reg + 4]);
            let v = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
            let v = (v & !0x700) | (mode << 8);
            bytes.copy_from_slice(&v.to_le_bytes());
        }
        self.fd.set_lapic(&lapic).map_err(|source| VcpuError::Kvm {
            index,
            what: "KVM_SET_LAPIC",
            source,
        })
    }

    fn kvm_err(&self, what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuError {
        let index = self.index;
        move |source| VcpuError::Kvm {
            index,
            what,
            source,
        }
    }

    /// Saves the vCPU's state. The vCPU must not be running (parked, or
    /// never started).
    ///
    /// Order: MP_STATE first, because KVM_GET_MP_STATE processes pending
    /// LAPIC events (INIT/SIPI) and may change the LAPIC and registers; the
    /// rest reads settled state. VCPU_EVENTS last: it carries the pending
    /// exception/interrupt/NMI, and the other GETs may still settle them.
    pub fn save_state(&self) -> Result<VcpuState, VcpuError> {
        let mp_state = self
            .fd
            .get_mp_state()
            .map_err(self.kvm_err("KVM_GET_MP_STATE"))?;
        let regs = self.fd.get_regs().map_err(self.kvm_err("KVM_GET_REGS"))?;
        let sregs = self.fd.get_sregs().map_err(self.kvm_err("KVM_GET_SREGS"))?;
        let (xsave, fpu) = if self.has_xsave {
            (Some(self.get_xsave()?), None)
        } else {
            let fpu = self.fd.get_fpu().map_err(self.kvm_err("KVM_GET_FPU"))?;
            (None, Some(FpuState::from(&fpu)))
        };
        let xcrs = if self.has_xcrs {
            Some(self.fd.get_xcrs().map_err(self.kvm_err("KVM_GET_XCRS"))?)
        } else {
            None
        };
        let debugregs = self
            .fd
            .get_debug_regs()
            .map_err(self.kvm_err("KVM_GET_DEBUGREGS"))?;
        let lapic = self.fd.get_lapic().map_err(self.kvm_err("KVM_GET_LAPIC"))?;
        let tsc_khz = self.fd.get_tsc_khz().ok();
        let mut cpuid = self
            .fd
            .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
            .map_err(self.kvm_err("KVM_GET_CPUID2"))?;
        // KVM_GET_CPUID2 leaves zeroed entries after the valid ones.
        cpuid.retain(|e| !(e.function == 0 && e.index == 0 && e.flags == 0 && e.eax == 0));
        let cpuid = cpuid.as_slice().to_vec();
        let msrs = self.get_msrs()?;
        let vcpu_events = self
            .fd
            .get_vcpu_events()
            .map_err(self.kvm_err("KVM_GET_VCPU_EVENTS"))?;
        Ok(VcpuState {
            index: self.index,
            cpuid,
            msrs,
            mp_state,
            regs,
            sregs,
            xsave,
            fpu,
            xcrs,
            debugregs,
            lapic,
            vcpu_events,
            tsc_khz,
        })
    }

    /// Restores what [`Vcpu::save_state`] took, into a vCPU that has never
    /// run.
    ///
    /// Order (Firecracker documents the reasons): TSC frequency first;
    /// CPUID before anything (other SETs check guest features, and
    /// MP_STATE depends on whether this is the BSP); MP_STATE; REGS (it
    /// clears pending exceptions, which VCPU_EVENTS restores last); SREGS
    /// (restores the APIC base, so before LAPIC); XSAVE (or FPU); XCRS;
    /// DEBUGREGS; LAPIC (the TSC-deadline MSR only takes when the LAPIC is
    /// configured); MSRs, with the TSC before TSC_DEADLINE; VCPU_EVENTS.
    pub fn restore_state(&self, state: &VcpuState) -> Result<(), VcpuError> {
        if state.index != self.index {
            return Err(self.invalid("vCPU index differs"));
        }
        if let Some(khz) = state.tsc_khz {
            self.restore_tsc_khz(khz)?;
        }
        let cpuid = CpuId::from_entries(&state.cpuid)
            .map_err(|_| self.invalid("too many CPUID entries"))?;
        self.fd
            .set_cpuid2(&cpuid)
            .map_err(self.kvm_err("KVM_SET_CPUID2"))?;
        self.fd
            .set_mp_state(state.mp_state)
            .map_err(self.kvm_err("KVM_SET_MP_STATE"))?;
        self.fd
            .set_regs(&state.regs)
            .map_err(self.kvm_err("KVM_SET_REGS"))?;
        self.fd
            .set_sregs(&state.sregs)
            .map_err(self.kvm_err("KVM_SET_SREGS"))?;
        match (&state.xsave, &state.fpu) {
            (Some(xsave), _) => self.set_xsave(xsave)?,
            (None, Some(fpu)) => self
                .fd
                .set_fpu(&fpu.into())
                .map_err(self.kvm_err("KVM_SET_FPU"))?,
            (None, None) => return Err(self.invalid("neither XSAVE nor FPU state")),
        }
        if let Some(xcrs) = &state.xcrs {
            self.fd
                .set_xcrs(xcrs)
                .map_err(self.kvm_err("KVM_SET_XCRS"))?;
        }
        self.fd
            .set_debug_regs(&state.debugregs)
            .map_err(self.kvm_err("KVM_SET_DEBUGREGS"))?;
        self.fd
            .set_lapic(&state.lapic)
            .map_err(self.kvm_err("KVM_SET_LAPIC"))?;
        self.set_msrs(&state.msrs)?;
        self.fd
            .set_vcpu_events(&state.vcpu_events)
            .map_err(self.kvm_err("KVM_SET_VCPU_EVENTS"))?;
        // Tells a kvmclock guest it was stopped by the host (no soft-lockup
        // report); fails harmlessly when the guest has no kvmclock.
        let _ = self.fd.kvmclock_ctrl();
        Ok(())
    }

    fn invalid(&self, why: &'static str) -> VcpuError {
        VcpuError::InvalidState {
            index: self.index,
            why,
        }
    }

    fn restore_tsc_khz(&self, khz: u32) -> Result<(), VcpuError> {
        let Ok(current) = self.fd.get_tsc_khz() else {
            return Ok(());
        };
        let diff = u64::from(current.abs_diff(khz));
        if diff * 1_000_000 > u64::from(khz) * TSC_KHZ_TOLERANCE_PPM {
            self.fd
                .set_tsc_khz(khz)
                .map_err(self.kvm_err("KVM_SET_TSC_KHZ"))?;
        }
        Ok(())
    }

    fn get_xsave(&self) -> Result<XsaveState, VcpuError> {
        let base = std::mem::size_of::<kvm_bindings::kvm_xsave>();
        match self.xsave2_size {
            Some(size) => {
                let fam_len = (size - base).div_ceil(std::mem::size_of::<u32>());
                let mut xsave = Xsave::new(fam_len).map_err(|_| self.invalid("XSAVE size"))?;
                // SAFETY: `xsave` holds KVM_CAP_XSAVE2's size in bytes, all
                // that KVM_GET_XSAVE2 writes.
                unsafe { self.fd.get_xsave2(&mut xsave) }
                    .map_err(self.kvm_err("KVM_GET_XSAVE2"))?;
                Ok(XsaveState {
                    region: xsave.as_fam_struct_ref().xsave.region.to_vec(),
                    extra: xsave.as_slice().to_vec(),
                })
            }
            None => {
                let legacy = self.fd.get_xsave().map_err(self.kvm_err("KVM_GET_XSAVE"))?;
                Ok(XsaveState {
                    region: legacy.region.to_vec(),
                    extra: Vec::new(),
                })
            }
        }
    }

    /// KVM_SET_XSAVE reads as many bytes as this host's XSAVE area holds,
    /// which may be more than the saved buffer: copy into a buffer of this
    /// host's size first, and refuse a saved area larger than it.
    fn set_xsave(&self, saved: &XsaveState) -> Result<(), VcpuError> {
        let base = std::mem::size_of::<kvm_bindings::kvm_xsave>();
        let fam_len = self
            .xsave2_size
            .map(|size| (size - base).div_ceil(std::mem::size_of::<u32>()))
            .unwrap_or(0);
        let extra = saved.extra.as_slice();
        if extra.len() > fam_len {
            return Err(self.invalid("XSAVE area larger than this host's"));
        }
        let region: [u32; 1024] = saved
            .region
            .as_slice()
            .try_into()
            .map_err(|_| self.invalid("XSAVE region is not 4 KiB"))?;
        let mut xsave = Xsave::new(fam_len).map_err(|_| self.invalid("XSAVE size"))?;
        xsave.as_mut_slice()[..extra.len()].copy_from_slice(extra);
        // SAFETY: only the fixed-size region is written; the FAM length
        // stays as allocated.
        unsafe { xsave.as_mut_fam_struct() }.xsave.region = region;
        // SAFETY: `xsave` is as large as this host's XSAVE area (the size
        // KVM_SET_XSAVE reads), or 4 KiB without KVM_CAP_XSAVE2.
        unsafe { self.fd.set_xsave2(&xsave) }.map_err(self.kvm_err("KVM_SET_XSAVE"))
    }

    /// Reads every MSR in the host's index list this vCPU can read, TSC
    /// deadline last.
    fn get_msrs(&self) -> Result<Vec<kvm_msr_entry>, VcpuError> {
        let indices = match self.msrs_to_save.get() {
            Some(list) => list.clone(),
            None => {
                let list = self.probe_msrs()?;
                let _ = self.msrs_to_save.set(list.clone());
                list
            }
        };
        let mut out = Vec::with_capacity(indices.len());
        for chunk in indices.chunks(KVM_MAX_MSR_ENTRIES) {
            let read = self.read_msrs(chunk)?;
            if read.len() != chunk.len() {
                return Err(VcpuError::GetMsr {
                    index: self.index,
                    msr: chunk[read.len()],
                });
            }
            out.extend(read);
        }
        Ok(out)
    }

    /// The MSRs of the host list this vCPU can read, in KVM's order, with
    /// TSC_DEADLINE moved last. KVM_GET_MSRS stops at the first MSR it
    /// cannot read; that one is dropped and the rest retried.
    fn probe_msrs(&self) -> Result<Vec<u32>, VcpuError> {
        let mut candidates: Vec<u32> = crate::vm::msr_index_list()
            .iter()
            .copied()
            .filter(|i| !MSR_MC_BANKS.contains(i))
            .collect();
        for &extra in std::iter::once(&MSR_IA32_TSC).chain(EXTRA_MSRS) {
            if !candidates.contains(&extra) {
                candidates.push(extra);
            }
        }
        let mut readable = Vec::with_capacity(candidates.len());
        let mut rest = candidates.as_slice();
        while !rest.is_empty() {
            let chunk = &rest[..rest.len().min(KVM_MAX_MSR_ENTRIES)];
            let n = self.read_msrs(chunk)?.len();
            readable.extend_from_slice(&chunk[..n]);
            // Skip the MSR KVM refused (if any).
            rest = &rest[(n + usize::from(n < chunk.len())).min(rest.len())..];
        }
        if let Some(pos) = readable.iter().position(|&i| i == MSR_IA32_TSC_DEADLINE) {
            let deadline = readable.remove(pos);
            readable.push(deadline);
        }
        Ok(readable)
    }

    fn read_msrs(&self, indices: &[u32]) -> Result<Vec<kvm_msr_entry>, VcpuError> {
        let entries: Vec<kvm_msr_entry> = indices
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs =
            Msrs::from_entries(&entries).map_err(|_| VcpuError::Msrs { index: self.index })?;
        let n = self
            .fd
            .get_msrs(&mut msrs)
            .map_err(self.kvm_err("KVM_GET_MSRS"))?;
        Ok(msrs.as_slice()[..n.min(indices.len())].to_vec())
    }

    fn set_msrs(&self, saved: &[kvm_msr_entry]) -> Result<(), VcpuError> {
        for chunk in saved.chunks(KVM_MAX_MSR_ENTRIES) {
            let msrs =
                Msrs::from_entries(chunk).map_err(|_| VcpuError::Msrs { index: self.index })?;
            let n = self
                .fd
                .set_msrs(&msrs)
                .map_err(self.kvm_err("KVM_SET_MSRS"))?;
            if n < chunk.len() {
                return Err(VcpuError::SetMsr {
                    index: self.index,
                    msr: chunk[n].index,
                });
            }
        }
        Ok(())
    }

    /// Starts the vCPU thread. It runs until the guest or a device reports
    /// an exit, dispatching every exit to the port-I/O or MMIO bus, and
    /// serves [`VcpuRequest`]s sent on the returned thread's channel.
    /// With `paused`, a Pause is queued before the thread exists: it parks
    /// before its first KVM_RUN, so no guest instruction runs until a
    /// Resume (the caller reads the Paused reply).
    pub fn start(
        self,
        pio: Arc<Bus>,
        mmio: Arc<Bus>,
        exit: Arc<ExitNotifier>,
        paused: bool,
    ) -> Result<VcpuThread, VcpuError> {
        let index = self.index;
        install_kick_handler().map_err(VcpuError::KickHandler)?;
        let (req_tx, req_rx) = std::sync::mpsc::channel();
        let (rep_tx, rep_rx) = std::sync::mpsc::channel();
        if paused {
            req_tx
                .send(VcpuRequest::Pause)
                .map_err(|_| VcpuError::Spawn {
                    index,
                    source: std::io::Error::other("request channel closed"),
                })?;
        }
        let handle = std::thread::Builder::new()
            .name(format!("vcpu{index}"))
            .spawn(move || {
                crate::seccomp::apply(crate::seccomp::Thread::Vcpu);
                let mut ctl = Control {
                    requests: req_rx,
                    replies: rep_tx,
                };
                self.run(&pio, &mmio, &exit, &mut ctl)
            })
            .map_err(|source| VcpuError::Spawn { index, source })?;
        Ok(VcpuThread {
            index,
            requests: req_tx,
            replies: rep_rx,
            handle,
        })
    }

    fn run(mut self, pio: &Bus, mmio: &Bus, exit: &ExitNotifier, ctl: &mut Control) {
        unblock_kick_signal();
        let immediate_exit: *mut u8 = &mut self.fd.get_kvm_run().immediate_exit;
        IMMEDIATE_EXIT.with(|p| p.set(immediate_exit));
        // Declared after `self`, so dropped before it: the pointer is gone
        // before the kvm_run mapping, even when unwinding.
        let _clear = ClearImmediateExit;
        // Requests are looked at before every KVM_RUN, and only after the
        // pointer above is set: a request sent (and kicked) before that is
        // found here, one kicked after it makes KVM_RUN return at once.
        while exit.get().is_none() {
            match ctl.requests.try_recv() {
                Ok(VcpuRequest::Pause) => self.park(pio, mmio, exit, ctl),
                Ok(VcpuRequest::Resume) => ctl.reply(VcpuReply::Resumed),
                Ok(VcpuRequest::Save) => ctl.reply(VcpuReply::Refused("vCPU is running")),
                Err(TryRecvError::Empty | TryRecvError::Disconnected) => {}
            }
            if self.run_once(pio, mmio, exit) == Ran::Interrupted {
                self.fd.set_kvm_immediate_exit(0);
            }
        }
    }

    /// Completes any pending I/O exit without running guest code, then
    /// serves requests until told to resume.
    fn park(&mut self, pio: &Bus, mmio: &Bus, exit: &ExitNotifier, ctl: &Control) {
        self.fd.set_kvm_immediate_exit(1);
        for _ in 0..MAX_PARK_REENTRIES {
            // A string I/O can exit again once completed: serve it and retry.
            if self.run_once(pio, mmio, exit) == Ran::Interrupted {
                break;
            }
        }
        self.fd.set_kvm_immediate_exit(0);
        ctl.reply(VcpuReply::Paused);
        loop {
            match ctl.requests.recv() {
                Ok(VcpuRequest::Resume) => {
                    ctl.reply(VcpuReply::Resumed);
                    return;
                }
                Ok(VcpuRequest::Pause) => ctl.reply(VcpuReply::Paused),
                Ok(VcpuRequest::Save) => {
                    ctl.reply(VcpuReply::Saved(Box::new(self.save_state())));
                }
                // Nobody can resume us any more: stay parked.
                Err(_) => loop {
                    std::thread::park();
                },
            }
        }
    }

    /// One KVM_RUN and the dispatch of its exit.
    fn run_once(&mut self, pio: &Bus, mmio: &Bus, exit: &ExitNotifier) -> Ran {
        let index = self.index;
        match self.fd.run() {
            Ok(VcpuExit::IoIn(port, data)) => {
                if !pio.read(u64::from(port), data) {
                    data.fill(0xff);
                }
            }
            Ok(VcpuExit::IoOut(port, data)) => {
                pio.write(u64::from(port), data);
            }
            Ok(VcpuExit::MmioRead(addr, data)) => {
                if !mmio.read(addr, data) {
                    data.fill(0xff);
                }
            }
            Ok(VcpuExit::MmioWrite(addr, data)) => {
                mmio.write(addr, data);
            }
            Ok(VcpuExit::Hlt) => {
                // With the in-kernel irqchip HLT is handled by KVM; an exit
                // here means the vCPU can never wake up again.
                tracing::info!("vcpu{index}: halted for good");
                exit.notify(GuestExit::Shutdown);
            }
            Ok(VcpuExit::Shutdown) => {
                // The guest crashed (a triple fault), it did not power off:
                // say so, and where if KVM still knows, so `ls` and vmm.log
                // tell one from the other.
                let rip = self.fd.get_regs().map(|r| r.rip).ok();
                let why = format!(
                    "vcpu{index}: triple fault (KVM_EXIT_SHUTDOWN){}",
                    shutdown_where(rip)
                );
                tracing::warn!("{why}");
                exit.fail(GuestExit::Shutdown, why);
            }
            Ok(VcpuExit::SystemEvent(kind, _)) => {
                let reason = match kind {
                    KVM_SYSTEM_EVENT_RESET => GuestExit::Reset,
                    KVM_SYSTEM_EVENT_SHUTDOWN => GuestExit::Poweroff,
                    _ => GuestExit::Shutdown,
                };
                exit.notify(reason);
            }
            Ok(VcpuExit::InternalError) => {
                let rip = self.fd.get_regs().map(|r| r.rip).unwrap_or(0);
                tracing::error!("vcpu{index}: KVM internal error at rip {rip:#x}");
                exit.notify(GuestExit::Crashed);
            }
            Ok(VcpuExit::FailEntry(reason, cpu)) => {
                tracing::error!("vcpu{index}: VM entry failed (reason {reason:#x}, cpu {cpu})");
                exit.notify(GuestExit::Crashed);
            }
            Ok(other) => {
                tracing::warn!("vcpu{index}: unexpected exit {other:?}");
            }
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                return Ran::Interrupted;
            }
            Err(e) => {
                tracing::error!("vcpu{index}: KVM_RUN failed: {e}");
                exit.notify(GuestExit::Crashed);
            }
        }
        Ran::Exited
    }
}

/// Clears this thread's kick target when the vCPU loop ends.
struct ClearImmediateExit;

impl Drop for ClearImmediateExit {
    fn drop(&mut self) {
        IMMEDIATE_EXIT.with(|p| p.set(std::ptr::null_mut()));
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Ran {
    /// KVM_RUN returned EINTR (kicked, or immediate_exit was set).
    Interrupted,
    /// An exit was served.
    Exited,
}

/// The vCPU thread's end of its control channels.
struct Control {
    requests: Receiver<VcpuRequest>,
    replies: Sender<VcpuReply>,
}

impl Control {
    fn reply(&self, reply: VcpuReply) {
        // The controller may be gone; nothing to tell then.
        let _ = self.replies.send(reply);
    }
}

/// The LAPIC register page is `[c_char; 1024]`; view a slice of it as bytes.
fn bytes_of_regs(regs: &mut [std::os::raw::c_char]) -> &mut [u8] {
    // SAFETY: c_char and u8 have the same size and alignment, and every bit
    // pattern is valid for both; the slice borrows `regs` exclusively.
    unsafe { std::slice::from_raw_parts_mut(regs.as_mut_ptr().cast::<u8>(), regs.len()) }
}

/// A vCPU's whole KVM state ([`Vcpu::save_state`]); a restore loads it
/// into a fresh vCPU of a prepared VM ([`crate::vstate::prepare_machine`]).
impl crate::persist::Persist for Vcpu {
    type State = VcpuState;
    type ConstructorArgs = Vcpu;
    type Error = VcpuError;

    fn save(&self) -> Result<VcpuState, VcpuError> {
        self.save_state()
    }

    fn restore(fresh: Vcpu, state: &VcpuState) -> Result<Self, VcpuError> {
        fresh.restore_state(state)?;
        Ok(fresh)
    }
}

/// Where a triple fault happened, for its report. On AMD SVM, KVM puts the
/// vCPU through INIT before it reports the shutdown (the VMCB is undefined
/// after one), so its registers are the reset state: rip 0xfff0 says
/// nothing about where the guest was.
fn shutdown_where(rip: Option<u64>) -> String {
    match rip {
        Some(0xfff0) => " (registers were reset by KVM, as AMD SVM does on a shutdown: where the guest was is unknown)".into(),
        Some(rip) => format!(" at rip {rip:#x}"),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn test_a_triple_fault_after_an_svm_reset_names_no_rip() {
        assert_eq!(super::shutdown_where(Some(0x1234)), " at rip 0x1234");
        assert!(super::shutdown_where(Some(0xfff0)).contains("unknown"));
        assert_eq!(super::shutdown_where(None), "");
    }
}
