#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod backend;
pub mod clock;
pub mod driver;
mod engine;
mod error;
mod handler;
mod key;
pub mod layer;
pub mod machine;
mod memory;
mod model;
mod record;
mod transactional;
pub mod watch;

pub use backend::{Backend, Capabilities, ListFilter, group_by};
pub use engine::{Engine, EngineBuilder, Outcome, Ran, WaitPolicy};
pub use error::{BoxError, Error, Result};
pub use handler::{Context, HandlerError, Unwind, panic_at_poll, panic_text};
pub use key::{Fingerprint, Key, MAX_ID_BYTES, MAX_NAMESPACE_BYTES};
pub use memory::MemoryBackend;
pub use model::Model;
pub use record::{
    Claim, ClaimKind, ClaimOutcome, FailureKind, Lease, Record, Settle, Settlement, State,
    Timestamp,
};
pub use transactional::{OffsetPosition, StoredOffset, Transactional, TxFuture};
pub use watch::Watch;

pub use async_trait::async_trait;
pub use bytes::Bytes;
