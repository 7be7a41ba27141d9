//! Checkpoints of a vm: template processes that hold a frozen moment
//! (`vms/NAME/checkpoints/TAG.json` and `TAG.sock`). fork.rs takes and
//! rolls back to them; this module reads, lists and ends them, for
//! everything below the moments (rm, layers, the sweep).

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::proc::Pid;
use crate::state::{self, VmDir};
use crate::Host;

/// A checkpoint of a vm: a template process holding the frozen moment.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CheckpointRecord {
    pub tag: String,
    pub pid: u32,
    pub pid_start: u64,
    pub created_ms: u64,
    /// The effects gateway's moment, and the branch and lineage it was
    /// taken of (a rollback continues from them as a new branch).
    #[serde(default)]
    pub moment: String,
    #[serde(default)]
    pub branch: String,
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Object>))]
    pub lineage: Vec<effects::Step>,
    /// The frozen disk layers the template holds (one per disk).
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<String>))]
    pub layers: Vec<PathBuf>,
}

pub(crate) fn checkpoint_paths(vm: &VmDir, tag: &str) -> (PathBuf, PathBuf) {
    let dir = vm.checkpoints();
    (
        dir.join(format!("{tag}.json")),
        dir.join(format!("{tag}.sock")),
    )
}

pub(crate) fn read_checkpoint(path: &Path) -> crate::Result<CheckpointRecord> {
    let text = std::fs::read_to_string(path)?;
    Ok(serde_json::from_str(&text)?)
}

/// The live checkpoints of a vm, oldest first.
pub fn list_checkpoints(h: &Host, name: &str) -> crate::Result<Vec<CheckpointRecord>> {
    state::validate_name(name)?;
    let vm = VmDir::new(&h.home, name);
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(vm.checkpoints()) else {
        return Ok(out);
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "json") {
            if let Ok(c) = read_checkpoint(&p) {
                if crate::proc::process_alive(c.pid, c.pid_start) {
                    out.push(c);
                }
            }
        }
    }
    out.sort_by_key(|c| c.created_ms);
    Ok(out)
}

pub(crate) fn drop_checkpoint_files(vm: &VmDir, tag: &str) {
    let (record, socket) = checkpoint_paths(vm, tag);
    if let Ok(c) = read_checkpoint(&record) {
        let _ = Pid {
            pid: c.pid,
            start: c.pid_start,
        }
        .kill(Duration::from_secs(10));
    }
    let _ = std::fs::remove_file(record);
    let _ = std::fs::remove_file(socket);
}

/// Ends every checkpoint template of a vm (on `rm`); how many ran.
pub(crate) fn drop_checkpoints(vm: &VmDir) -> usize {
    let Ok(rd) = std::fs::read_dir(vm.checkpoints()) else {
        return 0;
    };
    let mut n = 0;
    for e in rd.flatten() {
        let p = e.path();
        if let Ok(c) = read_checkpoint(&p) {
            let t = Pid {
                pid: c.pid,
                start: c.pid_start,
            };
            if t.alive() {
                let _ = t.kill(Duration::from_secs(10));
                n += 1;
            }
        }
    }
    n
}
