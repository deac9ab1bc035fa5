//! One delivery, from its key to its ack: the path every message takes.
//!
//! [`Session::handle`] finds the key, then either runs the handler under the engine
//! ([`Session::keyed`]), without it for a keyless message under `MissingKey::Process`
//! ([`Session::unkeyed`]), or dead-letters it ([`Session::dead`]); a message so settled is
//! acked. A store outage, a lease held elsewhere or a retryable failure waits and asks
//! again, holding the message unacked.

use std::sync::Arc;
use std::time::Duration;

use idem_core::binding::{Backoff, Extracted, MissingKey, Reason};
use idem_core::{FailureKind, Key, Outcome};
use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::{Acker, Channel};
use tokio_util::sync::CancellationToken;

use crate::dead_letter::Letter;
use crate::settings::{Mode, Settings};
use crate::{Error, Message, Point, Result, Verdict};

/// What became of one delivery.
pub(crate) enum Handled {
    /// Settled and acked.
    Acked,
    /// The shutdown came before it was settled: left unacked, for the server to requeue.
    Left,
    /// A probe crashed the consumer: nothing more is acked.
    Crashed,
}

/// Where a message's path ended, before the ack.
enum Step {
    Settled,
    Left,
    Crashed,
    /// The dead-letter channel is gone: the connection must be made again.
    Lost(String),
}

/// What a session's deliveries share: cheap to clone into each delivery's task.
#[derive(Clone)]
pub(crate) struct Session {
    pub settings: Arc<Settings>,
    pub letters: Channel,
    pub stop: CancellationToken,
    pub crash: CancellationToken,
}

/// A delivery with what its key source found.
pub(crate) struct Received {
    pub msg: Message,
    pub acker: Acker,
    pub found: Extracted,
}

impl Received {
    /// Its bytes, as the byte budget counts them: the payload and the header values.
    pub fn weight(&self) -> usize {
        self.msg.weight()
    }

    /// The key whose deliveries run one at a time, in the order they came: the
    /// idempotency key, if the message has one.
    pub fn lane(&self) -> Option<Key> {
        match &self.found {
            Extracted::Key(key) => Some(key.clone()),
            _ => None,
        }
    }
}

impl Session {
    /// Reads `delivery`'s key.
    pub fn receive(&self, delivery: Delivery) -> Received {
        let s = &*self.settings;
        let acker = delivery.acker.clone();
        let msg = Message::from_delivery(Arc::clone(&s.queue), delivery);
        let found = s.key_source.extract(&s.namespace, &msg);
        let msg = match &found {
            Extracted::Key(key) => msg.with_key(key.clone()),
            _ => msg,
        };
        Received { msg, acker, found }
    }

    /// Settles a received delivery and acks it.
    pub async fn handle(&self, received: Received) -> Result<Handled> {
        let s = &*self.settings;
        let Received { msg, acker, found } = received;
        let step = match found {
            Extracted::Key(key) => self.keyed(&msg, &key).await,
            Extracted::Missing if s.missing_key == MissingKey::Process => self.unkeyed(&msg).await,
            Extracted::Missing => {
                let why = format!("no key ({:?})", s.key_source);
                self.dead(&msg, Reason::MissingKey, &why, 0).await
            }
            Extracted::Invalid(why) => self.dead(&msg, Reason::InvalidKey, &why, 0).await,
            Extracted::Malformed(why) => self.dead(&msg, Reason::MalformedPayload, &why, 0).await,
            // An answer of a later key source: no key to claim under, so it is not run.
            other => {
                let why = format!("{other:?}");
                self.dead(&msg, Reason::InvalidKey, &why, 0).await
            }
        };
        self.finish(&msg, step, &acker).await
    }

    /// Acks a delivery settled by a batch.
    pub(crate) async fn ack(&self, received: &Received) -> Result<Handled> {
        self.finish(&received.msg, Step::Settled, &received.acker)
            .await
    }

    /// Acks a settled message.
    async fn finish(&self, msg: &Message, step: Step, acker: &lapin::Acker) -> Result<Handled> {
        match step {
            Step::Settled => {}
            Step::Left => return Ok(Handled::Left),
            Step::Crashed => return Ok(Handled::Crashed),
            Step::Lost(why) => return Err(Error::Lost(why)),
        }
        if self.crashes_at(Point::AfterSettle, msg) {
            return Ok(Handled::Crashed);
        }
        acker
            .ack(BasicAckOptions::default())
            .await
            .map_err(Error::amqp("basic.ack"))?;
        if self.crashes_at(Point::AfterAck, msg) {
            return Ok(Handled::Crashed);
        }
        Ok(Handled::Acked)
    }

    /// Runs the handler under the engine until the key is settled: executed, replayed,
    /// or dead-lettered as poisoned or mismatched.
    async fn keyed(&self, msg: &Message, key: &Key) -> Step {
        let s = &*self.settings;
        let mut backoff = Backoff::new(s.backoff);
        loop {
            if self.stop.is_cancelled() {
                return Step::Left;
            }
            if self.crashes_at(Point::BeforeClaim, msg) {
                return Step::Crashed;
            }
            let answer = tokio::select! {
                answer = self.run_keyed(msg, key) => answer,
                () = self.crash.cancelled() => return Step::Crashed,
            };
            match answer {
                Ok(Outcome::Executed(_) | Outcome::Replayed(_)) => return Step::Settled,
                Ok(Outcome::Poisoned { attempts, error }) => {
                    return self.dead(msg, Reason::Poisoned, &error, attempts).await;
                }
                Ok(Outcome::Mismatch) => {
                    let why = "the key is known with another payload";
                    return self.dead(msg, Reason::Mismatch, why, 0).await;
                }
                // Held elsewhere, failed with attempts left, fenced or handed back: ask
                // again after a wait.
                Ok(other) => tracing::debug!(%key, outcome = ?other, "asking again"),
                Err(e) => tracing::warn!(%key, error = %e, "store call failed; retrying"),
            }
            if !self.pause(backoff.wait()).await {
                return Step::Left;
            }
        }
    }

    /// One try of a keyed message: the engine around the handler, or the store's
    /// transaction.
    async fn run_keyed(&self, msg: &Message, key: &Key) -> idem_core::Result<Outcome> {
        let s = &*self.settings;
        match &s.mode {
            Mode::Lease(_) => {
                let run = |ctx| self.run_handler(msg, Some(ctx));
                s.engine.execute(key, msg.payload(), run).await
            }
            Mode::Transactional(store) => {
                let claim = s.engine.claim_for(key, msg.payload());
                let probe = s.probe.clone();
                let crash = self.crash.clone();
                let after_effect: crate::tx::Hook = Arc::new(move |m: &Message| {
                    if probe
                        .as_ref()
                        .is_some_and(|p| p.reached(Point::AfterEffect, m) == Verdict::Crash)
                    {
                        crash.cancel();
                    }
                    crash.is_cancelled()
                });
                store
                    .run(&claim, s.engine.retention(), msg.clone(), after_effect)
                    .await
            }
        }
    }

    /// A keyless message under `MissingKey::Process`: the handler with no claim, retried in
    /// place up to the engine's attempts; a permanent failure or the last one
    /// dead-letters it.
    async fn unkeyed(&self, msg: &Message) -> Step {
        let s = &*self.settings;
        tracing::warn!(queue = %s.queue, "a message with no key runs without deduplication");
        let mut backoff = Backoff::new(s.backoff);
        let max = s.engine.max_attempts().max(1);
        for attempt in 1.. {
            let run = self.run_handler(msg, None);
            let result = tokio::select! {
                result = run => result,
                () = self.crash.cancelled() => return Step::Crashed,
            };
            let error = match result {
                Ok(_) => return Step::Settled,
                Err(e) => e,
            };
            if error.kind() == FailureKind::Permanent || attempt >= max {
                return self
                    .dead(msg, Reason::Poisoned, error.message(), attempt)
                    .await;
            }
            if !self.pause(backoff.wait()).await {
                return Step::Left;
            }
        }
        Step::Left
    }

    /// The handler, then the probe at [`Point::AfterEffect`]; a crash there never
    /// returns, so nothing of the run is stored.
    pub(crate) async fn run_handler(
        &self,
        msg: &Message,
        ctx: Option<idem_core::Context>,
    ) -> idem_core::binding::HandlerResult {
        let Mode::Lease(handler) = &self.settings.mode else {
            return Err(idem_core::HandlerError::permanent(
                "transactional mode runs no handler outside a transaction",
            ));
        };
        let result = handler(msg.clone(), ctx).await;
        if self.crashes_at(Point::AfterEffect, msg) {
            std::future::pending::<()>().await;
        }
        result
    }

    /// Publishes `msg`'s dead letter until the server confirms it.
    async fn dead(&self, msg: &Message, reason: Reason, error: &str, attempts: u32) -> Step {
        let s = &*self.settings;
        tracing::warn!(queue = %s.queue, key = ?msg.idempotency_key(), reason = reason.as_str(), error, "dead-lettering");
        let (exchange, routing_key, _) = s.dead_letters.target(&s.queue);
        let letter = Letter {
            message: msg,
            reason,
            error,
            attempts,
        };
        let mut backoff = Backoff::new(s.backoff);
        loop {
            match letter.publish(&self.letters, &exchange, &routing_key).await {
                Ok(()) => return Step::Settled,
                Err(why) if !self.letters.status().connected() => return Step::Lost(why),
                Err(why) => {
                    tracing::warn!(queue = %s.queue, error = %why, "dead letter not confirmed; retrying")
                }
            }
            if !self.pause(backoff.wait()).await {
                return Step::Left;
            }
        }
    }

    /// Waits `d`; false if the shutdown or a crash came first.
    pub(crate) async fn pause(&self, d: Duration) -> bool {
        tokio::select! {
            () = tokio::time::sleep(d) => true,
            () = self.stop.cancelled() => false,
            () = self.crash.cancelled() => false,
        }
    }

    /// Asks the probe about `point`; on a crash sets the crash off and says so.
    pub(crate) fn crashes_at(&self, point: Point, msg: &Message) -> bool {
        let Some(probe) = &self.settings.probe else {
            return self.crash.is_cancelled();
        };
        if probe.reached(point, msg) == Verdict::Crash {
            self.crash.cancel();
        }
        self.crash.is_cancelled()
    }
}
