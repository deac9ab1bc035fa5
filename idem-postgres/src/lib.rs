#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod backend;
mod config;
mod error;
mod sql;
mod transactional;

pub use backend::{PLANNING, PgBackend};
pub use config::PgConfig;
pub use transactional::{OffsetPosition, PgTransaction, StoredOffset};
