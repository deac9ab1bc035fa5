//! Where a worker's messages come from: the partition's own queue in the client, and the
//! channel of those the poll thread routed (fetched before the queue was split off).

use std::sync::Arc;

use crate::Message;
use crate::handle::{PartitionState, WorkerEnds};

/// A worker's sources, and the offset of the last message it took.
pub(super) struct Intake {
    ends: WorkerEnds,
    state: Arc<PartitionState>,
    last_taken: i64,
}

impl Intake {
    /// Nothing at or below the partition's floor is taken (see [`PartitionState::floor`]).
    pub fn new(ends: WorkerEnds, state: Arc<PartitionState>) -> Intake {
        let last_taken = state.floor.load(std::sync::atomic::Ordering::SeqCst);
        Intake {
            ends,
            state,
            last_taken,
        }
    }

    /// Takes the messages waiting into `batch`, up to `batch_size`: those the poll thread
    /// routed first (older), then those in the partition's own queue, while the consumer
    /// holds no more bytes than its bound (a worker holding none always takes one). A
    /// message at or below one taken already is dropped. Returns how many the poll thread
    /// had routed.
    pub fn fill(&mut self, batch: &mut Vec<Message>, batch_size: usize) -> usize {
        let mut routed = 0;
        while batch.len() < batch_size {
            match self.ends.rx.try_recv() {
                Ok(m) => {
                    routed += 1;
                    self.push(batch, m);
                }
                Err(_) => break,
            }
        }
        if let Some(queue) = &self.ends.queue {
            let held = &self.state.held;
            while batch.len() < batch_size && !(held.get() > 0 && held.over_budget()) {
                let Some(m) = queue.take(&self.state.topic, held) else {
                    break;
                };
                if m.offset() > self.last_taken {
                    self.last_taken = m.offset();
                    batch.push(m);
                }
            }
        }
        routed
    }

    /// Waits until a message may be waiting: one the poll thread routed (taken into
    /// `batch`; `Some(1)`, it counts in the backlog) or a signal from the partition's queue
    /// (`Some(0)`). `None` once the poll thread dropped the channel.
    pub async fn wait(&mut self, batch: &mut Vec<Message>) -> Option<usize> {
        let WorkerEnds { rx, queue, .. } = &mut self.ends;
        let arrived = match queue {
            Some(queue) => queue.arrived(),
            None => Box::pin(std::future::pending()),
        };
        tokio::select! {
            m = rx.recv() => {
                let m = m?;
                self.push(batch, m);
                Some(1)
            }
            () = arrived => Some(0),
        }
    }

    fn push(&mut self, batch: &mut Vec<Message>, m: Message) {
        if m.offset() > self.last_taken {
            self.last_taken = m.offset();
            batch.push(m);
        }
    }
}
