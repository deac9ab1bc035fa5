//! Failures: servers that refuse or never answer, values under our prefix that idem did
//! not write, oversized responses, and passwords kept out of `Debug` and errors.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{HOUR, claim, closed_port, connect, raw, standalone_config};
use conformance::{service_env, unique_namespace};
use idem_core::{
    Backend, ClaimKind, ClaimOutcome, Error, FailureKind, Key, Lease, ListFilter, Timestamp,
};
use idem_redis::{RedisBackend, RedisConfig};

const LIMIT: Duration = Duration::from_millis(300);
/// Scheduling slack on a shared two-core machine, on top of the configured timeout.
const SLACK: Duration = Duration::from_millis(400);

fn key(id: &str) -> Key {
    Key::new(unique_namespace(), id).expect("key")
}

fn forged(key: &Key) -> Lease {
    Lease {
        key: key.clone(),
        owner: "w".into(),
        token: 1,
        attempts: 1,
        lease_until: Timestamp::from_millis(0),
        kind: ClaimKind::First,
    }
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
async fn claim_against_a_closed_port_fails_within_the_timeout() {
    let url = format!("redis://127.0.0.1:{}/", closed_port());
    let backend =
        RedisBackend::connect_lazy(RedisConfig::new(url).with_timeout(LIMIT)).expect("lazy");
    for _ in 0..3 {
        let started = Instant::now();
        assert_unavailable(backend.claim(&claim(&key("k"), "w")).await, started);
    }
    let started = Instant::now();
    assert_unavailable(backend.get(&key("k")).await, started);
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

/// A server that accepts connections and never answers: every call times out.
#[tokio::test]
async fn a_silent_server_times_out() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let holder = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            open.push(socket); // read nothing, answer nothing
        }
    });
    let config = RedisConfig::new(format!("redis://127.0.0.1:{port}/")).with_timeout(LIMIT);
    let started = Instant::now();
    assert_unavailable(RedisBackend::connect(config.clone()).await, started);
    let backend = RedisBackend::connect_lazy(config).expect("lazy");
    let started = Instant::now();
    assert_unavailable(backend.claim(&claim(&key("k"), "w")).await, started);
    holder.abort();
}

fn assert_corrupt<T: std::fmt::Debug>(what: &str, res: Result<T, Error>) {
    assert!(
        matches!(res, Err(Error::Corrupt { .. })),
        "{what}: expected Corrupt, got {res:?}"
    );
}

/// Every operation on `key` answers `Corrupt`.
async fn all_corrupt(backend: &RedisBackend, key: &Key, what: &str) {
    let lease = forged(key);
    assert_corrupt(what, backend.claim(&claim(key, "w")).await);
    assert_corrupt(what, backend.get(key).await);
    let body = Bytes::from_static(b"x");
    assert_corrupt(what, backend.complete(&lease, body, HOUR).await);
    let fail = backend.fail(&lease, "e", FailureKind::Retry, HOUR).await;
    assert_corrupt(what, fail);
    assert_corrupt(what, backend.extend(&lease, HOUR).await);
    let filter = ListFilter {
        namespace: Some(key.namespace().to_owned()),
        ..ListFilter::default()
    };
    assert_corrupt(what, backend.list(&filter).await);
}

#[tokio::test]
async fn a_foreign_string_under_the_prefix_is_corrupt() {
    let backend = connect(standalone_config()).await;
    let mut conn = raw(&service_env("IDEM_REDIS_URL")).await;
    let k = key("foreign");
    let _: () = redis::cmd("SET")
        .arg(backend.record_key(&k))
        .arg("not a record")
        .query_async(&mut conn)
        .await
        .expect("set");
    all_corrupt(&backend, &k, "plain string").await;
    assert!(backend.delete(&k).await.expect("delete"));
    let lease = backend.claim(&claim(&k, "w")).await.expect("claim");
    assert!(matches!(lease, ClaimOutcome::Acquired(l) if l.token == 1));
}

/// A hash field and its value.
type Field = (&'static str, &'static [u8]);

#[tokio::test]
async fn garbage_hashes_are_corrupt() {
    let backend = connect(standalone_config()).await;
    let mut conn = raw(&service_env("IDEM_REDIS_URL")).await;
    let far: &'static str = "99999999999999";
    let cases: [(&str, Vec<Field>); 6] = [
        ("unknown fields", vec![("foo", b"bar")]),
        (
            "bad state",
            vec![
                ("s", b"x"),
                ("o", b"w"),
                ("t", b"1"),
                ("n", b"1"),
                ("x", far.as_bytes()),
            ],
        ),
        (
            "bad token",
            vec![
                ("s", b"p"),
                ("o", b"w"),
                ("t", b"0x1"),
                ("n", b"1"),
                ("x", far.as_bytes()),
            ],
        ),
        (
            "missing expiry",
            vec![("s", b"c"), ("o", b"w"), ("t", b"1"), ("n", b"1")],
        ),
        (
            "short fingerprint",
            vec![
                ("s", b"p"),
                ("o", b"w"),
                ("t", b"1"),
                ("n", b"1"),
                ("x", far.as_bytes()),
                ("f", b"abc"),
            ],
        ),
        (
            "huge number",
            vec![
                ("s", b"p"),
                ("o", b"w"),
                ("t", b"1"),
                ("n", b"1"),
                ("x", b"99999999999999999999"),
            ],
        ),
    ];
    for (what, fields) in cases {
        let k = key("garbage");
        let _: () = redis::cmd("HSET")
            .arg(backend.record_key(&k))
            .arg(fields)
            .query_async(&mut conn)
            .await
            .expect("hset");
        all_corrupt(&backend, &k, what).await;
    }
}

/// A corrupt record fails a whole batch before anything is written.
#[tokio::test]
async fn a_corrupt_record_in_a_batch_writes_nothing() {
    let backend = connect(standalone_config()).await;
    let mut conn = raw(&service_env("IDEM_REDIS_URL")).await;
    let (fresh, bad) = (key("fresh"), key("bad"));
    let _: () = redis::cmd("SET")
        .arg(backend.record_key(&bad))
        .arg("x")
        .query_async(&mut conn)
        .await
        .expect("set");
    let batch = [claim(&fresh, "w"), claim(&bad, "w")];
    assert_corrupt("batch", backend.claim_many(&batch).await);
    assert_eq!(backend.get(&fresh).await.expect("get"), None);
}

#[tokio::test]
async fn the_response_limit_is_configurable() {
    let backend = connect(standalone_config().with_max_response_bytes(16)).await;
    assert_eq!(backend.capabilities().max_response_bytes, 16);
    let k = key("limit");
    let ClaimOutcome::Acquired(lease) = backend.claim(&claim(&k, "w")).await.expect("claim") else {
        panic!("not acquired");
    };
    let res = backend
        .complete(&lease, Bytes::from(vec![0; 17]), HOUR)
        .await;
    assert!(
        matches!(
            res,
            Err(Error::TooLarge {
                size: 17,
                limit: 16,
                ..
            })
        ),
        "{res:?}"
    );
    backend
        .complete(&lease, Bytes::from(vec![7; 16]), HOUR)
        .await
        .expect("complete at the limit");
    let replay = backend.claim(&claim(&k, "v")).await.expect("claim");
    assert_eq!(replay, ClaimOutcome::Completed(Bytes::from(vec![7; 16])));
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
