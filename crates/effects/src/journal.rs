//! The journal: every request the gateway forwarded, refused or replayed.
//!
//! Two backends behind one [`Journal`]: SQLite (`$TINE_HOME/effects/journal.db`,
//! WAL, `synchronous=FULL`, so a commit is on disk when it returns), the
//! default, and PostgreSQL when `TINE_META` is a `postgres://` URL, shared by
//! the hosts of a fleet so a branch woken on one host sees what its lineage
//! did on another (docs/design/effects.md, "Across hosts").
//!
//! Tables: `effects_branches` (who may call, from which socket, with which
//! lineage and policies, bound on which host), `effects_moments` (fork,
//! checkpoint and snapshot barriers: the sequence number at the moment),
//! `effects_effects` (one row per request that was executed, refused or
//! passed through; `key` is unique per tree and scope), `effects_releases`
//! (each time a recorded response went to a branch). The prefix keeps them
//! apart from the store's tables in a shared database. One sequence orders
//! effects, releases and moments, so "before the fork point" is a
//! comparison.
//!
//! Queries are written once, in the SQL both backends speak, with `?N`
//! parameters (turned into `$N` for PostgreSQL); what differs (the schema,
//! where the sequence comes from, transactions) is side by side per backend.

use std::cell::RefCell;
use std::path::{Path, PathBuf};

use rusqlite::Connection;
use serde::Serialize;

use crate::{Error, MomentKind, Registration};

/// The schema this build writes; older journals are migrated on open.
/// Both backends count to the same number (their steps differ).
pub const SCHEMA_VERSION: i64 = 2;

/// Selects the journal's database: unset, empty or `sqlite` is the local
/// SQLite file; `postgres://...` (or `postgresql://...`) a shared PostgreSQL.
pub const META_ENV: &str = "TINE_META";

/// SQLite migration `i` brings a journal from version `i` to `i + 1`.
const SQLITE_MIGRATIONS: [&str; 2] = [
    r#"
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
"#,
    // The PostgreSQL names (one set of queries for both), and the host
    // that bound a branch or is executing an effect.
    r#"
ALTER TABLE branches RENAME TO effects_branches;
ALTER TABLE moments RENAME TO effects_moments;
ALTER TABLE effects RENAME TO effects_effects;
ALTER TABLE releases RENAME TO effects_releases;
ALTER TABLE effects_branches ADD COLUMN host TEXT;
ALTER TABLE effects_effects ADD COLUMN host TEXT;
CREATE INDEX effects_branches_vm ON effects_branches(vm);
"#,
];

/// PostgreSQL migration `i` brings a journal from version `i` to `i + 1`.
/// Version 1 has SQLite's version 2 tables from the start; version 2 adds
/// the gateways' heartbeats (only a shared journal has other hosts).
/// Integers are BIGINT throughout (i64 on both sides), flags BOOLEAN.
const PG_MIGRATIONS: [&str; 2] = [
    r#"
CREATE TABLE effects_branches (
    id TEXT PRIMARY KEY,
    vm TEXT NOT NULL,
    tree TEXT NOT NULL,
    registration TEXT NOT NULL,
    active BOOLEAN NOT NULL,
    created_ms BIGINT NOT NULL,
    host TEXT
);
CREATE INDEX effects_branches_vm ON effects_branches(vm);
CREATE TABLE effects_moments (
    id TEXT PRIMARY KEY,
    branch TEXT NOT NULL,
    kind TEXT NOT NULL,
    seq BIGINT NOT NULL,
    created_ms BIGINT NOT NULL
);
CREATE SEQUENCE effects_seq;
CREATE TABLE effects_effects (
    id BIGSERIAL PRIMARY KEY,
    seq BIGINT NOT NULL,
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
    status BIGINT,
    resp_head BYTEA,
    resp_body BYTEA,
    req_bytes BIGINT NOT NULL DEFAULT 0,
    resp_bytes BIGINT,
    error TEXT,
    started_ms BIGINT NOT NULL,
    completed_ms BIGINT,
    host TEXT
);
CREATE UNIQUE INDEX effects_key ON effects_effects(tree, scope, key) WHERE key IS NOT NULL;
CREATE INDEX effects_digest ON effects_effects(digest);
CREATE INDEX effects_branch ON effects_effects(branch, seq);
CREATE INDEX effects_sent ON effects_effects(host) WHERE state = 'sent';
CREATE TABLE effects_releases (
    seq BIGINT PRIMARY KEY,
    effect BIGINT NOT NULL,
    branch TEXT NOT NULL,
    replay BOOLEAN NOT NULL,
    ms BIGINT NOT NULL
);
CREATE INDEX effects_releases_branch ON effects_releases(branch, effect);
CREATE INDEX effects_releases_effect ON effects_releases(effect);
"#,
    r#"
CREATE TABLE effects_hosts (
    host TEXT PRIMARY KEY,
    seen_ms BIGINT NOT NULL
);
"#,
];

/// Now by the database's clock, in ms (hosts' clocks may disagree; a
/// heartbeat and its check use the same clock).
const PG_NOW_MS: &str = "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000)::BIGINT";

/// Held (transaction-scoped) while PostgreSQL migrations run: hosts that
/// start together must not both create the tables. Any constant works;
/// this one spells "tinefx" and stays clear of the store's.
const PG_MIGRATION_LOCK: i64 = 0x7469_6e65_6678;

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
    /// The host whose gateway wrote it (and, while it is `sent`, executes
    /// it); `None` in journals from before hosts were recorded.
    pub host: Option<String>,
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
    /// The host whose gateway executed it (vm names are per host); absent
    /// in journals from before hosts were recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executed_on: Option<String>,
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

/// Where a journal lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Meta {
    /// This host's own file.
    Sqlite(PathBuf),
    /// A PostgreSQL database that several hosts share (a connection URL,
    /// `postgres://user[:password]@host[:port]/db[?host=/socket/dir]`).
    Postgres(String),
}

impl Meta {
    /// The journal `value` of `TINE_META` selects; `sqlite` is the file
    /// used when it selects SQLite.
    pub fn parse(value: Option<&str>, sqlite: &Path) -> Result<Meta, Error> {
        match value.map(str::trim) {
            None | Some("") | Some("sqlite") => Ok(Meta::Sqlite(sqlite.to_path_buf())),
            Some(v) if v.starts_with("postgres://") || v.starts_with("postgresql://") => {
                Ok(Meta::Postgres(v.to_string()))
            }
            Some(v) => Err(Error::Journal(format!(
                "{META_ENV}={:?}: not `sqlite` nor a postgres:// URL",
                Meta::Postgres(v.to_string()).shown()
            ))),
        }
    }

    /// What `TINE_META` in this process's environment selects.
    pub fn from_env(sqlite: &Path) -> Result<Meta, Error> {
        Meta::parse(std::env::var(META_ENV).ok().as_deref(), sqlite)
    }

    /// For messages and status: the path, or the URL without its password.
    pub fn shown(&self) -> String {
        match self {
            Meta::Sqlite(p) => p.display().to_string(),
            Meta::Postgres(url) => {
                let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
                match rest.split_once('@') {
                    Some((user, host)) => match user.split_once(':') {
                        Some((u, _)) => format!("{scheme}://{u}:***@{host}"),
                        None => url.clone(),
                    },
                    None => url.clone(),
                }
            }
        }
    }
}

/// A value passed to or read from either backend.
#[derive(Clone, Debug)]
enum V {
    Null,
    Int(i64),
    Text(String),
    Blob(Vec<u8>),
    Bool(bool),
}

impl From<i64> for V {
    fn from(v: i64) -> Self {
        V::Int(v)
    }
}
impl From<bool> for V {
    fn from(v: bool) -> Self {
        V::Bool(v)
    }
}
impl From<&str> for V {
    fn from(v: &str) -> Self {
        V::Text(v.to_string())
    }
}
impl From<&[u8]> for V {
    fn from(v: &[u8]) -> Self {
        V::Blob(v.to_vec())
    }
}
impl<T: Into<V>> From<Option<T>> for V {
    fn from(v: Option<T>) -> Self {
        v.map_or(V::Null, Into::into)
    }
}

impl rusqlite::ToSql for V {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, Value, ValueRef};
        Ok(match self {
            V::Null => ToSqlOutput::Owned(Value::Null),
            V::Int(i) => ToSqlOutput::Owned(Value::Integer(*i)),
            V::Text(s) => ToSqlOutput::Borrowed(ValueRef::Text(s.as_bytes())),
            V::Blob(b) => ToSqlOutput::Borrowed(ValueRef::Blob(b)),
            V::Bool(b) => ToSqlOutput::Owned(Value::Integer(i64::from(*b))),
        })
    }
}

impl postgres::types::ToSql for V {
    fn to_sql(
        &self,
        ty: &postgres::types::Type,
        out: &mut bytes::BytesMut,
    ) -> Result<postgres::types::IsNull, Box<dyn std::error::Error + Sync + Send>> {
        use postgres::types::Type;
        match self {
            V::Null => Ok(postgres::types::IsNull::Yes),
            // The schema is BIGINT throughout, but PostgreSQL infers a
            // parameter's type from where it appears.
            V::Int(i) if *ty == Type::INT4 => i32::try_from(*i)?.to_sql(ty, out),
            V::Int(i) => i.to_sql(ty, out),
            V::Text(s) => s.to_sql(ty, out),
            V::Blob(b) => b.to_sql(ty, out),
            V::Bool(b) => b.to_sql(ty, out),
        }
    }

    fn accepts(_: &postgres::types::Type) -> bool {
        true
    }

    postgres::types::to_sql_checked!();
}

/// One result row, whichever backend it came from.
struct Row(Vec<V>);

impl Row {
    fn at(&self, i: usize) -> Result<&V, Error> {
        self.0
            .get(i)
            .ok_or_else(|| Error::Journal(format!("a query returned no column {i}")))
    }
    fn mismatch(&self, i: usize, want: &str) -> Error {
        // The kind only: a value may be a whole response body.
        let got = match self.0.get(i) {
            Some(V::Null) => "NULL",
            Some(V::Int(_)) => "an integer",
            Some(V::Text(_)) => "text",
            Some(V::Blob(_)) => "bytes",
            Some(V::Bool(_)) => "a boolean",
            None => "nothing",
        };
        Error::Journal(format!("column {i}: expected {want}, got {got}"))
    }
    fn opt_i64(&self, i: usize) -> Result<Option<i64>, Error> {
        match self.at(i)? {
            V::Null => Ok(None),
            V::Int(v) => Ok(Some(*v)),
            V::Bool(b) => Ok(Some(i64::from(*b))),
            _ => Err(self.mismatch(i, "an integer")),
        }
    }
    fn i64(&self, i: usize) -> Result<i64, Error> {
        self.opt_i64(i)?
            .ok_or_else(|| self.mismatch(i, "an integer"))
    }
    fn bool(&self, i: usize) -> Result<bool, Error> {
        Ok(self.i64(i)? != 0)
    }
    fn opt_text(&self, i: usize) -> Result<Option<String>, Error> {
        match self.at(i)? {
            V::Null => Ok(None),
            V::Text(s) => Ok(Some(s.clone())),
            _ => Err(self.mismatch(i, "text")),
        }
    }
    fn text(&self, i: usize) -> Result<String, Error> {
        self.opt_text(i)?.ok_or_else(|| self.mismatch(i, "text"))
    }
    fn opt_blob(&self, i: usize) -> Result<Option<Vec<u8>>, Error> {
        match self.at(i)? {
            V::Null => Ok(None),
            V::Blob(b) => Ok(Some(b.clone())),
            _ => Err(self.mismatch(i, "bytes")),
        }
    }
    fn opt_status(&self, i: usize) -> Result<Option<u16>, Error> {
        Ok(self.opt_i64(i)?.and_then(|s| u16::try_from(s).ok()))
    }
}

/// The connection, per backend.
enum Db {
    /// SQLite; `seq` is the sequence's last value (one gateway per file,
    /// so an in-memory counter suffices).
    Sqlite {
        conn: Connection,
        seq: i64,
    },
    Postgres(Box<Pg>),
}

/// A PostgreSQL connection that comes back: a database restarted (or a
/// connection cut) fails the statement it was running, and the next call
/// connects again rather than failing until the gateway restarts.
struct Pg {
    url: String,
    shown: String,
    /// `None` only while the journal is dropped.
    client: Option<postgres::Client>,
}

impl Pg {
    fn connect(url: &str, shown: &str) -> Result<postgres::Client, Error> {
        blocking(|| postgres::Client::connect(url, postgres::NoTls))
            .map_err(|e| Error::Journal(format!("{shown}: {}", crate::pg_error(&e))))
    }

    fn client(&mut self) -> Result<&mut postgres::Client, Error> {
        if self
            .client
            .as_ref()
            .is_some_and(postgres::Client::is_closed)
        {
            let new = Pg::connect(&self.url, &self.shown)?;
            // Dropping a client blocks on its runtime (see `blocking`).
            let old = self.client.replace(new);
            blocking(move || drop(old));
        }
        self.client
            .as_mut()
            .ok_or_else(|| Error::Journal("the journal is closed".into()))
    }
}

/// `?N` parameters as PostgreSQL spells them (`$N`).
fn pg_sql(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len());
    let mut it = sql.chars().peekable();
    while let Some(c) = it.next() {
        if c == '?' && it.peek().is_some_and(char::is_ascii_digit) {
            out.push('$');
        } else {
            out.push(c);
        }
    }
    out
}

/// Runs `f`, which blocks on the postgres client's own runtime, where that
/// is allowed: the sync client panics if called on a thread that drives a
/// tokio runtime (the gateway's journal calls are on its workers).
fn blocking<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Err(_) => f(),
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        // A current-thread runtime cannot give its thread away.
        Ok(_) => std::thread::scope(|s| match s.spawn(f).join() {
            Ok(r) => r,
            Err(panic) => std::panic::resume_unwind(panic),
        }),
    }
}

fn pg_row(r: &postgres::Row) -> Result<Row, postgres::Error> {
    use postgres::types::Type;
    let mut out = Vec::with_capacity(r.len());
    for (i, c) in r.columns().iter().enumerate() {
        let t = c.type_();
        let v = if *t == Type::INT8 {
            r.try_get::<_, Option<i64>>(i)?.map(V::Int)
        } else if *t == Type::INT4 {
            r.try_get::<_, Option<i32>>(i)?.map(|v| V::Int(v.into()))
        } else if *t == Type::BOOL {
            r.try_get::<_, Option<bool>>(i)?.map(V::Bool)
        } else if *t == Type::BYTEA {
            r.try_get::<_, Option<Vec<u8>>>(i)?.map(V::Blob)
        } else {
            // TEXT and the like; anything else fails here, named.
            r.try_get::<_, Option<String>>(i)?.map(V::Text)
        };
        out.push(v.unwrap_or(V::Null));
    }
    Ok(Row(out))
}

impl Db {
    fn query(&mut self, sql: &str, args: &[V]) -> Result<Vec<Row>, Error> {
        match self {
            Db::Sqlite { conn, .. } => {
                use rusqlite::types::ValueRef;
                let mut st = conn.prepare_cached(sql)?;
                let n = st.column_count();
                let mut rows = st.query(rusqlite::params_from_iter(args))?;
                let mut out = Vec::new();
                while let Some(r) = rows.next()? {
                    let mut row = Vec::with_capacity(n);
                    for i in 0..n {
                        row.push(match r.get_ref(i)? {
                            ValueRef::Null => V::Null,
                            ValueRef::Integer(v) => V::Int(v),
                            ValueRef::Text(t) => V::Text(String::from_utf8_lossy(t).into_owned()),
                            ValueRef::Blob(b) => V::Blob(b.to_vec()),
                            ValueRef::Real(f) => {
                                return Err(Error::Journal(format!(
                                    "column {i}: unexpected real {f}"
                                )))
                            }
                        });
                    }
                    out.push(Row(row));
                }
                Ok(out)
            }
            Db::Postgres(c) => {
                let c = c.client()?;
                let sql = pg_sql(sql);
                let refs: Vec<&(dyn postgres::types::ToSql + Sync)> =
                    args.iter().map(|a| a as _).collect();
                blocking(|| -> Result<Vec<Row>, postgres::Error> {
                    c.query(sql.as_str(), &refs)?.iter().map(pg_row).collect()
                })
                .map_err(Error::from)
            }
        }
    }

    fn exec(&mut self, sql: &str, args: &[V]) -> Result<u64, Error> {
        match self {
            Db::Sqlite { conn, .. } => Ok(conn
                .prepare_cached(sql)?
                .execute(rusqlite::params_from_iter(args))?
                as u64),
            Db::Postgres(c) => {
                let c = c.client()?;
                let sql = pg_sql(sql);
                let refs: Vec<&(dyn postgres::types::ToSql + Sync)> =
                    args.iter().map(|a| a as _).collect();
                Ok(blocking(|| c.execute(sql.as_str(), &refs))?)
            }
        }
    }

    fn one(&mut self, sql: &str, args: &[V]) -> Result<Option<Row>, Error> {
        Ok(self.query(sql, args)?.into_iter().next())
    }

    /// The next value of the sequence that orders effects, releases and
    /// moments.
    fn next_seq(&mut self) -> Result<i64, Error> {
        match self {
            Db::Sqlite { seq, .. } => {
                *seq += 1;
                Ok(*seq)
            }
            // Every host's gateway draws from the one database sequence:
            // per-host counters would collide (releases.seq is a key) and
            // would not order a branch's rows written on two hosts.
            Db::Postgres(_) => self
                .one("SELECT nextval('effects_seq')", &[])?
                .ok_or_else(|| Error::Journal("nextval returned nothing".into()))?
                .i64(0),
        }
    }
}

/// The journal database.
pub struct Journal {
    db: RefCell<Db>,
    /// The host whose gateway this is (see [`crate::Paths::host_id`]).
    host: String,
}

impl Drop for Journal {
    fn drop(&mut self) {
        // Closing a postgres client blocks on its runtime: do it where
        // that is allowed (see `blocking`).
        if let Db::Postgres(pg) = self.db.get_mut() {
            if let Some(c) = pg.client.take() {
                blocking(move || drop(c));
            }
        }
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

const EFFECT_COLUMNS: &str = "id, seq, tree, scope, key, branch, method, dest, state, status, \
     resp_head, resp_body, resp_bytes, error, host";

fn effect_row(r: &Row) -> Result<EffectRow, Error> {
    Ok(EffectRow {
        id: r.i64(0)?,
        seq: r.i64(1)?,
        tree: r.text(2)?,
        scope: r.text(3)?,
        key: r.opt_text(4)?,
        branch: r.text(5)?,
        method: r.text(6)?,
        dest: r.text(7)?,
        state: State::parse(&r.text(8)?).unwrap_or(State::InDoubt),
        status: r.opt_status(9)?,
        resp_head: r.opt_blob(10)?,
        resp_body: r.opt_blob(11)?,
        resp_bytes: r.opt_i64(12)?,
        error: r.opt_text(13)?,
        host: r.opt_text(14)?,
    })
}

/// Appends to `sql` one `OR (<table>.branch = ?i AND <table>.seq < ?j)` per
/// barrier (an ancestor's rows before it forked), numbering the parameters
/// after those already in `args`.
fn or_before_barriers(
    sql: &mut String,
    args: &mut Vec<V>,
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
        args.push(b.as_str().into());
        args.push((*seq).into());
    }
}

impl Journal {
    /// Opens (creating or migrating) the SQLite journal at `path`, for a
    /// gateway that is alone on it.
    pub fn open(path: &Path) -> Result<Self, Error> {
        Journal::connect(&Meta::Sqlite(path.to_path_buf()), "")
    }

    /// Opens (creating or migrating) the journal `meta` names, as the
    /// gateway of `host`: its in-flight effects and bound branches are
    /// marked with it, so in a shared database each host's gateway picks
    /// up only its own (required for PostgreSQL).
    pub fn connect(meta: &Meta, host: &str) -> Result<Self, Error> {
        let db = match meta {
            Meta::Sqlite(path) => Db::Sqlite {
                conn: open_sqlite(path)?,
                seq: 0,
            },
            Meta::Postgres(url) => {
                if host.is_empty() {
                    return Err(Error::Journal(
                        "a shared (PostgreSQL) journal needs the host's id".into(),
                    ));
                }
                let shown = meta.shown();
                Db::Postgres(Box::new(Pg {
                    client: Some(Pg::connect(url, &shown)?),
                    url: url.clone(),
                    shown,
                }))
            }
        };
        let mut j = Journal {
            db: RefCell::new(db),
            host: host.to_string(),
        };
        j.migrate()?;
        j.resume_seq()?;
        Ok(j)
    }

    /// The host this journal writes as (`""`: a local journal's only gateway).
    pub fn host(&self) -> &str {
        &self.host
    }

    fn db(&self) -> Result<std::cell::RefMut<'_, Db>, Error> {
        self.db
            .try_borrow_mut()
            .map_err(|_| Error::Journal("the journal was used re-entrantly".into()))
    }

    /// Whose rows "this host's" means: every row in a local SQLite file
    /// (one gateway per file: its flock), only `host`'s in a shared database.
    fn host_filter(&self) -> Result<V, Error> {
        Ok(match &*self.db()? {
            Db::Sqlite { .. } => V::Text(String::new()),
            Db::Postgres(_) => V::Text(self.host.clone()),
        })
    }

    fn host_value(&self) -> V {
        Some(self.host.as_str()).filter(|h| !h.is_empty()).into()
    }

    fn migrate(&mut self) -> Result<(), Error> {
        match self.db.get_mut() {
            Db::Sqlite { conn, .. } => {
                let tx = conn.transaction()?;
                tx.execute_batch(
                    "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)",
                )?;
                let v: Option<i64> = {
                    let mut st = tx.prepare("SELECT version FROM schema_version")?;
                    let mut rows = st.query([])?;
                    match rows.next()? {
                        Some(r) => Some(r.get(0)?),
                        None => None,
                    }
                };
                let v = match v {
                    Some(v) => v,
                    None => {
                        tx.execute("INSERT INTO schema_version (version) VALUES (0)", [])?;
                        0
                    }
                };
                check_version(v)?;
                for (i, m) in SQLITE_MIGRATIONS.iter().enumerate().skip(v as usize) {
                    tx.execute_batch(m)?;
                    tx.execute("UPDATE schema_version SET version = ?1", [i as i64 + 1])?;
                }
                tx.commit()?;
                Ok(())
            }
            Db::Postgres(c) => {
                let c = c.client()?;
                blocking(|| -> Result<(), Error> {
                    let mut tx = c.transaction()?;
                    // Hosts that start at once would race on CREATE TABLE
                    // (IF NOT EXISTS is not safe under concurrency): one
                    // migrates, the others wait and find it done.
                    tx.batch_execute(&format!(
                        "SELECT pg_advisory_xact_lock({PG_MIGRATION_LOCK})"
                    ))?;
                    tx.batch_execute(
                        "CREATE TABLE IF NOT EXISTS effects_schema_version (version BIGINT NOT NULL)",
                    )?;
                    let v = match tx.query_opt("SELECT version FROM effects_schema_version", &[])? {
                        Some(r) => r.try_get::<_, i64>(0)?,
                        None => {
                            tx.execute(
                                "INSERT INTO effects_schema_version (version) VALUES (0)",
                                &[],
                            )?;
                            0
                        }
                    };
                    check_version(v)?;
                    for (i, m) in PG_MIGRATIONS.iter().enumerate().skip(v as usize) {
                        tx.batch_execute(m)?;
                        tx.execute(
                            "UPDATE effects_schema_version SET version = $1",
                            &[&(i as i64 + 1)],
                        )?;
                    }
                    tx.commit()?;
                    Ok(())
                })
            }
        }
    }

    /// SQLite's counter goes on from the largest sequence number written.
    fn resume_seq(&mut self) -> Result<(), Error> {
        if let Db::Sqlite { conn, seq } = self.db.get_mut() {
            *seq = conn.query_row(
                "SELECT MAX(COALESCE((SELECT MAX(seq) FROM effects_effects), 0),
                            COALESCE((SELECT MAX(seq) FROM effects_releases), 0),
                            COALESCE((SELECT MAX(seq) FROM effects_moments), 0))",
                [],
                |r| r.get(0),
            )?;
        }
        Ok(())
    }

    /// The schema version in the database.
    pub fn schema_version(&self) -> Result<i64, Error> {
        let mut db = self.db()?;
        let sql = match &*db {
            Db::Sqlite { .. } => "SELECT version FROM schema_version",
            // The store may have a `schema_version` in the same database.
            Db::Postgres(_) => "SELECT version FROM effects_schema_version",
        };
        db.one(sql, &[])?
            .ok_or_else(|| Error::Journal("no schema version".into()))?
            .i64(0)
    }

    /// At gateway start: this host's effects still `sent` were cut off by
    /// its gateway's end. Their outcome is unknown: they become in-doubt.
    /// Another host's are left alone: its gateway may be sending them now.
    pub fn mark_in_doubt(&mut self) -> Result<usize, Error> {
        let host = self.host_filter()?;
        Ok(self.db()?.exec(
            "UPDATE effects_effects SET state = 'in-doubt',
                 error = 'the gateway ended while the request was sent; the destination may or may not have acted on it'
             WHERE state = 'sent' AND (CAST(?1 AS TEXT) = '' OR host = ?1)",
            &[host],
        )? as usize)
    }

    /// A shared journal: this host's gateway is alive (by the database's
    /// clock). Other hosts take an effect this host was sending as in
    /// doubt once its heartbeats stop ([`Journal::doubt_if_host_gone`]).
    /// Nothing to do in a local journal.
    pub fn heartbeat(&mut self) -> Result<(), Error> {
        let mut db = self.db()?;
        if let Db::Postgres(_) = &*db {
            db.exec(
                &format!(
                    "INSERT INTO effects_hosts (host, seen_ms) VALUES (?1, {PG_NOW_MS})
                     ON CONFLICT (host) DO UPDATE SET seen_ms = EXCLUDED.seen_ms"
                ),
                &[self.host.as_str().into()],
            )?;
        }
        Ok(())
    }

    /// `row` is `sent` by another host's gateway: if that gateway has not
    /// beaten for `silent` (it died, or its host is gone), nobody will
    /// record its outcome: it becomes in doubt (one statement, so the
    /// check and the change cannot be split by that host's late
    /// heartbeat). Returns whether it did.
    pub fn doubt_if_host_gone(
        &mut self,
        row: &EffectRow,
        silent: std::time::Duration,
    ) -> Result<bool, Error> {
        let Some(owner) = row.host.as_deref().filter(|h| *h != self.host) else {
            return Ok(false);
        };
        let mut db = self.db()?;
        if let Db::Sqlite { .. } = &*db {
            return Ok(false);
        }
        let why = format!(
            "the gateway of host {owner} stopped while the request was sent (no heartbeat for {} s); the destination may or may not have acted on it",
            silent.as_secs()
        );
        let n = db.exec(
            &format!(
                "UPDATE effects_effects SET state = 'in-doubt', error = ?3, completed_ms = ?4
                 WHERE id = ?1 AND state = 'sent' AND host = ?2
                   AND NOT EXISTS (SELECT 1 FROM effects_hosts h
                                   WHERE h.host = ?2 AND h.seen_ms > {PG_NOW_MS} - ?5)"
            ),
            &[
                row.id.into(),
                owner.into(),
                why.as_str().into(),
                now_ms().into(),
                (silent.as_millis() as i64).into(),
            ],
        )?;
        Ok(n > 0)
    }

    /// Records (or replaces) a branch's registration, whether it is
    /// active, and that this host binds it.
    pub fn put_branch(&mut self, reg: &Registration, active: bool) -> Result<(), Error> {
        let text = serde_json::to_string(reg).map_err(|e| Error::Journal(e.to_string()))?;
        let host = self.host_value();
        self.db()?.exec(
            "INSERT INTO effects_branches (id, vm, tree, registration, active, created_ms, host)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
             ON CONFLICT(id) DO UPDATE SET vm = ?2, registration = ?4, active = ?5, host = ?7",
            &[
                reg.branch.as_str().into(),
                reg.vm.as_str().into(),
                reg.tree().into(),
                text.as_str().into(),
                active.into(),
                now_ms().into(),
                host,
            ],
        )?;
        Ok(())
    }

    pub fn set_active(&mut self, branch: &str, active: bool) -> Result<(), Error> {
        self.db()?.exec(
            "UPDATE effects_branches SET active = ?2 WHERE id = ?1",
            &[branch.into(), active.into()],
        )?;
        Ok(())
    }

    pub fn branch(&self, id: &str) -> Result<Option<BranchRow>, Error> {
        let row = self.db()?.one(
            "SELECT registration, active FROM effects_branches WHERE id = ?1",
            &[id.into()],
        )?;
        row.map(|r| branch_row(&r)).transpose()
    }

    /// The newest branch that belongs to vm `name` (this host's first, then
    /// active ones: vm names are per host, and hosts share a database).
    pub fn branch_of_vm(&self, name: &str) -> Result<Option<BranchRow>, Error> {
        let row = self.db()?.one(
            "SELECT registration, active FROM effects_branches WHERE vm = ?1
             ORDER BY CASE WHEN host = ?2 THEN 0 ELSE 1 END, active DESC, created_ms DESC, id DESC
             LIMIT 1",
            &[name.into(), self.host.as_str().into()],
        )?;
        row.map(|r| branch_row(&r)).transpose()
    }

    /// This host's active branches (re-bound when its gateway starts; a
    /// branch bound on another host has its socket there).
    pub fn active_branches(&self) -> Result<Vec<Registration>, Error> {
        let host = self.host_filter()?;
        self.db()?
            .query(
                "SELECT registration, active FROM effects_branches
                 WHERE active AND (CAST(?1 AS TEXT) = '' OR host = ?1)
                 ORDER BY created_ms, id",
                &[host],
            )?
            .iter()
            .map(|r| Ok(branch_row(r)?.registration))
            .collect()
    }

    /// Records a barrier: everything released to `branch` so far is before
    /// moment `id`. Returns its sequence number.
    pub fn add_moment(&mut self, id: &str, branch: &str, kind: MomentKind) -> Result<i64, Error> {
        let mut db = self.db()?;
        let seq = db.next_seq()?;
        db.exec(
            "INSERT INTO effects_moments (id, branch, kind, seq, created_ms)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT(id) DO UPDATE SET seq = ?4",
            &[
                id.into(),
                branch.into(),
                kind.as_str().into(),
                seq.into(),
                now_ms().into(),
            ],
        )?;
        Ok(seq)
    }

    /// A moment that was not taken after all (the VMM refused the fork).
    pub fn delete_moment(&mut self, id: &str) -> Result<(), Error> {
        self.db()?
            .exec("DELETE FROM effects_moments WHERE id = ?1", &[id.into()])?;
        Ok(())
    }

    pub fn moment_seq(&self, id: &str) -> Result<Option<i64>, Error> {
        self.db()?
            .one(
                "SELECT seq FROM effects_moments WHERE id = ?1",
                &[id.into()],
            )?
            .map(|r| r.i64(0))
            .transpose()
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
            "SELECT COUNT(*) FROM effects_releases r JOIN effects_effects e ON e.id = r.effect
             WHERE e.digest = ?1 AND e.key_source = 'derived' AND (r.branch = ?2",
        );
        let mut args: Vec<V> = vec![digest.into(), branch.into()];
        or_before_barriers(&mut sql, &mut args, "r", barriers);
        sql.push(')');
        self.db()?
            .one(&sql, &args)?
            .ok_or_else(|| Error::Journal("COUNT returned nothing".into()))?
            .i64(0)
    }

    /// The effect with `key` in `tree` and `scope`, if any.
    pub fn find(&self, tree: &str, scope: &str, key: &str) -> Result<Option<EffectRow>, Error> {
        self.db()?
            .one(
                &format!(
                    "SELECT {EFFECT_COLUMNS} FROM effects_effects
                     WHERE tree = ?1 AND scope = ?2 AND key = ?3"
                ),
                &[tree.into(), scope.into(), key.into()],
            )?
            .map(|r| effect_row(&r))
            .transpose()
    }

    /// An effect with `key` that an ancestor executed before its barrier.
    pub fn find_before(
        &self,
        tree: &str,
        key: &str,
        barriers: &[(String, i64)],
    ) -> Result<Option<EffectRow>, Error> {
        let mut db = self.db()?;
        for (b, seq) in barriers.iter().rev() {
            let row = db.one(
                &format!(
                    "SELECT {EFFECT_COLUMNS} FROM effects_effects
                     WHERE tree = ?1 AND key = ?2 AND branch = ?3 AND seq < ?4"
                ),
                &[tree.into(), key.into(), b.as_str().into(), (*seq).into()],
            )?;
            if let Some(r) = row {
                return Ok(Some(effect_row(&r)?));
            }
        }
        Ok(None)
    }

    pub fn get(&self, id: i64) -> Result<Option<EffectRow>, Error> {
        self.db()?
            .one(
                &format!("SELECT {EFFECT_COLUMNS} FROM effects_effects WHERE id = ?1"),
                &[id.into()],
            )?
            .map(|r| effect_row(&r))
            .transpose()
    }

    /// Inserts a row and commits it. `Ok(None)`: the key is taken.
    pub fn insert(&mut self, e: &NewEffect<'_>) -> Result<Option<i64>, Error> {
        let host = self.host_value();
        let mut db = self.db()?;
        let seq = db.next_seq()?;
        // The unique index on (tree, scope, key) decides between gateways
        // racing for one key (two hosts of one tree, in a shared
        // database): the loser's insert returns no row instead of failing
        // (PostgreSQL first waits for the winner's commit), and the caller
        // finds the winner's row. No lock is needed beyond the index's.
        let row = db.one(
            "INSERT INTO effects_effects (seq, tree, scope, key, key_text, key_source, branch,
                 method, url, dest, digest, policy, state, status, req_bytes, error, started_ms, host)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18)
             ON CONFLICT DO NOTHING
             RETURNING id",
            &[
                seq.into(),
                e.tree.into(),
                e.scope.into(),
                e.key.into(),
                e.key_text.or(e.key).into(),
                e.key_source.into(),
                e.branch.into(),
                e.method.into(),
                e.url.into(),
                e.dest.into(),
                e.digest.into(),
                e.policy.into(),
                e.state.as_str().into(),
                e.status.map(i64::from).into(),
                (e.req_bytes as i64).into(),
                e.error.into(),
                now_ms().into(),
                host,
            ],
        )?;
        row.map(|r| r.i64(0)).transpose()
    }

    /// The destination answered: status, headers and body are recorded.
    pub fn complete(
        &mut self,
        id: i64,
        status: u16,
        head: &[u8],
        body: &[u8],
    ) -> Result<(), Error> {
        self.db()?.exec(
            "UPDATE effects_effects SET state = 'completed', status = ?2, resp_head = ?3,
                 resp_body = ?4, resp_bytes = ?5, completed_ms = ?6 WHERE id = ?1",
            &[
                id.into(),
                i64::from(status).into(),
                head.into(),
                body.into(),
                (body.len() as i64).into(),
                now_ms().into(),
            ],
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
        self.db()?.exec(
            "UPDATE effects_effects SET state = 'too-large', status = ?2, resp_head = ?3,
                 resp_bytes = ?4, completed_ms = ?5 WHERE id = ?1",
            &[
                id.into(),
                i64::from(status).into(),
                head.into(),
                (bytes as i64).into(),
                now_ms().into(),
            ],
        )?;
        Ok(())
    }

    /// Sets the final byte count of a too-large, passed or tunnel row.
    pub fn set_bytes(&mut self, id: i64, req: u64, resp: u64) -> Result<(), Error> {
        self.db()?.exec(
            "UPDATE effects_effects
             SET req_bytes = CASE WHEN req_bytes > ?2 THEN req_bytes ELSE ?2 END,
                 resp_bytes = ?3, completed_ms = ?4 WHERE id = ?1",
            &[
                id.into(),
                (req as i64).into(),
                (resp as i64).into(),
                now_ms().into(),
            ],
        )?;
        Ok(())
    }

    /// Outcome unknown (the destination failed after the request went out).
    pub fn in_doubt(&mut self, id: i64, why: &str) -> Result<(), Error> {
        self.db()?.exec(
            "UPDATE effects_effects SET state = 'in-doubt', error = ?2, completed_ms = ?3
             WHERE id = ?1",
            &[id.into(), why.into(), now_ms().into()],
        )?;
        Ok(())
    }

    /// Nothing reached the destination (it could not be connected to): the
    /// row goes, so the key is free for a retry.
    pub fn delete_unsent(&mut self, id: i64) -> Result<(), Error> {
        self.db()?.exec(
            "DELETE FROM effects_effects WHERE id = ?1 AND state = 'sent'",
            &[id.into()],
        )?;
        Ok(())
    }

    /// A recorded response went to `branch`. Returns the release's sequence.
    pub fn release(&mut self, effect: i64, branch: &str, replay: bool) -> Result<i64, Error> {
        let mut db = self.db()?;
        // One statement: the sequence number (the database's on
        // PostgreSQL) is the row's key, so no two hosts write the same.
        let seq = db.next_seq()?;
        db.exec(
            "INSERT INTO effects_releases (seq, effect, branch, replay, ms)
             VALUES (?1, ?2, ?3, ?4, ?5)",
            &[
                seq.into(),
                effect.into(),
                branch.into(),
                replay.into(),
                now_ms().into(),
            ],
        )?;
        Ok(seq)
    }

    /// A human's decision on an in-doubt effect of `tree` with `key`:
    /// `resend` frees the key (the next request is sent), otherwise it
    /// becomes `failed` (later requests get an error). Returns the row id.
    pub fn resolve(&mut self, tree: &str, key: &str, resend: bool) -> Result<Option<i64>, Error> {
        // One statement, so two people resolving at once on two hosts
        // cannot both win: the outer `state = 'in-doubt'` is checked again
        // after the row lock (PostgreSQL re-reads a row another transaction
        // changed), and the loser updates nothing.
        self.db()?
            .one(
                "UPDATE effects_effects SET
                     state = CASE WHEN ?3 THEN 'abandoned' ELSE 'failed' END,
                     key = CASE WHEN ?3 THEN NULL ELSE key END,
                     error = COALESCE(error, '') || CASE WHEN ?3
                         THEN '; resolved by a human: send again'
                         ELSE '; resolved by a human: failed' END
                 WHERE state = 'in-doubt' AND id = (
                     SELECT id FROM effects_effects
                     WHERE tree = ?1 AND key = ?2 AND state = 'in-doubt' ORDER BY id LIMIT 1)
                 RETURNING id",
                &[tree.into(), key.into(), resend.into()],
            )?
            .map(|r| r.i64(0))
            .transpose()
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
                    EXISTS (SELECT 1 FROM effects_releases r
                            WHERE r.effect = e.id AND r.branch = ?1 AND r.replay),
                    e.host
             FROM effects_effects e LEFT JOIN effects_branches b ON b.id = e.branch
             WHERE e.branch = ?1
                OR e.id IN (SELECT effect FROM effects_releases WHERE branch = ?1 AND replay)",
        );
        let mut args: Vec<V> = vec![branch.into()];
        or_before_barriers(&mut sql, &mut args, "e", &barriers);
        sql.push_str(" ORDER BY e.seq");
        let mut db = self.db()?;
        let mut out = Vec::new();
        for r in db.query(&sql, &args)? {
            let executed_branch = r.text(9)?;
            let replayed_here = r.bool(15)?;
            let relation = if executed_branch == branch {
                "own"
            } else if replayed_here {
                "replayed"
            } else {
                "ancestor"
            };
            out.push(EffectView {
                id: r.i64(0)?,
                key: r.opt_text(1)?,
                key_source: r.opt_text(2)?,
                method: r.text(3)?,
                url: r.text(4)?,
                dest: r.text(5)?,
                policy: r.text(6)?,
                state: if replayed_here && executed_branch != branch {
                    "replayed".into()
                } else {
                    r.text(7)?
                },
                status: r.opt_status(8)?,
                relation: relation.into(),
                executed_by: r.text(10)?,
                executed_on: r.opt_text(16)?,
                started_ms: r.i64(11)?,
                completed_ms: r.opt_i64(12)?,
                resp_bytes: r.opt_i64(13)?,
                replayed_to: Vec::new(),
                error: r.opt_text(14)?,
            });
        }
        for v in &mut out {
            v.replayed_to = db
                .query(
                    "SELECT COALESCE(b.vm, r.branch), MIN(r.seq) AS first FROM effects_releases r
                     LEFT JOIN effects_branches b ON b.id = r.branch
                     WHERE r.effect = ?1 AND r.replay
                     GROUP BY COALESCE(b.vm, r.branch) ORDER BY first",
                    &[v.id.into()],
                )?
                .iter()
                .map(|r| r.text(0))
                .collect::<Result<_, _>>()?;
        }
        Ok(out)
    }

    /// Rows per state (for `tine gateway status` and tests).
    pub fn counts(&self) -> Result<Vec<(String, i64)>, Error> {
        self.db()?
            .query(
                "SELECT state, COUNT(*) FROM effects_effects GROUP BY state ORDER BY state",
                &[],
            )?
            .iter()
            .map(|r| Ok((r.text(0)?, r.i64(1)?)))
            .collect()
    }
}

fn branch_row(r: &Row) -> Result<BranchRow, Error> {
    let text = r.text(0)?;
    Ok(BranchRow {
        registration: serde_json::from_str(&text)
            .map_err(|e| Error::Journal(format!("a branch's registration: {e}")))?,
        active: r.bool(1)?,
    })
}

fn check_version(v: i64) -> Result<(), Error> {
    if v > SCHEMA_VERSION {
        return Err(Error::Journal(format!(
            "the journal has schema version {v}, newer than this tine's {SCHEMA_VERSION}: use a newer tine"
        )));
    }
    Ok(())
}

fn open_sqlite(path: &Path) -> Result<Connection, Error> {
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
    Ok(conn)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_pg_sql_numbers_parameters_only() {
        assert_eq!(
            pg_sql("a = ?1 AND b = ?12 AND c = '?' AND d = ?"),
            "a = $1 AND b = $12 AND c = '?' AND d = ?"
        );
    }

    #[test]
    fn test_meta_from_tine_meta() {
        let p = Path::new("/h/effects/journal.db");
        assert_eq!(Meta::parse(None, p).ok(), Some(Meta::Sqlite(p.into())));
        assert_eq!(
            Meta::parse(Some("sqlite"), p).ok(),
            Some(Meta::Sqlite(p.into()))
        );
        let url = "postgres://u:secret@db:5432/tine";
        assert_eq!(
            Meta::parse(Some(url), p).ok(),
            Some(Meta::Postgres(url.into()))
        );
        assert_eq!(
            Meta::Postgres(url.into()).shown(),
            "postgres://u:***@db:5432/tine"
        );
        let err = Meta::parse(Some("mysql://u:secret@x/y"), p)
            .err()
            .map(|e| e.to_string());
        assert!(
            err.as_deref()
                .is_some_and(|e| e.contains("TINE_META") && !e.contains("secret")),
            "{err:?}"
        );
    }
}
