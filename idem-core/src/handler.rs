//! What a handler receives and what it may return.

use std::fmt;

use tokio_util::sync::CancellationToken;

use crate::{ClaimKind, FailureKind, Lease};

/// What the engine hands a handler: the lease it runs under, and a signal that fires if
/// the lease is lost while it runs.
#[derive(Debug, Clone)]
pub struct Context {
    lease: Lease,
    fenced: CancellationToken,
}

impl Context {
    pub(crate) fn new(lease: Lease, fenced: CancellationToken) -> Self {
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
        self.fenced.cancelled().await
    }

    /// Whether the lease has been lost.
    pub fn is_fenced(&self) -> bool {
        self.fenced.is_cancelled()
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
    pub fn panicked(payload: &(dyn std::any::Any + Send)) -> Self {
        let text = if let Some(s) = payload.downcast_ref::<&str>() {
            (*s).to_owned()
        } else if let Some(s) = payload.downcast_ref::<String>() {
            s.clone()
        } else {
            "non-text panic payload".to_owned()
        };
        HandlerError::retry(format!("handler panicked: {text}"))
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
