//! The pieces of key-ordered concurrency within a partition: lanes of messages that share
//! an ordering key, the low-water mark of a chunk, and a settler that gathers what
//! concurrent handlers return into batch settles.

use std::hash::Hash;
use std::sync::Mutex;

use idem_core::Outcome;
use idem_core::backend::Settlement;
use tokio::sync::{Notify, oneshot};

/// What orders the messages of a partition when handlers run concurrently
/// ([`ConsumerBuilder::in_flight`](crate::ConsumerBuilder::in_flight)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum OrderBy {
    /// Messages with the same idempotency key run in offset order, one at a time (the
    /// default: a key's copies never race each other).
    #[default]
    IdempotencyKey,
    /// Messages with the same Kafka message key run in offset order, one at a time: per
    /// entity order across different operations. A message without a Kafka key is ordered
    /// by nothing.
    MessageKey,
}

/// Groups positions `0..n` into lanes by ordering key, each lane in order. A position
/// without a key gets a lane of its own.
pub(crate) fn lanes<K: Hash + Eq>(keys: impl Iterator<Item = Option<K>>) -> Vec<Vec<usize>> {
    let keys: Vec<Option<K>> = keys.collect();
    // A keyless position is its own key: no other position shares its lane.
    idem_core::backend::group_by(0..keys.len(), |&i| keys[i].as_ref().ok_or(i))
}

/// How many leading positions, up to `cap`, have ordering keys no earlier one shares: the
/// messages that run at once when they open a chunk (a keyless position shares nothing).
pub(crate) fn distinct_prefix<K: Hash + Eq>(
    keys: impl Iterator<Item = Option<K>>,
    cap: usize,
) -> usize {
    let mut seen = std::collections::HashSet::new();
    keys.take(cap)
        .map_while(|k| match k {
            None => Some(()),
            Some(k) => seen.insert(k).then_some(()),
        })
        .count()
}

/// Which messages of a chunk settled, and how long the settled prefix is: the committed
/// offset may move only to one past that prefix, never past an unsettled message.
#[derive(Debug)]
pub(crate) struct Window {
    done: Vec<bool>,
    mark: usize,
    above: usize,
}

impl Window {
    pub fn new(len: usize) -> Self {
        Window {
            done: vec![false; len],
            mark: 0,
            above: 0,
        }
    }

    /// Marks position `i` settled; returns the new length of the settled prefix if it grew.
    pub fn settle(&mut self, i: usize) -> Option<usize> {
        if self.done.get(i).copied() != Some(false) {
            return None;
        }
        self.done[i] = true;
        self.above += 1;
        let before = self.mark;
        while self.done.get(self.mark) == Some(&true) {
            self.mark += 1;
            self.above -= 1;
        }
        (self.mark > before).then_some(self.mark)
    }

    /// Messages settled beyond the prefix, waiting for an earlier one.
    pub fn lag(&self) -> usize {
        self.above
    }
}

/// Gathers the settlements of concurrent handlers: each is queued, and one flush at a time
/// settles everything queued in one store call, so what arrives during a flush rides the
/// next one.
#[derive(Default)]
pub(crate) struct Settler {
    queue: Mutex<Queue>,
    wake: Notify,
}

type Reply = oneshot::Sender<idem_core::Result<Outcome>>;

#[derive(Default)]
struct Queue {
    items: Vec<(Settlement, Reply)>,
    closed: bool,
}

impl Settler {
    /// Queues `item`; the receiver gets its outcome after the flush that carries it (or
    /// an error if the flusher ended first: the partition was given up).
    pub fn submit(&self, item: Settlement) -> oneshot::Receiver<idem_core::Result<Outcome>> {
        let (tx, rx) = oneshot::channel();
        let mut queue = self.lock();
        if !queue.closed {
            queue.items.push((item, tx));
            self.wake.notify_one();
        }
        rx
    }

    /// Everything queued, for one flush.
    pub fn take(&self) -> Vec<(Settlement, Reply)> {
        std::mem::take(&mut self.lock().items)
    }

    /// Takes nothing more: what is queued, and anything submitted later, gets an error.
    pub fn close(&self) {
        let mut queue = self.lock();
        queue.closed = true;
        queue.items.clear();
    }

    /// Resolves once something was queued since the last `take`.
    pub async fn queued(&self) {
        loop {
            let notified = self.wake.notified();
            if !self.lock().items.is_empty() {
                return;
            }
            notified.await;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_distinct_prefix_ends_at_a_repeated_key_or_the_cap() {
        let keys = [Some("a"), None, Some("b"), None, Some("a"), Some("c")];
        assert_eq!(distinct_prefix(keys.into_iter(), 8), 4);
        assert_eq!(distinct_prefix(keys.into_iter(), 3), 3);
        assert_eq!(distinct_prefix([Some("a"), Some("a")].into_iter(), 8), 1);
        assert_eq!(distinct_prefix(std::iter::empty::<Option<&str>>(), 8), 0);
    }

    #[test]
    fn lanes_keep_each_key_in_order_and_give_keyless_positions_their_own() {
        let keys = [
            Some("a"),
            Some("b"),
            None,
            Some("a"),
            None,
            Some("c"),
            Some("b"),
        ];
        let lanes = lanes(keys.into_iter());
        assert_eq!(
            lanes,
            vec![vec![0, 3], vec![1, 6], vec![2], vec![4], vec![5]]
        );
    }

    #[test]
    fn the_mark_moves_only_over_a_settled_prefix() {
        let mut w = Window::new(4);
        assert_eq!(w.settle(2), None);
        assert_eq!(w.settle(1), None);
        assert_eq!(w.lag(), 2);
        assert_eq!(w.settle(0), Some(3));
        assert_eq!(w.lag(), 0);
        assert_eq!(w.settle(0), None, "settling twice changes nothing");
        assert_eq!(w.settle(9), None, "out of range changes nothing");
        assert_eq!(w.settle(3), Some(4));
    }
}
