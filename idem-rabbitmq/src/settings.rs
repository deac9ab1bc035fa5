//! What the builder settles on: the consumer's settings and how a keyed message runs.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use idem_core::binding::{HandlerResult, MissingKey};
use idem_core::{Context, Engine};

use crate::{DeadLetters, KeySource, Message, Probe};

pub(crate) type DynHandler =
    Arc<dyn Fn(Message, Option<Context>) -> BoxFuture<'static, HandlerResult> + Send + Sync>;

/// How a keyed message runs.
pub(crate) enum Mode {
    /// The handler under a lease; the engine stores its result.
    Lease(DynHandler),
    /// The handler's writes and the record in one transaction of this store.
    Transactional(Arc<dyn crate::tx::TxStore>),
}

/// What the builder settled on.
pub(crate) struct Settings {
    pub target: crate::connect::Target,
    pub queue: Arc<str>,
    pub namespace: String,
    pub key_source: KeySource,
    pub engine: Engine,
    pub mode: Mode,
    pub dead_letters: DeadLetters,
    pub missing_key: MissingKey,
    pub prefetch: u16,
    pub in_flight: usize,
    pub max_bytes: usize,
    pub batch_size: usize,
    pub backoff: (Duration, Duration),
    pub probe: Option<Arc<dyn Probe>>,
}
