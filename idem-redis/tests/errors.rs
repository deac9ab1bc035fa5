//! Failures particular to Redis: an eager connect to a closed port, a corrupt record in a
//! batch, values idem did not write in a listing and in the errors that name them,
//! passwords kept out of `Debug` and errors, bad configurations. The
//! failures every backend shares (closed port, silent server, corrupt record, oversized
//! response) are `idem_conformance::remote_suite!` cases, run from `tests/conformance.rs`.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{claim, closed_port, connect, own_prefix, raw, standalone_config};
use idem_conformance::{service_env, unique_namespace};
use idem_core::backend::ListFilter;
use idem_core::{Backend, ClaimKind, Error, Key, Lease, Timestamp};
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

/// The message of a `Corrupt` answer about the value at `at`: it names the key and says
/// what is there, without the function's internals (file, line, script name).
/// The error's sources count, as a CLI prints the chain.
fn clean_corrupt<T: std::fmt::Debug>(what: &str, at: &str, res: Result<T, Error>) -> String {
    let err = match res {
        Err(err @ Error::Corrupt { .. }) => err,
        other => panic!("{what}: expected Corrupt, got {other:?}"),
    };
    let Error::Corrupt { message, .. } = &err else {
        unreachable!()
    };
    assert!(message.contains(at), "{what}: {message}");
    let mut chain = err.to_string();
    let mut source = std::error::Error::source(&err);
    while let Some(s) = source {
        chain.push_str(&format!(": {s} ({s:?})"));
        source = s.source();
    }
    for internal in ["user_script", "user_function", ".lua", "@", "script:"] {
        assert!(!chain.contains(internal), "{what}: {chain}");
    }
    message.clone()
}

/// Under a prefix of its own: a hash and a string that is no record at record keys, and a
/// key idem never names, beside two records. The listing returns the records and skips
/// and counts the rest, naming each; `get`, a claim and a settle of each foreign value are
/// `Corrupt`, naming the key and what it holds.
#[tokio::test]
async fn a_listing_skips_and_counts_values_idem_did_not_write() {
    let (backend, mut conn) = own_prefix().await;
    let ns = unique_namespace();
    let k = |id: &str| Key::new(ns.clone(), id).expect("key");
    let lease = match backend.claim(&claim(&k("done"), "w")).await.expect("claim") {
        idem_core::backend::ClaimOutcome::Acquired(lease) => lease,
        other => panic!("{other:?}"),
    };
    backend
        .complete(&lease, Bytes::from_static(b"ok"), common::HOUR)
        .await
        .expect("complete");
    backend.claim(&claim(&k("held"), "w")).await.expect("claim");
    let (hash, text) = (k("a-hash"), k("a-string"));
    let (hash_at, text_at) = (backend.record_key(&hash), backend.record_key(&text));
    let stray = format!("{}{{not ours}}", backend.config().prefix());
    let mut pipe = redis::pipe();
    pipe.cmd("HSET").arg(&hash_at).arg("f").arg("v").ignore();
    pipe.cmd("SET").arg(&text_at).arg("not a record").ignore();
    pipe.cmd("SET").arg(&stray).arg("x").ignore();
    let () = pipe
        .query_async(&mut conn)
        .await
        .expect("plant foreign values");

    let listing = backend.list(&ListFilter::default()).await.expect("list");
    let mut ids: Vec<&str> = listing.records.iter().map(|r| r.key.id()).collect();
    ids.sort();
    assert_eq!(ids, ["done", "held"]);
    assert_eq!(listing.skipped_total, 3, "{:?}", listing.skipped);
    let mut skipped: Vec<(&str, &str)> = (listing.skipped.iter())
        .map(|s| (s.key.as_str(), s.reason.as_str()))
        .collect();
    skipped.sort();
    let mut expected = [
        (hash_at.as_str(), "holds a Redis hash"),
        (text_at.as_str(), "not an idem record"),
        (stray.as_str(), "not a key idem names"),
    ];
    expected.sort();
    assert_eq!(skipped, expected);
    let one = ListFilter {
        limit: 1,
        ..ListFilter::default()
    };
    assert_eq!(backend.list(&one).await.expect("list").records.len(), 1);
    let in_ns = ListFilter {
        namespace: Some(ns.clone()),
        ..ListFilter::default()
    };
    let listing = backend.list(&in_ns).await.expect("list");
    assert_eq!((listing.records.len(), listing.skipped_total), (2, 2));

    for (key, at, holds) in [
        (&hash, &hash_at, "holds a Redis hash, not an idem record"),
        (&text, &text_at, "not an idem record"),
    ] {
        let message = clean_corrupt("get", at, backend.get(key).await);
        assert!(message.ends_with(holds), "{message}");
        clean_corrupt("claim", at, backend.claim(&claim(key, "w")).await);
        let batch = [claim(&k("fresh"), "w"), claim(key, "w")];
        clean_corrupt("claim_many", at, backend.claim_many(&batch).await);
    }
    let lease = Lease {
        key: text.clone(),
        owner: "w".into(),
        token: 1,
        attempts: 1,
        lease_until: Timestamp::from_millis(u64::MAX / 2),
        kind: ClaimKind::First,
        fingerprint: None,
    };
    let res = backend.extend(&lease, common::HOUR).await;
    clean_corrupt("extend", &text_at, res);
    let _: () = redis::cmd("DEL")
        .arg(&hash_at)
        .arg(&text_at)
        .arg(&stray)
        .query_async(&mut conn)
        .await
        .expect("clean up");
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
