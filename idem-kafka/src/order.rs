//! The pieces of key-ordered concurrency within a partition besides the lanes themselves
//! (`idem_core::binding::lanes`, shared with idem-rabbitmq): the low-water mark of a chunk,
//! and a settler that gathers what concurrent handlers return into batch settles.

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
