//! The crash test on the real broker (tansu, `IDEM_KAFKA_BROKERS`) with the in-memory
//! store, in lease mode. The store outlives the consumers the test crashes, as an embedded
//! store outlives a consumer task that dies in its process: every payment is applied, and
//! any payment applied twice must follow a lapsed lease.

mod common;
mod crash;

use std::sync::Arc;

use idem_core::MemoryBackend;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_test_memory_store() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    common::install_metrics();
    common::log_from_env();
    crash::lease_mode(
        &brokers,
        "memory, lease mode",
        Arc::new(MemoryBackend::new()),
        crash::Plan::default(),
    )
    .await;
}
