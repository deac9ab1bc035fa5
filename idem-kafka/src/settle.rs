//! Settling a keyed message: acting on each outcome until the message is done (executed,
//! replayed or dead-lettered), stalling the partition while it cannot be.

use std::time::Duration;

use idem_core::{Claim, ClaimOutcome, Outcome, Timestamp};

use crate::config::Mode;
use crate::dlq::{Letter, Reason};
use crate::partition::{Flow, Item, Worker};
use crate::run::Backoff;

/// What to do after one outcome.
pub(crate) enum Step {
    /// The message is settled.
    Settled,
    /// Ask the store again (now: any wait already happened).
    Again,
    /// Stop or die.
    Flow(Flow),
}

impl From<Flow> for Step {
    fn from(flow: Flow) -> Self {
        match flow {
            Flow::Go => Step::Settled,
            other => Step::Flow(other),
        }
    }
}

impl Worker {
    /// Settles a keyed message, starting from its batch claim's answer (lease mode) or
    /// from nothing (transactional mode, which claims in its own transaction). Returns
    /// `Go` once the message is settled.
    pub(crate) async fn settle_keyed(
        &mut self,
        item: &Item,
        claim: &Claim,
        answer: Option<ClaimOutcome>,
    ) -> Flow {
        let shared = self.shared.clone();
        let mut answer = answer;
        let mut backoff = Backoff::new(shared.settings.backoff);
        let mut asked_again = false;
        loop {
            let result = match &shared.settings.mode {
                Mode::Lease(_) => {
                    let answer = match answer.take() {
                        Some(a) => a,
                        None => match self.claim(claim).await {
                            Ok(a) => a,
                            Err(flow) => return flow,
                        },
                    };
                    self.run_lease(item, claim, answer).await
                }
                #[cfg(feature = "postgres")]
                Mode::Transactional(tx) => self.run_transaction(tx, item, claim).await,
            };
            let result = match result {
                Ok(r) => r,
                Err(flow) => return flow,
            };
            match self
                .react(item, result, &mut backoff, &mut asked_again)
                .await
            {
                Step::Settled => return Flow::Go,
                Step::Again => {}
                Step::Flow(flow) => return flow,
            }
        }
    }

    /// Acts on one outcome: counts it, records it on the message's span, and waits or
    /// dead-letters as the consumer rule says.
    async fn react(
        &mut self,
        item: &Item,
        result: idem_core::Result<Outcome>,
        backoff: &mut Backoff,
        asked_again: &mut bool,
    ) -> Step {
        let span = &item.span;
        let outcome = match result {
            Ok(outcome) => outcome,
            Err(e) => {
                self.store_error(&e);
                return self
                    .stall(backoff.next())
                    .await
                    .map_or_else(Step::Flow, |()| Step::Again);
            }
        };
        match outcome {
            Outcome::Executed(_) => {
                self.counters.executed.increment(1);
                span.record("outcome", "executed");
                Step::Settled
            }
            Outcome::Replayed(_) => {
                self.counters.replayed.increment(1);
                span.record("outcome", "replayed");
                Step::Settled
            }
            Outcome::InProgress { owner, lease_until } => {
                // A duplicate earlier in this batch held the key a moment ago: ask once
                // more before waiting.
                let ours = owner == self.shared.settings.engine.owner();
                let first = !std::mem::replace(asked_again, true);
                if ours && first {
                    return Step::Again;
                }
                self.counters.in_progress_waits.increment(1);
                let until_lapse = lease_until.since(Timestamp::now());
                let wait = backoff.next().min(until_lapse + Duration::from_millis(1));
                tracing::debug!(parent: span, %owner, ?wait, "key in progress elsewhere: waiting");
                self.stall(wait)
                    .await
                    .map_or_else(Step::Flow, |()| Step::Again)
            }
            Outcome::Failed { attempts, error } => {
                tracing::debug!(parent: span, attempts, %error, "handler failed; retrying");
                self.stall(backoff.next())
                    .await
                    .map_or_else(Step::Flow, |()| Step::Again)
            }
            Outcome::Poisoned { attempts, error } => {
                self.counters.poisoned.increment(1);
                self.dead_letter(item, Reason::Poisoned, &error, attempts)
                    .await
                    .into()
            }
            Outcome::Mismatch => {
                let error = "the key is known with another payload";
                self.dead_letter(item, Reason::Mismatch, error, 0)
                    .await
                    .into()
            }
            Outcome::Fenced => {
                self.counters.fenced.increment(1);
                tracing::warn!(parent: span, "lease lost while the handler ran; asking again");
                Step::Again
            }
            _ => Step::Again,
        }
    }

    /// Writes a dead letter, retrying until the broker acknowledges it; in transactional
    /// mode the offset past it is then stored in PostgreSQL too.
    pub(crate) async fn dead_letter(
        &mut self,
        item: &Item,
        reason: Reason,
        error: &str,
        attempts: u32,
    ) -> Flow {
        let mut backoff = Backoff::new(self.shared.settings.backoff);
        loop {
            let letter = Letter {
                message: &item.msg,
                reason,
                error,
                attempts,
            };
            let sent = match self
                .guarded(self.shared.dead_letters.send(&letter), None)
                .await
            {
                Ok(sent) => sent,
                Err(flow) => return flow,
            };
            match sent {
                Ok(()) => {
                    self.counters.dead_lettered.increment(1);
                    item.span.record("outcome", "dead-lettered");
                    tracing::warn!(parent: &item.span, reason = reason.as_str(), error, "dead-lettered");
                    return self.after_dead_letter(item).await;
                }
                Err(e) => {
                    tracing::warn!(parent: &item.span, error = %e, "dead-letter write failed: partition stalled");
                    if let Err(flow) = self.stall(backoff.next()).await {
                        return flow;
                    }
                }
            }
        }
    }

    #[cfg(not(feature = "postgres"))]
    async fn after_dead_letter(&mut self, _item: &Item) -> Flow {
        Flow::Go
    }

    /// Gives back leases claimed for messages that will not run here (the partition was
    /// revoked mid-batch): each is shortened to lapse at once, so the next owner of the
    /// partition takes it over without waiting a whole lease.
    pub(crate) async fn release(&self, answers: &mut [Option<ClaimOutcome>]) {
        if self.shared.dead.is_cancelled() {
            return;
        }
        let backend = self.shared.settings.engine.backend();
        for answer in answers.iter_mut() {
            if let Some(ClaimOutcome::Acquired(lease)) = answer.take() {
                let _ = backend.extend(&lease, Duration::from_millis(1)).await;
            }
        }
    }
}
