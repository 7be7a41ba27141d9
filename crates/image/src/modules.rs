//! Kernel modules for the initramfs: find them in an unpacked kernel package
//! and order them so that every module comes after the modules it depends on.
//!
//! Dependencies come from each module's own `.modinfo` (`depends=`), the same
//! data `depmod` reads, so no `modules.dep` (and no kmod) is needed.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use crate::{elf, ImageError};

/// Modules the guest needs for its virtio-mmio devices; their dependencies
/// (virtio, virtio_ring, failover, net_failover, vsock,
/// vmw_vsock_virtio_transport_common) are added automatically.
pub const GUEST_MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_blk",
    "virtio_net",
    "vmw_vsock_virtio_transport",
    "virtio_rng",
];

/// A module file to put into the initramfs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    /// Module name (dashes as underscores), e.g. `virtio_blk`.
    pub name: String,
    /// Where it is in the unpacked package.
    pub path: PathBuf,
}

/// Module name of a file name, or None if it is not an uncompressed module.
fn module_name(file_name: &str) -> Option<String> {
    file_name
        .strip_suffix(".ko")
        .map(|stem| stem.replace('-', "_"))
}

fn is_compressed_module(file_name: &str) -> bool {
    [".ko.xz", ".ko.zst", ".ko.gz"]
        .iter()
        .any(|s| file_name.ends_with(s))
}

/// All module files under `dir`, by module name. Compressed modules are
/// recorded as such so a request for one fails with a clear error.
fn index(dir: &Path) -> Result<BTreeMap<String, PathBuf>, ImageError> {
    let mut found = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let entries = std::fs::read_dir(&d).map_err(|e| ImageError::io(&d, e))?;
        for entry in entries {
            let entry = entry.map_err(|e| ImageError::io(&d, e))?;
            let path = entry.path();
            let file_type = entry.file_type().map_err(|e| ImageError::io(&path, e))?;
            let file_name = entry.file_name().to_string_lossy().into_owned();
            if file_type.is_dir() {
                stack.push(path);
            } else if let Some(name) = module_name(&file_name) {
                found.insert(name, path);
            } else if is_compressed_module(&file_name) {
                if let Some(stem) = file_name.split(".ko.").next() {
                    found.entry(stem.replace('-', "_")).or_insert(path);
                }
            }
        }
    }
    Ok(found)
}

/// The `depends=` list from a module file's `.modinfo` section.
pub fn depends(module: &[u8]) -> Option<Vec<String>> {
    let info = elf::section(module, ".modinfo")?;
    let deps = info
        .split(|&b| b == 0)
        .find_map(|field| field.strip_prefix(b"depends="))
        .unwrap_or_default();
    let deps = String::from_utf8_lossy(deps);
    Some(
        deps.split(',')
            .filter(|d| !d.is_empty())
            .map(|d| d.replace('-', "_"))
            .collect(),
    )
}

/// `wanted` and everything they depend on, found under `dir` (an unpacked
/// `lib/modules/<version>`), dependencies first.
pub fn resolve(dir: &Path, wanted: &[&str]) -> Result<Vec<Module>, ImageError> {
    let index = index(dir)?;
    let mut order = Vec::new();
    let mut done = HashSet::new();
    for name in wanted {
        visit(&index, name, &mut Vec::new(), &mut done, &mut order)?;
    }
    Ok(order)
}

fn visit(
    index: &BTreeMap<String, PathBuf>,
    name: &str,
    path: &mut Vec<String>,
    done: &mut HashSet<String>,
    order: &mut Vec<Module>,
) -> Result<(), ImageError> {
    if done.contains(name) {
        return Ok(());
    }
    let module_err = |reason: String| ImageError::Module {
        name: name.to_string(),
        reason,
    };
    if path.iter().any(|p| p == name) {
        return Err(module_err(format!(
            "dependency cycle through {}",
            path.join(" -> ")
        )));
    }
    let file = index
        .get(name)
        .ok_or_else(|| module_err("not found in the kernel package".into()))?;
    if file.extension().is_some_and(|e| e != "ko") {
        return Err(module_err(format!(
            "{} is compressed; only uncompressed .ko modules are supported",
            file.display()
        )));
    }
    let bytes = std::fs::read(file).map_err(|e| ImageError::io(file, e))?;
    let deps =
        depends(&bytes).ok_or_else(|| module_err(format!("{} has no .modinfo", file.display())))?;
    path.push(name.to_string());
    for dep in &deps {
        visit(index, dep, path, done, order)?;
    }
    path.pop();
    done.insert(name.to_string());
    order.push(Module {
        name: name.to_string(),
        path: file.clone(),
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_module_name_normalises_dashes() {
        assert_eq!(module_name("virtio-rng.ko").as_deref(), Some("virtio_rng"));
        assert_eq!(module_name("virtio_blk.ko.xz"), None);
        assert!(is_compressed_module("virtio_blk.ko.zst"));
    }

    #[test]
    fn test_resolve_missing_module_names_it() {
        let dir = std::env::temp_dir().join(format!("tine-modules-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let err = resolve(&dir, &["virtio_blk"]).expect_err("nothing there");
        assert!(err.to_string().contains("virtio_blk"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
