//! `PgBackend`: the `Backend` trait on PostgreSQL.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::backend::watch::Feed;
use idem_core::backend::{
    Capabilities, Claim, ClaimOutcome, ListFilter, Settle, Settlement, check_response, machine,
    watch::Watch,
};
use idem_core::{
    Backend, ClaimKind, Error, FailureKind, Fingerprint, Key, Lease, Record, Result, State,
    Timestamp,
};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, Row};

use crate::config::PgConfig;
use crate::error::{map, within};
use crate::sql::{ClaimStmt, Statements};

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
        .map_err(|e| map(what, e))?;
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
    fresh_batches: Arc<AtomicBool>,
}

impl PgBackend {
    /// Connects a pool. Does not create tables: call [`PgBackend::migrate`] once.
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
        // The first connection is bounded too: a server that accepts and never answers
        // is `Unavailable` after `connect_timeout`, not a hang.
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
            .connect_with(options.options(PLANNING))
            .await
            .map_err(|e| map(&what, e))?;
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

    /// Creates the schema and runs the migrations in `migrations/` (idempotent).
    pub async fn migrate(&self) -> Result<()> {
        let mut conn = self.pool.acquire().await.map_err(|e| map("migrate", e))?;
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

    /// One claim, if its key does not exist yet: the insert alone (`claim_fresh.sql`).
    /// `None` when the key exists.
    async fn claim_fresh(&self, stmt: &ClaimStmt, c: &Claim) -> Result<Option<ClaimOutcome>> {
        let query = bind_one(sqlx::query(stmt.fresh.sql()), c);
        let Some(row) = self
            .timed("claim", query.fetch_optional(&self.pool))
            .await?
        else {
            return Ok(None);
        };
        let until: i64 = row.try_get(0).map_err(|e| map("claim", e))?;
        Ok(Some(ClaimOutcome::Acquired(first_lease(c, until))))
    }

    /// The first round of a batch of distinct keys: the keys that do not exist yet are
    /// inserted (`claim_fresh_many.sql`) and answered; the others are `None`, for
    /// `claim.sql` to claim. Keys in `repeated` (claimed again later in the batch) also
    /// get the record the insert wrote, so that their repeats are answered from it.
    async fn claim_fresh_round(
        &self,
        stmt: &ClaimStmt,
        claims: &[&Claim],
        repeated: &HashSet<&Key>,
    ) -> Result<(Vec<Option<ClaimOutcome>>, HashMap<Key, Found>)> {
        let query = bind_many(stmt.fresh_many.sql(), claims);
        let rows = self.timed("claim", query.fetch_all(&self.pool)).await?;
        let mut out: Vec<Option<ClaimOutcome>> = vec![None; claims.len()];
        let mut found = HashMap::new();
        let at: HashMap<(&str, &str), usize> = claims
            .iter()
            .enumerate()
            .map(|(i, c)| ((c.key.namespace(), c.key.id()), i))
            .collect();
        for row in &rows {
            let get = |e: sqlx::Error| map("claim", e);
            let namespace: &str = row.try_get(0).map_err(get)?;
            let id: &str = row.try_get(1).map_err(get)?;
            let until: i64 = row.try_get(2).map_err(get)?;
            let i = *at.get(&(namespace, id)).ok_or_else(|| {
                Error::corrupt(format!("the fresh insert returned a key not claimed: {id}"))
            })?;
            if repeated.contains(&claims[i].key) {
                found.insert(claims[i].key.clone(), Found::first(claims[i], until));
            }
            out[i] = Some(ClaimOutcome::Acquired(first_lease(claims[i], until)));
        }
        Ok((out, found))
    }

    /// The answer to `claim` from its key's record as read now (`claim_read.sql`), or
    /// `None` where the claim could take the record (or found none): a claim statement
    /// must decide that.
    async fn claim_read(&self, claim: &Claim) -> Result<Option<ClaimOutcome>> {
        let query = sqlx::query(self.sql.claim_read.sql())
            .bind(claim.key.namespace())
            .bind(claim.key.id());
        let Some(row) = self
            .timed("claim", query.fetch_optional(&self.pool))
            .await?
        else {
            return Ok(None);
        };
        Ok(Found::from_row(&row, false)?.answer(claim))
    }

    /// One statement for claims of distinct keys. `None` where the key was neither written
    /// nor found (a concurrent first insert committed after this statement's snapshot), or
    /// where the database and the state machine disagreed at a millisecond boundary: the
    /// caller asks again. Also returns each found key's record as the statement left it,
    /// with the database's clock.
    async fn claim_round(
        &self,
        stmt: &ClaimStmt,
        claims: &[&Claim],
    ) -> Result<(Vec<Option<ClaimOutcome>>, HashMap<Key, Found>)> {
        let query = match claims {
            [c] => bind_one(sqlx::query(stmt.one.sql()), c),
            _ => bind_many(stmt.many.sql(), claims),
        };
        let rows = self.timed("claim", query.fetch_all(&self.pool)).await?;
        let mut found = HashMap::with_capacity(rows.len());
        for row in &rows {
            let written = row.try_get("written").map_err(|e| map("claim", e))?;
            let f = Found::from_row(row, written)?;
            found.insert(f.rec.key.clone(), f);
        }
        let mut out = Vec::with_capacity(claims.len());
        for claim in claims {
            out.push(match found.get(&claim.key) {
                None => None,
                Some(f) if f.written => Some(granted(&f.rec, &f.kind)?),
                Some(f) => f.answer(claim),
            });
        }
        Ok((out, found))
    }
}

impl PgBackend {
    /// Claims with `stmt` (a claim statement), in rounds of distinct keys.
    pub(crate) async fn claim_with(
        &self,
        stmt: &ClaimStmt,
        claims: &[Claim],
    ) -> Result<Vec<ClaimOutcome>> {
        if let [claim] = claims {
            if let Some(lease) = self.claim_fresh(stmt, claim).await? {
                return Ok(vec![lease]);
            }
            if let Some(answer) = self.claim_read(claim).await? {
                return Ok(vec![answer]);
            }
        }
        let mut answers: Vec<Option<ClaimOutcome>> = vec![None; claims.len()];
        let mut pending: Vec<usize> = (0..claims.len()).collect();
        // A single claim tried its insert above already.
        let mut first = claims.len() > 1;
        let mut try_insert = first && self.fresh_batches.load(Ordering::Relaxed);
        for _ in 0..claims.len() + 16 {
            if pending.is_empty() {
                break;
            }
            let (round, mut rest) = distinct_round(&pending, |i| &claims[i].key);
            let batch: Vec<&Claim> = round.iter().map(|&i| &claims[i]).collect();
            // The first round inserts the keys that do not exist yet, and nothing else,
            // unless the last batch was mostly keys that exist; the rounds after it run the
            // claim statement.
            let (round_answers, found) = if std::mem::take(&mut try_insert) {
                let repeated: HashSet<&Key> = rest.iter().map(|&i| &claims[i].key).collect();
                self.claim_fresh_round(stmt, &batch, &repeated).await?
            } else {
                self.claim_round(stmt, &batch).await?
            };
            if std::mem::take(&mut first) {
                let new = round_answers
                    .iter()
                    .filter(|a| {
                        matches!(a, Some(ClaimOutcome::Acquired(l)) if l.kind == ClaimKind::First)
                    })
                    .count();
                self.fresh_batches
                    .store(2 * new >= batch.len(), Ordering::Relaxed);
            }
            for (i, answer) in round.into_iter().zip(round_answers) {
                match answer {
                    Some(answer) => answers[i] = Some(answer),
                    None => rest.push(i),
                }
            }
            rest.sort_unstable();
            // A repeated key whose record this round left unclaimable to it (a lease just
            // granted, a stored response) gets the answer a claim made next would get, with
            // no statement; one it could claim waits for the next round, with every later
            // repetition of its key.
            let mut blocked = HashSet::new();
            rest.retain(|&i| {
                let c = &claims[i];
                let answer = match found.get(&c.key) {
                    Some(f) if !blocked.contains(&c.key) => f.answer(c),
                    _ => None,
                };
                if answer.is_none() {
                    blocked.insert(&c.key);
                }
                answers[i] = answer;
                answers[i].is_none()
            });
            pending = rest;
        }
        answers
            .into_iter()
            .map(|a| {
                a.ok_or_else(|| Error::Unavailable {
                    message: "claim kept racing with concurrent first inserts; retry".into(),
                    source: None,
                })
            })
            .collect()
    }
}

/// A record a claim statement returned: as the statement left it, whether the statement
/// wrote it, how it was granted, and the database's clock.
struct Found {
    rec: Record,
    written: bool,
    kind: String,
    now: Timestamp,
}

impl Found {
    /// A row of record columns with the database's clock (`now_ms`).
    fn from_row(row: &PgRow, written: bool) -> Result<Found> {
        let rec = decode(row)?;
        let now: i64 = row.try_get("now_ms").map_err(|e| map("claim", e))?;
        let kind = row.try_get("claim_kind").map_err(|e| map("claim", e))?;
        let now = Timestamp::from_millis(u64::try_from(now).unwrap_or(0));
        Ok(Found {
            rec,
            written,
            kind,
            now,
        })
    }

    /// The record a first claim (`claim_fresh_many.sql`) wrote for `claim`, given the
    /// deadline the database gave its lease.
    fn first(claim: &Claim, until_ms: i64) -> Found {
        let now = inserted_at(claim, until_ms);
        Found {
            rec: machine::first(claim, now).1,
            written: true,
            kind: "first".to_owned(),
            now,
        }
    }

    /// The answer `claim` gets from this record without writing, or `None` where the
    /// claim writes (it takes the record, or turns a lapsed lease with no attempts left
    /// failed): a statement must do that.
    fn answer(&self, claim: &Claim) -> Option<ClaimOutcome> {
        match machine::claim(Some(&self.rec), claim, self.now) {
            (answer, None) => Some(answer),
            (_, Some(_)) => None,
        }
    }
}

/// Splits `pending` into the first occurrence of each key, in order, and the rest, in
/// order.
pub(crate) fn distinct_round<'k>(
    pending: &[usize],
    key: impl Fn(usize) -> &'k Key,
) -> (Vec<usize>, Vec<usize>) {
    let mut seen: HashSet<&Key, foldhash::fast::FixedState> =
        HashSet::with_capacity_and_hasher(pending.len(), Default::default());
    pending.iter().copied().partition(|&i| seen.insert(key(i)))
}

/// The parameters of one claim, `$1` to `$7` of `claim_fresh.sql` and of `claim.sql`'s
/// single input.
fn bind_one<'q>(query: PgQuery<'q>, c: &'q Claim) -> PgQuery<'q> {
    query
        .bind(c.key.namespace())
        .bind(c.key.id())
        .bind(&*c.owner)
        .bind(millis(c.lease_ttl))
        .bind(c.fingerprint.map(|f| f.0.to_vec()))
        .bind(i32::try_from(c.max_attempts).unwrap_or(i32::MAX))
        .bind(millis(c.retention))
}

/// The parameters of a batch of claims as arrays, one element per claim: `$1` to `$7` of
/// `claim_fresh_many.sql` and of `claim.sql`'s batch input.
fn bind_many<'q>(sql: AssertSqlSafe<Arc<str>>, claims: &[&'q Claim]) -> PgQuery<'q> {
    let text: usize = claims
        .iter()
        .map(|c| c.key.namespace().len() + c.key.id().len() + c.owner.len())
        .sum();
    let query = sized(sql, 7, text + 96 * claims.len());
    let mut ns = Vec::with_capacity(claims.len());
    let (mut ids, mut owners, mut ttls) = (Vec::new(), Vec::new(), Vec::new());
    let (mut fps, mut maxes, mut retentions) = (Vec::new(), Vec::new(), Vec::new());
    for c in claims {
        ns.push(c.key.namespace());
        ids.push(c.key.id());
        owners.push(&*c.owner);
        ttls.push(millis(c.lease_ttl));
        fps.push(c.fingerprint.as_ref().map(|f| &f.0[..]));
        maxes.push(i32::try_from(c.max_attempts).unwrap_or(i32::MAX));
        retentions.push(millis(c.retention));
    }
    query
        .bind(ns)
        .bind(ids)
        .bind(owners)
        .bind(ttls)
        .bind(fps)
        .bind(maxes)
        .bind(retentions)
}

/// The lease of a first claim of `c` (token 1, attempt 1), lasting until `until_ms`.
fn first_lease(c: &Claim, until_ms: i64) -> Lease {
    machine::first(c, inserted_at(c, until_ms)).0
}

/// The database's clock when it inserted the first record of `c`, whose lease it gave
/// deadline `until_ms`: the deadline less the lease's length.
fn inserted_at(c: &Claim, until_ms: i64) -> Timestamp {
    let until = u64::try_from(until_ms).unwrap_or(0);
    Timestamp::from_millis(until.saturating_sub(u64::try_from(millis(c.lease_ttl)).unwrap_or(0)))
}

/// [`idem_core::backend::millis`] as the `BIGINT` the statements bind (its cap fits).
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(idem_core::backend::millis(d)).unwrap_or(i64::MAX)
}

/// The answer for a row the claim statement wrote.
fn granted(rec: &Record, kind: &str) -> Result<ClaimOutcome> {
    let kind = match kind {
        "first" => ClaimKind::First,
        "retry" => ClaimKind::Retry,
        "takeover" => ClaimKind::Takeover,
        "poisoned" => {
            return Ok(ClaimOutcome::Poisoned {
                attempts: rec.attempts,
                error: rec.error.clone().unwrap_or_default(),
            });
        }
        other => {
            return Err(Error::corrupt(format!(
                "claim_kind {other:?} of {}",
                rec.key
            )));
        }
    };
    let lease_until = rec
        .lease_until
        .ok_or_else(|| Error::corrupt(format!("claimed {} has no lease_until", rec.key)))?;
    Ok(ClaimOutcome::Acquired(Lease {
        key: rec.key.clone(),
        owner: rec.owner.clone(),
        token: rec.token,
        attempts: rec.attempts,
        lease_until,
        kind,
        fingerprint: rec.fingerprint,
    }))
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

    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>> {
        let limit = (filter.limit > 0).then(|| i64::try_from(filter.limit).unwrap_or(i64::MAX));
        let query = sqlx::query(self.sql.list.sql())
            .bind(filter.namespace.as_deref())
            .bind(filter.state.map(State::as_str))
            .bind(limit);
        let rows = self.timed("list", query.fetch_all(&self.pool)).await?;
        rows.iter().map(decode).collect()
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
