//! The wire protocol: a fresh key is claimed with a plain `SET NX` and no script, a
//! complete is one `FCALL` of the idem library (no `EVALSHA`) on Redis 7, where the first
//! complete's `SET … IFEQ` is refused once, and one `SET … IFEQ` on Valkey 8.1, the
//! deadline of a fast-path lease lives in the server's expiry (so the server's clock decides
//! its lapse), and a value in an earlier layout is not read as a record.

mod common;

use bytes::Bytes;
use common::{HOUR, calls, claim, connect, fresh_batch, raw, standalone_config};
use idem_conformance::{service_env, unique_namespace};
use std::time::Duration;

use idem_core::backend::{ClaimOutcome, Settlement};
use idem_core::{Backend, ClaimKind, Error, FailureKind, Key, Lease, State, Timestamp};
use idem_redis::RedisBackend;
use redis::aio::ConnectionLike;

fn key(id: &str) -> Key {
    Key::new(unique_namespace(), id).expect("key")
}

/// What `op` answered, and the calls it sent of each command in `counted`
/// (commandstats before and after; a function's nested calls count too).
async fn sent<T>(
    conn: &mut impl ConnectionLike,
    counted: &[&str],
    op: impl std::future::Future<Output = T>,
) -> (T, Vec<u64>) {
    let before = calls(conn, counted).await;
    let answer = op.await;
    let after = calls(conn, counted).await;
    (
        answer,
        after.iter().zip(&before).map(|(a, b)| a - b).collect(),
    )
}

fn acquired(answer: ClaimOutcome) -> Lease {
    match answer {
        ClaimOutcome::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Counted on a server of this test's own, so no other test's commands mix in.
#[tokio::test]
async fn fresh_keys_and_replays_need_no_script() {
    let (_server, backend, mut conn) = common::private().await;
    let batch = fresh_batch(128);
    let counted = [
        "evalsha",
        "eval",
        "set",
        "fcall",
        "function|load",
        "time",
        "pexpiretime",
    ];
    let before = calls(&mut conn, &counted).await;
    let lease = acquired(
        backend
            .claim(&claim(&key("one"), "w"))
            .await
            .expect("claim"),
    );
    assert_eq!((lease.token, lease.kind), (1, ClaimKind::First));
    let answers = backend.claim_many(&batch).await.expect("claim_many");
    assert!(
        answers
            .iter()
            .all(|a| matches!(a, ClaimOutcome::Acquired(_)))
    );
    let after = calls(&mut conn, &counted).await;
    assert_eq!(after[0] - before[0], 0, "EVALSHA calls");
    assert_eq!(after[1] - before[1], 0, "EVAL calls");
    assert_eq!(after[2] - before[2], 129, "SET calls");
    assert_eq!(after[3] - before[3], 0, "FCALL calls");
    assert_eq!(after[5] - before[5], 1, "TIME calls: one for the batch");
    assert_eq!(
        after[6] - before[6],
        1,
        "PEXPIRETIME calls: one for the single key"
    );

    // The server has no idem library yet: the first complete finds its function missing,
    // loads the library and calls again.
    let done = backend.complete(&lease, Bytes::from_static(b"ok"), HOUR);
    let (done, n) = sent(&mut conn, &counted, done).await;
    done.expect("complete");
    assert_eq!(n[3], 2, "FCALL calls, the first refused");
    assert_eq!(n[4], 1, "FUNCTION LOAD calls");
    // From then on a complete is one FCALL, and no script.
    let ClaimOutcome::Acquired(other) = &answers[0] else {
        panic!("{:?}", answers[0])
    };
    let done = backend.complete(other, Bytes::from_static(b"ok"), HOUR);
    let (done, n) = sent(&mut conn, &counted, done).await;
    done.expect("complete");
    // (The SET is the function's own write: commandstats counts calls made inside it too.
    // The first complete's `SET … IFEQ` was refused, so this one sends the function only.)
    assert_eq!(n, [0, 0, 1, 1, 0, 0, 0], "{counted:?} of a complete");

    let before = calls(&mut conn, &counted).await;
    let replay = backend.claim(&claim(&lease.key, "v")).await.expect("claim");
    assert_eq!(replay, ClaimOutcome::Completed(Bytes::from_static(b"ok")));
    let after = calls(&mut conn, &counted).await;
    assert_eq!(after[0] - before[0], 0, "a replay runs no script");
    assert_eq!(after[3] - before[3], 0, "a replay calls no function");
}

/// A batch settle reads its records in one `MGET` and announces its keys in one
/// `PUBLISH`; a waiter on each settled key wakes, and a waiter on a key left alone does
/// not.
#[tokio::test]
async fn a_batch_settle_is_one_read_and_one_announcement_that_wakes_each_key() {
    let (_server, backend, mut conn) = common::private().await;
    let batch = fresh_batch(4);
    let mut leases: Vec<Lease> = backend
        .claim_many(&batch)
        .await
        .expect("claim_many")
        .into_iter()
        .map(acquired)
        .collect();
    // The backend's first complete asks for `SET … IFEQ`, which Redis 7 refuses once.
    let probe = leases.pop().expect("four leases");
    backend
        .complete(&probe, Bytes::from_static(b"ok"), HOUR)
        .await
        .expect("complete");
    let mut watches = Vec::new();
    for lease in &leases {
        watches.push(backend.watch(&lease.key).await);
    }
    let counted = ["mget", "publish", "get"];
    let before = calls(&mut conn, &counted).await;
    let settled: Vec<Settlement> = leases[..2]
        .iter()
        .map(|lease| Settlement::complete(lease.clone(), Bytes::from_static(b"ok")))
        .collect();
    let answers = backend.settle_many(&settled, HOUR).await.expect("settle");
    assert!(answers.iter().all(Result::is_ok), "{answers:?}");
    let after = calls(&mut conn, &counted).await;
    assert_eq!(after[0] - before[0], 1, "MGET calls");
    assert_eq!(after[1] - before[1], 1, "PUBLISH calls");
    assert_eq!(after[2] - before[2], 0, "GET calls");
    let [first, second, left] = &mut watches[..] else {
        unreachable!("three watches");
    };
    assert!(first.changed(Duration::from_secs(10)).await, "first key");
    assert!(second.changed(Duration::from_secs(10)).await, "second key");
    assert!(
        !left.changed(Duration::from_millis(300)).await,
        "a key nobody settled woke"
    );
}

async fn server_now(conn: &mut impl ConnectionLike) -> u64 {
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(conn).await.expect("TIME");
    secs * 1000 + micros / 1000
}

/// A lease granted by `SET NX` ends where the key's server-side expiry says, less the
/// retention: moving that expiry on the server moves the lease, whatever the client holds.
/// The holder is told a deadline by the server's clock (a single key's `PEXPIRETIME` after
/// its `SET`, a batch's `TIME` ahead of its `SET`s), never later than the expiry's.
#[tokio::test]
async fn the_server_clock_decides_lapse_on_the_fast_path() {
    let backend = connect(standalone_config()).await;
    let mut conn = raw(&service_env("IDEM_REDIS_URL")).await;
    let retention = HOUR.as_millis() as u64;
    let before = server_now(&mut conn).await;
    let batch = fresh_batch(3);
    let leases = backend.claim_many(&batch).await.expect("claim_many");
    let k = key("lapse");
    let record = backend.record_key(&k);
    let lease = acquired(backend.claim(&claim(&k, "a")).await.expect("claim"));
    let told = leases.into_iter().map(acquired).chain([lease.clone()]);
    for (held, claimed) in told.zip(batch.iter().map(|c| &c.key).chain([&k])) {
        let expire = pexpiretime(&mut conn, &backend.record_key(claimed)).await;
        let deadline = Timestamp::from_millis(expire + 1 - retention);
        assert!(
            held.lease_until <= deadline && held.lease_until.as_millis() >= before + 10_000,
            "{claimed} told {:?}; the server's clock was {before} before the claim, the \
             expiry says {deadline:?}",
            held.lease_until
        );
    }
    let expire = pexpiretime(&mut conn, &record).await;
    let deadline = Timestamp::from_millis(expire + 1 - retention);
    let stored = backend.get(&k).await.expect("get").expect("record");
    assert_eq!(stored.lease_until, Some(deadline));
    assert_eq!(stored.expires_at, Some(Timestamp::from_millis(expire + 1)));
    let answer = backend.claim(&claim(&k, "b")).await.expect("claim");
    assert!(
        matches!(&answer, ClaimOutcome::InProgress { owner, lease_until } if &**owner == "a" && *lease_until == deadline),
        "{answer:?}"
    );
    // The client still thinks the lease has 10 s to run; the server ends it now.
    let now = server_now(&mut conn).await;
    let _: () = redis::cmd("PEXPIREAT")
        .arg(&record)
        .arg(now + retention - 1)
        .query_async(&mut conn)
        .await
        .expect("PEXPIREAT");
    assert!(lease.lease_until > Timestamp::now());
    let taken = acquired(backend.claim(&claim(&k, "b")).await.expect("claim"));
    assert_eq!((taken.token, taken.kind), (2, ClaimKind::Takeover));
    let res = backend
        .complete(&lease, Bytes::from_static(b"late"), HOUR)
        .await;
    assert!(matches!(res, Err(Error::Fenced { .. })), "{res:?}");
}

async fn pexpiretime(conn: &mut impl ConnectionLike, record: &str) -> u64 {
    redis::cmd("PEXPIRETIME")
        .arg(record)
        .query_async(conn)
        .await
        .expect("PEXPIRETIME")
}

/// On a server with compare-and-set (Valkey 8.1), a single complete is one `SET … IFEQ`
/// and one `PUBLISH`: no function runs, a waiter on the key wakes, and the record is the
/// one the function would have written.
#[tokio::test]
async fn a_complete_on_a_server_with_compare_and_set_runs_no_function() {
    let (_server, backend, mut conn) = common::private_valkey().await;
    let counted = ["fcall", "set", "publish", "function|load"];
    let k = key("cas");
    let lease = acquired(backend.claim(&claim(&k, "w")).await.expect("claim"));
    let mut watch = backend.watch(&k).await;
    let done = backend.complete(&lease, Bytes::from_static(b"ok"), HOUR);
    let (done, n) = sent(&mut conn, &counted, done).await;
    done.expect("complete");
    assert_eq!(n, [0, 1, 1, 0], "{counted:?} of a complete");
    assert!(
        watch.changed(Duration::from_secs(10)).await,
        "the waiter did not wake"
    );
    let replay = backend.claim(&claim(&k, "v")).await.expect("claim");
    assert_eq!(replay, ClaimOutcome::Completed(Bytes::from_static(b"ok")));
    let rec = backend.get(&k).await.expect("get").expect("record");
    assert_eq!(
        (rec.state, rec.token, rec.attempts, &*rec.owner),
        (State::Completed, 1, 1, "w")
    );
    assert_eq!(rec.fingerprint, claim(&k, "w").fingerprint);
}

/// On a server with compare-and-set, a batch's completes of keys met once go out as one
/// pipeline of `SET … IFEQ` and one `PUBLISH`; the rest (a fail, a key met twice) go to
/// one function call, which answers them in order.
#[tokio::test]
async fn a_batch_on_a_server_with_compare_and_set_sends_only_the_rest_to_the_function() {
    let (_server, backend, mut conn) = common::private_valkey().await;
    let leases: Vec<Lease> = backend
        .claim_many(&fresh_batch(4))
        .await
        .expect("claim_many")
        .into_iter()
        .map(acquired)
        .collect();
    let ok = || Bytes::from_static(b"ok");
    let items = vec![
        Settlement::complete(leases[0].clone(), ok()),
        Settlement::complete(leases[1].clone(), ok()),
        Settlement::fail(leases[2].clone(), "declined", FailureKind::Permanent),
        Settlement::complete(leases[3].clone(), ok()),
        Settlement::complete(leases[3].clone(), ok()),
    ];
    let counted = ["fcall", "publish", "mget"];
    let (answers, n) = sent(&mut conn, &counted, backend.settle_many(&items, HOUR)).await;
    let answers = answers.expect("settle_many");
    assert!(answers[..4].iter().all(Result::is_ok), "{answers:?}");
    assert!(
        matches!(answers[4], Err(Error::Fenced { .. })),
        "the key's second complete: {:?}",
        answers[4]
    );
    // The function's first call on a new server is refused, loads the library, and runs.
    assert_eq!(n, [2, 2, 1], "{counted:?} of the batch");
    for (lease, state) in [
        (&leases[0], State::Completed),
        (&leases[1], State::Completed),
        (&leases[2], State::Failed),
        (&leases[3], State::Completed),
    ] {
        let rec = backend.get(&lease.key).await.expect("get").expect("record");
        assert_eq!(rec.state, state, "{}", lease.key);
    }
}

/// A complete whose lease was taken over finds another record: its `SET … IFEQ` does not
/// land, the settle function answers `Fenced`, and the new holder's record stays. The new
/// holder's complete (its record written by the claim function) lands by compare-and-set.
#[tokio::test]
async fn a_stale_complete_by_compare_and_set_is_fenced_by_the_function() {
    let (_server, backend, mut conn) = common::private_valkey().await;
    let k = key("stale");
    let mut first = claim(&k, "a");
    first.lease_ttl = Duration::from_millis(100);
    let old = acquired(backend.claim(&first).await.expect("claim"));
    // The lease lapses by the server's clock; nothing signals it.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let new = acquired(backend.claim(&claim(&k, "b")).await.expect("takeover"));
    assert_eq!((new.token, new.kind), (2, ClaimKind::Takeover));

    let counted = ["fcall"];
    let stale = backend.complete(&old, Bytes::from_static(b"stale"), HOUR);
    let (res, n) = sent(&mut conn, &counted, stale).await;
    assert!(matches!(res, Err(Error::Fenced { .. })), "{res:?}");
    assert_eq!(n, [1], "FCALL calls: the function decides");
    let rec = backend.get(&k).await.expect("get").expect("record");
    assert_eq!(
        (rec.state, rec.token, &*rec.owner),
        (State::Processing, 2, "b")
    );

    let before = calls(&mut conn, &counted).await;
    backend
        .complete(&new, Bytes::from_static(b"ok"), HOUR)
        .await
        .expect("complete");
    let after = calls(&mut conn, &counted).await;
    assert_eq!(
        after[0] - before[0],
        0,
        "FCALL calls of the takeover's complete"
    );
    let rec = backend.get(&k).await.expect("get").expect("record");
    assert_eq!(
        (rec.state, rec.token, rec.response.as_deref()),
        (State::Completed, 2, Some(&b"ok"[..]))
    );
}

/// A complete under a lease with time left, settled with the claim's retention, keeps the
/// key's expiry (the lease's end plus that retention, later than now plus retention), as
/// PostgreSQL keeps `expires_at`. With another retention, or under a lease the client sees
/// about to lapse, the record expires at the server's now plus the settle's retention.
/// The same on Valkey, where the complete is a compare-and-set.
#[tokio::test]
async fn a_complete_keeps_the_expiry_of_a_live_lease_settled_with_its_retention() {
    let backend = connect(standalone_config()).await;
    let conn = raw(&service_env("IDEM_REDIS_URL")).await;
    keeps_expiry(backend, conn).await;
    let (_server, backend, conn) = common::private_valkey().await;
    keeps_expiry(backend, conn).await;
}

async fn keeps_expiry(backend: RedisBackend, mut conn: impl ConnectionLike) {
    let retention = HOUR.as_millis() as u64;

    // Live lease (10 s), same retention: the expiry does not move.
    let kept = key("keep");
    let lease = acquired(backend.claim(&claim(&kept, "a")).await.expect("claim"));
    let claimed = pexpiretime(&mut conn, &backend.record_key(&kept)).await;
    backend
        .complete(&lease, Bytes::from_static(b"kept"), HOUR)
        .await
        .expect("complete");
    assert_eq!(
        pexpiretime(&mut conn, &backend.record_key(&kept)).await,
        claimed
    );
    let rec = backend.get(&kept).await.expect("get").expect("record");
    assert_eq!(
        (rec.state, rec.response.as_deref()),
        (State::Completed, Some(&b"kept"[..]))
    );

    // Live lease, another retention: now plus that retention.
    let other = key("other");
    let lease = acquired(backend.claim(&claim(&other, "a")).await.expect("claim"));
    let before = server_now(&mut conn).await;
    backend
        .complete(&lease, Bytes::from_static(b"other"), HOUR / 2)
        .await
        .expect("complete");
    let after = server_now(&mut conn).await;
    let expire = pexpiretime(&mut conn, &backend.record_key(&other)).await + 1;
    assert!(
        (before + retention / 2..=after + retention / 2).contains(&expire),
        "expires at {expire}, settled between {before} and {after}"
    );

    // A lease the client sees lapse within the margin (300 ms): now plus retention.
    let short = key("short");
    let mut c = claim(&short, "a");
    c.lease_ttl = Duration::from_millis(300);
    let lease = acquired(backend.claim(&c).await.expect("claim"));
    let claimed = pexpiretime(&mut conn, &backend.record_key(&short)).await;
    let before = server_now(&mut conn).await;
    backend
        .complete(&lease, Bytes::from_static(b"short"), HOUR)
        .await
        .expect("complete");
    let after = server_now(&mut conn).await;
    let expire = pexpiretime(&mut conn, &backend.record_key(&short)).await + 1;
    assert!(
        expire != claimed + 1 && (before + retention..=after + retention).contains(&expire),
        "expires at {expire} (claimed with {claimed}), settled between {before} and {after}"
    );
}

async fn plant(backend: &RedisBackend, key: &Key, value: &str) {
    let mut conn = raw(&service_env("IDEM_REDIS_URL")).await;
    let _: () = redis::cmd("SET")
        .arg(backend.record_key(key))
        .arg(value)
        .arg("PX")
        .arg(HOUR.as_millis() as u64)
        .query_async(&mut conn)
        .await
        .expect("plant a record");
}

/// Values in the layout idem wrote before its first release (lowercase state, deadlines
/// inside) are not idem records: `get`, a claim (decoded from `SET NX`'s reply), a key
/// claimed twice in a batch (the claim function) and a complete (the settle function) are
/// `Corrupt`, naming the key, and nothing is rewritten.
#[tokio::test]
async fn values_in_the_first_layout_are_not_records() {
    let backend = connect(standalone_config()).await;
    let mut conn = raw(&service_env("IDEM_REDIS_URL")).await;
    let far = server_now(&mut conn).await + 3_600_000;
    let (done, live) = (key("done"), key("live"));
    let values = [
        (&done, format!("c3,2,,{far},0,1,0,2,;wok")),
        (&live, format!("p1,1,{far},{far},0,1,0,,;w")),
    ];
    for (k, value) in &values {
        plant(&backend, k, value).await;
    }
    let corrupt = |what: &str, at: &str, res: Result<_, Error>| match res {
        Err(Error::Corrupt { message, .. }) => {
            assert_eq!(message, format!("{at}: not an idem record"), "{what}");
        }
        other => panic!("{what}: expected Corrupt, got {other:?}"),
    };
    for (k, value) in &values {
        let at = backend.record_key(k);
        corrupt("get", &at, backend.get(k).await.map(|_| ()));
        corrupt(
            "claim",
            &at,
            backend.claim(&claim(k, "v")).await.map(|_| ()),
        );
        let twice = [claim(k, "v"), claim(k, "v")];
        corrupt(
            "claim function",
            &at,
            backend.claim_many(&twice).await.map(|_| ()),
        );
        let lease = Lease {
            key: (*k).clone(),
            owner: "w".into(),
            token: 1,
            attempts: 1,
            lease_until: Timestamp::from_millis(far),
            kind: ClaimKind::First,
            fingerprint: None,
        };
        let res = backend
            .complete(&lease, Bytes::from_static(b"x"), HOUR)
            .await;
        corrupt("complete", &at, res);
        let kept: String = redis::cmd("GET")
            .arg(&at)
            .query_async(&mut conn)
            .await
            .expect("GET");
        assert_eq!(&kept, value);
    }
}
