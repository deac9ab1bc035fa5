//! Operator commands against a real Redis (IDEM_REDIS_URL), under a key prefix of their own.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{fails, idem, ok, operator_scenario, text};
use idem_core::{Backend, Key};
use idem_redis::{RedisBackend, RedisConfig};

/// `IDEM_REDIS_URL` with a key prefix of this call's own, and a backend under that prefix.
async fn own_prefix() -> (String, RedisBackend) {
    let base = idem_conformance::service_env("IDEM_REDIS_URL");
    let prefix = format!("idemcli:{}:{}:", std::process::id(), fastrand::u32(..));
    let sep = if base.contains('?') { '&' } else { '?' };
    let url = format!("{base}{sep}prefix={prefix}");
    let config = RedisConfig::from_urls(&base).with_prefix(prefix);
    let backend = RedisBackend::connect(config)
        .await
        .expect("connect to IDEM_REDIS_URL");
    (url, backend)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_on_redis() {
    let (url, backend) = own_prefix().await;
    let out = ok(&["migrate", "-b", &url, "--yes"]);
    assert!(out.contains("redis: nothing to migrate"), "{out}");
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

/// `idem list` over a prefix that holds, beside a record, a hash and a string idem did not
/// write: it exits 0, lists the record, and says after the table what it skipped (on
/// stderr with `--json`, whose output stays the records).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_skips_what_is_not_an_idem_record() {
    let (url, backend) = own_prefix().await;
    let key = |id: &str| Key::new("orders", id).expect("key");
    let claim = idem_conformance::claim_of(&key("real"), "worker-1", Duration::from_secs(60));
    idem_conformance::acquire(&backend, &claim).await;
    let (hash, text_at) = (
        backend.record_key(&key("a-hash")),
        backend.record_key(&key("a-string")),
    );
    let base = idem_conformance::service_env("IDEM_REDIS_URL");
    let mut conn = redis::Client::open(base.as_str())
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("raw connection");
    let mut pipe = redis::pipe();
    pipe.cmd("HSET").arg(&hash).arg("f").arg("v").ignore();
    pipe.cmd("SET").arg(&text_at).arg("not a record").ignore();
    let () = pipe
        .query_async(&mut conn)
        .await
        .expect("plant foreign values");

    let out = ok(&["list", "-b", &url]);
    assert!(out.contains("real") && out.contains("1 record(s)"), "{out}");
    let line = out.lines().last().expect("a line");
    let first_hash = format!("(first: {hash:?}: holds a Redis hash)");
    let first_text = format!("(first: {text_at:?}: not an idem record)");
    assert!(
        line.starts_with(
            "skipped 2 entries under the key prefix that are not idem records (first: "
        ) && (line.ends_with(&first_hash) || line.ends_with(&first_text)),
        "{out}"
    );

    let json = idem(&["list", "-b", &url, "--json"]);
    let (stdout, stderr) = text(&json);
    assert!(json.status.success(), "{stdout}\n{stderr}");
    let records: serde_json::Value = serde_json::from_str(&stdout).expect("JSON");
    assert_eq!(records.as_array().map(Vec::len), Some(1), "{stdout}");
    let said = "idem: skipped 2 entries under the key prefix that are not idem records (first: ";
    assert!(stderr.contains(said), "{stderr}");
    // `--limit` counts records: the one record, and nothing cut.
    let limited = ok(&["list", "-b", &url, "--limit", "1"]);
    assert!(limited.contains("1 record(s)\n"), "{limited}");
    assert!(backend.delete(&key("real")).await.expect("delete"));
    let removed: i64 = redis::cmd("DEL")
        .arg(&hash)
        .arg(&text_at)
        .query_async(&mut conn)
        .await
        .expect("clean up");
    assert_eq!(removed, 2);
}
