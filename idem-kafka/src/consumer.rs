//! The consumer: the poll thread (rebalance callbacks, commits), and a worker per assigned
//! partition, which takes its messages from the partition's own queue in the client.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;
use rdkafka::TopicPartitionList;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message as _};
use tokio::sync::{Semaphore, oneshot};

use crate::client::Client;
use crate::crash::Crash;
use crate::dead_letter::write::Writer;
use crate::handle::{BYTES, Fetch, OFFSETS, PartitionState, Route, WorkerHandle};
use crate::probe::Point;
use crate::queue::Queue;
use crate::settings::{Mode, Settings};
use crate::worker::{Ctx, Worker};
use crate::{Error, Result};
use idem_core::binding::Backoff;
use idem_core::binding::Budget;

mod assign;
mod rebalance;

pub(crate) use rebalance::LoopContext;

/// How long one poll of the client blocks; also how quickly the poll thread notices a
/// shutdown.
const POLL: Duration = Duration::from_millis(50);
/// How long closing waits for the revoke after unsubscribing (see [`leave`]).
const LEAVE_WITHIN: Duration = Duration::from_secs(10);

/// A topic and partition.
pub(crate) type Tp = (Arc<str>, i32);

/// An effectively-once Kafka consumer: built by [`IdemConsumer::builder`], driven by
/// [`IdemConsumer::run`].
pub struct IdemConsumer {
    settings: Settings,
    shutdown: Option<BoxFuture<'static, ()>>,
}

impl std::fmt::Debug for IdemConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdemConsumer")
            .field("topics", &self.settings.topics)
            .field("group", &self.settings.group)
            .field("namespace", &self.settings.namespace)
            .finish_non_exhaustive()
    }
}

impl IdemConsumer {
    pub(crate) fn new(settings: Settings, shutdown: Option<BoxFuture<'static, ()>>) -> Self {
        IdemConsumer { settings, shutdown }
    }

    #[cfg(test)]
    pub(crate) fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Runs the loop until the shutdown signal resolves (then stops cleanly and returns
    /// `Ok`) or the client fails fatally. Needs a Tokio runtime; the client is polled on a
    /// thread of its own, so rebalance callbacks may wait for handlers on either runtime
    /// flavor.
    ///
    /// Dropping this future without the signal is a crash: nothing more is stored or
    /// committed, and the client is closed without a commit.
    ///
    /// Before it joins the group it checks, through a client of its own, that a broker
    /// answers and that the source and dead-letter topics exist: [`Error::Connect`] says
    /// why no broker answered, [`Error::MissingTopics`] names the topics missing (see
    /// [`ConsumerBuilder::skip_topic_check`](crate::ConsumerBuilder::skip_topic_check)).
    pub async fn run(self) -> Result<()> {
        let IdemConsumer { settings, shutdown } = self;
        let checks = crate::start::Checks::new(&settings);
        tokio::runtime::Handle::try_current()
            .map_err(|_| Error::Config("run() needs a Tokio runtime".into()))?
            .spawn_blocking(move || checks.run())
            .await
            .map_err(|e| Error::Thread(format!("the start-up checks: {e}")))??;
        let letters = Writer::new(&settings.dead_letter_config, settings.dead_letter.clone())?;
        let permits = settings
            .partition_concurrency
            .map(|n| Arc::new(Semaphore::new(n)));
        let ctx = Arc::new(Ctx {
            client: Client::default(),
            crash: Crash::new(settings.probe.clone()),
            letters,
            permits,
            running: Default::default(),
            settings: Arc::new(settings),
        });
        let shared = Arc::new(Shared {
            runtime: tokio::runtime::Handle::try_current()
                .map_err(|_| Error::Config("run() needs a Tokio runtime".into()))?,
            budget: Budget::new(ctx.settings.max_buffered_bytes),
            workers: Mutex::new(Workers::default()),
            stopping: AtomicBool::new(false),
            failure: Mutex::new(None),
            consumer: OnceLock::new(),
            ctx,
        });
        let settings = Arc::clone(&shared.ctx.settings);
        let consumer: BaseConsumer<LoopContext> = settings
            .consumer_config
            .create_with_context(LoopContext {
                shared: Arc::clone(&shared),
            })
            .map_err(|e| Error::kafka("creating the consumer", e))?;
        let topics: Vec<&str> = settings.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|e| Error::kafka("subscribing", e))?;
        let consumer = Arc::new(consumer);
        shared.ctx.client.set(&consumer);
        let _ = shared.consumer.set(Arc::downgrade(&consumer));

        let guard = CrashOnDrop(Some(Arc::clone(&shared)));
        let (done_tx, mut done_rx) = oneshot::channel();
        let poller = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("idem-kafka-poll".into())
            .spawn(move || {
                let result = poll_loop(&poller, consumer);
                let _ = done_tx.send(result);
            })
            .map_err(|e| Error::Thread(e.to_string()))?;

        let shutdown = shutdown.unwrap_or_else(|| Box::pin(std::future::pending()));
        let result = tokio::select! {
            r = &mut done_rx => r,
            () = shutdown => {
                shared.stopping.store(true, Ordering::SeqCst);
                done_rx.await
            }
        };
        guard.disarm();
        result.map_err(|_| Error::Thread("the poll thread ended without a result".into()))?
    }
}

/// Marks the consumer dead if `run` is dropped before it finished: a crash.
struct CrashOnDrop(Option<Arc<Shared>>);

impl CrashOnDrop {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for CrashOnDrop {
    fn drop(&mut self) {
        if let Some(shared) = self.0.take() {
            shared.ctx.crash.crash();
            for (_, w) in shared.lock_workers().drain() {
                w.abort();
            }
        }
    }
}

/// The partition workers, looked up once per message by the poll thread: a fast hash (the
/// keys are the consumer's own assignment, not outside data).
type Workers = HashMap<Tp, WorkerHandle, foldhash::fast::RandomState>;

/// State shared by the poll thread and the rebalance callbacks. The partition workers get
/// only `ctx`.
struct Shared {
    ctx: Arc<Ctx>,
    runtime: tokio::runtime::Handle,
    /// The bytes of fetched messages held, across partitions, and their bound.
    budget: Arc<Budget>,
    workers: Mutex<Workers>,
    stopping: AtomicBool,
    /// Why the loop stops on its own: a partition's worker panicked, or a partition cannot
    /// be read on.
    failure: Mutex<Option<Error>>,
    /// The client, to split a partition's queue off for its worker.
    consumer: OnceLock<Weak<BaseConsumer<LoopContext>>>,
}

impl Shared {
    fn lock_workers(&self) -> MutexGuard<'_, Workers> {
        self.workers.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn settings(&self) -> &Settings {
        &self.ctx.settings
    }

    /// Commits the offsets stored. Every `commit_interval` whether or not any were stored
    /// since: librdkafka skips partitions whose stored offset is committed already (then
    /// answers `NoOffset`, a no-op), and a commit that failed left its partitions behind,
    /// so the next one retries them, even the last offsets of an idle partition. A failure
    /// is counted here, except that of an asynchronous commit's request: librdkafka
    /// reports that only in its log (`COMMITFAIL`), which `LoopContext::log` counts.
    fn commit(&self, consumer: &BaseConsumer<LoopContext>, mode: CommitMode) {
        let crash = &self.ctx.crash;
        let _gate = crash.gate();
        if crash.happened() {
            return;
        }
        match consumer.commit_consumer_state(mode) {
            Ok(()) => self.probe_commit(),
            Err(KafkaError::ConsumerCommit(RDKafkaErrorCode::NoOffset)) => {}
            Err(e) => {
                // A synchronous commit's failure, or one refused before any request: no
                // `COMMITFAIL` is logged for either.
                crate::metrics::commit_failed(&self.settings().group);
                tracing::warn!(error = %e, "offset commit failed; retrying at the next commit");
            }
        }
    }

    /// Asks the probe about [`Point::AfterCommit`] for each assigned partition with an
    /// offset stored (the last message it covers), once a commit was made: acknowledged
    /// if synchronous, handed to the client if not. The caller holds the gate, so a crash
    /// here crashes without taking it again.
    fn probe_commit(&self) {
        let crash = &self.ctx.crash;
        let Some(probe) = crash.probe() else {
            return;
        };
        let states: Vec<Arc<PartitionState>> = self
            .lock_workers()
            .values()
            .map(|h| Arc::clone(&h.state))
            .collect();
        for s in states {
            let last = s.stored.load(Ordering::SeqCst);
            if last < 0 || crash.happened() {
                continue;
            }
            let verdict = probe.reached(Point::AfterCommit, &s.topic, s.partition, last);
            if verdict == crate::Verdict::Crash {
                tracing::info!(topic = %s.topic, partition = s.partition, offset = last, "probe: crash after commit");
                crash.crash_holding_gate();
            }
        }
    }

    /// A worker for `tp`; unless `held` (its start not known yet), positioned at once.
    fn spawn_worker(
        self: &Arc<Self>,
        tp: Tp,
        queue: Option<Box<dyn Fetch>>,
        held: bool,
    ) -> WorkerHandle {
        let (handle, mut ends) = PartitionState::create(tp.0, tp.1, Arc::clone(&self.budget));
        if !held {
            handle.state.positioned.fire();
        }
        ends.queue = queue;
        let worker = Worker::new(Arc::clone(&self.ctx), Arc::clone(&handle.state), ends);
        let shared = Arc::clone(self);
        let (topic, partition) = (Arc::clone(&handle.state.topic), handle.state.partition);
        let task = self.runtime.spawn(async move {
            if let Err(panic) = AssertUnwindSafe(worker.run()).catch_unwind().await {
                let why = idem_core::backend::panic_text(&*panic);
                shared.fail(format!("the worker of {topic}/{partition} panicked: {why}"));
            }
        });
        handle.with_task(task)
    }

    /// Stops the loop with `why` as its error (the first reason given wins). The stop is
    /// the same as a shutdown's: handlers in flight get `revoke_timeout`, and what was
    /// settled is committed.
    fn fail(&self, why: String) {
        self.fail_with(Error::Worker(why));
    }

    /// [`Shared::fail`] with a typed error.
    fn fail_with(&self, error: Error) {
        tracing::error!(%error, "stopping the consumer");
        let mut failure = self.failure.lock().unwrap_or_else(|e| e.into_inner());
        failure.get_or_insert(error);
        drop(failure);
        self.stopping.store(true, Ordering::SeqCst);
    }

    /// What a partition's queue calls with an error it cannot read past: stops the loop.
    fn stop_on_error(self: &Arc<Self>) -> crate::queue::Stop {
        let shared = Arc::downgrade(self);
        Arc::new(move |error| {
            if let Some(shared) = shared.upgrade() {
                shared.fail_with(error);
            }
        })
    }

    /// Creates workers for newly assigned partitions and makes sure they are not paused;
    /// unless `positioned`, holds them back: paused, their workers waiting, until
    /// [`assign::position_later`] starts them from the store's offsets.
    fn assign(
        self: &Arc<Self>,
        consumer: &BaseConsumer<LoopContext>,
        tpl: &TopicPartitionList,
        positioned: bool,
    ) {
        let client = self.consumer.get().and_then(Weak::upgrade);
        let mut workers = self.lock_workers();
        let mut held = Vec::new();
        for e in tpl.elements() {
            let tp: Tp = (Arc::from(e.topic()), e.partition());
            if let std::collections::hash_map::Entry::Vacant(slot) = workers.entry(tp) {
                let queue = client
                    .as_ref()
                    .and_then(|c| c.split_partition_queue(e.topic(), e.partition()))
                    .map(|q| Queue::boxed(q, e.partition(), self.stop_on_error()));
                let handle = self.spawn_worker(slot.key().clone(), queue, !positioned);
                if !positioned {
                    held.push(Arc::clone(&handle.state));
                }
                slot.insert(handle);
            }
        }
        drop(workers);
        drop(client);
        if let Err(e) = consumer.resume(tpl) {
            tracing::debug!(error = %e, "resume after assign");
        }
        if !held.is_empty() {
            self.hold_back(held);
        }
    }

    /// Pauses `held` partitions and starts them from the store's offsets once it answers.
    fn hold_back(self: &Arc<Self>, held: Vec<Arc<PartitionState>>) {
        let Mode::Transactional(store) = &self.settings().mode else {
            return;
        };
        for state in &held {
            state.set_pause(&self.ctx.client, OFFSETS, true);
        }
        let weak = self.consumer.get().cloned();
        let seek: assign::Seek = Arc::new(move |topic, partition, next| {
            let consumer = weak
                .as_ref()
                .and_then(Weak::upgrade)
                .ok_or_else(|| "the consumer is closed".to_owned())?;
            let at = rdkafka::Offset::Offset(next);
            consumer
                .seek(topic, partition, at, Duration::from_secs(5))
                .map_err(|e| e.to_string())
        });
        let settings = self.settings();
        self.runtime.spawn(assign::position_later(
            Arc::clone(store),
            settings.group.clone(),
            Backoff::new(settings.retry_backoff),
            held,
            Arc::clone(&self.ctx),
            seek,
        ));
    }

    /// Stops dispatching for `tps`, waits a bounded time for in-flight handlers, then
    /// commits what is settled.
    fn revoke(&self, consumer: &BaseConsumer<LoopContext>, tps: &[Tp]) {
        let handles: Vec<WorkerHandle> = {
            let mut workers = self.lock_workers();
            tps.iter().filter_map(|tp| workers.remove(tp)).collect()
        };
        if self.ctx.crash.happened() {
            handles.iter().for_each(WorkerHandle::abort);
            return;
        }
        for h in &handles {
            h.state.stop.fire();
        }
        let revoke_timeout = self.settings().revoke_timeout;
        let deadline = Instant::now() + revoke_timeout;
        for h in &handles {
            if !h.wait_until(deadline) {
                tracing::warn!(
                    topic = %h.state.topic, partition = h.state.partition,
                    timeout = ?revoke_timeout,
                    "handler still running at revoke: its heartbeat stops and its lease lapses"
                );
                h.state.abandon.fire();
                if !h.wait_until(Instant::now() + Duration::from_secs(1)) {
                    h.abort();
                }
            }
        }
        self.commit(consumer, CommitMode::Sync);
    }

    /// In transactional mode, sets the offsets of newly assigned partitions to those the
    /// store keeps (see [`assign::seek_to_stored`]); says whether their start is known
    /// (always in lease mode).
    fn seek_to_stored(&self, tpl: &mut TopicPartitionList) -> bool {
        let settings = self.settings();
        let Mode::Transactional(store) = &settings.mode else {
            return true;
        };
        // Patient enough for a store's blip (200 ms, then 400 ms), short enough for a
        // rebalance callback.
        let backoff = Backoff::new((Duration::from_millis(200), Duration::from_secs(1)));
        assign::seek_to_stored(&**store, &settings.group, backoff, &self.runtime, tpl)
    }

    fn all_partitions(&self) -> Vec<Tp> {
        self.lock_workers().keys().cloned().collect()
    }

    /// Hands `message` to the worker of `tp` (created if the assignment callback has not
    /// made it); the partition's state if that paused it for bytes.
    fn route(
        self: &Arc<Self>,
        tp: &Tp,
        message: &BorrowedMessage<'_>,
    ) -> Option<Arc<PartitionState>> {
        let mut workers = self.lock_workers();
        let handle = workers
            .entry(tp.clone())
            .or_insert_with(|| self.spawn_worker(tp.clone(), None, false));
        let route = Route {
            client: &self.ctx.client,
            budget: &self.budget,
            max_buffered: self.settings().max_buffered,
        };
        handle
            .send(message, &route)
            .then(|| Arc::clone(&handle.state))
    }

    /// Whether every partition the poll thread feeds (not paused, not stopping) holds at
    /// least [`Settings::read_ahead`] messages, and there is one.
    fn fed(&self) -> bool {
        let ahead = self.settings().read_ahead();
        let workers = self.lock_workers();
        let mut fed = false;
        for state in workers.values().map(|h| &h.state) {
            if state.stop.is_fired() || state.is_paused() {
                continue;
            }
            if state.backlog.load(Ordering::Relaxed) < ahead {
                return false;
            }
            fed = true;
        }
        fed
    }

    /// Resumes the partitions the poll thread paused for bytes (`paused`): all of them once
    /// the consumer holds at most half its bound, and each one that holds nothing at once
    /// (so none waits forever on partitions that hold the budget). Forgets a partition
    /// given up meanwhile.
    fn resume_bytes(&self, paused: &mut Vec<Arc<PartitionState>>) {
        let below_half = self.budget.held() <= self.budget.bound() / 2;
        paused.retain(|state| {
            if state.stop.is_fired() {
                return false;
            }
            if below_half || state.held.get() == 0 {
                state.set_pause(&self.ctx.client, BYTES, false);
                return false;
            }
            true
        });
    }
}

/// The poll thread: serves the rebalance callbacks, routes a message that arrives on the
/// main queue (one of a partition whose queue was not split off), commits periodically,
/// and on shutdown revokes everything, commits and closes the client. The client is
/// dropped here, on this thread.
fn poll_loop(shared: &Arc<Shared>, consumer: Arc<BaseConsumer<LoopContext>>) -> Result<()> {
    let mut last_commit = Instant::now();
    let mut cache: Option<Tp> = None;
    let mut bytes_paused: Vec<Arc<PartitionState>> = Vec::new();
    // Messages routed in a row (since a poll that found none).
    let mut routed = 0u32;
    shared.ctx.client.set_poller();
    let waits = crate::metrics::read_ahead_waits(&shared.settings().group);
    // Whether every partition had enough waiting at the last check.
    let mut fed = false;
    let result = loop {
        if shared.ctx.crash.happened() {
            break Ok(());
        }
        if shared.stopping.load(Ordering::SeqCst) {
            let all = shared.all_partitions();
            shared.revoke(&consumer, &all);
            let failure = shared
                .failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            break failure.map_or(Ok(()), Err);
        }
        match consumer.poll(POLL) {
            None => routed = 0,
            Some(Ok(m)) => {
                let tp = match &cache {
                    Some(tp) if tp.1 == m.partition() && *tp.0 == *m.topic() => tp.clone(),
                    _ => {
                        let tp: Tp = (Arc::from(m.topic()), m.partition());
                        cache = Some(tp.clone());
                        tp
                    }
                };
                routed = routed.wrapping_add(1);
                if let Some(state) = shared.route(&tp, &m) {
                    if !bytes_paused.iter().any(|s| Arc::ptr_eq(s, &state)) {
                        bytes_paused.push(state);
                    }
                }
            }
            Some(Err(KafkaError::MessageConsumptionFatal(code))) => {
                break Err(Error::kafka(
                    "consuming",
                    KafkaError::MessageConsumptionFatal(code),
                ));
            }
            Some(Err(e)) => {
                routed = 0;
                tracing::warn!(error = %e, "consumer error");
            }
        }
        if !bytes_paused.is_empty() {
            shared.resume_bytes(&mut bytes_paused);
        }
        // Every partition has enough waiting: what the client fetched stays in its prefetch,
        // not copied out ahead of the workers, until one of them runs low (it unparks this
        // thread) or a poll interval passes (rebalances and commits are served meanwhile).
        // Checked every 64th message, then after each message while the workers are fed:
        // a partition holds at most 64 more, and one more per poll interval while its
        // worker is stuck.
        if routed > 0 && (fed || routed % 64 == 0) {
            fed = shared.fed();
            if fed {
                waits.increment(1);
                std::thread::park_timeout(POLL);
            }
        }
        // The clock is read after a poll that found nothing and every 64th message, not
        // after every message: a commit is late by 64 messages at most.
        if routed % 64 == 0 && last_commit.elapsed() >= shared.settings().commit_interval {
            last_commit = Instant::now();
            shared.commit(&consumer, CommitMode::Async);
        }
    };
    close(shared, consumer);
    result
}

/// Leaves the group before the client closes: unsubscribes, then serves the rebalance
/// callbacks until nothing is assigned (at most [`LEAVE_WITHIN`]). Closing with an
/// assignment under way can hang for good: an incremental assign that arrives while the
/// client closes is taken as a full unassign, and the revoke after it then waits forever
/// for an answer (librdkafka #4884, seen here with cooperative-sticky in the churn tests).
fn leave(consumer: &BaseConsumer<LoopContext>) {
    consumer.unsubscribe();
    let start = Instant::now();
    while start.elapsed() < LEAVE_WITHIN {
        // A message polled now is not routed: its offset is not stored, so the partition's
        // next owner gets it.
        let quiet = consumer.poll(POLL).is_none();
        let assigned = consumer.assignment().map_or(0, |a| a.count());
        if quiet && assigned == 0 {
            return;
        }
    }
    tracing::warn!(within = ?LEAVE_WITHIN, "partitions still assigned at close");
}

/// Drops the client on this thread once no worker holds it (a worker's upgrade of its
/// weak handle is brief). Closing runs the revoke callback, which commits unless dead.
fn close(shared: &Shared, consumer: Arc<BaseConsumer<LoopContext>>) {
    let start = Instant::now();
    while Arc::strong_count(&consumer) > 1 && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(1));
    }
    let crashed = shared.ctx.crash.happened();
    if crashed {
        tracing::debug!("closing the consumer after a crash: no commit");
    } else {
        leave(&consumer);
    }
    drop(consumer);
    if let (true, Some(probe)) = (crashed, shared.ctx.crash.probe()) {
        probe.closed();
    }
}
