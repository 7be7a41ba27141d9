//! A snapshot directory: `memory` (guest RAM, a sparse file at the RAM's
//! layout), `state` (the [`Moment`] in tine-snapshot's envelope) and
//! `manifest.json` (what it needs to be restored; written last, so a
//! directory without it is not a snapshot). Disks are referenced as
//! frozen layers, not copied.

use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use crate::fork::ForkParts;
use crate::moment::{DeviceLayout, Moment};

pub const MANIFEST: &str = "manifest.json";
pub const MEMORY: &str = "memory";
pub const STATE: &str = "state";
/// A memory layer ([`crate::layer`]), written instead of [`MEMORY`] by
/// [`write_layer`].
pub const MEMORY_LAYER: &str = "memory.layer";

/// What a snapshot needs to be restored. Untrusted on the way in (it
/// moves between hosts): [`load`] checks its version first, refuses
/// unknown fields, checks it against the state's seal (the state's
/// envelope binds the manifest's bytes) and against this host.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// tine that wrote it.
    pub tine_version: String,
    /// State format of `state` (tine-snapshot), "major.minor".
    pub format_version: snapshot::Version,
    pub name: String,
    pub created_ms: u64,
    pub mem_mib: u64,
    pub vcpus: usize,
    pub layout: DeviceLayout,
    /// Every disk in order: a frozen layer (stack an overlay on it) or a
    /// read-only image attached as it is.
    pub disks: Vec<SnapshotDisk>,
    /// The vsock's guest CID, if the vm has a vsock.
    pub vsock_cid: Option<u64>,
    /// Bytes of data in `memory` (the rest are holes).
    pub memory_bytes: u64,
    /// What the host must offer to restore it (checked first).
    pub compat: snapshot::compat::Compat,
    /// The vm's fork contract (TOML, see crates/contract): how copies
    /// restored from this snapshot wake up. Names and policies only.
    #[serde(default)]
    pub contract: Option<String>,
    /// Set when memory was written as a layer (`memory.layer`, for the
    /// store) instead of `memory`: a full layer, or a diff against its
    /// base. Such a directory is not restored with `--from` directly.
    #[serde(default)]
    pub memory_layer: Option<crate::layer::LayerInfo>,
}

/// A disk of a snapshot.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotDisk {
    pub path: PathBuf,
    /// A frozen layer (true) or a read-only base (false).
    pub frozen: bool,
}

/// Errors writing or reading a snapshot directory.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotDirError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0} already holds a snapshot; choose an empty or new directory")]
    NotEmpty(PathBuf),
    #[error("{0} is not a tine snapshot (no manifest.json)")]
    NotASnapshot(PathBuf),
    #[error("{path} is not a valid manifest: {source}")]
    Manifest {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("{path}: {source}")]
    State {
        path: PathBuf,
        #[source]
        source: snapshot::StateError,
    },
    #[error("{path} has {found} bytes but the snapshot's memory is {want} bytes: the file is truncated or not this snapshot's")]
    MemorySize {
        path: PathBuf,
        found: u64,
        want: u64,
    },
    #[error("The manifest and the state disagree: {0}")]
    Mismatch(String),
    #[error(transparent)]
    Layer(#[from] crate::layer::LayerError),
    #[error("The vm's dirty base is {found:?}, the layer asked for a diff against {want:?}")]
    Base { want: String, found: Option<String> },
    #[error("Cannot read this host's KVM capabilities")]
    Host(#[from] crate::compat::CompatCollectError),
    #[error("{path} is snapshot format {found}; this tine reads {} and older minor versions of {}.x: restore it with a tine that reads it", snapshot::FORMAT_VERSION, snapshot::FORMAT_VERSION.major)]
    Version {
        path: PathBuf,
        found: snapshot::Version,
    },
    #[error("{path}: the snapshot asks for {what}; {limit}")]
    Machine {
        path: PathBuf,
        what: String,
        limit: String,
    },
    #[error("{dir} cannot be restored on this host:\n{source}")]
    Incompatible {
        dir: PathBuf,
        #[source]
        source: Box<snapshot::compat::CompatError>,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotDirError + '_ {
    move |source| SnapshotDirError::Io {
        path: path.into(),
        source,
    }
}

/// Writes `parts` (a frozen, private view) to `dir`; returns the bytes of
/// memory data written. Only pages the guest ever populated are read
/// (mincore), so untouched RAM costs nothing and stays a hole.
pub fn write(
    parts: &ForkParts,
    dir: &Path,
    name: &str,
    contract: Option<&str>,
) -> Result<u64, SnapshotDirError> {
    start_dir(dir)?;
    let mem_path = dir.join(MEMORY);
    let file = File::create(&mem_path).map_err(io(&mem_path))?;
    let total: u64 = parts.mem.iter().map(|r| r.len()).sum();
    file.set_len(total).map_err(io(&mem_path))?;
    let mut offset = 0u64;
    let mut written = 0u64;
    for region in parts.mem.iter() {
        written += write_region(&file, region.as_ptr(), region.len() as usize, offset)
            .map_err(io(&mem_path))?;
        offset += region.len();
    }
    file.sync_all().map_err(io(&mem_path))?;
    finish(parts, dir, name, contract, written, None)?;
    Ok(written)
}

/// Writes `parts` to `dir` like [`write()`], with memory as a layer in
/// `memory.layer` ([`crate::layer`]): all populated non-zero memory, or
/// the pages dirtied since the base (the set is in `parts.mem`'s bitmaps,
/// collected at the moment). Returns what the layer holds.
pub fn write_layer(
    parts: &ForkParts,
    dir: &Path,
    name: &str,
    contract: Option<&str>,
    mode: &crate::layer::LayerMode,
) -> Result<crate::layer::LayerInfo, SnapshotDirError> {
    use crate::layer::LayerMode;
    use crate::layer::{self, Selection};
    start_dir(dir)?;
    let path = dir.join(MEMORY_LAYER);
    let info = match mode {
        LayerMode::Full => layer::write(&parts.mem, Selection::Populated, None, &path)?,
        LayerMode::Diff(base) => {
            if parts.dirty.base.as_ref() != Some(base) || !parts.dirty.enabled {
                return Err(SnapshotDirError::Base {
                    want: base.clone(),
                    found: parts.dirty.base.clone(),
                });
            }
            let pages = crate::dirty::read(&parts.mem);
            layer::write(&parts.mem, Selection::Pages(&pages), Some(base), &path)?
        }
    };
    finish(
        parts,
        dir,
        name,
        contract,
        info.data_bytes,
        Some(info.clone()),
    )?;
    Ok(info)
}

fn start_dir(dir: &Path) -> Result<(), SnapshotDirError> {
    fs::create_dir_all(dir).map_err(io(dir))?;
    if dir.join(MANIFEST).exists() {
        return Err(SnapshotDirError::NotEmpty(dir.into()));
    }
    Ok(())
}

/// Writes `state`, then `manifest.json` (last: it makes the directory a
/// snapshot).
fn finish(
    parts: &ForkParts,
    dir: &Path,
    name: &str,
    contract: Option<&str>,
    written: u64,
    memory_layer: Option<crate::layer::LayerInfo>,
) -> Result<(), SnapshotDirError> {
    let config = &parts.config;
    let host = crate::compat::host_compat(&config.kvm_device)?;
    let mut compat = crate::compat::snapshot_compat(
        &parts.moment.machine,
        parts.moment.layout.kinds(),
        parts.moment.mem_mib,
        &host,
    );
    compat.cpu_template = config
        .cpu_template
        .as_ref()
        .map(snapshot::template::TemplateRecord::of);
    let disks = config
        .disks
        .iter()
        .enumerate()
        .map(|(i, d)| match parts.disks.iter().find(|f| f.index == i) {
            Some(f) => SnapshotDisk {
                path: f.frozen.clone(),
                frozen: true,
            },
            None => SnapshotDisk {
                path: d.path.clone(),
                frozen: false,
            },
        })
        .collect();
    let manifest = Manifest {
        tine_version: env!("CARGO_PKG_VERSION").into(),
        format_version: snapshot::FORMAT_VERSION,
        name: name.into(),
        created_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0),
        mem_mib: parts.moment.mem_mib,
        vcpus: parts.moment.machine.vcpus.len(),
        layout: parts.moment.layout,
        disks,
        vsock_cid: config.vsock.as_ref().map(|v| v.guest_cid),
        memory_bytes: written,
        compat,
        contract: contract.map(str::to_owned),
        memory_layer,
    };
    write_sealed(dir, &manifest, &parts.moment)
}

/// Writes `state` sealed to `manifest`'s bytes (and this host's key, if
/// one is configured), then `manifest.json` (last: it makes the directory
/// a snapshot).
fn write_sealed(dir: &Path, manifest: &Manifest, moment: &Moment) -> Result<(), SnapshotDirError> {
    let json = serde_json::to_vec_pretty(manifest).map_err(|e| SnapshotDirError::Manifest {
        path: dir.join(MANIFEST),
        source: e,
    })?;
    let state_path = dir.join(STATE);
    let state_err = |source| SnapshotDirError::State {
        path: state_path.clone(),
        source,
    };
    let key = snapshot::Key::from_env().map_err(state_err)?;
    let seal = snapshot::Seal::of_manifest(&json, key.as_ref());
    let bytes = snapshot::encode_sealed(moment, &seal).map_err(state_err)?;
    write_synced(&state_path, &bytes)?;
    let tmp = dir.join("manifest.json.tmp");
    write_synced(&tmp, &json)?;
    let path = dir.join(MANIFEST);
    fs::rename(&tmp, &path).map_err(io(&path))?;
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Rewrites a snapshot directory's manifest as `manifest` (the host
/// changed where its disks are, say) and seals its state anew to it. The
/// state is checked against the old manifest first, so a directory that
/// did not verify is never re-sealed.
pub fn reseal(dir: &Path, manifest: &Manifest) -> Result<(), SnapshotDirError> {
    let (_, moment) = load_unchecked_memory(dir)?;
    let _ = fs::remove_file(dir.join(MANIFEST));
    write_sealed(dir, manifest, &moment)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), SnapshotDirError> {
    let mut f = File::create(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

/// Writes the populated pages of one mapped region at `offset`.
fn write_region(file: &File, base: *mut u8, len: usize, offset: u64) -> std::io::Result<u64> {
    const PAGE: usize = 4096;
    let pages = len / PAGE;
    let mut vec = vec![0u8; pages];
    // SAFETY: `base..base+len` is one live mapping of guest RAM and `vec`
    // has one byte per page, as mincore(2) requires.
    let rc = unsafe { libc::mincore(base.cast(), len, vec.as_mut_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut written = 0u64;
    let mut p = 0;
    while p < pages {
        if vec[p] & 1 == 0 {
            p += 1;
            continue;
        }
        let start = p;
        while p < pages && vec[p] & 1 == 1 && p - start < 256 {
            p += 1;
        }
        // SAFETY: the run lies inside the mapping; the process is a frozen
        // view nobody writes while it is read.
        let run = unsafe { std::slice::from_raw_parts(base.add(start * PAGE), (p - start) * PAGE) };
        // Zero pages stay holes.
        for (i, page) in run.chunks(PAGE).enumerate() {
            if page.iter().any(|&b| b != 0) {
                file.write_all_at(page, offset + ((start + i) * PAGE) as u64)?;
                written += PAGE as u64;
            }
        }
    }
    Ok(written)
}

/// Reads and checks a snapshot directory's manifest and state: the
/// manifest's version (first, so an old or new format is named rather
/// than misparsed), its fields, the state's seal (which binds the
/// manifest), the machine it asks for against this host's limits, and the
/// memory file's size.
pub fn load(dir: &Path) -> Result<(Manifest, Moment), SnapshotDirError> {
    let (manifest, moment) = load_unchecked_memory(dir)?;
    let mem_path = dir.join(MEMORY);
    let found = fs::metadata(&mem_path).map_err(io(&mem_path))?.len();
    let want: u64 = moment.ram_regions().iter().map(|r| r.1 as u64).sum();
    if found != want {
        return Err(SnapshotDirError::MemorySize {
            path: mem_path,
            found,
            want,
        });
    }
    Ok((manifest, moment))
}

/// [`load`] without the memory file (a directory for the store holds a
/// memory layer instead).
fn load_unchecked_memory(dir: &Path) -> Result<(Manifest, Moment), SnapshotDirError> {
    let path = dir.join(MANIFEST);
    let text = match fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(SnapshotDirError::NotASnapshot(dir.into()))
        }
        Err(e) => return Err(io(&path)(e)),
    };
    let manifest = parse_manifest(&path, &text)?;
    let state_path = dir.join(STATE);
    let bytes = fs::read(&state_path).map_err(io(&state_path))?;
    let state_err = |source| SnapshotDirError::State {
        path: state_path.clone(),
        source,
    };
    let key = snapshot::Key::from_env().map_err(state_err)?;
    let seal = snapshot::Seal::of_manifest(&text, key.as_ref());
    let moment: Moment = snapshot::decode_sealed(&bytes, &seal).map_err(state_err)?;
    if moment.mem_mib != manifest.mem_mib
        || moment.layout != manifest.layout
        || moment.machine.vcpus.len() != manifest.vcpus
    {
        return Err(SnapshotDirError::Mismatch(format!(
            "manifest says {} MiB, {} vCPU(s) and {}, state says {} MiB, {} vCPU(s) and {}",
            manifest.mem_mib,
            manifest.vcpus,
            manifest.layout,
            moment.mem_mib,
            moment.machine.vcpus.len(),
            moment.layout
        )));
    }
    Ok((manifest, moment))
}

/// Parses a manifest: its format version first, then the rest (unknown
/// fields refused), then the machine it asks for against this host.
pub fn parse_manifest(path: &Path, text: &[u8]) -> Result<Manifest, SnapshotDirError> {
    #[derive(Deserialize)]
    struct Head {
        format_version: Option<snapshot::Version>,
    }
    let bad = |source| SnapshotDirError::Manifest {
        path: path.into(),
        source,
    };
    let head: Head = serde_json::from_slice(text).map_err(bad)?;
    if let Some(found) = head.format_version {
        if !snapshot::FORMAT_VERSION.reads(found) {
            return Err(SnapshotDirError::Version {
                path: path.into(),
                found,
            });
        }
    }
    let manifest: Manifest = serde_json::from_slice(text).map_err(bad)?;
    check_machine(path, &manifest)?;
    Ok(manifest)
}

/// The machine a manifest asks for, against the limits a boot applies
/// ([`crate::VmConfig::validate`]) and this host's memory.
fn check_machine(path: &Path, m: &Manifest) -> Result<(), SnapshotDirError> {
    use crate::config::{ConfigError, MAX_VCPUS};
    let machine = |what: String, limit: String| SnapshotDirError::Machine {
        path: path.into(),
        what,
        limit,
    };
    let vcpus = u8::try_from(m.vcpus)
        .ok()
        .filter(|n| (1..=MAX_VCPUS).contains(n))
        .ok_or_else(|| {
            machine(
                format!("{} vCPUs", m.vcpus),
                format!("tine runs 1 to {MAX_VCPUS}"),
            )
        })?;
    let config = crate::VmConfig {
        mem_mib: m.mem_mib,
        vcpus,
        ..crate::VmConfig::default()
    };
    match config.validate() {
        Ok(()) | Err(ConfigError::KernelMissing(_)) => {}
        Err(e) => {
            return Err(machine(
                format!("{} MiB of memory", m.mem_mib),
                e.to_string(),
            ))
        }
    }
    if m.disks.len() + usize::from(m.vsock_cid.is_some()) > 16 {
        return Err(machine(
            format!("{} disks", m.disks.len()),
            "a vm has at most 16 devices".into(),
        ));
    }
    if let Some(cid) = m.vsock_cid {
        if cid <= 2 || cid > u64::from(u32::MAX) {
            return Err(machine(
                format!("vsock CID {cid}"),
                "a guest CID is 3 to 2^32-1".into(),
            ));
        }
    }
    Ok(())
}

/// Checks that this host can run the snapshot (the compatibility set in
/// the manifest) before anything is created; names every mismatch.
pub fn check_host(dir: &Path, manifest: &Manifest, kvm: &Path) -> Result<(), SnapshotDirError> {
    let host = crate::compat::host_compat(kvm)?;
    snapshot::compat::check(&manifest.compat, &host).map_err(|source| {
        SnapshotDirError::Incompatible {
            dir: dir.into(),
            source: Box::new(source),
        }
    })
}
