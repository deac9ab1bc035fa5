//! Transactional mode over any [`Transactional`] store: the store and the user's handler
//! bound together behind one object-safe trait, so the consumer needs no store type.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::backend::Claim;
use idem_core::binding::HandlerResult;
use idem_core::{Backend, Lease, Outcome, Transactional};

use crate::Message;

/// Asked once the handler returned, before the commit; `true` means hang there (a crash
/// probe), so the transaction never commits.
pub(crate) type Hook = Arc<dyn Fn(&Message) -> bool + Send + Sync>;

/// A transactional store with its handler bound in.
#[async_trait]
pub(crate) trait TxStore: Send + Sync {
    /// The store as a plain backend, for the default engine.
    fn backend(&self) -> Arc<dyn Backend>;

    /// One message: the claim, then the handler's writes and the record in one
    /// transaction.
    async fn run(
        &self,
        claim: &Claim,
        retention: Duration,
        msg: Message,
        after_effect: Hook,
    ) -> idem_core::Result<Outcome>;
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
        msg: Message,
        after_effect: Hook,
    ) -> idem_core::Result<Outcome> {
        let handler = Arc::clone(&self.handler);
        self.store
            .execute_in_transaction(claim, retention, None, move |tx, lease| {
                async move {
                    let result = handler(msg.clone(), tx, lease).await;
                    if after_effect(&msg) {
                        std::future::pending::<()>().await;
                    }
                    result
                }
                .boxed()
            })
            .await
    }
}
