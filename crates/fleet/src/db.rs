//! The fleet's tables in the metadata database `TINE_META` names: SQLite
//! (one host: `$TINE_HOME/fleet.db`) or
//! PostgreSQL (every host of a fleet).
//!
//! Written by hand over rusqlite and postgres rather than through an ORM:
//! the fleet needs a handful of statements, and one SQL text serves both
//! because `$1`-style placeholders mean the same in both (SQLite reads
//! `$1` as a named parameter bound in order of first use).

use std::path::PathBuf;
use std::sync::Mutex;

use crate::FleetError;

/// A value bound to or read from a statement.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum V {
    I(i64),
    T(String),
    Null,
}

impl V {
    pub(crate) fn int(&self) -> Option<i64> {
        match self {
            V::I(i) => Some(*i),
            _ => None,
        }
    }
    pub(crate) fn text(&self) -> Option<&str> {
        match self {
            V::T(s) => Some(s),
            _ => None,
        }
    }
}

/// Where the metadata is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetaUrl {
    Sqlite(PathBuf),
    Postgres(String),
}

impl MetaUrl {
    /// `TINE_META`'s value (unset or `sqlite`: the host's own file).
    pub fn parse(value: Option<&str>, sqlite_file: PathBuf) -> Result<MetaUrl, FleetError> {
        match value.map(str::trim) {
            None | Some("") | Some("sqlite") => Ok(MetaUrl::Sqlite(sqlite_file)),
            Some(v) if v.starts_with("postgres://") || v.starts_with("postgresql://") => {
                Ok(MetaUrl::Postgres(v.to_string()))
            }
            Some(v) => Err(FleetError::Config(format!(
                "TINE_META={:?} is neither `sqlite` nor a postgres://user@host:port/db URL",
                redact(v)
            ))),
        }
    }

    /// For messages: never the password.
    pub fn describe(&self) -> String {
        match self {
            MetaUrl::Sqlite(p) => p.display().to_string(),
            MetaUrl::Postgres(u) => redact(u),
        }
    }

    /// Whether hosts other than this one can share it.
    pub fn shared(&self) -> bool {
        matches!(self, MetaUrl::Postgres(_))
    }
}

/// `scheme://user:secret@rest` → `scheme://user@rest`.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    match rest.split_once('@') {
        Some((userinfo, host)) => {
            let user = userinfo.split(':').next().unwrap_or("");
            format!("{scheme}://{user}@{host}")
        }
        None => url.to_string(),
    }
}

/// Migrations of the fleet's tables, in order; `fleet_schema_version`
/// holds how many ran. Never edit a step that shipped: add one.
const MIGRATIONS: &[&str] = &[
    // 1: hosts and where vms run.
    r#"
    CREATE TABLE fleet_hosts (
        id TEXT PRIMARY KEY,
        address TEXT NOT NULL,
        owner TEXT NOT NULL,
        offer TEXT NOT NULL,
        capacity TEXT NOT NULL,
        started_ms BIGINT NOT NULL,
        heartbeat_ms BIGINT NOT NULL,
        lease_ms BIGINT NOT NULL,
        stopped_ms BIGINT
    );
    CREATE TABLE fleet_vms (
        name TEXT PRIMARY KEY,
        host TEXT NOT NULL,
        state TEXT NOT NULL,
        mem_mib BIGINT NOT NULL,
        vcpus BIGINT NOT NULL,
        snapshot BIGINT,
        updated_ms BIGINT NOT NULL
    );
    CREATE INDEX fleet_vms_host ON fleet_vms (host);
    "#,
];

/// PostgreSQL's key for `pg_advisory_xact_lock`: every fleet write
/// transaction takes it, so they serialize as SQLite's do.
const PG_LOCK: i64 = 0x7469_6e65_666c_7431; // "tineflt1"

enum Conn {
    Sqlite(rusqlite::Connection),
    Pg(Box<postgres::Client>),
}

/// One connection, for one process (tined does not fork).
pub(crate) struct Db {
    url: MetaUrl,
    conn: Mutex<Option<Conn>>,
}

impl std::fmt::Debug for Db {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Db")
            .field("url", &self.url.describe())
            .finish()
    }
}

fn sq<'a>(url: &'a MetaUrl, what: &'static str) -> impl Fn(rusqlite::Error) -> FleetError + 'a {
    move |e| FleetError::Db {
        at: url.describe(),
        what,
        message: e.to_string(),
    }
}

fn pg<'a>(url: &'a MetaUrl, what: &'static str) -> impl Fn(postgres::Error) -> FleetError + 'a {
    move |e| FleetError::Db {
        at: url.describe(),
        what,
        message: e.to_string(),
    }
}

impl Db {
    /// Connects and runs the migrations that have not run.
    pub(crate) fn open(url: &MetaUrl) -> Result<Db, FleetError> {
        let db = Db {
            url: url.clone(),
            conn: Mutex::new(None),
        };
        db.with(migrate)?;
        Ok(db)
    }

    pub(crate) fn url(&self) -> &MetaUrl {
        &self.url
    }

    fn connect(&self) -> Result<Conn, FleetError> {
        match &self.url {
            MetaUrl::Sqlite(p) => {
                if let Some(dir) = p.parent() {
                    std::fs::create_dir_all(dir).map_err(|e| FleetError::Db {
                        at: self.url.describe(),
                        what: "creating its directory",
                        message: e.to_string(),
                    })?;
                }
                let c = rusqlite::Connection::open(p).map_err(sq(&self.url, "opening"))?;
                c.busy_timeout(std::time::Duration::from_secs(30))
                    .map_err(sq(&self.url, "setting busy_timeout"))?;
                c.pragma_update(None, "journal_mode", "WAL")
                    .map_err(sq(&self.url, "setting WAL"))?;
                Ok(Conn::Sqlite(c))
            }
            MetaUrl::Postgres(u) => {
                let c =
                    postgres::Client::connect(u, postgres::NoTls).map_err(|e| FleetError::Db {
                        at: self.url.describe(),
                        what: "connecting (is the server running? TINE_META names it)",
                        message: e.to_string(),
                    })?;
                Ok(Conn::Pg(Box::new(c)))
            }
        }
    }

    /// Runs `f` on the connection, connecting first if needed; a
    /// PostgreSQL connection that broke is made again once.
    fn with<T>(
        &self,
        f: impl Fn(&mut Conn, &MetaUrl) -> Result<T, FleetError>,
    ) -> Result<T, FleetError> {
        let mut g = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        for attempt in 0..2 {
            if g.is_none() {
                *g = Some(self.connect()?);
            }
            let Some(c) = g.as_mut() else { continue };
            let broken = matches!(c, Conn::Pg(p) if p.is_closed());
            if broken {
                *g = None;
                continue;
            }
            match f(c, &self.url) {
                // The server went away mid-call: connect again, once.
                Err(_) if attempt == 0 && matches!(c, Conn::Pg(p) if p.is_closed()) => {
                    *g = None;
                }
                r => return r,
            }
        }
        Err(FleetError::Db {
            at: self.url.describe(),
            what: "reconnecting",
            message: "the connection broke twice".into(),
        })
    }

    /// Rows of a query.
    pub(crate) fn query(&self, sql: &str, args: &[V]) -> Result<Vec<Vec<V>>, FleetError> {
        self.with(|c, url| match c {
            Conn::Sqlite(c) => sqlite_query(c, url, sql, args),
            Conn::Pg(c) => {
                let params = pg_params(args);
                let refs: Vec<&(dyn postgres::types::ToSql + Sync)> =
                    params.iter().map(|p| p.as_ref()).collect();
                let rows = c.query(sql, &refs).map_err(pg(url, "querying"))?;
                rows.iter().map(|r| pg_row(r, url)).collect()
            }
        })
    }

    /// Runs statements in one write transaction (serialized with every
    /// other fleet writer); returns rows changed by each.
    pub(crate) fn write(&self, stmts: &[(&str, Vec<V>)]) -> Result<Vec<u64>, FleetError> {
        self.with(|c, url| match c {
            Conn::Sqlite(c) => {
                let tx = c
                    .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                    .map_err(sq(url, "beginning"))?;
                let mut n = Vec::with_capacity(stmts.len());
                for (sql, args) in stmts {
                    let mut st = tx.prepare_cached(sql).map_err(sq(url, "preparing"))?;
                    let changed = st
                        .execute(rusqlite::params_from_iter(args.iter().map(sqlite_value)))
                        .map_err(sq(url, "writing"))?;
                    n.push(changed as u64);
                }
                tx.commit().map_err(sq(url, "committing"))?;
                Ok(n)
            }
            Conn::Pg(c) => {
                let mut tx = c.transaction().map_err(pg(url, "beginning"))?;
                tx.execute("SELECT pg_advisory_xact_lock($1)", &[&PG_LOCK])
                    .map_err(pg(url, "locking"))?;
                let mut n = Vec::with_capacity(stmts.len());
                for (sql, args) in stmts {
                    let params = pg_params(args);
                    let refs: Vec<&(dyn postgres::types::ToSql + Sync)> =
                        params.iter().map(|p| p.as_ref()).collect();
                    n.push(tx.execute(*sql, &refs).map_err(pg(url, "writing"))?);
                }
                tx.commit().map_err(pg(url, "committing"))?;
                Ok(n)
            }
        })
    }
}

fn sqlite_value(v: &V) -> rusqlite::types::Value {
    match v {
        V::I(i) => rusqlite::types::Value::Integer(*i),
        V::T(s) => rusqlite::types::Value::Text(s.clone()),
        V::Null => rusqlite::types::Value::Null,
    }
}

fn sqlite_query(
    c: &rusqlite::Connection,
    url: &MetaUrl,
    sql: &str,
    args: &[V],
) -> Result<Vec<Vec<V>>, FleetError> {
    let mut st = c.prepare_cached(sql).map_err(sq(url, "preparing"))?;
    let cols = st.column_count();
    let rows = st
        .query_map(
            rusqlite::params_from_iter(args.iter().map(sqlite_value)),
            |r| {
                (0..cols)
                    .map(|i| {
                        Ok(match r.get_ref(i)? {
                            rusqlite::types::ValueRef::Integer(i) => V::I(i),
                            rusqlite::types::ValueRef::Text(t) => {
                                V::T(String::from_utf8_lossy(t).into_owned())
                            }
                            _ => V::Null,
                        })
                    })
                    .collect::<rusqlite::Result<Vec<V>>>()
            },
        )
        .map_err(sq(url, "querying"))?;
    rows.collect::<rusqlite::Result<Vec<_>>>()
        .map_err(sq(url, "reading rows"))
}

type PgParam = Box<dyn postgres::types::ToSql + Sync>;

fn pg_params(args: &[V]) -> Vec<PgParam> {
    args.iter()
        .map(|v| -> PgParam {
            match v {
                V::I(i) => Box::new(*i),
                V::T(s) => Box::new(s.clone()),
                V::Null => Box::new(Option::<i64>::None),
            }
        })
        .collect()
}

fn pg_row(r: &postgres::Row, url: &MetaUrl) -> Result<Vec<V>, FleetError> {
    use postgres::types::Type;
    (0..r.len())
        .map(|i| {
            let t = r.columns()[i].type_();
            let v = if *t == Type::INT8 {
                r.try_get::<_, Option<i64>>(i)
                    .map(|v| v.map_or(V::Null, V::I))
            } else if *t == Type::INT4 {
                r.try_get::<_, Option<i32>>(i)
                    .map(|v| v.map_or(V::Null, |v| V::I(v.into())))
            } else {
                r.try_get::<_, Option<String>>(i)
                    .map(|v| v.map_or(V::Null, V::T))
            };
            v.map_err(pg(url, "reading a row"))
        })
        .collect()
}

fn migrate(c: &mut Conn, url: &MetaUrl) -> Result<(), FleetError> {
    let known = MIGRATIONS.len() as i64;
    let too_new = |found: i64| FleetError::SchemaTooNew {
        at: url.describe(),
        found,
        known,
    };
    match c {
        Conn::Sqlite(c) => {
            let tx = c
                .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
                .map_err(sq(url, "beginning the migration"))?;
            tx.execute_batch(
                "CREATE TABLE IF NOT EXISTS fleet_schema_version (version INTEGER NOT NULL)",
            )
            .map_err(sq(url, "migrating"))?;
            let ran: Option<i64> = tx
                .query_row("SELECT max(version) FROM fleet_schema_version", [], |r| {
                    r.get(0)
                })
                .map_err(sq(url, "migrating"))?;
            let ran = ran.unwrap_or(0);
            if ran > known {
                return Err(too_new(ran));
            }
            for (i, m) in MIGRATIONS.iter().enumerate().skip(ran as usize) {
                tx.execute_batch(m).map_err(sq(url, "migrating"))?;
                tx.execute(
                    "INSERT INTO fleet_schema_version (version) VALUES (?1)",
                    [i as i64 + 1],
                )
                .map_err(sq(url, "migrating"))?;
            }
            tx.commit().map_err(sq(url, "migrating"))
        }
        Conn::Pg(c) => {
            let mut tx = c
                .transaction()
                .map_err(pg(url, "beginning the migration"))?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&PG_LOCK])
                .map_err(pg(url, "locking"))?;
            tx.batch_execute(
                "CREATE TABLE IF NOT EXISTS fleet_schema_version (version BIGINT NOT NULL)",
            )
            .map_err(pg(url, "migrating"))?;
            let ran: Option<i64> = tx
                .query_one("SELECT max(version) FROM fleet_schema_version", &[])
                .and_then(|r| r.try_get(0))
                .map_err(pg(url, "migrating"))?;
            let ran = ran.unwrap_or(0);
            if ran > known {
                return Err(too_new(ran));
            }
            for (i, m) in MIGRATIONS.iter().enumerate().skip(ran as usize) {
                tx.batch_execute(m).map_err(pg(url, "migrating"))?;
                tx.execute(
                    "INSERT INTO fleet_schema_version (version) VALUES ($1)",
                    &[&(i as i64 + 1)],
                )
                .map_err(pg(url, "migrating"))?;
            }
            tx.commit().map_err(pg(url, "migrating"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redact_hides_the_password() {
        assert_eq!(
            redact("postgres://tine:s3cret@127.0.0.1:5433/tine"),
            "postgres://tine@127.0.0.1:5433/tine"
        );
        assert_eq!(redact("postgres://h/db"), "postgres://h/db");
    }

    #[test]
    fn meta_url_parses() {
        let f = PathBuf::from("/x/tree.db");
        assert_eq!(
            MetaUrl::parse(None, f.clone()).ok(),
            Some(MetaUrl::Sqlite(f.clone()))
        );
        assert!(matches!(
            MetaUrl::parse(Some("postgresql://a@b/c"), f.clone()),
            Ok(MetaUrl::Postgres(_))
        ));
        let e = MetaUrl::parse(Some("mysql://u:pw@h/d"), f)
            .err()
            .map(|e| e.to_string());
        let e = e.unwrap_or_default();
        assert!(e.contains("TINE_META") && !e.contains("pw"), "{e}");
    }
}
