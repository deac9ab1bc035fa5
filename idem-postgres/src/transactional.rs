//! Transactional mode: the handler's writes, the `Completed` record and the Kafka offset
//! commit in one PostgreSQL transaction. In batch transactional mode a poll batch's claims
//! commit in one statement, then its handlers, completes, failures and offset commit in
//! one transaction: first with no savepoints, and after a handler failure once more with a
//! savepoint per handler.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem_core::backend::tx::{self, Savepoint, TxStore};
use idem_core::backend::{Claim, ClaimOutcome, OffsetPosition, Settlement, StoredOffset, TxFuture};
use idem_core::{Error, Lease, Offsets, Outcome, Result, Transactional};
use sqlx::{AssertSqlSafe, Row};

use crate::backend::{PLANNING, PgBackend, PgQuery, check_fence, fenced, millis};
use crate::error::map;
use crate::settle::{Fences, Round, positions};

/// The open transaction a transactional handler writes through.
pub type PgTransaction = sqlx::Transaction<'static, sqlx::Postgres>;

#[async_trait::async_trait]
impl Transactional for PgBackend {
    type Tx = PgTransaction;

    /// Runs `handler` exactly once for `claim.key` as far as the database is concerned.
    ///
    /// 1. The claim runs on its own and commits, so the attempt counts even if what follows
    ///    rolls back (a crash loop stays bounded by `max_attempts`). A key that is not
    ///    claimable answers at once: `Replayed`, `InProgress`, `Poisoned`, `Mismatch`.
    /// 2. A transaction opens; `handler` gets it and the lease, and writes through it.
    /// 3. In the same transaction the record becomes `Completed` with the response (fenced
    ///    by the lease's token; the row lock it takes is held until commit) and, if
    ///    `offset` is given, the group's next offset is stored. Then COMMIT.
    ///
    /// A handler error or panic rolls everything back, then `fail` records the attempt in a
    /// short transaction of its own. Dropping the returned future rolls back too; the key
    /// stays `Processing` until its lease (`claim.lease_ttl`) lapses and a later claim takes
    /// over. If a lease lapses while a slow handler still runs and another worker takes
    /// over, both may run their handlers, but the token check under the row lock lets only
    /// one transaction commit: the other is `Fenced` and rolled back.
    ///
    /// A replayed duplicate with `offset` given stores that offset as well, so the group's
    /// position moves past duplicates.
    async fn execute_in_transaction<F>(
        &self,
        claim: &Claim,
        retention: Duration,
        offset: Option<&OffsetPosition>,
        handler: F,
    ) -> Result<Outcome>
    where
        F: for<'t> FnOnce(&'t mut PgTransaction, Lease) -> TxFuture<'t> + Send,
    {
        tx::execute(self, claim, retention, offset, handler).await
    }

    /// On PostgreSQL: the
    /// claims in one statement (asynchronous commit, as for one message), then one
    /// transaction of
    ///
    /// 1. one `SELECT … FOR UPDATE` of the records the batch's leases still hold, in key
    ///    order: a lease not held any more is `Fenced` (its handler does not run); a held
    ///    one cannot be taken over until the transaction ends;
    /// 2. each held lease's handler under `SAVEPOINT idem_item` (one round trip per
    ///    handler besides its own statements): an error or panic rolls back to it;
    /// 3. one statement that completes the successes, fails the failures and stores the
    ///    offset `offset` chose from the outcomes; then COMMIT.
    async fn execute_batch_in_transaction<H, O>(
        &self,
        claims: &[Claim],
        retention: Duration,
        handler: H,
        offset: O,
    ) -> Result<Vec<Outcome>>
    where
        H: for<'t> FnMut(&'t mut PgTransaction, usize, Lease) -> TxFuture<'t> + Send,
        O: FnOnce(&[Outcome]) -> Option<OffsetPosition> + Send,
    {
        tx::execute_batch(self, claims, retention, handler, offset).await
    }

    /// Stores `offset + 1` as the group's next offset for the partition, on its own.
    async fn store_offset(&self, at: &OffsetPosition) -> Result<()> {
        let query = bind_offset(sqlx::query(self.sql.store_offset.sql()), at);
        self.timed("store offset", query.execute(&self.pool))
            .await?;
        Ok(())
    }

    /// The next offsets stored for `group`, by topic and partition: where a consumer in
    /// transactional mode seeks on assignment.
    async fn stored_offsets(&self, group: &str) -> Result<Vec<StoredOffset>> {
        let query = sqlx::query(self.sql.offsets.sql()).bind(group);
        let rows = self
            .timed("read offsets", query.fetch_all(&self.pool))
            .await?;
        rows.iter()
            .map(|row| {
                Ok(StoredOffset {
                    topic: row.try_get("topic").map_err(|e| map("read offsets", e))?,
                    partition: row
                        .try_get("partition")
                        .map_err(|e| map("read offsets", e))?,
                    next_offset: row
                        .try_get("next_offset")
                        .map_err(|e| map("read offsets", e))?,
                })
            })
            .collect()
    }
}

/// What `idem offsets` reads and moves: the `idem_offsets` rows of a group.
#[async_trait::async_trait]
impl Offsets for PgBackend {
    async fn offsets(&self, group: &str) -> Result<Vec<StoredOffset>> {
        self.stored_offsets(group).await
    }

    async fn set_offset(&self, group: &str, to: &StoredOffset) -> Result<()> {
        self.store_offset(&OffsetPosition::before(group, to)).await
    }

    async fn delete_offsets(
        &self,
        group: &str,
        topic: Option<&str>,
        partition: Option<i32>,
    ) -> Result<u64> {
        let query = sqlx::query(self.sql.delete_offsets.sql())
            .bind(group)
            .bind(topic)
            .bind(partition);
        let done = self
            .timed("delete offsets", query.execute(&self.pool))
            .await?;
        Ok(done.rows_affected())
    }
}

fn bind_offset<'q>(query: PgQuery<'q>, at: &'q OffsetPosition) -> PgQuery<'q> {
    query
        .bind(at.group.as_str())
        .bind(at.topic.as_str())
        .bind(at.partition)
        .bind(at.offset.saturating_add(1))
}

/// The savepoint each handler runs under. One name serves: `ROLLBACK TO` keeps it for the
/// next handler, and after a success the next handler releases it and sets a new one.
const SAVEPOINT: &str = "SAVEPOINT idem_item";
const NEXT_SAVEPOINT: &str = "RELEASE SAVEPOINT idem_item; SAVEPOINT idem_item";
const ROLLBACK: &str = "ROLLBACK TO SAVEPOINT idem_item";

/// Transactional mode's steps on PostgreSQL; `idem_core::backend::tx` runs them.
#[async_trait::async_trait]
impl TxStore for PgBackend {
    /// The claims in one statement whose commit is asynchronous: the main transaction's
    /// synchronous commit flushes the WAL past it anyway.
    async fn claim_for_tx(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        self.claim_with(&self.sql.claim_async, claims).await
    }

    /// Opens a transactional-mode transaction: the handler's statements plan with the
    /// server's own settings, not the ones idem's connections use (see `PLANNING`).
    async fn begin(&self) -> Result<PgTransaction> {
        let begin = self
            .pool
            .begin_with(sqlx::AssertSqlSafe(Arc::clone(&self.begin)));
        self.timed("begin", begin).await
    }

    /// Plain BEGIN: the lock plans with idem's settings; `lock_held` then restores the
    /// server's for the handlers, and `settle_in` sets idem's again (see `PLANNING`).
    async fn begin_locked(
        &self,
        leases: &[Lease],
        savepoints: bool,
    ) -> Result<(PgTransaction, Vec<bool>)> {
        let mut tx = self.timed("begin", self.pool.begin()).await?;
        let held = self.lock_held(&mut tx, leases, savepoints).await?;
        Ok((tx, held))
    }

    /// The first savepoint is set with the lock (`lock_held`), and `ROLLBACK TO` keeps
    /// it: only a success needs a new one, released and set in one round trip.
    async fn savepoint(&self, tx: &mut PgTransaction, at: Savepoint) -> Result<()> {
        if at == Savepoint::AfterSuccess {
            self.timed(
                "savepoint",
                sqlx::raw_sql(NEXT_SAVEPOINT).execute(&mut **tx),
            )
            .await?;
        }
        Ok(())
    }

    async fn rollback_to_savepoint(&self, tx: &mut PgTransaction) -> Result<()> {
        self.timed("rollback", sqlx::raw_sql(ROLLBACK).execute(&mut **tx))
            .await?;
        Ok(())
    }

    /// Settles `items` (distinct keys, locked by this transaction) and stores `at`, in one
    /// statement inside `tx`. How many items it settled.
    async fn settle_in(
        &self,
        tx: &mut PgTransaction,
        items: &[Settlement],
        retention: Duration,
        at: Option<&OffsetPosition>,
    ) -> Result<usize> {
        if self.restore_settings().next().is_some() {
            let idem: Vec<String> = PLANNING
                .iter()
                .map(|(name, value)| format!("SET LOCAL {name} = {value}"))
                .collect();
            let idem = AssertSqlSafe(idem.join("; "));
            self.timed("settings", sqlx::raw_sql(idem).execute(&mut **tx))
                .await?;
        }
        let mut round = Round::default();
        for item in items {
            round.push(item, millis(retention));
        }
        let query = round
            .bind(sqlx::query(self.sql.settle_batch.sql()))
            .bind(at.map(|at| at.group.as_str()))
            .bind(at.map(|at| at.topic.as_str()))
            .bind(at.map(|at| at.partition))
            .bind(at.map(|at| at.offset.saturating_add(1)));
        let rows = self
            .timed("settle batch", query.fetch_all(&mut **tx))
            .await?;
        Ok(positions(&rows, "settle batch")?.len())
    }

    /// One statement: the record becomes `Completed` (fenced by the lease's token; the row
    /// lock it takes is held until commit) and the offset is stored.
    async fn complete_in(
        &self,
        tx: &mut PgTransaction,
        lease: &Lease,
        response: &Bytes,
        retention: Duration,
        offset: Option<&OffsetPosition>,
    ) -> Result<bool> {
        let (group, topic, partition, next) = match offset {
            Some(at) => (
                Some(at.group.as_str()),
                Some(at.topic.as_str()),
                Some(at.partition),
                Some(at.offset.saturating_add(1)),
            ),
            None => (None, None, None, None),
        };
        let query = fenced(sqlx::query(self.sql.complete_with_offset.sql()), lease)
            .bind(response.as_ref())
            .bind(millis(retention))
            .bind(group)
            .bind(topic)
            .bind(partition)
            .bind(next);
        let row = self.timed("complete", query.fetch_one(&mut **tx)).await?;
        let completed: i64 = row.try_get("completed").map_err(|e| map("complete", e))?;
        Ok(check_fence(u64::try_from(completed).unwrap_or(0), lease).is_ok())
    }

    async fn commit(&self, tx: PgTransaction) -> Result<()> {
        self.timed("commit", tx.commit()).await
    }

    async fn rollback(&self, tx: PgTransaction) -> Result<()> {
        self.timed("rollback", tx.rollback()).await
    }
}

impl PgBackend {
    /// Locks the records `leases` still hold, then restores the server's settings and,
    /// with `savepoints`, sets the first savepoint (the same round trip would not do: the
    /// lock binds parameters). Whether each lease is held, in order.
    async fn lock_held(
        &self,
        tx: &mut PgTransaction,
        leases: &[Lease],
        savepoints: bool,
    ) -> Result<Vec<bool>> {
        let mut fences = Fences::with_capacity(leases.len());
        for lease in leases {
            fences.push(lease);
        }
        let query = fences.bind(sqlx::query(self.sql.lock_batch.sql()));
        let rows = self.timed("lock batch", query.fetch_all(&mut **tx)).await?;
        let mut held = vec![false; leases.len()];
        for n in positions(&rows, "lock batch")? {
            *held
                .get_mut(n)
                .ok_or_else(|| Error::corrupt(format!("lock batch returned row {n}")))? = true;
        }
        let mut first: Vec<String> = self.restore_settings().collect();
        if savepoints {
            first.push(SAVEPOINT.to_owned());
        }
        if !first.is_empty() {
            let first = AssertSqlSafe(first.join("; "));
            self.timed("savepoint", sqlx::raw_sql(first).execute(&mut **tx))
                .await?;
        }
        Ok(held)
    }

    /// The `SET LOCAL` statements that give a transaction the server's own planner
    /// settings (none for a backend made by `from_pool`).
    fn restore_settings(&self) -> impl Iterator<Item = String> + '_ {
        self.begin
            .split("; ")
            .filter(|s| s.starts_with("SET LOCAL"))
            .map(str::to_owned)
    }
}
