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
use crate::{BoxError, ClaimKind, FailureKind, Lease};

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
///
/// Any `Send + Sync + 'static` [`std::error::Error`] converts into it with `?` (a
/// retryable failure, the error kept
/// as its [`source`](HandlerError::source)), and so do `anyhow::Error`, `eyre::Report` and
/// `Box<dyn Error + Send + Sync>` through [`retry_from`](HandlerError::retry_from) or
/// [`permanent_from`](HandlerError::permanent_from). For that `?` to work it is not itself
/// a `std::error::Error` (as `anyhow::Error` is not): [`into_boxed`](HandlerError::into_boxed)
/// gives one, with the cause as its source. The record stores the text only.
pub struct HandlerError {
    message: String,
    kind: FailureKind,
    source: Option<BoxError>,
}

impl HandlerError {
    /// A failure a later attempt may get past.
    pub fn retry(message: impl fmt::Display) -> Self {
        HandlerError::new(message.to_string(), FailureKind::Retry, None)
    }

    /// A failure no retry will fix: the key is poisoned at once.
    pub fn permanent(message: impl fmt::Display) -> Self {
        HandlerError::new(message.to_string(), FailureKind::Permanent, None)
    }

    /// A retryable failure caused by `error`, kept as the source; its text is the message.
    /// Takes what converts into a boxed error: any `std::error::Error`, `anyhow::Error`,
    /// `eyre::Report`, `Box<dyn Error + Send + Sync>`, a `String`.
    pub fn retry_from(error: impl Into<BoxError>) -> Self {
        HandlerError::caused(error.into(), FailureKind::Retry)
    }

    /// A permanent failure caused by `error`, kept as the source (see
    /// [`retry_from`](HandlerError::retry_from)).
    pub fn permanent_from(error: impl Into<BoxError>) -> Self {
        HandlerError::caused(error.into(), FailureKind::Permanent)
    }

    fn new(message: String, kind: FailureKind, source: Option<BoxError>) -> Self {
        HandlerError {
            message,
            kind,
            source,
        }
    }

    fn caused(error: BoxError, kind: FailureKind) -> Self {
        HandlerError::new(error.to_string(), kind, Some(error))
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

    /// The error this failure was made from, if it was made from one.
    pub fn source(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        self.source.as_deref()
    }

    /// This failure as a `std::error::Error`: its text, and the cause as its source.
    pub fn into_boxed(self) -> BoxError {
        Box::new(Failed(self))
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for HandlerError {
    fn from(e: E) -> Self {
        HandlerError::retry_from(e)
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HandlerError({:?}: {})", self.kind, self.message)?;
        match &self.source {
            Some(source) => write!(f, " caused by {source:?}"),
            None => Ok(()),
        }
    }
}

/// [`HandlerError::into_boxed`]'s error.
struct Failed(HandlerError);

impl fmt::Debug for Failed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for Failed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for Failed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0
            .source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io() -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::TimedOut, "card service timed out")
    }

    #[test]
    fn a_question_mark_keeps_the_error_as_its_source() {
        fn handler() -> Result<(), HandlerError> {
            Err::<(), _>(io())?;
            Ok(())
        }
        let e = handler().unwrap_err();
        assert_eq!(e.kind(), FailureKind::Retry);
        assert_eq!(e.message(), "card service timed out");
        let source = e.source().expect("the io error");
        let io = source
            .downcast_ref::<std::io::Error>()
            .expect("an io::Error");
        assert_eq!(io.kind(), std::io::ErrorKind::TimedOut);
    }

    #[test]
    fn boxed_errors_and_text_convert_with_their_kind() {
        let boxed: BoxError = Box::new(io());
        let e = HandlerError::permanent_from(boxed);
        assert_eq!(e.kind(), FailureKind::Permanent);
        assert!(e.source().is_some_and(|s| s.is::<std::io::Error>()));
        let e = HandlerError::retry_from("declined");
        assert_eq!((e.kind(), e.message()), (FailureKind::Retry, "declined"));
        assert!(HandlerError::retry("plain").source().is_none());
    }

    #[test]
    fn into_boxed_is_a_std_error_with_the_cause_as_source() {
        let boxed = HandlerError::from(io()).into_boxed();
        assert_eq!(boxed.to_string(), "card service timed out");
        let cause = boxed.source().expect("a source");
        assert!(cause.is::<std::io::Error>(), "{cause:?}");
        assert!(
            HandlerError::retry("no cause")
                .into_boxed()
                .source()
                .is_none()
        );
    }
}
