//! Tracing and metrics for every store call.

use std::time::Instant;

use futures::FutureExt;
use futures::future::BoxFuture;
use tracing::Instrument;

use super::{Around, Call, Layer, Layered};
use crate::{Backend, Error, Result};

/// Records each call of the backend it wraps:
///
/// - a `tracing` span `idem.store` with fields `op` and `items`, and a debug event with the
///   outcome and the time taken (a warn event for `Unavailable` and `Corrupt`);
/// - through the `metrics` facade, the counter `idem_store_calls_total` and the histogram
///   `idem_store_call_seconds`, both labelled `op` (`claim`, `settle_many`, …) and
///   `outcome` (`ok`, `fenced`, `unavailable`, `corrupt`, `too_large`, `other`), and the
///   counter `idem_store_items_total` labelled `op` (a batch counts its items).
///
/// Nothing is recorded unless the application installs a subscriber or a recorder.
#[derive(Clone, Copy, Debug, Default)]
pub struct ObserveLayer;

impl ObserveLayer {
    /// The layer.
    pub fn new() -> Self {
        ObserveLayer
    }
}

impl<B: Backend> Layer<B> for ObserveLayer {
    type Backend = Layered<B, ObserveLayer>;
    fn layer(&self, inner: B) -> Self::Backend {
        Layered::new(inner, *self)
    }
}

/// The `outcome` label of an answer.
pub(crate) fn outcome<T>(answer: &Result<T>) -> &'static str {
    match answer {
        Ok(_) => "ok",
        Err(Error::Fenced { .. }) => "fenced",
        Err(Error::Unavailable { .. }) => "unavailable",
        Err(Error::Corrupt { .. }) => "corrupt",
        Err(Error::TooLarge { .. }) => "too_large",
        Err(_) => "other",
    }
}

impl Around for ObserveLayer {
    fn around<'a, T: Send + 'a>(
        &'a self,
        call: Call<'a>,
        next: BoxFuture<'a, Result<T>>,
    ) -> BoxFuture<'a, Result<T>> {
        let op = call.op.name();
        let span = tracing::debug_span!("idem.store", op, items = call.items);
        async move {
            let started = Instant::now();
            let answer = next.await;
            let elapsed = started.elapsed();
            let outcome = outcome(&answer);
            metrics::counter!("idem_store_calls_total", "op" => op, "outcome" => outcome)
                .increment(1);
            metrics::counter!("idem_store_items_total", "op" => op).increment(call.items as u64);
            metrics::histogram!("idem_store_call_seconds", "op" => op, "outcome" => outcome)
                .record(elapsed.as_secs_f64());
            match &answer {
                Err(e @ (Error::Unavailable { .. } | Error::Corrupt { .. })) => {
                    tracing::warn!(outcome, ?elapsed, error = %e, "store call failed");
                }
                _ => tracing::debug!(outcome, ?elapsed, "store call"),
            }
            answer
        }
        .instrument(span)
        .boxed()
    }
}
