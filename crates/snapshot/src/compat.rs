//! The compatibility manifest (ARCHITECTURE.md "Compatibility manifest"):
//! what a snapshot needs from the host that restores it, what a host offers,
//! and the check restore runs first, which names every mismatch at once.
//!
//! Plain data and logic only: the VMM fills [`Compat`] from the saved vCPU
//! state and [`HostCompat`] from /dev/kvm.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::template::{Template, TemplateRecord};
use Register::{Eax, Ebx, Ecx, Edx};

/// TSC frequencies closer than this are the same (QEMU and Firecracker
/// use 250 ppm; tine's restore too).
pub const TSC_KHZ_TOLERANCE_PPM: u64 = 250;
/// KVM_CAP_TSC_CONTROL: lets restore give the guest its saved TSC rate.
pub const CAP_TSC_CONTROL: u32 = 60;

/// KVM_CPUID_FLAG_SIGNIFCANT_INDEX: the entry applies to one sub-leaf only.
pub const CPUID_FLAG_SIGNIFICANT_INDEX: u32 = 1;

/// One CPUID entry (the fields of `kvm_cpuid_entry2`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuidEntry {
    pub function: u32,
    pub index: u32,
    pub flags: u32,
    pub eax: u32,
    pub ebx: u32,
    pub ecx: u32,
    pub edx: u32,
}

impl CpuidEntry {
    pub(crate) fn get(&self, reg: Register) -> u32 {
        match reg {
            Register::Eax => self.eax,
            Register::Ebx => self.ebx,
            Register::Ecx => self.ecx,
            Register::Edx => self.edx,
        }
    }

    pub(crate) fn get_mut(&mut self, reg: Register) -> &mut u32 {
        match reg {
            Register::Eax => &mut self.eax,
            Register::Ebx => &mut self.ebx,
            Register::Ecx => &mut self.ecx,
            Register::Edx => &mut self.edx,
        }
    }

    /// Whether this entry answers CPUID (`function`, `index`).
    pub fn matches(&self, function: u32, index: u32) -> bool {
        self.function == function
            && (self.index == index || self.flags & CPUID_FLAG_SIGNIFICANT_INDEX == 0)
    }
}

/// A KVM capability (KVM_CAP_* name and number).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvmCap {
    pub name: String,
    pub number: u32,
}

/// What a snapshot needs, recorded when it is taken.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Compat {
    /// The tine that wrote the snapshot.
    pub tine_version: String,
    /// [`crate::FORMAT_VERSION`] of that tine.
    pub format_version: crate::Version,
    /// `uname -r` of the host that took it (informational).
    pub host_kernel: String,
    /// CPUID leaf 0 vendor string the guest saw ("GenuineIntel").
    pub cpu_vendor: String,
    /// CPUID the guest saw (the boot vCPU's; tine gives every vCPU the same
    /// features and differs only in topology).
    pub cpuid: Vec<CpuidEntry>,
    /// Indices of the saved MSRs the saving host's KVM lists; MSRs tine
    /// saves that KVM emulates on every host are left out.
    pub msrs: Vec<u32>,
    /// KVM capabilities restoring this state needs.
    pub caps: Vec<KvmCap>,
    /// The guest's TSC frequency, if KVM reported it.
    pub tsc_khz: Option<u32>,
    /// Devices in bus order, as "virtio-blk", "virtio-net", ...
    pub devices: Vec<String>,
    pub mem_mib: u64,
    pub vcpus: u8,
    /// The CPU template the vm ran under (docs/design/cpu-templates.md):
    /// a restore checks that the host satisfies it. Absent in manifests of
    /// vms started without one, and in every manifest before templates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_template: Option<TemplateRecord>,
}

/// What this host (and this tine) offers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostCompat {
    pub tine_version: String,
    /// The state format this tine reads (and older minors of its major).
    pub format_version: crate::Version,
    /// `uname -r`.
    pub kernel: String,
    /// CPUID leaf 0 vendor string.
    pub cpu_vendor: String,
    /// KVM_GET_SUPPORTED_CPUID.
    pub cpuid: Vec<CpuidEntry>,
    /// KVM_GET_MSR_INDEX_LIST.
    pub msrs: Vec<u32>,
    /// The capabilities this host's KVM has (among those tine asks about).
    pub caps: Vec<KvmCap>,
    /// A new vCPU's TSC frequency, if KVM reports it.
    pub tsc_khz: Option<u32>,
}

/// What a restore asks for; `None` takes the snapshot's value.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreRequest {
    pub devices: Option<Vec<String>>,
    pub mem_mib: Option<u64>,
    pub vcpus: Option<u8>,
}

/// A CPUID output register.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Register {
    Eax,
    Ebx,
    Ecx,
    Edx,
}

impl fmt::Display for Register {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Register::Eax => "EAX",
            Register::Ebx => "EBX",
            Register::Ecx => "ECX",
            Register::Edx => "EDX",
        })
    }
}

/// One CPUID bit, shown as `CPUID.(EAX=7,ECX=0):EBX bit 5`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct CpuidBit {
    pub function: u32,
    pub index: u32,
    pub register: Register,
    pub bit: u32,
}

impl fmt::Display for CpuidBit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "CPUID.(EAX={:#x},ECX={}):{} bit {}",
            self.function, self.index, self.register, self.bit
        )
    }
}

/// One reason a snapshot cannot be restored here.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum Mismatch {
    FormatVersion {
        snapshot: crate::Version,
        snapshot_tine: String,
        host: crate::Version,
        host_tine: String,
    },
    Vendor {
        snapshot: String,
        host: String,
    },
    /// The guest saw a CPU feature this host's KVM does not offer.
    CpuFeature {
        name: Option<&'static str>,
        bit: CpuidBit,
    },
    /// A CPU feature the CPU template requires that this host's KVM does
    /// not offer.
    TemplateFeature {
        template: String,
        name: Option<&'static str>,
        bit: CpuidBit,
    },
    /// An MSR the CPU template sets that this host's KVM does not list.
    TemplateMsr {
        template: String,
        index: u32,
    },
    /// The manifest's template does not match the hash recorded with it.
    TemplateHash {
        template: String,
        recorded: String,
        found: String,
    },
    /// A saved MSR this host's KVM does not list.
    Msr {
        index: u32,
    },
    /// A KVM capability restore needs.
    Cap(KvmCap),
    /// The guest's TSC runs at another rate and this host cannot scale it.
    TscFrequency {
        snapshot: u32,
        host: u32,
    },
    Devices {
        snapshot: Vec<String>,
        requested: Vec<String>,
    },
    Memory {
        snapshot: u64,
        requested: u64,
    },
    Vcpus {
        snapshot: u8,
        requested: u8,
    },
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::FormatVersion {
                snapshot,
                snapshot_tine,
                host,
                host_tine,
            } => write!(
                f,
                "state format: the snapshot needs format {snapshot} (written by tine {snapshot_tine}); this tine {host_tine} reads format {host}"
            ),
            Mismatch::Vendor { snapshot, host } => write!(
                f,
                "CPU vendor: the snapshot needs {snapshot}; this host has {host}"
            ),
            Mismatch::CpuFeature { name, bit } => {
                match name {
                    Some(name) => write!(f, "CPU feature {name} ({bit})")?,
                    None => write!(f, "CPU feature {bit}")?,
                }
                f.write_str(": the snapshot's guest uses it; this host's KVM does not offer it")
            }
            Mismatch::TemplateFeature {
                template,
                name,
                bit,
            } => {
                match name {
                    Some(name) => write!(f, "CPU feature {name} ({bit})")?,
                    None => write!(f, "CPU feature {bit}")?,
                }
                write!(
                    f,
                    ": CPU template {template} requires it; this host's KVM does not offer it"
                )
            }
            Mismatch::TemplateMsr { template, index } => {
                write!(f, "MSR {index:#x}")?;
                if let Some(name) = msr_name(*index) {
                    write!(f, " ({name})")?;
                }
                write!(
                    f,
                    ": CPU template {template} sets it; this host's KVM does not list it"
                )
            }
            Mismatch::TemplateHash {
                template,
                recorded,
                found,
            } => write!(
                f,
                "CPU template {template}: the manifest records hash {recorded} but the template it carries hashes to {found} (the manifest was altered)"
            ),
            Mismatch::Msr { index } => {
                write!(f, "MSR {index:#x}")?;
                if let Some(name) = msr_name(*index) {
                    write!(f, " ({name})")?;
                }
                f.write_str(": the snapshot saved it; this host's KVM cannot restore it")
            }
            Mismatch::Cap(cap) => write!(
                f,
                "KVM capability {} ({}): restore needs it; this host's KVM does not have it",
                cap.name, cap.number
            ),
            Mismatch::TscFrequency { snapshot, host } => write!(
                f,
                "TSC frequency: the snapshot needs {snapshot} kHz; this host runs at {host} kHz and its KVM cannot scale it (no KVM_CAP_TSC_CONTROL)"
            ),
            Mismatch::Devices {
                snapshot,
                requested,
            } => write!(
                f,
                "device layout: the snapshot has [{}]; the restore asks for [{}]",
                snapshot.join(", "),
                requested.join(", ")
            ),
            Mismatch::Memory {
                snapshot,
                requested,
            } => write!(
                f,
                "memory: the snapshot has {snapshot} MiB; the restore asks for {requested} MiB"
            ),
            Mismatch::Vcpus {
                snapshot,
                requested,
            } => write!(
                f,
                "vCPUs: the snapshot has {snapshot}; the restore asks for {requested}"
            ),
        }
    }
}

/// A snapshot that cannot be restored on this host, with every reason.
#[derive(Debug, thiserror::Error)]
pub struct CompatError {
    pub mismatches: Vec<Mismatch>,
    /// Kernel of the host that took the snapshot and of this one (for the advice).
    pub snapshot_kernel: String,
    pub host_kernel: String,
    /// The CPU template the snapshot was taken under, if any.
    pub template: Option<String>,
    /// The built-in CPU templates this host satisfies (for the advice).
    pub host_templates: Vec<String>,
}

impl fmt::Display for CompatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.mismatches.len();
        writeln!(
            f,
            "This snapshot cannot be restored on this host ({n} mismatch{}):",
            if n == 1 { "" } else { "es" }
        )?;
        for m in &self.mismatches {
            writeln!(f, "  - {m}")?;
        }
        let has = |p: fn(&Mismatch) -> bool| self.mismatches.iter().any(p);
        let mut advice = Vec::new();
        if let Some(Mismatch::FormatVersion {
            snapshot,
            snapshot_tine,
            ..
        }) = self
            .mismatches
            .iter()
            .find(|m| matches!(m, Mismatch::FormatVersion { .. }))
        {
            advice.push(format!(
                "restore with tine {snapshot_tine} (or another tine that reads format {snapshot})"
            ));
        }
        if has(|m| {
            matches!(
                m,
                Mismatch::Vendor { .. }
                    | Mismatch::CpuFeature { .. }
                    | Mismatch::TemplateFeature { .. }
                    | Mismatch::TemplateMsr { .. }
            )
        }) {
            advice.push(self.cpu_advice());
        }
        if has(|m| {
            matches!(
                m,
                Mismatch::Msr { .. } | Mismatch::Cap(_) | Mismatch::TscFrequency { .. }
            )
        }) {
            advice.push(format!(
                "restore on a host whose kernel's KVM has these (the snapshot was taken on Linux {}, this host runs {})",
                self.snapshot_kernel, self.host_kernel
            ));
        }
        if has(|m| {
            matches!(
                m,
                Mismatch::Devices { .. } | Mismatch::Memory { .. } | Mismatch::Vcpus { .. }
            )
        }) {
            advice.push(
                "restore without overriding devices, memory or vCPUs (the snapshot's are used), or take a new snapshot with the ones you need"
                    .to_string(),
            );
        }
        f.write_str("What to do:")?;
        for a in advice {
            write!(f, "\n  * {a}")?;
        }
        Ok(())
    }
}

impl CompatError {
    /// What to do about CPU mismatches, naming the templates that would help.
    fn cpu_advice(&self) -> String {
        let vendor = self
            .mismatches
            .iter()
            .any(|m| matches!(m, Mismatch::Vendor { .. }));
        let suggest = match self.host_templates.first() {
            Some(t) => format!(
                "take the snapshot under a CPU template this host satisfies ({}: tine run --cpu-template {t})",
                self.host_templates.join(", ")
            ),
            None => format!(
                "no built-in CPU template fits this host ({} need features it lacks): use a custom template (tine run --cpu-template FILE) with only features both hosts have",
                crate::template::builtin_names().join(", ")
            ),
        };
        match (&self.template, vendor) {
            (_, true) => format!(
                "restore on a host with the same CPU vendor (a CPU template cannot hide the vendor), with these CPU features, or {suggest}"
            ),
            (Some(t), false) => match self.host_templates.first() {
                Some(_) => format!(
                    "restore on a host that satisfies CPU template {t} (`tine cpu-templates` on a host lists the ones it satisfies), or {suggest}"
                ),
                None => format!(
                    "restore on a host that satisfies CPU template {t} (`tine cpu-templates` on a host lists the ones it satisfies)"
                ),
            },
            (None, false) => format!(
                "restore on a host with these CPU features (same vendor), or {suggest}"
            ),
        }
    }
}

impl HostCompat {
    /// Whether this host can run a vm under `template`: every feature the
    /// template requires (a `1` in a checked feature register) is in the
    /// offer, and every MSR it sets is listed. Names every gap.
    pub fn satisfies(&self, template: &Template) -> Result<(), Vec<Mismatch>> {
        let mut out: Vec<Mismatch> =
            missing_cpu_features(&required_features(template), &self.cpuid)
                .into_iter()
                .map(|bit| Mismatch::TemplateFeature {
                    template: template.name.clone(),
                    name: feature_name(bit),
                    bit,
                })
                .collect();
        out.extend(
            template
                .msr_modifiers
                .iter()
                .filter(|m| !self.msrs.contains(&m.addr))
                .map(|m| Mismatch::TemplateMsr {
                    template: template.name.clone(),
                    index: m.addr,
                }),
        );
        if out.is_empty() {
            Ok(())
        } else {
            Err(out)
        }
    }

    /// Names of the built-in templates this host satisfies.
    pub fn satisfied_templates(&self) -> Vec<String> {
        crate::template::builtins()
            .unwrap_or_default()
            .iter()
            .filter(|t| self.satisfies(t).is_ok())
            .map(|t| t.name.clone())
            .collect()
    }
}

/// The features `template` requires, as a CPUID list holding only its
/// `1` bits of the checked feature registers.
pub fn required_features(template: &Template) -> Vec<CpuidEntry> {
    let mut out: Vec<CpuidEntry> = Vec::new();
    for &(function, index, register, skip) in FEATURE_REGISTERS {
        let Some(b) = template.bitmap(function, index, register) else {
            continue;
        };
        let bits = (b.value & b.mask) as u32 & !skip;
        if bits == 0 {
            continue;
        }
        let i = match out.iter().position(|e| e.matches(function, index)) {
            Some(i) => i,
            None => {
                out.push(CpuidEntry {
                    function,
                    index,
                    flags: CPUID_FLAG_SIGNIFICANT_INDEX,
                    ..Default::default()
                });
                out.len() - 1
            }
        };
        *out[i].get_mut(register) |= bits;
    }
    out
}

/// Bits of (`leaf`, `register`) that tine or KVM set per vCPU, whatever a
/// template says: the APIC ID and logical processor count (leaf 1 EBX
/// 31:16), HYPERVISOR, HTT, OSXSAVE and OSPKE (mirrors of the guest's
/// CR4), the topology leaves 0xB and 0x1F, and the XSAVE area sizes
/// (leaf 0xD EBX, from the guest's XCR0).
pub fn vcpu_set_bits(leaf: u32, register: Register) -> u32 {
    match (leaf, register) {
        (0x1, Register::Ebx) => 0xffff_0000,
        (0x1, Register::Ecx) => (1 << 27) | (1 << 31),
        (0x1, Register::Edx) => 1 << 28,
        (0x7, Register::Ecx) => 1 << 4,
        (0xb | 0x1f, _) => u32::MAX,
        (0xd, Register::Ebx) => u32::MAX,
        _ => 0,
    }
}

/// Checks `saved` against what `host` offers (device layout, memory and
/// vCPU count are the snapshot's own).
pub fn check(saved: &Compat, host: &HostCompat) -> Result<(), CompatError> {
    check_restore(saved, host, &RestoreRequest::default())
}

/// Checks `saved` against `host` and against what the restore asks for.
/// Every mismatch is collected before returning.
pub fn check_restore(
    saved: &Compat,
    host: &HostCompat,
    request: &RestoreRequest,
) -> Result<(), CompatError> {
    let mut out = Vec::new();
    if !host.format_version.reads(saved.format_version) {
        out.push(Mismatch::FormatVersion {
            snapshot: saved.format_version,
            snapshot_tine: saved.tine_version.clone(),
            host: host.format_version,
            host_tine: host.tine_version.clone(),
        });
    }
    if saved.cpu_vendor != host.cpu_vendor {
        out.push(Mismatch::Vendor {
            snapshot: saved.cpu_vendor.clone(),
            host: host.cpu_vendor.clone(),
        });
    }
    // Under a template: the host must satisfy it (named as the template's
    // needs), and offer whatever else the guest saw (bits the template
    // passes through), named as today.
    let mut template_bits: Vec<CpuidBit> = Vec::new();
    if let Some(rec) = &saved.cpu_template {
        let found = rec.template.hash();
        if found != rec.hash {
            out.push(Mismatch::TemplateHash {
                template: rec.name.clone(),
                recorded: rec.hash.clone(),
                found,
            });
        }
        let mut template = rec.template.clone();
        template.name = rec.name.clone();
        if let Err(gaps) = host.satisfies(&template) {
            for m in &gaps {
                if let Mismatch::TemplateFeature { bit, .. } = m {
                    template_bits.push(*bit);
                }
            }
            out.extend(gaps);
        }
    }
    out.extend(
        missing_cpu_features(&saved.cpuid, &host.cpuid)
            .into_iter()
            .filter(|bit| !template_bits.contains(bit))
            .map(|bit| Mismatch::CpuFeature {
                name: feature_name(bit),
                bit,
            }),
    );
    out.extend(
        saved
            .msrs
            .iter()
            .filter(|i| !host.msrs.contains(i))
            .map(|&index| Mismatch::Msr { index }),
    );
    out.extend(
        saved
            .caps
            .iter()
            .filter(|c| !host.caps.iter().any(|h| h.number == c.number))
            .cloned()
            .map(Mismatch::Cap),
    );
    if let (Some(snapshot), Some(host_khz)) = (saved.tsc_khz, host.tsc_khz) {
        let diff = u64::from(snapshot.abs_diff(host_khz));
        let scales = host.caps.iter().any(|c| c.number == CAP_TSC_CONTROL);
        if diff * 1_000_000 > u64::from(snapshot) * TSC_KHZ_TOLERANCE_PPM && !scales {
            out.push(Mismatch::TscFrequency {
                snapshot,
                host: host_khz,
            });
        }
    }
    if let Some(devices) = &request.devices {
        if *devices != saved.devices {
            out.push(Mismatch::Devices {
                snapshot: saved.devices.clone(),
                requested: devices.clone(),
            });
        }
    }
    if let Some(mem) = request.mem_mib {
        if mem != saved.mem_mib {
            out.push(Mismatch::Memory {
                snapshot: saved.mem_mib,
                requested: mem,
            });
        }
    }
    if let Some(vcpus) = request.vcpus {
        if vcpus != saved.vcpus {
            out.push(Mismatch::Vcpus {
                snapshot: saved.vcpus,
                requested: vcpus,
            });
        }
    }
    if out.is_empty() {
        Ok(())
    } else {
        Err(CompatError {
            mismatches: out,
            snapshot_kernel: saved.host_kernel.clone(),
            host_kernel: host.kernel.clone(),
            template: saved.cpu_template.as_ref().map(|t| t.name.clone()),
            host_templates: host.satisfied_templates(),
        })
    }
}

/// The feature registers checked: (leaf, sub-leaf, register, bits to skip).
/// Skipped bits are not host features: OSXSAVE and OSPKE mirror the
/// guest's CR4, HYPERVISOR and HTT are set by tine's CPUID filter.
const FEATURE_REGISTERS: &[(u32, u32, Register, u32)] = &[
    (0x1, 0, Register::Ecx, (1 << 27) | (1 << 31)),
    (0x1, 0, Register::Edx, 1 << 28),
    (0x7, 0, Register::Ebx, 0),
    (0x7, 0, Register::Ecx, 1 << 4),
    (0x7, 0, Register::Edx, 0),
    (0x7, 1, Register::Eax, 0),
    // XSAVE state components (XCR0 bits): a saved XSAVE area with a
    // component this host lacks cannot be loaded.
    (0xd, 0, Register::Eax, 0),
    (0xd, 1, Register::Eax, 0),
    (0x8000_0001, 0, Register::Ecx, 0),
    (0x8000_0001, 0, Register::Edx, 0),
    (0x8000_0007, 0, Register::Edx, 0),
    (0x8000_0008, 0, Register::Ebx, 0),
];

/// ORs the feature bits of `from` into `into` (registers outside
/// [`FEATURE_REGISTERS`] are left alone; a feature leaf `into` lacks is
/// added with only its feature registers). For a host whose vCPUs get more
/// features than KVM_GET_SUPPORTED_CPUID lists (PVM passes the hardware's
/// through): `from` is what a vCPU reads back after KVM_SET_CPUID2.
pub fn merge_features(into: &mut Vec<CpuidEntry>, from: &[CpuidEntry]) {
    for &(function, index, register, _) in FEATURE_REGISTERS {
        let Some(f) = from.iter().find(|e| e.matches(function, index)) else {
            continue;
        };
        let bits = f.get(register);
        match into.iter_mut().find(|e| e.matches(function, index)) {
            Some(e) => *e.get_mut(register) |= bits,
            None => {
                let mut e = CpuidEntry {
                    function,
                    index,
                    flags: f.flags,
                    ..Default::default()
                };
                *e.get_mut(register) = bits;
                into.push(e);
            }
        }
    }
}

/// Every bit of [`FEATURE_REGISTERS`] set in `guest` and clear in `host`
/// (a leaf the host lacks offers nothing).
pub fn missing_cpu_features(guest: &[CpuidEntry], host: &[CpuidEntry]) -> Vec<CpuidBit> {
    let mut out = Vec::new();
    for &(function, index, register, skip) in FEATURE_REGISTERS {
        let Some(g) = guest.iter().find(|e| e.matches(function, index)) else {
            continue;
        };
        let offered = host
            .iter()
            .find(|e| e.matches(function, index))
            .map_or(0, |e| e.get(register));
        let missing = g.get(register) & !skip & !offered;
        out.extend(
            (0..32)
                .filter(|b| missing & (1 << b) != 0)
                .map(|bit| CpuidBit {
                    function,
                    index,
                    register,
                    bit,
                }),
        );
    }
    out
}

/// Linux's name for a feature bit, where it has a common one.
pub fn feature_name(bit: CpuidBit) -> Option<&'static str> {
    FEATURE_NAMES
        .iter()
        .find(|&&(f, i, r, b, _)| {
            f == bit.function && i == bit.index && r == bit.register && b == bit.bit
        })
        .map(|e| e.4)
}

/// (leaf, sub-leaf, register, bit, name), names as in /proc/cpuinfo.
const FEATURE_NAMES: &[(u32, u32, Register, u32, &str)] = &[
    (0x1, 0, Ecx, 0, "sse3"),
    (0x1, 0, Ecx, 1, "pclmulqdq"),
    (0x1, 0, Ecx, 3, "monitor"),
    (0x1, 0, Ecx, 5, "vmx"),
    (0x1, 0, Ecx, 9, "ssse3"),
    (0x1, 0, Ecx, 12, "fma"),
    (0x1, 0, Ecx, 13, "cx16"),
    (0x1, 0, Ecx, 17, "pcid"),
    (0x1, 0, Ecx, 19, "sse4_1"),
    (0x1, 0, Ecx, 20, "sse4_2"),
    (0x1, 0, Ecx, 21, "x2apic"),
    (0x1, 0, Ecx, 22, "movbe"),
    (0x1, 0, Ecx, 23, "popcnt"),
    (0x1, 0, Ecx, 24, "tsc_deadline_timer"),
    (0x1, 0, Ecx, 25, "aes"),
    (0x1, 0, Ecx, 26, "xsave"),
    (0x1, 0, Ecx, 28, "avx"),
    (0x1, 0, Ecx, 29, "f16c"),
    (0x1, 0, Ecx, 30, "rdrand"),
    (0x1, 0, Edx, 0, "fpu"),
    (0x1, 0, Edx, 1, "vme"),
    (0x1, 0, Edx, 2, "de"),
    (0x1, 0, Edx, 3, "pse"),
    (0x1, 0, Edx, 4, "tsc"),
    (0x1, 0, Edx, 5, "msr"),
    (0x1, 0, Edx, 6, "pae"),
    (0x1, 0, Edx, 7, "mce"),
    (0x1, 0, Edx, 8, "cx8"),
    (0x1, 0, Edx, 9, "apic"),
    (0x1, 0, Edx, 11, "sep"),
    (0x1, 0, Edx, 12, "mtrr"),
    (0x1, 0, Edx, 13, "pge"),
    (0x1, 0, Edx, 14, "mca"),
    (0x1, 0, Edx, 15, "cmov"),
    (0x1, 0, Edx, 16, "pat"),
    (0x1, 0, Edx, 17, "pse36"),
    (0x1, 0, Edx, 19, "clflush"),
    (0x1, 0, Edx, 23, "mmx"),
    (0x1, 0, Edx, 24, "fxsr"),
    (0x1, 0, Edx, 25, "sse"),
    (0x1, 0, Edx, 26, "sse2"),
    (0x7, 0, Ebx, 0, "fsgsbase"),
    (0x7, 0, Ebx, 1, "tsc_adjust"),
    (0x7, 0, Ebx, 3, "bmi1"),
    (0x7, 0, Ebx, 4, "hle"),
    (0x7, 0, Ebx, 5, "avx2"),
    (0x7, 0, Ebx, 7, "smep"),
    (0x7, 0, Ebx, 8, "bmi2"),
    (0x7, 0, Ebx, 9, "erms"),
    (0x7, 0, Ebx, 10, "invpcid"),
    (0x7, 0, Ebx, 11, "rtm"),
    (0x7, 0, Ebx, 14, "mpx"),
    (0x7, 0, Ebx, 16, "avx512f"),
    (0x7, 0, Ebx, 17, "avx512dq"),
    (0x7, 0, Ebx, 18, "rdseed"),
    (0x7, 0, Ebx, 19, "adx"),
    (0x7, 0, Ebx, 20, "smap"),
    (0x7, 0, Ebx, 21, "avx512ifma"),
    (0x7, 0, Ebx, 23, "clflushopt"),
    (0x7, 0, Ebx, 24, "clwb"),
    (0x7, 0, Ebx, 28, "avx512cd"),
    (0x7, 0, Ebx, 29, "sha_ni"),
    (0x7, 0, Ebx, 30, "avx512bw"),
    (0x7, 0, Ebx, 31, "avx512vl"),
    (0x7, 0, Ecx, 1, "avx512vbmi"),
    (0x7, 0, Ecx, 2, "umip"),
    (0x7, 0, Ecx, 3, "pku"),
    (0x7, 0, Ecx, 5, "waitpkg"),
    (0x7, 0, Ecx, 6, "avx512_vbmi2"),
    (0x7, 0, Ecx, 8, "gfni"),
    (0x7, 0, Ecx, 9, "vaes"),
    (0x7, 0, Ecx, 10, "vpclmulqdq"),
    (0x7, 0, Ecx, 11, "avx512_vnni"),
    (0x7, 0, Ecx, 12, "avx512_bitalg"),
    (0x7, 0, Ecx, 14, "avx512_vpopcntdq"),
    (0x7, 0, Ecx, 16, "la57"),
    (0x7, 0, Ecx, 22, "rdpid"),
    (0x7, 0, Ecx, 25, "cldemote"),
    (0x7, 0, Ecx, 27, "movdiri"),
    (0x7, 0, Ecx, 28, "movdir64b"),
    (0x7, 0, Edx, 4, "fsrm"),
    (0x7, 0, Edx, 8, "avx512_vp2intersect"),
    (0x7, 0, Edx, 10, "md_clear"),
    (0x7, 0, Edx, 14, "serialize"),
    (0x7, 0, Edx, 16, "tsxldtrk"),
    (0x7, 0, Edx, 22, "amx_bf16"),
    (0x7, 0, Edx, 23, "avx512_fp16"),
    (0x7, 0, Edx, 24, "amx_tile"),
    (0x7, 0, Edx, 25, "amx_int8"),
    (0x7, 0, Edx, 26, "spec_ctrl"),
    (0x7, 0, Edx, 27, "intel_stibp"),
    (0x7, 0, Edx, 28, "flush_l1d"),
    (0x7, 0, Edx, 29, "arch_capabilities"),
    (0x7, 0, Edx, 31, "ssbd"),
    (0x7, 1, Eax, 4, "avx_vnni"),
    (0x7, 1, Eax, 5, "avx512_bf16"),
    (0x7, 1, Eax, 26, "lam"),
    (0xd, 0, Eax, 0, "xsave state x87"),
    (0xd, 0, Eax, 1, "xsave state sse"),
    (0xd, 0, Eax, 2, "xsave state avx"),
    (0xd, 0, Eax, 3, "xsave state mpx bndregs"),
    (0xd, 0, Eax, 4, "xsave state mpx bndcsr"),
    (0xd, 0, Eax, 5, "xsave state avx512 opmask"),
    (0xd, 0, Eax, 6, "xsave state avx512 zmm_hi256"),
    (0xd, 0, Eax, 7, "xsave state avx512 hi16_zmm"),
    (0xd, 0, Eax, 9, "xsave state pkru"),
    (0xd, 0, Eax, 17, "xsave state amx tilecfg"),
    (0xd, 0, Eax, 18, "xsave state amx tiledata"),
    (0xd, 1, Eax, 0, "xsaveopt"),
    (0xd, 1, Eax, 1, "xsavec"),
    (0xd, 1, Eax, 2, "xgetbv1"),
    (0xd, 1, Eax, 3, "xsaves"),
    (0xd, 1, Eax, 4, "xfd"),
    (0x8000_0001, 0, Ecx, 0, "lahf_lm"),
    (0x8000_0001, 0, Ecx, 1, "cmp_legacy"),
    (0x8000_0001, 0, Ecx, 2, "svm"),
    (0x8000_0001, 0, Ecx, 3, "extapic"),
    (0x8000_0001, 0, Ecx, 4, "cr8_legacy"),
    (0x8000_0001, 0, Ecx, 5, "abm"),
    (0x8000_0001, 0, Ecx, 6, "sse4a"),
    (0x8000_0001, 0, Ecx, 7, "misalignsse"),
    (0x8000_0001, 0, Ecx, 8, "3dnowprefetch"),
    (0x8000_0001, 0, Ecx, 9, "osvw"),
    (0x8000_0001, 0, Ecx, 11, "xop"),
    (0x8000_0001, 0, Ecx, 16, "fma4"),
    (0x8000_0001, 0, Ecx, 21, "tbm"),
    (0x8000_0001, 0, Ecx, 22, "topoext"),
    (0x8000_0001, 0, Edx, 11, "syscall"),
    (0x8000_0001, 0, Edx, 20, "nx"),
    (0x8000_0001, 0, Edx, 22, "mmxext"),
    (0x8000_0001, 0, Edx, 25, "fxsr_opt"),
    (0x8000_0001, 0, Edx, 26, "pdpe1gb (1 GiB pages)"),
    (0x8000_0001, 0, Edx, 27, "rdtscp"),
    (0x8000_0001, 0, Edx, 29, "lm"),
    (0x8000_0007, 0, Edx, 8, "invtsc"),
    (0x8000_0008, 0, Ebx, 0, "clzero"),
    (0x8000_0008, 0, Ebx, 9, "wbnoinvd"),
    (0x8000_0008, 0, Ebx, 12, "amd_ibpb"),
    (0x8000_0008, 0, Ebx, 14, "amd_ibrs"),
    (0x8000_0008, 0, Ebx, 15, "amd_stibp"),
    (0x8000_0008, 0, Ebx, 24, "amd_ssbd"),
    (0x8000_0008, 0, Ebx, 25, "virt_ssbd"),
];

/// Names of MSRs a mismatch commonly involves.
fn msr_name(index: u32) -> Option<&'static str> {
    Some(match index {
        0x10 => "IA32_TSC",
        0x3a => "IA32_FEATURE_CONTROL",
        0x3b => "IA32_TSC_ADJUST",
        0x48 => "IA32_SPEC_CTRL",
        0x10a => "IA32_ARCH_CAPABILITIES",
        0x1a0 => "IA32_MISC_ENABLE",
        0x6e0 => "IA32_TSC_DEADLINE",
        0xc000_0080 => "EFER",
        0xc000_0103 => "TSC_AUX",
        0xda0 => "IA32_XSS",
        0x4b56_4d00..=0x4b56_4dff => "KVM paravirtual MSR",
        _ => return None,
    })
}
