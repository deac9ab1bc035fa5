//! One partition's worker. The path of one message reads top to bottom:
//!
//! 1. [`Worker::run`] takes a poll batch that the poll thread routed here (`consumer.rs`);
//! 2. [`Worker::key`] finds each message's idempotency key;
//! 3. [`Worker::claim_chunk`] claims a chunk of the batch in one store call;
//! 4. [`Worker::run_handler`] runs each acquired message's handler under its lease;
//! 5. [`Worker::settle`] settles the chunk's results in one store call;
//! 6. [`Worker::store_offset`] stores the offset past the settled prefix;
//! 7. the poll thread commits the stored offsets (`consumer.rs`).
//!
//! A message off that path (its key busy elsewhere, a failed handler, a lease lost, a
//! poisoned key, a store outage) goes to [`Worker::resolve`], which settles that one message
//! before the partition moves on: the consumer rule holds at every step.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use idem_core::backend::{Claim, ClaimOutcome, OffsetPosition, Ran, Settle, Settlement};
use idem_core::{
    Context, Engine, FailureKind, HandlerError, Lease, Outcome, Timestamp, WaitPolicy,
};
use rdkafka::consumer::Consumer;
use tracing::{Instrument, Span};

use crate::Message;
use crate::config::{MissingKey, Mode};
use crate::consumer::Shared;
use crate::dlq::{Letter, Reason};
use crate::handle::{BACKLOG, PartitionState, STALL, WorkerEnds};
use crate::key::Extracted;
use crate::lanes::{self, OrderBy, Settler, Window};
use crate::metrics::Counters;
use crate::probe::Point;
use crate::slot::Slot;

/// The longest a chunk's results wait for their settle, as handlers are timed so far.
const SETTLE_WITHIN: Duration = Duration::from_millis(100);
/// How many messages the first chunk of a partition claims, before any handler was timed.
const FIRST_CHUNK: usize = 16;

/// What the rest of a partition's work should do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flow {
    /// Go on with the next message.
    Go,
    /// The partition was revoked (or the consumer is shutting down): dispatch nothing more.
    Stop,
    /// The consumer crashed: do nothing more at all.
    Dead,
}

/// A message and what its key source made of it.
pub(crate) struct Item {
    msg: Message,
    kind: Kind,
    span: Span,
}

enum Kind {
    /// The payload's fingerprint, hashed as the batch is keyed (the key is the message's,
    /// [`Message::key`]); the claim is built where it is sent ([`Worker::claim_of`]), so
    /// no copy of it is kept.
    Keyed(Option<idem_core::Fingerprint>),
    Unkeyed,
    Dead(Reason, String),
}

/// A handler that ran on the fast path, waiting for the chunk's settle.
struct Pending {
    index: usize,
    settlement: Settlement,
}

/// What the lanes of a chunk share.
struct Lanes {
    answers: std::sync::Mutex<Vec<Option<ClaimOutcome>>>,
    window: std::sync::Mutex<Window>,
    settler: Settler,
}

/// What a lane is ordered by.
#[derive(Hash, PartialEq, Eq)]
enum LaneKey<'a> {
    Id(&'a idem_core::Key),
    Message(&'a bytes::Bytes),
}

/// A running handler's permit; it counts in the in-flight gauge until dropped.
struct InFlight<'a> {
    _permit: Option<tokio::sync::SemaphorePermit<'a>>,
    gauge: &'a metrics::Gauge,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.gauge.decrement(1.0);
    }
}

/// How far a partition got: its last settled offset (the end of the settled prefix), and
/// whether it is paused for a stall. The last offset stored in the client is
/// `PartitionState::stored`, which the poll thread reads too.
#[derive(Default)]
struct Progress {
    settled: Option<i64>,
    stalled: bool,
}

/// The worker of one partition, run as a Tokio task.
pub(crate) struct Worker {
    shared: Arc<Shared>,
    state: Arc<PartitionState>,
    engine: Engine,
    ends: WorkerEnds,
    counters: Counters,
    progress: std::sync::Mutex<Progress>,
    /// Handlers that may run at once (`in_flight`).
    permits: tokio::sync::Semaphore,
    /// Average time to run one message, to keep claims ahead of their handler short.
    per_message: Duration,
}

impl Worker {
    pub fn new(shared: Arc<Shared>, state: Arc<PartitionState>, ends: WorkerEnds) -> Worker {
        Worker {
            counters: Counters::new(&state.topic, state.partition),
            engine: shared.settings.engine.clone(),
            permits: tokio::sync::Semaphore::new(shared.settings.in_flight),
            shared,
            state,
            ends,
            progress: Default::default(),
            per_message: Duration::ZERO,
        }
    }

    /// Takes poll batches in order until the partition is revoked or the consumer stops.
    pub async fn run(mut self) {
        let batch_size = self.shared.settings.batch_size;
        let mut batch = Vec::with_capacity(batch_size);
        loop {
            let first = tokio::select! {
                biased;
                () = self.shared.dead.cancelled() => return,
                () = self.state.stop.cancelled() => break,
                m = self.ends.rx.recv() => match m {
                    Some(m) => m,
                    None => break,
                },
            };
            batch.push(first);
            while batch.len() < batch_size {
                match self.ends.rx.try_recv() {
                    Ok(m) => batch.push(m),
                    Err(_) => break,
                }
            }
            let permit = match self.shared.permits.clone() {
                None => None,
                Some(sem) => tokio::select! {
                    biased;
                    () = self.shared.dead.cancelled() => return,
                    () = self.state.stop.cancelled() => break,
                    p = sem.acquire_owned() => p.ok(),
                },
            };
            let taken = batch.len();
            let flow = self.process(&mut batch).await;
            drop(permit);
            batch.clear();
            // Counted until handled: the bound covers messages waiting and in flight.
            let before = self.state.backlog.fetch_sub(taken, Ordering::Relaxed);
            if before.saturating_sub(taken) <= self.shared.settings.buffer / 2 {
                self.state.set_pause(&self.shared, BACKLOG, false);
            }
            match flow {
                Flow::Go => self.store_offset(),
                Flow::Stop => break,
                Flow::Dead => return,
            }
        }
        self.store_offset();
    }

    /// One poll batch, in chunks short enough that no claimed lease waits long for its
    /// handler.
    async fn process(&mut self, batch: &mut Vec<Message>) -> Flow {
        let items: Vec<Item> = batch.drain(..).map(|m| self.key(m)).collect();
        let mut start = 0;
        while start < items.len() {
            let end = start + self.chunk_len(&items[start..]);
            let began = Instant::now();
            let chunk = &items[start..end];
            let flow = match &self.shared.settings.mode {
                _ if self.shared.settings.in_flight > 1 => self.process_concurrent(chunk).await,
                Mode::Lease(_) => self.process_chunk(chunk).await,
                Mode::Transactional(_) => self.process_transactional(chunk).await,
            };
            if flow != Flow::Go {
                return flow;
            }
            let each = began.elapsed() / u32::try_from(chunk.len()).unwrap_or(u32::MAX);
            self.per_message = if self.per_message.is_zero() {
                each
            } else {
                (self.per_message * 7 + each) / 8
            };
            self.store_offset();
            start = end;
        }
        Flow::Go
    }

    /// The key of a message, or why it has none usable.
    fn key(&self, msg: Message) -> Item {
        let s = &self.shared.settings;
        let (msg, kind) = match s.key_source.extract(&s.namespace, &msg) {
            Extracted::Key(key) => {
                let fingerprint = self.engine.fingerprint_of(msg.payload());
                (msg.with_key(key), Kind::Keyed(fingerprint))
            }
            Extracted::Missing => match s.missing_key {
                MissingKey::DeadLetter => {
                    let why = format!("no idempotency key ({:?})", s.key_source);
                    (msg, Kind::Dead(Reason::MissingKey, why))
                }
                MissingKey::Process => (msg, Kind::Unkeyed),
            },
            Extracted::Invalid(reason) => (msg, Kind::Dead(Reason::InvalidKey, reason)),
            Extracted::Malformed(reason) => (msg, Kind::Dead(Reason::MalformedPayload, reason)),
        };
        // The key is a field from the start: no `record` per message, and nothing is
        // formatted while no subscriber wants the span.
        let span = tracing::info_span!(
            "idem_kafka.message",
            topic = %self.state.topic,
            partition = self.state.partition,
            offset = msg.offset(),
            key = msg.key().map(tracing::field::display),
            outcome = tracing::field::Empty,
        );
        Item { msg, kind, span }
    }

    /// The claim of a keyed message (its key, this engine's settings, the payload's
    /// fingerprint); `None` for a message without a key.
    fn claim_of(&self, item: &Item) -> Option<Claim> {
        match &item.kind {
            Kind::Keyed(fingerprint) => {
                let key = item.msg.key()?;
                Some(self.engine.claim_with(key, *fingerprint))
            }
            _ => None,
        }
    }

    /// Lease mode: one claim for the chunk, the handlers in order, one settle.
    async fn process_chunk(&self, chunk: &[Item]) -> Flow {
        let first = chunk[0].msg.offset();
        if self.probe(Point::BeforeClaim, first) {
            return Flow::Dead;
        }
        let mut answers = match self.claim_chunk(chunk).await {
            Ok(answers) => answers,
            Err(flow) => return flow,
        };
        if self.probe(Point::AfterClaim, first) {
            return Flow::Dead;
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
                        Err(flow) => Some(flow),
                        Ok(Ran::Settle(done @ Settle::Complete(_))) => {
                            let settlement = Settlement {
                                lease,
                                settle: done,
                            };
                            pending.push(Pending { index, settlement });
                            None
                        }
                        // Off the fast path: settle what ran before it, then this one alone.
                        Ok(ran) => {
                            let flow = self
                                .settle_before(chunk, &mut pending, &mut settled_to, index)
                                .await;
                            let first = match ran {
                                Ran::Settle(failed) => {
                                    let settlement = Settlement {
                                        lease,
                                        settle: failed,
                                    };
                                    self.settle_one(settlement).await
                                }
                                Ran::Fenced => Ok(Ok(Outcome::Fenced)),
                            };
                            match (flow, first) {
                                (Flow::Go, Ok(first)) => {
                                    Some(self.resolve(item, Some(first)).await)
                                }
                                (Flow::Go, Err(flow)) | (flow, _) => Some(flow),
                            }
                        }
                    }
                }
                (Kind::Keyed(..), Some(ClaimOutcome::Completed(_))) => {
                    self.counters.replayed.increment(1);
                    item.span.record("outcome", "replayed");
                    None
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
                        Flow::Go => Some(self.resolve(item, first).await),
                        flow => Some(flow),
                    }
                }
                // Off the path too: what ran before is settled first.
                (Kind::Unkeyed | Kind::Dead(..), _) => {
                    match self
                        .settle_before(chunk, &mut pending, &mut settled_to, index)
                        .await
                    {
                        Flow::Go => Some(match &item.kind {
                            Kind::Dead(reason, error) => {
                                self.dead_letter(item, *reason, error, 0).await
                            }
                            _ => self.run_unkeyed(item).await,
                        }),
                        flow => Some(flow),
                    }
                }
            };
            match flow {
                None | Some(Flow::Go) => {}
                Some(flow) => return self.give_up(&mut answers, pending, flow).await,
            }
            if pending.is_empty() {
                if self.mark_settled(chunk, settled_to..=index) {
                    return Flow::Dead;
                }
                settled_to = index + 1;
            }
        }
        let flow = self.settle(chunk, &mut pending).await;
        if flow != Flow::Go {
            return flow;
        }
        if self.mark_settled(chunk, settled_to..=chunk.len() - 1) {
            return Flow::Dead;
        }
        Flow::Go
    }

    /// Claims the keyed messages of `chunk` in one store call, retrying while the store
    /// fails. The answers line up with the chunk (`None` for a message without a claim).
    async fn claim_chunk(&self, chunk: &[Item]) -> Result<Vec<Option<ClaimOutcome>>, Flow> {
        let claims: Vec<Claim> = chunk.iter().filter_map(|i| self.claim_of(i)).collect();
        let mut answers = if claims.is_empty() {
            Vec::new()
        } else {
            let mut backoff = self.backoff();
            loop {
                match self.engine.claim_many(&claims).await {
                    Ok(answers) => break answers,
                    Err(e) => self.store_error(&e),
                }
                self.stall(backoff.next()).await?;
            }
        }
        .into_iter();
        Ok(chunk
            .iter()
            .map(|item| match item.kind {
                Kind::Keyed(..) => answers.next(),
                _ => None,
            })
            .collect())
    }

    /// Runs the handler of `item` under `lease` through the engine (heartbeats, panics,
    /// the response limit), writing nothing. `Err` when the partition was given up (the
    /// handler moves to a task of its own) or the consumer crashed.
    async fn run_handler(&self, item: &Item, lease: &Lease) -> Result<Ran, Flow> {
        let Mode::Lease(handler) = &self.shared.settings.mode else {
            return Ok(Ran::Settle(Settle::Fail {
                error: "no lease-mode handler".into(),
                kind: FailureKind::Permanent,
            }));
        };
        let mut slot = None;
        let start = |ctx: Context| {
            let running = Slot::new(handler(item.msg.clone(), Some(ctx)));
            slot = Some(Arc::clone(&running));
            let offset = item.msg.offset();
            running.poll_with(move || self.probe(Point::AfterEffect, offset))
        };
        let _permit = match self.handler_permit().await {
            Ok(permit) => permit,
            Err(flow) => {
                // Stopped before the handler started: hand the lease back.
                if flow == Flow::Stop {
                    let _ = self
                        .engine
                        .settle_batch(&[Settlement::release(lease.clone())])
                        .await;
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
        if let (Err(Flow::Stop), Some(slot)) = (&result, &slot) {
            slot.detach(&self.shared.runtime, item.span.clone());
        }
        result
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
                return Flow::Dead;
            }
            *settled_to = index;
        }
        Flow::Go
    }

    /// [`Engine::settle_batch`], retried with backoff while the store fails.
    async fn settle_all(
        &self,
        batch: &[Settlement],
    ) -> Result<Vec<idem_core::Result<Outcome>>, Flow> {
        let mut backoff = self.backoff();
        loop {
            match self.guarded(self.engine.settle_batch(batch)).await? {
                Ok(answers) => return Ok(answers),
                Err(e) => self.store_error(&e),
            }
            self.stall(backoff.next()).await?;
        }
    }

    async fn settle_one(&self, item: Settlement) -> Result<idem_core::Result<Outcome>, Flow> {
        let mut answers = self.settle_all(std::slice::from_ref(&item)).await?;
        Ok(answers
            .pop()
            .unwrap_or_else(|| Err(idem_core::Error::corrupt("settle answered nothing"))))
    }

    /// Marks the messages of `range` settled, in order; says whether a probe crashed.
    fn mark_settled(&self, chunk: &[Item], range: std::ops::RangeInclusive<usize>) -> bool {
        for item in &chunk[range] {
            self.unstall();
            self.progress().settled = Some(item.msg.offset());
            if self.probe(Point::AfterSettle, item.msg.offset()) {
                return true;
            }
        }
        false
    }

    /// Stores the offset after the last settled message, unless it is stored already or
    /// the consumer crashed or gave the partition up.
    fn store_offset(&self) {
        let Some(settled) = self.progress().settled else {
            return;
        };
        if self.state.stored.load(Ordering::SeqCst) == settled
            || self.shared.dead.is_cancelled()
            || self.state.abandon.is_cancelled()
        {
            return;
        }
        let Some(consumer) = self.shared.consumer() else {
            return;
        };
        match consumer.store_offset(&self.state.topic, self.state.partition, settled) {
            Ok(()) => {
                self.state.stored.store(settled, Ordering::SeqCst);
                drop(consumer);
                let _ = self.probe(Point::AfterStore, settled);
            }
            Err(e) => tracing::debug!(
                topic = %self.state.topic, partition = self.state.partition, error = %e,
                "offset store refused (partition no longer assigned?)"
            ),
        }
    }

    // ---- Key-ordered concurrency (`in_flight` above one). ----

    /// The chunk's messages in lanes of one ordering key each: lanes run at once, up to
    /// `in_flight` handlers; a lane keeps its key's offset order, and a lane waiting for a
    /// busy key holds no other lane up. One claim for the chunk; the results of concurrent
    /// handlers are gathered into batch settles; the offset moves only over the settled
    /// prefix (the low-water mark).
    async fn process_concurrent(&self, chunk: &[Item]) -> Flow {
        let answers = if self.shared.settings.mode.is_transactional() {
            (0..chunk.len()).map(|_| None).collect()
        } else {
            let first = chunk[0].msg.offset();
            if self.probe(Point::BeforeClaim, first) {
                return Flow::Dead;
            }
            let answers = match self.claim_chunk(chunk).await {
                Ok(answers) => answers,
                Err(flow) => return flow,
            };
            if self.probe(Point::AfterClaim, first) {
                return Flow::Dead;
            }
            answers
        };
        let lanes = lanes::lanes(chunk.iter().map(|item| self.lane_key(item)));
        let shared = Lanes {
            answers: std::sync::Mutex::new(answers),
            window: std::sync::Mutex::new(Window::new(chunk.len())),
            settler: Settler::default(),
        };
        let lanes_done = tokio_util::sync::CancellationToken::new();
        let run_lanes = async {
            let mut running: FuturesUnordered<_> = lanes
                .iter()
                .map(|lane| self.run_lane(chunk, lane, &shared))
                .collect();
            let mut flow = Flow::Go;
            while let Some(f) = running.next().await {
                if flow == Flow::Go {
                    flow = f;
                }
            }
            lanes_done.cancel();
            flow
        };
        let (flow, flushed) = tokio::join!(run_lanes, self.flush(&shared.settler, &lanes_done));
        let flow = if flow == Flow::Go { flushed } else { flow };
        if flow != Flow::Go {
            let mut left = shared
                .answers
                .into_inner()
                .unwrap_or_else(|e| e.into_inner());
            return self.give_up(&mut left, Vec::new(), flow).await;
        }
        self.counters.low_water_lag.set(0.0);
        self.store_offset_past(&chunk[chunk.len() - 1]).await
    }

    /// Transactional mode: stores the offset past `item` in the store on its own, retrying
    /// while the store fails. Lease mode stores offsets in Kafka only: nothing to do.
    async fn store_offset_past(&self, item: &Item) -> Flow {
        let Mode::Transactional(tx) = &self.shared.settings.mode else {
            return Flow::Go;
        };
        let at = self.position(&item.msg);
        let mut backoff = self.backoff();
        while let Err(e) = tx.store_offset(&at).await {
            self.store_error(&e);
            if let Err(flow) = self.stall(backoff.next()).await {
                return flow;
            }
        }
        Flow::Go
    }

    /// One lane: its messages in offset order, each settled before the next starts.
    async fn run_lane(&self, chunk: &[Item], lane: &[usize], shared: &Lanes) -> Flow {
        for &i in lane {
            if let Some(flow) = self.interrupted() {
                return flow;
            }
            let item = &chunk[i];
            let answer = shared.answers.lock().unwrap_or_else(|e| e.into_inner())[i].take();
            let flow = match (&item.kind, answer) {
                (Kind::Keyed(..), Some(ClaimOutcome::Acquired(lease))) => {
                    match self.run_handler(item, &lease).await {
                        Err(flow) => flow,
                        Ok(Ran::Settle(settle)) => {
                            let reply = shared.settler.submit(Settlement { lease, settle });
                            match reply.await {
                                Ok(Ok(Outcome::Executed(_))) => {
                                    self.counters.executed.increment(1);
                                    item.span.record("outcome", "executed");
                                    Flow::Go
                                }
                                Ok(other) => self.resolve(item, Some(other)).await,
                                Err(_) => self.interrupted().unwrap_or(Flow::Stop),
                            }
                        }
                        Ok(Ran::Fenced) => self.resolve(item, Some(Ok(Outcome::Fenced))).await,
                    }
                }
                (Kind::Keyed(..), Some(ClaimOutcome::Completed(_))) => {
                    self.counters.replayed.increment(1);
                    item.span.record("outcome", "replayed");
                    Flow::Go
                }
                (Kind::Keyed(..), other) => {
                    let first = other
                        .and_then(|a| Engine::lease_or_outcome(a).err())
                        .map(Ok);
                    self.resolve(item, first).await
                }
                (Kind::Unkeyed, _) => self.run_unkeyed(item).await,
                (Kind::Dead(reason, error), _) => self.dead_letter(item, *reason, error, 0).await,
            };
            if flow != Flow::Go {
                return flow;
            }
            self.unstall();
            if self.probe(Point::AfterSettle, item.msg.offset()) {
                return Flow::Dead;
            }
            let (moved, lag) = {
                let mut window = shared.window.lock().unwrap_or_else(|e| e.into_inner());
                (window.settle(i), window.lag())
            };
            self.counters.low_water_lag.set(lag as f64);
            if let Some(mark) = moved {
                self.progress().settled = Some(chunk[mark - 1].msg.offset());
                self.store_offset();
            }
        }
        Flow::Go
    }

    /// Settles what the lanes queue, one store call per flush, until the lanes are done.
    async fn flush(
        &self,
        settler: &Settler,
        lanes_done: &tokio_util::sync::CancellationToken,
    ) -> Flow {
        let flow = loop {
            tokio::select! {
                biased;
                () = settler.queued() => {}
                () = lanes_done.cancelled() => break Flow::Go,
            }
            let (batch, replies): (Vec<Settlement>, Vec<_>) = settler.take().into_iter().unzip();
            if batch.is_empty() {
                continue;
            }
            match self.settle_all(&batch).await {
                Ok(answers) => {
                    for (reply, answer) in replies.into_iter().zip(answers) {
                        let _ = reply.send(answer);
                    }
                }
                Err(flow) => break flow,
            }
        };
        settler.close();
        flow
    }

    /// A permit to run one handler: at most `in_flight` run at once in a partition. `Stop`
    /// if the partition is given up while waiting: no handler starts after that.
    async fn handler_permit(&self) -> Result<InFlight<'_>, Flow> {
        // One handler at a time: the partition's single permit would always be free here
        // (handlers run in turn), so none is taken.
        if self.shared.settings.in_flight == 1 {
            self.counters.in_flight.increment(1.0);
            return Ok(InFlight {
                _permit: None,
                gauge: &self.counters.in_flight,
            });
        }
        let permit = tokio::select! {
            biased;
            p = self.permits.acquire() => p,
            () = self.shared.dead.cancelled() => return Err(Flow::Dead),
            () = self.state.stop.cancelled() => return Err(Flow::Stop),
        };
        self.counters.in_flight.increment(1.0);
        Ok(InFlight {
            _permit: permit.ok(),
            gauge: &self.counters.in_flight,
        })
    }

    // ---- Off the fast path: one message until it is settled. ----

    /// Settles one message whatever it takes, starting from `first` if the fast path got
    /// an outcome already: asks the store again, waits while another worker holds the key,
    /// retries a failed handler, dead-letters a poisoned or mismatched key. `Go` once the
    /// message is settled.
    async fn resolve(&self, item: &Item, first: Option<idem_core::Result<Outcome>>) -> Flow {
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
                    backoff.next()
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
                        WaitPolicy::Return => backoff.next(),
                    };
                    let until_lapse = lease_until.since(Timestamp::now());
                    let wait = every.min(until_lapse + Duration::from_millis(1));
                    tracing::debug!(parent: span, %owner, ?wait, "key in progress elsewhere: waiting");
                    wait
                }
                Ok(Outcome::Failed { attempts, error }) => {
                    tracing::debug!(parent: span, attempts, %error, "handler failed; retrying");
                    backoff.next()
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
        if let Mode::Transactional(tx) = &self.shared.settings.mode {
            let offset = item.msg.offset();
            if self.probe(Point::BeforeClaim, offset) {
                return Err(Flow::Dead);
            }
            // Concurrent transactions may commit out of offset order: the offset is then
            // stored apart, at the low-water mark (see `process_concurrent`).
            let at = (self.shared.settings.in_flight == 1).then(|| self.position(&item.msg));
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
        let mut backoff = self.backoff();
        let answer = loop {
            match self
                .guarded(self.engine.claim_many(std::slice::from_ref(&claim)))
                .await?
            {
                Ok(mut answers) => break answers.pop(),
                Err(e) => self.store_error(&e),
            }
            self.stall(backoff.next()).await?;
        };
        let Some(answer) = answer else {
            return Ok(Err(idem_core::Error::corrupt("claim answered nothing")));
        };
        let lease = match Engine::lease_or_outcome(answer) {
            Ok(lease) => lease,
            Err(outcome) => return Ok(Ok(outcome)),
        };
        match self.run_handler(item, &lease).await? {
            Ran::Fenced => Ok(Ok(Outcome::Fenced)),
            Ran::Settle(settle) => self.settle_one(Settlement { lease, settle }).await,
        }
    }

    /// Transactional mode: each run of keyed messages in one transaction of the store
    /// (claims first, then the handlers (a savepoint each only after a failure), then the records and
    /// the offset past the run's settled prefix in one commit); a message the batch left
    /// unsettled (failed, fenced, busy, poisoned) is then resolved on its own, in order, and
    /// keyless messages one by one. A store error fails the whole transaction: its
    /// messages are then resolved one by one (their claims committed, so each waits for its
    /// lease to lapse).
    async fn process_transactional(&self, chunk: &[Item]) -> Flow {
        let Mode::Transactional(tx) = &self.shared.settings.mode else {
            return Flow::Stop;
        };
        let mut start = 0;
        while start < chunk.len() {
            let keyed = chunk[start..]
                .iter()
                .take_while(|item| matches!(item.kind, Kind::Keyed(..)))
                .count();
            if keyed == 0 {
                let flow = self.process_one_by_one(&chunk[start..=start]).await;
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
                return Flow::Dead;
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
            drop(permit);
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
                    return Flow::Dead;
                }
            }
            if store_last {
                let flow = self.store_offset_past(&run[run.len() - 1]).await;
                if flow != Flow::Go {
                    return flow;
                }
            }
        }
        Flow::Go
    }

    /// The crash probe for a transaction's handlers.
    fn tx_hook(&self) -> crate::tx::Hook {
        let (shared, state) = (Arc::clone(&self.shared), Arc::clone(&self.state));
        Arc::new(move |point, offset| probe_at(&shared, &state, point, offset))
    }

    /// Transactional mode, one message at a time: each in a transaction of its own.
    async fn process_one_by_one(&self, chunk: &[Item]) -> Flow {
        for item in chunk {
            if let Some(flow) = self.interrupted() {
                return flow;
            }
            let flow = match &item.kind {
                Kind::Keyed(..) => self.resolve(item, None).await,
                Kind::Unkeyed => self.run_unkeyed(item).await,
                Kind::Dead(reason, error) => self.dead_letter(item, *reason, error, 0).await,
            };
            if flow != Flow::Go {
                return flow;
            }
            if self.mark_settled(std::slice::from_ref(item), 0..=0) {
                return Flow::Dead;
            }
        }
        Flow::Go
    }

    /// Runs the handler of a keyless message without a claim (`MissingKey::Process`),
    /// retrying retryable failures in place up to the engine's attempts.
    async fn run_unkeyed(&self, item: &Item) -> Flow {
        let Mode::Lease(handler) = &self.shared.settings.mode else {
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
            let slot = Slot::new(futures::FutureExt::boxed(idem_core::panic_at_poll(|| {
                handler(msg, None)
            })));
            let offset = item.msg.offset();
            let run = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(
                slot.poll_with(|| self.probe(Point::AfterEffect, offset)),
            ));
            let error = match self.guarded(run.instrument(span.clone())).await {
                Err(flow) => {
                    if flow == Flow::Stop {
                        slot.detach(&self.shared.runtime, span.clone());
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
            if let Err(flow) = self.stall(backoff.next()).await {
                return flow;
            }
        }
    }

    /// Writes a dead letter, retrying until the broker acknowledges it; in transactional
    /// mode the offset past it is then stored in the store too (so a seek skips it).
    async fn dead_letter(&self, item: &Item, reason: Reason, error: &str, attempts: u32) -> Flow {
        let mut backoff = self.backoff();
        let letter = Letter {
            message: &item.msg,
            reason,
            error,
            attempts,
        };
        loop {
            match self.guarded(self.shared.dead_letters.send(&letter)).await {
                Err(flow) => return flow,
                Ok(Ok(())) => break,
                Ok(Err(e)) => {
                    tracing::warn!(parent: &item.span, error = %e, "dead-letter write failed: partition stalled");
                }
            }
            if let Err(flow) = self.stall(backoff.next()).await {
                return flow;
            }
        }
        self.counters.dead_lettered.increment(1);
        item.span.record("outcome", "dead-lettered");
        tracing::warn!(parent: &item.span, reason = reason.as_str(), error, "dead-lettered");
        if self.shared.settings.in_flight > 1 {
            // Lanes run at once: messages before this one may be unsettled still, and a
            // crash after storing past this one would skip them. The offset is stored at
            // the low-water mark instead (see `process_concurrent`).
            return Flow::Go;
        }
        self.store_offset_past(item).await
    }

    // ---- Giving up, stalling, probing. ----

    /// Whether the partition was given up or the consumer crashed.
    fn interrupted(&self) -> Option<Flow> {
        if self.shared.dead.is_cancelled() {
            Some(Flow::Dead)
        } else if self.state.stop.is_cancelled() {
            Some(Flow::Stop)
        } else {
            None
        }
    }

    /// Leaves a chunk early: what already ran is settled (its work is done), and the leases
    /// claimed for messages that will not run here are released in one call, so the next
    /// owner of the partition runs them at once and no attempt is spent. A crash writes
    /// nothing.
    async fn give_up(
        &self,
        answers: &mut [Option<ClaimOutcome>],
        mut pending: Vec<Pending>,
        flow: Flow,
    ) -> Flow {
        if flow == Flow::Dead || self.shared.dead.is_cancelled() {
            return Flow::Dead;
        }
        let mut batch: Vec<Settlement> = pending.drain(..).map(|p| p.settlement).collect();
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

    /// Pauses the partition and sleeps `wait`, after storing what is settled. `Err` when
    /// the partition is revoked or the consumer crashed meanwhile.
    async fn stall(&self, wait: Duration) -> Result<(), Flow> {
        self.store_offset();
        if !std::mem::replace(&mut self.progress().stalled, true) {
            self.state.set_pause(&self.shared, STALL, true);
        }
        tokio::select! {
            biased;
            () = self.shared.dead.cancelled() => Err(Flow::Dead),
            () = self.state.stop.cancelled() => Err(Flow::Stop),
            () = tokio::time::sleep(wait) => Ok(()),
        }
    }

    /// Resumes a partition paused for a stall, now that a message settled.
    fn unstall(&self) {
        if std::mem::replace(&mut self.progress().stalled, false) {
            self.state.set_pause(&self.shared, STALL, false);
        }
    }

    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Polls `work` unless the consumer crashes (`Dead`) or the partition is given up for
    /// good (`Stop`, once the revoke timeout passed) first.
    async fn guarded<T>(&self, work: impl Future<Output = T>) -> Result<T, Flow> {
        tokio::select! {
            biased;
            r = work => Ok(r),
            () = self.shared.dead.cancelled() => Err(Flow::Dead),
            () = self.state.abandon.cancelled() => Err(Flow::Stop),
        }
    }

    fn store_error(&self, e: &idem_core::Error) {
        self.counters.store_errors.increment(1);
        tracing::warn!(
            topic = %self.state.topic, partition = self.state.partition, error = %e,
            "store error: partition stalled until the store answers"
        );
    }

    fn backoff(&self) -> Backoff {
        Backoff::new(self.shared.settings.backoff)
    }

    /// How many of the `left` messages to claim at once: all of them while handlers are
    /// fast, fewer when a chunk would take longer than [`SETTLE_WITHIN`] or a quarter of
    /// the lease to run (its results are settled, and its offsets stored, only at its
    /// end). The first chunk, before any handler was timed, is at most [`FIRST_CHUNK`].
    ///
    /// With handlers in flight at once, a chunk always holds the leading messages whose
    /// ordering keys differ, up to `in_flight`: they start together, so no lease of theirs
    /// waits for another handler, however slow the handlers are (a chunk sized by time
    /// alone shrank to one message, and ran slow handlers one at a time).
    fn chunk_len(&self, left: &[Item]) -> usize {
        let in_flight = self.shared.settings.in_flight;
        let fits = if self.per_message.is_zero() {
            FIRST_CHUNK
        } else {
            let budget = (self.engine.lease_ttl() / 4).min(SETTLE_WITHIN);
            let fits = budget.as_nanos() / self.per_message.as_nanos().max(1);
            usize::try_from(fits).unwrap_or(usize::MAX)
        };
        // The floor is at most `in_flight`: with fast handlers the budget already holds
        // that many, and the keys need not be read.
        let floor = if fits < in_flight {
            lanes::distinct_prefix(left.iter().map(|item| self.lane_key(item)), in_flight)
        } else {
            1
        };
        left.len().min(fits.max(floor).max(1))
    }

    /// The key that orders `item` among concurrent handlers, if any.
    fn lane_key<'a>(&self, item: &'a Item) -> Option<LaneKey<'a>> {
        match self.shared.settings.order_by {
            OrderBy::IdempotencyKey => item.msg.key().map(LaneKey::Id),
            _ => item.msg.message_key().map(LaneKey::Message),
        }
    }

    fn position(&self, msg: &Message) -> OffsetPosition {
        OffsetPosition {
            group: self.shared.settings.group.clone(),
            topic: msg.topic().to_owned(),
            partition: msg.partition(),
            offset: msg.offset(),
        }
    }

    /// Asks the probe, if any; a crash verdict kills the consumer. Says whether it did.
    fn probe(&self, point: Point, offset: i64) -> bool {
        probe_at(&self.shared, &self.state, point, offset)
    }
}

/// Asks the probe about `point` for the message at `offset` of `state`'s partition; a
/// crash verdict kills the consumer. Says whether it did.
fn probe_at(shared: &Shared, state: &PartitionState, point: Point, offset: i64) -> bool {
    if shared.probe(point, &state.topic, state.partition, offset) {
        if !shared.dead.is_cancelled() {
            tracing::info!(?point, topic = %state.topic, partition = state.partition, offset, "probe: crash");
            shared.crash();
        }
        return true;
    }
    false
}

/// Exponential backoff between two bounds.
struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    fn new((first, max): (Duration, Duration)) -> Self {
        Backoff { next: first, max }
    }

    fn next(&mut self) -> Duration {
        let d = self.next;
        self.next = d.saturating_mul(2).min(self.max);
        d
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_bound_and_never_overflows() {
        let ms = Duration::from_millis;
        let mut b = Backoff::new((ms(20), ms(50)));
        assert_eq!([b.next(), b.next(), b.next()], [ms(20), ms(40), ms(50)]);
        let mut far = Backoff::new((Duration::MAX, Duration::MAX));
        assert_eq!([far.next(), far.next()], [Duration::MAX; 2]);
    }
}
