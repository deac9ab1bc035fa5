//! A bound on every call.

use std::future::Future;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;

use super::{Around, Call, Layer, Layered};
use crate::{Backend, Error, Result};

/// Runs `fut` for at most `limit`; past it, the call is dropped and answers
/// [`Error::Unavailable`] naming `what` and the limit. What the dropped call had done in
/// the store is unknown (a write may have landed): callers treat it as any `Unavailable`.
///
/// The one timeout of the workspace: [`TimeoutLayer`] and every backend's own configured
/// timeout run through it.
pub async fn within<T>(
    what: &str,
    limit: Duration,
    fut: impl Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(answer) => answer,
        Err(_) => Err(Error::Unavailable {
            message: format!("{what}: no answer within {limit:?}"),
            source: None,
        }),
    }
}

/// Bounds every call of the backend it wraps to a duration (`watch` excepted: it waits by
/// design). Put it inside [`RetryLayer`](super::RetryLayer) to bound each try, outside to
/// bound the whole call.
#[derive(Clone, Copy, Debug)]
pub struct TimeoutLayer {
    limit: Duration,
}

impl TimeoutLayer {
    /// Every call bounded by `limit`.
    pub fn new(limit: Duration) -> Self {
        TimeoutLayer { limit }
    }

    /// The bound.
    pub fn limit(&self) -> Duration {
        self.limit
    }
}

impl<B: Backend> Layer<B> for TimeoutLayer {
    type Backend = Layered<B, TimeoutLayer>;
    fn layer(&self, inner: B) -> Self::Backend {
        Layered::new(inner, *self)
    }
}

impl Around for TimeoutLayer {
    fn around<'a, T: Send + 'a>(
        &'a self,
        call: Call<'a>,
        next: BoxFuture<'a, Result<T>>,
    ) -> BoxFuture<'a, Result<T>> {
        if call.op.runs_handlers() {
            return next;
        }
        within(call.op.name(), self.limit, next).boxed()
    }
}
