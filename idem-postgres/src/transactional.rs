//! Transactional mode: the handler's writes, the `Completed` record and the Kafka offset
//! commit in one PostgreSQL transaction.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use idem_core::backend::{
    Claim, ClaimOutcome, OffsetPosition, StoredOffset, TxFuture, handler_response,
};
use idem_core::{Backend, Error, HandlerError, Lease, Outcome, Result, Transactional};
use sqlx::Row;

use crate::backend::{PgBackend, PgQuery, check_fence, fenced, millis};

use crate::error::map;

/// The open transaction a transactional handler writes through.
pub type PgTransaction = sqlx::Transaction<'static, sqlx::Postgres>;

impl PgBackend {
    /// Opens a transactional-mode transaction: the handler's statements plan with the
    /// server's own settings, not the ones idem's connections use (see `PLANNING`).
    pub(crate) async fn begin_tx(&self) -> Result<PgTransaction> {
        let begin = self
            .pool
            .begin_with(sqlx::AssertSqlSafe(Arc::clone(&self.begin)));
        self.timed("begin", begin).await
    }

    /// Awaits a handler: its response, or its failure (an error, a panic, or a response
    /// over `max_response_bytes`, which is permanent).
    pub(crate) async fn run(&self, handler: TxFuture<'_>) -> Result<Bytes, HandlerError> {
        match AssertUnwindSafe(handler).catch_unwind().await {
            Ok(Ok(response)) => handler_response(response, self.max_response_bytes),
            Ok(Err(e)) => Err(e),
            Err(panic) => Err(HandlerError::panicked(panic.as_ref())),
        }
    }

    async fn commit(
        &self,
        mut tx: PgTransaction,
        lease: &Lease,
        response: Bytes,
        retention: Duration,
        offset: Option<&OffsetPosition>,
    ) -> Result<Outcome> {
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
        let row = self.timed("complete", query.fetch_one(&mut *tx)).await?;
        let completed: i64 = row.try_get("completed").map_err(|e| map("complete", e))?;
        if check_fence(u64::try_from(completed).unwrap_or(0), lease).is_err() {
            self.timed("rollback", tx.rollback()).await?;
            return Ok(Outcome::Fenced);
        }
        self.timed("commit", tx.commit()).await?;
        Ok(Outcome::Executed(response))
    }
}

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
        let answer = self
            .claim_with(&self.sql.claim_async, std::slice::from_ref(claim))
            .await?
            .pop()
            .ok_or_else(|| Error::corrupt("claim returned no answer"))?;
        let lease = match acquired(answer) {
            Ok(lease) => lease,
            Err(replay @ Outcome::Replayed(_)) => {
                if let Some(at) = offset {
                    self.store_offset(at).await?;
                }
                return Ok(replay);
            }
            Err(outcome) => return Ok(outcome),
        };
        let mut tx = self.begin_tx().await?;
        let failure = match self.run(handler(&mut tx, lease.clone())).await {
            Ok(response) => return self.commit(tx, &lease, response, retention, offset).await,
            Err(failure) => failure,
        };
        self.timed("rollback", tx.rollback()).await?;
        let kind = failure.kind();
        match self.fail(&lease, failure.message(), kind, retention).await {
            Ok(()) => {}
            Err(Error::Fenced { .. }) => return Ok(Outcome::Fenced),
            Err(e) => return Err(e),
        }
        let error = failure.message().to_owned();
        Ok(Outcome::after_failure(
            lease.attempts,
            claim.max_attempts,
            kind,
            error,
        ))
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
        self.run_batch(claims, retention, handler, offset).await
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

fn bind_offset<'q>(query: PgQuery<'q>, at: &'q OffsetPosition) -> PgQuery<'q> {
    query
        .bind(at.group.as_str())
        .bind(at.topic.as_str())
        .bind(at.partition)
        .bind(at.offset.saturating_add(1))
}

/// The lease of an acquired claim, or the outcome of one that was not: a duplicate
/// (`Replayed`), `InProgress`, `Poisoned` or `Mismatch`.
pub(crate) fn acquired(answer: ClaimOutcome) -> Result<Lease, Outcome> {
    match answer {
        ClaimOutcome::Acquired(lease) => Ok(lease),
        ClaimOutcome::Completed(bytes) => Err(Outcome::Replayed(bytes)),
        ClaimOutcome::InProgress { owner, lease_until } => {
            Err(Outcome::InProgress { owner, lease_until })
        }
        ClaimOutcome::Poisoned { attempts, error } => Err(Outcome::Poisoned { attempts, error }),
        ClaimOutcome::Mismatch => Err(Outcome::Mismatch),
    }
}
