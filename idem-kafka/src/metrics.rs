//! The `metrics` counters and gauges the loop keeps, labelled by `topic` and `partition`
//! (the commit errors by `group`).

use metrics::{Counter, Gauge, counter, gauge};

/// Handlers run to completion now (including keyless messages under `MissingKey::Process`).
pub const EXECUTED: &str = "idem_kafka_executed_total";
/// Duplicates answered from the store without running the handler.
pub const REPLAYED: &str = "idem_kafka_replayed_total";
/// Waits of a partition on a key another worker holds.
pub const IN_PROGRESS_WAITS: &str = "idem_kafka_in_progress_waits_total";
/// Handler runs whose lease was lost before their result was stored.
pub const FENCED: &str = "idem_kafka_fenced_total";
/// Keys found poisoned (attempts spent, or a permanent handler error).
pub const POISONED: &str = "idem_kafka_poisoned_total";
/// Messages written to the dead-letter topic and acknowledged.
pub const DEAD_LETTERED: &str = "idem_kafka_dead_lettered_total";
/// Store calls that failed (each one stalls its partition until the store answers).
pub const STORE_ERRORS: &str = "idem_kafka_store_errors_total";
/// Offset commits that failed (each is retried at the next commit), labelled by `group`:
/// one per failed commit whatever its partitions, synchronous (on a revoke or shutdown)
/// or asynchronous (the periodic ones, counted from librdkafka's `COMMITFAIL` log line).
pub const COMMIT_ERRORS: &str = "idem_kafka_commit_errors_total";
/// Times the poll thread stopped copying messages out of the client because every
/// partition held enough waiting (`batch_size` × 4), labelled by `group`: the rest stays
/// in librdkafka's prefetch until a worker runs low.
pub const READ_AHEAD_WAITS: &str = "idem_kafka_read_ahead_waits_total";
/// Gauge: handlers running now.
pub const IN_FLIGHT: &str = "idem_kafka_in_flight";
/// Gauge: messages settled above the low-water mark, waiting for an earlier message to
/// settle before their offsets can be committed (key-ordered concurrency only).
pub const LOW_WATER_LAG: &str = "idem_kafka_low_water_lag";

/// Gauge: 1 while the partition waits, paused, for the offset its store keeps, which could
/// not be read at its assignment (transactional mode); 0 once it started from there.
pub const AWAITING_STORED_OFFSET: &str = "idem_kafka_awaiting_stored_offset";

/// Gauge: bytes (payload, key and headers) of the partition's fetched messages the
/// consumer holds, waiting for the worker or not settled yet. Their sum over the consumer's
/// partitions is bounded by `max_buffered_bytes`, give or take a message per partition.
pub const BUFFERED_BYTES: &str = "idem_kafka_buffered_bytes";

/// The bytes-held gauge of one partition.
pub(crate) fn buffered_bytes(topic: &str, partition: i32) -> Gauge {
    let labels = [
        ("topic", topic.to_owned()),
        ("partition", partition.to_string()),
    ];
    gauge!(BUFFERED_BYTES, &labels)
}

/// The awaiting-stored-offset gauge of one partition.
pub(crate) fn awaiting_stored_offset(topic: &str, partition: i32) -> Gauge {
    let labels = [
        ("topic", topic.to_owned()),
        ("partition", partition.to_string()),
    ];
    gauge!(AWAITING_STORED_OFFSET, &labels)
}

/// The poll thread's waits for its workers, of `group`.
pub(crate) fn read_ahead_waits(group: &str) -> Counter {
    counter!(READ_AHEAD_WAITS, "group" => group.to_owned())
}

/// Counts a failed offset commit of `group`.
pub(crate) fn commit_failed(group: &str) {
    counter!(COMMIT_ERRORS, "group" => group.to_owned()).increment(1);
}

/// The counters of one partition.
pub(crate) struct Counters {
    pub executed: Counter,
    pub replayed: Counter,
    pub in_progress_waits: Counter,
    pub fenced: Counter,
    pub poisoned: Counter,
    pub dead_lettered: Counter,
    pub store_errors: Counter,
    pub in_flight: Gauge,
    pub low_water_lag: Gauge,
}

impl Counters {
    pub fn new(topic: &str, partition: i32) -> Self {
        let labels = [
            ("topic", topic.to_owned()),
            ("partition", partition.to_string()),
        ];
        Counters {
            executed: counter!(EXECUTED, &labels),
            replayed: counter!(REPLAYED, &labels),
            in_progress_waits: counter!(IN_PROGRESS_WAITS, &labels),
            fenced: counter!(FENCED, &labels),
            poisoned: counter!(POISONED, &labels),
            dead_lettered: counter!(DEAD_LETTERED, &labels),
            store_errors: counter!(STORE_ERRORS, &labels),
            in_flight: gauge!(IN_FLIGHT, &labels),
            low_water_lag: gauge!(LOW_WATER_LAG, &labels),
        }
    }
}
