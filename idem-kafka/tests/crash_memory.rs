//! The crash test on the real broker (tansu, `IDEM_KAFKA_BROKERS`) with the in-memory
//! backend shared by every consumer instance.

mod common;
mod crash;

use std::sync::Arc;

use idem_core::MemoryBackend;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn crash_test_memory_store() {
    let brokers = conformance::service_env("IDEM_KAFKA_BROKERS");
    common::install_metrics();
    common::log_from_env();
    let store = Arc::new(crash::LeaseStore::new(Arc::new(MemoryBackend::new())));
    let figures = crash::run(&brokers, store, crash::Plan::default()).await;
    crash::print("memory store, lease mode", &figures);
    assert_eq!(figures.crashes, 10);
    // 400 payments were sent twice. A copy can go unreplayed only when a crash lands
    // between its settle and its probe (then it is skipped, not lost).
    assert!(
        figures.duplicates_replayed >= 400 - 2 * figures.crashes as u64,
        "{figures:?}"
    );
    assert!(figures.effects_applied >= 2000, "{figures:?}");
}
