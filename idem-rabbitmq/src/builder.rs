//! The consumer's builder.

use std::fmt;
use std::future::Future;
#[cfg(feature = "tls")]
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::binding::{HandlerResult, MissingKey};
use idem_core::{Context, Engine};

use crate::settings::{DynHandler, Mode, Settings};
use crate::{DeadLetters, Error, IdemConsumer, KeySource, Message, Probe, Result};

/// Builds an [`IdemConsumer`]: [`IdemConsumer::builder`], then the queue and a handler.
pub struct ConsumerBuilder {
    uri: String,
    #[cfg(feature = "tls")]
    tls_ca_file: Option<PathBuf>,
    #[cfg(feature = "tls")]
    tls_client_cert: Option<(PathBuf, PathBuf)>,
    queue: Option<String>,
    namespace: Option<String>,
    key_source: KeySource,
    engine: Option<Engine>,
    handler: Option<DynHandler>,
    transactional: Option<Arc<dyn crate::tx::TxStore>>,
    dead_letters: DeadLetters,
    missing_key: MissingKey,
    prefetch: u16,
    in_flight: usize,
    max_bytes: usize,
    batch_size: usize,
    backoff: (Duration, Duration),
    shutdown: Option<BoxFuture<'static, ()>>,
    probe: Option<Arc<dyn Probe>>,
}

impl IdemConsumer {
    /// A builder for a consumer of the server at `uri` (`amqp://user:pass@host:port/vhost`,
    /// the vhost `/` written `%2f`; `amqps://` for TLS, with the feature `tls`).
    pub fn builder(uri: impl Into<String>) -> ConsumerBuilder {
        ConsumerBuilder {
            uri: uri.into(),
            #[cfg(feature = "tls")]
            tls_ca_file: None,
            #[cfg(feature = "tls")]
            tls_client_cert: None,
            queue: None,
            namespace: None,
            key_source: KeySource::default(),
            engine: None,
            handler: None,
            transactional: None,
            dead_letters: DeadLetters::default(),
            missing_key: MissingKey::default(),
            prefetch: 32,
            in_flight: 1,
            max_bytes: 64 << 20,
            batch_size: 32,
            backoff: (Duration::from_millis(50), Duration::from_secs(2)),
            shutdown: None,
            probe: None,
        }
    }
}

impl ConsumerBuilder {
    /// The queue to consume (required). It must exist: the consumer does not declare it.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }

    /// The keys' namespace (default: the queue's name).
    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// Where each message's idempotency key comes from (default: the `idempotency-key`
    /// header).
    pub fn key_source(mut self, source: KeySource) -> Self {
        self.key_source = source;
        self
    }

    /// With an `amqps://` URI, trust the CA certificates in the PEM file `path` (a private
    /// CA, a provider's bundle) beside the public (webpki) roots, which alone are trusted
    /// by default. Read by [`build`](Self::build).
    #[cfg(feature = "tls")]
    pub fn tls_ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.tls_ca_file = Some(path.into());
        self
    }

    /// With an `amqps://` URI, present the client certificate (chain) in the PEM file
    /// `cert`, with its private key in the PEM file `key`, to a server that asks for one
    /// (and logs in as its user with `?auth_mechanism=external`). Read by
    /// [`build`](Self::build).
    #[cfg(feature = "tls")]
    pub fn tls_client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.tls_client_cert = Some((cert.into(), key.into()));
        self
    }

    /// The engine: the store, leases, attempts. Required in lease mode (with
    /// [`handler`](Self::handler)); with [`transactional`](Self::transactional), one over
    /// its store by default.
    pub fn engine(mut self, engine: Engine) -> Self {
        self.engine = Some(engine);
        self
    }

    /// The handler: runs once per key under a fenced lease, given the message and the
    /// lease's [`Context`] (`None` only for a keyless message under
    /// [`MissingKey::Process`]). Its `Ok` bytes are stored and replayed to duplicates.
    pub fn handler<F, Fut>(mut self, handler: F) -> Self
    where
        F: Fn(Message, Option<Context>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = HandlerResult> + Send + 'static,
    {
        self.handler = Some(Arc::new(move |m, c| handler(m, c).boxed()));
        self
    }

    /// Transactional mode, instead of [`handler`](Self::handler): the handler gets the
    /// message, a transaction of `store` (PostgreSQL's `PgBackend`, MySQL's
    /// `MySqlBackend`) and the lease; its writes, the key's `Completed` record and nothing
    /// else commit together, and the delivery is acked after the commit. A crash before
    /// the commit rolls the writes back; one between the commit and the ack redelivers
    /// the message, which the store replays: effects in that store happen once. The
    /// engine, if set, gives the owner, lease, attempts and retention; by default one over
    /// `store` with the engine's defaults.
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

    /// Where dead letters go (default: the durable queue `<queue>.dlq`).
    pub fn dead_letters(mut self, target: DeadLetters) -> Self {
        self.dead_letters = target;
        self
    }

    /// What to do with a message that has no key (default: dead-letter it).
    pub fn missing_key(mut self, policy: MissingKey) -> Self {
        self.missing_key = policy;
        self
    }

    /// The most deliveries the server sends before one is acked (`basic.qos`; default 32,
    /// at least 1, and at least [`in_flight`](Self::in_flight)). It keeps the next
    /// deliveries on their way while others run, and bounds what a stalled consumer holds.
    pub fn prefetch(mut self, n: u16) -> Self {
        self.prefetch = n.max(1);
        self
    }

    /// How many deliveries run at once (default 1: one at a time, in the order they
    /// came). Deliveries of one idempotency key still run one at a time, in the order they
    /// came; each is acked once settled, whatever the others do.
    pub fn in_flight(mut self, n: usize) -> Self {
        self.in_flight = n.max(1);
        self
    }

    /// In lease mode with `in_flight` 1, the most deliveries that go through one claim
    /// and one settle (default 32; 1 claims and settles each alone): those that have
    /// arrived when one is taken, without waiting for more. Each is still acked once its
    /// own record is settled.
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n.max(1);
        self
    }

    /// The most bytes (payloads and header values) of the deliveries in hand, running or
    /// waiting in a key's lane (default 64 MiB). Over it, no more are taken until some
    /// finish: memory stays within it plus about one message, whatever `in_flight` and
    /// `prefetch` allow. The prefetched deliveries lapin buffers are bounded by `prefetch`.
    pub fn max_bytes(mut self, bytes: usize) -> Self {
        self.max_bytes = bytes;
        self
    }

    /// The waits between retries of a store call, a dead-letter publish or a reconnect:
    /// from `first`, doubling up to `max` (default 50 ms to 2 s).
    pub fn backoff(mut self, first: Duration, max: Duration) -> Self {
        self.backoff = (first, max.max(first));
        self
    }

    /// Stops the consumer when `signal` resolves: it cancels its subscription, finishes the
    /// message in hand, and closes the connection; deliveries not acked go back to the
    /// queue.
    pub fn shutdown(mut self, signal: impl Future<Output = ()> + Send + 'static) -> Self {
        self.shutdown = Some(signal.boxed());
        self
    }

    /// A probe asked at each [`Point`](crate::Point) of each delivery (crash tests).
    pub fn probe(mut self, probe: Arc<dyn Probe>) -> Self {
        self.probe = Some(probe);
        self
    }

    /// The consumer, or why the settings do not work. Reads the TLS files; connects
    /// nothing yet.
    pub fn build(self) -> Result<IdemConsumer> {
        let queue = self
            .queue
            .filter(|q| !q.is_empty())
            .ok_or_else(|| Error::Config("a queue is required".into()))?;
        let mode = match (self.handler, self.transactional) {
            (Some(handler), None) => Mode::Lease(handler),
            (None, Some(store)) => Mode::Transactional(store),
            (None, None) => return Err(Error::Config("a handler is required".into())),
            (Some(_), Some(_)) => {
                return Err(Error::Config(
                    "a handler and transactional mode: give one of them".into(),
                ));
            }
        };
        if matches!(mode, Mode::Transactional(_)) && self.missing_key == MissingKey::Process {
            return Err(Error::Config(
                "transactional mode needs a key for every message: MissingKey::Process is \
                 not available"
                    .into(),
            ));
        }
        self.key_source.check().map_err(Error::Config)?;
        if let DeadLetters::Exchange { routing_key, .. } = &self.dead_letters
            && routing_key.is_empty()
        {
            return Err(Error::Config("the dead-letter routing key is empty".into()));
        }
        let namespace = self.namespace.unwrap_or_else(|| queue.clone());
        idem_core::Key::new(&namespace, "x").map_err(|e| Error::Config(e.to_string()))?;
        let engine = match (self.engine, &mode) {
            (Some(engine), _) => engine,
            (None, Mode::Transactional(store)) => Engine::builder(store.backend()).build()?,
            (None, Mode::Lease(_)) => return Err(Error::Config("an engine is required".into())),
        };
        #[cfg(feature = "tls")]
        let tls = crate::connect::tls_config(
            self.tls_ca_file.as_deref(),
            self.tls_client_cert
                .as_ref()
                .map(|(cert, key)| (cert.as_path(), key.as_path())),
        )?;
        #[cfg(not(feature = "tls"))]
        let tls = lapin::tcp::OwnedTLSConfig::default();
        let target = crate::connect::Target::new(&self.uri, tls)?;
        Ok(IdemConsumer::new(
            Settings {
                target,
                queue: queue.into(),
                namespace,
                key_source: self.key_source,
                engine,
                mode,
                dead_letters: self.dead_letters,
                missing_key: self.missing_key,
                prefetch: self
                    .prefetch
                    .max(u16::try_from(self.in_flight).unwrap_or(u16::MAX)),
                in_flight: self.in_flight,
                max_bytes: self.max_bytes,
                batch_size: self.batch_size,
                backoff: self.backoff,
                probe: self.probe,
            },
            self.shutdown,
        ))
    }
}

impl fmt::Debug for ConsumerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("queue", &self.queue)
            .field("namespace", &self.namespace)
            .field("key_source", &self.key_source)
            .field("dead_letters", &self.dead_letters)
            .field("missing_key", &self.missing_key)
            .field("prefetch", &self.prefetch)
            .field("in_flight", &self.in_flight)
            .field("batch_size", &self.batch_size)
            .finish_non_exhaustive()
    }
}
