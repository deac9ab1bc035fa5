//! `MySqlBackend`: the `Backend` trait on MySQL and MariaDB (InnoDB).

use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use idem_core::backend::{
    Capabilities, Claim, ClaimOutcome, ListFilter, Listing, Settlement, list_limited,
};
use idem_core::{Backend, Error, Key, Lease, Record, Result, Timestamp};
use sqlx::mysql::{MySqlConnectOptions, MySqlPool, MySqlPoolOptions, MySqlSslMode};
use sqlx::{AssertSqlSafe, Executor};

use crate::config::MySqlConfig;
use crate::error::{code, first_contact, map, number, within};
use crate::row::{decode, row_key};
use crate::sql::Tables;

/// What every connection of idem's pool runs first: read committed, so that a claim's
/// `SELECT … FOR UPDATE` of keys that do not exist yet takes no gap locks (two claims of
/// new keys would otherwise deadlock on each other's gaps). sqlx also sets `time_zone` to
/// `+00:00` at connect (its default), which the clock needs: `NOW(6)` is read back as
/// milliseconds with `UNIX_TIMESTAMP`, exact only in a zone without daylight saving.
pub const SESSION: &str = "SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// Records in an InnoDB table; the server's clock (`NOW(6)`) decides lease lapse.
#[derive(Clone, Debug)]
pub struct MySqlBackend {
    pub(crate) pool: MySqlPool,
    pub(crate) tables: Arc<Tables>,
    schema: Option<String>,
    pub(crate) max_response_bytes: usize,
    purge_batch: u32,
    pub(crate) timeout: Duration,
    /// Whether the last claim (or batch of claims) was mostly of keys with no row: the
    /// next one tries the fresh insert first.
    pub(crate) fresh_batches: Arc<AtomicBool>,
    /// Whether the server has `INSERT … RETURNING`: 0 not asked yet, 1 no, 2 yes.
    returning: Arc<AtomicU8>,
}

impl MySqlBackend {
    /// Connects a pool, its first connection made now. Does not create tables: call
    /// [`MySqlBackend::migrate`] once.
    ///
    /// A server that refuses idem (a wrong user or password, a certificate not trusted, TLS
    /// on one side only) is [`Error::Refused`], naming the server (`host:port`) and which
    /// refusal it is; a server that cannot be reached is [`Error::Unavailable`].
    pub async fn connect(config: MySqlConfig) -> Result<Self> {
        let connect_timeout = config.connect_timeout();
        if config.max_connections() == 0 {
            // sqlx's pool would panic on it.
            return Err(Error::config("max_connections must be at least 1"));
        }
        config.quoted_schema()?;
        let what = format!("connect to {}", config.redacted_url());
        let url = config.url().replacen("mariadb://", "mysql://", 1);
        let options = MySqlConnectOptions::from_str(&url)
            .map_err(|e| map(&what, e))?
            .timezone(Some("+00:00".to_owned()));
        let pool = MySqlPoolOptions::new()
            .max_connections(config.max_connections())
            .acquire_timeout(connect_timeout)
            // No ping before every checkout: it doubles the round trips, and a dead
            // connection surfaces as `Unavailable` on its next statement anyway.
            .test_before_acquire(false)
            .after_connect(|conn, _| {
                Box::pin(async move { conn.execute(SESSION).await.map(drop) })
            });
        // The first connection is made here, at start, and bounded: a server that accepts
        // and never answers is `Unavailable` after `connect_timeout`, not a hang; a wrong
        // password, an untrusted certificate or a TLS mismatch is `Refused`, now.
        let server = format!("{}:{}", options.get_host(), options.get_port());
        let plaintext = matches!(options.get_ssl_mode(), MySqlSslMode::Disabled);
        let first = async {
            pool.connect_with(options)
                .await
                .map_err(|e| first_contact(&what, &server, plaintext, e))
        };
        let pool = idem_core::layer::within(&what, connect_timeout, first).await?;
        Self::from_pool(pool, config)
    }

    /// Uses an existing pool; `config` gives the schema and limits (its URL is not used).
    /// Give its connections [`SESSION`]'s settings (`after_connect`): without read
    /// committed, concurrent claims of new keys deadlock more often (each is retried, so
    /// answers stay right but slower), and without a `+00:00` time zone the clock may jump
    /// by an hour at a daylight-saving change.
    pub fn from_pool(pool: MySqlPool, config: MySqlConfig) -> Result<Self> {
        let schema = config.quoted_schema()?;
        Ok(MySqlBackend {
            pool,
            tables: Arc::new(Tables::new(schema)),
            schema: config.schema().map(str::to_owned),
            max_response_bytes: config.max_response_bytes(),
            purge_batch: config.purge_batch().max(1),
            timeout: config.query_timeout(),
            fresh_batches: Arc::new(AtomicBool::new(true)),
            returning: Arc::new(AtomicU8::new(0)),
        })
    }

    /// The schema holding idem's tables, if one was configured (unquoted).
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// The pool, for the caller's own queries.
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// Creates the schema (if one is configured) and the tables `idem_records` and
    /// `idem_offsets`, where missing (idempotent), and drops the expiry index that earlier
    /// versions put on `idem_records`.
    pub async fn migrate(&self) -> Result<()> {
        for stmt in self.tables.migrations() {
            let query = sqlx::query(AssertSqlSafe(stmt)).execute(&self.pool);
            self.timed("migrate", query).await?;
        }
        // A table created by an earlier version has an index on the expiry, which every
        // write paid for; it goes.
        let has = sqlx::query_scalar::<_, i64>(self.tables.has_expiry_index())
            .bind(self.schema.as_deref())
            .fetch_one(&self.pool);
        if self.timed("migrate", has).await? > 0 {
            let drop = sqlx::query(AssertSqlSafe(self.tables.drop_expiry_index()));
            match self.timed_raw("migrate", drop.execute(&self.pool)).await? {
                Err(e) if number(&e) != Some(code::NO_SUCH_INDEX) => return Err(map("migrate", e)),
                _ => {}
            }
        }
        Ok(())
    }

    /// Whether the server has `INSERT … RETURNING` (MariaDB 10.5 and later; MySQL has
    /// not), asked once (`SELECT VERSION()`).
    pub(crate) async fn returning(&self) -> Result<bool> {
        match self.returning.load(Ordering::Relaxed) {
            1 => return Ok(false),
            2 => return Ok(true),
            _ => {}
        }
        let query = sqlx::query_scalar::<_, String>("SELECT VERSION()").fetch_one(&self.pool);
        let version = self.timed("read the server's version", query).await?;
        let has = has_returning(&version);
        self.returning
            .store(if has { 2 } else { 1 }, Ordering::Relaxed);
        Ok(has)
    }

    /// Runs `fut` within the query timeout, its driver error left to the caller; a
    /// timeout is `Unavailable`.
    pub(crate) async fn timed_raw<T>(
        &self,
        what: &str,
        fut: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<Result<T, sqlx::Error>> {
        idem_core::layer::within(what, self.timeout, Box::pin(async { Ok(fut.await) })).await
    }

    /// Runs `fut` within the query timeout; a timeout is `Unavailable`.
    pub(crate) async fn timed<T>(
        &self,
        what: &str,
        fut: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T> {
        within(what, self.timeout, Box::pin(fut)).await
    }
}

/// Whether a server of `version` (`SELECT VERSION()`) has `INSERT … RETURNING`: MariaDB
/// from 10.5.
fn has_returning(version: &str) -> bool {
    // `10.11.19-MariaDB-…`, or behind the `5.5.5-` that old handshakes put first.
    let Some((number, _)) = version.split_once("-MariaDB") else {
        return false;
    };
    let number = number.rsplit('-').next().unwrap_or(number);
    let mut parts = number.split('.').map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= (10, 5),
        _ => false,
    }
}

#[async_trait]
impl Backend for MySqlBackend {
    /// Keys with no row: one `INSERT IGNORE`; the rest one transaction per batch (one
    /// locking read of the batch's records, one write of the records granted, COMMIT; see
    /// `claim.rs`).
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        self.claim_batch(claims).await
    }

    /// Fenced updates; what they cannot answer, one transaction per batch, as for claims
    /// (see `settle.rs`).
    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        self.settle_batch(items, retention).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        self.extend_lease(lease, ttl).await
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let sql = self.tables.get();
        let query = sqlx::query(AssertSqlSafe(sql))
            .bind(key.namespace().as_bytes())
            .bind(key.id().as_bytes());
        let row = self.timed("get", query.fetch_optional(&self.pool)).await?;
        row.as_ref().map(decode).transpose()
    }

    async fn delete(&self, key: &Key) -> Result<bool> {
        let live = sqlx::query(AssertSqlSafe(self.tables.delete_live()))
            .bind(key.namespace().as_bytes())
            .bind(key.id().as_bytes());
        let done = self.timed("delete", live.execute(&self.pool)).await?;
        if done.rows_affected() > 0 {
            return Ok(true);
        }
        // An expired record counts as absent; it goes too.
        let any = sqlx::query(AssertSqlSafe(self.tables.delete_any()))
            .bind(key.namespace().as_bytes())
            .bind(key.id().as_bytes());
        self.timed("delete", any.execute(&self.pool)).await?;
        Ok(false)
    }

    /// A walk of the primary key in chunks of `purge_batch` rows: per chunk, one read of
    /// the key that ends it and one delete of its expired records, so that no statement
    /// scans (or locks) more than a chunk, with no index on the expiry.
    async fn purge_expired(&self) -> Result<u64> {
        let mut purged = 0;
        let mut after: Option<(Vec<u8>, Vec<u8>)> = None;
        loop {
            let sql = self.tables.purge_bound(after.is_none());
            let mut query = sqlx::query_as::<_, (Vec<u8>, Vec<u8>)>(AssertSqlSafe(sql));
            if let Some((ns, id)) = &after {
                query = query.bind(ns).bind(ns).bind(id);
            }
            let offset = i64::from(self.purge_batch.max(1) - 1);
            let bound = query.bind(offset).fetch_optional(&self.pool);
            let bound = self.timed("purge", bound).await?;
            let sql = self.tables.purge_chunk(after.is_none(), bound.is_none());
            let mut query = sqlx::query(AssertSqlSafe(sql));
            for (ns, id) in after.iter().chain(&bound) {
                query = query.bind(ns).bind(ns).bind(id);
            }
            let done = self.timed("purge", query.execute(&self.pool)).await?;
            purged += done.rows_affected();
            match bound {
                Some(bound) => after = Some(bound),
                None => return Ok(purged),
            }
        }
    }

    /// In primary key order, so that a row that does not decode (skipped and counted,
    /// named by its namespace and id) is read again, not lost, when the query runs again
    /// for the records the limit still wants ([`list_limited`]).
    async fn list(&self, filter: &ListFilter) -> Result<Listing> {
        let fetch = |n: usize| {
            let sql = self
                .tables
                .list(filter.namespace.is_some(), filter.state.is_some(), n > 0);
            let mut query = sqlx::query(AssertSqlSafe(sql));
            if let Some(ns) = &filter.namespace {
                query = query.bind(ns.as_bytes());
            }
            if let Some(state) = filter.state {
                query = query.bind(state.as_str());
            }
            if n > 0 {
                query = query.bind(i64::try_from(n).unwrap_or(i64::MAX));
            }
            self.timed("list", query.fetch_all(&self.pool))
        };
        list_limited(filter.limit, fetch, |row, listing| {
            listing.add(|| row_key(row), decode(row))
        })
        .await
    }

    /// No `notify`: MySQL has no LISTEN/NOTIFY, so a waiting engine polls (the default
    /// [`Backend::watch`] only times out).
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
            .with_list(true)
            .with_notify(false)
            .with_max_response_bytes(self.max_response_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::has_returning;

    #[test]
    fn returning_is_mariadb_from_10_5() {
        assert!(has_returning("10.11.19-MariaDB-0+deb12u1"));
        assert!(has_returning("11.4.2-MariaDB"));
        assert!(has_returning("5.5.5-10.5.0-MariaDB"));
        assert!(!has_returning("10.4.30-MariaDB"));
        assert!(!has_returning("8.0.36"));
    }
}
