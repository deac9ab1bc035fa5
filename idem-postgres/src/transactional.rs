//! Transactional mode: the handler's writes, the `Completed` record and the Kafka offset
//! commit in one PostgreSQL transaction. In batch transactional mode a poll batch's claims
//! commit in one statement, then its handlers, completes, failures and offset commit in
//! one transaction: first with no savepoints, and after a handler failure once more with a
//! savepoint per handler.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use idem_core::backend::{
    Claim, ClaimOutcome, OffsetPosition, Settlement, StoredOffset, TxFuture, handler_response,
};
use idem_core::{Backend, Error, HandlerError, Lease, Outcome, Result, Transactional};
use sqlx::{AssertSqlSafe, Row};

use crate::backend::{PLANNING, PgBackend, PgQuery, check_fence, fenced, millis};
use crate::error::map;
use crate::settle::{Fences, Round, positions};

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

/// The savepoint each handler runs under. One name serves: `ROLLBACK TO` keeps it for the
/// next handler, and after a success the next handler releases it and sets a new one.
const SAVEPOINT: &str = "SAVEPOINT idem_item";
const NEXT_SAVEPOINT: &str = "RELEASE SAVEPOINT idem_item; SAVEPOINT idem_item";
const ROLLBACK: &str = "ROLLBACK TO SAVEPOINT idem_item";

impl PgBackend {
    /// The body of `execute_batch_in_transaction` (see its docs in `transactional.rs`).
    pub(crate) async fn run_batch<H, O>(
        &self,
        claims: &[Claim],
        retention: Duration,
        mut handler: H,
        offset: O,
    ) -> Result<Vec<Outcome>>
    where
        H: for<'t> FnMut(&'t mut PgTransaction, usize, Lease) -> TxFuture<'t> + Send,
        O: FnOnce(&[Outcome]) -> Option<OffsetPosition> + Send,
    {
        let answers = self.claim_with(&self.sql.claim_async, claims).await?;
        let mut outcomes: Vec<Option<Outcome>> = Vec::with_capacity(claims.len());
        let mut leases: Vec<(usize, Lease)> = Vec::new();
        for (i, answer) in answers.into_iter().enumerate() {
            match acquired(answer) {
                Ok(lease) => {
                    leases.push((i, lease));
                    outcomes.push(None);
                }
                Err(outcome) => outcomes.push(Some(outcome)),
            }
        }
        if leases.is_empty() {
            let outcomes: Vec<Outcome> = outcomes.into_iter().flatten().collect();
            if let Some(at) = offset(&outcomes) {
                self.store_offset(&at).await?;
            }
            return Ok(outcomes);
        }
        // The optimistic pass runs the handlers with no savepoints: one round trip less
        // per message. The first handler that fails rolls it all back, and the careful
        // pass runs the batch again, each handler under a savepoint.
        let mut pass = match self
            .pass(claims, &leases, &mut handler, Isolation::Optimistic)
            .await?
        {
            Some(pass) => pass,
            None => self
                .pass(claims, &leases, &mut handler, Isolation::Savepoints)
                .await?
                .ok_or_else(|| Error::corrupt("the careful pass gave up"))?,
        };
        for (i, outcome) in pass.outcomes.drain(..) {
            outcomes[i] = Some(outcome);
        }
        let outcomes: Vec<Outcome> = outcomes.into_iter().flatten().collect();
        let at = offset(&outcomes);
        let settled = self
            .settle_in(&mut pass.tx, &pass.settle, retention, at.as_ref())
            .await?;
        if settled != pass.settle.len() {
            self.timed("rollback", pass.tx.rollback()).await?;
            return Err(Error::corrupt(format!(
                "a locked batch settled {settled} of {} leases",
                pass.settle.len()
            )));
        }
        self.timed("commit", pass.tx.commit()).await?;
        Ok(outcomes)
    }

    /// Opens the batch's transaction, locks the records `leases` still hold and runs the
    /// held leases' handlers in order. With `Savepoints`, each handler runs under its own
    /// savepoint and a failure rolls back to it; with `Optimistic`, there are none, and the
    /// first failure rolls the whole transaction back and answers `None`.
    async fn pass<H>(
        &self,
        claims: &[Claim],
        leases: &[(usize, Lease)],
        handler: &mut H,
        isolation: Isolation,
    ) -> Result<Option<Pass>>
    where
        H: for<'t> FnMut(&'t mut PgTransaction, usize, Lease) -> TxFuture<'t> + Send,
    {
        // Plain BEGIN: the lock plans with idem's settings; `lock_held` then restores the
        // server's for the handlers, and `settle_in` sets idem's again (see `PLANNING`).
        let mut tx = self.timed("begin", self.pool.begin()).await?;
        let held = self.lock_held(&mut tx, leases, isolation).await?;
        let mut pass = Pass {
            tx,
            outcomes: Vec::with_capacity(leases.len()),
            settle: Vec::with_capacity(leases.len()),
        };
        let mut savepoint = None;
        for ((i, lease), held) in leases.iter().zip(held) {
            let (i, lease) = (*i, lease.clone());
            if !held {
                pass.outcomes.push((i, Outcome::Fenced));
                continue;
            }
            if let Some(sql) = savepoint.take() {
                self.timed("savepoint", sqlx::raw_sql(sql).execute(&mut *pass.tx))
                    .await?;
            }
            match self.run(handler(&mut pass.tx, i, lease.clone())).await {
                Ok(response) => {
                    pass.outcomes.push((i, Outcome::Executed(response.clone())));
                    pass.settle.push(Settlement::complete(lease, response));
                    if isolation == Isolation::Savepoints {
                        savepoint = Some(NEXT_SAVEPOINT);
                    }
                }
                Err(_) if isolation == Isolation::Optimistic => {
                    self.timed("rollback", pass.tx.rollback()).await?;
                    return Ok(None);
                }
                Err(failure) => {
                    self.timed("rollback", sqlx::raw_sql(ROLLBACK).execute(&mut *pass.tx))
                        .await?;
                    pass.outcomes
                        .push((i, failed(&failure, &lease, &claims[i])));
                    pass.settle
                        .push(Settlement::fail(lease, failure.message(), failure.kind()));
                }
            }
        }
        Ok(Some(pass))
    }

    /// Locks the records `leases` still hold, then restores the server's settings and,
    /// with `Savepoints`, sets the first savepoint (the same round trip would not do: the
    /// lock binds parameters). Whether each lease is held, in order.
    async fn lock_held(
        &self,
        tx: &mut PgTransaction,
        leases: &[(usize, Lease)],
        isolation: Isolation,
    ) -> Result<Vec<bool>> {
        let mut fences = Fences::with_capacity(leases.len());
        for (_, lease) in leases {
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
        if isolation == Isolation::Savepoints {
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
}

/// How a pass keeps one handler's failure from undoing the others' writes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Isolation {
    /// No savepoints: a failure abandons the pass.
    Optimistic,
    /// Each handler under its own savepoint.
    Savepoints,
}

/// A pass that ran every held handler: its open transaction, the outcome of each lease
/// (by its index in the claims) and what to settle.
struct Pass {
    tx: PgTransaction,
    outcomes: Vec<(usize, Outcome)>,
    settle: Vec<Settlement>,
}

/// The outcome of a handler that failed, once its failure is recorded.
fn failed(failure: &HandlerError, lease: &Lease, claim: &Claim) -> Outcome {
    Outcome::after_failure(
        lease.attempts,
        claim.max_attempts,
        failure.kind(),
        failure.message().to_owned(),
    )
}
