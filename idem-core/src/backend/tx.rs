//! Transactional mode written once, over a few steps of a store's transaction: a store
//! whose handler writes share a transaction with its records (an SQL database) implements
//! [`TxStore`], its SQL only, and answers [`Transactional`]'s two calls with [`execute`]
//! and [`execute_batch`]:
//!
//! ```ignore
//! #[async_trait]
//! impl Transactional for MyStore {
//!     type Tx = MyTransaction;
//!
//!     async fn execute_in_transaction<F>(&self, claim: &Claim, retention: Duration,
//!         offset: Option<&OffsetPosition>, handler: F) -> Result<Outcome>
//!     where
//!         F: for<'t> FnOnce(&'t mut MyTransaction, Lease) -> TxFuture<'t> + Send,
//!     {
//!         tx::execute(self, claim, retention, offset, handler).await
//!     }
//!
//!     async fn execute_batch_in_transaction<H, O>(&self, claims: &[Claim],
//!         retention: Duration, handler: H, offset: O) -> Result<Vec<Outcome>>
//!     where
//!         H: for<'t> FnMut(&'t mut MyTransaction, usize, Lease) -> TxFuture<'t> + Send,
//!         O: FnOnce(&[Outcome]) -> Option<OffsetPosition> + Send,
//!     {
//!         tx::execute_batch(self, claims, retention, handler, offset).await
//!     }
//!
//!     // store_offset, stored_offsets: the store's own statements.
//! }
//! ```
//!
//! What is here decides the outcomes, the attempts, the fencing and what is settled; the
//! store's steps only run statements and say what they found. The claims commit on their
//! own first (so an attempt counts even if what follows rolls back); a handler's response
//! is kept byte for byte, over [`Capabilities::max_response_bytes`](super::Capabilities)
//! a permanent failure, and a panic a failure.

use std::panic::AssertUnwindSafe;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::FutureExt;

use super::{Claim, ClaimOutcome, OffsetPosition, Settlement, TxFuture, handler_response};
use crate::{Error, HandlerError, Lease, Outcome, Result, Transactional};

/// Where the careful pass of [`execute_batch`] stands when it asks for a handler's
/// savepoint ([`TxStore::savepoint`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Savepoint {
    /// No handler of this pass has run yet ([`TxStore::begin_locked`] was told that the
    /// pass uses savepoints, and may have set the first one already).
    First,
    /// The previous handler succeeded: its writes are under the savepoint set before it.
    AfterSuccess,
    /// The previous handler failed and the transaction was rolled back to its savepoint
    /// ([`TxStore::rollback_to_savepoint`]), which SQL keeps.
    AfterRollback,
}

/// The steps of a store's transaction that [`execute`] and [`execute_batch`] drive. Each
/// step is one or a few statements of the store, bounded by its own timeout; none decides
/// an outcome. Every step that gets a transaction by value ends it.
#[async_trait]
pub trait TxStore: Transactional {
    /// Claims `claims` for transactional mode, as
    /// [`Backend::claim_many`](crate::Backend::claim_many) does (which the default calls):
    /// the claims commit on their own, before any handler runs. A store may claim
    /// differently here (PostgreSQL commits these asynchronously).
    async fn claim_for_tx(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        self.claim_many(claims).await
    }

    /// Opens the transaction one message's handler writes through.
    async fn begin(&self) -> Result<Self::Tx>;

    /// Opens a batch's transaction and locks the records of `leases` (distinct keys) until
    /// it ends, answering whether each lease still holds its record, in order: a held
    /// lease cannot be taken over until the transaction ends, one not held is `Fenced`.
    /// With `savepoints`, the handlers will each run under a savepoint
    /// ([`TxStore::savepoint`]).
    async fn begin_locked(
        &self,
        leases: &[Lease],
        savepoints: bool,
    ) -> Result<(Self::Tx, Vec<bool>)>;

    /// Sets the savepoint the next handler runs under, in the careful pass; `at` says
    /// what came before it (a store whose savepoint survives may skip setting it again).
    async fn savepoint(&self, tx: &mut Self::Tx, at: Savepoint) -> Result<()>;

    /// Rolls `tx` back to the last savepoint, keeping the savepoint.
    async fn rollback_to_savepoint(&self, tx: &mut Self::Tx) -> Result<()>;

    /// Inside `tx`: settles `items` (distinct keys) as
    /// [`Backend::settle_many`](crate::Backend::settle_many) would, each fenced by its
    /// lease's token under a lock held until `tx` ends, and stores `at` (its `offset + 1`
    /// as the group's next offset) if given. How many items were not fenced.
    async fn settle_in(
        &self,
        tx: &mut Self::Tx,
        items: &[Settlement],
        retention: Duration,
        at: Option<&OffsetPosition>,
    ) -> Result<usize>;

    /// Inside `tx`: completes `lease` with `response` and stores `at` if given, as
    /// [`TxStore::settle_in`] of one complete does (the default); whether the lease still
    /// held the record (if not, `tx` is rolled back and nothing it wrote counts).
    async fn complete_in(
        &self,
        tx: &mut Self::Tx,
        lease: &Lease,
        response: &Bytes,
        retention: Duration,
        at: Option<&OffsetPosition>,
    ) -> Result<bool> {
        let item = Settlement::complete(lease.clone(), response.clone());
        let settled = self
            .settle_in(tx, std::slice::from_ref(&item), retention, at)
            .await?;
        Ok(settled == 1)
    }

    /// Commits `tx`.
    async fn commit(&self, tx: Self::Tx) -> Result<()>;

    /// Rolls `tx` back.
    async fn rollback(&self, tx: Self::Tx) -> Result<()>;
}

/// [`Transactional::execute_in_transaction`] over a [`TxStore`]'s steps:
///
/// 1. [`TxStore::claim_for_tx`] of `claim`. A key that is not claimable answers at once
///    (`Replayed`, then storing `offset` if given; `InProgress`, `Poisoned`, `Mismatch`).
/// 2. [`TxStore::begin`]; `handler` gets the transaction and the lease.
/// 3. On success, [`TxStore::complete_in`] with `offset`, then COMMIT: `Executed`, or
///    `Fenced` (rolled back) if the lease no longer held the record.
/// 4. On a handler error or panic: ROLLBACK, then
///    [`Backend::fail`](crate::Backend::fail) records the attempt (`Failed`, or
///    `Poisoned` when permanent or out of attempts; `Fenced` if the lease was lost).
pub async fn execute<S, F>(
    store: &S,
    claim: &Claim,
    retention: Duration,
    offset: Option<&OffsetPosition>,
    handler: F,
) -> Result<Outcome>
where
    S: TxStore + ?Sized,
    F: for<'t> FnOnce(&'t mut S::Tx, Lease) -> TxFuture<'t> + Send,
{
    let mut answers = store
        .claim_for_tx(std::slice::from_ref(claim))
        .await?
        .into_iter();
    let answer = match (answers.next(), answers.next()) {
        (Some(answer), None) => answer,
        _ => return Err(Error::corrupt("a claim of one did not answer once")),
    };
    let lease = match acquired(answer) {
        Ok(lease) => lease,
        Err(replay @ Outcome::Replayed(_)) => {
            if let Some(at) = offset {
                store.store_offset(at).await?;
            }
            return Ok(replay);
        }
        Err(outcome) => return Ok(outcome),
    };
    let limit = store.capabilities().max_response_bytes;
    let mut tx = store.begin().await?;
    let failure = match run(handler(&mut tx, lease.clone()), limit).await {
        Ok(response) => {
            if !store
                .complete_in(&mut tx, &lease, &response, retention, offset)
                .await?
            {
                store.rollback(tx).await?;
                return Ok(Outcome::Fenced);
            }
            store.commit(tx).await?;
            return Ok(Outcome::Executed(response));
        }
        Err(failure) => failure,
    };
    store.rollback(tx).await?;
    let kind = failure.kind();
    match store.fail(&lease, failure.message(), kind, retention).await {
        Ok(()) => {}
        Err(Error::Fenced { .. }) => return Ok(Outcome::Fenced),
        Err(e) => return Err(e),
    }
    Ok(failed(&failure, &lease, claim))
}

/// [`Transactional::execute_batch_in_transaction`] over a [`TxStore`]'s steps:
///
/// 1. [`TxStore::claim_for_tx`] of every claim; the ones not acquired answer at once. If
///    none is, the offset `offset` chose is stored on its own.
/// 2. The optimistic pass: [`TxStore::begin_locked`] of the acquired leases, then each
///    held lease's handler in order, with no savepoints (one round trip less per message).
///    The first handler that fails rolls the whole transaction back, and the careful pass
///    runs the batch again in a new one, each handler under a savepoint
///    ([`TxStore::savepoint`]), a failure rolling back to it
///    ([`TxStore::rollback_to_savepoint`]). A lease not held is `Fenced`, its handler not
///    run.
/// 3. `offset` gets every outcome; [`TxStore::settle_in`] completes the successes, fails
///    the failures and stores the position it chose; then COMMIT. A settle that finds a
///    locked lease fenced is [`Error::Corrupt`], and rolls back.
pub async fn execute_batch<S, H, O>(
    store: &S,
    claims: &[Claim],
    retention: Duration,
    mut handler: H,
    offset: O,
) -> Result<Vec<Outcome>>
where
    S: TxStore + ?Sized,
    H: for<'t> FnMut(&'t mut S::Tx, usize, Lease) -> TxFuture<'t> + Send,
    O: FnOnce(&[Outcome]) -> Option<OffsetPosition> + Send,
{
    let answers = store.claim_for_tx(claims).await?;
    let mut outcomes: Vec<Option<Outcome>> = Vec::with_capacity(claims.len());
    let mut indices: Vec<usize> = Vec::new();
    let mut leases: Vec<Lease> = Vec::new();
    for (i, answer) in answers.into_iter().enumerate() {
        match acquired(answer) {
            Ok(lease) => {
                indices.push(i);
                leases.push(lease);
                outcomes.push(None);
            }
            Err(outcome) => outcomes.push(Some(outcome)),
        }
    }
    if leases.is_empty() {
        let outcomes: Vec<Outcome> = outcomes.into_iter().flatten().collect();
        if let Some(at) = offset(&outcomes) {
            store.store_offset(&at).await?;
        }
        return Ok(outcomes);
    }
    let batch = Batch {
        claims,
        indices: &indices,
        leases: &leases,
        limit: store.capabilities().max_response_bytes,
    };
    let mut pass = match batch.pass(store, &mut handler, false).await? {
        Some(pass) => pass,
        None => batch
            .pass(store, &mut handler, true)
            .await?
            .ok_or_else(|| Error::corrupt("the careful pass gave up"))?,
    };
    for (i, outcome) in pass.outcomes.drain(..) {
        outcomes[i] = Some(outcome);
    }
    let outcomes: Vec<Outcome> = outcomes.into_iter().flatten().collect();
    let at = offset(&outcomes);
    let settled = store
        .settle_in(&mut pass.tx, &pass.settle, retention, at.as_ref())
        .await?;
    if settled != pass.settle.len() {
        store.rollback(pass.tx).await?;
        return Err(Error::corrupt(format!(
            "a locked batch settled {settled} of {} leases",
            pass.settle.len()
        )));
    }
    store.commit(pass.tx).await?;
    Ok(outcomes)
}

/// The acquired part of a batch: each lease with its claim's index.
struct Batch<'a> {
    claims: &'a [Claim],
    indices: &'a [usize],
    leases: &'a [Lease],
    limit: usize,
}

/// A pass that ran every held handler: its open transaction, the outcome of each lease
/// (by its index in the claims) and what to settle.
struct Pass<Tx> {
    tx: Tx,
    outcomes: Vec<(usize, Outcome)>,
    settle: Vec<Settlement>,
}

impl Batch<'_> {
    /// Opens the batch's transaction, locks the records of the leases and runs the held
    /// leases' handlers in order. With `savepoints`, each handler runs under its own
    /// savepoint and a failure rolls back to it; without, the first failure rolls the
    /// whole transaction back and answers `None`.
    async fn pass<S, H>(
        &self,
        store: &S,
        handler: &mut H,
        savepoints: bool,
    ) -> Result<Option<Pass<S::Tx>>>
    where
        S: TxStore + ?Sized,
        H: for<'t> FnMut(&'t mut S::Tx, usize, Lease) -> TxFuture<'t> + Send,
    {
        let (tx, held) = store.begin_locked(self.leases, savepoints).await?;
        if held.len() != self.leases.len() {
            store.rollback(tx).await?;
            return Err(Error::corrupt(format!(
                "a lock of {} leases answered {}",
                self.leases.len(),
                held.len()
            )));
        }
        let mut pass = Pass {
            tx,
            outcomes: Vec::with_capacity(self.leases.len()),
            settle: Vec::with_capacity(self.leases.len()),
        };
        let mut at = Savepoint::First;
        for ((&i, lease), held) in self.indices.iter().zip(self.leases).zip(held) {
            let lease = lease.clone();
            if !held {
                pass.outcomes.push((i, Outcome::Fenced));
                continue;
            }
            if savepoints {
                store.savepoint(&mut pass.tx, at).await?;
            }
            match run(handler(&mut pass.tx, i, lease.clone()), self.limit).await {
                Ok(response) => {
                    pass.outcomes.push((i, Outcome::Executed(response.clone())));
                    pass.settle.push(Settlement::complete(lease, response));
                    at = Savepoint::AfterSuccess;
                }
                Err(_) if !savepoints => {
                    store.rollback(pass.tx).await?;
                    return Ok(None);
                }
                Err(failure) => {
                    store.rollback_to_savepoint(&mut pass.tx).await?;
                    pass.outcomes
                        .push((i, failed(&failure, &lease, &self.claims[i])));
                    pass.settle
                        .push(Settlement::fail(lease, failure.message(), failure.kind()));
                    at = Savepoint::AfterRollback;
                }
            }
        }
        Ok(Some(pass))
    }
}

/// Awaits a handler: its response, or its failure (an error, a panic, or a response over
/// `limit` bytes, which is permanent).
async fn run(handler: TxFuture<'_>, limit: usize) -> Result<Bytes, HandlerError> {
    match AssertUnwindSafe(handler).catch_unwind().await {
        Ok(Ok(response)) => handler_response(response, limit),
        Ok(Err(e)) => Err(e),
        Err(panic) => Err(HandlerError::panicked(panic.as_ref())),
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

/// The outcome of a handler that failed, once its failure is recorded.
fn failed(failure: &HandlerError, lease: &Lease, claim: &Claim) -> Outcome {
    Outcome::after_failure(
        lease.attempts,
        claim.max_attempts,
        failure.kind(),
        failure.message().to_owned(),
    )
}
