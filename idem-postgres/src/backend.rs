//! `PgBackend`: the `Backend` trait on PostgreSQL.

use std::future::Future;
use std::str::FromStr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::backend::watch::Feed;
use idem_core::backend::{
    Capabilities, Claim, ClaimOutcome, ListFilter, Listing, Settle, Settlement, check_response,
    list_limited, watch::Watch,
};
use idem_core::{
    Backend, Error, FailureKind, Fingerprint, Key, Lease, Record, Result, State, Timestamp,
};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Row};

use crate::config::PgConfig;
use crate::error::{first_contact, map, within};
use crate::sql::Statements;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// The planner settings on idem's connections.
///
/// - `enable_seqscan=off`: every statement of ours finds rows by an index. A prepared
///   statement's cached generic plan is made while the table is small, when a sequential
///   scan looks cheaper, and is kept until the table is next analyzed: with autovacuum
///   slow or off, every claim would then scan the whole table.
/// - `plan_cache_mode=force_generic_plan`: the claim binds arrays, whose length the
///   generic plan cannot know, so by its own cost estimate PostgreSQL would plan every
///   claim afresh (measured: 0.4 ms of planning for 0.1 ms of execution).
///
/// Transactional mode restores the server's own values for the handler's statements.
pub const PLANNING: [(&str, &str); 2] = [
    ("enable_seqscan", "off"),
    ("plan_cache_mode", "force_generic_plan"),
];

/// The statement that opens a transactional-mode transaction: `BEGIN`, then the server's
/// own values of the [`PLANNING`] settings, read once on a connection without them. Only
/// values from a fixed list go into the text; another value is left as idem's.
async fn restoring_begin(options: &PgConnectOptions, what: &str) -> Result<Arc<str>> {
    use sqlx::Connection;
    const KNOWN: [&str; 5] = [
        "on",
        "off",
        "auto",
        "force_generic_plan",
        "force_custom_plan",
    ];
    let mut conn = sqlx::PgConnection::connect_with(options)
        .await
        .map_err(|e| first_contact(what, &server(options), e))?;
    let mut text = String::from("BEGIN");
    for (name, _) in PLANNING {
        let value: String = sqlx::query_scalar("SELECT current_setting($1)")
            .bind(name)
            .fetch_one(&mut conn)
            .await
            .map_err(|e| map(what, e))?;
        match KNOWN.iter().find(|k| **k == value) {
            Some(known) => text.push_str(&format!("; SET LOCAL {name} = {known}")),
            None => tracing::warn!(setting = name, %value, "unknown server value: not restored"),
        }
    }
    let _ = conn.close().await;
    Ok(Arc::from(text))
}

/// The server `options` reach, as `host:port`, for error messages.
fn server(options: &PgConnectOptions) -> String {
    format!("{}:{}", options.get_host(), options.get_port())
}

/// Records in a PostgreSQL table; the database clock (`now()`) decides lease lapse.
#[derive(Clone, Debug)]
pub struct PgBackend {
    pub(crate) pool: PgPool,
    pub(crate) sql: Arc<Statements>,
    /// Opens a transactional-mode transaction: `BEGIN`, then the server's own values of
    /// the [`PLANNING`] settings for the handler's statements.
    pub(crate) begin: Arc<str>,
    schema: String,
    pub(crate) max_response_bytes: usize,
    purge_batch: i64,
    pub(crate) timeout: Duration,
    /// The `LISTEN` feed of [`Backend::watch`], started by the first watch and shared by
    /// clones (see `notify.rs`).
    feed: Arc<OnceLock<Feed>>,
    /// Whether most keys of the last batch claim were new: the next batch then tries the
    /// plain insert first (`claim_fresh_many.sql`), else goes straight to `claim.sql`, so a
    /// run of redelivered batches costs one round trip a batch, not two. Shared by clones.
    pub(crate) fresh_batches: Arc<AtomicBool>,
}

impl PgBackend {
    /// Connects a pool, its first connection made now. Does not create tables: call
    /// [`PgBackend::migrate`] once.
    ///
    /// A server that refuses idem (a wrong user or password, a certificate not trusted, TLS
    /// on one side only) is [`Error::Refused`], naming the server (`host:port`) and which
    /// refusal it is; a server that cannot be reached is [`Error::Unavailable`].
    pub async fn connect(config: PgConfig) -> Result<Self> {
        let connect_timeout = config.connect_timeout();
        if config.max_connections() == 0 {
            // sqlx's pool would panic on it.
            return Err(Error::config("max_connections must be at least 1"));
        }
        let what = format!("connect to {}", config.redacted_url());
        let options = PgConnectOptions::from_str(config.url())
            .map_err(|e| map(&what, e))?
            .application_name(config.application_name());
        // The first connection is made here, at start, and bounded: a server that accepts
        // and never answers is `Unavailable` after `connect_timeout`, not a hang; a wrong
        // password, an untrusted certificate or a TLS mismatch is `Refused`, now.
        let begin = tokio::time::timeout(connect_timeout, restoring_begin(&options, &what))
            .await
            .map_err(|_| Error::Unavailable {
                message: format!("{what}: no answer within {connect_timeout:?}"),
                source: None,
            })??;
        let pool = PgPoolOptions::new()
            .max_connections(config.max_connections())
            .acquire_timeout(connect_timeout)
            // No ping before every checkout: it doubles the round trips, and a dead
            // connection surfaces as `Unavailable` on its next statement anyway.
            .test_before_acquire(false)
            .connect_with(options.clone().options(PLANNING))
            .await
            .map_err(|e| first_contact(&what, &server(&options), e))?;
        let mut backend = Self::from_pool(pool, config)?;
        backend.begin = begin;
        Ok(backend)
    }

    /// Uses an existing pool; `config` gives the schema and limits (its URL is not used).
    ///
    /// [`PgBackend::connect`] sets `enable_seqscan=off` and
    /// `plan_cache_mode=force_generic_plan` on its connections (see [`PLANNING`] for why);
    /// give this pool's connections the same options (`PgConnectOptions::options`), or
    /// claims slow down. A transactional handler on this pool runs with the pool's own
    /// settings: `from_pool` cannot know the server's.
    pub fn from_pool(pool: PgPool, config: PgConfig) -> Result<Self> {
        let schema = config.quoted_schema()?;
        Ok(PgBackend {
            pool,
            sql: Arc::new(Statements::new(&schema)),
            begin: Arc::from("BEGIN"),
            schema,
            max_response_bytes: config.max_response_bytes(),
            purge_batch: config.purge_batch().max(1),
            timeout: config.query_timeout(),
            feed: Arc::default(),
            fresh_batches: Arc::new(AtomicBool::new(true)),
        })
    }

    /// The schema holding idem's tables, as configured (unquoted).
    pub fn schema(&self) -> &str {
        self.schema.trim_matches('"')
    }

    /// The pool, for the caller's own queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Creates the schema and runs the migrations in `migrations/` (idempotent). Safe to
    /// call from several processes at once, as replicas starting together do: a session
    /// advisory lock on the schema's name makes them migrate one after another (`CREATE
    /// SCHEMA IF NOT EXISTS` alone races: two sessions can both find it absent, and one
    /// fails on the catalog's unique index).
    pub async fn migrate(&self) -> Result<()> {
        let mut conn = self.pool.acquire().await.map_err(|e| map("migrate", e))?;
        let lock = format!(
            "SELECT pg_advisory_lock(hashtext('idem.migrate.{}'))",
            self.schema
        );
        sqlx::query(AssertSqlSafe(lock))
            .execute(&mut *conn)
            .await
            .map_err(|e| map("migrate", e))?;
        let migrated = self.migrate_locked(&mut conn).await;
        let unlock = format!(
            "SELECT pg_advisory_unlock(hashtext('idem.migrate.{}'))",
            self.schema
        );
        let unlocked = sqlx::query(AssertSqlSafe(unlock)).execute(&mut *conn).await;
        migrated?;
        unlocked.map_err(|e| map("migrate", e))?;
        Ok(())
    }

    async fn migrate_locked(&self, conn: &mut sqlx::PgConnection) -> Result<()> {
        let create = format!("CREATE SCHEMA IF NOT EXISTS {}", self.schema);
        let path = format!("SET search_path TO {}", self.schema);
        for stmt in [create, path] {
            sqlx::query(AssertSqlSafe(stmt))
                .execute(&mut *conn)
                .await
                .map_err(|e| map("migrate", e))?;
        }
        // run_direct, not run: run's future is not provably Send (sqlx says so at run_direct).
        let ran = MIGRATOR
            .run_direct(None, &mut *conn, false)
            .await
            .map_err(|e| Error::Config {
                message: "migrations failed".into(),
                source: Some(Box::new(e)),
            });
        let reset = sqlx::query("RESET search_path").execute(&mut *conn).await;
        ran?;
        reset.map_err(|e| map("migrate", e))?;
        Ok(())
    }

    /// Runs `fut` within the query timeout; a timeout is `Unavailable`.
    pub(crate) async fn timed<T>(
        &self,
        what: &str,
        fut: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T> {
        // Boxed once here: sqlx's futures are large, and each layer of the timeout would
        // otherwise move (copy) the whole of it.
        within(what, self.timeout, Box::pin(fut)).await
    }
}

/// [`idem_core::backend::millis`] as the `BIGINT` the statements bind (its cap fits).
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(idem_core::backend::millis(d)).unwrap_or(i64::MAX)
}

/// Decodes a row of the record columns; anything that is not an idem record is `Corrupt`.
pub(crate) fn decode(row: &PgRow) -> Result<Record> {
    let get = |e: sqlx::Error| map("decode record", e);
    // Text is borrowed from the row where it is copied anyway (the key, the owner): one
    // allocation each, not a String and then its copy.
    let namespace: &str = row.try_get("namespace").map_err(get)?;
    let id: &str = row.try_get("id").map_err(get)?;
    let key = Key::new(namespace, id).map_err(|e| Error::Corrupt {
        message: "stored key is not a valid key".into(),
        source: Some(Box::new(e)),
    })?;
    let state: &str = row.try_get("state").map_err(get)?;
    let state =
        State::parse(state).ok_or_else(|| Error::corrupt(format!("state {state:?} of {key}")))?;
    let token: i64 = row.try_get("token").map_err(get)?;
    let attempts: i32 = row.try_get("attempts").map_err(get)?;
    let fingerprint: Option<&[u8]> = row.try_get("fingerprint").map_err(get)?;
    let fingerprint = match fingerprint {
        None => None,
        Some(bytes) => Some(Fingerprint(bytes.try_into().map_err(|_| {
            Error::corrupt(format!(
                "fingerprint of {key} is {} bytes, not 32",
                bytes.len()
            ))
        })?)),
    };
    let time = |name: &str| -> Result<Option<Timestamp>> {
        let ms: Option<i64> = row.try_get(name).map_err(get)?;
        Ok(ms.map(|ms| Timestamp::from_millis(u64::try_from(ms).unwrap_or(0))))
    };
    let response: Option<&[u8]> = row.try_get("response").map_err(get)?;
    Ok(Record {
        state,
        owner: Arc::from(row.try_get::<&str, _>("owner").map_err(get)?),
        token: u64::try_from(token)
            .map_err(|_| Error::corrupt(format!("negative token of {key}")))?,
        attempts: u32::try_from(attempts)
            .map_err(|_| Error::corrupt(format!("negative attempts of {key}")))?,
        lease_until: time("lease_until_ms")?,
        fingerprint,
        response: response.map(Bytes::copy_from_slice),
        error: row.try_get("error").map_err(get)?,
        permanent: row.try_get("permanent").map_err(get)?,
        expires_at: time("expires_at_ms")?,
        key,
    })
}

/// A row's namespace and id, `namespace/id`, to name a row that does not decode.
fn row_key(row: &PgRow) -> String {
    let part = |name| row.try_get::<&str, _>(name).unwrap_or("?");
    format!("{}/{}", part("namespace"), part("id"))
}

#[async_trait]
impl Backend for PgBackend {
    /// One statement per batch; answers are those of claims made one after another. A key
    /// repeated in the batch is answered from the record the statement left, unless the
    /// repeat could claim it, which takes one more statement.
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        self.claim_with(&self.sql.claim, claims).await
    }

    /// One statement (`complete.sql`); the single settles below are simpler statements
    /// than a batch of one, so they stay.
    async fn complete(&self, lease: &Lease, response: Bytes, retention: Duration) -> Result<()> {
        check_response(&Settle::Complete(response.clone()), self.max_response_bytes)?;
        let query = fenced(sqlx::query(self.sql.complete.sql()), lease)
            .bind(response.as_ref())
            .bind(millis(retention));
        let done = self.timed("complete", query.execute(&self.pool)).await?;
        check_fence(done.rows_affected(), lease)
    }

    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        let query = fenced(sqlx::query(self.sql.fail.sql()), lease)
            .bind(error)
            .bind(kind == FailureKind::Permanent)
            .bind(millis(retention));
        let done = self.timed("fail", query.execute(&self.pool)).await?;
        check_fence(done.rows_affected(), lease)
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let query = fenced(sqlx::query(self.sql.release.sql()), lease);
        let done = self.timed("release", query.execute(&self.pool)).await?;
        check_fence(done.rows_affected(), lease)
    }

    /// One statement per round of distinct keys (a key repeated in the batch waits for the
    /// next round, so it is answered from the state the earlier item left).
    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        self.settle_rounds(items, retention).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        let query = fenced(sqlx::query(self.sql.extend.sql()), lease).bind(millis(ttl));
        let row = self
            .timed("extend", query.fetch_optional(&self.pool))
            .await?;
        let row = row.ok_or_else(|| Error::fenced(lease))?;
        let ms: i64 = row
            .try_get("lease_until_ms")
            .map_err(|e| map("extend", e))?;
        Ok(Timestamp::from_millis(u64::try_from(ms).unwrap_or(0)))
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let query = sqlx::query(self.sql.get.sql())
            .bind(key.namespace())
            .bind(key.id());
        let row = self.timed("get", query.fetch_optional(&self.pool)).await?;
        row.as_ref().map(decode).transpose()
    }

    async fn delete(&self, key: &Key) -> Result<bool> {
        let query = sqlx::query(self.sql.delete.sql())
            .bind(key.namespace())
            .bind(key.id());
        let row = self
            .timed("delete", query.fetch_optional(&self.pool))
            .await?;
        match row {
            Some(row) => row.try_get("live").map_err(|e| map("delete", e)),
            None => Ok(false),
        }
    }

    async fn purge_expired(&self) -> Result<u64> {
        let waiters = sqlx::query(self.sql.purge_waiters.sql()).execute(&self.pool);
        self.timed("purge waiters", waiters).await?;
        let mut purged = 0;
        loop {
            let query = sqlx::query(self.sql.purge.sql()).bind(self.purge_batch);
            let done = self.timed("purge", query.execute(&self.pool)).await?;
            purged += done.rows_affected();
            if done.rows_affected() < u64::try_from(self.purge_batch).unwrap_or(u64::MAX) {
                return Ok(purged);
            }
        }
    }

    /// In primary key order, so that a row that does not decode (skipped and counted,
    /// named by its namespace and id) is read again, not lost, when the query runs again
    /// for the records the limit still wants ([`list_limited`]).
    async fn list(&self, filter: &ListFilter) -> Result<Listing> {
        let fetch = |n: usize| {
            let limit = (n > 0).then(|| i64::try_from(n).unwrap_or(i64::MAX));
            let query = sqlx::query(self.sql.list.sql())
                .bind(filter.namespace.as_deref())
                .bind(filter.state.map(State::as_str))
                .bind(limit);
            self.timed("list", query.fetch_all(&self.pool))
        };
        list_limited(filter.limit, fetch, |row: &PgRow, listing| {
            listing.add(|| row_key(row), decode(row))
        })
        .await
    }

    async fn watch(&self, key: &Key) -> Watch {
        let feed = self.feed.get_or_init(|| self.feed());
        // Listen first, then say so: a settle after the row commits is notified.
        let watch = feed.watch(self.topic(key), self.timeout).await;
        self.register_waiter(key).await;
        watch
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_list(true)
            .with_notify(true)
            .with_max_response_bytes(self.max_response_bytes)
    }
}

/// `sql` with room for `params` parameters of about `bytes` bytes in all made at once: a
/// batch's arrays would otherwise grow the buffer in steps, copying it at each.
pub(crate) fn sized<'q>(sql: AssertSqlSafe<Arc<str>>, params: usize, bytes: usize) -> PgQuery<'q> {
    let mut args = sqlx::postgres::PgArguments::default();
    sqlx::Arguments::reserve(&mut args, params, bytes);
    sqlx::query_with(sql, args)
}

pub(crate) type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// Binds the four parameters every fenced statement starts with: key, token, owner.
pub(crate) fn fenced<'q>(query: PgQuery<'q>, lease: &'q Lease) -> PgQuery<'q> {
    query
        .bind(lease.key.namespace())
        .bind(lease.key.id())
        .bind(token(lease))
        .bind(&*lease.owner)
}

/// A lease's token as the `BIGINT` column holds it (one past `i64::MAX`, which no record
/// reaches, is sent as `i64::MAX`).
pub(crate) fn token(lease: &Lease) -> i64 {
    i64::try_from(lease.token).unwrap_or(i64::MAX)
}

pub(crate) fn check_fence(rows: u64, lease: &Lease) -> Result<()> {
    if rows == 1 {
        Ok(())
    } else {
        Err(Error::fenced(lease))
    }
}
