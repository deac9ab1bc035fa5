//! Lease mode, one handler at a time (`in_flight` 1): one claim for the chunk, the
//! handlers in offset order, one settle for the results.

use idem_core::backend::{ClaimOutcome, Ran, Settle, Settlement};
use idem_core::{Context, Engine, FailureKind, Lease, Outcome};
use tracing::Instrument;

use super::{Failing, Flow, Item, Kind, Worker};
use crate::probe::Point;
use crate::settings::Mode;
use crate::slot::Slot;

/// A handler that ran on the fast path, waiting for the chunk's settle.
pub(super) struct Pending {
    index: usize,
    settlement: Settlement,
}

impl Pending {
    pub(super) fn into_settlement(self) -> Settlement {
        self.settlement
    }
}

/// What came of starting a handler under a lease.
pub(super) enum Started {
    /// It ran (or its lease was lost meanwhile): settle this.
    Ran(Ran),
    /// Another handler of its key runs in this consumer: it did not start, and its lease
    /// was handed back. The message waits as for a key in progress elsewhere.
    Busy,
}

impl Worker {
    /// Claims the chunk, runs each acquired message's handler in order, and settles the
    /// results in one call. A message off that path is settled on its own
    /// ([`Worker::resolve`]) after what ran before it.
    pub(super) async fn process_leased(&self, chunk: &[Item]) -> Flow {
        let first = chunk[0].msg.offset();
        if self.probe(Point::BeforeClaim, first) {
            return Flow::Crashed;
        }
        let mut answers = match self.claim_chunk(chunk).await {
            Ok(answers) => answers,
            Err(flow) => return flow,
        };
        if self.probe(Point::AfterClaim, first) {
            return Flow::Crashed;
        }
        let mut pending: Vec<Pending> = Vec::new();
        let mut settled_to = 0;
        for (index, item) in chunk.iter().enumerate() {
            if let Some(flow) = self.interrupted() {
                return self.give_up(&mut answers, pending, flow).await;
            }
            let answer = answers[index].take();
            let flow = match (&item.kind, answer) {
                (Kind::Keyed(..), Some(ClaimOutcome::Acquired(lease))) => {
                    match self.run_handler(item, &lease).await {
                        Err(flow) => flow,
                        Ok(Started::Ran(Ran::Settle(done @ Settle::Complete(_)))) => {
                            let settlement = Settlement {
                                lease,
                                settle: done,
                            };
                            pending.push(Pending { index, settlement });
                            Flow::Go
                        }
                        // Off the fast path: settle what ran before it, then this one alone.
                        Ok(started) => {
                            let flow = self
                                .settle_before(chunk, &mut pending, &mut settled_to, index)
                                .await;
                            let first = match started {
                                Started::Ran(Ran::Settle(failed)) => {
                                    let settlement = Settlement {
                                        lease,
                                        settle: failed,
                                    };
                                    self.settle_one(settlement).await
                                }
                                Started::Ran(Ran::Fenced) => Ok(Ok(Outcome::Fenced)),
                                Started::Busy => Ok(Ok(self.busy_here())),
                            };
                            match (flow, first) {
                                (Flow::Go, Ok(first)) => self.resolve(item, Some(first)).await,
                                (Flow::Go, Err(flow)) | (flow, _) => flow,
                            }
                        }
                    }
                }
                (Kind::Keyed(..), Some(ClaimOutcome::Completed(_))) => {
                    self.counters.replayed.increment(1);
                    item.span.record("outcome", "replayed");
                    Flow::Go
                }
                (Kind::Keyed(..), other) => {
                    // A key busy elsewhere (or earlier in this chunk), poisoned or mismatched.
                    let flow = self
                        .settle_before(chunk, &mut pending, &mut settled_to, index)
                        .await;
                    let first = other
                        .and_then(|a| Engine::lease_or_outcome(a).err())
                        .map(Ok);
                    match flow {
                        Flow::Go => self.resolve(item, first).await,
                        flow => flow,
                    }
                }
                // Off the path too: what ran before is settled first.
                (Kind::Unkeyed | Kind::DeadLetter(..), _) => {
                    match self
                        .settle_before(chunk, &mut pending, &mut settled_to, index)
                        .await
                    {
                        Flow::Go => self.resolve_keyless(item).await,
                        flow => flow,
                    }
                }
            };
            if flow != Flow::Go {
                return self.give_up(&mut answers, pending, flow).await;
            }
            if pending.is_empty() {
                if self.mark_settled(chunk, settled_to..=index) {
                    return Flow::Crashed;
                }
                settled_to = index + 1;
            }
        }
        let flow = self.settle(chunk, &mut pending).await;
        if flow != Flow::Go {
            return flow;
        }
        if self.mark_settled(chunk, settled_to..=chunk.len() - 1) {
            return Flow::Crashed;
        }
        Flow::Go
    }

    /// Runs the handler of `item` under `lease` through the engine (heartbeats, panics,
    /// the response limit), writing nothing. `Err` when the partition was given up (the
    /// handler moves to a task of its own) or the consumer crashed.
    pub(super) async fn run_handler(&self, item: &Item, lease: &Lease) -> Result<Started, Flow> {
        let Mode::Lease(handler) = &self.settings().mode else {
            return Ok(Started::Ran(Ran::Settle(Settle::Fail {
                error: "no lease-mode handler".into(),
                kind: FailureKind::Permanent,
            })));
        };
        // A key runs in one handler of this process at a time, whatever the store says: a
        // lease taken over from a handler still running here is handed back unused.
        let key = item.msg.idempotency_key();
        let Some(runs) = key.and_then(|key| self.ctx.running.start(key)) else {
            tracing::debug!(parent: &item.span, "the key runs in another handler here: not started");
            self.release(lease).await;
            return Ok(Started::Busy);
        };
        let slot = Slot::default();
        let start = |ctx: Context| {
            slot.fill(handler(item.msg.clone(), Some(ctx)));
            let offset = item.msg.offset();
            slot.poll_with(move || self.probe(Point::AfterEffect, offset))
        };
        let _permit = match self.handler_permit().await {
            Ok(permit) => permit,
            Err(flow) => {
                // Stopped before the handler started: hand the lease back.
                if flow == Flow::Stop {
                    self.release(lease).await;
                }
                return Err(flow);
            }
        };
        // Pinned where it is made: the handler's future is not moved again on its way in.
        let result = {
            let run = self.engine.run_leased(lease, start);
            let run = std::pin::pin!(run.instrument(item.span.clone()));
            self.guarded(run).await
        };
        match &result {
            // Still running, the key stays marked until the handler ends.
            Err(Flow::Stop) => slot.detach(item.span.clone(), runs.keep(&self.ctx.running)),
            _ => drop(runs),
        }
        result.map(Started::Ran)
    }

    /// Hands `lease` back unused (a failure is only logged: the lease then lapses).
    async fn release(&self, lease: &Lease) {
        let release = [Settlement::release(lease.clone())];
        if let Err(e) = self.engine.settle_batch(&release).await {
            self.store_error(&e);
        }
    }

    /// Settles the handlers that ran since the last settle, in one store call, retrying
    /// while the store fails (a retry is safe: what landed is then fenced, and asked again).
    /// An item the store fences after all is settled again on its own.
    async fn settle(&self, chunk: &[Item], pending: &mut Vec<Pending>) -> Flow {
        if pending.is_empty() {
            return Flow::Go;
        }
        let (indices, batch): (Vec<usize>, Vec<Settlement>) =
            pending.drain(..).map(|p| (p.index, p.settlement)).unzip();
        let answers = match self.settle_all(&batch).await {
            Ok(answers) => answers,
            Err(flow) => return flow,
        };
        for (index, answer) in indices.into_iter().zip(answers) {
            let item = &chunk[index];
            let flow = match answer {
                Ok(Outcome::Executed(_)) => {
                    self.counters.executed.increment(1);
                    item.span.record("outcome", "executed");
                    Flow::Go
                }
                other => self.resolve(item, Some(other)).await,
            };
            if flow != Flow::Go {
                return flow;
            }
        }
        Flow::Go
    }

    /// Settles what ran before `chunk[index]` and marks everything before it settled, so a
    /// message that leaves the fast path never holds back the offsets of those before it.
    async fn settle_before(
        &self,
        chunk: &[Item],
        pending: &mut Vec<Pending>,
        settled_to: &mut usize,
        index: usize,
    ) -> Flow {
        let flow = self.settle(chunk, pending).await;
        if flow != Flow::Go {
            return flow;
        }
        if index > *settled_to {
            if self.mark_settled(chunk, *settled_to..=index - 1) {
                return Flow::Crashed;
            }
            *settled_to = index;
        }
        Flow::Go
    }

    /// [`Engine::settle_batch`], retried with backoff while the store fails.
    pub(super) async fn settle_all(
        &self,
        batch: &[Settlement],
    ) -> Result<Vec<idem_core::Result<Outcome>>, Flow> {
        self.retry(Failing::Store, || self.engine.settle_batch(batch))
            .await
    }

    pub(super) async fn settle_one(
        &self,
        item: Settlement,
    ) -> Result<idem_core::Result<Outcome>, Flow> {
        let mut answers = self.settle_all(std::slice::from_ref(&item)).await?;
        Ok(answers
            .pop()
            .unwrap_or_else(|| Err(idem_core::Error::corrupt("settle answered nothing"))))
    }
}
