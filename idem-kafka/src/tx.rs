//! Transactional mode over any [`Transactional`] store: the store and the user's handler,
//! bound together behind one object-safe trait so the loop needs no store type.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::backend::{Claim, OffsetPosition, StoredOffset};
use idem_core::{Backend, Lease, Outcome, Transactional};

use crate::Message;
use crate::handler::HandlerResult;

/// Asked after the claim and after the handler, with the message's offset; `true` means
/// hang there (a crash probe).
pub(crate) type Hook = Arc<dyn Fn(crate::Point, i64) -> bool + Send + Sync>;

/// Picks the offset to store with a batch from its outcomes (see
/// [`Transactional::execute_batch_in_transaction`]).
pub(crate) type PickOffset = Box<dyn FnOnce(&[Outcome]) -> Option<OffsetPosition> + Send>;

/// A transactional store with its handler bound in.
#[async_trait]
pub(crate) trait TxStore: Send + Sync {
    /// The store as a plain backend, for the default engine.
    fn backend(&self) -> Arc<dyn Backend>;

    /// One message: claim, then the handler, the record and (if given) the offset in one
    /// transaction.
    async fn run(
        &self,
        claim: &Claim,
        retention: Duration,
        at: Option<&OffsetPosition>,
        msg: Message,
        hook: Hook,
    ) -> idem_core::Result<Outcome>;

    /// A run of keyed messages (`claims[i]` is `msgs[i]`'s) in one transaction: the claims
    /// commit first, then the handlers (a savepoint each only after a failure), then the records and the
    /// offset `pick` chooses, in one commit.
    async fn run_batch(
        &self,
        claims: &[Claim],
        retention: Duration,
        msgs: Vec<Message>,
        hook: Hook,
        pick: PickOffset,
    ) -> idem_core::Result<Vec<Outcome>>;

    /// Stores the offset past `at` on its own.
    async fn store_offset(&self, at: &OffsetPosition) -> idem_core::Result<()>;

    /// The offsets stored for `group`.
    async fn stored_offsets(&self, group: &str) -> idem_core::Result<Vec<StoredOffset>>;
}

/// A store and the handler the user gave for it.
pub(crate) struct Bound<S, H> {
    pub store: Arc<S>,
    pub handler: Arc<H>,
}

#[async_trait]
impl<S, H> TxStore for Bound<S, H>
where
    S: Transactional + 'static,
    H: for<'t> Fn(Message, &'t mut S::Tx, Lease) -> BoxFuture<'t, HandlerResult>
        + Send
        + Sync
        + 'static,
{
    fn backend(&self) -> Arc<dyn Backend> {
        self.store.clone()
    }

    async fn run(
        &self,
        claim: &Claim,
        retention: Duration,
        at: Option<&OffsetPosition>,
        msg: Message,
        hook: Hook,
    ) -> idem_core::Result<Outcome> {
        let handler = Arc::clone(&self.handler);
        self.store
            .execute_in_transaction(claim, retention, at, move |tx, lease| {
                probed(&*handler, msg, tx, lease, hook)
            })
            .await
    }

    async fn run_batch(
        &self,
        claims: &[Claim],
        retention: Duration,
        msgs: Vec<Message>,
        hook: Hook,
        pick: PickOffset,
    ) -> idem_core::Result<Vec<Outcome>> {
        let handler = &*self.handler;
        let msgs = &msgs;
        self.store
            .execute_batch_in_transaction(
                claims,
                retention,
                |tx, i, lease| probed(handler, msgs[i].clone(), tx, lease, Arc::clone(&hook)),
                pick,
            )
            .await
    }

    async fn store_offset(&self, at: &OffsetPosition) -> idem_core::Result<()> {
        self.store.store_offset(at).await
    }

    async fn stored_offsets(&self, group: &str) -> idem_core::Result<Vec<StoredOffset>> {
        self.store.stored_offsets(group).await
    }
}

/// The user's handler for `msg`, with the crash probe asked before and after it.
fn probed<'t, S, H>(
    handler: &H,
    msg: Message,
    tx: &'t mut S,
    lease: Lease,
    hook: Hook,
) -> BoxFuture<'t, HandlerResult>
where
    H: for<'a> Fn(Message, &'a mut S, Lease) -> BoxFuture<'a, HandlerResult>,
    S: Send,
{
    let offset = msg.offset();
    if hook(crate::Point::AfterClaim, offset) {
        return std::future::pending().boxed();
    }
    let run = idem_core::backend::panic_at_poll(|| handler(msg, tx, lease));
    async move {
        let result = run.await;
        if hook(crate::Point::AfterEffect, offset) {
            std::future::pending::<()>().await;
        }
        result
    }
    .boxed()
}
