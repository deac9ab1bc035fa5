//! Off the fast path: one message until it is settled (executed, replayed or
//! dead-lettered), whatever it takes; and leaving a chunk early.

use std::sync::Arc;
use std::time::Duration;

use idem_core::backend::{ClaimOutcome, Ran, Settlement};
use idem_core::{Engine, FailureKind, HandlerError, Outcome, Timestamp, WaitPolicy};
use tracing::Instrument;

use super::lease::{Pending, Started};
use super::{Failing, Flow, Item, Kind, Worker};
use crate::dead_letter::Reason;
use crate::dead_letter::write::Outgoing;
use crate::probe::Point;
use crate::settings::Mode;
use crate::slot::Slot;

impl Worker {
    /// A message without a usable key: dead-lettered with its reason, or (under
    /// `MissingKey::Process`) run without a claim.
    pub(super) async fn resolve_keyless(&self, item: &Item) -> Flow {
        match &item.kind {
            Kind::DeadLetter(reason, error) => self.dead_letter(item, *reason, error, 0).await,
            _ => self.run_unkeyed(item).await,
        }
    }

    /// Settles one message whatever it takes, starting from `first` if the fast path got
    /// an outcome already: asks the store again, waits while another worker holds the key,
    /// retries a failed handler, dead-letters a poisoned or mismatched key. `Go` once the
    /// message is settled.
    pub(super) async fn resolve(
        &self,
        item: &Item,
        first: Option<idem_core::Result<Outcome>>,
    ) -> Flow {
        let mut next = first;
        let mut backoff = self.backoff();
        let mut asked_again = false;
        loop {
            let result = match next.take() {
                Some(result) => result,
                None => match self.attempt(item).await {
                    Ok(result) => result,
                    Err(flow) => return flow,
                },
            };
            let span = &item.span;
            let wait = match result {
                Err(e) => {
                    self.store_error(&e);
                    backoff.wait()
                }
                Ok(Outcome::Executed(_)) => {
                    self.counters.executed.increment(1);
                    span.record("outcome", "executed");
                    return Flow::Go;
                }
                Ok(Outcome::Replayed(_)) => {
                    self.counters.replayed.increment(1);
                    span.record("outcome", "replayed");
                    return Flow::Go;
                }
                Ok(Outcome::Poisoned { attempts, error }) => {
                    self.counters.poisoned.increment(1);
                    return self
                        .dead_letter(item, Reason::Poisoned, &error, attempts)
                        .await;
                }
                Ok(Outcome::Mismatch) => {
                    let error = "the key is known with another payload";
                    return self.dead_letter(item, Reason::Mismatch, error, 0).await;
                }
                Ok(Outcome::InProgress { owner, lease_until }) => {
                    // This worker held the key a moment ago (a duplicate earlier in the
                    // batch): ask once more before waiting.
                    if &*owner == self.engine.owner() && !std::mem::replace(&mut asked_again, true)
                    {
                        continue;
                    }
                    self.counters.in_progress_waits.increment(1);
                    let every = match self.engine.wait_policy() {
                        WaitPolicy::Wait { poll, .. } => poll,
                        // `Return`, and a policy of a later idem-core: back off.
                        _ => backoff.wait(),
                    };
                    let until_lapse = lease_until.since(Timestamp::now());
                    let wait = every.min(until_lapse + Duration::from_millis(1));
                    tracing::debug!(parent: span, %owner, ?wait, "key in progress elsewhere: waiting");
                    wait
                }
                Ok(Outcome::Failed { attempts, error }) => {
                    tracing::debug!(parent: span, attempts, %error, "handler failed; retrying");
                    backoff.wait()
                }
                Ok(Outcome::Fenced) => {
                    self.counters.fenced.increment(1);
                    tracing::warn!(parent: span, "lease lost while the handler ran; asking again");
                    continue;
                }
                Ok(_) => continue,
            };
            if let Err(flow) = self.stall(wait).await {
                return flow;
            }
        }
    }

    /// One attempt at one message: claim, run and settle it alone (lease mode), or run it
    /// in a transaction of its own (transactional mode).
    async fn attempt(&self, item: &Item) -> Result<idem_core::Result<Outcome>, Flow> {
        let Some(claim) = self.claim_of(item) else {
            return Ok(Err(idem_core::Error::corrupt(
                "a keyless message has no claim",
            )));
        };
        if let Mode::Transactional(tx) = &self.settings().mode {
            // The transaction is the handler's run: its key is marked running throughout.
            let Some(_runs) = self.ctx.running.start(&claim.key) else {
                return Ok(Ok(self.busy_here()));
            };
            let offset = item.msg.offset();
            if self.probe(Point::BeforeClaim, offset) {
                return Err(Flow::Crashed);
            }
            // Concurrent transactions may commit out of offset order: the offset is then
            // stored apart, at the low-water mark (see `process_lanes`).
            let at = (self.settings().in_flight == 1).then(|| self.position(&item.msg));
            let hook = self.tx_hook();
            let _permit = self.handler_permit().await?;
            let run = tx.run(
                &claim,
                self.engine.retention(),
                at.as_ref(),
                item.msg.clone(),
                hook,
            );
            // Given up or crashed, the transaction is dropped: it rolls back.
            return self.guarded(run.instrument(item.span.clone())).await;
        }
        if self.ctx.running.contains(&claim.key) {
            return Ok(Ok(self.busy_here()));
        }
        let claims = std::slice::from_ref(&claim);
        let mut answers = self
            .retry(Failing::Store, || self.engine.claim_many(claims))
            .await?;
        let Some(answer) = answers.pop() else {
            return Ok(Err(idem_core::Error::corrupt("claim answered nothing")));
        };
        let lease = match Engine::lease_or_outcome(answer) {
            Ok(lease) => lease,
            Err(outcome) => return Ok(Ok(outcome)),
        };
        match self.run_handler(item, &lease).await? {
            Started::Ran(Ran::Fenced) => Ok(Ok(Outcome::Fenced)),
            Started::Ran(Ran::Settle(settle)) => {
                self.settle_one(Settlement { lease, settle }).await
            }
            Started::Busy => Ok(Ok(self.busy_here())),
        }
    }

    /// Runs the handler of a keyless message without a claim (`MissingKey::Process`),
    /// retrying retryable failures in place up to the engine's attempts.
    async fn run_unkeyed(&self, item: &Item) -> Flow {
        let Mode::Lease(handler) = &self.settings().mode else {
            return Flow::Stop;
        };
        let handler = Arc::clone(handler);
        let span = &item.span;
        tracing::warn!(parent: span, "message without an idempotency key: processed without deduplication");
        let mut backoff = self.backoff();
        let mut attempt = 0;
        loop {
            attempt += 1;
            // Not under the engine, whose `run_leased` catches a panic in the call itself:
            // caught here, it fails the attempt like a panic in the future.
            let msg = item.msg.clone();
            let slot = Slot::new(futures::FutureExt::boxed(
                idem_core::backend::panic_at_poll(|| handler(msg, None)),
            ));
            let offset = item.msg.offset();
            let run = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(
                slot.poll_with(|| self.probe(Point::AfterEffect, offset)),
            ));
            let error = match self.guarded(run.instrument(span.clone())).await {
                Err(flow) => {
                    if flow == Flow::Stop {
                        slot.detach(span.clone(), ());
                    }
                    return flow;
                }
                Ok(Ok(Ok(_))) => {
                    self.counters.executed.increment(1);
                    span.record("outcome", "executed-without-key");
                    return Flow::Go;
                }
                Ok(Ok(Err(e))) => e,
                Ok(Err(_panic)) => HandlerError::retry("handler panicked"),
            };
            if error.kind() == FailureKind::Permanent || attempt >= self.engine.max_attempts() {
                self.counters.poisoned.increment(1);
                return self
                    .dead_letter(item, Reason::Poisoned, error.message(), attempt)
                    .await;
            }
            if let Err(flow) = self.stall(backoff.wait()).await {
                return flow;
            }
        }
    }

    /// Writes a dead letter, retrying until the broker acknowledges it; in transactional
    /// mode the offset past it is then stored in the store too (so a seek skips it).
    async fn dead_letter(&self, item: &Item, reason: Reason, error: &str, attempts: u32) -> Flow {
        let letter = Outgoing {
            message: &item.msg,
            reason,
            error,
            attempts,
        };
        let sent = self.retry(Failing::Broker(&item.span), || {
            self.ctx.letters.send(&letter)
        });
        if let Err(flow) = sent.await {
            return flow;
        }
        self.counters.dead_lettered.increment(1);
        item.span.record("outcome", "dead-lettered");
        tracing::warn!(parent: &item.span, reason = reason.as_str(), error, "dead-lettered");
        if self.settings().in_flight > 1 {
            // Lanes run at once: messages before this one may be unsettled still, and a
            // crash after storing past this one would skip them. The offset is stored at
            // the low-water mark instead (see `process_lanes`).
            return Flow::Go;
        }
        self.store_offset_in_tx(item).await
    }

    /// Leaves a chunk early: what already ran is settled (its work is done), and the leases
    /// claimed for messages that will not run here are released in one call, so the next
    /// owner of the partition runs them at once and no attempt is spent. A crash writes
    /// nothing.
    pub(super) async fn give_up(
        &self,
        answers: &mut [Option<ClaimOutcome>],
        mut pending: Vec<Pending>,
        flow: Flow,
    ) -> Flow {
        if flow == Flow::Crashed || self.ctx.crash.happened() {
            return Flow::Crashed;
        }
        let mut batch: Vec<Settlement> = pending.drain(..).map(Pending::into_settlement).collect();
        batch.extend(answers.iter_mut().filter_map(|a| match a.take() {
            Some(ClaimOutcome::Acquired(lease)) => Some(Settlement::release(lease)),
            _ => None,
        }));
        // Safe even after the partition moved on: each write is fenced by its token.
        if !batch.is_empty() {
            if let Err(e) = self.engine.settle_batch(&batch).await {
                self.store_error(&e);
            }
        }
        flow
    }
}
