//! A one-way signal that is cheap to check: a flag read on every message, and a wait for
//! the rare task that sleeps on it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

/// Fired once, never reset; clones share it. [`Signal::is_fired`] is one atomic load, and
/// a clone or a drop one atomic count, where a `CancellationToken` takes a lock for each:
/// a consumer checks its signals for every message, and the engine makes one per lease.
#[derive(Clone, Debug, Default)]
pub struct Signal(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    fired: AtomicBool,
    notify: Notify,
}

impl Signal {
    /// A signal not fired yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Fires the signal and wakes every task waiting on it; later waits return at once.
    pub fn fire(&self) {
        self.0.fired.store(true, Ordering::SeqCst);
        self.0.notify.notify_waiters();
    }

    /// Whether it was fired.
    pub fn is_fired(&self) -> bool {
        self.0.fired.load(Ordering::SeqCst)
    }

    /// Resolves once it is fired.
    pub async fn fired(&self) {
        loop {
            let notified = self.0.notify.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the flag is read: a `fire` after the read wakes this one.
            notified.as_mut().enable();
            if self.is_fired() {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_waiter_wakes_when_fired_and_later_waits_return_at_once() {
        let signal = Signal::new();
        assert!(!signal.is_fired());
        let waiter = tokio::spawn({
            let signal = signal.clone();
            async move { signal.fired().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        signal.fire();
        waiter.await.expect("waiter");
        assert!(signal.is_fired());
        signal.fired().await;
    }
}
