//! Layers: behaviour that wraps any [`Backend`] (timeouts, retries, tracing and metrics,
//! fault injection), written once instead of inside each backend, as tower's and OpenDAL's
//! layers are.
//!
//! ```
//! use std::time::Duration;
//! use idem_core::MemoryBackend;
//! use idem_core::layer::{BackendExt, ChaosLayer, ObserveLayer, RetryLayer, TimeoutLayer};
//!
//! let chaos = ChaosLayer::new();
//! let backend = MemoryBackend::new()
//!     .layer(chaos.clone())                                // innermost: the injected faults
//!     .layer(TimeoutLayer::new(Duration::from_secs(1)))    // each try bounded
//!     .layer(RetryLayer::new())                            // retries `Unavailable` only
//!     .layer(ObserveLayer::new());                         // outermost: what the caller saw
//! # let _ = backend;
//! ```
//!
//! Names are tower's: each `XLayer` makes an `X<B>` out of a backend `B` ([`Timeout`],
//! [`Retry`], [`Coalesce`], [`Observe`], [`Chaos`]).
//!
//! Every layer but [`Retry`] and [`Coalesce`] is a [`Layered`] backend: one forwarding
//! implementation of [`Backend`] that hands each call to an [`Around`] hook. [`Retry`]
//! implements the trait itself, because what a retry means differs per operation (see its
//! docs), and so does [`Coalesce`], because it changes which method reaches the store.

mod chaos;
mod coalesce;
mod observe;
mod retry;
mod timeout;

use futures::future::BoxFuture;

pub use chaos::{ChaosLayer, Fault};
pub use coalesce::{Coalesce, CoalesceLayer};
pub use observe::ObserveLayer;
pub use retry::{Retry, RetryLayer};
pub use timeout::{TimeoutLayer, within};

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

use crate::backend::{
    Capabilities, Claim, ClaimOutcome, ListFilter, Listing, OffsetPosition, Settle, Settlement,
    StoredOffset, TxFuture, watch::Watch,
};
use crate::{Backend, FailureKind, Key, Lease, Outcome, Record, Result, Timestamp, Transactional};

/// A backend with each call bounded by a [`TimeoutLayer`].
pub type Timeout<B> = Layered<B, TimeoutLayer>;
/// A backend traced and measured by an [`ObserveLayer`].
pub type Observe<B> = Layered<B, ObserveLayer>;
/// A backend with the faults of a [`ChaosLayer`] injected.
pub type Chaos<B> = Layered<B, ChaosLayer>;

/// Makes a backend out of another, as `tower::Layer` does for services.
pub trait Layer<B> {
    /// The wrapped backend.
    type Backend: Backend;
    /// Wraps `inner`.
    fn layer(&self, inner: B) -> Self::Backend;
}

/// `backend.layer(l)`: reads outward, innermost first.
pub trait BackendExt: Backend + Sized {
    /// Wraps `self` in `layer`.
    fn layer<L: Layer<Self>>(self, layer: L) -> L::Backend {
        layer.layer(self)
    }
}

impl<B: Backend> BackendExt for B {}

/// Which [`Backend`] method a call is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Op {
    /// [`Backend::claim`]
    Claim,
    /// [`Backend::claim_many`]
    ClaimMany,
    /// [`Backend::complete`]
    Complete,
    /// [`Backend::fail`]
    Fail,
    /// [`Backend::release`]
    Release,
    /// [`Backend::settle_many`]
    SettleMany,
    /// [`Backend::extend`]
    Extend,
    /// [`Backend::get`]
    Get,
    /// [`Backend::delete`]
    Delete,
    /// [`Backend::purge_expired`]
    PurgeExpired,
    /// [`Backend::list`]
    List,
    /// [`Transactional::execute_in_transaction`]
    Transaction,
    /// [`Transactional::execute_batch_in_transaction`]
    BatchTransaction,
    /// [`Transactional::store_offset`]
    StoreOffset,
    /// [`Transactional::stored_offsets`]
    StoredOffsets,
}

impl Op {
    /// The method's name: `claim`, `settle_many`, …
    pub fn name(self) -> &'static str {
        match self {
            Op::Claim => "claim",
            Op::ClaimMany => "claim_many",
            Op::Complete => "complete",
            Op::Fail => "fail",
            Op::Release => "release",
            Op::SettleMany => "settle_many",
            Op::Extend => "extend",
            Op::Get => "get",
            Op::Delete => "delete",
            Op::PurgeExpired => "purge_expired",
            Op::List => "list",
            Op::Transaction => "execute_in_transaction",
            Op::BatchTransaction => "execute_batch_in_transaction",
            Op::StoreOffset => "store_offset",
            Op::StoredOffsets => "stored_offsets",
        }
    }

    /// Whether the call runs the caller's handlers inside it (a transaction), so that its
    /// length is theirs as much as the store's.
    pub fn runs_handlers(self) -> bool {
        matches!(self, Op::Transaction | Op::BatchTransaction)
    }
}

/// One call as a hook sees it: the method, how many items it carries, and for
/// `settle_many` the settlements (so a hook can tell completes from failures).
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Call<'a> {
    /// The method.
    pub op: Op,
    /// Items in the call: 1, or a batch's length (0 for `purge_expired` and `list`).
    pub items: usize,
    /// `settle_many`'s items; empty for every other call.
    pub settlements: &'a [Settlement],
}

impl Call<'_> {
    fn of(op: Op, items: usize) -> Call<'static> {
        Call {
            op,
            items,
            settlements: &[],
        }
    }

    /// Whether the call writes a complete: `complete`, or a `settle_many` with one in it.
    pub fn completes(&self) -> bool {
        self.op == Op::Complete
            || self
                .settlements
                .iter()
                .any(|s| matches!(s.settle, Settle::Complete(_)))
    }

    /// Whether the call writes a failure or a release: `fail`, `release`, or a
    /// `settle_many` with either in it.
    pub fn fails_or_releases(&self) -> bool {
        matches!(self.op, Op::Fail | Op::Release)
            || self
                .settlements
                .iter()
                .any(|s| !matches!(s.settle, Settle::Complete(_)))
    }
}

/// What a [`Layered`] backend does around each call: runs `next` (the inner backend's
/// call) once, or not at all, and may change its answer.
pub trait Around: Send + Sync {
    /// Wraps one call.
    fn around<'a, T: Send + 'a>(
        &'a self,
        call: Call<'a>,
        next: BoxFuture<'a, Result<T>>,
    ) -> BoxFuture<'a, Result<T>>;

    /// A watch to hand out instead of the inner backend's, if the hook wants one.
    fn watch(&self, key: &Key) -> Option<Watch> {
        let _ = key;
        None
    }
}

/// A backend that sends every call through a hook `H` to the backend `B` inside. The one
/// forwarding implementation the layers share.
#[derive(Clone, Debug)]
pub struct Layered<B, H> {
    inner: B,
    hook: H,
}

impl<B, H> Layered<B, H> {
    /// `inner` behind `hook`.
    pub fn new(inner: B, hook: H) -> Self {
        Layered { inner, hook }
    }

    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }

    /// The hook.
    pub fn hook(&self) -> &H {
        &self.hook
    }
}

#[async_trait]
impl<B: Backend, H: Around> Backend for Layered<B, H> {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome> {
        let next = self.inner.claim(claim);
        self.hook.around(Call::of(Op::Claim, 1), next).await
    }
    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        let next = self.inner.claim_many(claims);
        let call = Call::of(Op::ClaimMany, claims.len());
        self.hook.around(call, next).await
    }
    async fn complete(&self, lease: &Lease, response: Bytes, retention: Duration) -> Result<()> {
        let next = self.inner.complete(lease, response, retention);
        self.hook.around(Call::of(Op::Complete, 1), next).await
    }
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        let next = self.inner.fail(lease, error, kind, retention);
        self.hook.around(Call::of(Op::Fail, 1), next).await
    }
    async fn release(&self, lease: &Lease) -> Result<()> {
        let next = self.inner.release(lease);
        self.hook.around(Call::of(Op::Release, 1), next).await
    }
    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        let call = Call {
            op: Op::SettleMany,
            items: items.len(),
            settlements: items,
        };
        let next = self.inner.settle_many(items, retention);
        self.hook.around(call, next).await
    }
    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        let next = self.inner.extend(lease, ttl);
        self.hook.around(Call::of(Op::Extend, 1), next).await
    }
    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        let next = self.inner.get(key);
        self.hook.around(Call::of(Op::Get, 1), next).await
    }
    async fn delete(&self, key: &Key) -> Result<bool> {
        let next = self.inner.delete(key);
        self.hook.around(Call::of(Op::Delete, 1), next).await
    }
    async fn purge_expired(&self) -> Result<u64> {
        let next = self.inner.purge_expired();
        self.hook.around(Call::of(Op::PurgeExpired, 0), next).await
    }
    async fn list(&self, filter: &ListFilter) -> Result<Listing> {
        let next = self.inner.list(filter);
        self.hook.around(Call::of(Op::List, 0), next).await
    }
    async fn watch(&self, key: &Key) -> Watch {
        match self.hook.watch(key) {
            Some(watch) => watch,
            None => self.inner.watch(key).await,
        }
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

/// Transactional mode through a layer: each transaction is one call to the hook, its
/// handlers' run included, so [`ObserveLayer`] counts and times transactions and [`ChaosLayer`] can
/// refuse them. [`TimeoutLayer`] lets transactions through unbounded: the store bounds
/// each of its statements, and the lease bounds the handlers.
#[async_trait]
impl<B: Transactional, H: Around> Transactional for Layered<B, H> {
    type Tx = B::Tx;

    async fn execute_in_transaction<F>(
        &self,
        claim: &Claim,
        retention: Duration,
        offset: Option<&OffsetPosition>,
        handler: F,
    ) -> Result<Outcome>
    where
        F: for<'t> FnOnce(&'t mut Self::Tx, Lease) -> TxFuture<'t> + Send,
    {
        let next = self
            .inner
            .execute_in_transaction(claim, retention, offset, handler);
        self.hook.around(Call::of(Op::Transaction, 1), next).await
    }

    async fn execute_batch_in_transaction<F, O>(
        &self,
        claims: &[Claim],
        retention: Duration,
        handler: F,
        offset: O,
    ) -> Result<Vec<Outcome>>
    where
        F: for<'t> FnMut(&'t mut Self::Tx, usize, Lease) -> TxFuture<'t> + Send,
        O: FnOnce(&[Outcome]) -> Option<OffsetPosition> + Send,
    {
        let next = self
            .inner
            .execute_batch_in_transaction(claims, retention, handler, offset);
        let call = Call::of(Op::BatchTransaction, claims.len());
        self.hook.around(call, next).await
    }

    async fn store_offset(&self, at: &OffsetPosition) -> Result<()> {
        let next = self.inner.store_offset(at);
        self.hook.around(Call::of(Op::StoreOffset, 1), next).await
    }

    async fn stored_offsets(&self, group: &str) -> Result<Vec<StoredOffset>> {
        let next = self.inner.stored_offsets(group);
        self.hook.around(Call::of(Op::StoredOffsets, 0), next).await
    }
}
