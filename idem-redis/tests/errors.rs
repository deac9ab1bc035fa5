//! Failures particular to Redis: an eager connect to a closed port, a corrupt record in a
//! batch or a listing, passwords kept out of `Debug` and errors, bad configurations. The
//! failures every backend shares (closed port, silent server, corrupt record, oversized
//! response) are `idem_conformance::remote_suite!` cases, run from `tests/conformance.rs`.

mod common;

use std::time::{Duration, Instant};

use common::{claim, closed_port, connect, raw, standalone_config};
use idem_conformance::{service_env, unique_namespace};
use idem_core::backend::ListFilter;
use idem_core::{Backend, Error, Key};
use idem_redis::{RedisBackend, RedisConfig};

const LIMIT: Duration = Duration::from_millis(300);
/// Scheduling slack on a shared two-core machine, on top of the configured timeout.
const SLACK: Duration = Duration::from_millis(400);

fn key(id: &str) -> Key {
    Key::new(unique_namespace(), id).expect("key")
}

fn assert_unavailable<T: std::fmt::Debug>(res: Result<T, Error>, started: Instant) {
    let took = started.elapsed();
    assert!(matches!(res, Err(Error::Unavailable { .. })), "{res:?}");
    assert!(
        took <= LIMIT + SLACK,
        "failed after {took:?}, limit {LIMIT:?}"
    );
}

#[tokio::test]
async fn connect_to_a_closed_port_fails_within_the_timeout() {
    let url = format!("redis://127.0.0.1:{}/", closed_port());
    let started = Instant::now();
    let res = RedisBackend::connect(RedisConfig::new(url).with_timeout(LIMIT)).await;
    assert_unavailable(res, started);
    let cluster = RedisConfig::cluster([format!("redis://127.0.0.1:{}/", closed_port())]);
    let started = Instant::now();
    assert_unavailable(
        RedisBackend::connect(cluster.with_timeout(LIMIT)).await,
        started,
    );
}

fn assert_corrupt<T: std::fmt::Debug>(what: &str, res: Result<T, Error>) {
    assert!(
        matches!(res, Err(Error::Corrupt { .. })),
        "{what}: expected Corrupt, got {res:?}"
    );
}

/// `list` over `key`'s namespace answers `Corrupt` (it walks the whole keyspace: keep to a
/// few calls).
async fn list_corrupt(backend: &RedisBackend, key: &Key, what: &str) {
    let filter = ListFilter {
        namespace: Some(key.namespace().to_owned()),
        ..ListFilter::default()
    };
    assert_corrupt(what, backend.list(&filter).await);
}

/// Writes `value` (the command's arguments after the key) at `key`'s record with `command`.
async fn plant(backend: &RedisBackend, key: &Key, command: &str, value: &[&[u8]]) {
    let mut conn = raw(&service_env("IDEM_REDIS_URL")).await;
    let _: () = redis::cmd(command)
        .arg(backend.record_key(key))
        .arg(value)
        .query_async(&mut conn)
        .await
        .expect("plant a foreign value");
}

/// A listing that meets a record it cannot decode, a string or a hash, is `Corrupt`.
#[tokio::test]
async fn a_listing_over_a_corrupt_record_is_corrupt() {
    let backend = connect(standalone_config()).await;
    let cases: [(&str, &[&[u8]]); 2] = [("SET", &[b"hello"]), ("HSET", &[b"s", b"c"])];
    for (command, value) in cases {
        let k = key("listed");
        plant(&backend, &k, command, value).await;
        list_corrupt(&backend, &k, command).await;
    }
}

/// A corrupt record fails the whole batch, whether it is a string that does not decode or
/// a value of another type, and the claim script writes nothing: the repeated key, which
/// only the script claims, stays unclaimed. (A fresh key claimed by `SET NX` in the same
/// pipeline would be claimed, as after a timed-out call: see the README.)
#[tokio::test]
async fn a_corrupt_record_in_a_batch_writes_nothing() {
    let backend = connect(standalone_config()).await;
    let cases: [(&str, &[&[u8]]); 2] = [("SET", &[b"not a record"]), ("HSET", &[b"f", b"v"])];
    for (command, value) in cases {
        let (fresh, bad) = (key("fresh"), key("bad"));
        plant(&backend, &bad, command, value).await;
        let batch = [claim(&fresh, "w"), claim(&bad, "w"), claim(&fresh, "v")];
        assert_corrupt(command, backend.claim_many(&batch).await);
        assert_eq!(backend.get(&fresh).await.expect("get"), None, "{command}");
        assert_corrupt(command, backend.get(&bad).await);
    }
}

#[tokio::test]
async fn passwords_stay_out_of_debug_and_errors() {
    let url = format!("redis://user:s3cret@127.0.0.1:{}/", closed_port());
    let backend =
        RedisBackend::connect_lazy(RedisConfig::new(&url).with_timeout(LIMIT)).expect("lazy");
    let shown = format!("{backend:?}");
    assert!(
        !shown.contains("s3cret") && shown.contains("***"),
        "{shown}"
    );
    let err = backend
        .claim(&claim(&key("k"), "w"))
        .await
        .expect_err("closed port");
    let mut chain = format!("{err} / {err:?}");
    let mut source = std::error::Error::source(&err);
    while let Some(s) = source {
        chain.push_str(&format!(" / {s} / {s:?}"));
        source = s.source();
    }
    assert!(!chain.contains("s3cret"), "{chain}");
    let bad = RedisBackend::connect(RedisConfig::new("nonsense://user:s3cret@x/")).await;
    let Err(err) = bad else {
        panic!("a bad scheme connected")
    };
    assert!(matches!(err, Error::Config { .. }), "{err:?}");
    assert!(!format!("{err} {err:?}").contains("s3cret"), "{err:?}");
}

#[tokio::test]
async fn a_bad_configuration_is_refused_before_connecting() {
    let res = RedisBackend::connect(standalone_config().with_prefix("a{b}")).await;
    assert!(matches!(res, Err(Error::Config { .. })), "{res:?}");
    let res = RedisBackend::connect(standalone_config().with_timeout(Duration::ZERO)).await;
    assert!(matches!(res, Err(Error::Config { .. })), "{res:?}");
}

/// A timeout of `Duration::MAX` (for "never") is a century, not an overflow: the backend
/// connects and claims.
#[tokio::test]
async fn a_timeout_of_duration_max_connects_and_claims() {
    let config = standalone_config().with_timeout(Duration::MAX);
    assert_eq!(config.timeout(), idem_core::clock::capped(Duration::MAX));
    let b = connect(config).await;
    let k = key("forever");
    let res = b.claim(&claim(&k, "a")).await.expect("claim");
    assert!(
        matches!(res, idem_core::backend::ClaimOutcome::Acquired(_)),
        "{res:?}"
    );
}
