//! Where a running handler future lives, so that it can move to a task of its own when its
//! partition is given up while it runs (dropping it could cut a side effect in half).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard};
use std::task::{Context, Poll};

use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::HandlerError;
use tracing::Instrument;

use crate::handler::HandlerResult;

/// A handler future, running or gone. It lives on the stack of the call that runs the
/// handler, which polls it through [`Slot::poll_with`]: no allocation besides the future's.
#[derive(Default)]
pub(crate) struct Slot {
    running: Mutex<Option<BoxFuture<'static, HandlerResult>>>,
}

impl Slot {
    /// A slot running `fut`.
    pub fn new(fut: BoxFuture<'static, HandlerResult>) -> Self {
        Slot {
            running: Mutex::new(Some(fut)),
        }
    }

    /// Puts `fut` in the slot, to run.
    pub fn fill(&self, fut: BoxFuture<'static, HandlerResult>) {
        *self.lock() = Some(fut);
    }

    fn lock(&self) -> MutexGuard<'_, Option<BoxFuture<'static, HandlerResult>>> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Moves a handler that is still running to a task of its own: it runs to its end, but
    /// nothing stores its result and no heartbeat extends its lease. `keep` (its key's
    /// running mark) is dropped when it ends. Called on the worker's runtime.
    pub fn detach(&self, span: tracing::Span, keep: impl Send + 'static) {
        if let Some(fut) = self.lock().take() {
            tokio::spawn(
                async move {
                    let _ = fut.await;
                    drop(keep);
                    tracing::warn!(
                        "handler finished after its partition was given up; its result is dropped"
                    );
                }
                .instrument(span),
            );
        }
    }

    /// Polls the handler in the slot; `after` runs once when it returns and says whether
    /// to hang there forever (a crash probe).
    pub fn poll_with<F: FnMut() -> bool + Unpin>(&self, after: F) -> SlotFuture<'_, F> {
        SlotFuture {
            slot: self,
            after,
            hung: false,
        }
    }
}

/// The future of [`Slot::poll_with`].
pub(crate) struct SlotFuture<'a, F> {
    slot: &'a Slot,
    after: F,
    hung: bool,
}

impl<F: FnMut() -> bool + Unpin> Future for SlotFuture<'_, F> {
    type Output = HandlerResult;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<HandlerResult> {
        if self.hung {
            return Poll::Pending;
        }
        let mut running = self.slot.lock();
        let result = match running.as_mut() {
            Some(fut) => match fut.poll_unpin(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => r,
            },
            None => return Poll::Ready(Err(HandlerError::retry("handler was detached"))),
        };
        *running = None;
        drop(running);
        if (self.after)() {
            self.hung = true;
            return Poll::Pending;
        }
        Poll::Ready(result)
    }
}
