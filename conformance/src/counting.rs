//! A wrapper that logs every call a caller makes to a real backend, with its batch size, so
//! a test can count round trips (how many store calls a poll batch costs).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{
    Backend, Bytes, Capabilities, Claim, ClaimOutcome, FailureKind, Key, Lease, ListFilter, Record,
    Result, Settlement, Timestamp, Watch, async_trait,
};
use tokio::sync::watch;

/// Wraps a backend and logs each call as `(operation, items)`: `("claim_many", 12)`,
/// `("complete", 1)`, ... Every call reaches the wrapped backend.
#[derive(Debug, Clone)]
pub struct Counting<B> {
    inner: B,
    log: Arc<Mutex<Vec<(&'static str, usize)>>>,
    /// How many `claim` calls have answered.
    answered: Arc<watch::Sender<usize>>,
}

impl<B: Backend> Counting<B> {
    /// Wraps `inner` with an empty log.
    pub fn new(inner: B) -> Self {
        Counting {
            inner,
            log: Arc::default(),
            answered: Arc::new(watch::channel(0).0),
        }
    }

    /// The calls so far, in order.
    pub fn calls(&self) -> Vec<(&'static str, usize)> {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Returns once `n` `claim` calls have answered (whatever they answered).
    pub async fn claims_answered(&self, n: usize) {
        let mut rx = self.answered.subscribe();
        // The sender lives in `self`: the wait ends only by reaching `n`.
        let _ = rx.wait_for(|done| *done >= n).await;
    }

    fn note(&self, op: &'static str, items: usize) {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((op, items));
    }
}

#[async_trait]
impl<B: Backend> Backend for Counting<B> {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome> {
        self.note("claim", 1);
        let answer = self.inner.claim(claim).await;
        self.answered.send_modify(|n| *n += 1);
        answer
    }
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        self.note("claim_many", claims.len());
        self.inner.claim_many(claims).await
    }
    async fn complete(&self, lease: &Lease, response: Bytes, retention: Duration) -> Result<()> {
        self.note("complete", 1);
        self.inner.complete(lease, response, retention).await
    }
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        self.note("fail", 1);
        self.inner.fail(lease, error, kind, retention).await
    }
    async fn release(&self, lease: &Lease) -> Result<()> {
        self.note("release", 1);
        self.inner.release(lease).await
    }
    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        self.note("settle_many", items.len());
        self.inner.settle_many(items, retention).await
    }
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        self.note("extend", 1);
        self.inner.extend(lease, ttl).await
    }
    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        self.note("get", 1);
        self.inner.get(key).await
    }
    async fn delete(&self, key: &Key) -> Result<bool> {
        self.note("delete", 1);
        self.inner.delete(key).await
    }
    async fn purge_expired(&self) -> Result<u64> {
        self.note("purge_expired", 0);
        self.inner.purge_expired().await
    }
    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>> {
        self.note("list", 0);
        self.inner.list(filter).await
    }
    async fn watch(&self, key: &Key) -> Watch {
        // Not logged: a watch is no round trip (backends subscribe in process).
        self.inner.watch(key).await
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}
