#![doc = include_str!("../README.md")]
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
