//! What the poll thread and the rebalance callbacks keep of a partition's worker: its
//! shared state (stop, abandon, pause reasons, backlog, bytes held), and what feeds it: the
//! partition's own queue in the client ([`Fetch`]) and a channel for the messages the poll
//! thread routes.

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use rdkafka::message::{BorrowedMessage, Message as _};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::Message;
use crate::budget::Held;
use crate::client::Client;
use idem_core::binding::{Budget, Signal};

/// Pause reasons: the worker's buffer is full, the worker is stalled, the consumer holds
/// more bytes of fetched messages than its bound, or (transactional mode) the offset the
/// store keeps for the partition could not be read at its assignment yet.
pub(crate) const BACKLOG: u8 = 1;
pub(crate) const STALL: u8 = 2;
pub(crate) const BYTES: u8 = 4;
pub(crate) const OFFSETS: u8 = 8;

/// A partition's state shared by its worker, the poll thread and the rebalance callback.
pub(crate) struct PartitionState {
    pub topic: Arc<str>,
    pub partition: i32,
    /// Stop dispatching (revoke, shutdown); in-flight work may finish.
    pub stop: Signal,
    /// Give up in-flight work too (the revoke timeout passed).
    pub abandon: Signal,
    pub backlog: AtomicUsize,
    /// The last message whose offset is stored in the client (librdkafka stores the one
    /// after it), or -1.
    pub stored: AtomicI64,
    pause: Mutex<u8>,
    /// Bytes of this partition's messages held.
    pub held: Arc<Held>,
    /// Fired once the partition's start is known; its worker takes no message before
    /// (transactional mode: the store's offset for it was read, see `consumer::assign::position_later`).
    pub positioned: Signal,
    /// The last offset before the partition's start: its worker drops messages at or
    /// below it (fetched from Kafka's offset before the seek to the store's).
    pub floor: AtomicI64,
}

impl PartitionState {
    /// Whether the partition is paused in the client, for any reason.
    pub fn is_paused(&self) -> bool {
        *self.pause.lock().unwrap_or_else(|e| e.into_inner()) != 0
    }

    /// Sets or clears one pause reason, pausing or resuming the partition in the client
    /// when the set of reasons becomes non-empty or empty.
    pub fn set_pause(&self, client: &Client, reason: u8, on: bool) {
        let mut reasons = self.pause.lock().unwrap_or_else(|e| e.into_inner());
        let before = *reasons;
        if on {
            *reasons |= reason;
        } else {
            *reasons &= !reason;
        }
        if (before == 0) != (*reasons == 0) {
            client.pause(&self.topic, self.partition, *reasons != 0);
        }
    }
}

/// What the poll thread and the callbacks keep of a worker.
pub(crate) struct WorkerHandle {
    pub state: Arc<PartitionState>,
    tx: mpsc::UnboundedSender<Message>,
    task: Option<JoinHandle<()>>,
    /// Disconnected when the worker's task ends, however it ends.
    done: std::sync::mpsc::Receiver<()>,
    last_routed: i64,
}

/// What the worker keeps of its handle: the receiving ends.
pub(crate) struct WorkerEnds {
    pub rx: mpsc::UnboundedReceiver<Message>,
    /// The partition's own queue in the client, when it could be split off the main one:
    /// the worker takes its messages from there itself, as it is ready for them.
    pub queue: Option<Box<dyn Fetch>>,
    /// Held until the worker ends: dropping it tells the handle.
    pub _done: std::sync::mpsc::Sender<()>,
}

/// A partition's own queue in the client.
pub(crate) trait Fetch: Send + Sync {
    /// The next message waiting, copied out (its bytes held in `held`); `None` when none
    /// waits.
    fn take(&self, topic: &Arc<str>, held: &Arc<Held>) -> Option<Message>;

    /// Resolves once a message may be waiting (at once if one arrived since the last
    /// `take` that found none).
    fn arrived(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>>;
}

impl PartitionState {
    /// A partition's state and the handle that feeds its worker.
    pub fn create(
        topic: Arc<str>,
        partition: i32,
        budget: Arc<Budget>,
    ) -> (WorkerHandle, WorkerEnds) {
        let gauge = crate::metrics::buffered_bytes(&topic, partition);
        let state = Arc::new(PartitionState {
            topic,
            partition,
            stop: Signal::new(),
            abandon: Signal::new(),
            backlog: AtomicUsize::new(0),
            stored: AtomicI64::new(-1),
            pause: Mutex::new(0),
            held: Held::new(budget, gauge),
            positioned: Signal::new(),
            floor: AtomicI64::new(i64::MIN),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let handle = WorkerHandle {
            state,
            tx,
            task: None,
            done: done_rx,
            last_routed: i64::MIN,
        };
        let ends = WorkerEnds {
            rx,
            queue: None,
            _done: done_tx,
        };
        (handle, ends)
    }
}

/// What [`WorkerHandle::send`] needs of the consumer.
pub(crate) struct Route<'a> {
    pub client: &'a Client,
    pub budget: &'a Budget,
    /// Messages a worker may hold before its partition is paused.
    pub max_buffered: usize,
}

impl WorkerHandle {
    pub fn with_task(mut self, task: JoinHandle<()>) -> Self {
        self.task = Some(task);
        self
    }

    /// Hands `m` to the worker, pausing the partition when the worker's buffer is full, or
    /// when the consumer holds more bytes than its bound and this partition holds some
    /// already (so a partition holding nothing always gets its next message, however large).
    /// Says whether it paused the partition for bytes. A message at or below one already
    /// routed is a redelivery after a pause: dropped.
    pub fn send(&mut self, m: &BorrowedMessage<'_>, route: &Route<'_>) -> bool {
        if m.offset() <= self.last_routed {
            return false;
        }
        self.last_routed = m.offset();
        let mut held_some = false;
        let message = Message::from_borrowed(Arc::clone(&self.state.topic), m, |weight| {
            let (ticket, some) = self.state.held.hold(weight);
            held_some = some;
            ticket
        });
        // Counted before it is sent, so the worker never takes out more than was put in.
        let n = self.state.backlog.fetch_add(1, Ordering::Relaxed) + 1;
        if self.tx.send(message).is_err() {
            self.state.backlog.fetch_sub(1, Ordering::Relaxed);
            return false;
        }
        if n >= route.max_buffered {
            self.state.set_pause(route.client, BACKLOG, true);
        }
        if held_some && route.budget.held() > route.budget.bound() {
            self.state.set_pause(route.client, BYTES, true);
            return true;
        }
        false
    }

    /// Waits for the worker's task to end, up to `deadline`; says whether it ended.
    pub fn wait_until(&self, deadline: Instant) -> bool {
        let left = deadline.saturating_duration_since(Instant::now());
        !matches!(
            self.done.recv_timeout(left),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout)
        )
    }

    pub fn abort(&self) {
        self.state.abandon.fire();
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}
