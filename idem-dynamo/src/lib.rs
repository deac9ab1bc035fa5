#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod backend;
mod batch;
mod config;
mod driver;
mod error;
mod expr;
mod item;
mod requests;
mod table;

pub use backend::DynamoBackend;
pub use config::{DynamoConfig, ITEM_LIMIT_BYTES, StaticCredentials};
pub use driver::{DRIVER, DynamoDriver};
