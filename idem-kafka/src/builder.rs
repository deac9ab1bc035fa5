//! The builder: what it takes, and the checks that make its settings.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::{Context, Engine, Key};
use rdkafka::ClientConfig;
use rdkafka::config::RDKafkaLogLevel;
use tokio::sync::Semaphore;

use crate::consumer::IdemConsumer;
use crate::handler::{DynHandler, HandlerResult};
use crate::settings::{DeadLetterTopic, MAX_BATCH_SIZE, Mode, Settings, check_topic};
use crate::{Error, KeySource, Message, Probe, Result};
use idem_core::binding::MissingKey;

/// Builds an [`IdemConsumer`]. Required: topics, a group ([`ConsumerBuilder::group`] or
/// the config's `group.id`), and either a [`handler`](ConsumerBuilder::handler) and an
/// [`engine`](ConsumerBuilder::engine) (lease mode) or a
/// [`transactional`](ConsumerBuilder::transactional) handler, for which the engine is
/// optional.
///
/// Of the client config it is given: `enable.auto.commit` and `enable.auto.offset.store`
/// are set to `false` (`true` is an error); unless the config sets them,
/// `fetch.queue.backoff.ms` is 10 and `auto.offset.reset` is `earliest`, so a group with no
/// committed offset starts at the oldest message (librdkafka's own default, `latest`,
/// skips what was produced before the group first joined); librdkafka's log level is
/// raised to at least warnings.
pub struct ConsumerBuilder {
    config: ClientConfig,
    dead_letter_config: Option<ClientConfig>,
    topics: Vec<String>,
    group: Option<String>,
    namespace: Option<String>,
    key_source: KeySource,
    engine: Option<Engine>,
    handler: Option<DynHandler>,
    transactional: Option<Arc<dyn crate::tx::TxStore>>,
    dead_letter: DeadLetterTopic,
    missing_key: MissingKey,
    partition_concurrency: Option<usize>,
    in_flight: usize,
    order_by: crate::OrderBy,
    batch_size: usize,
    max_unsettled: Option<usize>,
    settle_within: Duration,
    max_buffered: Option<usize>,
    max_buffered_bytes: Option<usize>,
    commit_interval: Duration,
    revoke_timeout: Duration,
    retry_backoff: (Duration, Duration),
    shutdown: Option<BoxFuture<'static, ()>>,
    probe: Option<Arc<dyn Probe>>,
    topic_check: bool,
    start_timeout: Duration,
}

impl IdemConsumer {
    /// Starts a builder over `config`, the rdkafka client configuration
    /// (`bootstrap.servers` and anything else librdkafka accepts).
    pub fn builder(config: ClientConfig) -> ConsumerBuilder {
        ConsumerBuilder::new(config)
    }
}

impl ConsumerBuilder {
    pub(crate) fn new(config: ClientConfig) -> Self {
        ConsumerBuilder {
            config,
            dead_letter_config: None,
            topics: Vec::new(),
            group: None,
            namespace: None,
            key_source: KeySource::default(),
            engine: None,
            handler: None,
            transactional: None,
            dead_letter: DeadLetterTopic::default(),
            missing_key: MissingKey::default(),
            partition_concurrency: None,
            in_flight: 1,
            order_by: crate::OrderBy::default(),
            batch_size: 500,
            max_unsettled: None,
            settle_within: Duration::from_millis(100),
            max_buffered: None,
            max_buffered_bytes: None,
            commit_interval: Duration::from_secs(1),
            revoke_timeout: Duration::from_secs(10),
            retry_backoff: (Duration::from_millis(20), Duration::from_secs(2)),
            shutdown: None,
            probe: None,
            topic_check: true,
            start_timeout: Duration::from_secs(10),
        }
    }

    /// The topics to subscribe to.
    pub fn topics<I, S>(mut self, topics: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.topics = topics.into_iter().map(Into::into).collect();
        self
    }

    /// The consumer group (sets `group.id`).
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = Some(group.into());
        self
    }

    /// The key namespace (default: the group id).
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// Where keys come from (default: the `idempotency-key` header).
    pub fn key_source(mut self, source: KeySource) -> Self {
        self.key_source = source;
        self
    }

    /// The engine, over any backend; its owner, lease, heartbeat, retention, attempts,
    /// fingerprint setting (a different payload under a known key is dead-lettered as a
    /// mismatch) and wait policy (how often a partition asks again for a key another worker
    /// holds) apply.
    pub fn engine(mut self, engine: Engine) -> Self {
        self.engine = Some(engine);
        self
    }

    /// The handler. It gets the message and the lease's [`Context`] (its fencing token;
    /// `None` only for a keyless message under [`MissingKey::Process`]) and returns the
    /// response bytes, or a retryable or permanent [`HandlerError`](idem_core::HandlerError).
    pub fn handler<F, Fut>(mut self, handler: F) -> Self
    where
        F: Fn(Message, Option<Context>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HandlerResult> + Send + 'static,
    {
        self.handler = Some(Arc::new(move |m, c| handler(m, c).boxed()));
        self
    }

    /// Transactional mode over `store` (PostgreSQL's `PgBackend`, or any
    /// [`Transactional`](idem_core::Transactional) store), instead of
    /// [`ConsumerBuilder::handler`]: `handler` runs with the lease inside a transaction of
    /// the store, and its writes, the `Completed` record and the offset commit together.
    ///
    /// With [`in_flight`](Self::in_flight) at 1 (the default) a chunk's run of keyed
    /// messages is one transaction: their claims commit first, together in one claim call
    /// (so a rollback cannot erase the attempts, and a crash loop stays bounded by
    /// `max_attempts`); then the handlers run in offset order in one transaction, with no
    /// savepoints; then one statement writes their `Completed` records and stores the
    /// offset past the settled prefix, and it all commits once. If a handler fails, the
    /// run is redone with a savepoint per handler, so a failure rolls back only its own
    /// writes (a handler may run more than once; only the run that commits counts), and a
    /// message the run left unsettled is then resolved on its own, in order. A store error
    /// or a crash rolls the whole run back; its keys wait for their leases to lapse. With
    /// `in_flight` above one each message has a transaction of its own (see there).
    ///
    /// On assignment the consumer seeks to the offsets stored there; while the store does
    /// not answer, the assigned partitions stay paused, never started from Kafka's
    /// committed offsets. The engine, if set,
    /// gives the owner, lease, attempts and retention; by default one over `store` with
    /// the engine's defaults.
    pub fn transactional<S, F>(mut self, store: S, handler: F) -> Self
    where
        S: idem_core::Transactional + 'static,
        F: for<'t> Fn(Message, &'t mut S::Tx, idem_core::Lease) -> BoxFuture<'t, HandlerResult>
            + Send
            + Sync
            + 'static,
    {
        self.transactional = Some(Arc::new(crate::tx::Bound {
            store: Arc::new(store),
            handler: Arc::new(handler),
        }));
        self
    }

    /// The dead-letter topic (default `<topic>.dlq` per source topic). It must exist:
    /// [`IdemConsumer::run`] checks at start (see
    /// [`skip_topic_check`](Self::skip_topic_check)), and until a dead letter is
    /// acknowledged, its partition stalls.
    pub fn dead_letter_topic(mut self, topic: DeadLetterTopic) -> Self {
        self.dead_letter = topic;
        self
    }

    /// Skips the check that the source and dead-letter topics exist, for topics created
    /// after the consumer starts. By default [`IdemConsumer::run`] reads their metadata
    /// before it joins the group and fails with [`Error::MissingTopics`] naming each one
    /// missing. Without the check a missing source topic is waited for (its partitions are
    /// assigned once it exists and the client's metadata refresh sees it), and a missing
    /// dead-letter topic is found only when a dead letter is written to it: that
    /// partition stalls until the topic exists. The brokers are still reached at start,
    /// and a failed connection is still [`Error::Connect`].
    pub fn skip_topic_check(mut self) -> Self {
        self.topic_check = false;
        self
    }

    /// How long the checks at start wait for the brokers to answer a metadata request,
    /// through the consumer's client and again through the dead-letter producer's
    /// (default 10 s). A refused login, an untrusted certificate or a TLS/plaintext
    /// mismatch fails at once, as soon as the client reports it; a broker that does not
    /// answer at all fails at this timeout ([`Error::Connect`] either way).
    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = idem_core::clock::capped(timeout);
        self
    }

    /// The dead-letter producer's configuration (default: the consumer's, without the
    /// consumer-only properties).
    pub fn dead_letter_config(mut self, config: ClientConfig) -> Self {
        self.dead_letter_config = Some(config);
        self
    }

    /// What to do with a message that has no key (default: dead-letter it).
    pub fn missing_key(mut self, policy: MissingKey) -> Self {
        self.missing_key = policy;
        self
    }

    /// How many partitions may run handlers at once (default: every assigned partition).
    pub fn partition_concurrency(mut self, n: usize) -> Self {
        self.partition_concurrency = Some(n);
        self
    }

    /// How many handlers may run at once within one partition (default 1: one at a time,
    /// in offset order). Above one, messages with different ordering keys (see
    /// [`ConsumerBuilder::order_by`]) run concurrently, up to `n`; messages with the same
    /// ordering key still run one at a time in offset order, and a message whose key is
    /// busy waits without holding up other keys. The committed offset stays one past the
    /// longest prefix of settled messages (the low-water mark), so a slow message holds the
    /// commit back, never the other keys' work. In transactional mode each message has its
    /// own transaction, and the stored offset moves to the low-water mark after each
    /// chunk instead of inside each transaction (transactions may commit out of order).
    pub fn in_flight(mut self, n: usize) -> Self {
        self.in_flight = n;
        self
    }

    /// What keeps messages in order when [`ConsumerBuilder::in_flight`] is above one
    /// (default: the idempotency key).
    pub fn order_by(mut self, order: crate::OrderBy) -> Self {
        self.order_by = order;
        self
    }

    /// The most messages of one partition claimed in one round trip (default 500; at most
    /// [`MAX_BATCH_SIZE`]).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }

    /// Lease mode: the most effects of one partition that may have run without being
    /// settled, so the most a crash repeats per partition (default
    /// [`batch_size`](Self::batch_size): no bound but the chunk's length).
    ///
    /// A chunk of a poll batch is claimed in one store call and its results are settled in
    /// one call at its end; a crash between a handler's effect and that settle repeats the
    /// effect once the lease lapses (under a higher token). Each chunk is at most `n`
    /// messages, so at most `n` handlers of a partition can have run, or be running,
    /// without their results stored. At 1 a partition claims, runs and settles one message
    /// at a time: a crash repeats at most one effect per partition, at the price of a
    /// claim and a settle per message. With [`in_flight`](Self::in_flight) above `n`, at most `n`
    /// handlers of a partition run at once (the bound is what limits them). A revoke is
    /// not a crash: a handler still running past the revoke timeout is detached and its
    /// effect may repeat beside the bound.
    ///
    /// Transactional mode is not bounded by it: a crash rolls the chunk's writes back.
    pub fn max_unsettled(mut self, n: usize) -> Self {
        self.max_unsettled = Some(n);
        self
    }

    /// How long a chunk's results should wait for their settle (default 100 ms): chunks
    /// are sized so that their handlers run within this, or a quarter of the lease if
    /// less, at the handler time measured so far (the first chunk of a partition is at
    /// most 16 messages); the chunk's claim and settle come on top. It is a target, not a
    /// bound: a handler slower than measured, or the leading messages of distinct keys
    /// that [`in_flight`](Self::in_flight) runs together, can take longer;
    /// [`max_unsettled`](Self::max_unsettled) is the hard bound on what a crash repeats.
    /// Shorter means smaller chunks, so more store calls per message; in transactional
    /// mode it sizes the chunk's transaction.
    pub fn settle_within(mut self, within: Duration) -> Self {
        self.settle_within = idem_core::clock::capped(within);
        self
    }

    /// How many fetched messages of one partition the client keeps ready for its worker.
    /// Each partition's worker takes its messages from the partition's own queue in the
    /// client when it is ready for them, so what waits stays in librdkafka's queue and is
    /// copied nowhere else. This sets librdkafka's prefetch per partition,
    /// `queued.min.messages` (100,000 by default), unless the client config sets it. A
    /// value below [`batch_size`](Self::batch_size) is raised to it.
    ///
    /// A message of a partition whose queue could not be split off (fetched before its
    /// assignment reached the consumer) goes through the poll thread instead; of those, at
    /// most this many wait for the worker, and the partition is paused past it. While
    /// every partition fed that way holds four batches ([`batch_size`](Self::batch_size) ×
    /// 4, at most this), the poll thread copies no more of them and waits (up to 50 ms at a
    /// time) for a worker to run low.
    pub fn max_buffered(mut self, n: usize) -> Self {
        self.max_buffered = Some(n);
        self
    }

    /// The most bytes (payload, key and headers) of fetched messages the consumer's workers
    /// hold, across partitions: taken, running or settling. While the consumer holds more,
    /// a worker takes no more messages from its partition's queue, except that a worker
    /// holding nothing always takes its next one: the bound can be passed by about one
    /// message per partition, and a message larger than the bound still gets through,
    /// alone. The default is librdkafka's `queued.max.messages.kbytes` if the client config
    /// sets it, else 64 MiB.
    ///
    /// Messages not taken yet wait in their partition's queue in the client. librdkafka
    /// bounds each such queue by `queued.max.messages.kbytes`; unless the client config
    /// sets it, it is a sixteenth of this bound (at least 1 MiB), so that 16 partitions
    /// prefetch about the bound together. A consumer of many partitions that must stay
    /// small sets it lower.
    pub fn max_buffered_bytes(mut self, bytes: usize) -> Self {
        self.max_buffered_bytes = Some(bytes);
        self
    }

    /// How often stored offsets are committed (default 1 s). They are also committed on
    /// revoke and on shutdown.
    pub fn commit_interval(mut self, every: Duration) -> Self {
        self.commit_interval = every;
        self
    }

    /// How long a revoke or a shutdown waits for in-flight handlers (default 10 s).
    pub fn revoke_timeout(mut self, timeout: Duration) -> Self {
        self.revoke_timeout = idem_core::clock::capped(timeout);
        self
    }

    /// The first and the longest pause of a stalled partition between retries (default
    /// 20 ms and 2 s, doubling).
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.retry_backoff = (
            idem_core::clock::capped(first),
            idem_core::clock::capped(max),
        );
        self
    }

    /// Stops the loop when `signal` resolves: dispatching ends, in-flight handlers get
    /// the revoke timeout, settled offsets are committed, the consumer leaves its group
    /// (up to 10 s more for the revoke to be served), and the client is closed.
    pub fn shutdown(mut self, signal: impl Future<Output = ()> + Send + 'static) -> Self {
        self.shutdown = Some(signal.boxed());
        self
    }

    /// A crash-point probe, for fault-injection tests (see [`Probe`]).
    pub fn probe(mut self, probe: Arc<dyn Probe>) -> Self {
        self.probe = Some(probe);
        self
    }

    /// The engine and the mode, from what was set.
    fn mode(&mut self) -> Result<(Engine, Mode)> {
        if let Some(tx) = self.transactional.take() {
            if self.handler.is_some() {
                return Err(Error::Config(
                    "set either a handler or a transactional handler, not both".into(),
                ));
            }
            let engine = match self.engine.take() {
                Some(engine) => engine,
                None => Engine::builder(tx.backend()).build()?,
            };
            return Ok((engine, Mode::Transactional(tx)));
        }
        let engine = self
            .engine
            .take()
            .ok_or_else(|| Error::Config("an engine is required".into()))?;
        let handler = self
            .handler
            .take()
            .ok_or_else(|| Error::Config("a handler is required".into()))?;
        Ok((engine, Mode::Lease(handler)))
    }

    /// Checks the settings and builds the consumer; the Kafka client is created by
    /// [`IdemConsumer::run`].
    pub fn build(mut self) -> Result<IdemConsumer> {
        let mut config = std::mem::take(&mut self.config);
        if let Some(group) = &self.group {
            config.set("group.id", group);
        }
        let group = match config.get("group.id") {
            Some(g) if !g.is_empty() => g.to_owned(),
            _ => return Err(Error::Config("a group is required (group.id)".into())),
        };
        for (prop, why) in [
            ("enable.auto.commit", "idem-kafka commits itself"),
            (
                "enable.auto.offset.store",
                "offsets are stored only for settled messages",
            ),
        ] {
            match config.get(prop) {
                None | Some("false") => {}
                Some(v) => return Err(Error::Config(format!("{prop}={v}: must be false, {why}"))),
            }
            config.set(prop, "false");
        }
        if config.get("fetch.queue.backoff.ms").is_none() {
            config.set("fetch.queue.backoff.ms", "10");
        }
        // A group with no committed offset starts at the oldest message, not the newest:
        // librdkafka's default (`latest`) skips what was produced before the first join.
        if config.get("auto.offset.reset").is_none() {
            config.set("auto.offset.reset", "earliest");
        }
        // librdkafka's warnings (a failed asynchronous commit is reported only as one) reach
        // `tracing` only if its log level lets them out; rdkafka takes that level from the
        // `log` crate's, which is errors only where no `log` logger is installed. A level
        // set below warnings on the config given is raised too: the commit-error counter
        // needs it (README, "What it promises", Observability).
        if (config.log_level as u8) < RDKafkaLogLevel::Warning as u8 {
            config.set_log_level(RDKafkaLogLevel::Warning);
        }
        if self.topics.is_empty() {
            return Err(Error::Config("at least one topic is required".into()));
        }
        for topic in &self.topics {
            check_topic(topic)?;
            if let DeadLetterTopic::Suffix = &self.dead_letter {
                check_topic(&self.dead_letter.for_topic(topic))?;
            }
        }
        let namespace = self.namespace.take().unwrap_or_else(|| group.clone());
        Key::new(namespace.clone(), "-")
            .map_err(|e| Error::Config(format!("namespace {namespace:?}: {e}")))?;
        self.key_source.check().map_err(Error::Config)?;
        let (engine, mode) = self.mode()?;
        if !(1..=MAX_BATCH_SIZE).contains(&self.batch_size) {
            return Err(Error::Config(format!(
                "batch_size must be 1 to {MAX_BATCH_SIZE}"
            )));
        }
        if self.max_unsettled == Some(0) {
            return Err(Error::Config("max_unsettled must be at least 1".into()));
        }
        if self.settle_within.is_zero() {
            return Err(Error::Config("settle_within must be above zero".into()));
        }
        let permits = Semaphore::MAX_PERMITS;
        if !(1..=permits).contains(&self.in_flight) {
            return Err(Error::Config(format!("in_flight must be 1 to {permits}")));
        }
        if self
            .partition_concurrency
            .is_some_and(|n| !(1..=permits).contains(&n))
        {
            return Err(Error::Config(format!(
                "partition_concurrency must be 1 to {permits}"
            )));
        }
        let (first, max) = self.retry_backoff;
        if first.is_zero() || max < first {
            return Err(Error::Config(format!(
                "retry_backoff: first ({first:?}) must be above zero and at most max ({max:?})"
            )));
        }
        if self.max_buffered_bytes == Some(0) {
            return Err(Error::Config(
                "max_buffered_bytes must be at least 1".into(),
            ));
        }
        if self.start_timeout.is_zero() {
            return Err(Error::Config("start_timeout must be above zero".into()));
        }
        if self.commit_interval.is_zero() {
            return Err(Error::Config("commit_interval must be above zero".into()));
        }
        if let DeadLetterTopic::Fixed(t) = &self.dead_letter {
            check_topic(t)?;
            if self.topics.contains(t) {
                return Err(Error::Config(format!(
                    "dead-letter topic {t:?} must not be a source topic"
                )));
            }
        }
        if mode.is_transactional() && self.missing_key == MissingKey::Process {
            return Err(Error::Config(
                "transactional mode needs a key for every message: MissingKey::Process is \
                 not available"
                    .into(),
            ));
        }
        let dead_letter_config = self
            .dead_letter_config
            .unwrap_or_else(|| producer_config(&config));
        let max_buffered = self
            .max_buffered
            .unwrap_or_else(|| prefetch(&config))
            .max(self.batch_size);
        if self.max_buffered.is_some() && config.get("queued.min.messages").is_none() {
            config.set("queued.min.messages", max_buffered.to_string());
        }
        let max_buffered_bytes = self
            .max_buffered_bytes
            .unwrap_or_else(|| prefetch_bytes(&config));
        if config.get("queued.max.messages.kbytes").is_none() {
            // librdkafka takes 1 to 2,097,151 KiB.
            let kbytes = (max_buffered_bytes / PREFETCH_SHARE / 1024).clamp(1024, 2_097_151);
            config.set("queued.max.messages.kbytes", kbytes.to_string());
        }
        let settings = Settings {
            consumer_config: config,
            dead_letter_config,
            topics: self.topics,
            group,
            namespace,
            key_source: self.key_source,
            engine,
            mode,
            dead_letter: self.dead_letter,
            missing_key: self.missing_key,
            partition_concurrency: self.partition_concurrency,
            in_flight: self.in_flight,
            order_by: self.order_by,
            batch_size: self.batch_size,
            max_unsettled: self.max_unsettled.unwrap_or(self.batch_size),
            settle_within: self.settle_within,
            max_buffered,
            max_buffered_bytes,
            commit_interval: self.commit_interval,
            revoke_timeout: self.revoke_timeout,
            retry_backoff: self.retry_backoff,
            probe: self.probe,
            topic_check: self.topic_check,
            start_timeout: self.start_timeout,
        };
        Ok(IdemConsumer::new(settings, self.shutdown))
    }
}

impl fmt::Debug for ConsumerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("topics", &self.topics)
            .field("group", &self.group)
            .field("namespace", &self.namespace)
            .field("key_source", &self.key_source)
            .field("dead_letter", &self.dead_letter)
            .field("missing_key", &self.missing_key)
            .finish_non_exhaustive()
    }
}

pub(crate) mod config;
#[cfg(test)]
mod tests;

pub(crate) use config::producer_config;
use config::{PREFETCH_SHARE, prefetch, prefetch_bytes};
