//! Waiting for a key's record to change ([`Backend::watch`](crate::Backend::watch)): a
//! [`Watch`] wakes when the record may have changed, or when its timeout passes, so a lost
//! notification costs one poll interval and never a hang.
//!
//! [`Watchers`] fans notifications out in process, by topic (a string the backend picks
//! per key); [`Feed`] keeps one subscriber connection to a store (PostgreSQL `LISTEN`,
//! Redis `SUBSCRIBE`) feeding a [`Watchers`], and reconnects when it drops.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use futures::stream::BoxStream;
use tokio::sync::{oneshot, watch};

use crate::{Key, Result};

/// The topic of `key` for backends that have no naming of their own:
/// `<namespace length>:<namespace>:<id>`, unambiguous whatever either part contains.
pub fn topic(key: &Key) -> String {
    let ns = key.namespace();
    format!("{}:{ns}:{}", ns.len(), key.id())
}

/// In-process fan-out: waiters subscribe to a topic, a writer (or a feed) notifies it.
#[derive(Debug, Default)]
pub struct Watchers {
    topics: Mutex<HashMap<String, watch::Sender<u64>>>,
    /// Live subscriptions: a notify with none skips the lock.
    subscribed: AtomicUsize,
}

impl Watchers {
    /// An empty hub.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// A watch on `topic`: it wakes at every [`Watchers::notify`] of `topic` (and every
    /// [`Watchers::notify_all`]) made after this call.
    pub fn subscribe(self: &Arc<Self>, topic: String) -> Watch {
        let mut topics = self.lock();
        let rx = topics
            .entry(topic.clone())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe();
        self.subscribed.fetch_add(1, Ordering::SeqCst);
        Watch {
            sub: Some(Subscription {
                hub: Arc::clone(self),
                topic,
                rx,
            }),
        }
    }

    /// Whether no watch is open: a writer can skip naming the topic it would notify.
    pub fn is_idle(&self) -> bool {
        self.subscribed.load(Ordering::SeqCst) == 0
    }

    /// Wakes the watches of `topic`.
    pub fn notify(&self, topic: &str) {
        if self.is_idle() {
            return;
        }
        if let Some(tx) = self.lock().get(topic) {
            tx.send_modify(|v| *v = v.wrapping_add(1));
        }
    }

    /// Wakes every watch: after a feed lost its connection, any notification may be lost.
    pub fn notify_all(&self) {
        for tx in self.lock().values() {
            tx.send_modify(|v| *v = v.wrapping_add(1));
        }
    }

    /// How many topics have a watch on them.
    pub fn topics(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, watch::Sender<u64>>> {
        // Every write under the lock is one insert or remove: the map stays whole.
        self.topics.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Debug)]
struct Subscription {
    hub: Arc<Watchers>,
    topic: String,
    rx: watch::Receiver<u64>,
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut topics = self.hub.lock();
        // This subscription's receiver is still alive here: it is the last one at 1.
        if topics
            .get(&self.topic)
            .is_some_and(|tx| tx.receiver_count() <= 1)
        {
            topics.remove(&self.topic);
        }
        self.hub.subscribed.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A wait for one key's record to change, taken before the read it follows, so that a
/// change between that read and the wait still wakes it.
#[derive(Debug, Default)]
pub struct Watch {
    sub: Option<Subscription>,
}

impl Watch {
    /// A watch that nothing wakes: [`Watch::changed`] sleeps its timeout (polling).
    pub fn poll_only() -> Self {
        Watch::default()
    }

    /// Whether something can wake this watch before its timeout.
    pub fn is_notified(&self) -> bool {
        self.sub.is_some()
    }

    /// Returns when the record may have changed since the last call (or since the watch
    /// began), or after `timeout`; says which (`true`: woken). Either way the caller reads
    /// the record again: a wake is a hint, never a value.
    pub async fn changed(&mut self, timeout: Duration) -> bool {
        let deadline = crate::clock::deadline(timeout);
        if let Some(sub) = &mut self.sub {
            match tokio::time::timeout_at(deadline, sub.rx.changed()).await {
                Ok(Ok(())) => return true,
                Err(_) => return false,
                // The sender went away (it cannot while subscribed): poll from now on.
                Ok(Err(_)) => self.sub = None,
            }
        }
        tokio::time::sleep_until(deadline).await;
        false
    }
}

/// Connects a feed: a stream of the topics the store announces, ending when the
/// connection drops.
pub type Connect =
    Box<dyn FnMut() -> BoxFuture<'static, Result<BoxStream<'static, String>>> + Send>;

/// One subscriber connection feeding a [`Watchers`], run in a task: it connects, forwards
/// every announced topic, and when the connection drops wakes every watch (whatever was
/// announced meanwhile is lost) and connects again, backing off up to 5 s. The task ends
/// when the `Feed` is dropped.
#[derive(Debug)]
pub struct Feed {
    watchers: Arc<Watchers>,
    /// Whether the first connect has ended, either way.
    tried: watch::Receiver<bool>,
    _stop: oneshot::Sender<()>,
}

impl Feed {
    /// Starts the feed's task; `what` names it in logs. Needs a running tokio runtime.
    pub fn spawn(what: &'static str, mut connect: Connect) -> Self {
        let watchers = Watchers::new();
        let (tried_tx, tried) = watch::channel(false);
        let (stop, mut stopped) = oneshot::channel::<()>();
        let hub = Arc::clone(&watchers);
        tokio::spawn(async move {
            let mut backoff = Duration::from_millis(50);
            loop {
                let run = async {
                    match connect().await {
                        Ok(mut topics) => {
                            // After a reconnect, whatever was announced meanwhile is lost:
                            // every watch reads again. The first connect missed nothing a
                            // watch waiting for it relies on.
                            if *tried_tx.borrow() {
                                hub.notify_all();
                            }
                            tried_tx.send_replace(true);
                            backoff = Duration::from_millis(50);
                            while let Some(topic) = topics.next().await {
                                hub.notify(&topic);
                            }
                            tracing::warn!(feed = what, "notification feed lost; reconnecting");
                        }
                        Err(e) => {
                            tried_tx.send_replace(true);
                            tracing::warn!(feed = what, error = %e, "notification feed down");
                        }
                    }
                    hub.notify_all();
                };
                tokio::select! {
                    _ = &mut stopped => return,
                    () = run => {}
                }
                tokio::select! {
                    _ = &mut stopped => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        });
        Feed {
            watchers,
            tried,
            _stop: stop,
        }
    }

    /// A watch on `topic`. While the feed's first connect is under way, waits up to
    /// `within` for it to end, then returns the watch anyway; later calls never wait. A
    /// watch's timeout covers whatever the feed misses while it is down.
    pub async fn watch(&self, topic: String, within: Duration) -> Watch {
        let watch = self.watchers.subscribe(topic);
        if !*self.tried.borrow() {
            let mut tried = self.tried.clone();
            let _ = tokio::time::timeout(within, tried.wait_for(|done| *done)).await;
        }
        watch
    }

    /// The hub it feeds.
    pub fn watchers(&self) -> &Arc<Watchers> {
        &self.watchers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_notify_after_subscribe_wakes_and_others_do_not() {
        let hub = Watchers::new();
        let mut a = hub.subscribe("a".into());
        let mut b = hub.subscribe("b".into());
        hub.notify("a");
        assert!(a.changed(Duration::from_secs(5)).await);
        assert!(!b.changed(Duration::from_millis(1)).await);
        assert!(
            !a.changed(Duration::from_millis(1)).await,
            "woken once per notify"
        );
        hub.notify_all();
        assert!(b.changed(Duration::from_secs(5)).await);
    }

    #[tokio::test]
    async fn dropped_watches_leave_no_topic() {
        let hub = Watchers::new();
        let a = hub.subscribe("k".into());
        let b = hub.subscribe("k".into());
        drop(a);
        assert_eq!(hub.topics(), 1);
        drop(b);
        assert_eq!(hub.topics(), 0);
        hub.notify("k");
    }

    #[tokio::test]
    async fn a_feed_forwards_topics_and_wakes_all_when_its_stream_ends() {
        let (tx, rx) = futures::channel::mpsc::unbounded::<String>();
        let mut rx = Some(rx);
        let feed = Feed::spawn(
            "test",
            Box::new(move || {
                let stream = rx.take();
                Box::pin(async move {
                    match stream {
                        Some(s) => Ok(s.boxed()),
                        None => Ok(futures::stream::pending().boxed()),
                    }
                })
            }),
        );
        let long = Duration::from_secs(30);
        let mut a = feed.watch("a".into(), long).await;
        let mut b = feed.watch("b".into(), long).await;
        assert!(
            !a.changed(Duration::from_millis(1)).await,
            "no wake at the first connect"
        );
        tx.unbounded_send("a".into()).expect("send");
        assert!(a.changed(long).await);
        assert!(!b.changed(Duration::from_millis(1)).await);
        drop(tx);
        assert!(b.changed(long).await, "a lost feed wakes every watch");
    }

    #[tokio::test(start_paused = true)]
    async fn poll_only_sleeps_its_timeout() {
        let start = tokio::time::Instant::now();
        assert!(!Watch::poll_only().changed(Duration::from_millis(30)).await);
        assert_eq!(start.elapsed(), Duration::from_millis(30));
    }
}
