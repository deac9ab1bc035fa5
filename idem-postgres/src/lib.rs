#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod backend;
mod claim;
mod config;
mod driver;
mod error;
mod notify;
mod settle;
mod sql;
mod transactional;

pub use backend::{PLANNING, PgBackend};
pub use config::PgConfig;
pub use driver::{DRIVER, PgDriver};
pub use idem_core::backend::{OffsetPosition, StoredOffset};
/// The sqlx this crate is built on, for a transactional handler's queries: its
/// transaction type is sqlx's, so your queries need the same version with the same
/// features, which this re-export is.
pub use sqlx;
pub use transactional::PgTransaction;
