//! The record kept per key, the claim request and its answers.

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::{Fingerprint, Key};

/// A point in time: milliseconds since the Unix epoch, as the deciding clock saw it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(u64);

impl Timestamp {
    /// From milliseconds since the Unix epoch.
    pub const fn from_millis(millis: u64) -> Self {
        Timestamp(millis)
    }

    /// Milliseconds since the Unix epoch.
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// The system clock, now.
    pub fn now() -> Self {
        Self::from_system_time(SystemTime::now())
    }

    /// From a [`SystemTime`]; times before the epoch become the epoch.
    pub fn from_system_time(t: SystemTime) -> Self {
        let millis = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis();
        Timestamp(u64::try_from(millis).unwrap_or(u64::MAX))
    }

    /// As a [`SystemTime`].
    pub fn to_system_time(self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.0)
    }

    /// `self + d`, saturating.
    pub fn saturating_add(self, d: Duration) -> Self {
        let d = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        Timestamp(self.0.saturating_add(d))
    }

    /// How long from `earlier` to `self`, zero if `earlier` is later.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Timestamp({})", self.0)
    }
}

/// The state of a record. A key with no record is "new".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    /// A worker holds, or held, a lease and may be running the handler.
    Processing,
    /// The handler finished; the response is kept for duplicates.
    Completed,
    /// The last attempt failed; retried by the next claim while attempts are left, unless
    /// the failure was permanent.
    Failed,
}

impl State {
    /// The lower-case name used in stores: `processing`, `completed`, `failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Processing => "processing",
            State::Completed => "completed",
            State::Failed => "failed",
        }
    }

    /// Parses [`State::as_str`]'s form.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "processing" => Some(State::Processing),
            "completed" => Some(State::Completed),
            "failed" => Some(State::Failed),
            _ => None,
        }
    }
}

/// One record per key, as CONTRACT.md describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// The key.
    pub key: Key,
    /// Its state.
    pub state: State,
    /// The worker that holds, or last held, the lease (shared: a record, its claim and
    /// its lease hold the same string).
    pub owner: Arc<str>,
    /// The fencing token: grows by one at every successful claim.
    pub token: u64,
    /// How many claims were granted so far.
    pub attempts: u32,
    /// `Processing` only: when the lease lapses unless extended.
    pub lease_until: Option<Timestamp>,
    /// The payload fingerprint fixed at the first claim, if one was given.
    pub fingerprint: Option<Fingerprint>,
    /// `Completed` only: the handler's response.
    pub response: Option<Bytes>,
    /// `Failed` only: the last error text.
    pub error: Option<String>,
    /// `Failed` only: the failure was permanent, so the key is poisoned.
    pub permanent: bool,
    /// When the record may be dropped.
    pub expires_at: Option<Timestamp>,
}

/// A claim request: `claim(key, owner, lease_ttl, fingerprint, max_attempts)` of CONTRACT.md,
/// plus the retention a record keeps when this claim finds its lease lapsed for good.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    /// The key to claim.
    pub key: Key,
    /// Who claims (the engine's owner, shared by every claim it makes).
    pub owner: Arc<str>,
    /// How long the lease lasts unless extended.
    pub lease_ttl: Duration,
    /// The payload fingerprint, if payloads are checked.
    pub fingerprint: Option<Fingerprint>,
    /// How many attempts a key gets before it is poisoned (at least 1).
    pub max_attempts: u32,
    /// How long a `Processing`, `Failed` or poisoned record is kept past its last change.
    pub retention: Duration,
}

/// Why a claim was granted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ClaimKind {
    /// No record existed (or it had expired): the first attempt.
    First,
    /// The previous attempt failed with a retryable error.
    Retry,
    /// The previous holder's lease lapsed: it may have half-run the side effect.
    Takeover,
}

/// A granted lease: the right to run the handler for one key, fenced by its token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// The key.
    pub key: Key,
    /// The holder.
    pub owner: Arc<str>,
    /// The fencing token; pass it to downstream stores so they can refuse stale writers.
    pub token: u64,
    /// This attempt's number, starting at 1.
    pub attempts: u32,
    /// When the lease lapses unless extended.
    pub lease_until: Timestamp,
    /// Whether this is a first attempt, a retry or a takeover.
    pub kind: ClaimKind,
    /// The payload fingerprint the record carries under this lease: the claim's, or on a
    /// retry or takeover the one stored before, which the record keeps. It plays no part in
    /// fencing: a backend may use it to name the record exactly (Redis's compare-and-set
    /// complete does).
    pub fingerprint: Option<Fingerprint>,
}

/// The one answer a claim gives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller holds the lease and should run the handler.
    Acquired(Lease),
    /// A duplicate: the stored response, byte for byte.
    Completed(Bytes),
    /// Another worker holds a live lease.
    InProgress {
        /// The holder.
        owner: Arc<str>,
        /// When its lease lapses unless extended, as this backend judges it: a backend that
        /// allows for clock skew reports the deadline plus its margin.
        lease_until: Timestamp,
    },
    /// The attempts are spent, or a handler failed permanently.
    Poisoned {
        /// Attempts made.
        attempts: u32,
        /// The last error.
        error: String,
    },
    /// The key exists with another payload fingerprint; the record was not touched.
    Mismatch,
}

/// How one lease of a batch is settled: what [`Backend::complete`](crate::Backend::complete),
/// [`Backend::fail`](crate::Backend::fail) or [`Backend::release`](crate::Backend::release)
/// would do for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Settle {
    /// `Completed` with this response.
    Complete(Bytes),
    /// `Failed` with this error text, retryable or permanent.
    Fail {
        /// The error text stored in the record.
        error: String,
        /// Retry or permanent.
        kind: FailureKind,
    },
    /// Handed back unrun: the attempt is taken back and the lease lapses now.
    Release,
}

impl Settle {
    /// The bytes of the text it stores: the response or the error (none for a release). A
    /// store sizes its request with it.
    pub fn text_len(&self) -> usize {
        match self {
            Settle::Complete(response) => response.len(),
            Settle::Fail { error, .. } => error.len(),
            Settle::Release => 0,
        }
    }
}

/// One item of [`Backend::settle_many`](crate::Backend::settle_many): a lease and what
/// becomes of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settlement {
    /// The lease the handler ran (or would have run) under.
    pub lease: Lease,
    /// What to write.
    pub settle: Settle,
}

impl Settlement {
    /// `lease` completed with `response`.
    pub fn complete(lease: Lease, response: Bytes) -> Self {
        Settlement {
            lease,
            settle: Settle::Complete(response),
        }
    }

    /// `lease` failed with `error`.
    pub fn fail(lease: Lease, error: impl Into<String>, kind: FailureKind) -> Self {
        Settlement {
            lease,
            settle: Settle::Fail {
                error: error.into(),
                kind,
            },
        }
    }

    /// `lease` handed back unrun.
    pub fn release(lease: Lease) -> Self {
        Settlement {
            lease,
            settle: Settle::Release,
        }
    }
}

/// Whether a failed attempt may be retried.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// A later claim may try again while attempts are left.
    Retry,
    /// Never try again: the key is poisoned.
    Permanent,
}
