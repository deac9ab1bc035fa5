//! Crash points for fault-injection tests.

/// A point in the life of a message where a [`Probe`] is asked whether to crash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Point {
    /// A poll batch is about to be claimed (`offset` is its first message).
    BeforeClaim,
    /// A poll batch was claimed (`offset` is its first message).
    AfterClaim,
    /// The handler returned: its side effect is done, its result not yet stored.
    AfterEffect,
    /// The message is settled in the store (completed, replayed or dead-lettered), its
    /// offset not yet stored.
    AfterSettle,
    /// The offset after this message was stored in the client, not yet committed.
    AfterStore,
    /// A commit of the offset after this message was made: acknowledged if synchronous,
    /// handed to the client if asynchronous (the periodic commit). Asked once per assigned
    /// partition with a stored offset at each commit, on the poll thread.
    AfterCommit,
}

/// What a [`Probe`] wants done at a point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// Go on.
    Continue,
    /// Behave as if the process died here: from now on this consumer stores and commits
    /// nothing, and every partition worker stops where it is. The caller then drops (or
    /// aborts) the [`IdemConsumer::run`](crate::IdemConsumer::run) future, which closes the
    /// client without a commit.
    Crash,
}

/// Asked at each [`Point`] of each message, for crash tests. Keep it cheap: it runs on the
/// hot path of every message.
pub trait Probe: Send + Sync + 'static {
    /// Whether to crash at `point` for the message at `topic`/`partition`/`offset`.
    fn reached(&self, point: Point, topic: &str, partition: i32, offset: i64) -> Verdict;

    /// Called once the client of a crashed consumer is closed (it has left its group), so
    /// a test can start the replacement only after the dead one is gone, as a supervisor
    /// restarting a process would.
    fn closed(&self) {}
}
