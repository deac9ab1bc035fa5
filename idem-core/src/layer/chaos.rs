//! Fault injection: a backend that fails on demand, to test what callers do when the store
//! is down or answers are lost. Every call it lets through reaches the wrapped backend.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;

use super::{Around, Call, Layer, Layered, Op};
use crate::backend::watch::Watch;
use crate::backend::watch::Watchers;
use crate::{Backend, Error, Key, Result};

/// A kind of call [`ChaosLayer`] can refuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
#[non_exhaustive]
pub enum Fault {
    /// `claim` and `claim_many`, and transactions (which claim first).
    Claim = 1,
    /// `complete`, `settle_many` of a batch with a complete in it, transactions (which
    /// complete at their end) and `store_offset`.
    Complete = 2,
    /// `fail` and `release`, and `settle_many` of a batch with either in it.
    Fail = 4,
    /// `extend`.
    Extend = 8,
    /// `get`, `delete`, `purge_expired`, `list` and `stored_offsets`.
    Read = 16,
    /// Notifications: `watch` hands out a watch nothing wakes (every notification lost),
    /// while the capabilities still say the backend notifies.
    Notify = 32,
}

impl Fault {
    fn of(call: &Call<'_>) -> u32 {
        let mut bits = 0;
        if matches!(call.op, Op::Claim | Op::ClaimMany) || call.op.runs_handlers() {
            bits |= Fault::Claim as u32;
        }
        if call.completes() || call.op.runs_handlers() || call.op == Op::StoreOffset {
            bits |= Fault::Complete as u32;
        }
        if call.fails_or_releases() {
            bits |= Fault::Fail as u32;
        }
        if call.op == Op::Extend {
            bits |= Fault::Extend as u32;
        }
        if matches!(
            call.op,
            Op::Get | Op::Delete | Op::PurgeExpired | Op::List | Op::StoredOffsets
        ) {
            bits |= Fault::Read as u32;
        }
        bits
    }
}

/// The chaos layer: switches that make calls answer [`Error::Unavailable`] without
/// reaching the store ([`ChaosLayer::set`]), a random share of calls refused before they reach
/// it or whose answer is lost after the store applied them ([`ChaosLayer::with_refused`],
/// [`ChaosLayer::with_lost_answers`], ambiguous like a timeout), and a delay before each call.
/// Clones share their switches, so a test keeps one to flip faults under a running
/// backend.
#[derive(Clone, Debug, Default)]
pub struct ChaosLayer {
    state: Arc<State>,
}

#[derive(Debug, Default)]
struct State {
    on: AtomicU32,
    /// Shares of calls refused before, and answers lost after, in millionths.
    refused: AtomicU32,
    lost: AtomicU32,
    delay_micros: AtomicU64,
    /// Calls still to refuse, and answers still to lose, whatever the shares say.
    refuse_next: AtomicU32,
    lose_next: AtomicU32,
    /// The hub of the watches nothing wakes.
    silent: Arc<Watchers>,
}

const MILLION: f64 = 1_000_000.0;

impl ChaosLayer {
    /// Every fault off.
    pub fn new() -> Self {
        ChaosLayer::default()
    }

    /// Refuses each call with probability `share` (0 to 1) before it reaches the store.
    pub fn with_refused(self, share: f64) -> Self {
        self.state
            .refused
            .store(millionths(share), Ordering::SeqCst);
        self
    }

    /// Loses each answer with probability `share` (0 to 1): the call reaches the store and
    /// does whatever it does, then answers `Unavailable`, as a call whose reply timed out.
    pub fn with_lost_answers(self, share: f64) -> Self {
        self.state.lost.store(millionths(share), Ordering::SeqCst);
        self
    }

    /// Waits `delay` before each call (a slow network).
    pub fn with_delay(self, delay: Duration) -> Self {
        let micros = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.state.delay_micros.store(micros, Ordering::SeqCst);
        self
    }

    /// Refuses the next `n` calls (of any kind) before they reach the store.
    pub fn refuse_next(&self, n: u32) {
        self.state.refuse_next.store(n, Ordering::SeqCst);
    }

    /// Loses the answers of the next `n` calls (of any kind) after the store applied them.
    pub fn lose_next_answers(&self, n: u32) {
        self.state.lose_next.store(n, Ordering::SeqCst);
    }

    /// Switches `fault` on or off.
    pub fn set(&self, fault: Fault, on: bool) {
        if on {
            self.state.on.fetch_or(fault as u32, Ordering::SeqCst);
        } else {
            self.state.on.fetch_and(!(fault as u32), Ordering::SeqCst);
        }
    }

    /// Switches every fault on or off.
    pub fn set_all(&self, on: bool) {
        let bits = if on { u32::MAX } else { 0 };
        self.state.on.store(bits, Ordering::SeqCst);
    }

    fn is_on(&self, fault: Fault) -> bool {
        self.state.on.load(Ordering::SeqCst) & fault as u32 != 0
    }

    /// Whether this call is hit: one of the next `count`, or by the `share`.
    fn hit(count: &AtomicU32, share: &AtomicU32) -> bool {
        let counted = count
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        let share = share.load(Ordering::Relaxed);
        counted || (share > 0 && fastrand::u32(0..1_000_000) < share)
    }
}

fn millionths(share: f64) -> u32 {
    (share.clamp(0.0, 1.0) * MILLION) as u32
}

fn injected(call: &Call<'_>, what: &str) -> Error {
    Error::Unavailable {
        message: format!("injected fault on {}: {what}", call.op.name()),
        source: None,
    }
}

impl<B: Backend> Layer<B> for ChaosLayer {
    type Backend = Layered<B, ChaosLayer>;
    fn layer(&self, inner: B) -> Self::Backend {
        Layered::new(inner, self.clone())
    }
}

impl Around for ChaosLayer {
    fn around<'a, T: Send + 'a>(
        &'a self,
        call: Call<'a>,
        next: BoxFuture<'a, Result<T>>,
    ) -> BoxFuture<'a, Result<T>> {
        async move {
            let delay = self.state.delay_micros.load(Ordering::Relaxed);
            if delay > 0 {
                tokio::time::sleep(Duration::from_micros(delay)).await;
            }
            if self.state.on.load(Ordering::SeqCst) & Fault::of(&call) != 0 {
                return Err(injected(&call, "switched on"));
            }
            if ChaosLayer::hit(&self.state.refuse_next, &self.state.refused) {
                return Err(injected(&call, "refused"));
            }
            let answer = next.await;
            if ChaosLayer::hit(&self.state.lose_next, &self.state.lost) {
                return Err(injected(&call, "answer lost"));
            }
            answer
        }
        .boxed()
    }

    fn watch(&self, _key: &Key) -> Option<Watch> {
        self.is_on(Fault::Notify)
            .then(|| self.state.silent.subscribe(String::new()))
    }
}
