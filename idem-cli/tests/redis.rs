//! Operator commands against a real Redis (IDEM_REDIS_URL), under a key prefix of their own.

mod common;

use std::sync::Arc;

use common::{fails, ok, operator_scenario};
use idem_redis::{RedisBackend, RedisConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_on_redis() {
    let base = idem_conformance::service_env("IDEM_REDIS_URL");
    let prefix = format!("idemcli:{}:{}:", std::process::id(), fastrand::u32(..));
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}prefix={prefix}");

    let out = ok(&["migrate", "-b", &url, "--yes"]);
    assert!(out.contains("redis: nothing to migrate"), "{out}");

    let config = RedisConfig::from_urls(&base).with_prefix(prefix.clone());
    let backend = RedisBackend::connect(config)
        .await
        .expect("connect to IDEM_REDIS_URL");
    operator_scenario(&url, Arc::new(backend), "orders").await;
}

#[test]
fn an_unreachable_redis_is_one_line() {
    let err = fails(
        &["inspect", "-b", "redis://:s3cret@127.0.0.1:1/", "ns", "id"],
        1,
    );
    assert!(
        err.contains("connect to redis://:***@127.0.0.1:1/"),
        "{err}"
    );
    assert!(!err.contains("s3cret"), "{err}");
}
