//! The Kafka client as the partition workers see it: pause, resume and store an offset,
//! and wake the thread that polls it; nothing more. The consumer hands it the client once
//! it exists.

use std::sync::{Arc, OnceLock, Weak};

use rdkafka::TopicPartitionList;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaResult;

/// The calls a worker makes on the client.
pub(crate) trait Partitions: Send + Sync {
    fn pause(&self, tpl: &TopicPartitionList) -> KafkaResult<()>;
    fn resume(&self, tpl: &TopicPartitionList) -> KafkaResult<()>;
    fn store_offset(&self, topic: &str, partition: i32, offset: i64) -> KafkaResult<()>;
}

impl<C: ConsumerContext> Partitions for BaseConsumer<C> {
    fn pause(&self, tpl: &TopicPartitionList) -> KafkaResult<()> {
        Consumer::pause(self, tpl)
    }

    fn resume(&self, tpl: &TopicPartitionList) -> KafkaResult<()> {
        Consumer::resume(self, tpl)
    }

    fn store_offset(&self, topic: &str, partition: i32, offset: i64) -> KafkaResult<()> {
        Consumer::store_offset(self, topic, partition, offset)
    }
}

/// A weak handle on the client: the poll thread owns it and drops it at the end, and a
/// call made after that does nothing.
#[derive(Default)]
pub(crate) struct Client {
    consumer: OnceLock<Weak<dyn Partitions>>,
    /// The poll thread, which parks while every partition has enough waiting.
    poller: OnceLock<std::thread::Thread>,
}

impl Client {
    /// Hands over the client once it exists.
    pub fn set<P: Partitions + 'static>(&self, consumer: &Arc<P>) {
        let weak: Weak<dyn Partitions> = Arc::downgrade(consumer) as Weak<dyn Partitions>;
        let _ = self.consumer.set(weak);
    }

    /// Registers the calling thread as the one that polls the client.
    pub fn set_poller(&self) {
        let _ = self.poller.set(std::thread::current());
    }

    /// Wakes the poll thread if it is parked (or makes its next park return at once).
    pub fn wake_poller(&self) {
        if let Some(poller) = self.poller.get() {
            poller.unpark();
        }
    }

    fn get(&self) -> Option<Arc<dyn Partitions>> {
        self.consumer.get().and_then(Weak::upgrade)
    }

    /// Pauses (`on`) or resumes one partition's fetching.
    pub fn pause(&self, topic: &str, partition: i32, on: bool) {
        let Some(consumer) = self.get() else {
            return;
        };
        let tpl = tp_list(topic, partition);
        let result = if on {
            consumer.pause(&tpl)
        } else {
            consumer.resume(&tpl)
        };
        if let Err(e) = result {
            tracing::debug!(topic, partition, error = %e, "pause/resume");
        }
    }

    /// Stores `offset` (the last settled message; librdkafka stores the one after it) for
    /// the next commit; says whether the client took it.
    pub fn store_offset(&self, topic: &str, partition: i32, offset: i64) -> bool {
        let Some(consumer) = self.get() else {
            return false;
        };
        match consumer.store_offset(topic, partition, offset) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(
                    topic, partition, error = %e,
                    "offset store refused (partition no longer assigned?)"
                );
                false
            }
        }
    }
}

/// A one-partition list, for pause and resume calls.
pub(crate) fn tp_list(topic: &str, partition: i32) -> TopicPartitionList {
    let mut tpl = TopicPartitionList::with_capacity(1);
    tpl.add_partition(topic, partition);
    tpl
}

/// librdkafka's log lines, as `tracing` events with target `librdkafka`.
pub(crate) fn log_to_tracing(level: RDKafkaLogLevel, fac: &str, message: &str) {
    match level {
        RDKafkaLogLevel::Emerg
        | RDKafkaLogLevel::Alert
        | RDKafkaLogLevel::Critical
        | RDKafkaLogLevel::Error => tracing::error!(target: "librdkafka", fac, "{message}"),
        RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", fac, "{message}"),
        RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
            tracing::info!(target: "librdkafka", fac, "{message}")
        }
        RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", fac, "{message}"),
    }
}
