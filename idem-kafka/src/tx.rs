//! Transactional mode over any [`Transactional`] store: the store and the user's handler,
//! bound together behind one object-safe trait so the loop needs no store type.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::backend::{Claim, OffsetPosition, StoredOffset};
use idem_core::{Backend, Lease, Outcome, Transactional};

use crate::Message;
use crate::handle::{OFFSETS, PartitionState};
use crate::handler::HandlerResult;
use crate::worker::Ctx;
use idem_core::binding::Backoff;

/// Asked after the claim and after the handler, with the message's offset; `true` means
/// hang there (a crash probe).
pub(crate) type Hook = Arc<dyn Fn(crate::Point, i64) -> bool + Send + Sync>;

/// Picks the offset to store with a batch from its outcomes (see
/// [`Transactional::execute_batch_in_transaction`]).
pub(crate) type PickOffset = Box<dyn FnOnce(&[Outcome]) -> Option<OffsetPosition> + Send>;

/// A transactional store with its handler bound in.
#[async_trait]
pub(crate) trait TxStore: Send + Sync {
    /// The store as a plain backend, for the default engine.
    fn backend(&self) -> Arc<dyn Backend>;

    /// One message: claim, then the handler, the record and (if given) the offset in one
    /// transaction.
    async fn run(
        &self,
        claim: &Claim,
        retention: Duration,
        at: Option<&OffsetPosition>,
        msg: Message,
        hook: Hook,
    ) -> idem_core::Result<Outcome>;

    /// A run of keyed messages (`claims[i]` is `msgs[i]`'s) in one transaction: the claims
    /// commit first, then the handlers (a savepoint each only after a failure), then the records and the
    /// offset `pick` chooses, in one commit.
    async fn run_batch(
        &self,
        claims: &[Claim],
        retention: Duration,
        msgs: Vec<Message>,
        hook: Hook,
        pick: PickOffset,
    ) -> idem_core::Result<Vec<Outcome>>;

    /// Stores the offset past `at` on its own.
    async fn store_offset(&self, at: &OffsetPosition) -> idem_core::Result<()>;

    /// The offsets stored for `group`.
    async fn stored_offsets(&self, group: &str) -> idem_core::Result<Vec<StoredOffset>>;
}

/// A store and the handler the user gave for it.
pub(crate) struct Bound<S, H> {
    pub store: Arc<S>,
    pub handler: Arc<H>,
}

#[async_trait]
impl<S, H> TxStore for Bound<S, H>
where
    S: Transactional + 'static,
    H: for<'t> Fn(Message, &'t mut S::Tx, Lease) -> BoxFuture<'t, HandlerResult>
        + Send
        + Sync
        + 'static,
{
    fn backend(&self) -> Arc<dyn Backend> {
        self.store.clone()
    }

    async fn run(
        &self,
        claim: &Claim,
        retention: Duration,
        at: Option<&OffsetPosition>,
        msg: Message,
        hook: Hook,
    ) -> idem_core::Result<Outcome> {
        let handler = Arc::clone(&self.handler);
        self.store
            .execute_in_transaction(claim, retention, at, move |tx, lease| {
                probed(&*handler, msg, tx, lease, hook)
            })
            .await
    }

    async fn run_batch(
        &self,
        claims: &[Claim],
        retention: Duration,
        msgs: Vec<Message>,
        hook: Hook,
        pick: PickOffset,
    ) -> idem_core::Result<Vec<Outcome>> {
        let handler = &*self.handler;
        let msgs = &msgs;
        self.store
            .execute_batch_in_transaction(
                claims,
                retention,
                |tx, i, lease| probed(handler, msgs[i].clone(), tx, lease, Arc::clone(&hook)),
                pick,
            )
            .await
    }

    async fn store_offset(&self, at: &OffsetPosition) -> idem_core::Result<()> {
        self.store.store_offset(at).await
    }

    async fn stored_offsets(&self, group: &str) -> idem_core::Result<Vec<StoredOffset>> {
        self.store.stored_offsets(group).await
    }
}

/// The user's handler for `msg`, with the crash probe asked before and after it.
fn probed<'t, S, H>(
    handler: &H,
    msg: Message,
    tx: &'t mut S,
    lease: Lease,
    hook: Hook,
) -> BoxFuture<'t, HandlerResult>
where
    H: for<'a> Fn(Message, &'a mut S, Lease) -> BoxFuture<'a, HandlerResult>,
    S: Send,
{
    let offset = msg.offset();
    if hook(crate::Point::AfterClaim, offset) {
        return std::future::pending().boxed();
    }
    let run = idem_core::backend::panic_at_poll(|| handler(msg, tx, lease));
    async move {
        let result = run.await;
        if hook(crate::Point::AfterEffect, offset) {
            std::future::pending::<()>().await;
        }
        result
    }
    .boxed()
}

/// How long one read of the stored offsets may take in the rebalance callback.
const READ_WITHIN: Duration = Duration::from_secs(2);

/// Sets the offsets of newly assigned partitions to those `store` keeps for `group`; says
/// whether it could. Runs on the poll thread in the rebalance callback, so it tries three
/// times only, each bounded by [`READ_WITHIN`], with `backoff` between them. If the store
/// does not answer, the partitions must not start from Kafka's committed offsets (expired,
/// or absent and reset to the earliest, they would run effects again): the caller holds
/// them back, paused, and [`position_later`] starts them once the store answers.
pub(crate) fn seek_to_stored(
    store: &dyn TxStore,
    group: &str,
    mut backoff: Backoff,
    runtime: &tokio::runtime::Handle,
    tpl: &mut rdkafka::TopicPartitionList,
) -> bool {
    let mut stored = None;
    for attempt in 1..=3u32 {
        let read = runtime.block_on(async {
            tokio::time::timeout(READ_WITHIN, store.stored_offsets(group)).await
        });
        match read {
            Ok(Ok(offsets)) => {
                stored = Some(offsets);
                break;
            }
            Ok(Err(e)) => tracing::warn!(attempt, error = %e, "reading stored offsets failed"),
            Err(_) => {
                tracing::warn!(attempt, within = ?READ_WITHIN, "reading stored offsets timed out")
            }
        }
        if attempt < 3 {
            std::thread::sleep(backoff.wait());
        }
    }
    let Some(stored) = stored else {
        tracing::error!(
            partitions = tpl.count(),
            "no stored offsets: the assigned partitions stay paused until the store answers"
        );
        return false;
    };
    for s in stored {
        let assigned = tpl
            .elements()
            .iter()
            .any(|e| e.topic() == s.topic && e.partition() == s.partition);
        if !assigned {
            continue;
        }
        let next = rdkafka::Offset::Offset(s.next_offset);
        match tpl.set_partition_offset(&s.topic, s.partition, next) {
            Ok(()) => {
                tracing::debug!(topic = %s.topic, partition = s.partition, next = s.next_offset, "seek to the stored offset")
            }
            Err(e) => tracing::warn!(topic = %s.topic, partition = s.partition, error = %e, "seek"),
        }
    }
    true
}

/// Moves a partition to `next` in the client (a blocking seek); `Err` says why not.
pub(crate) type Seek = Arc<dyn Fn(&str, i32, i64) -> Result<(), String> + Send + Sync>;

/// Starts partitions held back at their assignment (paused, their workers waiting on
/// [`PartitionState::positioned`]) once `store` answers: reads the offsets it keeps for
/// `group`, retrying with `backoff` for as long as it fails, seeks each partition still
/// assigned to its stored offset (retrying a refused seek too), sets its floor, and lets
/// its worker go and its fetching resume. A partition the store has no offset for starts
/// where Kafka's committed offset put it, as at an assignment that read the store. A
/// partition revoked meanwhile is left alone; a crash ends it all.
pub(crate) async fn position_later(
    store: Arc<dyn TxStore>,
    group: String,
    mut backoff: Backoff,
    held: Vec<Arc<PartitionState>>,
    client: Arc<Ctx>,
    seek: Seek,
) {
    let mut gauges = Awaiting(
        held.iter()
            .map(|s| {
                let gauge = crate::metrics::awaiting_stored_offset(&s.topic, s.partition);
                gauge.increment(1.0);
                Some(gauge)
            })
            .collect(),
    );
    let given_up = || client.crash.happened() || held.iter().all(|s| s.stop.is_fired());
    let stored = loop {
        if given_up() {
            return;
        }
        match store.stored_offsets(&group).await {
            Ok(stored) => break stored,
            Err(e) => {
                tracing::warn!(error = %e, "reading stored offsets failed: partitions stay paused")
            }
        }
        tokio::select! {
            () = client.crash.happens() => return,
            () = tokio::time::sleep(backoff.wait()) => {}
        }
    };
    for (state, gauge) in held.iter().zip(&mut gauges.0) {
        let next = stored
            .iter()
            .find(|s| *s.topic == *state.topic && s.partition == state.partition)
            .map(|s| s.next_offset);
        if let Some(next) = next {
            loop {
                if state.stop.is_fired() || client.crash.happened() {
                    break;
                }
                let (seek, topic, partition) =
                    (Arc::clone(&seek), Arc::clone(&state.topic), state.partition);
                let sought =
                    tokio::task::spawn_blocking(move || seek(&topic, partition, next)).await;
                match sought {
                    Ok(Ok(())) => break,
                    Ok(Err(e)) => {
                        tracing::warn!(topic = %state.topic, partition = state.partition, error = %e, "seek to the stored offset failed: retrying")
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "seek to the stored offset failed: retrying")
                    }
                }
                tokio::time::sleep(backoff.wait()).await;
            }
            state.floor.store(next.saturating_sub(1), Ordering::SeqCst);
        }
        if state.stop.is_fired() || client.crash.happened() {
            continue;
        }
        tracing::info!(topic = %state.topic, partition = state.partition, next, "the store answered: partition starts from its stored offset");
        state.positioned.fire();
        state.set_pause(&client.client, OFFSETS, false);
        if let Some(gauge) = gauge.take() {
            gauge.decrement(1.0);
        }
    }
}

/// The awaiting-stored-offset gauges of held partitions, raised while they wait: lowered
/// as each starts, and however the wait ends.
struct Awaiting(Vec<Option<metrics::Gauge>>);

impl Drop for Awaiting {
    fn drop(&mut self) {
        self.0
            .iter_mut()
            .filter_map(Option::take)
            .for_each(|g| g.decrement(1.0));
    }
}
