//! The `metrics` counters the loop keeps, labelled by `topic` and `partition`.

use metrics::{Counter, counter};

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

/// The counters of one partition.
pub(crate) struct Counters {
    pub executed: Counter,
    pub replayed: Counter,
    pub in_progress_waits: Counter,
    pub fenced: Counter,
    pub poisoned: Counter,
    pub dead_lettered: Counter,
    pub store_errors: Counter,
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
        }
    }
}
