//! Coalescing: single claims and settles that many tasks make at once, joined into the
//! backend's batch calls, so that they share round trips and, on PostgreSQL, commits.

use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::oneshot;

use super::Layer;
use crate::backend::{
    Capabilities, Claim, ClaimOutcome, ListFilter, Listing, Settlement, watch::Watch,
};
use crate::{Backend, Error, FailureKind, Key, Lease, Record, Result, Timestamp};

/// [`Coalesce`] as a [`Layer`].
#[derive(Clone, Copy, Debug, Default)]
pub struct CoalesceLayer;

impl<B: Backend + 'static> Layer<B> for CoalesceLayer {
    type Backend = Coalesce<B>;

    fn layer(&self, inner: B) -> Coalesce<B> {
        Coalesce::new(inner)
    }
}

/// A backend whose single calls are joined: a `claim` made while another is in flight
/// waits for it, then goes out with every claim that queued meanwhile as one
/// `claim_many`; `complete`, `fail` and `release` the same way as one `settle_many`. A call
/// made when none of its kind is in flight goes out at once: there is no timer, so an idle
/// caller waits for nothing, and a busy one shares each round trip (and, on PostgreSQL,
/// each commit) with the others. Each answer is what the call alone would have answered,
/// as the batch calls promise; a store error fails every call of its batch.
///
/// The batch runs on a Tokio task of its own, so a caller that stops waiting (a timeout)
/// leaves the others' answers intact; outside a Tokio runtime each call goes out alone.
/// It is not [`Transactional`](crate::Transactional): a transaction joins its claims in
/// one statement already, so a transactional store is passed as it is.
pub struct Coalesce<B> {
    inner: Arc<B>,
    claims: Arc<Lane<Claim, ClaimOutcome>>,
    /// Each settle with its retention (`None` for a release, which keeps the record's).
    settles: Arc<Lane<(Settlement, Option<Duration>), ()>>,
}

impl<B: Backend + 'static> Coalesce<B> {
    /// Joins the single calls of `inner`.
    pub fn new(inner: B) -> Self {
        Coalesce {
            inner: Arc::new(inner),
            claims: Arc::default(),
            settles: Arc::default(),
        }
    }

    async fn settle(&self, item: Settlement, retention: Option<Duration>) -> Result<()> {
        let inner = Arc::clone(&self.inner);
        self.settles
            .call((item, retention), move |items| {
                let inner = Arc::clone(&inner);
                async move { settle_runs(&*inner, items).await }
            })
            .await
    }
}

/// `items` settled in runs of one retention each (a batch call takes one; a release fits
/// any run), in order.
async fn settle_runs<B: Backend + ?Sized>(
    inner: &B,
    items: Vec<(Settlement, Option<Duration>)>,
) -> Result<Vec<Result<()>>> {
    let mut out = Vec::with_capacity(items.len());
    let mut rest = items.as_slice();
    while !rest.is_empty() {
        let mut retention = None;
        let run = rest
            .iter()
            .take_while(|(_, r)| match (r, retention) {
                (None, _) => true,
                (Some(r), None) => {
                    retention = Some(*r);
                    true
                }
                (Some(r), Some(run)) => *r == run,
            })
            .count();
        let batch: Vec<Settlement> = rest[..run].iter().map(|(s, _)| s.clone()).collect();
        let retention = retention.unwrap_or(Duration::ZERO);
        match checked(inner.settle_many(&batch, retention).await, run) {
            Ok(answers) => out.extend(answers),
            // The runs before answered already; this run and the rest fail with the error.
            Err(e) => out.extend(rest.iter().map(|_| Err(again(&e)))),
        }
        rest = &rest[run..];
        if out.len() == items.len() {
            break;
        }
    }
    Ok(out)
}

#[async_trait]
impl<B: Backend + 'static> Backend for Coalesce<B> {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome> {
        let inner = Arc::clone(&self.inner);
        self.claims
            .call(claim.clone(), move |claims| {
                let inner = Arc::clone(&inner);
                async move {
                    let answers = inner.claim_many(&claims).await?;
                    Ok(answers.into_iter().map(Ok).collect())
                }
            })
            .await
    }

    async fn claim_many(&self, claims: &[Claim]) -> Result<Vec<ClaimOutcome>> {
        self.inner.claim_many(claims).await
    }

    async fn complete(&self, lease: &Lease, response: Bytes, retention: Duration) -> Result<()> {
        let item = Settlement::complete(lease.clone(), response);
        self.settle(item, Some(retention)).await
    }

    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        kind: FailureKind,
        retention: Duration,
    ) -> Result<()> {
        let item = Settlement::fail(lease.clone(), error, kind);
        self.settle(item, Some(retention)).await
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.settle(Settlement::release(lease.clone()), None).await
    }

    async fn settle_many(
        &self,
        items: &[Settlement],
        retention: Duration,
    ) -> Result<Vec<Result<()>>> {
        self.inner.settle_many(items, retention).await
    }

    async fn extend(&self, lease: &Lease, ttl: Duration) -> Result<Timestamp> {
        self.inner.extend(lease, ttl).await
    }

    async fn get(&self, key: &Key) -> Result<Option<Record>> {
        self.inner.get(key).await
    }

    async fn delete(&self, key: &Key) -> Result<bool> {
        self.inner.delete(key).await
    }

    async fn purge_expired(&self) -> Result<u64> {
        self.inner.purge_expired().await
    }

    async fn list(&self, filter: &ListFilter) -> Result<Listing> {
        self.inner.list(filter).await
    }

    async fn watch(&self, key: &Key) -> Watch {
        self.inner.watch(key).await
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
}

/// The calls of one kind waiting for the batch in flight, and whether one is in flight.
struct Lane<T, R> {
    state: Mutex<Waiting<T, R>>,
}

struct Waiting<T, R> {
    queue: Vec<(T, oneshot::Sender<Result<R>>)>,
    busy: bool,
}

impl<T, R> Default for Lane<T, R> {
    fn default() -> Self {
        Lane {
            state: Mutex::new(Waiting {
                queue: Vec::new(),
                busy: false,
            }),
        }
    }
}

impl<T: Send + 'static, R: Send + 'static> Lane<T, R> {
    fn lock(&self) -> MutexGuard<'_, Waiting<T, R>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `item` and waits for its answer; the first call while none is in flight
    /// starts the task that sends batches (`run`) until the queue is empty. Outside a
    /// Tokio runtime there is no task to start, and the call goes out alone.
    async fn call<F, Fut>(self: &Arc<Self>, item: T, run: F) -> Result<R>
    where
        F: Fn(Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Vec<Result<R>>>> + Send,
    {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            let answer = checked(run(vec![item]).await, 1)?.pop();
            return answer.unwrap_or_else(|| Err(Error::corrupt("a batch call answered nothing")));
        };
        let (tx, rx) = oneshot::channel();
        let lead = {
            let mut w = self.lock();
            w.queue.push((item, tx));
            !std::mem::replace(&mut w.busy, true)
        };
        if lead {
            // Made before the task, so that a task dropped unpolled (a runtime shutting
            // down) still frees the lane.
            let idle = Idle {
                lane: Arc::clone(self),
                done: false,
            };
            runtime.spawn(async move { idle.drain(run).await });
        }
        rx.await.unwrap_or_else(|_| {
            Err(Error::unavailable(
                "the batch call carrying this call ended without an answer",
                "coalesce",
            ))
        })
    }
}

/// The lane a drain task owns. Dropped before the queue was found empty (a panic in the
/// store, a runtime shutting down), it frees the lane and drops what was queued, whose
/// callers then answer `Unavailable`, so that nobody waits for a task that is gone.
struct Idle<T, R> {
    lane: Arc<Lane<T, R>>,
    done: bool,
}

impl<T: Send + 'static, R: Send + 'static> Idle<T, R> {
    async fn drain<F, Fut>(mut self, run: F)
    where
        F: Fn(Vec<T>) -> Fut,
        Fut: Future<Output = Result<Vec<Result<R>>>>,
    {
        loop {
            let batch = {
                let mut w = self.lane.lock();
                if w.queue.is_empty() {
                    w.busy = false;
                    self.done = true;
                    return;
                }
                std::mem::take(&mut w.queue)
            };
            let (items, senders): (Vec<T>, Vec<_>) = batch.into_iter().unzip();
            let n = items.len();
            match checked(run(items).await, n) {
                Ok(answers) => {
                    for (tx, answer) in senders.into_iter().zip(answers) {
                        let _ = tx.send(answer);
                    }
                }
                Err(e) => {
                    for tx in senders {
                        let _ = tx.send(Err(again(&e)));
                    }
                }
            }
        }
    }
}

impl<T, R> Drop for Idle<T, R> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let queued = {
            let mut w = self.lane.state.lock().unwrap_or_else(|e| e.into_inner());
            w.busy = false;
            std::mem::take(&mut w.queue)
        };
        drop(queued);
    }
}

/// A batch call's answers, if there is one per item; a wrong count is `Corrupt`.
fn checked<R>(answers: Result<Vec<Result<R>>>, items: usize) -> Result<Vec<Result<R>>> {
    match answers {
        Ok(a) if a.len() == items => Ok(a),
        Ok(a) => Err(Error::corrupt(format!(
            "a batch call of {items} answered {}",
            a.len()
        ))),
        Err(e) => Err(e),
    }
}

/// The same error for another caller of the batch (an error's source is kept as text).
fn again(e: &Error) -> Error {
    let text = |s: &Option<crate::BoxError>| s.as_ref().map(|s| s.to_string().into());
    match e {
        Error::Fenced { key, token } => Error::Fenced {
            key: key.clone(),
            token: *token,
        },
        Error::Unavailable { message, source } => Error::Unavailable {
            message: message.clone(),
            source: text(source),
        },
        Error::InvalidKey { reason } => Error::invalid_key(reason.clone()),
        Error::Corrupt { message, source } => Error::Corrupt {
            message: message.clone(),
            source: text(source),
        },
        Error::TooLarge { what, size, limit } => Error::TooLarge {
            what,
            size: *size,
            limit: *limit,
        },
        Error::Config { message, source } => Error::Config {
            message: message.clone(),
            source: text(source),
        },
        Error::Unsupported { operation } => Error::Unsupported { operation },
        Error::Refused {
            server,
            why,
            message,
            source,
        } => Error::Refused {
            server: server.clone(),
            why: *why,
            message: message.clone(),
            source: text(source),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `checked` and `again`, which the drain loop and `settle_runs` use to answer each
    /// caller of a batch.
    #[test]
    fn a_batch_answer_of_the_wrong_count_is_corrupt_and_copied_for_each_caller() {
        let short: Result<Vec<Result<u8>>> = Ok(vec![Ok(1), Ok(2)]);
        let e = checked(short, 3).expect_err("two answers for three items");
        assert!(
            matches!(&e, Error::Corrupt { message, .. } if message.contains("of 3 answered 2")),
            "{e:?}"
        );
        // Each caller of the batch gets the error again, not a share of the answers.
        assert!(matches!(again(&e), Error::Corrupt { .. }));
        let whole = checked(Ok(vec![Ok(1), Err(Error::unavailable("x", "y"))]), 2);
        assert_eq!(whole.expect("one answer an item").len(), 2);
        let failed: Result<Vec<Result<u8>>> = Err(Error::unavailable("down", "test"));
        assert!(matches!(checked(failed, 1), Err(Error::Unavailable { .. })));
    }
}
