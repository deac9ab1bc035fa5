//! A wrapper that makes a real backend fail on demand, to test what callers do when the
//! store is down. It never stands in for a store: every call it lets through reaches the
//! wrapped backend.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem_core::watch::Watchers;
use idem_core::{
    Backend, Bytes, Capabilities, Claim, ClaimOutcome, Error, FailureKind, Key, Lease, ListFilter,
    Record, Result, Settle, Settlement, Timestamp, Watch, async_trait,
};

/// Which calls a [`Faulty`] backend refuses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Fault {
    /// `claim` and `claim_many`.
    Claim = 1,
    /// `complete`, and `settle_many` of a batch with a complete in it.
    Complete = 2,
    /// `fail` and `release`, and `settle_many` of a batch with either in it.
    Fail = 4,
    /// `extend`.
    Extend = 8,
    /// `get`, `delete`, `purge_expired` and `list`.
    Read = 16,
    /// Notifications: `watch` gives a watch nothing wakes (every notification lost), while
    /// the capabilities still say the backend notifies.
    Notify = 32,
}

/// Wraps a backend; calls of the kinds switched on answer [`Error::Unavailable`] without
/// reaching the store.
#[derive(Debug, Clone)]
pub struct Faulty<B> {
    inner: B,
    on: Arc<AtomicU32>,
    /// The hub of the watches nothing wakes.
    silent: Arc<Watchers>,
}

impl<B: Backend> Faulty<B> {
    /// Wraps `inner` with every fault off.
    pub fn new(inner: B) -> Self {
        Faulty {
            inner,
            on: Arc::new(AtomicU32::new(0)),
            silent: Watchers::new(),
        }
    }

    /// Switches `fault` on or off. Clones share the switches.
    pub fn set(&self, fault: Fault, on: bool) {
        if on {
            self.on.fetch_or(fault as u32, Ordering::SeqCst);
        } else {
            self.on.fetch_and(!(fault as u32), Ordering::SeqCst);
        }
    }

    /// Switches every fault on or off.
    pub fn set_all(&self, on: bool) {
        self.on
            .store(if on { u32::MAX } else { 0 }, Ordering::SeqCst);
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    fn is_on(&self, fault: Fault) -> bool {
        self.on.load(Ordering::SeqCst) & fault as u32 != 0
    }

    fn check(&self, fault: Fault) -> Result<()> {
        if self.is_on(fault) {
            return Err(Error::Unavailable {
                message: format!("injected fault on {fault:?}"),
                source: None,
            });
        }
        Ok(())
    }
}

#[async_trait]
impl<B: Backend> Backend for Faulty<B> {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome> {
        self.check(Fault::Claim)?;
        self.inner.claim(claim).await
    }
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        self.check(Fault::Claim)?;
        self.inner.claim_many(claims).await
    }
    async fn complete(&self, lease: &Lease, response: Bytes, retention: Duration) -> Result<()> {
        self.check(Fault::Complete)?;
        self.inner.complete(lease, response, retention).await
    }
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        self.check(Fault::Fail)?;
        self.inner.fail(lease, error, kind, retention).await
    }
    async fn release(&self, lease: &Lease) -> Result<()> {
        self.check(Fault::Fail)?;
        self.inner.release(lease).await
    }
    /// Fails the whole batch if any of its kinds of write is faulted.
    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        for item in items {
            self.check(match item.settle {
                Settle::Complete(_) => Fault::Complete,
                Settle::Fail { .. } | Settle::Release => Fault::Fail,
            })?;
        }
        self.inner.settle_many(items, retention).await
    }
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        self.check(Fault::Extend)?;
        self.inner.extend(lease, ttl).await
    }
    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        self.check(Fault::Read)?;
        self.inner.get(key).await
    }
    async fn delete(&self, key: &Key) -> Result<bool> {
        self.check(Fault::Read)?;
        self.inner.delete(key).await
    }
    async fn purge_expired(&self) -> Result<u64> {
        self.check(Fault::Read)?;
        self.inner.purge_expired().await
    }
    async fn list(&self, filter: &ListFilter) -> Result<Vec<Record>> {
        self.check(Fault::Read)?;
        self.inner.list(filter).await
    }
    async fn watch(&self, key: &Key) -> Watch {
        if self.is_on(Fault::Notify) {
            return self.silent.subscribe(String::new());
        }
        self.inner.watch(key).await
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}
