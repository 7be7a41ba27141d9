//! Guest images through the API. A build runs in a child process (`tined
//! build-image`): it spawns debootstrap, apt and mkfs and waits for them,
//! which must not race with the reaper of this process (crates/host's
//! `proc`); its progress lines arrive on its stderr.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// What to build.
#[derive(Clone, Debug, Deserialize, Serialize, utoipa::ToSchema)]
pub struct BuildSpec {
    /// `minimal` (kernel + busybox initramfs) or `debian` (a Debian root disk).
    pub kind: String,
    /// The guest agent (a static binary), absolute; default: the one
    /// scripts/build-agent made, found beside tine.
    #[serde(default)]
    pub agent: Option<String>,
    /// A kernel instead of Debian's cloud kernel, absolute.
    #[serde(default)]
    pub kernel: Option<String>,
    /// Rebuild even when a cached image matches.
    #[serde(default)]
    pub force: bool,
    /// Build it without the agent (its vms then run only with no_agent).
    #[serde(default)]
    pub no_agent: bool,
}

/// Every image under `home`: name, directory, manifest.
pub fn list(home: &Path) -> serde_json::Value {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(home.join("images")) {
        for e in rd.flatten() {
            if let Ok(img) = image::Image::load(&e.path()) {
                out.push(serde_json::to_value(&img).unwrap_or_default());
            }
        }
    }
    serde_json::Value::Array(out)
}

/// What can be checked before a build starts: the kind, and that the
/// files named are absolute paths (tined's working directory means
/// nothing to a client).
pub fn check(spec: &BuildSpec) -> host::Result<()> {
    if !matches!(spec.kind.as_str(), "minimal" | "debian") {
        return Err(host::Error::invalid(format!(
            "image kind {:?}: say minimal or debian",
            spec.kind
        )));
    }
    for (what, p) in [("agent", &spec.agent), ("kernel", &spec.kernel)] {
        if let Some(p) = p {
            if !Path::new(p).is_absolute() {
                return Err(host::Error::invalid(format!(
                    "the {what} must be an absolute path, not {p:?}"
                )));
            }
        }
    }
    Ok(())
}

/// Builds `spec` in a child process and returns its manifest.
pub fn build(
    home: &Path,
    spec: &BuildSpec,
    progress: &dyn store::Progress,
) -> host::Result<serde_json::Value> {
    check(spec)?;
    let exe = std::env::current_exe()
        .map_err(|e| host::Error::internal(format!("cannot find tined's executable: {e}")))?;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("build-image")
        .arg(&spec.kind)
        .env("TINE_HOME", home);
    if let Some(a) = &spec.agent {
        cmd.arg("--agent").arg(a);
    }
    if let Some(k) = &spec.kernel {
        cmd.arg("--kernel").arg(k);
    }
    if spec.force {
        cmd.arg("--force");
    }
    if spec.no_agent {
        cmd.arg("--no-agent");
    }
    progress.start(&format!("building image {}", spec.kind), 0);
    let out = host::proc::output(&mut cmd, b"", std::time::Duration::from_secs(3600))?;
    progress.finish();
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(host::Error::failed(format!(
            "image build failed ({}): {}",
            out.status,
            last.trim_start_matches("tined: ")
        )));
    }
    serde_json::from_slice(&out.stdout)
        .map_err(|e| host::Error::internal(format!("the image build printed no manifest: {e}")))
}
