//! Debian packages without installing them: `apt-get download` into a cache
//! of .deb files, `dpkg-deb -x` into a scratch directory.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::ImageError;

/// The metapackage that names the current cloud kernel package.
pub const KERNEL_METAPACKAGE: &str = "linux-image-cloud-amd64";
/// The pin file, shared with testhost/run so the guests and the nested test
/// host boot the same kernel.
const KERNEL_PIN_FILE: &str = include_str!("../../../guests/kernel-package");
/// Overrides the pin: a kernel package name, or [`KERNEL_METAPACKAGE`] to
/// follow Debian's newest.
pub const KERNEL_PACKAGE_ENV: &str = "TINE_KERNEL_PACKAGE";
/// The package with a statically linked busybox.
pub const BUSYBOX_PACKAGE: &str = "busybox-static";

/// Runs `cmd`, returning its stdout; a failure names the command and `hint`.
fn run(cmd: &mut Command, what: &str, hint: &str) -> Result<String, ImageError> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let out = cmd.output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            ImageError::ToolMissing {
                tool: program.clone(),
                hint: hint.to_string(),
            }
        } else {
            ImageError::Command {
                command: what.to_string(),
                detail: e.to_string(),
                hint: hint.to_string(),
            }
        }
    })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let detail = stderr
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with("W: "))
            .collect::<Vec<_>>()
            .join("; ");
        return Err(ImageError::Command {
            command: what.to_string(),
            detail: if detail.is_empty() {
                out.status.to_string()
            } else {
                detail
            },
            hint: hint.to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The real kernel package behind the metapackage, e.g.
/// `linux-image-6.1.0-48-cloud-amd64`.
pub fn resolve_kernel_package(hint: &str) -> Result<String, ImageError> {
    let what = format!("apt-cache depends {KERNEL_METAPACKAGE}");
    let out = run(
        Command::new("apt-cache").args(["depends", KERNEL_METAPACKAGE]),
        &what,
        hint,
    )?;
    out.lines()
        .filter_map(|l| l.trim().strip_prefix("Depends:"))
        .map(str::trim)
        .find(|p| p.starts_with("linux-image-") && p.ends_with("-cloud-amd64"))
        .map(str::to_string)
        .ok_or_else(|| ImageError::Command {
            command: what,
            detail: "no linux-image-<version>-cloud-amd64 dependency listed".into(),
            hint: hint.to_string(),
        })
}

/// The kernel package to build with: `TINE_KERNEL_PACKAGE` if set, else the
/// pin in guests/kernel-package. Either may be [`KERNEL_METAPACKAGE`].
pub fn kernel_package() -> Result<String, ImageError> {
    match std::env::var(KERNEL_PACKAGE_ENV) {
        Ok(value) if !value.trim().is_empty() => {
            checked_kernel_package(value.trim(), KERNEL_PACKAGE_ENV)
        }
        _ => checked_kernel_package(&pin_line(KERNEL_PIN_FILE), "guests/kernel-package"),
    }
}

/// The pin file's first line that is neither empty nor a comment.
fn pin_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .unwrap_or_default()
        .to_string()
}

fn checked_kernel_package(package: &str, from: &str) -> Result<String, ImageError> {
    if package == KERNEL_METAPACKAGE || is_kernel_package(package) {
        Ok(package.to_string())
    } else {
        Err(ImageError::BadKernelPackage {
            package: package.to_string(),
            from: from.to_string(),
        })
    }
}

/// Downloads `package` with `apt-get download` into `cache`; returns the .deb.
pub fn download(cache: &Path, package: &str, hint: &str) -> Result<PathBuf, ImageError> {
    std::fs::create_dir_all(cache).map_err(|e| ImageError::io(cache, e))?;
    // Download into a private directory, then move into the cache, so a
    // concurrent or interrupted download never leaves a partial .deb there.
    let partial = cache.join(format!(".partial-{}-{}", std::process::id(), package));
    std::fs::create_dir_all(&partial).map_err(|e| ImageError::io(&partial, e))?;
    let result = (|| {
        tracing::info!("downloading {package} (apt-get download)");
        run(
            Command::new("apt-get")
                .arg("download")
                .arg(package)
                .current_dir(&partial),
            &format!("apt-get download {package}"),
            hint,
        )?;
        let deb = find_deb(&partial, package)?.ok_or_else(|| ImageError::Command {
            command: format!("apt-get download {package}"),
            detail: "no .deb file was written".into(),
            hint: hint.to_string(),
        })?;
        let name = deb
            .file_name()
            .map(|n| n.to_os_string())
            .unwrap_or_default();
        let dest = cache.join(name);
        std::fs::rename(&deb, &dest).map_err(|e| ImageError::io(&dest, e))?;
        Ok(dest)
    })();
    std::fs::remove_dir_all(&partial).ok();
    result
}

/// The newest cached .deb of `package` (exact package name), if any.
pub fn find_deb(dir: &Path, package: &str) -> Result<Option<PathBuf>, ImageError> {
    find_debs(dir, |name| name == package)
}

/// The newest cached .deb whose package name satisfies `matches`.
pub fn find_debs(
    dir: &Path,
    matches: impl Fn(&str) -> bool,
) -> Result<Option<PathBuf>, ImageError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(ImageError::io(dir, e)),
    };
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in entries {
        let entry = entry.map_err(|e| ImageError::io(dir, e))?;
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let Some(stem) = file_name.strip_suffix(".deb") else {
            continue;
        };
        let package = stem.split('_').next().unwrap_or_default();
        if !matches(package) {
            continue;
        }
        let mtime = entry
            .metadata()
            .and_then(|m| m.modified())
            .map_err(|e| ImageError::io(&entry.path(), e))?;
        if best.as_ref().is_none_or(|(t, _)| mtime > *t) {
            best = Some((mtime, entry.path()));
        }
    }
    Ok(best.map(|(_, p)| p))
}

/// Whether `package` names a versioned cloud kernel image package.
pub fn is_kernel_package(package: &str) -> bool {
    package != KERNEL_METAPACKAGE
        && package.starts_with("linux-image-")
        && package.ends_with("-cloud-amd64")
        && !package.contains("-dbg")
}

/// Unpacks `deb` into `dest` (`dpkg-deb -x`).
pub fn extract(deb: &Path, dest: &Path) -> Result<(), ImageError> {
    std::fs::create_dir_all(dest).map_err(|e| ImageError::io(dest, e))?;
    run(
        Command::new("dpkg-deb").arg("-x").arg(deb).arg(dest),
        &format!("dpkg-deb -x {}", deb.display()),
        "install dpkg (apt-get install dpkg), or delete the cached .deb if it is damaged",
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_download_unknown_package_names_command_and_fix() {
        let cache = std::env::temp_dir().join(format!("tine-deb-test-{}", std::process::id()));
        let err = download(&cache, "tine-no-such-package", "run `apt-get update`")
            .expect_err("no such package");
        let msg = err.to_string();
        assert!(
            msg.starts_with("apt-get download tine-no-such-package failed: "),
            "{msg}"
        );
        assert!(msg.ends_with("run `apt-get update`"), "{msg}");
        // Nothing partial is left in the cache.
        assert_eq!(
            find_deb(&cache, "tine-no-such-package").expect("scan"),
            None
        );
        assert_eq!(std::fs::read_dir(&cache).expect("cache").count(), 0);
        std::fs::remove_dir_all(&cache).ok();
    }

    #[test]
    fn test_missing_tool_names_what_to_install() {
        let err = run(
            &mut Command::new("tine-no-such-tool"),
            "tine-no-such-tool",
            "install it",
        )
        .expect_err("no such tool");
        assert!(matches!(err, ImageError::ToolMissing { .. }));
        assert_eq!(err.to_string(), "tine-no-such-tool not found: install it");
    }

    #[test]
    fn test_kernel_package_names() {
        assert!(is_kernel_package("linux-image-6.1.0-48-cloud-amd64"));
        assert!(!is_kernel_package(KERNEL_METAPACKAGE));
        assert!(!is_kernel_package("linux-image-6.1.0-48-cloud-amd64-dbg"));
        assert!(!is_kernel_package("linux-image-6.1.0-48-amd64"));
    }

    #[test]
    fn the_pin_names_one_cloud_kernel_package() {
        let pin = pin_line(KERNEL_PIN_FILE);
        assert!(
            is_kernel_package(&pin),
            "guests/kernel-package pins {pin:?}"
        );
        assert_eq!(
            pin_line("# c\n\n  linux-image-cloud-amd64 \nx\n"),
            KERNEL_METAPACKAGE
        );
        assert_eq!(pin_line("# only comments\n"), "");
    }

    #[test]
    fn a_bad_override_is_refused_with_where_it_came_from() {
        for bad in [
            "",
            "linux-image-6.1.0-50-amd64",
            "bash; id",
            "linux-image-cloud-amd64-dbg",
        ] {
            let err = checked_kernel_package(bad, KERNEL_PACKAGE_ENV).expect_err(bad);
            let text = err.to_string();
            assert!(
                text.contains(KERNEL_PACKAGE_ENV) && text.contains("cloud-amd64"),
                "{text}"
            );
        }
        assert_eq!(
            checked_kernel_package(KERNEL_METAPACKAGE, "x").expect("metapackage"),
            KERNEL_METAPACKAGE
        );
    }
}
