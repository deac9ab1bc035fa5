//! Transactional mode at assignment: newly assigned partitions start from the offsets the
//! store keeps, never from Kafka's; partitions whose offsets could not be read are held
//! back, paused, until the store answers.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use idem_core::binding::Backoff;

use crate::handle::{OFFSETS, PartitionState};
use crate::tx::TxStore;
use crate::worker::Ctx;

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
