//! The compare-and-set design of a fenced complete (issue 18), for measuring only: the
//! backend completes with its settle function, since Redis 7.0 has no compare-and-set.
//! Valkey 8.1 and Redis 8.4 have one, `SET key value IFEQ expected`. A fresh claim writes
//! a record the client built, so the client knows its bytes exactly, and the complete
//! becomes `SET key <completed record> IFEQ <processing record> KEEPTTL`: it lands only
//! while the key holds that very record (state `Processing`, this token and owner), so no
//! script runs at all. A nil answer (fenced, or a record this shortcut cannot predict)
//! would go to the settle function for the exact answer.

use redis::aio::ConnectionLike;

use super::watch_multi;

/// Whether the server knows `SET … IFEQ`: Redis 7.x answers a syntax error.
pub async fn supported(conn: &mut impl ConnectionLike) -> bool {
    let probe = "idem-bench-ifeq-probe";
    let set: redis::RedisResult<Option<String>> = redis::cmd("SET")
        .arg(probe)
        .arg("b")
        .arg("IFEQ")
        .arg("a")
        .query_async(conn)
        .await;
    set.is_ok()
}

/// A complete of the lease whose record is `held` (the fresh claim's bytes): the completed
/// record if the key still holds `held`, then (if `publish`) the settled key announced as
/// the settle function does, in one round trip. True if the record landed.
pub async fn complete(
    conn: &mut impl ConnectionLike,
    key: &str,
    held: &[u8],
    response: &[u8],
    publish: bool,
) -> bool {
    let record = watch_multi::completed(held, &watch_multi::fence(1), response)
        .expect("the held record carries its own fence");
    let mut pipe = redis::pipe();
    pipe.cmd("SET")
        .arg(key)
        .arg(record)
        .arg("IFEQ")
        .arg(held)
        .arg("KEEPTTL");
    if publish {
        pipe.cmd("PUBLISH")
            .arg(watch_multi::CHANNEL)
            .arg(key)
            .ignore();
    }
    let (set,): (Option<String>,) = pipe.query_async(conn).await.expect("SET IFEQ");
    set.is_some()
}

/// The contract, checked once before measuring: after a takeover (token 2) the first
/// holder's complete does not land and the key keeps the new holder's record; the new
/// holder's own complete lands.
pub async fn fences(conn: &mut impl ConnectionLike, key: &str) {
    let held = watch_multi::claim_record(conn, key, true).await;
    let mut taken = b"P2".to_vec();
    taken.extend_from_slice(&held[2..]);
    let _: () = redis::cmd("SET")
        .arg(key)
        .arg(&taken)
        .arg("KEEPTTL")
        .query_async(conn)
        .await
        .expect("takeover");
    assert!(
        !complete(conn, key, &held, b"stale", true).await,
        "a stale complete landed"
    );
    let now: Vec<u8> = redis::cmd("GET")
        .arg(key)
        .query_async(conn)
        .await
        .expect("GET");
    assert_eq!(now, taken, "the record changed under a refused complete");
    let done = watch_multi::completed(&taken, &watch_multi::fence(2), b"ok").expect("held");
    let (set,): (Option<String>,) = redis::pipe()
        .cmd("SET")
        .arg(key)
        .arg(&done)
        .arg("IFEQ")
        .arg(&taken)
        .arg("KEEPTTL")
        .query_async(conn)
        .await
        .expect("SET IFEQ");
    assert!(set.is_some(), "the holder's complete was refused");
}
