//! A layer that logs every call a caller makes to a real backend, with its batch size, so
//! a test can count round trips (how many store calls a poll batch costs).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::BoxFuture;
use idem_core::Result;
use idem_core::layer::{Around, Call, Layer, Layered, Op};
use tokio::sync::watch;

/// A backend behind a [`CallLog`]: `inner.layer(CallLog::new())`.
pub type Counting<B> = Layered<B, CallLog>;

/// Logs each call as `(operation, items)`: `("claim_many", 12)`, `("complete", 1)`, ...
/// Every call reaches the wrapped backend. `watch` is not a round trip of its own and is
/// only counted ([`CallLog::watches`]). Clones share the log.
#[derive(Debug, Clone)]
pub struct CallLog {
    log: Arc<Mutex<Vec<(&'static str, usize)>>>,
    /// How many `claim` calls have answered.
    answered: Arc<watch::Sender<usize>>,
    /// How many watches were taken.
    watches: Arc<AtomicUsize>,
}

impl Default for CallLog {
    fn default() -> Self {
        CallLog {
            log: Arc::default(),
            answered: Arc::new(watch::channel(0).0),
            watches: Arc::default(),
        }
    }
}

impl CallLog {
    /// An empty log.
    pub fn new() -> Self {
        CallLog::default()
    }

    /// The calls so far, in order.
    pub fn calls(&self) -> Vec<(&'static str, usize)> {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// How many times [`Backend::watch`](idem_core::Backend::watch) was called.
    pub fn watches(&self) -> usize {
        self.watches.load(Ordering::Relaxed)
    }

    /// Returns once `n` `claim` calls have answered (whatever they answered).
    pub async fn claims_answered(&self, n: usize) {
        let mut rx = self.answered.subscribe();
        // The sender lives in `self`: the wait ends only by reaching `n`.
        let _ = rx.wait_for(|done| *done >= n).await;
    }
}

impl<B: idem_core::Backend> Layer<B> for CallLog {
    type Backend = Counting<B>;
    fn layer(&self, inner: B) -> Counting<B> {
        Layered::new(inner, self.clone())
    }
}

impl Around for CallLog {
    fn around<'a, T: Send + 'a>(
        &'a self,
        call: Call<'a>,
        next: BoxFuture<'a, Result<T>>,
    ) -> BoxFuture<'a, Result<T>> {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((call.op.name(), call.items));
        async move {
            let answer = next.await;
            if call.op == Op::Claim {
                self.answered.send_modify(|n| *n += 1);
            }
            answer
        }
        .boxed()
    }

    fn watch(&self, _key: &idem_core::Key) -> Option<idem_core::backend::watch::Watch> {
        self.watches.fetch_add(1, Ordering::Relaxed);
        None
    }
}
