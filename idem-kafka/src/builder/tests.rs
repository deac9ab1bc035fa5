//! The builder's checks.
use bytes::Bytes;
use idem_core::MemoryBackend;

use super::*;

#[test]
fn the_buffer_follows_librdkafkas_prefetch() {
    let mut c = ClientConfig::new();
    assert_eq!(prefetch(&c), 100_000);
    c.set("queued.min.messages", "2500");
    assert_eq!(prefetch(&c), 2500);
    c.set("queued.min.messages", "lots");
    assert_eq!(prefetch(&c), 100_000);
}

#[test]
fn the_byte_bound_follows_librdkafkas_prefetch_bound() {
    let mut c = ClientConfig::new();
    assert_eq!(prefetch_bytes(&c), 64 << 20);
    c.set("queued.max.messages.kbytes", "1024");
    assert_eq!(prefetch_bytes(&c), 1 << 20);
    c.set("queued.max.messages.kbytes", "much");
    assert_eq!(prefetch_bytes(&c), 64 << 20);
    let s = builder().build().unwrap();
    assert_eq!(s.settings().max_buffered_bytes, 64 << 20);
    let s = builder().max_buffered_bytes(5_000_000).build().unwrap();
    assert_eq!(s.settings().max_buffered_bytes, 5_000_000);
}

#[test]
fn the_partition_queues_prefetch_a_share_of_the_byte_bound_unless_the_client_config_says() {
    let kbytes = |s: &IdemConsumer| {
        let c = &s.settings().consumer_config;
        c.get("queued.max.messages.kbytes").map(str::to_owned)
    };
    let queued = |s: &IdemConsumer| {
        let c = &s.settings().consumer_config;
        c.get("queued.min.messages").map(str::to_owned)
    };
    let s = builder().build().unwrap();
    assert_eq!(kbytes(&s).as_deref(), Some("4096"), "64 MiB / 16");
    assert_eq!(queued(&s), None, "librdkafka's own default");
    let s = builder().max_buffered_bytes(1 << 20).build().unwrap();
    assert_eq!(kbytes(&s).as_deref(), Some("1024"), "at least 1 MiB");
    let s = builder().max_buffered_bytes(usize::MAX).build().unwrap();
    assert_eq!(kbytes(&s).as_deref(), Some("2097151"), "librdkafka's most");
    let s = builder().max_buffered(700).build().unwrap();
    assert_eq!(queued(&s).as_deref(), Some("700"));
    let mut config = ClientConfig::new();
    config
        .set("queued.max.messages.kbytes", "300")
        .set("queued.min.messages", "9");
    let s = ConsumerBuilder::new(config)
        .topics(["payments"])
        .group("billing")
        .engine(engine())
        .handler(|_, _| async { Ok(Bytes::new()) })
        .max_buffered(700)
        .build()
        .unwrap();
    assert_eq!(kbytes(&s).as_deref(), Some("300"), "the client config's");
    assert_eq!(queued(&s).as_deref(), Some("9"), "the client config's");
    assert_eq!(s.settings().max_buffered_bytes, 300 << 10);
}

#[test]
fn the_unsettled_bound_defaults_to_the_batch_and_takes_what_is_set() {
    let s = builder().build().unwrap();
    assert_eq!(s.settings().max_unsettled, 500, "the batch size by default");
    assert_eq!(s.settings().settle_within, Duration::from_millis(100));
    let s = builder().batch_size(40).build().unwrap();
    assert_eq!(s.settings().max_unsettled, 40, "follows the batch size");
    let s = builder()
        .max_unsettled(1)
        .settle_within(Duration::from_millis(5))
        .build()
        .unwrap();
    assert_eq!(s.settings().max_unsettled, 1);
    assert_eq!(s.settings().settle_within, Duration::from_millis(5));
    let s = builder().settle_within(Duration::MAX).build().unwrap();
    assert_eq!(
        s.settings().settle_within,
        idem_core::clock::capped(Duration::MAX)
    );
    assert!(config_error(builder().max_unsettled(0)).contains("max_unsettled must be at least 1"));
    let zero = builder().settle_within(Duration::ZERO);
    assert!(config_error(zero).contains("settle_within must be above zero"));
}

#[test]
fn durations_of_duration_max_are_a_century() {
    let century = idem_core::clock::capped(Duration::MAX);
    let s = builder()
        .revoke_timeout(Duration::MAX)
        .retry_backoff(Duration::MAX, Duration::MAX)
        .build()
        .unwrap();
    let settings = s.settings();
    assert_eq!(settings.revoke_timeout, century);
    assert_eq!(settings.retry_backoff, (century, century));
    // The revoke deadline and the doubled backoff are computed from these.
    let _ = std::time::Instant::now() + settings.revoke_timeout;
    let _ = settings.retry_backoff.1.saturating_mul(2);
}

fn engine() -> Engine {
    Engine::builder(Arc::new(MemoryBackend::new()))
        .build()
        .unwrap()
}

fn builder() -> ConsumerBuilder {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", "127.0.0.1:1");
    ConsumerBuilder::new(config)
        .topics(["payments"])
        .group("billing")
        .engine(engine())
        .handler(|_, _| async { Ok(Bytes::new()) })
}

fn config_error(b: ConsumerBuilder) -> String {
    match b.build() {
        Err(Error::Config(message)) => message,
        other => panic!("expected a configuration error, got {other:?}"),
    }
}

#[test]
fn builds_with_forced_and_default_properties() {
    let c = builder().build().unwrap();
    let s = c.settings();
    assert_eq!(s.consumer_config.get("enable.auto.commit"), Some("false"));
    assert_eq!(
        s.consumer_config.get("enable.auto.offset.store"),
        Some("false")
    );
    assert_eq!(s.consumer_config.get("fetch.queue.backoff.ms"), Some("10"));
    assert_eq!(s.consumer_config.get("auto.offset.reset"), Some("earliest"));
    assert!(
        s.consumer_config.log_level as u8 >= RDKafkaLogLevel::Warning as u8
            && s.dead_letter_config.log_level as u8 >= RDKafkaLogLevel::Warning as u8,
        "librdkafka's warnings are let out: {:?}",
        s.consumer_config.log_level
    );
    assert_eq!(s.consumer_config.get("group.id"), Some("billing"));
    assert_eq!(
        s.namespace, "billing",
        "the namespace defaults to the group"
    );
    assert_eq!(s.dead_letter_config.get("group.id"), None);
    assert_eq!(
        s.dead_letter_config.get("bootstrap.servers"),
        Some("127.0.0.1:1")
    );
    assert_eq!(s.dead_letter.for_topic("payments"), "payments.dlq");
    assert_eq!(s.missing_key, MissingKey::DeadLetter);
}

#[test]
fn keeps_what_the_caller_set() {
    let mut config = ClientConfig::new();
    config
        .set("group.id", "from-config")
        .set("fetch.queue.backoff.ms", "500")
        .set("auto.offset.reset", "latest");
    let c = ConsumerBuilder::new(config)
        .topics(["t"])
        .namespace("ns")
        .engine(engine())
        .handler(|_, _| async { Ok(Bytes::new()) })
        .build()
        .unwrap();
    let s = c.settings();
    assert_eq!(s.group, "from-config");
    assert_eq!(s.namespace, "ns");
    assert_eq!(s.consumer_config.get("fetch.queue.backoff.ms"), Some("500"));
    assert_eq!(s.consumer_config.get("auto.offset.reset"), Some("latest"));
}

#[test]
fn refuses_what_breaks_the_consumer_rule_or_makes_no_sense() {
    let mut auto = ClientConfig::new();
    auto.set("enable.auto.commit", "true");
    let b = ConsumerBuilder::new(auto)
        .topics(["t"])
        .group("g")
        .engine(engine())
        .handler(|_, _| async { Ok(Bytes::new()) });
    assert!(config_error(b).contains("enable.auto.commit"));

    let no_group = ConsumerBuilder::new(ClientConfig::new())
        .topics(["t"])
        .engine(engine())
        .handler(|_, _| async { Ok(Bytes::new()) });
    assert!(config_error(no_group).contains("group"));

    assert!(config_error(builder().topics(Vec::<String>::new())).contains("topic"));
    assert!(config_error(builder().batch_size(0)).contains("batch_size"));
    assert!(config_error(builder().max_buffered_bytes(0)).contains("max_buffered_bytes"));
    assert!(config_error(builder().partition_concurrency(0)).contains("partition_concurrency"));
    assert!(config_error(builder().in_flight(0)).contains("in_flight"));
    // Bounds past which tokio's semaphore or the batch's allocation would panic.
    let huge = builder().batch_size(MAX_BATCH_SIZE + 1);
    assert!(config_error(huge).contains("batch_size must be 1 to 65536"));
    assert!(builder().batch_size(MAX_BATCH_SIZE).build().is_ok());
    assert!(config_error(builder().in_flight(usize::MAX)).contains("in_flight"));
    let all = builder().partition_concurrency(usize::MAX);
    assert!(config_error(all).contains("partition_concurrency"));
    // Topic names librdkafka refuses (rdkafka panics on them).
    assert!(config_error(builder().topics(["a\0b"])).contains("without NUL"));
    let long = "t".repeat(250);
    assert!(config_error(builder().topics([long.as_str()])).contains("249 bytes"));
    let suffixed = "t".repeat(246);
    assert!(config_error(builder().topics([suffixed.as_str()])).contains(".dlq"));
    let fixed = builder().dead_letter_topic(DeadLetterTopic::Fixed(String::new()));
    assert!(config_error(fixed).contains("topic"));
    let backoff = builder().retry_backoff(Duration::from_secs(2), Duration::from_secs(1));
    assert!(config_error(backoff).contains("retry_backoff"));
    let same = builder().dead_letter_topic(DeadLetterTopic::Fixed("payments".into()));
    assert!(config_error(same).contains("dead-letter"));
    assert!(config_error(builder().namespace("a\0b")).contains("namespace"));
    let pointer = builder().key_source(KeySource::json_pointer("id"));
    assert!(config_error(pointer).contains("JSON pointer"));

    let no_engine = ConsumerBuilder::new(ClientConfig::new())
        .topics(["t"])
        .group("g")
        .handler(|_, _| async { Ok(Bytes::new()) });
    assert!(config_error(no_engine).contains("engine"));
    let no_handler = ConsumerBuilder::new(ClientConfig::new())
        .topics(["t"])
        .group("g")
        .engine(engine());
    assert!(config_error(no_handler).contains("handler"));
}
