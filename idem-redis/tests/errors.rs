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

#[tokio::test]
async fn malformed_records_are_corrupt() {
    let backend = connect(standalone_config()).await;
    let far = "99999999999999";
    let cases: [(&str, String); 7] = [
        ("no header", "hello".into()),
        ("bad state", format!("z1,1,,{far},0,1,0,,;w")),
        ("bad token", format!("p0x1,1,,{far},0,1,0,,;w")),
        ("missing expiry", "c1,1,,,0,1,0,0,;w".into()),
        ("short fingerprint", format!("p1,1,,{far},0,1,3,,;wabc")),
        ("lengths disagree", format!("c1,1,,{far},0,1,0,9,;wok")),
        ("huge number", "p1,1,,99999999999999999999,0,1,0,,;w".into()),
    ];
    for (i, (what, value)) in cases.into_iter().enumerate() {
        let k = key("malformed");
        plant(&backend, &k, "SET", &[value.as_bytes()]).await;
        all_corrupt(&backend, &k, what).await;
        if i == 0 {
            list_corrupt(&backend, &k, what).await;
        }
    }
    let k = key("hash");
    plant(&backend, &k, "HSET", &[b"s", b"c", b"o", b"w"]).await;
    all_corrupt(&backend, &k, "a hash").await;
    list_corrupt(&backend, &k, "a hash").await;
    assert!(backend.delete(&k).await.expect("delete"));
    let again = backend.claim(&claim(&k, "w")).await.expect("claim");
    assert!(matches!(again, ClaimOutcome::Acquired(l) if l.token == 1));
}

/// A corrupt record fails a whole batch before anything is written, whether it is a string
/// that does not decode or a value of another type (which `MGET` reads as nil).
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
