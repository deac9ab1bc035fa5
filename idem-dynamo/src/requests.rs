//! Counting the requests a backend sends.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use aws_sdk_dynamodb::config::interceptors::BeforeTransmitInterceptorContextRef;
use aws_sdk_dynamodb::config::{ConfigBag, Intercept, RuntimeComponents};
use aws_sdk_dynamodb::error::BoxError;

/// An SDK interceptor that counts every HTTP request sent, retries included.
#[derive(Clone, Debug, Default)]
pub(crate) struct Requests(Arc<AtomicU64>);

impl Requests {
    /// How many were sent so far.
    pub(crate) fn sent(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

impl Intercept for Requests {
    fn name(&self) -> &'static str {
        "idem-dynamo request counter"
    }

    fn read_before_transmit(
        &self,
        _: &BeforeTransmitInterceptorContextRef<'_>,
        _: &RuntimeComponents,
        _: &mut ConfigBag,
    ) -> Result<(), BoxError> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}
