#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod config;
mod consumer;
mod dlq;
mod error;
mod key;
mod message;
pub mod metrics;
mod partition;
mod probe;
mod run;
mod settle;
#[cfg(feature = "postgres")]
mod transactional;

pub use config::{ConsumerBuilder, DeadLetterTopic, HandlerResult, MissingKey};
pub use consumer::IdemConsumer;
pub use dlq::{
    HEADER_ATTEMPTS, HEADER_ERROR, HEADER_KEY, HEADER_OFFSET, HEADER_PARTITION, HEADER_REASON,
    HEADER_TOPIC, Reason,
};
pub use error::{Error, Result};
pub use key::{DEFAULT_KEY_HEADER, KeyFn, KeySource};
pub use message::Message;
pub use probe::{Point, Probe, Verdict};

pub use rdkafka;
