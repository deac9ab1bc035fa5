// The README is the front page. Its quickstart needs the features `redis` and `kafka` (as
// docs.rs builds it, with every feature); without them the page is a pointer to it, so the
// README's example needs no lines hidden from a reader who pastes it.
#![cfg_attr(all(feature = "redis", feature = "kafka"), doc = include_str!("../README.md"))]
#![cfg_attr(
    not(all(feature = "redis", feature = "kafka")),
    doc = "Effectively-once processing for Kafka and RabbitMQ consumers: idempotency keys, \
           leases and fencing over Redis, PostgreSQL, MySQL, DynamoDB or memory. The \
           README (this page, with the features `redis` and `kafka` on) has the quickstart."
)]
#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use idem_core::{
    Backend, BoxError, Bytes, ClaimKind, Context, Engine, EngineBuilder, Error, FailureKind,
    Fingerprint, HandlerError, Key, Lease, MAX_ID_BYTES, MAX_NAMESPACE_BYTES, MemoryBackend,
    Outcome, Record, Result, State, Timestamp, Transactional, WaitPolicy, backend, clock, layer,
};

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use idem_postgres as postgres;

#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use idem_mysql as mysql;

#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use idem_redis as redis;

#[cfg(feature = "dynamo")]
#[cfg_attr(docsrs, doc(cfg(feature = "dynamo")))]
pub use idem_dynamo as dynamo;

#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub use idem_kafka as kafka;

#[cfg(feature = "rabbitmq")]
#[cfg_attr(docsrs, doc(cfg(feature = "rabbitmq")))]
pub use idem_rabbitmq as rabbitmq;

mod registry;

pub use registry::{LookupError, Registered, driver_for, drivers, open};
