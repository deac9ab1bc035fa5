//! The crash test on the real broker (tansu, `IDEM_KAFKA_BROKERS`) with Redis
//! (`IDEM_REDIS_URL`, and the cluster `IDEM_REDIS_CLUSTER_URL`) as the store, in lease
//! mode: every payment is applied, and any payment applied twice must follow a lapsed
//! lease; the test counts these.

mod common;
mod crash;

use std::sync::Arc;

use idem_redis::{RedisBackend, RedisConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_test_redis_store() {
    scenario(crash::Plan::default(), "Redis, lease mode").await;
}

/// The same with 32 handlers in flight per partition (key-ordered concurrency).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_test_redis_store_in_flight_32() {
    let plan = crash::Plan {
        in_flight: 32,
        ..crash::Plan::default()
    };
    scenario(plan, "Redis, lease mode, 32 in flight per partition").await;
}

/// The same on the three-node Redis Cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_test_redis_cluster_store() {
    let urls = idem_conformance::service_env("IDEM_REDIS_CLUSTER_URL");
    let config = RedisConfig::cluster(urls.split(',').map(str::trim));
    run(config, crash::Plan::default(), "Redis Cluster, lease mode").await;
}

async fn scenario(plan: crash::Plan, label: &str) {
    let url = idem_conformance::service_env("IDEM_REDIS_URL");
    run(RedisConfig::new(url), plan, label).await;
}

async fn run(config: RedisConfig, plan: crash::Plan, label: &str) {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    common::install_metrics();
    common::log_from_env();
    let prefix = format!("{}:", common::unique("idem-kafka-crash"));
    let backend = RedisBackend::connect(config.with_prefix(prefix))
        .await
        .expect("connect to the Redis the environment names");
    crash::lease_mode(&brokers, label, Arc::new(backend), plan).await;
}
