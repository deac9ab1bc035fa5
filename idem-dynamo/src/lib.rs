#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod backend;
mod claim;
mod config;
mod driver;
mod error;
mod expr;
mod item;
mod settle;
mod table;

pub use backend::DynamoBackend;
pub use config::{DynamoConfig, ITEM_LIMIT_BYTES, StaticCredentials};
pub use driver::{DRIVER, DynamoDriver};
