//! The crash test on the real broker (tansu, `IDEM_KAFKA_BROKERS`) with DynamoDB
//! (Amazon DynamoDB Local, `IDEM_DYNAMO_ENDPOINT`) as the store, in lease mode: every
//! payment is applied, and any payment applied twice must follow a lapsed lease; the test
//! counts these. DynamoDB decides lapse by the client's clock: every consumer here shares
//! one, so the skew margin is kept small next to the 2 s lease.

mod common;
mod crash;

use std::sync::Arc;
use std::time::Duration;

use idem_dynamo::{DynamoBackend, DynamoConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_test_dynamo_store() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let endpoint = idem_conformance::service_env("IDEM_DYNAMO_ENDPOINT");
    common::install_metrics();
    common::log_from_env();
    let config = DynamoConfig::local(endpoint, "idem_kafka_crash")
        .with_clock_skew(Duration::from_millis(50));
    let backend = DynamoBackend::connect(config)
        .await
        .expect("connect to IDEM_DYNAMO_ENDPOINT");
    backend.create_table().await.expect("create table");
    let plan = crash::Plan::default();
    crash::lease_mode(&brokers, "DynamoDB, lease mode", Arc::new(backend), plan).await;
}
