//! What the builder derives from the client config: the producer's config, and
//! librdkafka's prefetch bounds.

use rdkafka::ClientConfig;

/// Consumer-only librdkafka properties left out of the dead-letter producer's
/// configuration (which otherwise copies the consumer's).
const CONSUMER_ONLY: &[&str] = &[
    "group.id",
    "group.instance.id",
    "group.protocol",
    "group.protocol.type",
    "group.remote.assignor",
    "partition.assignment.strategy",
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "coordinator.query.interval.ms",
    "max.poll.interval.ms",
    "enable.auto.commit",
    "auto.commit.interval.ms",
    "enable.auto.offset.store",
    "queued.min.messages",
    "queued.max.messages.kbytes",
    "fetch.wait.max.ms",
    "fetch.queue.backoff.ms",
    "fetch.message.max.bytes",
    "max.partition.fetch.bytes",
    "fetch.max.bytes",
    "fetch.min.bytes",
    "fetch.error.backoff.ms",
    "isolation.level",
    "enable.partition.eof",
    "check.crcs",
    "auto.offset.reset",
    "allow.auto.create.topics",
];

/// `config` without its consumer-only properties: a producer's configuration (the
/// dead-letter producer's by default, and the start-up checks' client's).
pub(crate) fn producer_config(config: &ClientConfig) -> ClientConfig {
    let mut p = config.clone();
    for prop in CONSUMER_ONLY {
        p.remove(prop);
    }
    p
}

/// Each partition's queue in the client prefetches at most this share of
/// `max_buffered_bytes` (at least 1 MiB), unless the client config sets
/// `queued.max.messages.kbytes`: 16 partitions prefetch about the bound together.
pub(super) const PREFETCH_SHARE: usize = 16;

/// librdkafka's prefetch per partition: `queued.min.messages`, default 100,000.
pub(super) fn prefetch(config: &ClientConfig) -> usize {
    config
        .get("queued.min.messages")
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(100_000)
}

/// librdkafka's prefetch bound in bytes: `queued.max.messages.kbytes`, default 65,536 KiB.
pub(super) fn prefetch_bytes(config: &ClientConfig) -> usize {
    let kbytes: usize = config
        .get("queued.max.messages.kbytes")
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(65_536);
    kbytes.saturating_mul(1024).max(1)
}
