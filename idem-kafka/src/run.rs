//! Running a handler: under a lease through the engine, or without one for keyless
//! messages; and handing a still-running handler off when its partition is given up.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::{Claim, ClaimOutcome, FailureKind, HandlerError, Lease, Outcome, Timestamp};
use tracing::Instrument;

use crate::Message;
use crate::config::{HandlerResult, Mode};
use crate::partition::{Flow, Item, Worker};
use crate::probe::Point;

/// Exponential backoff between two bounds.
pub(crate) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    pub fn new((first, max): (Duration, Duration)) -> Self {
        Backoff { next: first, max }
    }

    pub fn next(&mut self) -> Duration {
        let d = self.next;
        self.next = (d * 2).min(self.max);
        d
    }
}

/// Where a running handler future lives, so that it can be moved to a task of its own if
/// its partition is given up while it runs, and so its response survives a failed store.
#[derive(Default)]
pub(crate) struct Slot {
    state: Mutex<SlotState>,
}

#[derive(Default)]
enum SlotState {
    #[default]
    Idle,
    Running(BoxFuture<'static, HandlerResult>),
    Done(Option<Bytes>),
}

impl Slot {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The response of a handler that returned `Ok`.
    fn response(&self) -> Option<Bytes> {
        match &*self.lock() {
            SlotState::Done(r) => r.clone(),
            _ => None,
        }
    }

    /// Moves a handler that is still running to a task of its own: it runs to its end, but
    /// nothing stores its result and no heartbeat extends its lease.
    fn detach(&self, runtime: &tokio::runtime::Handle, span: tracing::Span) {
        if let SlotState::Running(fut) = std::mem::take(&mut *self.lock()) {
            runtime.spawn(
                async move {
                    let _ = fut.await;
                    tracing::warn!(
                        "handler finished after its partition was given up; its result is dropped"
                    );
                }
                .instrument(span),
            );
        }
    }
}

/// Polls the handler in its [`Slot`]; when it returns, asks the probe about
/// [`Point::AfterEffect`] and hangs forever on a crash verdict.
struct SlotFuture<'w> {
    slot: Arc<Slot>,
    worker: &'w Worker,
    offset: i64,
    crashed: bool,
}

impl Future for SlotFuture<'_> {
    type Output = HandlerResult;

    fn poll(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<HandlerResult> {
        if self.crashed {
            return Poll::Pending;
        }
        let mut state = self.slot.lock();
        let result = match &mut *state {
            SlotState::Running(fut) => match fut.poll_unpin(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => r,
            },
            _ => return Poll::Ready(Err(HandlerError::retry("handler was detached"))),
        };
        *state = SlotState::Done(result.as_ref().ok().cloned());
        drop(state);
        if self.worker.probe(Point::AfterEffect, self.offset) {
            self.crashed = true;
            return Poll::Pending;
        }
        Poll::Ready(result)
    }
}

impl Worker {
    fn start(
        &self,
        slot: &Arc<Slot>,
        msg: &Message,
        ctx: Option<idem_core::Context>,
    ) -> SlotFuture<'_> {
        let fut = match &self.shared.settings.mode {
            Mode::Lease(handler) => handler(msg.clone(), ctx),
            #[cfg(feature = "postgres")]
            Mode::Transactional(_) => {
                std::future::ready(Err(HandlerError::permanent("no lease-mode handler"))).boxed()
            }
        };
        *slot.lock() = SlotState::Running(fut);
        SlotFuture {
            slot: Arc::clone(slot),
            worker: self,
            offset: msg.offset(),
            crashed: false,
        }
    }

    /// Polls `work` unless the consumer crashes (`Dead`) or the partition is given up
    /// (`Stop`) first. Given up, a handler still running in `slot` moves to a task of its
    /// own: it runs to its end, but nothing stores its result and no heartbeat extends its
    /// lease.
    pub(crate) async fn guarded<T>(
        &self,
        work: impl Future<Output = T>,
        slot: Option<(&Slot, &tracing::Span)>,
    ) -> Result<T, Flow> {
        let result = tokio::select! {
            biased;
            r = work => Ok(r),
            () = self.shared.dead.cancelled() => Err(Flow::Dead),
            () = self.state.abandon.cancelled() => Err(Flow::Stop),
        };
        if let (Err(Flow::Stop), Some((slot, span))) = (&result, slot) {
            slot.detach(&self.shared.runtime, span.clone());
        }
        result
    }

    /// Settles a claim's answer through [`Engine::settle`](idem_core::Engine::settle):
    /// under an acquired lease the handler runs (renewing a lease that waited in its
    /// batch first); any other answer becomes its outcome. `Err` when the partition was
    /// given up (the handler is moved to a task of its own) or the consumer crashed.
    pub(crate) async fn run_lease(
        &mut self,
        item: &Item,
        claim: &Claim,
        answer: ClaimOutcome,
    ) -> Result<idem_core::Result<Outcome>, Flow> {
        let engine = self.shared.settings.engine.clone();
        let (msg, span) = (&item.msg, &item.span);
        let lease = match answer {
            ClaimOutcome::Acquired(lease) => lease,
            other => {
                let never = |_| std::future::ready(Err(HandlerError::permanent("not acquired")));
                return Ok(engine.settle(other, never).await);
            }
        };
        // A lease claimed with its batch may have waited; renew it before running on it.
        if lease.lease_until.since(Timestamp::now()) < claim.lease_ttl / 2 {
            match engine.backend().extend(&lease, claim.lease_ttl).await {
                Ok(_) => {}
                Err(e) if e.is_fenced() => return Ok(Ok(Outcome::Fenced)),
                Err(e) => return Ok(Err(e)),
            }
        }
        let slot = Arc::new(Slot::default());
        let answer = ClaimOutcome::Acquired(lease.clone());
        let run = engine
            .settle(answer, |ctx| self.start(&slot, msg, Some(ctx)))
            .instrument(span.clone());
        match self.guarded(run, Some((&slot, span))).await {
            Err(flow) => Err(flow),
            Ok(Err(e)) => match slot.response() {
                // The handler ran and returned, but storing its response failed.
                Some(response) => {
                    self.store_error(&e);
                    self.complete_again(&lease, claim, response).await
                }
                None => Ok(Err(e)),
            },
            Ok(outcome) => Ok(outcome),
        }
    }

    /// Stores a handler's response again under the same lease until the store answers,
    /// so a store outage after the side effect does not run the handler twice.
    async fn complete_again(
        &mut self,
        lease: &Lease,
        claim: &Claim,
        response: Bytes,
    ) -> Result<idem_core::Result<Outcome>, Flow> {
        let backend = self.shared.settings.engine.backend().clone();
        let mut backoff = Backoff::new(self.shared.settings.backoff);
        loop {
            self.stall(backoff.next()).await?;
            match backend
                .complete(lease, response.clone(), claim.retention)
                .await
            {
                Ok(()) => return Ok(Ok(Outcome::Executed(response))),
                Err(e) if e.is_fenced() => return Ok(Ok(Outcome::Fenced)),
                Err(e) => self.store_error(&e),
            }
        }
    }

    /// Runs the handler of a keyless message without a claim (`MissingKey::Process`),
    /// retrying retryable failures in place up to the engine's attempts.
    pub(crate) async fn run_unkeyed(&mut self, item: &Item) -> Flow {
        let (msg, span) = (&item.msg, &item.span);
        tracing::warn!(parent: span, "message without an idempotency key: processed without deduplication");
        let mut backoff = Backoff::new(self.shared.settings.backoff);
        let mut attempt = 0;
        loop {
            attempt += 1;
            let slot = Arc::new(Slot::default());
            let run = AssertUnwindSafe(self.start(&slot, msg, None))
                .catch_unwind()
                .instrument(span.clone());
            let error = match self.guarded(run, Some((&slot, span))).await {
                Err(flow) => return flow,
                Ok(Ok(Ok(_))) => {
                    self.counters.executed.increment(1);
                    span.record("outcome", "executed-without-key");
                    return Flow::Go;
                }
                Ok(Ok(Err(e))) => e,
                Ok(Err(_panic)) => HandlerError::retry("handler panicked"),
            };
            if error.kind() == FailureKind::Permanent
                || attempt >= self.shared.settings.max_attempts
            {
                self.counters.poisoned.increment(1);
                return self
                    .dead_letter(item, crate::dlq::Reason::Poisoned, error.message(), attempt)
                    .await;
            }
            if let Err(flow) = self.stall(backoff.next()).await {
                return flow;
            }
        }
    }
}
