//! What a handler returns, and the lease-mode handler as the loop keeps it.

use std::sync::Arc;

use futures::future::BoxFuture;
use idem_core::Context;

use crate::Message;

pub use idem_core::binding::HandlerResult;

pub(crate) type DynHandler =
    Arc<dyn Fn(Message, Option<Context>) -> BoxFuture<'static, HandlerResult> + Send + Sync>;
