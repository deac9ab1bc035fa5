#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod backend;
pub mod binding;
pub mod clock;
mod engine;
mod error;
mod handler;
mod key;
pub mod layer;
mod memory;
mod record;
mod transactional;

// The user's face: what running handlers through an engine needs. What only a backend
// author or a test needs is in `backend`; what the broker bindings share, in `binding`.
pub use backend::Backend;
pub use engine::{Engine, EngineBuilder, Outcome, WaitPolicy};
pub use error::{BoxError, Error, Refusal, Result};
pub use handler::{Context, HandlerError};
pub use key::{Fingerprint, Key, MAX_ID_BYTES, MAX_NAMESPACE_BYTES};
pub use memory::MemoryBackend;
pub use record::{ClaimKind, FailureKind, Lease, Record, State, Timestamp};
pub use transactional::{Offsets, Transactional};

pub use bytes::Bytes;
