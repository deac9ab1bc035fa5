//! Transactional mode: the handler's writes, the `Completed` record and the Kafka offset
//! commit in one InnoDB transaction. The claim commits first, on its own (so an attempt
//! counts even when what follows rolls back); the record is locked again in the handler's
//! transaction when it completes, and its token checked under that lock, so a worker whose
//! lease was taken over meanwhile is `Fenced` and rolls back. In batch mode a poll batch's
//! claims commit in one transaction, then its handlers, completes, failures and offset
//! commit in one: first with no savepoints, and after a handler failure once more with a
//! savepoint per handler.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use idem_core::backend::{
    Claim, ClaimOutcome, OffsetPosition, Settlement, StoredOffset, TxFuture, handler_response,
    machine,
};
use idem_core::{Backend, Error, HandlerError, Lease, Outcome, Result, Transactional};
use sqlx::{AssertSqlSafe, MySql, MySqlConnection, Row};

use crate::backend::MySqlBackend;
use crate::error::map;
use crate::settle::settle_locked;

/// The open transaction a transactional handler writes through.
pub type MySqlTransaction = sqlx::Transaction<'static, MySql>;

impl MySqlBackend {
    /// Awaits a handler: its response, or its failure (an error, a panic, or a response
    /// over `max_response_bytes`, which is permanent).
    async fn run(&self, handler: TxFuture<'_>) -> Result<Bytes, HandlerError> {
        match AssertUnwindSafe(handler).catch_unwind().await {
            Ok(Ok(response)) => handler_response(response, self.max_response_bytes),
            Ok(Err(e)) => Err(e),
            Err(panic) => Err(HandlerError::panicked(panic.as_ref())),
        }
    }

    /// Inside `conn`'s open transaction: settles `items` (distinct keys) against their
    /// records, locked now, and stores `at`. How many items were not fenced.
    async fn settle_in(
        &self,
        conn: &mut MySqlConnection,
        items: &[Settlement],
        retention: Duration,
        at: Option<&OffsetPosition>,
    ) -> Result<usize> {
        let what = "settle in transaction";
        let keys: Vec<_> = items.iter().map(|i| &i.lease.key).collect();
        let work = async {
            let settled = self
                .lock_apply_write(conn, &keys, &mut |locked| {
                    items
                        .iter()
                        .filter(|item| settle_locked(locked, item, retention).is_ok())
                        .count()
                })
                .await
                .map_err(|e| map(what, e))??;
            if let Some(at) = at {
                self.offset_query(at)
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| map(what, e))?;
            }
            Ok(settled)
        };
        idem_core::layer::within(what, self.timeout, Box::pin(work)).await
    }

    fn offset_query<'q>(
        &self,
        at: &'q OffsetPosition,
    ) -> sqlx::query::Query<'q, MySql, sqlx::mysql::MySqlArguments> {
        sqlx::query(AssertSqlSafe(self.tables.store_offset()))
            .bind(at.group.as_str())
            .bind(at.topic.as_str())
            .bind(at.partition)
            .bind(at.offset.saturating_add(1))
    }

    /// Completes `lease` in `tx` with the offset, and commits; `Fenced` (rolled back) if
    /// the lease no longer holds the record.
    async fn commit_one(
        &self,
        mut tx: MySqlTransaction,
        lease: &Lease,
        response: Bytes,
        retention: Duration,
        offset: Option<&OffsetPosition>,
    ) -> Result<Outcome> {
        let item = Settlement::complete(lease.clone(), response.clone());
        let settled = self
            .settle_in(&mut tx, std::slice::from_ref(&item), retention, offset)
            .await?;
        if settled != 1 {
            self.timed("rollback", tx.rollback()).await?;
            return Ok(Outcome::Fenced);
        }
        self.timed("commit", tx.commit()).await?;
        Ok(Outcome::Executed(response))
    }
}

#[async_trait::async_trait]
impl Transactional for MySqlBackend {
    type Tx = MySqlTransaction;

    /// Runs `handler` exactly once for `claim.key` as far as the database is concerned.
    ///
    /// 1. The claim runs in its own transaction and commits, so the attempt counts even
    ///    if what follows rolls back. A key that is not claimable answers at once.
    /// 2. A transaction opens; `handler` gets it and the lease, and writes through it.
    /// 3. In the same transaction the record is locked (`SELECT … FOR UPDATE`), its token
    ///    checked, and it becomes `Completed`; if `offset` is given, the group's next
    ///    offset is stored. Then COMMIT.
    ///
    /// A handler error or panic rolls everything back, then `fail` records the attempt in a
    /// transaction of its own. Dropping the future rolls back too. A replayed duplicate
    /// with `offset` given stores that offset.
    async fn execute_in_transaction<F>(
        &self,
        claim: &Claim,
        retention: Duration,
        offset: Option<&OffsetPosition>,
        handler: F,
    ) -> Result<Outcome>
    where
        F: for<'t> FnOnce(&'t mut MySqlTransaction, Lease) -> TxFuture<'t> + Send,
    {
        let lease = match acquired(self.claim(claim).await?) {
            Ok(lease) => lease,
            Err(replay @ Outcome::Replayed(_)) => {
                if let Some(at) = offset {
                    self.store_offset(at).await?;
                }
                return Ok(replay);
            }
            Err(outcome) => return Ok(outcome),
        };
        let mut tx = self.timed("begin", self.pool.begin()).await?;
        let failure = match self.run(handler(&mut tx, lease.clone())).await {
            Ok(response) => {
                return self
                    .commit_one(tx, &lease, response, retention, offset)
                    .await;
            }
            Err(failure) => failure,
        };
        self.timed("rollback", tx.rollback()).await?;
        let kind = failure.kind();
        match self.fail(&lease, failure.message(), kind, retention).await {
            Ok(()) => {}
            Err(Error::Fenced { .. }) => return Ok(Outcome::Fenced),
            Err(e) => return Err(e),
        }
        Ok(Outcome::after_failure(
            lease.attempts,
            claim.max_attempts,
            kind,
            failure.message().to_owned(),
        ))
    }

    /// On MySQL: the claims in one transaction, then one transaction of
    ///
    /// 1. one `SELECT … FOR UPDATE` of the batch's records: a lease that no longer holds
    ///    its record is `Fenced` (its handler does not run); a held one cannot be taken
    ///    over until the transaction ends;
    /// 2. each held lease's handler, with no savepoints; if one fails, the transaction
    ///    rolls back and the batch runs again in a new one, each handler under
    ///    `SAVEPOINT idem_item` (one round trip per handler), a failure rolling back to it;
    /// 3. one write of the completes and failures, and the offset `offset` chose; then
    ///    COMMIT.
    async fn execute_batch_in_transaction<H, O>(
        &self,
        claims: &[Claim],
        retention: Duration,
        mut handler: H,
        offset: O,
    ) -> Result<Vec<Outcome>>
    where
        H: for<'t> FnMut(&'t mut MySqlTransaction, usize, Lease) -> TxFuture<'t> + Send,
        O: FnOnce(&[Outcome]) -> Option<OffsetPosition> + Send,
    {
        let answers = self.claim_many(claims).await?;
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
        let mut pass = match self.pass(claims, &leases, &mut handler, false).await? {
            Some(pass) => pass,
            None => self
                .pass(claims, &leases, &mut handler, true)
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

    /// Stores `offset + 1` as the group's next offset for the partition, on its own.
    async fn store_offset(&self, at: &OffsetPosition) -> Result<()> {
        let query = self.offset_query(at);
        self.timed("store offset", query.execute(&self.pool))
            .await?;
        Ok(())
    }

    /// The next offsets stored for `group`, by topic and partition.
    async fn stored_offsets(&self, group: &str) -> Result<Vec<StoredOffset>> {
        let query = sqlx::query(AssertSqlSafe(self.tables.offsets())).bind(group);
        let rows = self
            .timed("read offsets", query.fetch_all(&self.pool))
            .await?;
        let get = |e| map("read offsets", e);
        rows.iter()
            .map(|row| {
                Ok(StoredOffset {
                    topic: row.try_get("topic").map_err(get)?,
                    partition: row.try_get("kafka_partition").map_err(get)?,
                    next_offset: row.try_get("next_offset").map_err(get)?,
                })
            })
            .collect()
    }
}

/// A pass that ran every held handler: its open transaction, the outcome of each lease
/// (by its index in the claims) and what to settle.
struct Pass {
    tx: MySqlTransaction,
    outcomes: Vec<(usize, Outcome)>,
    settle: Vec<Settlement>,
}

impl MySqlBackend {
    /// Opens the batch's transaction, locks the records of `leases` and runs the held
    /// leases' handlers in order. With `savepoints`, each handler runs under its own
    /// savepoint and a failure rolls back to it; without, the first failure rolls the
    /// whole transaction back and answers `None`.
    async fn pass<H>(
        &self,
        claims: &[Claim],
        leases: &[(usize, Lease)],
        handler: &mut H,
        savepoints: bool,
    ) -> Result<Option<Pass>>
    where
        H: for<'t> FnMut(&'t mut MySqlTransaction, usize, Lease) -> TxFuture<'t> + Send,
    {
        let mut tx = self.timed("begin", self.pool.begin()).await?;
        let keys: Vec<_> = leases.iter().map(|(_, l)| &l.key).collect();
        let locked = self
            .timed("lock batch", self.lock(&mut tx, &keys))
            .await??;
        let mut pass = Pass {
            tx,
            outcomes: Vec::with_capacity(leases.len()),
            settle: Vec::with_capacity(leases.len()),
        };
        for (i, lease) in leases {
            let (i, lease) = (*i, lease.clone());
            if !machine::holds(locked.get(&lease.key), &lease, locked.now) {
                pass.outcomes.push((i, Outcome::Fenced));
                continue;
            }
            if savepoints {
                let set = sqlx::raw_sql("SAVEPOINT idem_item").execute(&mut *pass.tx);
                self.timed("savepoint", set).await?;
            }
            match self.run(handler(&mut pass.tx, i, lease.clone())).await {
                Ok(response) => {
                    pass.outcomes.push((i, Outcome::Executed(response.clone())));
                    pass.settle.push(Settlement::complete(lease, response));
                }
                Err(_) if !savepoints => {
                    self.timed("rollback", pass.tx.rollback()).await?;
                    return Ok(None);
                }
                Err(failure) => {
                    let back =
                        sqlx::raw_sql("ROLLBACK TO SAVEPOINT idem_item").execute(&mut *pass.tx);
                    self.timed("rollback", back).await?;
                    let outcome = Outcome::after_failure(
                        lease.attempts,
                        claims[i].max_attempts,
                        failure.kind(),
                        failure.message().to_owned(),
                    );
                    pass.outcomes.push((i, outcome));
                    pass.settle
                        .push(Settlement::fail(lease, failure.message(), failure.kind()));
                }
            }
        }
        Ok(Some(pass))
    }
}

/// The lease of an acquired claim, or the outcome of one that was not: a duplicate
/// (`Replayed`), `InProgress`, `Poisoned` or `Mismatch`.
fn acquired(answer: ClaimOutcome) -> Result<Lease, Outcome> {
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
