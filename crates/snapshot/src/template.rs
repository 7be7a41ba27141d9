//! CPU templates (docs/design/cpu-templates.md): a named, normalized CPUID
//! (and MSR) baseline a vm is started under, so that what its guest sees
//! does not depend on the host it first ran on, and a snapshot of it wakes
//! on any host whose offer satisfies the template.
//!
//! The shape is Firecracker's custom CPU template: per CPUID leaf and
//! sub-leaf, one bitmap per register, written MSB first as `0b` and 32
//! characters, each `0` (the guest sees 0), `1` (the guest sees 1) or `x`
//! (the host's bit passes through); MSR modifiers the same with 64
//! characters. tine adds `name` and `description`. Built-in templates are
//! the JSON files in `crates/snapshot/templates/`, compiled in, so a
//! custom template starts as a copy of one (`tine cpu-templates show t2`).
//!
//! A `1` in a feature register ([`crate::compat`]'s checked set) is a
//! feature the template *requires*: a host whose offer lacks it does not
//! satisfy the template, and a vm is not started under it there.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::compat::{CpuidEntry, Register};

/// The built-in templates: (name, JSON).
const BUILTIN: &[(&str, &str)] = &[
    ("t2", include_str!("../templates/t2.json")),
    ("t2s", include_str!("../templates/t2s.json")),
];

/// The built-in template tine suggests when a snapshot will not move.
pub const DEFAULT_TEMPLATE: &str = "t2";

/// Bits a template sets: `mask` has a 1 for every bit the template
/// defines, `value` their values (0 outside `mask`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bitmap {
    pub mask: u64,
    pub value: u64,
}

impl Bitmap {
    /// `v` with the defined bits replaced.
    pub fn apply(&self, v: u64) -> u64 {
        (v & !self.mask) | (self.value & self.mask)
    }

    fn parse(s: &str, width: u32) -> Result<Self, String> {
        let Some(digits) = s.strip_prefix("0b") else {
            return Err(format!(
                "bitmap {s:?} must start with 0b and have {width} characters of 0, 1 or x (most significant bit first)"
            ));
        };
        if digits.chars().count() != width as usize {
            return Err(format!(
                "bitmap {s:?} has {} characters after 0b; it needs exactly {width} (0, 1 or x, most significant bit first)",
                digits.chars().count()
            ));
        }
        let mut out = Bitmap::default();
        for (i, c) in digits.chars().enumerate() {
            let bit = width - 1 - i as u32;
            match c {
                '0' => out.mask |= 1 << bit,
                '1' => {
                    out.mask |= 1 << bit;
                    out.value |= 1 << bit;
                }
                'x' | 'X' => {}
                other => {
                    return Err(format!(
                        "bitmap {s:?} has {other:?} for bit {bit}; use 0, 1 or x"
                    ))
                }
            }
        }
        Ok(out)
    }

    fn render(&self, width: u32) -> String {
        let mut s = String::with_capacity(width as usize + 2);
        s.push_str("0b");
        for bit in (0..width).rev() {
            s.push(if self.mask & (1 << bit) == 0 {
                'x'
            } else if self.value & (1 << bit) != 0 {
                '1'
            } else {
                '0'
            });
        }
        s
    }
}

/// One register of one CPUID leaf.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegisterModifier {
    pub register: Register,
    /// 32 bits wide.
    pub bitmap: Bitmap,
}

/// The registers a template sets in one CPUID leaf and sub-leaf.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuidModifier {
    pub leaf: u32,
    pub subleaf: u32,
    /// KVM_CPUID_FLAG_* of the entry (1: the sub-leaf is significant),
    /// used when the host's list lacks the leaf and the template adds it.
    pub flags: u32,
    pub modifiers: Vec<RegisterModifier>,
}

/// The bits a template sets in one MSR's initial value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MsrModifier {
    pub addr: u32,
    /// 64 bits wide.
    pub bitmap: Bitmap,
}

/// A validated CPU template. (De)serializes as its JSON form.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawTemplate", into = "RawTemplate")]
pub struct Template {
    pub name: String,
    pub description: String,
    /// Sorted by (leaf, sub-leaf), one per pair.
    pub cpuid_modifiers: Vec<CpuidModifier>,
    /// Sorted by address, one per MSR.
    pub msr_modifiers: Vec<MsrModifier>,
}

/// Why a template was refused.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("CPU template {0:?} is neither a built-in template ({list}) nor a file", list = builtin_names().join(", "))]
    Unknown(String),
    #[error("Cannot read CPU template {path}: {source}")]
    Read {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("CPU template {origin} is not valid JSON of a CPU template: {source}")]
    Json {
        origin: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("CPU template {origin}: {what}")]
    Invalid { origin: String, what: String },
}

/// The JSON form (Firecracker's custom template, plus name and description).
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTemplate {
    #[serde(default)]
    name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    description: String,
    #[serde(default)]
    cpuid_modifiers: Vec<RawCpuid>,
    #[serde(default)]
    msr_modifiers: Vec<RawMsr>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCpuid {
    leaf: Number,
    #[serde(default)]
    subleaf: Option<Number>,
    #[serde(default)]
    flags: u32,
    modifiers: Vec<RawRegister>,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRegister {
    register: String,
    bitmap: String,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMsr {
    addr: Number,
    bitmap: String,
}

/// A number as Firecracker writes them (`"0x1f"`, `"0b101"`), or a plain
/// JSON number.
#[derive(Debug, Serialize, Deserialize)]
#[serde(untagged)]
enum Number {
    Int(u64),
    Text(String),
}

impl Number {
    fn hex(v: u32) -> Self {
        Number::Text(format!("{v:#x}"))
    }

    fn value(&self, what: &str) -> Result<u32, String> {
        let v = match self {
            Number::Int(v) => *v,
            Number::Text(s) => {
                let parsed = if let Some(h) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X"))
                {
                    u64::from_str_radix(h, 16)
                } else if let Some(b) = s.strip_prefix("0b") {
                    u64::from_str_radix(b, 2)
                } else {
                    s.parse()
                };
                parsed.map_err(|_| {
                    format!("{what} {s:?} is not a number (write it as \"0x1f\", \"0b101\" or 31)")
                })?
            }
        };
        u32::try_from(v).map_err(|_| format!("{what} {v:#x} does not fit in 32 bits"))
    }
}

impl TryFrom<RawTemplate> for Template {
    type Error = String;

    fn try_from(raw: RawTemplate) -> Result<Self, String> {
        let mut cpuid_modifiers = Vec::with_capacity(raw.cpuid_modifiers.len());
        for (i, c) in raw.cpuid_modifiers.iter().enumerate() {
            let leaf = c
                .leaf
                .value("leaf")
                .map_err(|e| format!("cpuid_modifiers[{i}]: {e}"))?;
            let subleaf = match &c.subleaf {
                Some(s) => s
                    .value("subleaf")
                    .map_err(|e| format!("cpuid_modifiers[{i}]: {e}"))?,
                None => 0,
            };
            let at = format!("cpuid_modifiers[{i}] (leaf {leaf:#x}, subleaf {subleaf:#x})");
            if c.flags & !crate::compat::CPUID_FLAG_SIGNIFICANT_INDEX != 0 {
                return Err(format!(
                    "{at}: flags {:#x}: only 0 or 1 (the sub-leaf is significant) are allowed",
                    c.flags
                ));
            }
            if c.modifiers.is_empty() {
                return Err(format!("{at}: no register modifiers"));
            }
            let mut modifiers: Vec<RegisterModifier> = Vec::new();
            for r in &c.modifiers {
                let register = match r.register.to_ascii_lowercase().as_str() {
                    "eax" => Register::Eax,
                    "ebx" => Register::Ebx,
                    "ecx" => Register::Ecx,
                    "edx" => Register::Edx,
                    other => {
                        return Err(format!(
                            "{at}: register {other:?} is not one of eax, ebx, ecx, edx"
                        ))
                    }
                };
                if modifiers.iter().any(|m| m.register == register) {
                    return Err(format!("{at}: register {register} is modified twice"));
                }
                let bitmap =
                    Bitmap::parse(&r.bitmap, 32).map_err(|e| format!("{at}, {register}: {e}"))?;
                modifiers.push(RegisterModifier { register, bitmap });
            }
            modifiers.sort_by_key(|m| m.register as u8);
            if cpuid_modifiers
                .iter()
                .any(|m: &CpuidModifier| m.leaf == leaf && m.subleaf == subleaf)
            {
                return Err(format!("{at}: this leaf and subleaf appear twice"));
            }
            cpuid_modifiers.push(CpuidModifier {
                leaf,
                subleaf,
                flags: c.flags,
                modifiers,
            });
        }
        cpuid_modifiers.sort_by_key(|m| (m.leaf, m.subleaf));
        let mut msr_modifiers: Vec<MsrModifier> = Vec::with_capacity(raw.msr_modifiers.len());
        for (i, m) in raw.msr_modifiers.iter().enumerate() {
            let addr = m
                .addr
                .value("addr")
                .map_err(|e| format!("msr_modifiers[{i}]: {e}"))?;
            let at = format!("msr_modifiers[{i}] (MSR {addr:#x})");
            if msr_modifiers.iter().any(|o| o.addr == addr) {
                return Err(format!("{at}: this MSR appears twice"));
            }
            let bitmap = Bitmap::parse(&m.bitmap, 64).map_err(|e| format!("{at}: {e}"))?;
            msr_modifiers.push(MsrModifier { addr, bitmap });
        }
        msr_modifiers.sort_by_key(|m| m.addr);
        let name = raw.name.trim().to_string();
        if !name.is_empty() && !valid_name(&name) {
            return Err(format!(
                "name {name:?}: use letters, digits, '-', '_' and '.' (at most 64)"
            ));
        }
        Ok(Template {
            name,
            description: raw.description,
            cpuid_modifiers,
            msr_modifiers,
        })
    }
}

impl From<Template> for RawTemplate {
    fn from(t: Template) -> Self {
        RawTemplate {
            name: t.name,
            description: t.description,
            cpuid_modifiers: t
                .cpuid_modifiers
                .iter()
                .map(|c| RawCpuid {
                    leaf: Number::hex(c.leaf),
                    subleaf: Some(Number::hex(c.subleaf)),
                    flags: c.flags,
                    modifiers: c
                        .modifiers
                        .iter()
                        .map(|m| RawRegister {
                            register: m.register.to_string().to_ascii_lowercase(),
                            bitmap: m.bitmap.render(32),
                        })
                        .collect(),
                })
                .collect(),
            msr_modifiers: t
                .msr_modifiers
                .iter()
                .map(|m| RawMsr {
                    addr: Number::hex(m.addr),
                    bitmap: m.bitmap.render(64),
                })
                .collect(),
        }
    }
}

fn valid_name(name: &str) -> bool {
    name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl Template {
    /// Parses a template's JSON; `origin` names it in errors, and is its
    /// name when the JSON has none.
    pub fn parse(json: &str, origin: &str) -> Result<Self, TemplateError> {
        Self::parse_named(json, origin, origin)
    }

    fn parse_named(json: &str, origin: &str, default_name: &str) -> Result<Self, TemplateError> {
        let mut t: Template =
            serde_json::from_str(json).map_err(|source| classify(source, origin))?;
        if t.name.is_empty() {
            t.name = default_name.to_string();
        }
        if !valid_name(&t.name) {
            return Err(TemplateError::Invalid {
                origin: origin.into(),
                what: format!(
                    "name {:?}: use letters, digits, '-', '_' and '.' (at most 64); give the template a \"name\"",
                    t.name
                ),
            });
        }
        Ok(t)
    }

    /// Reads a template file (its name: the JSON's, else the file stem).
    pub fn from_file(path: &Path) -> Result<Self, TemplateError> {
        let text = std::fs::read_to_string(path).map_err(|source| TemplateError::Read {
            path: path.into(),
            source,
        })?;
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        Self::parse_named(&text, &path.display().to_string(), &stem)
    }

    /// Content hash (BLAKE3, hex) of what the template sets: its CPUID and
    /// MSR modifiers in canonical form. Name, description and JSON layout
    /// do not change it.
    pub fn hash(&self) -> String {
        let mut h = blake3::Hasher::new();
        h.update(b"tine cpu template v1\n");
        for c in &self.cpuid_modifiers {
            for m in &c.modifiers {
                h.update(
                    format!(
                        "cpuid {:#x} {:#x} {} {} {}\n",
                        c.leaf,
                        c.subleaf,
                        c.flags,
                        m.register,
                        m.bitmap.render(32)
                    )
                    .as_bytes(),
                );
            }
        }
        for m in &self.msr_modifiers {
            h.update(format!("msr {:#x} {}\n", m.addr, m.bitmap.render(64)).as_bytes());
        }
        h.finalize().to_hex().to_string()
    }

    /// The template as pretty JSON (the custom template format).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// The bitmap the template sets for `register` of (`leaf`, `subleaf`).
    pub fn bitmap(&self, leaf: u32, subleaf: u32, register: Register) -> Option<Bitmap> {
        self.cpuid_modifiers
            .iter()
            .find(|c| c.leaf == leaf && c.subleaf == subleaf)?
            .modifiers
            .iter()
            .find(|m| m.register == register)
            .map(|m| m.bitmap)
    }

    /// Applies the CPUID modifiers to `cpuid` (a host's list): defined
    /// bits are set as the template says; a leaf the list lacks is added
    /// with the template's bits (the rest 0).
    pub fn apply_cpuid(&self, cpuid: &mut Vec<CpuidEntry>) {
        for c in &self.cpuid_modifiers {
            let idx = match cpuid.iter().position(|e| e.matches(c.leaf, c.subleaf)) {
                Some(i) => i,
                None => {
                    cpuid.push(CpuidEntry {
                        function: c.leaf,
                        index: c.subleaf,
                        flags: c.flags,
                        ..Default::default()
                    });
                    cpuid.len() - 1
                }
            };
            let e = &mut cpuid[idx];
            for m in &c.modifiers {
                let r = e.get_mut(m.register);
                *r = m.bitmap.apply(u64::from(*r)) as u32;
            }
        }
    }

    /// Every bit the template defines that `cpuid` (what a vCPU got) does
    /// not have as defined, leaving out `skip` bits (those tine itself
    /// sets per vCPU: topology, HYPERVISOR, HTT, and the bits that mirror
    /// the guest's CR4). A leaf the vCPU lacks counts as all zeroes.
    pub fn differences(&self, cpuid: &[CpuidEntry]) -> Vec<crate::compat::CpuidBit> {
        let mut out = Vec::new();
        for c in &self.cpuid_modifiers {
            let e = cpuid.iter().find(|e| e.matches(c.leaf, c.subleaf));
            for m in &c.modifiers {
                let got = e.map_or(0, |e| e.get(m.register));
                let skip = crate::compat::vcpu_set_bits(c.leaf, m.register);
                let wrong = (u64::from(got) ^ m.bitmap.value) & m.bitmap.mask & !u64::from(skip);
                out.extend((0..32).filter(|b| wrong & (1 << b) != 0).map(|bit| {
                    crate::compat::CpuidBit {
                        function: c.leaf,
                        index: c.subleaf,
                        register: m.register,
                        bit,
                    }
                }));
            }
        }
        out
    }
}

impl fmt::Display for Template {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hash = self.hash();
        write!(f, "{} ({})", self.name, &hash[..12])
    }
}

/// Tells a JSON syntax error from a shape error (a leaf that is not a
/// number, a bitmap of the wrong length: serde carries our message).
fn classify(source: serde_json::Error, origin: &str) -> TemplateError {
    use serde_json::error::Category;
    match source.classify() {
        Category::Data => TemplateError::Invalid {
            origin: origin.into(),
            what: source.to_string(),
        },
        _ => TemplateError::Json {
            origin: origin.into(),
            source,
        },
    }
}

/// Names of the built-in templates.
pub fn builtin_names() -> Vec<&'static str> {
    BUILTIN.iter().map(|(n, _)| *n).collect()
}

/// The built-in template called `name` (case-insensitive), if there is one.
pub fn builtin(name: &str) -> Option<Result<Template, TemplateError>> {
    BUILTIN
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(n, json)| Template::parse(json, n))
}

/// Every built-in template.
pub fn builtins() -> Result<Vec<Template>, TemplateError> {
    BUILTIN
        .iter()
        .map(|(n, json)| Template::parse(json, n))
        .collect()
}

/// `--cpu-template NAME|FILE`: a built-in template by name, else a file.
pub fn resolve(spec: &str) -> Result<Template, TemplateError> {
    if let Some(t) = builtin(spec) {
        return t;
    }
    let path = Path::new(spec);
    if path.exists() || spec.contains('/') || spec.ends_with(".json") {
        return Template::from_file(path);
    }
    Err(TemplateError::Unknown(spec.to_string()))
}

/// What a snapshot's manifest records about the template its vm ran
/// under: the name, the content hash, and the template itself, so a host
/// that does not have a custom template's file can still check it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateRecord {
    pub name: String,
    pub hash: String,
    pub template: Template,
}

impl TemplateRecord {
    pub fn of(template: &Template) -> Self {
        TemplateRecord {
            name: template.name.clone(),
            hash: template.hash(),
            template: template.clone(),
        }
    }
}
