//! What a handler returns, and the lease-mode handler as the loop keeps it.

use std::sync::Arc;

use bytes::Bytes;
use futures::future::BoxFuture;
use idem_core::{Context, HandlerError};

use crate::Message;

/// What a handler's future resolves to: the response bytes stored for duplicates, or a
/// retryable or permanent [`HandlerError`].
pub type HandlerResult = std::result::Result<Bytes, HandlerError>;

pub(crate) type DynHandler =
    Arc<dyn Fn(Message, Option<Context>) -> BoxFuture<'static, HandlerResult> + Send + Sync>;
