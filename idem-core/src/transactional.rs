//! Transactional mode: a store whose idempotency records commit in one transaction with the
//! handler's own writes and the consumer's offset, so a side effect in that store happens
//! exactly once. The Kafka loop drives any store that implements [`Transactional`].

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::future::BoxFuture;

use crate::backend::Claim;
use crate::{Backend, HandlerError, Lease, Outcome, Result};

/// What a transactional handler's future resolves to.
pub type TxFuture<'t> = BoxFuture<'t, Result<Bytes, HandlerError>>;

/// A Kafka message's position; transactional mode stores `offset + 1` as the group's next
/// offset for the partition, in the same transaction as the record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffsetPosition {
    /// The consumer group.
    pub group: String,
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The message's offset.
    pub offset: i64,
}

impl OffsetPosition {
    /// The position of the message before `next`: storing it makes `next.next_offset` the
    /// group's next offset for the partition.
    pub fn before(group: &str, next: &StoredOffset) -> Self {
        OffsetPosition {
            group: group.to_owned(),
            topic: next.topic.clone(),
            partition: next.partition,
            offset: next.next_offset.saturating_sub(1),
        }
    }
}

/// A stored next offset, for seeking on partition assignment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredOffset {
    /// The topic.
    pub topic: String,
    /// The partition.
    pub partition: i32,
    /// The next offset to read.
    pub next_offset: i64,
}

/// The consumer offsets a transactional store keeps, read and moved by an operator
/// (`idem offsets show|reset`). Object safe, unlike [`Transactional`]; a store's driver
/// hands it out through [`Store::offsets`](crate::backend::driver::Store::offsets).
///
/// A consumer reads its group's stored offsets when it is assigned partitions, and writes
/// them as it settles: move them only while the group's consumers are stopped.
#[async_trait]
pub trait Offsets: Send + Sync {
    /// The next offsets stored for `group`, by topic and partition.
    async fn offsets(&self, group: &str) -> Result<Vec<StoredOffset>>;

    /// Makes `to.next_offset` the group's next offset for `to`'s partition, replacing what
    /// is stored (forward or back).
    async fn set_offset(&self, group: &str, to: &StoredOffset) -> Result<()>;

    /// Removes the group's stored offsets of `topic` (every topic when `None`) and
    /// `partition` (every partition when `None`), so a consumer starts those partitions
    /// from the offsets committed to Kafka; returns how many were removed.
    async fn delete_offsets(
        &self,
        group: &str,
        topic: Option<&str>,
        partition: Option<i32>,
    ) -> Result<u64>;
}

/// A [`Backend`] whose records commit with the handler's writes and the consumer's offset
/// in one transaction of the store.
#[async_trait]
pub trait Transactional: Backend {
    /// The open transaction a handler writes through.
    type Tx: Send;

    /// Runs `handler` exactly once for `claim.key` as far as the store is concerned: the
    /// claim commits on its own first (so the attempt counts even if what follows rolls
    /// back); then, in one transaction, the handler's writes, the `Completed` record
    /// (fenced by the lease's token) and, if `offset` is given, the group's next offset.
    /// A handler error or panic rolls back and records the failure; dropping the future
    /// rolls back. A replayed duplicate with `offset` given stores that offset too.
    async fn execute_in_transaction<F>(
        &self,
        claim: &Claim,
        retention: Duration,
        offset: Option<&OffsetPosition>,
        handler: F,
    ) -> Result<Outcome>
    where
        F: for<'t> FnOnce(&'t mut Self::Tx, Lease) -> TxFuture<'t> + Send;

    /// Runs a batch (a Kafka poll batch of one partition) in one transaction of the store,
    /// each handler exactly once as far as the store is concerned:
    ///
    /// 1. Every claim of the batch commits first, on its own, in one store call (so
    ///    attempts count even if what follows rolls back, and a crash loop stays bounded).
    ///    Claims that are not acquired answer at once: `Replayed`, `InProgress` (a later
    ///    occurrence of a key repeated in the batch gets this: the earlier one holds it),
    ///    `Poisoned`, `Mismatch`.
    /// 2. One transaction opens. `handler(tx, i, lease)` runs for each acquired claim `i`
    ///    (its index in `claims`), in order, each in a scope of its own: a handler error or
    ///    panic rolls back only that handler's writes and records its failure (`Failed`,
    ///    or `Poisoned` when permanent or out of attempts). A store may get there by
    ///    running the batch again in a new transaction after a failure, so `handler` may
    ///    run more than once for an item within one call; only the writes of the run that
    ///    commits count, so a handler must write only through the transaction. A claim
    ///    whose lease is no longer held when the transaction starts is `Fenced` and its
    ///    handler does not run; one held then cannot be taken over until the transaction
    ///    ends, so the writes of a fenced message never commit.
    /// 3. `offset` gets every item's outcome, in the order of `claims`, before anything
    ///    settles, and returns the position to store (its `offset + 1` becomes the group's
    ///    next offset) or `None` to store none. Only a settled prefix of the partition may
    ///    be committed: `Executed` and `Replayed` are settled; `InProgress`, `Failed`,
    ///    `Poisoned`, `Mismatch` and `Fenced` are not until the caller dead-letters or
    ///    retries them, so the closure returns the position of the last message of the
    ///    longest settled prefix.
    /// 4. One store call completes every `Executed` item, records every failure and stores
    ///    that offset; then the transaction commits, and the outcomes are returned.
    ///
    /// A store error fails the whole call, and nothing of the transaction commits (the
    /// claims did: their keys stay `Processing` until their leases lapse). Dropping the
    /// future rolls back the same way; the batch redone after the leases lapse runs each
    /// handler again, and each effect still lands once.
    ///
    /// The default runs [`Transactional::execute_in_transaction`] per claim (one
    /// transaction each), then stores the offset on its own.
    async fn execute_batch_in_transaction<H, O>(
        &self,
        claims: &[Claim],
        retention: Duration,
        mut handler: H,
        offset: O,
    ) -> Result<Vec<Outcome>>
    where
        H: for<'t> FnMut(&'t mut Self::Tx, usize, Lease) -> TxFuture<'t> + Send,
        O: FnOnce(&[Outcome]) -> Option<OffsetPosition> + Send,
    {
        let mut outcomes = Vec::with_capacity(claims.len());
        for (i, claim) in claims.iter().enumerate() {
            let one = item_handler(&mut handler, i);
            outcomes.push(
                self.execute_in_transaction(claim, retention, None, one)
                    .await?,
            );
        }
        if let Some(at) = offset(&outcomes) {
            self.store_offset(&at).await?;
        }
        Ok(outcomes)
    }

    /// Stores `offset + 1` as the group's next offset for the partition, on its own (after
    /// a dead letter, which is settled without a transaction).
    async fn store_offset(&self, at: &OffsetPosition) -> Result<()>;

    /// The next offsets stored for `group`: where a consumer seeks on assignment.
    async fn stored_offsets(&self, group: &str) -> Result<Vec<StoredOffset>>;
}

/// The handler of item `i` of a batch, as a single message's handler.
fn item_handler<Tx, H>(
    handler: &mut H,
    i: usize,
) -> impl for<'t> FnOnce(&'t mut Tx, Lease) -> TxFuture<'t> + Send + '_
where
    H: for<'t> FnMut(&'t mut Tx, usize, Lease) -> TxFuture<'t> + Send,
{
    move |tx, lease| handler(tx, i, lease)
}
