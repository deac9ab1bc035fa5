//! A partition's own queue in the client, split off the main one when the partition is
//! assigned: its worker takes its messages from here.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::ConsumerContext;
use rdkafka::consumer::base_consumer::PartitionQueue;
use tokio::sync::Notify;

use crate::Message;
use crate::budget::Held;
use crate::handle::Fetch;

/// A partition's queue, and the signal its client raises when the queue turns non-empty.
pub(crate) struct Queue<C: ConsumerContext + 'static> {
    queue: PartitionQueue<C>,
    arrived: Arc<Notify>,
}

impl<C: ConsumerContext + 'static> Queue<C> {
    /// The queue as its worker takes from it, woken by the client's non-empty callback.
    pub fn boxed(mut queue: PartitionQueue<C>) -> Box<dyn Fetch> {
        let arrived = Arc::new(Notify::new());
        let signal = Arc::clone(&arrived);
        queue.set_nonempty_callback(move || signal.notify_one());
        Box::new(Queue { queue, arrived })
    }
}

impl<C: ConsumerContext + 'static> Fetch for Queue<C> {
    fn take(&self, topic: &Arc<str>, held: &Arc<Held>) -> Option<Message> {
        loop {
            match self.queue.poll(Duration::ZERO)? {
                Ok(m) => {
                    let hold = |weight| held.hold(weight).0;
                    return Some(Message::from_borrowed(Arc::clone(topic), &m, hold));
                }
                Err(e) => tracing::warn!(error = %e, "consumer error"),
            }
        }
    }

    fn arrived(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(self.arrived.notified())
    }
}
