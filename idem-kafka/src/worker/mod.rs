//! One partition's worker. The path of one message reads top to bottom:
//!
//! 1. [`Worker::run`] takes a batch of what waits in the partition's own queue in the
//!    client (`intake.rs`; the queue is split off when the partition is assigned,
//!    `consumer.rs`, and read through `queue.rs`);
//! 2. [`Worker::key`] finds each message's idempotency key, and [`Worker::process`] cuts
//!    the batch into chunks and hands each to its mode's path:
//!    - `lease.rs`: one handler at a time under a lease (`in_flight` 1);
//!    - `lanes.rs`: handlers at once in lanes of one ordering key each (`in_flight` > 1);
//!    - `transactional.rs`: the handler, its record and the offset in one transaction;
//! 3. a message off its path (its key busy elsewhere, a failed handler, a lease lost, a
//!    poisoned key, a store outage) goes to `resolve.rs`, which settles that one message
//!    before the partition moves on;
//! 4. [`Worker::store_offset`], the one place an offset is stored in the client, stores it
//!    past the settled prefix after each chunk and before each stall;
//! 5. the poll thread commits the stored offsets (`consumer.rs`).
//!
//! A worker sees the consumer only through its [`Ctx`]: the settings, the client handle it
//! pauses and stores offsets through, the crash token with the probe, and the dead-letter
//! producer.

mod intake;
mod lanes;
mod lease;
mod resolve;
mod running;
mod transactional;

pub(crate) use running::Running;

use intake::Intake;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem_core::backend::{Claim, ClaimOutcome, OffsetPosition};
use idem_core::{Engine, Outcome, Timestamp};
use tokio::sync::Semaphore;
use tracing::Span;

use crate::Message;
use crate::client::Client;
use crate::crash::Crash;
use crate::dead_letter::Reason;
use crate::dead_letter::write::Writer;
use crate::handle::{BACKLOG, PartitionState, STALL, WorkerEnds};
use crate::key::Extracted;
use crate::metrics::Counters;
use crate::order::OrderBy;
use crate::probe::Point;
use crate::settings::{Mode, Settings};
use idem_core::binding::Backoff;
use idem_core::binding::MissingKey;

/// How many messages the first chunk of a partition claims, before any handler was timed.
const FIRST_CHUNK: usize = 16;

/// What a partition's worker gets of the consumer.
pub(crate) struct Ctx {
    pub settings: Arc<Settings>,
    /// Pauses and resumes partitions, stores offsets.
    pub client: Client,
    /// Set off by a crash probe (or a dropped `run`): nothing is written after it.
    pub crash: Crash,
    pub letters: Writer,
    /// Partitions that may work at once (`partition_concurrency`).
    pub permits: Option<Arc<Semaphore>>,
    /// The keys whose handler runs in this consumer now.
    pub running: Arc<Running>,
}

/// What the rest of a partition's work should do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flow {
    /// Go on with the next message.
    Go,
    /// The partition was revoked (or the consumer is shutting down): dispatch nothing more.
    Stop,
    /// The consumer crashed: do nothing more at all.
    Crashed,
}

/// A message and what its key source made of it.
struct Item {
    msg: Message,
    kind: Kind,
    span: Span,
}

enum Kind {
    /// The payload's fingerprint, hashed as the batch is keyed (the key is the message's,
    /// [`Message::idempotency_key`]); the claim is built where it is sent ([`Worker::claim_of`]), so
    /// no copy of it is kept.
    Keyed(Option<idem_core::Fingerprint>),
    Unkeyed,
    /// No usable key: dead-letter it for this reason.
    DeadLetter(Reason, String),
}

/// What a failed call that is retried was talking to.
#[derive(Clone, Copy)]
enum Failing<'a> {
    Store,
    /// The dead-letter producer, for the message of this span.
    Broker(&'a Span),
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
    ctx: Arc<Ctx>,
    state: Arc<PartitionState>,
    engine: Engine,
    ends: Option<WorkerEnds>,
    counters: Counters,
    progress: std::sync::Mutex<Progress>,
    /// Handlers that may run at once (`in_flight`).
    permits: Semaphore,
    /// Average time to run one message, to keep claims ahead of their handler short.
    per_message: Duration,
    /// Time spent in store calls ([`Worker::retry`] on the store), in nanoseconds, so far:
    /// a chunk's own time, less this, is its handlers' time.
    store_nanos: AtomicU64,
}

impl Worker {
    pub fn new(ctx: Arc<Ctx>, state: Arc<PartitionState>, ends: WorkerEnds) -> Worker {
        Worker {
            counters: Counters::new(&state.topic, state.partition),
            engine: ctx.settings.engine.clone(),
            permits: Semaphore::new(ctx.settings.in_flight),
            ctx,
            state,
            ends: Some(ends),
            progress: Default::default(),
            per_message: Duration::ZERO,
            store_nanos: AtomicU64::new(0),
        }
    }

    fn settings(&self) -> &Settings {
        &self.ctx.settings
    }

    /// Takes batches in order until the partition is revoked or the consumer stops. The
    /// next batch is taken while the current one waits on its store, so the copy out of
    /// the client overlaps the round trips; the byte bound covers both batches.
    pub async fn run(mut self) {
        let Some(ends) = self.ends.take() else {
            return;
        };
        // Until the partition's start is known (transactional mode: the store answered),
        // nothing is taken; it is paused in the client meanwhile.
        tokio::select! {
            biased;
            () = self.ctx.crash.happens() => return,
            () = self.state.stop.fired() => return,
            () = self.state.positioned.fired() => {}
        }
        let mut intake = Intake::new(ends, Arc::clone(&self.state));
        let batch_size = self.settings().batch_size;
        let mut batch = Vec::with_capacity(batch_size);
        let mut next = Vec::with_capacity(batch_size);
        let mut routed_next = 0;
        loop {
            std::mem::swap(&mut batch, &mut next);
            let mut routed = std::mem::take(&mut routed_next) + intake.fill(&mut batch, batch_size);
            while batch.is_empty() {
                let got = tokio::select! {
                    biased;
                    () = self.ctx.crash.happens() => return,
                    () = self.state.stop.fired() => return,
                    got = intake.wait(&mut batch) => got,
                };
                let Some(n) = got else {
                    return;
                };
                routed += n + intake.fill(&mut batch, batch_size);
            }
            let permit = match self.ctx.permits.clone() {
                None => None,
                Some(sem) => tokio::select! {
                    biased;
                    () = self.ctx.crash.happens() => return,
                    () = self.state.stop.fired() => return,
                    p = sem.acquire_owned() => p.ok(),
                },
            };
            let taken = routed;
            let (flow, ()) = futures::join!(self.process(&mut batch), async {
                // After the batch's first wait (at once for a store that never waits).
                tokio::task::yield_now().await;
                routed_next = intake.fill(&mut next, batch_size);
            });
            drop(permit);
            batch.clear();
            // Counted until handled: the bound covers messages waiting and in flight.
            let before = self.state.backlog.fetch_sub(taken, Ordering::Relaxed);
            let after = before.saturating_sub(taken);
            if after <= self.settings().max_buffered / 2 {
                self.state.set_pause(&self.ctx.client, BACKLOG, false);
            }
            // Ran low: the poll thread may be parked, waiting for a partition to.
            let ahead = self.settings().read_ahead();
            if before >= ahead && after < ahead {
                self.ctx.client.wake_poller();
            }
            if flow != Flow::Go {
                return;
            }
        }
    }

    /// One poll batch, in chunks short enough that no claimed lease waits long for its
    /// handler; the offset past what settled is stored after each chunk.
    async fn process(&mut self, batch: &mut Vec<Message>) -> Flow {
        let items: Vec<Item> = batch.drain(..).map(|m| self.key(m)).collect();
        let mut start = 0;
        while start < items.len() {
            let end = start + self.chunk_len(&items[start..]);
            let began = Instant::now();
            let store_before = self.store_nanos.load(Ordering::Relaxed);
            let chunk = &items[start..end];
            let flow = match &self.settings().mode {
                _ if self.settings().in_flight > 1 => self.process_lanes(chunk).await,
                Mode::Lease(_) => self.process_leased(chunk).await,
                Mode::Transactional(_) => self.process_transactional(chunk).await,
            };
            self.store_offset();
            if flow != Flow::Go {
                return flow;
            }
            // The handlers' time alone: the chunk's claim and settle take a round trip
            // each however long the chunk is. Counted in, they made a chunk slowed by its
            // store (a cold connection, a stall) look like slow handlers, and the chunks
            // after it short, each paying both round trips again, for dozens of chunks.
            // In transactional mode the store's time is the chunk's work (its handlers'
            // statements run in the transaction), so all of it counts, as before.
            let store = match self.settings().mode {
                Mode::Lease(_) => self
                    .store_nanos
                    .load(Ordering::Relaxed)
                    .saturating_sub(store_before),
                Mode::Transactional(_) => 0,
            };
            let handlers = began.elapsed().saturating_sub(Duration::from_nanos(store));
            let each = handlers / u32::try_from(chunk.len()).unwrap_or(u32::MAX);
            self.per_message = if self.per_message.is_zero() {
                each
            } else {
                (self.per_message * 7 + each) / 8
            };
            start = end;
        }
        Flow::Go
    }

    /// The key of a message, or why it has none usable.
    fn key(&self, msg: Message) -> Item {
        let s = self.settings();
        let (msg, kind) = match s.key_source.extract(&s.namespace, &msg) {
            Extracted::Key(key) => {
                let fingerprint = self.engine.fingerprint_of(msg.payload());
                (msg.with_key(key), Kind::Keyed(fingerprint))
            }
            Extracted::Missing if s.missing_key == MissingKey::Process => (msg, Kind::Unkeyed),
            Extracted::Missing => {
                let why = format!("no idempotency key ({:?})", s.key_source);
                (msg, Kind::DeadLetter(Reason::MissingKey, why))
            }
            Extracted::Invalid(reason) => (msg, Kind::DeadLetter(Reason::InvalidKey, reason)),
            Extracted::Malformed(reason) => {
                (msg, Kind::DeadLetter(Reason::MalformedPayload, reason))
            }
            // An answer of a later key source: no key to claim under, so it is not run.
            other => {
                let why = format!("{other:?}");
                (msg, Kind::DeadLetter(Reason::InvalidKey, why))
            }
        };
        // The key is a field from the start: no `record` per message, and nothing is
        // formatted while no subscriber wants the span.
        let span = tracing::info_span!(
            "idem_kafka.message",
            topic = %self.state.topic,
            partition = self.state.partition,
            offset = msg.offset(),
            key = msg.idempotency_key().map(tracing::field::display),
            outcome = tracing::field::Empty,
        );
        Item { msg, kind, span }
    }

    /// The claim of a keyed message (its key, this engine's settings, the payload's
    /// fingerprint); `None` for a message without a key.
    fn claim_of(&self, item: &Item) -> Option<Claim> {
        match &item.kind {
            Kind::Keyed(fingerprint) => {
                let key = item.msg.idempotency_key()?;
                Some(self.engine.claim_with(key, *fingerprint))
            }
            _ => None,
        }
    }

    /// Claims the keyed messages of `chunk` in one store call, retrying while the store
    /// fails. The answers line up with the chunk (`None` for a message without a claim). A
    /// key whose handler runs in this consumer now is not claimed: it is answered
    /// [`Worker::running_here`].
    async fn claim_chunk(&self, chunk: &[Item]) -> Result<Vec<Option<ClaimOutcome>>, Flow> {
        fn keyed(item: &Item) -> Option<&idem_core::Key> {
            match item.kind {
                Kind::Keyed(..) => item.msg.idempotency_key(),
                _ => None,
            }
        }
        let busy = self.ctx.running.which(chunk.iter().map(keyed));
        let claims: Vec<Claim> = chunk
            .iter()
            .zip(&busy)
            .filter(|(_, busy)| !**busy)
            .filter_map(|(i, _)| self.claim_of(i))
            .collect();
        let mut answers = if claims.is_empty() {
            Vec::new()
        } else {
            self.retry(Failing::Store, || self.engine.claim_many(&claims))
                .await?
        }
        .into_iter();
        Ok(chunk
            .iter()
            .zip(busy)
            .map(|(item, busy)| match item.kind {
                Kind::Keyed(..) if busy => {
                    let (owner, lease_until) = self.running_here();
                    Some(ClaimOutcome::InProgress { owner, lease_until })
                }
                Kind::Keyed(..) => answers.next(),
                _ => None,
            })
            .collect())
    }

    /// The answer for a key whose handler runs in this consumer now, instead of a claim:
    /// in progress (owner, lease end) under this owner, so the message waits for it like
    /// for a key in progress elsewhere (a claim could take over a lease that lapsed while
    /// that handler ran, and start a second handler of the key beside it).
    fn running_here(&self) -> (Arc<str>, Timestamp) {
        let lease_until = Timestamp::now().saturating_add(self.engine.lease_ttl());
        (Arc::from(self.engine.owner()), lease_until)
    }

    /// [`Worker::running_here`] as the outcome a message waits on.
    fn busy_here(&self) -> Outcome {
        let (owner, lease_until) = self.running_here();
        Outcome::InProgress { owner, lease_until }
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

    /// Stores the offset after the last settled message in the client, unless it is
    /// stored already or the consumer crashed or gave the partition up. The one place an
    /// offset goes to the client.
    fn store_offset(&self) {
        let Some(settled) = self.progress().settled else {
            return;
        };
        if self.state.stored.load(Ordering::SeqCst) == settled
            || self.ctx.crash.happened()
            || self.state.abandon.is_fired()
        {
            return;
        }
        let (topic, partition) = (&*self.state.topic, self.state.partition);
        if self.ctx.client.store_offset(topic, partition, settled) {
            self.state.stored.store(settled, Ordering::SeqCst);
            let _ = self.probe(Point::AfterStore, settled);
        }
    }

    /// A permit to run one handler: at most `in_flight` run at once in a partition. `Stop`
    /// if the partition is given up while waiting: no handler starts after that.
    async fn handler_permit(&self) -> Result<InFlight<'_>, Flow> {
        // One handler at a time: the partition's single permit would always be free here
        // (handlers run in turn), so none is taken.
        if self.settings().in_flight == 1 {
            self.counters.in_flight.increment(1.0);
            return Ok(InFlight {
                _permit: None,
                gauge: &self.counters.in_flight,
            });
        }
        let permit = tokio::select! {
            biased;
            p = self.permits.acquire() => p,
            () = self.ctx.crash.happens() => return Err(Flow::Crashed),
            () = self.state.stop.fired() => return Err(Flow::Stop),
        };
        self.counters.in_flight.increment(1.0);
        Ok(InFlight {
            _permit: permit.ok(),
            gauge: &self.counters.in_flight,
        })
    }

    // ---- Retrying, giving up, stalling, probing. ----

    /// Calls `op` until it succeeds: the one retry loop for a store or a broker. Between
    /// tries the partition stalls (paused, offsets stored) with backoff. `Err` when the
    /// partition is given up or the consumer crashes first.
    async fn retry<T, E, Fut>(&self, on: Failing<'_>, op: impl FnMut() -> Fut) -> Result<T, Flow>
    where
        E: std::fmt::Display,
        Fut: Future<Output = Result<T, E>>,
    {
        let began = Instant::now();
        let answer = self.retry_inner(on, op).await;
        if matches!(on, Failing::Store) {
            let took = u64::try_from(began.elapsed().as_nanos()).unwrap_or(u64::MAX);
            self.store_nanos.fetch_add(took, Ordering::Relaxed);
        }
        answer
    }

    /// [`Worker::retry`], untimed.
    async fn retry_inner<T, E, Fut>(
        &self,
        on: Failing<'_>,
        mut op: impl FnMut() -> Fut,
    ) -> Result<T, Flow>
    where
        E: std::fmt::Display,
        Fut: Future<Output = Result<T, E>>,
    {
        let mut backoff = self.backoff();
        loop {
            match self.guarded(op()).await? {
                Ok(value) => return Ok(value),
                Err(e) => match on {
                    Failing::Store => self.store_error(&e),
                    Failing::Broker(span) => {
                        tracing::warn!(parent: span, error = %e, "dead-letter write failed: partition stalled");
                    }
                },
            }
            self.stall(backoff.wait()).await?;
        }
    }

    /// Whether the partition was given up or the consumer crashed.
    fn interrupted(&self) -> Option<Flow> {
        if self.ctx.crash.happened() {
            Some(Flow::Crashed)
        } else if self.state.stop.is_fired() {
            Some(Flow::Stop)
        } else {
            None
        }
    }

    /// Pauses the partition and sleeps `wait`, after storing what is settled. `Err` when
    /// the partition is revoked or the consumer crashed meanwhile.
    async fn stall(&self, wait: Duration) -> Result<(), Flow> {
        self.store_offset();
        if !std::mem::replace(&mut self.progress().stalled, true) {
            self.state.set_pause(&self.ctx.client, STALL, true);
        }
        tokio::select! {
            biased;
            () = self.ctx.crash.happens() => Err(Flow::Crashed),
            () = self.state.stop.fired() => Err(Flow::Stop),
            () = tokio::time::sleep(wait) => Ok(()),
        }
    }

    /// Resumes a partition paused for a stall, now that a message settled.
    fn unstall(&self) {
        if std::mem::replace(&mut self.progress().stalled, false) {
            self.state.set_pause(&self.ctx.client, STALL, false);
        }
    }

    fn progress(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Polls `work` unless the consumer crashes (`Crashed`) or the partition is given up
    /// for good (`Stop`, once the revoke timeout passed) first.
    async fn guarded<T>(&self, work: impl Future<Output = T>) -> Result<T, Flow> {
        tokio::select! {
            biased;
            r = work => Ok(r),
            () = self.ctx.crash.happens() => Err(Flow::Crashed),
            () = self.state.abandon.fired() => Err(Flow::Stop),
        }
    }

    fn store_error(&self, e: &dyn std::fmt::Display) {
        self.counters.store_errors.increment(1);
        tracing::warn!(
            topic = %self.state.topic, partition = self.state.partition, error = %e,
            "store error: partition stalled until the store answers"
        );
    }

    fn backoff(&self) -> Backoff {
        Backoff::new(self.settings().retry_backoff)
    }

    /// How many of the `left` messages to claim at once: all of them while handlers are
    /// fast, fewer when a chunk's handlers would take longer than `settle_within` or a
    /// quarter of the lease to run (its results are settled, and its offsets stored, only
    /// at its end; its claim and settle come on top, one round trip each). The first
    /// chunk, before any handler was timed, is at most [`FIRST_CHUNK`].
    ///
    /// With handlers in flight at once, a chunk always holds the leading messages whose
    /// ordering keys differ, up to `in_flight`: they start together, so no lease of theirs
    /// waits for another handler, however slow the handlers are (a chunk sized by time
    /// alone shrank to one message, and ran slow handlers one at a time).
    ///
    /// In lease mode no chunk is longer than `max_unsettled`, that floor included: a chunk
    /// is the most effects that may have run without being settled (the lanes of a chunk
    /// all end before the next chunk starts), so the most a crash repeats.
    fn chunk_len(&self, left: &[Item]) -> usize {
        let settings = self.settings();
        let in_flight = settings.in_flight;
        let fits = if self.per_message.is_zero() {
            FIRST_CHUNK
        } else {
            let budget = (self.engine.lease_ttl() / 4).min(settings.settle_within);
            let fits = budget.as_nanos() / self.per_message.as_nanos().max(1);
            usize::try_from(fits).unwrap_or(usize::MAX)
        };
        // The floor is at most `in_flight`: with fast handlers the budget already holds
        // that many, and the keys need not be read.
        let floor = if fits < in_flight {
            idem_core::binding::distinct_prefix(
                left.iter().map(|item| self.lane_key(item)),
                in_flight,
            )
        } else {
            1
        };
        let len = left.len().min(fits.max(floor).max(1));
        match settings.mode {
            Mode::Lease(_) => len.min(settings.max_unsettled),
            Mode::Transactional(_) => len,
        }
    }

    /// The key that orders `item` among concurrent handlers, if any.
    fn lane_key<'a>(&self, item: &'a Item) -> Option<LaneKey<'a>> {
        match self.settings().order_by {
            OrderBy::IdempotencyKey => item.msg.idempotency_key().map(LaneKey::Id),
            _ => item.msg.message_key().map(LaneKey::Message),
        }
    }

    fn position(&self, msg: &Message) -> OffsetPosition {
        OffsetPosition {
            group: self.settings().group.clone(),
            topic: msg.topic().to_owned(),
            partition: msg.partition(),
            offset: msg.offset(),
        }
    }

    /// Asks the probe, if any; a crash verdict crashes the consumer. Says whether it did.
    fn probe(&self, point: Point, offset: i64) -> bool {
        let state = &self.state;
        self.ctx
            .crash
            .at(point, &state.topic, state.partition, offset)
    }
}

/// What a lane is ordered by.
#[derive(Hash, PartialEq, Eq)]
enum LaneKey<'a> {
    Id(&'a idem_core::Key),
    Message(&'a bytes::Bytes),
}
