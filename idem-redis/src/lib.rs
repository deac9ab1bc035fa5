#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod backend;
mod claim;
mod config;
mod conn;
mod driver;
mod error;
mod keys;
mod library;
mod notify;
mod record;
mod settle;

pub use backend::RedisBackend;
pub use config::RedisConfig;
pub use driver::{DRIVER, RedisDriver};
