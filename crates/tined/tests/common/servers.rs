//! The real servers of one fleet test: a PostgreSQL 15 cluster (TINE_META)
//! and a Garage cluster of 1 or 3 nodes (TINE_STORE and its key), started
//! by `scripts/servers` in a directory of their own and stopped and removed
//! when dropped. Shared by the fleet tests of tined and of the CLI (a
//! `#[path]` module, since tests of two crates cannot share a crate).

// Each test binary uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

pub struct Servers {
    pub dir: PathBuf,
    /// `KEY=VALUE` lines `scripts/servers` printed: what a tined of the
    /// fleet needs in its environment.
    pub env: Vec<(String, String)>,
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/servers")
}

impl Servers {
    pub fn start(tag: &str, garage_nodes: u32) -> Servers {
        Self::start_on(tag, garage_nodes, None)
    }

    /// [`Self::start`] listening on `listen` (`TINE_SERVERS_LISTEN`), an
    /// address of this machine; default 127.0.0.1.
    pub fn start_on(tag: &str, garage_nodes: u32, listen: Option<&str>) -> Servers {
        let dir = std::env::temp_dir().join(format!("tine-fleet-{tag}-{}", std::process::id()));
        let mut s = Servers {
            dir: dir.clone(),
            env: vec![],
        };
        let d = dir.display().to_string();
        for args in [
            vec!["pg".to_string(), d.clone()],
            vec!["garage".to_string(), d.clone(), garage_nodes.to_string()],
        ] {
            let mut cmd = Command::new(script());
            if let Some(l) = listen {
                cmd.env("TINE_SERVERS_LISTEN", l);
            }
            let out = cmd.args(&args).output().expect("run scripts/servers");
            assert!(
                out.status.success(),
                "scripts/servers {args:?} failed (scripts/setup installs PostgreSQL and Garage): {}",
                String::from_utf8_lossy(&out.stderr)
            );
            for l in String::from_utf8_lossy(&out.stdout).lines() {
                if let Some((k, v)) = l.split_once('=') {
                    s.env.push((k.to_string(), v.to_string()));
                }
            }
        }
        s
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        let _ = Command::new(script()).arg("stop").arg(&self.dir).status();
    }
}
