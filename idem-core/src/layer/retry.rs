//! Retries of calls that answered `Unavailable`.

use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use super::Layer;
use crate::backend::{
    Capabilities, Claim, ClaimOutcome, ListFilter, Listing, OffsetPosition, Settle, Settlement,
    StoredOffset, TxFuture, watch::Watch,
};
use crate::{
    Backend, Error, FailureKind, Key, Lease, Outcome, Record, Result, State, Timestamp,
    Transactional,
};

/// Retries a call that answered [`Error::Unavailable`], and only that: every other answer
/// (`Fenced`, `Corrupt`, `TooLarge`, …) is final. Tries are spaced by exponential backoff
/// with full jitter: a random wait up to `first_backoff`, doubling per try, capped at
/// `max_backoff`.
///
/// A call that answered `Unavailable` may still have been applied (a lost reply, a
/// timeout), so a retry can meet its own write. Each operation is made safe for that:
///
/// - `complete`, `fail`, `release` and each item of `settle_many`: a retry that answers
///   `Fenced` reads the record; if it still carries the lease's token, in the state the
///   write leaves (`Completed`, `Failed`, or for a release `Processing` with the lease
///   ended), the earlier try was applied and the answer is `Ok`. (A release whose lease had
///   also run out by itself is answered `Ok` too: the lease is over either way.)
/// - `claim` and `claim_many`: a retry after an applied claim finds the key held by its
///   own owner and answers `InProgress`, as the next claim after a timed-out claim does
///   without the layer; the lease lapses and the key is taken over then. A claim is never
///   turned into a lease the caller did not get an answer for.
/// - `extend` extends again from the store's now; `get`, `list` and `purge_expired` read
///   or purge again; `delete` may answer `false` when its earlier try deleted the record.
#[derive(Clone, Copy, Debug)]
pub struct RetryLayer {
    tries: u32,
    first_backoff: Duration,
    max_backoff: Duration,
}

impl Default for RetryLayer {
    fn default() -> Self {
        RetryLayer {
            tries: 3,
            first_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_secs(1),
        }
    }
}

impl RetryLayer {
    /// Three tries, backoff from 20 ms up to 1 s.
    pub fn new() -> Self {
        RetryLayer::default()
    }

    /// Tries per call, the first included (at least 1).
    pub fn with_tries(mut self, tries: u32) -> Self {
        self.tries = tries.max(1);
        self
    }

    /// The most the first backoff waits.
    pub fn with_first_backoff(mut self, backoff: Duration) -> Self {
        self.first_backoff = backoff;
        self
    }

    /// The most any backoff waits.
    pub fn with_max_backoff(mut self, backoff: Duration) -> Self {
        self.max_backoff = backoff;
        self
    }

    fn backoff(&self, retry: u32) -> Duration {
        let cap = self
            .first_backoff
            .saturating_mul(1u32 << retry.min(16))
            .min(self.max_backoff);
        let nanos = u64::try_from(cap.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(fastrand::u64(0..=nanos))
    }
}

impl<B: Backend> Layer<B> for RetryLayer {
    type Backend = Retry<B>;
    fn layer(&self, inner: B) -> Retry<B> {
        Retry {
            inner,
            policy: *self,
        }
    }
}

/// A backend whose calls are retried by [`RetryLayer`]'s rules.
#[derive(Clone, Debug)]
pub struct Retry<B> {
    inner: B,
    policy: RetryLayer,
}

impl<B> Retry<B> {
    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }
}

/// How a call ended: its answer, and whether an earlier try had answered `Unavailable`.
struct Tried<T> {
    answer: Result<T>,
    retried: bool,
}

impl<B: Backend> Retry<B> {
    async fn tries<T, F: Future<Output = Result<T>>>(
        &self,
        mut call: impl FnMut() -> F,
    ) -> Tried<T> {
        let mut retried = false;
        let mut retry = 0;
        loop {
            match call().await {
                Err(Error::Unavailable { .. }) if retry + 1 < self.policy.tries => {
                    tokio::time::sleep(self.policy.backoff(retry)).await;
                    retry += 1;
                    retried = true;
                }
                answer => return Tried { answer, retried },
            }
        }
    }

    async fn retried<T, F: Future<Output = Result<T>>>(
        &self,
        call: impl FnMut() -> F,
    ) -> Result<T> {
        self.tries(call).await.answer
    }

    /// Whether `settle` of `lease` is what the record now shows: the earlier try applied it.
    async fn landed(&self, lease: &Lease, settle: &Settle) -> Result<bool> {
        let Some(record) = self.retried(|| self.inner.get(&lease.key)).await? else {
            return Ok(false);
        };
        if record.token != lease.token || record.owner != lease.owner {
            return Ok(false);
        }
        Ok(match settle {
            Settle::Complete(_) => record.state == State::Completed,
            Settle::Fail { .. } => record.state == State::Failed,
            Settle::Release => record.state == State::Processing,
        })
    }

    /// One settle, with a `Fenced` after a retry checked against the record.
    async fn settle_one(&self, lease: &Lease, settle: Settle, retention: Duration) -> Result<()> {
        let tried = self
            .tries(|| async {
                match &settle {
                    Settle::Complete(response) => {
                        self.inner
                            .complete(lease, response.clone(), retention)
                            .await
                    }
                    Settle::Fail { error, kind } => {
                        self.inner.fail(lease, error, *kind, retention).await
                    }
                    Settle::Release => self.inner.release(lease).await,
                }
            })
            .await;
        match tried.answer {
            Err(Error::Fenced { .. }) if tried.retried && self.landed(lease, &settle).await? => {
                Ok(())
            }
            answer => answer,
        }
    }
}

#[async_trait]
impl<B: Backend> Backend for Retry<B> {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome> {
        self.retried(|| self.inner.claim(claim)).await
    }
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        self.retried(|| self.inner.claim_many(claims)).await
    }
    async fn complete(&self, lease: &Lease, response: Bytes, retention: Duration) -> Result<()> {
        self.settle_one(lease, Settle::Complete(response), retention)
            .await
    }
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        let settle = Settle::Fail {
            error: error.to_owned(),
            kind,
        };
        self.settle_one(lease, settle, retention).await
    }
    async fn release(&self, lease: &Lease) -> Result<()> {
        self.settle_one(lease, Settle::Release, Duration::ZERO)
            .await
    }
    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let tried = self
            .tries(|| self.inner.settle_many(items, retention))
            .await;
        let mut answers = tried.answer?;
        if tried.retried {
            for (answer, item) in answers.iter_mut().zip(items) {
                if matches!(answer, Err(Error::Fenced { .. }))
                    && self.landed(&item.lease, &item.settle).await?
                {
                    *answer = Ok(());
                }
            }
        }
        Ok(answers)
    }
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        self.retried(|| self.inner.extend(lease, ttl)).await
    }
    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        self.retried(|| self.inner.get(key)).await
    }
    async fn delete(&self, key: &Key) -> Result<bool> {
        self.retried(|| self.inner.delete(key)).await
    }
    async fn purge_expired(&self) -> Result<u64> {
        self.retried(|| self.inner.purge_expired()).await
    }
    async fn list(&self, filter: &ListFilter) -> Result<Listing> {
        self.retried(|| self.inner.list(filter)).await
    }
    async fn watch(&self, key: &Key) -> Watch {
        self.inner.watch(key).await
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

/// Transactional mode through the retry layer: a transaction is not retried (its claims
/// committed on their own, so a second run would find its own lease and answer
/// `InProgress`; the caller retries the message after the lease, as without the layer).
/// Storing and reading offsets are retried: storing the same next offset again is what
/// the first try did.
#[async_trait]
impl<B: Transactional> Transactional for Retry<B> {
    type Tx = B::Tx;

    async fn execute_in_transaction<F>(
        &self,
        claim: &Claim,
        retention: Duration,
        offset: Option<&OffsetPosition>,
        handler: F,
    ) -> Result<Outcome>
    where
        F: for<'t> FnOnce(&'t mut Self::Tx, Lease) -> TxFuture<'t> + Send,
    {
        self.inner
            .execute_in_transaction(claim, retention, offset, handler)
            .await
    }

    async fn execute_batch_in_transaction<F, O>(
        &self,
        claims: &[Claim],
        retention: Duration,
        handler: F,
        offset: O,
    ) -> Result<Vec<Outcome>>
    where
        F: for<'t> FnMut(&'t mut Self::Tx, usize, Lease) -> TxFuture<'t> + Send,
        O: FnOnce(&[Outcome]) -> Option<OffsetPosition> + Send,
    {
        self.inner
            .execute_batch_in_transaction(claims, retention, handler, offset)
            .await
    }

    async fn store_offset(&self, at: &OffsetPosition) -> Result<()> {
        self.retried(|| self.inner.store_offset(at)).await
    }

    async fn stored_offsets(&self, group: &str) -> Result<Vec<StoredOffset>> {
        self.retried(|| self.inner.stored_offsets(group)).await
    }
}
