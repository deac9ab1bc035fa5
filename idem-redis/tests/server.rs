//! Behaviour that needs a server of its own (stopped, restarted, its functions flushed,
//! its commands counted) or the cluster's layout.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{
    HOUR, PrivateServer, calls, claim, cluster_config, connect, fresh_batch, raw, raw_cluster,
};
use idem_conformance::unique_namespace;
use idem_core::backend::{ClaimOutcome, Settlement};
use idem_core::{Backend, Error, FailureKind, Key, Lease, State};
use idem_redis::{RedisBackend, RedisConfig};
use redis::aio::ConnectionLike;

fn key(id: &str) -> Key {
    Key::new(unique_namespace(), id).expect("key")
}

async fn acquire(backend: &RedisBackend, key: &Key, owner: &str) -> Lease {
    match backend.claim(&claim(key, owner)).await.expect("claim") {
        ClaimOutcome::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// How many times the server ran `FCALL` so far.
async fn fcall_calls(conn: &mut impl ConnectionLike) -> u64 {
    calls(conn, &["fcall"]).await[0]
}

/// `FUNCTION FLUSH`: on every primary through a cluster connection.
async fn function_flush(conn: &mut impl ConnectionLike) {
    let _: () = redis::cmd("FUNCTION")
        .arg("FLUSH")
        .query_async(conn)
        .await
        .expect("function flush");
}

/// The names of the function libraries loaded on the server at `url`.
async fn libraries(url: &str) -> Vec<String> {
    let mut conn = raw(url).await;
    let list: Vec<redis::Value> = redis::cmd("FUNCTION")
        .arg("LIST")
        .query_async(&mut conn)
        .await
        .expect("function list");
    let mut names = Vec::new();
    for library in list {
        let fields: Vec<redis::Value> = redis::from_redis_value(library).expect("a library");
        for pair in fields.chunks(2) {
            match pair {
                [redis::Value::BulkString(field), value] if field == b"library_name" => {
                    names.push(redis::from_redis_value(value.clone()).expect("a name"));
                }
                _ => {}
            }
        }
    }
    names
}

/// A batch costs one pipeline of `SET NX`, then one function call for the keys that had a
/// record; settling it is one function call.
#[tokio::test]
async fn a_batch_is_one_function_call() {
    let (_server, backend, mut conn) = common::private().await;
    let batch = fresh_batch(128);
    backend.claim(&batch[0]).await.expect("claim");
    backend
        .claim(&batch[0])
        .await
        .expect("a claim of a held key loads the library");
    let before = fcall_calls(&mut conn).await;
    let answers = backend.claim_many(&batch).await.expect("claim_many");
    assert_eq!(fcall_calls(&mut conn).await - before, 1);
    assert!(matches!(&answers[0], ClaimOutcome::InProgress { owner, .. } if &**owner == "w"));
    let mut settle = Vec::new();
    for (c, answer) in batch.iter().zip(&answers).skip(1) {
        match answer {
            ClaimOutcome::Acquired(l) if l.key == c.key && l.token == 1 => {
                settle.push(Settlement::complete(l.clone(), Bytes::from_static(b"ok")));
            }
            other => panic!("{other:?}"),
        }
    }
    backend
        .complete(&settle[0].lease, Bytes::from_static(b"ok"), HOUR)
        .await
        .expect("a complete");
    let before = fcall_calls(&mut conn).await;
    let answers = backend
        .settle_many(&settle, HOUR)
        .await
        .expect("settle_many");
    assert_eq!(fcall_calls(&mut conn).await - before, 1);
    assert!(
        matches!(answers[0], Err(Error::Fenced { .. })),
        "{:?}",
        answers[0]
    );
    assert!(answers[1..].iter().all(Result::is_ok), "{answers:?}");
}

/// Every function call survives `FUNCTION FLUSH` before it: the call finds its function
/// missing (`ERR Function not found`), loads the library and calls again.
#[tokio::test]
async fn functions_reload_after_they_are_flushed() {
    let (server, backend, mut conn) = common::private().await;
    let (a, b, c) = (key("a"), key("b"), key("c"));
    let lease = acquire(&backend, &a, "w").await;
    let other = acquire(&backend, &b, "w").await;
    let third = acquire(&backend, &c, "w").await;
    let until = backend.extend(&lease, HOUR).await.expect("extend");
    assert!(until > lease.lease_until);
    assert_eq!(libraries(&server.url()).await, [backend.function_library()]);
    function_flush(&mut conn).await;
    assert!(libraries(&server.url()).await.is_empty());
    let until = backend.extend(&lease, HOUR).await.expect("extend");
    assert!(until > lease.lease_until);
    function_flush(&mut conn).await;
    backend
        .complete(&lease, Bytes::from_static(b"ok"), HOUR)
        .await
        .expect("complete");
    function_flush(&mut conn).await;
    backend
        .fail(&other, "no", FailureKind::Permanent, HOUR)
        .await
        .expect("fail");
    function_flush(&mut conn).await;
    let got = backend.get(&a).await.expect("get").expect("a record");
    assert_eq!(got.state, State::Completed);
    function_flush(&mut conn).await;
    let answers = backend
        .claim_many(&[claim(&a, "v"), claim(&b, "v"), claim(&c, "v")])
        .await
        .expect("claim_many");
    assert_eq!(
        answers[0],
        ClaimOutcome::Completed(Bytes::from_static(b"ok"))
    );
    assert!(matches!(&answers[1], ClaimOutcome::Poisoned { error, .. } if error == "no"));
    assert!(matches!(&answers[2], ClaimOutcome::InProgress { owner, .. } if &**owner == "w"));
    function_flush(&mut conn).await;
    backend.release(&third).await.expect("release");
    // Many calls at once after a flush: each loads the library (REPLACE) and succeeds.
    function_flush(&mut conn).await;
    let shared = &backend;
    let leases: Vec<Lease> = futures::future::join_all(
        (0..16).map(|i| async move { acquire(shared, &key(&format!("m{i}")), "w").await }),
    )
    .await;
    function_flush(&mut conn).await;
    let done = futures::future::join_all(
        leases
            .iter()
            .map(|l| backend.complete(l, Bytes::from_static(b"ok"), HOUR)),
    )
    .await;
    assert!(done.iter().all(Result::is_ok), "{done:?}");
    assert_eq!(libraries(&server.url()).await, [backend.function_library()]);
}

#[tokio::test]
async fn reconnects_after_the_server_restarts() {
    let mut server = PrivateServer::start().await;
    let limit = Duration::from_millis(300);
    let backend = connect(RedisConfig::new(server.url()).with_timeout(limit)).await;
    let k = key("restart");
    acquire(&backend, &k, "w").await;
    server.stop();
    for _ in 0..3 {
        let started = Instant::now();
        let res = backend.claim(&claim(&key("down"), "w")).await;
        assert!(matches!(res, Err(Error::Unavailable { .. })), "{res:?}");
        // Bounded by the timeout, not by the reconnect (10 s): the margin is for a loaded
        // machine's scheduling, not for the server.
        assert!(
            started.elapsed() < limit + Duration::from_secs(2),
            "a call to a stopped server took {:?}",
            started.elapsed()
        );
    }
    server.restart().await;
    // The manager reconnects in the background after a failure; a few calls may still
    // fail while it does.
    let deadline = Instant::now() + Duration::from_secs(10);
    let answer = loop {
        match backend.claim(&claim(&key("up"), "w")).await {
            Ok(answer) => break answer,
            Err(e) => {
                assert!(e.is_retryable(), "{e:?}");
                assert!(Instant::now() < deadline, "never reconnected: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    // The restarted server kept nothing (no persistence): the old key is new again, and
    // the function library is loaded again by the first call that needs it.
    let ClaimOutcome::Acquired(lease) = answer else {
        panic!("{answer:?}")
    };
    assert_eq!(backend.get(&k).await.expect("get"), None);
    backend
        .complete(&lease, Bytes::from_static(b"ok"), HOUR)
        .await
        .expect("complete");
}

#[tokio::test]
async fn cluster_keys_hash_on_the_idem_key() {
    let backend = connect(cluster_config()).await;
    let mut conn = raw_cluster().await;
    let k = Key::new("payments", "order-1042").expect("key");
    let record_key = backend.record_key(&k);
    assert_eq!(record_key, "idem:{8:payments:order-1042}");
    let slot = |name: String| {
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("KEYSLOT").arg(name);
        cmd
    };
    let of_key: i64 = slot(record_key)
        .query_async(&mut conn)
        .await
        .expect("keyslot");
    let of_tag: i64 = slot("8:payments:order-1042".into())
        .query_async(&mut conn)
        .await
        .expect("keyslot");
    assert_eq!(of_key, of_tag);
    let other_prefix = connect(cluster_config().with_prefix("other:")).await;
    let moved: i64 = slot(other_prefix.record_key(&k))
        .query_async(&mut conn)
        .await
        .expect("keyslot");
    assert_eq!(moved, of_key, "the prefix does not move a key's slot");
}

#[tokio::test]
async fn cluster_batches_span_slots_and_keep_order() {
    let backend = connect(cluster_config()).await;
    let ns = unique_namespace();
    let keys: Vec<Key> = (0..128)
        .map(|i| Key::new(ns.clone(), format!("k{i}")).expect("key"))
        .collect();
    let mut batch: Vec<_> = keys.iter().map(|k| claim(k, "w")).collect();
    batch.push(claim(&keys[5], "v")); // a repeat: sees the first claim of the batch
    let answers = backend.claim_many(&batch).await.expect("claim_many");
    for (k, answer) in keys.iter().zip(&answers) {
        assert!(
            matches!(answer, ClaimOutcome::Acquired(l) if &l.key == k && l.token == 1),
            "{answer:?}"
        );
    }
    assert!(matches!(&answers[128], ClaimOutcome::InProgress { owner, .. } if &**owner == "w"));
    for k in &keys {
        let rec = backend.get(k).await.expect("get").expect("record");
        assert_eq!(rec.state, State::Processing);
    }
}

/// After `FUNCTION FLUSH` on every primary, the first call that finds its function
/// missing loads the library on every primary, and calls on any slot work again. (Other
/// tests of this file share the cluster and may load it too, so only the end state is
/// checked here; `functions_reload_after_they_are_flushed` watches a private server.)
#[tokio::test]
async fn cluster_functions_reload_after_they_are_flushed() {
    let backend = connect(cluster_config()).await;
    let mut conn = raw_cluster().await;
    let primaries = primaries(&mut conn).await;
    assert!(primaries.len() >= 3, "{primaries:?}");
    let k = key("flush");
    let lease = acquire(&backend, &k, "w").await;
    function_flush(&mut conn).await; // every primary
    backend
        .complete(&lease, Bytes::from_static(b"ok"), HOUR)
        .await
        .expect("complete");
    for url in &primaries {
        let loaded = libraries(url).await;
        assert!(
            loaded.iter().any(|l| l == backend.function_library()),
            "{url}: {loaded:?}"
        );
    }
    // Keys of every primary's slots settle without another load.
    let ns = unique_namespace();
    let keys: Vec<Key> = (0..32)
        .map(|i| Key::new(ns.clone(), format!("k{i}")).expect("key"))
        .collect();
    let mut items = Vec::new();
    for k in &keys {
        let lease = acquire(&backend, k, "w").await;
        items.push(Settlement::complete(lease, Bytes::from_static(b"ok")));
    }
    let done = backend
        .settle_many(&items, HOUR)
        .await
        .expect("settle_many");
    assert!(done.iter().all(Result::is_ok), "{done:?}");
    function_flush(&mut conn).await;
    let replay = backend.claim(&claim(&k, "v")).await.expect("claim");
    assert_eq!(replay, ClaimOutcome::Completed(Bytes::from_static(b"ok")));
    let got = backend.get(&k).await.expect("get").expect("a record");
    assert_eq!(got.state, State::Completed);
}

/// The URLs of the cluster's primaries, from `CLUSTER NODES`.
async fn primaries(conn: &mut impl ConnectionLike) -> Vec<String> {
    let nodes: String = redis::cmd("CLUSTER")
        .arg("NODES")
        .query_async(conn)
        .await
        .expect("cluster nodes");
    nodes
        .lines()
        .filter(|l| l.split(' ').nth(2).is_some_and(|f| f.contains("master")))
        .filter_map(|l| l.split(' ').nth(1))
        .filter_map(|addr| addr.split('@').next())
        .map(|addr| format!("redis://{addr}/"))
        .collect()
}
