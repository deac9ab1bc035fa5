//! Coalescing concurrent calls: single claims (and completes) that arrive while earlier
//! ones are in flight go to PostgreSQL together, as one statement and one commit.
//!
//! A call waits for nothing but a free slot: while fewer than `in_flight` statements run,
//! each call goes out at once, alone. Only when every slot is busy do calls queue, and the
//! next free slot takes all of them (up to `max_batch`) in one statement. This is group
//! commit on the client side: under load, one WAL flush serves many keys.

use std::future::Future;
use std::sync::Arc;

use futures::future::BoxFuture;
use idem_core::{Error, Result};
use tokio::sync::{Semaphore, mpsc, oneshot};

type Waiting<Req, Resp> = (Req, oneshot::Sender<Result<Resp>>);

/// Sends requests to a driver task that runs them in batches.
pub(crate) struct Coalescer<Req, Resp> {
    tx: mpsc::UnboundedSender<Waiting<Req, Resp>>,
}

impl<Req: Send + 'static, Resp: Send + 'static> Coalescer<Req, Resp> {
    /// Spawns the driver on the current Tokio runtime. `run` answers a batch, one result
    /// per request in order, or fails the whole batch. The driver ends when the last
    /// `Coalescer` handle is dropped.
    pub fn spawn<F>(in_flight: usize, max_batch: usize, run: F) -> Self
    where
        F: Fn(Vec<Req>) -> BoxFuture<'static, Result<Vec<Result<Resp>>>> + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(drive(rx, run, in_flight.max(1), max_batch.max(1)));
        Coalescer { tx }
    }

    /// Runs `req` in the next batch. Dropping the returned future does not withdraw a
    /// request already sent: its statement still runs, as if the caller died right after.
    pub fn call(&self, req: Req) -> impl Future<Output = Result<Resp>> + Send + use<Req, Resp> {
        let (answer_tx, answer_rx) = oneshot::channel();
        let sent = self.tx.send((req, answer_tx)).is_ok();
        async move {
            if !sent {
                return Err(stopped());
            }
            answer_rx.await.unwrap_or_else(|_| Err(stopped()))
        }
    }
}

fn stopped() -> Error {
    Error::Unavailable {
        message: "the PostgreSQL batching task stopped (is the Tokio runtime shutting down?)"
            .into(),
        source: None,
    }
}

async fn drive<Req, Resp, F>(
    mut rx: mpsc::UnboundedReceiver<Waiting<Req, Resp>>,
    run: F,
    in_flight: usize,
    max_batch: usize,
) where
    Req: Send + 'static,
    Resp: Send + 'static,
    F: Fn(Vec<Req>) -> BoxFuture<'static, Result<Vec<Result<Resp>>>>,
{
    let slots = Arc::new(Semaphore::new(in_flight));
    while let Some(first) = rx.recv().await {
        // Wait for a slot before gathering, so that whatever arrives meanwhile joins.
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let mut batch = vec![first];
        while batch.len() < max_batch {
            match rx.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let (reqs, waiting): (Vec<Req>, Vec<oneshot::Sender<Result<Resp>>>) =
            batch.into_iter().unzip();
        let answers = run(reqs);
        tokio::spawn(async move {
            match answers.await {
                Ok(answers) if answers.len() == waiting.len() => {
                    for (w, a) in waiting.into_iter().zip(answers) {
                        let _ = w.send(a);
                    }
                }
                Ok(answers) => {
                    let e = Error::corrupt(format!(
                        "a batch of {} answered {}",
                        waiting.len(),
                        answers.len()
                    ));
                    answer_all(waiting, e);
                }
                Err(e) => answer_all(waiting, e),
            }
            drop(slot);
        });
    }
}

/// Gives the batch's error to the first waiting caller and a copy of the same kind and
/// message (without its source) to each of the others.
fn answer_all<Resp>(waiting: Vec<oneshot::Sender<Result<Resp>>>, e: Error) {
    let mut waiting = waiting.into_iter();
    let Some(first) = waiting.next() else {
        return;
    };
    for w in waiting {
        let _ = w.send(Err(copy(&e)));
    }
    let _ = first.send(Err(e));
}

fn copy(e: &Error) -> Error {
    match e {
        Error::Unavailable { message, .. } => Error::Unavailable {
            message: message.clone(),
            source: None,
        },
        Error::Config { message, .. } => Error::Config {
            message: message.clone(),
            source: None,
        },
        Error::Fenced { key, token } => Error::Fenced {
            key: key.clone(),
            token: *token,
        },
        Error::InvalidKey { reason } => Error::invalid_key(reason.clone()),
        Error::TooLarge { what, size, limit } => Error::TooLarge {
            what,
            size: *size,
            limit: *limit,
        },
        Error::Unsupported { operation } => Error::Unsupported { operation },
        other => Error::corrupt(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::FutureExt;
    use std::sync::Mutex;
    use tokio::sync::Notify;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn calls_queued_behind_a_busy_slot_go_out_together_and_in_order() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let (started, gate) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        let (s, st, g) = (Arc::clone(&sizes), Arc::clone(&started), Arc::clone(&gate));
        let c = Coalescer::spawn(1, 64, move |reqs: Vec<u32>| {
            let (s, st, g) = (Arc::clone(&s), Arc::clone(&st), Arc::clone(&g));
            async move {
                s.lock().expect("lock").push(reqs.len());
                if reqs == [0] {
                    st.notify_one();
                    g.notified().await;
                }
                Ok(reqs.into_iter().map(|r| Ok(r * 10)).collect())
            }
            .boxed()
        });
        let first = tokio::spawn(c.call(0));
        // The first batch holds the only slot until released; these queue behind it.
        started.notified().await;
        let rest: Vec<_> = (1..=5).map(|i| tokio::spawn(c.call(i))).collect();
        gate.notify_one();
        assert_eq!(first.await.expect("join").expect("answer"), 0);
        for (i, r) in rest.into_iter().enumerate() {
            let want = u32::try_from(i + 1).expect("small") * 10;
            assert_eq!(r.await.expect("join").expect("answer"), want);
        }
        assert_eq!(*sizes.lock().expect("lock"), vec![1, 5]);
    }

    #[tokio::test]
    async fn a_failed_batch_fails_each_caller_with_its_kind() {
        let c: Coalescer<u32, u32> = Coalescer::spawn(1, 64, |_reqs: Vec<u32>| {
            async { Err(Error::unavailable("down", "refused")) }.boxed()
        });
        let calls: Vec<_> = (0..3).map(|i| c.call(i)).collect();
        for call in calls {
            let e = call.await.expect_err("batch failed");
            assert!(e.is_retryable(), "{e}");
        }
    }
}
