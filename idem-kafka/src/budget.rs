//! The bytes of fetched messages the consumer holds per partition, counted in the
//! consumer's [`Budget`] too, and the ticket each message carries until it is dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem_core::binding::Budget;
use metrics::Gauge;

/// The bytes one partition holds, counted in the consumer's budget too.
pub(crate) struct Held {
    bytes: AtomicUsize,
    budget: Arc<Budget>,
    gauge: Gauge,
}

impl Held {
    pub fn new(budget: Arc<Budget>, gauge: Gauge) -> Arc<Held> {
        Arc::new(Held {
            bytes: AtomicUsize::new(0),
            budget,
            gauge,
        })
    }

    /// Bytes of this partition's messages held.
    pub fn get(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Whether the consumer holds more bytes than its bound.
    pub fn over_budget(&self) -> bool {
        self.budget.held() > self.budget.bound()
    }

    /// Counts `bytes` of a message of this partition; says whether the partition held
    /// anything before it.
    pub fn hold(self: &Arc<Self>, bytes: usize) -> (Ticket, bool) {
        let before = self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.budget.take(bytes);
        self.gauge.increment(bytes as f64);
        let ticket = Ticket {
            held: Arc::clone(self),
            bytes,
        };
        (ticket, before > 0)
    }
}

/// One message's share of the budget (payload, key and headers), given back when the
/// message is dropped: once settled, or when its partition is given up.
pub(crate) struct Ticket {
    held: Arc<Held>,
    bytes: usize,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let held = &self.held;
        held.bytes.fetch_sub(self.bytes, Ordering::Relaxed);
        held.budget.give_back(self.bytes);
        held.gauge.decrement(self.bytes as f64);
    }
}
