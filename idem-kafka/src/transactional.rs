//! Transactional mode over PostgreSQL: the handler's writes, the `Completed` record and the
//! offset commit in one transaction; on assignment the consumer seeks to the offsets stored
//! there.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::{Claim, Lease, Outcome};
use idem_postgres::{OffsetPosition, PgBackend, PgTransaction};
use rdkafka::{Offset, TopicPartitionList};
use tracing::Instrument;

use crate::Message;
use crate::config::{HandlerResult, Mode};
use crate::consumer::Shared;
use crate::partition::{Flow, Item, Worker, probe_at};
use crate::probe::Point;
use crate::run::Backoff;

pub(crate) type DynTxHandler = Arc<
    dyn for<'t> Fn(Message, &'t mut PgTransaction, Lease) -> BoxFuture<'t, HandlerResult>
        + Send
        + Sync,
>;

/// The PostgreSQL backend and the transactional handler.
pub(crate) struct Transactional {
    pub backend: PgBackend,
    pub handler: DynTxHandler,
}

impl Worker {
    fn position(&self, msg: &Message) -> OffsetPosition {
        OffsetPosition {
            group: self.shared.settings.group.clone(),
            topic: msg.topic().to_owned(),
            partition: msg.partition(),
            offset: msg.offset(),
        }
    }

    /// One attempt: claim (committed on its own), then the handler, the record and the
    /// offset in one transaction. Dropping it (revoke timeout, crash) rolls back.
    pub(crate) async fn run_transaction(
        &mut self,
        tx: &Transactional,
        item: &Item,
        claim: &Claim,
    ) -> Result<idem_core::Result<Outcome>, Flow> {
        let offset = item.msg.offset();
        if self.probe(Point::BeforeClaim, offset) {
            return Err(Flow::Dead);
        }
        let at = self.position(&item.msg);
        let (shared, state) = (self.shared.clone(), self.state.clone());
        let (handler, msg) = (tx.handler.clone(), item.msg.clone());
        let run = tx
            .backend
            .execute_in_transaction(claim, claim.retention, Some(&at), move |t, lease| {
                async move {
                    if probe_at(&shared, &state, Point::AfterClaim, offset) {
                        std::future::pending::<()>().await;
                    }
                    let result = handler(msg, t, lease).await;
                    if probe_at(&shared, &state, Point::AfterEffect, offset) {
                        std::future::pending::<()>().await;
                    }
                    result
                }
                .boxed()
            })
            .instrument(item.span.clone());
        // Given up or crashed, the transaction is dropped: it rolls back.
        self.guarded(run, None).await
    }

    /// After a dead letter in transactional mode, the offset past it is stored in
    /// PostgreSQL too (retried while the store fails), so a seek on assignment skips it.
    pub(crate) async fn after_dead_letter(&mut self, item: &Item) -> Flow {
        let shared = self.shared.clone();
        let Mode::Transactional(tx) = &shared.settings.mode else {
            return Flow::Go;
        };
        let at = self.position(&item.msg);
        let mut backoff = Backoff::new(shared.settings.backoff);
        loop {
            match tx.backend.store_offset(&at).await {
                Ok(()) => return Flow::Go,
                Err(e) => self.store_error(&e),
            }
            if let Err(flow) = self.stall(backoff.next()).await {
                return flow;
            }
        }
    }
}

/// Sets the offsets of newly assigned partitions to those stored in PostgreSQL. Runs on
/// the poll thread in the rebalance callback. If PostgreSQL does not answer after a few
/// tries, the assignment keeps Kafka's committed offsets: they are never ahead of
/// PostgreSQL's (an offset is stored in Kafka only after its transaction committed), so
/// the worst case is a redelivery, answered by replay.
pub(crate) fn seek_to_stored(shared: &Shared, tpl: &mut TopicPartitionList) {
    let Mode::Transactional(tx) = &shared.settings.mode else {
        return;
    };
    let group = shared.settings.group.as_str();
    let mut stored = None;
    for attempt in 1..=3u32 {
        match shared.runtime.block_on(tx.backend.stored_offsets(group)) {
            Ok(offsets) => {
                stored = Some(offsets);
                break;
            }
            Err(e) => {
                tracing::warn!(attempt, error = %e, "reading offsets from PostgreSQL failed");
                std::thread::sleep(Duration::from_millis(200) * attempt);
            }
        }
    }
    let Some(stored) = stored else {
        tracing::error!("no offsets from PostgreSQL: starting from Kafka's committed offsets");
        return;
    };
    for s in stored {
        let assigned = tpl
            .elements()
            .iter()
            .any(|e| e.topic() == s.topic && e.partition() == s.partition);
        if assigned {
            if let Err(e) =
                tpl.set_partition_offset(&s.topic, s.partition, Offset::Offset(s.next_offset))
            {
                tracing::warn!(topic = %s.topic, partition = s.partition, error = %e, "seek");
            } else {
                tracing::debug!(topic = %s.topic, partition = s.partition, next = s.next_offset, "seek to the offset stored in PostgreSQL");
            }
        }
    }
}
