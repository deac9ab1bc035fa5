//! Batch transactional mode: a poll batch's claims commit in one statement, then its
//! handlers, completes, failures and offset commit in one transaction: first with no
//! savepoints, and after a handler failure once more with a savepoint per handler.

use std::time::Duration;

use idem_core::backend::{Claim, OffsetPosition, Settlement, TxFuture};
use idem_core::{Error, HandlerError, Lease, Outcome, Result, Transactional};

use sqlx::AssertSqlSafe;

use crate::backend::{PLANNING, PgBackend, millis};
use crate::settle::{Fences, Round, positions};
use crate::transactional::{PgTransaction, acquired};

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
