//! Crash points for fault-injection tests.

use crate::Message;

/// A point in the life of a delivery where a [`Probe`] is asked whether to crash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Point {
    /// The message's key is about to be claimed.
    BeforeClaim,
    /// The handler returned: its side effect is done, its result not yet stored.
    AfterEffect,
    /// The message is settled in the store (completed, replayed, or its dead letter
    /// confirmed by the server), not yet acked.
    AfterSettle,
    /// The message was acked.
    AfterAck,
}

/// What a [`Probe`] wants done at a point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// Go on.
    Continue,
    /// Behave as if the process died here: nothing more is settled or acked, and the
    /// connection is closed, so the server requeues every unacked delivery.
    /// [`IdemConsumer::run`](crate::IdemConsumer::run) then returns.
    Crash,
}

/// Asked at each [`Point`] of each delivery, for crash tests and to watch a consumer. Keep
/// it cheap: it runs on the path of every message.
pub trait Probe: Send + Sync + 'static {
    /// Whether to crash at `point` for `message`.
    fn reached(&self, point: Point, message: &Message) -> Verdict;
}
