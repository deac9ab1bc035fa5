#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod budget;
mod builder;
mod client;
mod consumer;
mod crash;
mod dead_letter;
mod error;
mod handle;
mod handler;
mod key;
mod message;
pub mod metrics;
mod order;
mod probe;
mod queue;
mod replay;
mod settings;
mod slot;
mod start;
mod tx;
mod worker;

pub use builder::ConsumerBuilder;
pub use consumer::IdemConsumer;
pub use dead_letter::read::{DeadLetter, Selection, read_letters};
pub use dead_letter::{
    DEAD_LETTER_HEADERS, HEADER_ATTEMPTS, HEADER_DROPPED, HEADER_ERROR, HEADER_KEY,
    HEADER_NAMESPACE, HEADER_OFFSET, HEADER_PARTITION, HEADER_REASON, HEADER_REPLAY_OF,
    HEADER_TOPIC, Reason,
};
pub use error::{Error, Result};
pub use handler::HandlerResult;
pub use idem_core::binding::MissingKey;
pub use key::{DEFAULT_KEY_HEADER, KeyFn, KeySource};
pub use message::Message;
pub use order::OrderBy;
pub use probe::{Point, Probe, Verdict};
pub use replay::{Previous, REPLAY_NAMESPACE, Replay, Replayer, Reset, Sent};
pub use settings::{DeadLetterTopic, MAX_BATCH_SIZE};
pub use start::ConnectFailure;

pub use rdkafka;
