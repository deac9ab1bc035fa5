//! A partition's own queue in the client, split off the main one when the partition is
//! assigned: its worker takes its messages from here. An error in it that librdkafka does
//! not heal by itself stops the consumer (see [`Error::Unreadable`]): the partition's
//! messages are not left unread behind it with only a log line.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use rdkafka::consumer::ConsumerContext;
use rdkafka::consumer::base_consumer::PartitionQueue;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message as _;
use tokio::sync::Notify;

use crate::budget::Held;
use crate::handle::Fetch;
use crate::{Error, Message};

/// Stops the consumer with the error given: what a queue does with one it cannot read past.
pub(crate) type Stop = Arc<dyn Fn(Error) + Send + Sync>;

/// A partition's queue, and the signal its client raises when the queue turns non-empty.
pub(crate) struct Queue<C: ConsumerContext + 'static> {
    queue: PartitionQueue<C>,
    arrived: Arc<Notify>,
    partition: i32,
    /// The offset of the last message taken, or -1.
    last: AtomicI64,
    /// Set once an error stopped the consumer: nothing more is taken from here.
    stopped: AtomicBool,
    stop: Stop,
}

impl<C: ConsumerContext + 'static> Queue<C> {
    /// The queue of `partition` as its worker takes from it, woken by the client's
    /// non-empty callback; an error it cannot read past goes to `stop`.
    pub fn boxed(mut queue: PartitionQueue<C>, partition: i32, stop: Stop) -> Box<dyn Fetch> {
        let arrived = Arc::new(Notify::new());
        let signal = Arc::clone(&arrived);
        queue.set_nonempty_callback(move || signal.notify_one());
        Box::new(Queue {
            queue,
            arrived,
            partition,
            last: AtomicI64::new(-1),
            stopped: AtomicBool::new(false),
            stop,
        })
    }
}

impl<C: ConsumerContext + 'static> Fetch for Queue<C> {
    fn take(&self, topic: &Arc<str>, held: &Arc<Held>) -> Option<Message> {
        if self.stopped.load(Ordering::Acquire) {
            return None;
        }
        loop {
            match self.queue.poll(Duration::ZERO)? {
                Ok(m) => {
                    self.last.store(m.offset(), Ordering::Relaxed);
                    let hold = |weight| held.hold(weight).0;
                    return Some(Message::from_borrowed(Arc::clone(topic), &m, hold));
                }
                Err(KafkaError::PartitionEOF(_)) => {}
                Err(e) if heals(&e) => tracing::warn!(
                    %topic, partition = self.partition, error = %e,
                    "consumer error; librdkafka retries"
                ),
                Err(source) => {
                    self.stopped.store(true, Ordering::Release);
                    let last = self.last.load(Ordering::Relaxed);
                    (self.stop)(Error::Unreadable {
                        topic: topic.to_string(),
                        partition: self.partition,
                        offset: (last >= 0).then_some(last + 1),
                        source: Box::new(source),
                    });
                    return None;
                }
            }
        }
    }

    fn arrived(&self) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(self.arrived.notified())
    }
}

/// Whether librdkafka gets past `error` by itself: it retries the fetch once the broker,
/// the network or the partition's leader is back. Every other error in a partition's queue
/// (a batch that does not decode, a refused fetch, an offset out of range with no reset
/// policy) would be retried forever, or skipped with the messages in it, so it stops the
/// consumer instead.
pub(crate) fn heals(error: &KafkaError) -> bool {
    use RDKafkaErrorCode as C;
    let KafkaError::MessageConsumption(code) = error else {
        return false;
    };
    matches!(
        code,
        C::BrokerTransportFailure
            | C::Resolve
            | C::AllBrokersDown
            | C::OperationTimedOut
            | C::TimedOutQueue
            | C::Retry
            | C::WaitCache
            | C::Interrupted
            | C::WaitingForCoordinator
            | C::RequestTimedOut
            | C::NetworkException
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::BrokerNotAvailable
            | C::ReplicaNotAvailable
            | C::KafkaStorageError
            | C::FencedLeaderEpoch
            | C::UnknownLeaderEpoch
            | C::OffsetNotAvailable
            | C::ThrottlingQuotaExceeded
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_and_leadership_errors_heal_and_unreadable_batches_do_not() {
        let consumption = KafkaError::MessageConsumption;
        for code in [
            RDKafkaErrorCode::BrokerTransportFailure,
            RDKafkaErrorCode::AllBrokersDown,
            RDKafkaErrorCode::NotLeaderForPartition,
            RDKafkaErrorCode::RequestTimedOut,
        ] {
            assert!(heals(&consumption(code)), "{code:?} heals");
        }
        for code in [
            RDKafkaErrorCode::BadCompression,
            RDKafkaErrorCode::BadMessage,
            RDKafkaErrorCode::NotImplemented,
            RDKafkaErrorCode::InvalidMessage,
            RDKafkaErrorCode::UnsupportedCompressionType,
            RDKafkaErrorCode::TopicAuthorizationFailed,
            RDKafkaErrorCode::MessageSizeTooLarge,
            RDKafkaErrorCode::AutoOffsetReset,
        ] {
            assert!(!heals(&consumption(code)), "{code:?} does not heal");
        }
        let fatal = KafkaError::MessageConsumptionFatal(RDKafkaErrorCode::Fatal);
        assert!(!heals(&fatal), "a fatal error does not heal");
    }
}
