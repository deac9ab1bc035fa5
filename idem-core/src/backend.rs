//! The `Backend` trait every store implements.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::{
    Claim, ClaimOutcome, Error, FailureKind, Key, Lease, Record, Result, State, Timestamp,
};

/// What a backend can do beyond the required operations. The conformance suite and the
/// engine read these; nothing asks a backend for what it does not declare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// The store drops expired records itself; `purge_expired` has little or nothing to do.
    pub native_expiry: bool,
    /// `claim_many` is cheaper than a loop of `claim` (one round trip per batch).
    pub batch_claim: bool,
    /// The backend offers transactional mode (handler writes commit with the record).
    pub transactions: bool,
    /// The largest response `complete` accepts, in bytes.
    pub max_response_bytes: usize,
    /// `list` is implemented.
    pub list: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            native_expiry: false,
            batch_claim: false,
            transactions: false,
            max_response_bytes: 64 * 1024,
            list: false,
        }
    }
}

impl Capabilities {
    /// Sets `native_expiry`.
    pub fn with_native_expiry(mut self, yes: bool) -> Self {
        self.native_expiry = yes;
        self
    }

    /// Sets `batch_claim`.
    pub fn with_batch_claim(mut self, yes: bool) -> Self {
        self.batch_claim = yes;
        self
    }

    /// Sets `transactions`.
    pub fn with_transactions(mut self, yes: bool) -> Self {
        self.transactions = yes;
        self
    }

    /// Sets `list`.
    pub fn with_list(mut self, yes: bool) -> Self {
        self.list = yes;
        self
    }

    /// Sets `max_response_bytes`.
    pub fn with_max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }
}

/// Which records [`Backend::list`] returns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListFilter {
    /// Only this namespace (all when `None`).
    pub namespace: Option<String>,
    /// Only this state (all when `None`).
    pub state: Option<State>,
    /// At most this many records (0: no limit).
    pub limit: usize,
}

impl ListFilter {
    /// Whether `record` passes the namespace and state conditions.
    pub fn matches(&self, record: &Record) -> bool {
        self.namespace
            .as_deref()
            .is_none_or(|ns| record.key.namespace() == ns)
            && self.state.is_none_or(|s| record.state == s)
    }
}

/// A store of idempotency records. Every method is one atomic step in the store.
///
/// Object safe: the backend is often picked at run time, so `Arc<dyn Backend>` works
/// everywhere a backend does.
#[async_trait]
pub trait Backend: Send + Sync {
    /// Claims `claim.key`, atomically: of concurrent claims on one key, at most one returns
    /// [`ClaimOutcome::Acquired`] while its lease is live; the others learn the existing
    /// record's answer in the same call. Granted tokens for a key strictly increase.
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome>;

    /// Claims each of `claims`, answering in the same order, each with the guarantee of
    /// [`Backend::claim`]. The batch is not atomic as a whole. A store error fails the whole
    /// call. The default loops over `claim`.
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        let mut out = Vec::with_capacity(claims.len());
        for claim in claims {
            out.push(self.claim(claim).await?);
        }
        Ok(out)
    }

    /// Marks the lease's key `Completed` with `response`, kept for `retention`. Succeeds
    /// only while the record is `Processing` with the lease's token; otherwise
    /// [`Error::Fenced`](crate::Error::Fenced) and nothing changes. A response over
    /// [`Capabilities::max_response_bytes`] is [`Error::TooLarge`](crate::Error::TooLarge).
    async fn complete(&self, lease: &Lease, response: Bytes, retention: Duration) -> Result<()>;

    /// Marks the lease's key `Failed` with `error`, kept for `retention`: a later claim
    /// retries it while attempts are left, unless `kind` is permanent. Fenced like
    /// [`Backend::complete`].
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()>;

    /// Extends the lease to `ttl` from the store's now, returning the new deadline. Fenced
    /// like [`Backend::complete`].
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp>;

    /// The record of `key`, if one exists and has not expired.
    async fn get(&self, key: &Key) -> Result<Option<Record>>;

    /// Removes the record of `key`, whatever its state; says whether one existed. An
    /// operator's tool: it breaks the guarantees for that key.
    async fn delete(&self, key: &Key) -> Result<bool>;

    /// Drops records past their `expires_at`, returning how many. Backends with native
    /// expiry may return 0.
    async fn purge_expired(&self) -> Result<u64>;

    /// Live records passing `filter`, in no set order: an operator's tool (`idem list`),
    /// not for hot paths. Backends that cannot enumerate keep the default, which answers
    /// [`Error::Unsupported`], and leave [`Capabilities::list`] false.
    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>> {
        let _ = filter;
        Err(Error::Unsupported { operation: "list" })
    }

    /// What this backend can do.
    fn capabilities(&self) -> Capabilities;
}

macro_rules! forward {
    ($($ptr:tt)*) => {
        #[async_trait]
        impl<T: Backend + ?Sized> Backend for $($ptr)*<T> {
            async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome> {
                (**self).claim(claim).await
            }
            async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
                (**self).claim_many(claims).await
            }
            async fn complete(&self, lease: &Lease, response: Bytes, retention: Duration) -> Result<()> {
                (**self).complete(lease, response, retention).await
            }
            async fn fail(&self, lease: &Lease, error: &str, kind: FailureKind, retention: Duration) -> Result<()> {
                (**self).fail(lease, error, kind, retention).await
            }
            async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
                (**self).extend(lease, ttl).await
            }
            async fn get(&self, key: &Key) -> Result<Option<Record>> {
                (**self).get(key).await
            }
            async fn delete(&self, key: &Key) -> Result<bool> {
                (**self).delete(key).await
            }
            async fn purge_expired(&self) -> Result<u64> {
                (**self).purge_expired().await
            }
            async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>> {
                (**self).list(filter).await
            }
            fn capabilities(&self) -> Capabilities {
                (**self).capabilities()
            }
        }
    };
}

forward!(Arc);
forward!(Box);
