//! The crash test on the real broker (tansu, `IDEM_KAFKA_BROKERS`) with Redis
//! (`IDEM_REDIS_URL`) as the store, in lease mode: every payment is applied, and any
//! payment applied twice must follow a lapsed lease; the test counts these.

mod common;
mod crash;

use std::sync::Arc;

use idem_redis::{RedisBackend, RedisConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_test_redis_store() {
    let brokers = conformance::service_env("IDEM_KAFKA_BROKERS");
    let url = conformance::service_env("IDEM_REDIS_URL");
    common::install_metrics();
    common::log_from_env();
    let prefix = format!("{}:", common::unique("idem-kafka-crash"));
    let backend = RedisBackend::connect(RedisConfig::new(url).with_prefix(prefix))
        .await
        .expect("connect to IDEM_REDIS_URL");
    let store = Arc::new(crash::LeaseStore::new(Arc::new(backend)));
    let figures = crash::run(&brokers, store, crash::Plan::default()).await;
    crash::print("Redis, lease mode", &figures);
    assert_eq!(figures.crashes, 10);
    // 400 payments were sent twice. A copy can go unreplayed only when a crash lands
    // between its settle and its probe (then it is skipped, not lost).
    assert!(
        figures.duplicates_replayed >= 400 - 2 * figures.crashes as u64,
        "{figures:?}"
    );
    // Every payment applied; the harness has checked each double against a lapsed lease.
    assert!(figures.effects_applied >= 2000, "{figures:?}");
    assert_eq!(
        figures.effects_applied,
        2000 + figures.double_effects,
        "{figures:?}"
    );
}
