//! The `Backend` trait every store implements.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::{
    Claim, ClaimOutcome, Error, FailureKind, Key, Lease, Record, Result, Settle, Settlement, State,
    Timestamp, Watch,
};

/// What a backend can do beyond the required operations. The conformance suite and the
/// engine read these; nothing asks a backend for what it does not declare.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// The store drops expired records itself; `purge_expired` has little or nothing to do.
    pub native_expiry: bool,
    /// The largest response `complete` accepts, in bytes.
    pub max_response_bytes: usize,
    /// `list` is implemented.
    pub list: bool,
    /// [`Backend::watch`] is woken by the store when a key is settled (completed, failed,
    /// released); without it a watch only times out, and a waiting engine polls.
    pub notify: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            native_expiry: false,
            max_response_bytes: 64 * 1024,
            list: false,
            notify: false,
        }
    }
}

impl Capabilities {
    /// Sets `native_expiry`.
    pub fn with_native_expiry(mut self, yes: bool) -> Self {
        self.native_expiry = yes;
        self
    }

    /// Sets `list`.
    pub fn with_list(mut self, yes: bool) -> Self {
        self.list = yes;
        self
    }

    /// Sets `notify`.
    pub fn with_notify(mut self, yes: bool) -> Self {
        self.notify = yes;
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

    /// Hands back a lease whose handler never started (a revoke, a shutdown): the attempt
    /// it counted is taken back and the lease lapses now, so the next claim takes the key
    /// over at once; the token stays. Only the holder of a live lease can release; a lapsed
    /// or superseded lease is [`Error::Fenced`](crate::Error::Fenced) and nothing changes.
    async fn release(&self, lease: &Lease) -> Result<()>;

    /// Settles each item as [`Backend::complete`], [`Backend::fail`] or
    /// [`Backend::release`] would, answering in the same order with what those calls made
    /// in turn would answer: `Ok`, [`Error::Fenced`](crate::Error::Fenced) or
    /// [`Error::TooLarge`](crate::Error::TooLarge) per item. A key repeated in the batch is
    /// answered from the state the earlier item left; one item's refusal never changes
    /// another item's record. The batch is not atomic as a whole. A store error fails the
    /// whole call (some items may have been written: each is safe to settle again, which
    /// is then fenced or repeats the same write). The default loops over the single calls.
    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            let answer = match &item.settle {
                Settle::Complete(response) => {
                    self.complete(&item.lease, response.clone(), retention)
                        .await
                }
                Settle::Fail { error, kind } => {
                    self.fail(&item.lease, error, *kind, retention).await
                }
                Settle::Release => self.release(&item.lease).await,
            };
            match answer {
                Ok(()) => out.push(Ok(())),
                Err(e @ (Error::Fenced { .. } | Error::TooLarge { .. })) => out.push(Err(e)),
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

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

    /// Starts watching `key`: the [`Watch`] wakes when the record may have changed after
    /// this call (a settle of the key: complete, fail, release, delete), or when its
    /// timeout passes. Take it before reading the record, then read, then wait: a change
    /// between the read and the wait still wakes it. A wake is only a hint to read again; a
    /// lost notification costs the caller one timeout, never a hang. A backend may cover
    /// only a record that exists when the watch is taken (PostgreSQL marks it); the engine
    /// watches a key only after a claim found it in progress. Backends with
    /// [`Capabilities::notify`] override it; the default never wakes (polling).
    async fn watch(&self, key: &Key) -> Watch {
        let _ = key;
        Watch::poll_only()
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
            async fn release(&self, lease: &Lease) -> Result<()> {
                (**self).release(lease).await
            }
            async fn settle_many(&self, items: &[Settlement], retention: Duration) -> Result<Vec<Result<()>>> {
                (**self).settle_many(items, retention).await
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
            async fn watch(&self, key: &Key) -> Watch {
                (**self).watch(key).await
            }
            fn capabilities(&self) -> Capabilities {
                (**self).capabilities()
            }
        }
    };
}

forward!(Arc);
forward!(Box);

/// `items` grouped by `key`: one group per distinct key, in the order each key first
/// appears, each group in the order of `items`. What a batch call needs to keep the items
/// of one key in order (a backend's rounds of distinct keys, a cluster's slots, a
/// partition's lanes).
///
/// ```
/// let words = ["a", "b", "a", "c", "b"];
/// let groups = idem_core::group_by(0..words.len(), |&i| words[i]);
/// assert_eq!(groups, vec![vec![0, 2], vec![1, 4], vec![3]]);
/// ```
pub fn group_by<T, K: Hash + Eq>(
    items: impl IntoIterator<Item = T>,
    mut key: impl FnMut(&T) -> K,
) -> Vec<Vec<T>> {
    let mut index: HashMap<K, usize, foldhash::fast::FixedState> = HashMap::default();
    let mut groups: Vec<Vec<T>> = Vec::new();
    for item in items {
        let g = *index.entry(key(&item)).or_insert_with(|| {
            groups.push(Vec::new());
            groups.len() - 1
        });
        groups[g].push(item);
    }
    groups
}
