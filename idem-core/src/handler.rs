//! What a handler receives and what it may return.

use std::any::Any;
use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{self, Poll};

use futures::future::Either;

use crate::binding::Signal;
use crate::{ClaimKind, FailureKind, Lease};

/// What the engine hands a handler: the lease it runs under, and a signal that fires if
/// the lease is lost while it runs.
#[derive(Debug, Clone)]
pub struct Context {
    lease: Lease,
    fenced: Signal,
}

impl Context {
    pub(crate) fn new(lease: Lease, fenced: Signal) -> Self {
        Context { lease, fenced }
    }

    /// The fencing token. Pass it to a downstream store that can refuse a write carrying a
    /// token lower than one it has seen: that, not the lease, is what stops a stalled
    /// worker's late side effect.
    pub fn token(&self) -> u64 {
        self.lease.token
    }

    /// This attempt's number, starting at 1.
    pub fn attempt(&self) -> u32 {
        self.lease.attempts
    }

    /// Whether this is a first attempt, a retry, or a takeover of a lapsed lease (in which
    /// case a previous attempt may have half-run).
    pub fn kind(&self) -> ClaimKind {
        self.lease.kind
    }

    /// The whole lease.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Resolves when the lease has been lost (a heartbeat was fenced). A handler that can
    /// stop half-way should select on this and return.
    pub async fn fenced(&self) {
        self.fenced.fired().await
    }

    /// Whether the lease has been lost.
    pub fn is_fenced(&self) -> bool {
        self.fenced.is_fired()
    }
}

/// The future `start` returns, where a panic in `start` itself (before any future exists)
/// is raised again at the future's first poll, so that the `catch_unwind` guarding the
/// future sees it too. A handler written `|m, _| { let p = parse(&m).unwrap(); async move
/// {..} }` panics in that first part, outside its future.
pub fn panic_at_poll<Fut: Future, S: FnOnce() -> Fut>(
    start: S,
) -> Either<Fut, Unwind<Fut::Output>> {
    match std::panic::catch_unwind(AssertUnwindSafe(start)) {
        Ok(fut) => Either::Left(fut),
        Err(panic) => Either::Right(Unwind(Some(panic), PhantomData)),
    }
}

/// A future that resumes a caught panic when polled (see [`panic_at_poll`]).
pub struct Unwind<T>(Option<Box<dyn Any + Send>>, PhantomData<fn() -> T>);

impl<T> Future for Unwind<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, _: &mut task::Context<'_>) -> Poll<T> {
        match self.0.take() {
            Some(panic) => std::panic::resume_unwind(panic),
            None => Poll::Pending,
        }
    }
}

impl<T> fmt::Debug for Unwind<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Unwind")
    }
}

/// The text a panic carried (its `&str` or `String` payload), or a placeholder.
pub fn panic_text(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "non-text panic payload"
    }
}

/// A handler's failure: retryable (the default for any `?`-converted error) or permanent.
pub struct HandlerError {
    message: String,
    kind: FailureKind,
}

impl HandlerError {
    /// A failure a later attempt may get past.
    pub fn retry(message: impl fmt::Display) -> Self {
        HandlerError {
            message: message.to_string(),
            kind: FailureKind::Retry,
        }
    }

    /// A failure no retry will fix: the key is poisoned at once.
    pub fn permanent(message: impl fmt::Display) -> Self {
        HandlerError {
            message: message.to_string(),
            kind: FailureKind::Permanent,
        }
    }

    /// A retryable failure for a handler that panicked with `payload`.
    pub fn panicked(payload: &(dyn Any + Send)) -> Self {
        HandlerError::retry(format!("handler panicked: {}", panic_text(payload)))
    }

    /// The error text stored in the record.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The error text, owned.
    pub fn into_message(self) -> String {
        self.message
    }

    /// Retry or permanent.
    pub fn kind(&self) -> FailureKind {
        self.kind
    }
}

impl<E: std::error::Error> From<E> for HandlerError {
    fn from(e: E) -> Self {
        HandlerError::retry(e)
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HandlerError({:?}: {})", self.kind, self.message)
    }
}
