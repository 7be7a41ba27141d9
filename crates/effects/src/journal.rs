//! The journal: every request the gateway forwarded, refused or replayed,
//! in SQLite (`$TINE_HOME/effects/journal.db`, WAL, `synchronous=FULL`, so
//! a commit is on disk when it returns).
//!
//! Tables: `branches` (who may call, from which socket, with which lineage
//! and policies), `moments` (fork, checkpoint and snapshot barriers: the
//! sequence number at the moment), `effects` (one row per request that was
//! executed, refused or passed through; `key` is unique per tree and
//! scope), `releases` (each time a recorded response went to a branch).
//! One sequence number orders effects, releases and moments, so "before
//! the fork point" is a comparison.

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension};
use serde::Serialize;

use crate::{Error, MomentKind, Registration};

/// The schema this build writes; older journals are migrated on open.
pub const SCHEMA_VERSION: i64 = 1;

/// Migration `i` brings a journal from version `i` to `i + 1`.
const MIGRATIONS: [&str; 1] = [r#"
CREATE TABLE branches (
    id TEXT PRIMARY KEY,
    vm TEXT NOT NULL,
    tree TEXT NOT NULL,
    registration TEXT NOT NULL,
    active INTEGER NOT NULL,
    created_ms INTEGER NOT NULL
);
CREATE TABLE moments (
    id TEXT PRIMARY KEY,
    branch TEXT NOT NULL,
    kind TEXT NOT NULL,
    seq INTEGER NOT NULL,
    created_ms INTEGER NOT NULL
);
CREATE TABLE effects (
    id INTEGER PRIMARY KEY,
    seq INTEGER NOT NULL,
    tree TEXT NOT NULL,
    scope TEXT NOT NULL,
    key TEXT,
    key_text TEXT,
    key_source TEXT,
    branch TEXT NOT NULL,
    method TEXT NOT NULL,
    url TEXT NOT NULL,
    dest TEXT NOT NULL,
    digest TEXT,
    policy TEXT NOT NULL,
    state TEXT NOT NULL,
    status INTEGER,
    resp_head BLOB,
    resp_body BLOB,
    req_bytes INTEGER NOT NULL DEFAULT 0,
    resp_bytes INTEGER,
    error TEXT,
    started_ms INTEGER NOT NULL,
    completed_ms INTEGER
);
CREATE UNIQUE INDEX effects_key ON effects(tree, scope, key) WHERE key IS NOT NULL;
CREATE INDEX effects_digest ON effects(digest);
CREATE INDEX effects_branch ON effects(branch, seq);
CREATE TABLE releases (
    seq INTEGER PRIMARY KEY,
    effect INTEGER NOT NULL,
    branch TEXT NOT NULL,
    replay INTEGER NOT NULL,
    ms INTEGER NOT NULL
);
CREATE INDEX releases_branch ON releases(branch, effect);
CREATE INDEX releases_effect ON releases(effect);
"#];

/// An effect's state in the journal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum State {
    /// Written before the destination was contacted; no outcome yet.
    Sent,
    /// The destination answered; the response is recorded.
    Completed,
    /// The gateway ended (or the destination failed) while it was sent:
    /// nobody knows whether it happened. Never re-sent without a human.
    InDoubt,
    /// Refused by policy (deny-in-children).
    Refused,
    /// Answered with a body over the size limit: not replayable.
    TooLarge,
    /// Resolved by a human as failed: later requests get an error.
    Failed,
    /// Resolved by a human to be sent again: the key is free.
    Abandoned,
    /// A GET/HEAD/OPTIONS (or `pass`) request: forwarded, never replayed.
    Passed,
    /// A CONNECT tunnel (TLS): journaled by destination, never replayed.
    Tunnel,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Sent => "sent",
            State::Completed => "completed",
            State::InDoubt => "in-doubt",
            State::Refused => "refused",
            State::TooLarge => "too-large",
            State::Failed => "failed",
            State::Abandoned => "abandoned",
            State::Passed => "passed",
            State::Tunnel => "tunnel",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        [
            State::Sent,
            State::Completed,
            State::InDoubt,
            State::Refused,
            State::TooLarge,
            State::Failed,
            State::Abandoned,
            State::Passed,
            State::Tunnel,
        ]
        .into_iter()
        .find(|st| st.as_str() == s)
    }
}

/// One row of `effects`.
#[derive(Clone, Debug)]
pub struct EffectRow {
    pub id: i64,
    pub seq: i64,
    pub tree: String,
    pub scope: String,
    pub key: Option<String>,
    pub branch: String,
    pub method: String,
    pub dest: String,
    pub state: State,
    pub status: Option<u16>,
    /// Response headers, `name: value\r\n` each, as received.
    pub resp_head: Option<Vec<u8>>,
    pub resp_body: Option<Vec<u8>>,
    pub resp_bytes: Option<i64>,
    pub error: Option<String>,
}

/// What a new effect row says.
#[derive(Clone, Debug)]
pub struct NewEffect<'a> {
    pub tree: &'a str,
    /// `""` for tree-wide keys (once-per-tree), else the branch id.
    pub scope: &'a str,
    /// The uniqueness key (None: not keyed, e.g. passed or refused).
    pub key: Option<&'a str>,
    /// The key as shown, also for rows that are not keyed.
    pub key_text: Option<&'a str>,
    pub key_source: Option<&'a str>,
    pub branch: &'a str,
    pub method: &'a str,
    pub url: &'a str,
    pub dest: &'a str,
    pub digest: Option<&'a str>,
    pub policy: &'a str,
    pub state: State,
    pub status: Option<u16>,
    pub req_bytes: u64,
    pub error: Option<&'a str>,
}

/// One line of `tine effects N`.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct EffectView {
    pub id: i64,
    pub key: Option<String>,
    /// `header` (Idempotency-Key) or `derived` (by the gateway).
    pub key_source: Option<String>,
    pub method: String,
    pub url: String,
    pub dest: String,
    pub policy: String,
    /// What happened to it, seen from this branch: completed, replayed
    /// (executed by another branch, its response given here), in-doubt,
    /// refused, too-large, failed, abandoned, passed, tunnel, sent.
    pub state: String,
    pub status: Option<u16>,
    /// own (this branch did it), ancestor (before this branch's fork
    /// point) or replayed (another branch did it; this one got its response).
    pub relation: String,
    /// The vm that executed it.
    pub executed_by: String,
    pub started_ms: i64,
    pub completed_ms: Option<i64>,
    pub resp_bytes: Option<i64>,
    /// Vms that got its recorded response instead of executing it.
    pub replayed_to: Vec<String>,
    pub error: Option<String>,
}

/// A branch known to the journal.
#[derive(Clone, Debug)]
pub struct BranchRow {
    pub registration: Registration,
    pub active: bool,
}

/// The journal database.
pub struct Journal {
    conn: Connection,
    seq: i64,
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

const EFFECT_COLUMNS: &str =
    "id, seq, tree, scope, key, branch, method, dest, state, status, resp_head, resp_body, resp_bytes, error";

fn effect_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<EffectRow> {
    let state: String = r.get(8)?;
    Ok(EffectRow {
        id: r.get(0)?,
        seq: r.get(1)?,
        tree: r.get(2)?,
        scope: r.get(3)?,
        key: r.get(4)?,
        branch: r.get(5)?,
        method: r.get(6)?,
        dest: r.get(7)?,
        state: State::parse(&state).unwrap_or(State::InDoubt),
        status: r
            .get::<_, Option<i64>>(9)?
            .and_then(|s| u16::try_from(s).ok()),
        resp_head: r.get(10)?,
        resp_body: r.get(11)?,
        resp_bytes: r.get(12)?,
        error: r.get(13)?,
    })
}

/// Appends to `sql` one `OR (<table>.branch = ? AND <table>.seq < ?)` per
/// barrier (an ancestor's rows before it forked), numbering the parameters
/// after those already in `args`.
fn or_before_barriers(
    sql: &mut String,
    args: &mut Vec<rusqlite::types::Value>,
    table: &str,
    barriers: &[(String, i64)],
) {
    for (b, seq) in barriers {
        let i = args.len();
        sql.push_str(&format!(
            " OR ({table}.branch = ?{} AND {table}.seq < ?{})",
            i + 1,
            i + 2
        ));
        args.push(b.clone().into());
        args.push((*seq).into());
    }
}

impl Journal {
    /// Opens (creating or migrating) the journal at `path`.
    pub fn open(path: &Path) -> Result<Self, Error> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| Error::Io(dir.display().to_string(), e))?;
        }
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(Error::Journal(format!(
                "{}: cannot use WAL mode (got {mode})",
                path.display()
            )));
        }
        // FULL: a commit is fsynced before it returns, so "written before
        // the response is released" holds across a power loss too.
        conn.execute_batch("PRAGMA synchronous=FULL;")?;
        let mut j = Journal { conn, seq: 0 };
        j.migrate()?;
        j.seq = j.conn.query_row(
            "SELECT MAX(COALESCE((SELECT MAX(seq) FROM effects), 0),
                        COALESCE((SELECT MAX(seq) FROM releases), 0),
                        COALESCE((SELECT MAX(seq) FROM moments), 0))",
            [],
            |r| r.get(0),
        )?;
        Ok(j)
    }

    fn migrate(&mut self) -> Result<(), Error> {
        let tx = self.conn.transaction()?;
        tx.execute_batch("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")?;
        let v: Option<i64> = tx
            .query_row("SELECT version FROM schema_version", [], |r| r.get(0))
            .optional()?;
        let v = match v {
            Some(v) => v,
            None => {
                tx.execute("INSERT INTO schema_version (version) VALUES (0)", [])?;
                0
            }
        };
        if v > SCHEMA_VERSION {
            return Err(Error::Journal(format!(
                "the journal has schema version {v}, newer than this tine's {SCHEMA_VERSION}: use a newer tine"
            )));
        }
        for (i, m) in MIGRATIONS.iter().enumerate().skip(v as usize) {
            tx.execute_batch(m)?;
            tx.execute("UPDATE schema_version SET version = ?1", [i as i64 + 1])?;
        }
        tx.commit()?;
        Ok(())
    }

    /// The schema version on disk.
    pub fn schema_version(&self) -> Result<i64, Error> {
        Ok(self
            .conn
            .query_row("SELECT version FROM schema_version", [], |r| r.get(0))?)
    }

    fn next_seq(&mut self) -> i64 {
        self.seq += 1;
        self.seq
    }

    /// At gateway start: effects still `sent` were cut off by a crash.
    /// Their outcome is unknown: they become in-doubt.
    pub fn mark_in_doubt(&mut self) -> Result<usize, Error> {
        Ok(self.conn.execute(
            "UPDATE effects SET state = 'in-doubt',
                 error = 'the gateway ended while the request was sent; the destination may or may not have acted on it'
             WHERE state = 'sent'",
            [],
        )?)
    }

    /// Records (or replaces) a branch's registration and whether it is active.
    pub fn put_branch(&mut self, reg: &Registration, active: bool) -> Result<(), Error> {
        let text = serde_json::to_string(reg).map_err(|e| Error::Journal(e.to_string()))?;
        self.conn.execute(
            "INSERT INTO branches (id, vm, tree, registration, active, created_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT(id) DO UPDATE SET vm = ?2, registration = ?4, active = ?5",
            params![reg.branch, reg.vm, reg.tree(), text, active, now_ms()],
        )?;
        Ok(())
    }

    pub fn set_active(&mut self, branch: &str, active: bool) -> Result<(), Error> {
        self.conn.execute(
            "UPDATE branches SET active = ?2 WHERE id = ?1",
            params![branch, active],
        )?;
        Ok(())
    }

    pub fn branch(&self, id: &str) -> Result<Option<BranchRow>, Error> {
        let row: Option<(String, bool)> = self
            .conn
            .query_row(
                "SELECT registration, active FROM branches WHERE id = ?1",
                [id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?;
        row.map(|(text, active)| {
            Ok(BranchRow {
                registration: serde_json::from_str(&text)
                    .map_err(|e| Error::Journal(format!("branch {id}: {e}")))?,
                active,
            })
        })
        .transpose()
    }

    /// The newest branch that belongs to vm `name` (active ones first).
    pub fn branch_of_vm(&self, name: &str) -> Result<Option<BranchRow>, Error> {
        let id: Option<String> = self
            .conn
            .query_row(
                "SELECT id FROM branches WHERE vm = ?1 ORDER BY active DESC, created_ms DESC, rowid DESC LIMIT 1",
                [name],
                |r| r.get(0),
            )
            .optional()?;
        match id {
            Some(id) => self.branch(&id),
            None => Ok(None),
        }
    }

    /// Every active branch (re-bound when the gateway starts).
    pub fn active_branches(&self) -> Result<Vec<Registration>, Error> {
        let mut st = self
            .conn
            .prepare("SELECT id FROM branches WHERE active = 1 ORDER BY rowid")?;
        let ids: Vec<String> = st.query_map([], |r| r.get(0))?.collect::<Result<_, _>>()?;
        let mut out = Vec::new();
        for id in ids {
            if let Some(b) = self.branch(&id)? {
                out.push(b.registration);
            }
        }
        Ok(out)
    }

    /// Records a barrier: everything released to `branch` so far is before
    /// moment `id`. Returns its sequence number.
    pub fn add_moment(&mut self, id: &str, branch: &str, kind: MomentKind) -> Result<i64, Error> {
        let seq = self.next_seq();
        self.conn.execute(
            "INSERT INTO moments (id, branch, kind, seq, created_ms) VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT(id) DO UPDATE SET seq = ?4",
            params![id, branch, kind.as_str(), seq, now_ms()],
        )?;
        Ok(seq)
    }

    /// A moment that was not taken after all (the VMM refused the fork).
    pub fn delete_moment(&mut self, id: &str) -> Result<(), Error> {
        self.conn
            .execute("DELETE FROM moments WHERE id = ?1", [id])?;
        Ok(())
    }

    pub fn moment_seq(&self, id: &str) -> Result<Option<i64>, Error> {
        Ok(self
            .conn
            .query_row("SELECT seq FROM moments WHERE id = ?1", [id], |r| r.get(0))
            .optional()?)
    }

    /// The lineage of `reg` as (ancestor branch, barrier sequence); an
    /// ancestor whose moment the journal does not know counts as nothing
    /// (the side that replays rather than repeats).
    pub fn barriers(&self, reg: &Registration) -> Result<Vec<(String, i64)>, Error> {
        reg.lineage
            .iter()
            .map(|s| Ok((s.branch.clone(), self.moment_seq(&s.moment)?.unwrap_or(0))))
            .collect()
    }

    /// How many responses of derived-key effects with `digest` the lineage
    /// released before this point: the branch's own, and each ancestor's
    /// before its barrier.
    pub fn count_released(
        &self,
        branch: &str,
        barriers: &[(String, i64)],
        digest: &str,
    ) -> Result<i64, Error> {
        let mut sql = String::from(
            "SELECT COUNT(*) FROM releases r JOIN effects e ON e.id = r.effect
             WHERE e.digest = ?1 AND e.key_source = 'derived' AND (r.branch = ?2",
        );
        let mut args: Vec<rusqlite::types::Value> =
            vec![digest.to_string().into(), branch.to_string().into()];
        or_before_barriers(&mut sql, &mut args, "r", barriers);
        sql.push(')');
        Ok(self
            .conn
            .query_row(&sql, rusqlite::params_from_iter(args), |r| r.get(0))?)
    }

    /// The effect with `key` in `tree` and `scope`, if any.
    pub fn find(&self, tree: &str, scope: &str, key: &str) -> Result<Option<EffectRow>, Error> {
        Ok(self
            .conn
            .query_row(
                &format!("SELECT {EFFECT_COLUMNS} FROM effects WHERE tree = ?1 AND scope = ?2 AND key = ?3"),
                params![tree, scope, key],
                effect_row,
            )
            .optional()?)
    }

    /// An effect with `key` that an ancestor executed before its barrier.
    pub fn find_before(
        &self,
        tree: &str,
        key: &str,
        barriers: &[(String, i64)],
    ) -> Result<Option<EffectRow>, Error> {
        for (b, seq) in barriers.iter().rev() {
            let row = self
                .conn
                .query_row(
                    &format!(
                        "SELECT {EFFECT_COLUMNS} FROM effects
                         WHERE tree = ?1 AND key = ?2 AND branch = ?3 AND seq < ?4"
                    ),
                    params![tree, key, b, seq],
                    effect_row,
                )
                .optional()?;
            if row.is_some() {
                return Ok(row);
            }
        }
        Ok(None)
    }

    pub fn get(&self, id: i64) -> Result<Option<EffectRow>, Error> {
        Ok(self
            .conn
            .query_row(
                &format!("SELECT {EFFECT_COLUMNS} FROM effects WHERE id = ?1"),
                [id],
                effect_row,
            )
            .optional()?)
    }

    /// Inserts a row and commits it. `Ok(None)`: the key is taken.
    pub fn insert(&mut self, e: &NewEffect<'_>) -> Result<Option<i64>, Error> {
        let seq = self.next_seq();
        let res = self.conn.execute(
            "INSERT INTO effects (seq, tree, scope, key, key_text, key_source, branch, method, url,
                 dest, digest, policy, state, status, req_bytes, error, started_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17)",
            params![
                seq,
                e.tree,
                e.scope,
                e.key,
                e.key_text.or(e.key),
                e.key_source,
                e.branch,
                e.method,
                e.url,
                e.dest,
                e.digest,
                e.policy,
                e.state.as_str(),
                e.status,
                e.req_bytes as i64,
                e.error,
                now_ms()
            ],
        );
        match res {
            Ok(_) => Ok(Some(self.conn.last_insert_rowid())),
            Err(rusqlite::Error::SqliteFailure(f, _))
                if f.code == rusqlite::ErrorCode::ConstraintViolation =>
            {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The destination answered: status, headers and body are recorded.
    pub fn complete(
        &mut self,
        id: i64,
        status: u16,
        head: &[u8],
        body: &[u8],
    ) -> Result<(), Error> {
        self.conn.execute(
            "UPDATE effects SET state = 'completed', status = ?2, resp_head = ?3, resp_body = ?4,
                 resp_bytes = ?5, completed_ms = ?6 WHERE id = ?1",
            params![id, status, head, body, body.len() as i64, now_ms()],
        )?;
        Ok(())
    }

    /// The destination answered with a body over the limit (`bytes` so far).
    pub fn too_large(
        &mut self,
        id: i64,
        status: u16,
        head: &[u8],
        bytes: u64,
    ) -> Result<(), Error> {
        self.conn.execute(
            "UPDATE effects SET state = 'too-large', status = ?2, resp_head = ?3, resp_bytes = ?4,
                 completed_ms = ?5 WHERE id = ?1",
            params![id, status, head, bytes as i64, now_ms()],
        )?;
        Ok(())
    }

    /// Sets the final byte count of a too-large, passed or tunnel row.
    pub fn set_bytes(&mut self, id: i64, req: u64, resp: u64) -> Result<(), Error> {
        self.conn.execute(
            "UPDATE effects SET req_bytes = MAX(req_bytes, ?2), resp_bytes = ?3,
                 completed_ms = ?4 WHERE id = ?1",
            params![id, req as i64, resp as i64, now_ms()],
        )?;
        Ok(())
    }

    /// Outcome unknown (the destination failed after the request went out).
    pub fn in_doubt(&mut self, id: i64, why: &str) -> Result<(), Error> {
        self.conn.execute(
            "UPDATE effects SET state = 'in-doubt', error = ?2, completed_ms = ?3 WHERE id = ?1",
            params![id, why, now_ms()],
        )?;
        Ok(())
    }

    /// Nothing reached the destination (it could not be connected to): the
    /// row goes, so the key is free for a retry.
    pub fn delete_unsent(&mut self, id: i64) -> Result<(), Error> {
        self.conn
            .execute("DELETE FROM effects WHERE id = ?1 AND state = 'sent'", [id])?;
        Ok(())
    }

    /// A recorded response went to `branch`. Returns the release's sequence.
    pub fn release(&mut self, effect: i64, branch: &str, replay: bool) -> Result<i64, Error> {
        let seq = self.next_seq();
        self.conn.execute(
            "INSERT INTO releases (seq, effect, branch, replay, ms) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![seq, effect, branch, replay, now_ms()],
        )?;
        Ok(seq)
    }

    /// A human's decision on an in-doubt effect of `tree` with `key`:
    /// `resend` frees the key (the next request is sent), otherwise it
    /// becomes `failed` (later requests get an error). Returns the row id.
    pub fn resolve(&mut self, tree: &str, key: &str, resend: bool) -> Result<Option<i64>, Error> {
        let id: Option<i64> = self
            .conn
            .query_row(
                "SELECT id FROM effects WHERE tree = ?1 AND key = ?2 AND state = 'in-doubt'",
                params![tree, key],
                |r| r.get(0),
            )
            .optional()?;
        let Some(id) = id else { return Ok(None) };
        if resend {
            self.conn.execute(
                "UPDATE effects SET state = 'abandoned', key = NULL,
                     error = COALESCE(error, '') || '; resolved by a human: send again' WHERE id = ?1",
                [id],
            )?;
        } else {
            self.conn.execute(
                "UPDATE effects SET state = 'failed',
                     error = COALESCE(error, '') || '; resolved by a human: failed' WHERE id = ?1",
                [id],
            )?;
        }
        Ok(Some(id))
    }

    /// The effects in `branch`'s lineage: its own, its ancestors' before
    /// each fork point, and those it got as replays; oldest first.
    pub fn lineage_effects(&self, branch: &str) -> Result<Vec<EffectView>, Error> {
        let reg = match self.branch(branch)? {
            Some(b) => b.registration,
            None => return Ok(Vec::new()),
        };
        let barriers = self.barriers(&reg)?;
        let mut sql = String::from(
            "SELECT e.id, e.key_text, e.key_source, e.method, e.url, e.dest, e.policy, e.state,
                    e.status, e.branch, COALESCE(b.vm, e.branch), e.started_ms, e.completed_ms,
                    e.resp_bytes, e.error,
                    EXISTS (SELECT 1 FROM releases r WHERE r.effect = e.id AND r.branch = ?1 AND r.replay = 1)
             FROM effects e LEFT JOIN branches b ON b.id = e.branch
             WHERE e.branch = ?1
                OR e.id IN (SELECT effect FROM releases WHERE branch = ?1 AND replay = 1)",
        );
        let mut args: Vec<rusqlite::types::Value> = vec![branch.to_string().into()];
        or_before_barriers(&mut sql, &mut args, "e", &barriers);
        sql.push_str(" ORDER BY e.seq");
        let mut st = self.conn.prepare(&sql)?;
        let rows = st.query_map(rusqlite::params_from_iter(args), |r| {
            let executed_branch: String = r.get(9)?;
            let replayed_here: bool = r.get(15)?;
            let state: String = r.get(7)?;
            let relation = if executed_branch == branch {
                "own"
            } else if replayed_here {
                "replayed"
            } else {
                "ancestor"
            };
            Ok(EffectView {
                id: r.get(0)?,
                key: r.get(1)?,
                key_source: r.get(2)?,
                method: r.get(3)?,
                url: r.get(4)?,
                dest: r.get(5)?,
                policy: r.get(6)?,
                state: if replayed_here && executed_branch != branch {
                    "replayed".into()
                } else {
                    state
                },
                status: r
                    .get::<_, Option<i64>>(8)?
                    .and_then(|s| u16::try_from(s).ok()),
                relation: relation.into(),
                executed_by: r.get(10)?,
                started_ms: r.get(11)?,
                completed_ms: r.get(12)?,
                resp_bytes: r.get(13)?,
                replayed_to: Vec::new(),
                error: r.get(14)?,
            })
        })?;
        let mut out: Vec<EffectView> = rows.collect::<Result<_, _>>()?;
        let mut st = self.conn.prepare(
            "SELECT DISTINCT COALESCE(b.vm, r.branch) FROM releases r
             LEFT JOIN branches b ON b.id = r.branch
             WHERE r.effect = ?1 AND r.replay = 1 ORDER BY r.seq",
        )?;
        for v in &mut out {
            v.replayed_to = st
                .query_map([v.id], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
        }
        Ok(out)
    }

    /// Rows per state (for `tine gateway status` and tests).
    pub fn counts(&self) -> Result<Vec<(String, i64)>, Error> {
        let mut st = self
            .conn
            .prepare("SELECT state, COUNT(*) FROM effects GROUP BY state ORDER BY state")?;
        let rows = st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Step;

    fn reg(branch: &str, lineage: Vec<Step>) -> Registration {
        Registration {
            branch: branch.into(),
            vm: format!("vm-{branch}"),
            socket: "/nonexistent".into(),
            lineage,
            effects: Default::default(),
        }
    }

    fn effect<'a>(tree: &'a str, branch: &'a str, key: &'a str, digest: &'a str) -> NewEffect<'a> {
        NewEffect {
            tree,
            scope: "",
            key: Some(key),
            key_text: None,
            key_source: Some("derived"),
            branch,
            method: "POST",
            url: "http://x/",
            dest: "x:80",
            digest: Some(digest),
            policy: "once-per-tree",
            state: State::Sent,
            status: None,
            req_bytes: 0,
            error: None,
        }
    }

    #[test]
    fn test_keys_barriers_and_counts() {
        let dir = std::env::temp_dir().join(format!("tine-journal-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("journal.db");
        let mut j = Journal::open(&path).expect("open");
        assert_eq!(j.schema_version().expect("v"), SCHEMA_VERSION);
        let root = reg("r", vec![]);
        j.put_branch(&root, true).expect("branch");
        let a = j
            .insert(&effect("r", "r", "k1", "d"))
            .expect("i")
            .expect("new");
        assert!(
            j.insert(&effect("r", "r", "k1", "d")).expect("i").is_none(),
            "key taken"
        );
        j.complete(a, 201, b"x: y\r\n", b"body").expect("complete");
        j.release(a, "r", false).expect("release");
        let m = j.add_moment("m1", "r", MomentKind::Fork).expect("moment");
        // After the barrier: the parent's own count grows, the child's not.
        let b = j
            .insert(&effect("r", "r", "k2", "d"))
            .expect("i")
            .expect("new");
        j.complete(b, 201, b"", b"").expect("complete");
        j.release(b, "r", false).expect("release");
        let child = reg(
            "c",
            vec![Step {
                branch: "r".into(),
                moment: "m1".into(),
                kind: MomentKind::Fork,
            }],
        );
        j.put_branch(&child, true).expect("branch");
        let bar = j.barriers(&child).expect("barriers");
        assert_eq!(bar, vec![("r".to_string(), m)]);
        assert_eq!(j.count_released("r", &[], "d").expect("count"), 2);
        assert_eq!(j.count_released("c", &bar, "d").expect("count"), 1);
        assert_eq!(
            j.find_before("r", "k1", &bar).expect("f").map(|e| e.id),
            Some(a)
        );
        assert!(j.find_before("r", "k2", &bar).expect("f").is_none());
        j.release(b, "c", true).expect("replay");
        let v = j.lineage_effects("c").expect("list");
        assert_eq!(v.len(), 2, "{v:?}");
        assert_eq!(
            (v[0].relation.as_str(), v[1].state.as_str()),
            ("ancestor", "replayed")
        );
        assert_eq!(v[1].replayed_to, vec!["vm-c".to_string()]);
        drop(j);
        // Reopened: same schema, sent rows become in-doubt, seq goes on.
        let mut j = Journal::open(&path).expect("reopen");
        let s = j
            .insert(&effect("r", "r", "k3", "e"))
            .expect("i")
            .expect("new");
        assert!(j.get(s).expect("g").expect("row").seq > m);
        drop(j);
        let mut j = Journal::open(&path).expect("reopen");
        assert_eq!(j.mark_in_doubt().expect("mark"), 1);
        assert_eq!(j.get(s).expect("g").expect("row").state, State::InDoubt);
        assert_eq!(j.resolve("r", "k3", true).expect("resolve"), Some(s));
        assert!(
            j.insert(&effect("r", "r", "k3", "e")).expect("i").is_some(),
            "key freed"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
