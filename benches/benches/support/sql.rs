//! The hand-written SQL loops' statements, one [`Sql`] per store (PostgreSQL, MySQL or
//! MariaDB), so that the Kafka bench's dedup loop, its batch-transaction loop and idem's
//! transactional handler run the same frame and the same business insert on both.
//!
//! The tables, in the bench's schema (on MySQL a database): `dedup` (a key and its
//! result), `ledger` (one business row per message) and `hand_offsets` (a group's next
//! offset per partition), beside idem's own.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use idem_mysql::{MySqlBackend, MySqlConfig};
use sqlx::{AssertSqlSafe, Database};

use super::SCHEMA;

/// A connection of `S`'s database: a pool's, or an open transaction's.
pub type Conn<S> = <<S as Sql>::Db as Database>::Connection;

/// What the hand-written loops run on a SQL store.
#[async_trait]
pub trait Sql: Clone + Send + Sync + 'static {
    type Db: Database;

    fn pool(&self) -> &sqlx::Pool<Self::Db>;

    /// Inserts those of `keys` absent from `dedup`, in one statement; returns those it
    /// inserted.
    async fn mark(&self, conn: &mut Conn<Self>, keys: &[String]) -> HashSet<String>;

    /// Stores the results of `keys` (rows of `dedup` already), in one statement.
    async fn answer(&self, conn: &mut Conn<Self>, keys: &[String], results: &[Vec<u8>]);

    /// One business row: what both the hand-written transaction loop and idem's
    /// transactional handler write per message.
    async fn ledger(conn: &mut Conn<Self>, key: &str) -> Result<(), sqlx::Error>;

    /// Stores `group`'s next offset of `topic`'s partition `part`.
    async fn offset(&self, conn: &mut Conn<Self>, group: &str, topic: &str, part: i32, next: i64);
}

/// [`Sql::mark`] on a connection of the pool: per key, whether it was new.
pub async fn mark<S: Sql>(store: &S, keys: &[String]) -> Vec<bool> {
    let mut conn = store.pool().acquire().await.expect("connection");
    let new = store.mark(&mut conn, keys).await;
    keys.iter().map(|k| new.contains(k)).collect()
}

/// [`Sql::answer`] on a connection of the pool.
pub async fn answer<S: Sql>(store: &S, keys: &[String], results: &[Vec<u8>]) {
    if keys.is_empty() {
        return;
    }
    let mut conn = store.pool().acquire().await.expect("connection");
    store.answer(&mut conn, keys, results).await;
}

/// PostgreSQL: `INSERT … ON CONFLICT DO NOTHING RETURNING` of the keys, one `UPDATE … FROM
/// unnest` of the results.
#[derive(Clone)]
pub struct Postgres(pub sqlx::PgPool);

#[async_trait]
impl Sql for Postgres {
    type Db = sqlx::Postgres;

    fn pool(&self) -> &sqlx::PgPool {
        &self.0
    }

    async fn mark(&self, conn: &mut sqlx::PgConnection, keys: &[String]) -> HashSet<String> {
        let q = format!(
            "INSERT INTO {SCHEMA}.dedup (k) SELECT unnest($1::text[]) \
             ON CONFLICT DO NOTHING RETURNING k"
        );
        sqlx::query_scalar(AssertSqlSafe(q))
            .bind(keys)
            .fetch_all(conn)
            .await
            .expect("mark")
            .into_iter()
            .collect()
    }

    async fn answer(&self, conn: &mut sqlx::PgConnection, keys: &[String], results: &[Vec<u8>]) {
        let q = format!(
            "UPDATE {SCHEMA}.dedup d SET v = u.v \
             FROM unnest($1::text[], $2::bytea[]) AS u(k, v) WHERE d.k = u.k"
        );
        sqlx::query(AssertSqlSafe(q))
            .bind(keys)
            .bind(results)
            .execute(conn)
            .await
            .expect("answer");
    }

    async fn ledger(conn: &mut sqlx::PgConnection, key: &str) -> Result<(), sqlx::Error> {
        let q = format!("INSERT INTO {SCHEMA}.ledger (k) VALUES ($1)");
        sqlx::query(AssertSqlSafe(q))
            .bind(key)
            .execute(conn)
            .await
            .map(drop)
    }

    async fn offset(
        &self,
        conn: &mut sqlx::PgConnection,
        group: &str,
        topic: &str,
        part: i32,
        next: i64,
    ) {
        let q = format!(
            "INSERT INTO {SCHEMA}.hand_offsets (grp, topic, part, next) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (grp, topic, part) DO UPDATE SET next = excluded.next"
        );
        sqlx::query(AssertSqlSafe(q))
            .bind(group)
            .bind(topic)
            .bind(part)
            .bind(next)
            .execute(conn)
            .await
            .expect("upsert offset");
    }
}

/// MySQL or MariaDB (InnoDB): one multi-row `INSERT IGNORE` of the keys, answered with
/// `RETURNING` where the server has it (MariaDB 10.5+); one multi-row `INSERT … ON
/// DUPLICATE KEY UPDATE` of the results.
#[derive(Clone)]
pub struct MySql {
    pool: sqlx::MySqlPool,
    /// Whether `INSERT … RETURNING` works (MariaDB). Without it (MySQL) the keys go in
    /// with a per-batch marker, and when fewer rows went in than keys, a `SELECT` of the
    /// marker's rows says which.
    returning: bool,
}

/// `(?), (?), …` or `(?, ?), (?, ?), …`: `rows` groups of `columns` placeholders.
fn placeholders(rows: usize, columns: usize) -> String {
    let row = format!("({})", vec!["?"; columns].join(", "));
    vec![row; rows].join(", ")
}

#[async_trait]
impl Sql for MySql {
    type Db = sqlx::MySql;

    fn pool(&self) -> &sqlx::MySqlPool {
        &self.pool
    }

    async fn mark(&self, conn: &mut sqlx::MySqlConnection, keys: &[String]) -> HashSet<String> {
        if self.returning {
            let q = format!(
                "INSERT IGNORE INTO {SCHEMA}.dedup (k) VALUES {} RETURNING k",
                placeholders(keys.len(), 1)
            );
            let mut query = sqlx::query_scalar(AssertSqlSafe(q));
            for key in keys {
                query = query.bind(key);
            }
            return query
                .fetch_all(conn)
                .await
                .expect("mark")
                .into_iter()
                .collect();
        }
        static BATCH: AtomicU64 = AtomicU64::new(0);
        let batch = i64::try_from(BATCH.fetch_add(1, Ordering::Relaxed)).expect("batch");
        let q = format!(
            "INSERT IGNORE INTO {SCHEMA}.dedup (k, b) VALUES {}",
            placeholders(keys.len(), 2)
        );
        let mut query = sqlx::query(AssertSqlSafe(q));
        for key in keys {
            query = query.bind(key).bind(batch);
        }
        let inserted = query
            .execute(&mut *conn)
            .await
            .expect("mark")
            .rows_affected();
        if inserted == keys.len() as u64 {
            return keys.iter().cloned().collect();
        }
        let q = format!("SELECT k FROM {SCHEMA}.dedup WHERE b = ?");
        sqlx::query_scalar(AssertSqlSafe(q))
            .bind(batch)
            .fetch_all(conn)
            .await
            .expect("marked")
            .into_iter()
            .collect()
    }

    async fn answer(&self, conn: &mut sqlx::MySqlConnection, keys: &[String], results: &[Vec<u8>]) {
        let q = format!(
            "INSERT INTO {SCHEMA}.dedup (k, v) VALUES {} ON DUPLICATE KEY UPDATE v = VALUES(v)",
            placeholders(keys.len(), 2)
        );
        let mut query = sqlx::query(AssertSqlSafe(q));
        for (key, result) in keys.iter().zip(results) {
            query = query.bind(key).bind(result);
        }
        query.execute(conn).await.expect("answer");
    }

    async fn ledger(conn: &mut sqlx::MySqlConnection, key: &str) -> Result<(), sqlx::Error> {
        let q = format!("INSERT INTO {SCHEMA}.ledger (k) VALUES (?)");
        sqlx::query(AssertSqlSafe(q))
            .bind(key)
            .execute(conn)
            .await
            .map(drop)
    }

    async fn offset(
        &self,
        conn: &mut sqlx::MySqlConnection,
        group: &str,
        topic: &str,
        part: i32,
        next: i64,
    ) {
        let q = format!(
            "INSERT INTO {SCHEMA}.hand_offsets (grp, topic, part, next_offset) \
             VALUES (?, ?, ?, ?) ON DUPLICATE KEY UPDATE next_offset = VALUES(next_offset)"
        );
        sqlx::query(AssertSqlSafe(q))
            .bind(group)
            .bind(topic)
            .bind(part)
            .bind(next)
            .execute(conn)
            .await
            .expect("upsert offset");
    }
}

/// The tables [`MySql::reset`] empties.
const MYSQL_TABLES: [&str; 5] = [
    "idem_records",
    "idem_offsets",
    "dedup",
    "ledger",
    "hand_offsets",
];

impl MySql {
    /// idem's backend on `url` with its tables in the database `SCHEMA` (dropped and
    /// created afresh), the hand-written loops' tables beside them, and the hand-written
    /// loops' store on the backend's pool.
    pub async fn connect(url: &str) -> (MySqlBackend, MySql) {
        let config = MySqlConfig::new(url)
            .with_schema(SCHEMA)
            .with_max_connections(16);
        let backend = MySqlBackend::connect(config).await.expect("connect MySQL");
        let pool = backend.pool().clone();
        let run = |stmt: String| {
            let pool = pool.clone();
            async move { sqlx::query(AssertSqlSafe(stmt)).execute(&pool).await }
        };
        run(format!("DROP DATABASE IF EXISTS {SCHEMA}"))
            .await
            .expect("drop the bench's database");
        backend.migrate().await.expect("migrate");
        let text = "VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin";
        for stmt in [
            format!("CREATE TABLE {SCHEMA}.ledger (k {text} NOT NULL) ENGINE = InnoDB"),
            format!(
                "CREATE TABLE {SCHEMA}.hand_offsets (grp {text} NOT NULL, topic {text} NOT NULL, \
                 part INT NOT NULL, next_offset BIGINT NOT NULL, PRIMARY KEY (grp, topic, part)) \
                 ENGINE = InnoDB"
            ),
        ] {
            run(stmt).await.expect("create bench tables");
        }
        let returning = run(format!(
            "INSERT INTO {SCHEMA}.ledger (k) VALUES ('probe') RETURNING k"
        ))
        .await
        .is_ok();
        let dedup = if returning {
            format!("CREATE TABLE {SCHEMA}.dedup (k {text} PRIMARY KEY, v BLOB) ENGINE = InnoDB")
        } else {
            format!(
                "CREATE TABLE {SCHEMA}.dedup (k {text} PRIMARY KEY, v BLOB, b BIGINT, KEY (b)) \
                 ENGINE = InnoDB"
            )
        };
        run(dedup).await.expect("create bench tables");
        let store = MySql { pool, returning };
        store.reset().await;
        (backend, store)
    }

    /// Empties idem's tables and the hand-written loops'.
    pub async fn reset(&self) {
        for table in MYSQL_TABLES {
            let q = format!("TRUNCATE TABLE {SCHEMA}.{table}");
            sqlx::query(AssertSqlSafe(q))
                .execute(&self.pool)
                .await
                .expect("TRUNCATE");
        }
    }
}
