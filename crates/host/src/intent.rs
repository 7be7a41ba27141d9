//! Intents: what an operation is about to do, recorded before it does it,
//! so that whatever kills the process doing it (kill -9 of tined, a host
//! crash of the daemon) leaves a note that the next start reconciles
//! ([`crate::reconcile`]): rolled back where the operation had not
//! reached its point of no return, finished where it had.
//!
//! One file per operation in flight, `$TINE_HOME/intents/ID.json`,
//! replaced atomically at each phase and removed when the operation is
//! done (either way). Written without fsync: they guard against a killed
//! process, whose writes the page cache keeps, not against power loss.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::Context;
use crate::state::{now_ms, write_atomic};

/// What an operation is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Start a vm (boot or restore) named `vm`.
    Run { vm: String },
    /// Fork `vm` into `children`.
    Fork { vm: String, children: Vec<String> },
    /// Checkpoint `vm` as `tag`.
    Checkpoint { vm: String, tag: String },
    /// Roll `vm` back to `tag`.
    Rollback { vm: String, tag: String },
    /// Write `vm` to the snapshot directory `dir` (`created`: by this op).
    Snapshot {
        vm: String,
        dir: PathBuf,
        created: bool,
    },
    /// Put `vm` to sleep through the staging directory `staging`.
    Sleep { vm: String, staging: PathBuf },
    /// Store `vm`'s moment while it runs on (a move's pre-copy round).
    Precopy { vm: String, staging: PathBuf },
    /// Wake branch `branch` as vm `vm`.
    Wake { branch: String, vm: String },
    /// Remove `vm`.
    Remove { vm: String },
}

/// How far an operation got.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Files and names made; no process asked or started yet.
    Prepared,
    /// The VMM was asked (or started); its answer is not recorded.
    Asked,
    /// Its answer (the new processes) is recorded.
    Recorded,
    /// Past the point of no return (a sleep's snapshot is committed):
    /// reconcile finishes it rather than undoing it.
    Committed,
}

/// One intent as stored.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    #[serde(flatten)]
    pub op: Op,
    pub phase: Phase,
    pub started_ms: u64,
    /// The pid of the process that recorded it.
    pub pid: u32,
}

fn dir(home: &Path) -> PathBuf {
    home.join("intents")
}

/// An operation in flight. Dropping it without [`Intent::done`] leaves
/// its record for reconcile (as a crash would).
#[derive(Debug)]
pub struct Intent {
    path: PathBuf,
    record: Record,
}

impl Intent {
    /// Records `op` as prepared.
    pub fn begin(home: &Path, op: Op) -> crate::Result<Intent> {
        let d = dir(home);
        std::fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
        let id = effects::random_id()?;
        let record = Record {
            id: id.clone(),
            op,
            phase: Phase::Prepared,
            started_ms: now_ms(),
            pid: std::process::id(),
        };
        let intent = Intent {
            path: d.join(format!("{id}.json")),
            record,
        };
        intent.write()?;
        Ok(intent)
    }

    fn write(&self) -> crate::Result<()> {
        write_atomic(&self.path, &serde_json::to_vec(&self.record)?)
    }

    /// Moves on to `phase`.
    pub fn phase(&mut self, phase: Phase) -> crate::Result<()> {
        self.record.phase = phase;
        self.write()
    }

    /// Changes what the operation is about (e.g. the staging directory
    /// became known).
    pub fn update(&mut self, op: Op) -> crate::Result<()> {
        self.record.op = op;
        self.write()
    }

    pub fn record(&self) -> &Record {
        &self.record
    }

    /// The operation is over (done, or fully undone by itself).
    pub fn done(self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Removes what a process killed in the middle of writing an intent left
/// (`ID.json.tmp.PID`, never renamed into place): called by reconcile,
/// before any operation runs. Returns how many.
pub fn remove_partial(home: &Path) -> usize {
    let Ok(rd) = std::fs::read_dir(dir(home)) else {
        return 0;
    };
    rd.flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_none_or(|x| x != "json"))
        .filter(|p| std::fs::remove_file(p).is_ok())
        .count()
}

/// Every intent left in `home`, oldest first.
pub fn pending(home: &Path) -> Vec<(PathBuf, Record)> {
    let Ok(rd) = std::fs::read_dir(dir(home)) else {
        return Vec::new();
    };
    let mut v: Vec<(PathBuf, Record)> = rd
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter_map(|p| {
            let text = std::fs::read(&p).ok()?;
            match serde_json::from_slice::<Record>(&text) {
                Ok(r) => Some((p, r)),
                Err(e) => {
                    tracing::warn!("ignoring unreadable intent {}: {e}", p.display());
                    None
                }
            }
        })
        .collect();
    v.sort_by_key(|(_, r)| r.started_ms);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_intent_is_recorded_until_done() {
        let home = tempfile::tempdir().expect("tempdir");
        let mut i = Intent::begin(
            home.path(),
            Op::Fork {
                vm: "a".into(),
                children: vec!["a-1".into()],
            },
        )
        .expect("begin");
        i.phase(Phase::Asked).expect("phase");
        let p = pending(home.path());
        assert_eq!(p.len(), 1);
        assert_eq!(p[0].1.phase, Phase::Asked);
        assert!(matches!(&p[0].1.op, Op::Fork { vm, .. } if vm == "a"));
        i.done();
        assert!(pending(home.path()).is_empty());
    }

    #[test]
    fn test_a_half_written_intent_is_removed() {
        let home = tempfile::tempdir().expect("tempdir");
        let i = Intent::begin(home.path(), Op::Remove { vm: "a".into() }).expect("begin");
        let partial = dir(home.path()).join("0123.tmp.42");
        std::fs::write(&partial, b"{\"id\":").expect("write");
        assert_eq!(remove_partial(home.path()), 1);
        assert!(!partial.exists());
        assert_eq!(pending(home.path()).len(), 1, "whole intents stay");
        i.done();
    }
}
