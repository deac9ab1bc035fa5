//! One partition's worker: takes poll batches in order, claims each batch in one round
//! trip, settles message by message, and stores an offset only past settled messages.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idem_core::{Claim, ClaimOutcome, Fingerprint};
use rdkafka::consumer::Consumer;
use rdkafka::message::{BorrowedMessage, Message as _};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::Span;

use crate::Message;
use crate::config::MissingKey;
use crate::consumer::{Shared, Tp, tp_list};
use crate::dlq::Reason;
use crate::key::Extracted;
use crate::metrics::Counters;
use crate::probe::{Point, Verdict};
use crate::run::Backoff;

/// Pause reasons: the worker's buffer is full, or the worker is stalled.
const BACKLOG: u8 = 1;
const STALL: u8 = 2;

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

/// A partition's state shared by its worker, the poll thread and the rebalance callback.
pub(crate) struct PartitionState {
    pub topic: Arc<str>,
    pub partition: i32,
    /// Stop dispatching (revoke, shutdown); in-flight work may finish.
    pub stop: CancellationToken,
    /// Give up in-flight work too (the revoke timeout passed).
    pub abandon: CancellationToken,
    backlog: AtomicUsize,
    pause: Mutex<u8>,
}

impl PartitionState {
    /// Sets or clears one pause reason, pausing or resuming the partition in the client
    /// when the set of reasons becomes non-empty or empty.
    pub fn set_pause(&self, shared: &Shared, reason: u8, on: bool) {
        let mut reasons = self.pause.lock().unwrap_or_else(|e| e.into_inner());
        let before = *reasons;
        if on {
            *reasons |= reason;
        } else {
            *reasons &= !reason;
        }
        if (before == 0) == (*reasons == 0) {
            return;
        }
        let Some(consumer) = shared.consumer() else {
            return;
        };
        let tpl = tp_list(&self.topic, self.partition);
        let result = if *reasons != 0 {
            consumer.pause(&tpl)
        } else {
            consumer.resume(&tpl)
        };
        if let Err(e) = result {
            tracing::debug!(topic = %self.topic, partition = self.partition, error = %e, "pause/resume");
        }
    }
}

/// What the poll thread and the callbacks keep of a worker.
pub(crate) struct WorkerHandle {
    pub state: Arc<PartitionState>,
    tx: mpsc::UnboundedSender<Message>,
    task: Option<JoinHandle<()>>,
    /// Disconnected when the worker's task ends, however it ends.
    done: std::sync::mpsc::Receiver<()>,
    last_routed: i64,
}

impl WorkerHandle {
    pub fn with_task(mut self, task: JoinHandle<()>) -> Self {
        self.task = Some(task);
        self
    }

    /// Hands `m` to the worker, pausing the partition when the worker's buffer is full. A
    /// message at or below one already routed is a redelivery after a pause: dropped.
    pub fn send(&mut self, m: &BorrowedMessage<'_>, shared: &Shared) {
        if m.offset() <= self.last_routed {
            return;
        }
        self.last_routed = m.offset();
        let message = Message::from_borrowed(Arc::clone(&self.state.topic), m);
        // Counted before it is sent, so the worker never takes out more than was put in.
        let n = self.state.backlog.fetch_add(1, Ordering::Relaxed) + 1;
        if self.tx.send(message).is_err() {
            self.state.backlog.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        if n >= shared.settings.buffer {
            self.state.set_pause(shared, BACKLOG, true);
        }
    }

    /// Waits for the worker's task to end, up to `deadline`; says whether it ended.
    pub fn wait_until(&self, deadline: Instant) -> bool {
        let left = deadline.saturating_duration_since(Instant::now());
        !matches!(
            self.done.recv_timeout(left),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout)
        )
    }

    pub fn abort(&self) {
        self.state.abandon.cancel();
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// A message and what its key source made of it.
pub(crate) struct Item {
    pub msg: Message,
    pub kind: Kind,
    pub span: Span,
}

pub(crate) enum Kind {
    Keyed,
    Unkeyed,
    Dead(Reason, String),
}

/// The worker of one partition, run as a Tokio task.
pub(crate) struct Worker {
    pub(crate) shared: Arc<Shared>,
    pub(crate) state: Arc<PartitionState>,
    rx: mpsc::UnboundedReceiver<Message>,
    pub(crate) counters: Counters,
    /// The last settled offset, and the last one stored in the client.
    pub(crate) settled: Option<i64>,
    stored: Option<i64>,
    pub(crate) stalled: bool,
    /// Average time to settle one message, to keep claims ahead of the handler short.
    per_message: Duration,
    lease_ttl: Duration,
    _done: std::sync::mpsc::Sender<()>,
}

impl Worker {
    pub fn new(shared: Arc<Shared>, tp: Tp) -> (Worker, WorkerHandle) {
        let (topic, partition) = tp;
        let state = Arc::new(PartitionState {
            topic: Arc::clone(&topic),
            partition,
            stop: CancellationToken::new(),
            abandon: CancellationToken::new(),
            backlog: AtomicUsize::new(0),
            pause: Mutex::new(0),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let lease_ttl = shared.settings.lease_ttl;
        let worker = Worker {
            counters: Counters::new(&topic, partition),
            shared,
            state: Arc::clone(&state),
            rx,
            settled: None,
            stored: None,
            stalled: false,
            per_message: Duration::ZERO,
            lease_ttl,
            _done: done_tx,
        };
        let handle = WorkerHandle {
            state,
            tx,
            task: None,
            done: done_rx,
            last_routed: i64::MIN,
        };
        (worker, handle)
    }

    pub async fn run(mut self) {
        let batch_size = self.shared.settings.batch_size;
        let mut batch = Vec::with_capacity(batch_size);
        loop {
            let first = tokio::select! {
                biased;
                () = self.shared.dead.cancelled() => return,
                () = self.state.stop.cancelled() => break,
                m = self.rx.recv() => match m {
                    Some(m) => m,
                    None => break,
                },
            };
            batch.push(first);
            while batch.len() < batch_size {
                match self.rx.try_recv() {
                    Ok(m) => batch.push(m),
                    Err(_) => break,
                }
            }
            let before = self.state.backlog.fetch_sub(batch.len(), Ordering::Relaxed);
            let left = before.saturating_sub(batch.len());
            if left <= self.shared.settings.buffer / 2 {
                self.state.set_pause(&self.shared, BACKLOG, false);
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
            let flow = self.process(&mut batch).await;
            drop(permit);
            batch.clear();
            match flow {
                Flow::Go => self.flush(),
                Flow::Stop => break,
                Flow::Dead => return,
            }
        }
        self.flush();
    }

    /// Processes one poll batch in order, claiming it in chunks short enough that no
    /// lease waits long for its handler.
    async fn process(&mut self, batch: &mut Vec<Message>) -> Flow {
        let mut items: Vec<Item> = batch.drain(..).map(|m| self.classify(m)).collect();
        let mut start = 0;
        while start < items.len() {
            let end = start + self.chunk_len(items.len() - start);
            let chunk = &mut items[start..end];
            let claims: Vec<Claim> = chunk
                .iter()
                .filter(|i| matches!(i.kind, Kind::Keyed))
                .filter_map(|i| i.msg.key().map(|k| self.claim_for(k, i.msg.payload())))
                .collect();
            let first = chunk[0].msg.offset();
            // Transactional mode claims each message inside its own transaction.
            let batched = !self.shared.settings.mode.is_transactional();
            if batched && self.probe(Point::BeforeClaim, first) {
                return Flow::Dead;
            }
            let mut answers = if claims.is_empty() || !batched {
                Vec::new()
            } else {
                match self.claim_many(&claims).await {
                    Ok(a) => a,
                    Err(flow) => return flow,
                }
            }
            .into_iter()
            .map(Some)
            .collect::<Vec<_>>();
            if batched && self.probe(Point::AfterClaim, first) {
                return Flow::Dead;
            }
            let mut next_claim = 0;
            let began = Instant::now();
            for item in chunk.iter() {
                let flow = if self.state.stop.is_cancelled() {
                    Flow::Stop
                } else if self.shared.dead.is_cancelled() {
                    Flow::Dead
                } else {
                    match &item.kind {
                        Kind::Keyed => {
                            let i = next_claim;
                            next_claim += 1;
                            let answer = answers.get_mut(i).and_then(Option::take);
                            match claims.get(i) {
                                Some(claim) => self.settle_keyed(item, claim, answer).await,
                                None => Flow::Stop,
                            }
                        }
                        Kind::Unkeyed => self.run_unkeyed(item).await,
                        Kind::Dead(reason, error) => {
                            self.dead_letter(item, *reason, error, 0).await
                        }
                    }
                };
                if flow != Flow::Go {
                    self.release(&mut answers).await;
                    return flow;
                }
                if self.stalled {
                    self.stalled = false;
                    self.state.set_pause(&self.shared, STALL, false);
                }
                self.settled = Some(item.msg.offset());
                if self.probe(Point::AfterSettle, item.msg.offset()) {
                    return Flow::Dead;
                }
            }
            let each = began.elapsed() / u32::try_from(chunk.len()).unwrap_or(u32::MAX);
            self.per_message = (self.per_message * 7 + each) / 8;
            start = end;
        }
        Flow::Go
    }

    /// How many of `left` messages to claim at once: all of them while handlers are fast,
    /// fewer when a batch would take more than a quarter of the lease to run.
    fn chunk_len(&self, left: usize) -> usize {
        let budget = self.lease_ttl / 4;
        if self.per_message.is_zero() {
            return left;
        }
        let fits = budget.as_nanos() / self.per_message.as_nanos().max(1);
        left.min(usize::try_from(fits).unwrap_or(usize::MAX).max(1))
    }

    fn claim_for(&self, key: &idem_core::Key, payload: &[u8]) -> Claim {
        let s = &self.shared.settings;
        let mut claim = s.engine.claim_for(key, payload);
        if claim.fingerprint.is_some() != s.fingerprint {
            claim.fingerprint = s.fingerprint.then(|| Fingerprint::of(payload));
        }
        claim
    }

    fn classify(&self, msg: Message) -> Item {
        let s = &self.shared.settings;
        let span = tracing::info_span!(
            "idem_kafka.message",
            topic = %self.state.topic,
            partition = self.state.partition,
            offset = msg.offset(),
            key = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let (msg, kind) = match s.key_source.extract(&s.namespace, &msg) {
            Extracted::Key(key) => {
                span.record("key", tracing::field::display(&key));
                (msg.with_key(key), Kind::Keyed)
            }
            Extracted::Missing => match s.missing_key {
                MissingKey::DeadLetter => (
                    msg,
                    Kind::Dead(
                        Reason::MissingKey,
                        format!("no idempotency key ({:?})", s.key_source),
                    ),
                ),
                MissingKey::Process => (msg, Kind::Unkeyed),
            },
            Extracted::Invalid(reason) => (msg, Kind::Dead(Reason::InvalidKey, reason)),
            Extracted::Malformed(reason) => (msg, Kind::Dead(Reason::MalformedPayload, reason)),
        };
        Item { msg, kind, span }
    }

    /// `claim_many`, retried with backoff while the store fails: the partition stalls.
    async fn claim_many(&mut self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>, Flow> {
        let mut backoff = Backoff::new(self.shared.settings.backoff);
        loop {
            match self
                .shared
                .settings
                .engine
                .backend()
                .claim_many(claims)
                .await
            {
                Ok(a) if a.len() == claims.len() => return Ok(a),
                Ok(a) => self.store_error(&idem_core::Error::corrupt(format!(
                    "claim_many answered {} outcomes for {} claims",
                    a.len(),
                    claims.len()
                ))),
                Err(e) => self.store_error(&e),
            }
            self.stall(backoff.next()).await?;
        }
    }

    /// One claim, retried with backoff while the store fails.
    pub(crate) async fn claim(&mut self, claim: &Claim) -> Result<ClaimOutcome, Flow> {
        let mut backoff = Backoff::new(self.shared.settings.backoff);
        loop {
            match self.shared.settings.engine.backend().claim(claim).await {
                Ok(a) => return Ok(a),
                Err(e) => self.store_error(&e),
            }
            self.stall(backoff.next()).await?;
        }
    }

    pub(crate) fn store_error(&self, e: &idem_core::Error) {
        self.counters.store_errors.increment(1);
        tracing::warn!(
            topic = %self.state.topic, partition = self.state.partition, error = %e,
            "store error: partition stalled until the store answers"
        );
    }

    /// Stores the offset after the last settled message, unless it is stored already or
    /// the consumer crashed or gave the partition up.
    pub(crate) fn flush(&mut self) {
        let Some(settled) = self.settled else {
            return;
        };
        if self.stored == Some(settled)
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
                self.stored = Some(settled);
                self.shared.dirty.store(true, Ordering::SeqCst);
                drop(consumer);
                let _ = self.probe(Point::AfterStore, settled);
            }
            Err(e) => tracing::debug!(
                topic = %self.state.topic, partition = self.state.partition, error = %e,
                "offset store refused (partition no longer assigned?)"
            ),
        }
    }

    /// Pauses the partition and sleeps `wait`, after storing what is settled. `Err` when
    /// the partition is revoked or the consumer crashed meanwhile.
    pub(crate) async fn stall(&mut self, wait: Duration) -> Result<(), Flow> {
        self.flush();
        if !self.stalled {
            self.stalled = true;
            self.state.set_pause(&self.shared, STALL, true);
        }
        tokio::select! {
            biased;
            () = self.shared.dead.cancelled() => Err(Flow::Dead),
            () = self.state.stop.cancelled() => Err(Flow::Stop),
            () = tokio::time::sleep(wait) => Ok(()),
        }
    }

    /// Asks the probe, if any; a crash verdict kills the consumer. Says whether it did.
    pub(crate) fn probe(&self, point: Point, offset: i64) -> bool {
        probe_at(&self.shared, &self.state, point, offset)
    }
}

/// Asks the probe about `point` for the message at `offset` of `state`'s partition; a
/// crash verdict kills the consumer. Says whether it did.
pub(crate) fn probe_at(shared: &Shared, state: &PartitionState, point: Point, offset: i64) -> bool {
    let Some(probe) = &shared.settings.probe else {
        return false;
    };
    if probe.reached(point, &state.topic, state.partition, offset) == Verdict::Crash {
        if !shared.dead.is_cancelled() {
            tracing::info!(?point, topic = %state.topic, partition = state.partition, offset, "probe: crash");
            shared.crash();
        }
        return true;
    }
    false
}
