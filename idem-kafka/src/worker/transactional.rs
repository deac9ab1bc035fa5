//! Transactional mode: each run of keyed messages in one transaction of the store, with
//! the offset past its settled prefix.

use std::sync::Arc;

use idem_core::Outcome;
use idem_core::backend::{Claim, OffsetPosition};

use super::{Failing, Flow, Item, Kind, Worker};
use crate::probe::Point;
use crate::settings::Mode;

impl Worker {
    /// Each run of keyed messages in one transaction of the store (claims first, then the
    /// handlers (a savepoint each only after a failure), then the records and the offset
    /// past the run's settled prefix in one commit); a message the batch left unsettled
    /// (failed, fenced, busy, poisoned) is then resolved on its own, in order, and keyless
    /// messages one by one. A store error fails the whole transaction: its messages are then
    /// resolved one by one (their claims committed, so each waits for its lease to lapse).
    pub(super) async fn process_transactional(&self, chunk: &[Item]) -> Flow {
        let Mode::Transactional(tx) = &self.settings().mode else {
            return Flow::Stop;
        };
        let mut start = 0;
        while start < chunk.len() {
            // The run's keys are marked running for its transaction; a key running here
            // already (in another partition's handler, or earlier in this run) ends the run,
            // and is resolved on its own after it.
            let mut runs = Vec::new();
            let keyed = chunk[start..]
                .iter()
                .take_while(|item| match (&item.kind, item.msg.idempotency_key()) {
                    (Kind::Keyed(..), Some(key)) => {
                        self.ctx.running.start(key).map(|r| runs.push(r)).is_some()
                    }
                    _ => false,
                })
                .count();
            if keyed == 0 {
                let flow = self.one_by_one(&chunk[start..=start]).await;
                if flow != Flow::Go {
                    return flow;
                }
                start += 1;
                continue;
            }
            let run = &chunk[start..start + keyed];
            start += keyed;
            if let Some(flow) = self.interrupted() {
                return flow;
            }
            if self.probe(Point::BeforeClaim, run[0].msg.offset()) {
                return Flow::Crashed;
            }
            let claims: Vec<Claim> = run.iter().filter_map(|i| self.claim_of(i)).collect();
            let positions: Vec<OffsetPosition> =
                run.iter().map(|item| self.position(&item.msg)).collect();
            let pick: crate::tx::PickOffset = Box::new(move |outcomes| {
                let prefix = outcomes.iter().take_while(|o| settled_by(o)).count();
                prefix.checked_sub(1).map(|last| positions[last].clone())
            });
            let msgs = run.iter().map(|item| item.msg.clone()).collect();
            let permit = match self.handler_permit().await {
                Ok(permit) => permit,
                Err(flow) => return flow,
            };
            let batch = tx.run_batch(&claims, self.engine.retention(), msgs, self.tx_hook(), pick);
            // Given up or crashed, the transaction is dropped: it rolls back.
            let outcomes = match self.guarded(batch).await {
                Err(flow) => return flow,
                Ok(Ok(outcomes)) if outcomes.len() == run.len() => {
                    outcomes.into_iter().map(Some).collect()
                }
                Ok(Ok(_)) => {
                    self.store_error(&idem_core::Error::corrupt("a batch answered a wrong count"));
                    vec![None; run.len()]
                }
                Ok(Err(e)) => {
                    self.store_error(&e);
                    vec![None; run.len()]
                }
            };
            drop((permit, runs));
            // Settled in the batch but after a message it left unsettled: its offset was
            // not stored with it, so it is stored on its own once that one is resolved.
            let prefix = outcomes.iter().take_while(|o| settled(o)).count();
            let store_last = prefix < run.len() && outcomes.last().is_some_and(settled);
            for (item, outcome) in run.iter().zip(outcomes) {
                let flow = self.resolve(item, outcome.map(Ok)).await;
                if flow != Flow::Go {
                    return flow;
                }
                if self.mark_settled(std::slice::from_ref(item), 0..=0) {
                    return Flow::Crashed;
                }
            }
            if store_last {
                let flow = self.store_offset_in_tx(&run[run.len() - 1]).await;
                if flow != Flow::Go {
                    return flow;
                }
            }
        }
        Flow::Go
    }

    /// One message at a time, each in a transaction of its own.
    async fn one_by_one(&self, chunk: &[Item]) -> Flow {
        for item in chunk {
            if let Some(flow) = self.interrupted() {
                return flow;
            }
            let flow = match &item.kind {
                Kind::Keyed(..) => self.resolve(item, None).await,
                Kind::Unkeyed | Kind::DeadLetter(..) => self.resolve_keyless(item).await,
            };
            if flow != Flow::Go {
                return flow;
            }
            if self.mark_settled(std::slice::from_ref(item), 0..=0) {
                return Flow::Crashed;
            }
        }
        Flow::Go
    }

    /// The crash probe for a transaction's handlers.
    pub(super) fn tx_hook(&self) -> crate::tx::Hook {
        let (ctx, state) = (Arc::clone(&self.ctx), Arc::clone(&self.state));
        Arc::new(move |point, offset| ctx.crash.at(point, &state.topic, state.partition, offset))
    }

    /// Transactional mode: stores the offset past `item` in the store on its own, retrying
    /// while the store fails (the offset in the client follows from
    /// [`Worker::store_offset`]). Lease mode keeps offsets in Kafka only: nothing to do.
    pub(super) async fn store_offset_in_tx(&self, item: &Item) -> Flow {
        let Mode::Transactional(tx) = &self.settings().mode else {
            return Flow::Go;
        };
        let at = self.position(&item.msg);
        match self.retry(Failing::Store, || tx.store_offset(&at)).await {
            Ok(()) => Flow::Go,
            Err(flow) => flow,
        }
    }
}

/// Whether a transaction's outcome settled its message (its offset may be stored).
fn settled_by(outcome: &Outcome) -> bool {
    matches!(outcome, Outcome::Executed(_) | Outcome::Replayed(_))
}

/// [`settled_by`] for an outcome a failed batch may not have.
fn settled(outcome: &Option<Outcome>) -> bool {
    outcome.as_ref().is_some_and(settled_by)
}
