#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod config;
mod consumer;
mod dlq;
mod error;
mod handle;
mod key;
mod lanes;
mod letters;
mod message;
pub mod metrics;
mod partition;
mod probe;
mod replay;
mod slot;
mod tx;

pub use config::{ConsumerBuilder, DeadLetterTopic, HandlerResult, MAX_BATCH_SIZE, MissingKey};
pub use consumer::IdemConsumer;
pub use dlq::{
    DEAD_LETTER_HEADERS, HEADER_ATTEMPTS, HEADER_DROPPED, HEADER_ERROR, HEADER_KEY,
    HEADER_NAMESPACE, HEADER_OFFSET, HEADER_PARTITION, HEADER_REASON, HEADER_REPLAY_OF,
    HEADER_TOPIC, Reason,
};
pub use error::{Error, Result};
pub use key::{DEFAULT_KEY_HEADER, KeyFn, KeySource};
pub use lanes::OrderBy;
pub use letters::{DeadLetter, Selection, read_letters};
pub use message::Message;
pub use probe::{Point, Probe, Verdict};
pub use replay::{Previous, REPLAY_NAMESPACE, Replay, Replayer, Reset, Sent};

pub use rdkafka;
