//! What a backend answers when its store fails it: a closed port, a server that accepts and
//! never answers, a record idem did not write, and a response over the configured limit.
//! Each is a typed error (`Unavailable`, `Corrupt`, `TooLarge`), in time, never a panic or a
//! hang.

use std::fmt::Debug;
use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idem_core::backend::{ClaimOutcome, Settlement};
use idem_core::{Backend, ClaimKind, Error, FailureKind, Key, Lease, Result, Timestamp};

use crate::{Factory, Remote};

const HOUR: Duration = Duration::from_secs(3600);

/// A lease idem never granted: owner `w`, token 1, as a forged or very stale caller holds.
fn forged(key: &Key) -> Lease {
    Lease {
        key: key.clone(),
        owner: "w".into(),
        token: 1,
        attempts: 1,
        lease_until: Timestamp::from_millis(0),
        kind: ClaimKind::First,
        fingerprint: None,
    }
}

/// `res`, answered after `took`, is a retryable `Unavailable` within `bound`.
fn unavailable<T: Debug>(what: &str, res: Result<T>, took: Duration, bound: Duration) {
    match &res {
        Err(e @ Error::Unavailable { .. }) => assert!(e.is_retryable(), "{what}: {e:?}"),
        other => panic!("{what}: expected Unavailable, got {other:?}"),
    }
    assert!(
        took <= bound,
        "{what}: answered after {took:?}, over the bound {bound:?}"
    );
}

/// Runs `call` and how long it took; panics if it gives no answer within three `bound`s.
async fn timed<T>(what: &str, bound: Duration, call: impl Future<Output = T>) -> (T, Duration) {
    let started = Instant::now();
    let res = tokio::time::timeout(bound * 3, call)
        .await
        .unwrap_or_else(|_| panic!("{what}: no answer after {:?}", bound * 3));
    (res, started.elapsed())
}

/// A backend pointed at `addr` answers `Unavailable` in time: at connect, or at each call.
async fn unavailable_at<F: Remote>(f: &F, addr: SocketAddr, what: &str) {
    let bound = f.unavailable_within();
    let (connected, took) = timed(what, bound, f.connect_to(addr)).await;
    let backend = match connected {
        Ok(backend) => backend,
        Err(e) => return unavailable::<()>(&format!("{what}: connect"), Err(e), took, bound),
    };
    let key = Key::new(crate::unique_namespace(), "k").expect("key");
    let claim = crate::claim_of(&key, "w", Duration::from_secs(10));
    for round in 0..2 {
        let what = format!("{what}: claim {round}");
        let (res, took) = timed(&what, bound, backend.claim(&claim)).await;
        unavailable(&what, res, took, bound);
    }
    let what_many = format!("{what}: claim_many");
    let batch = [claim.clone(), claim.clone()];
    let (res, took) = timed(&what_many, bound, backend.claim_many(&batch)).await;
    unavailable(&what_many, res, took, bound);
    let what_get = format!("{what}: get");
    let (res, took) = timed(&what_get, bound, backend.get(&key)).await;
    unavailable(&what_get, res, took, bound);
    let what_complete = format!("{what}: complete");
    let lease = forged(&key);
    let complete = backend.complete(&lease, Bytes::from_static(b"x"), HOUR);
    let (res, took) = timed(&what_complete, bound, complete).await;
    unavailable(&what_complete, res, took, bound);
}

/// Nothing listens on the port: every call (or the connect) answers `Unavailable` within
/// the bound the factory configured.
pub async fn closed_port<F: Remote>(f: &F) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    drop(listener);
    unavailable_at(f, addr, "closed port").await;
}

/// A server accepts connections and never answers: every call (or the connect) times out
/// as `Unavailable` within the bound the factory configured, and never hangs.
pub async fn silent_server<F: Remote>(f: &F) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let silent = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket); // read nothing, answer nothing
        }
    });
    unavailable_at(f, addr, "silent server").await;
    silent.abort();
}

fn corrupt<T: Debug>(what: &str, res: Result<T>) {
    assert!(
        matches!(res, Err(Error::Corrupt { .. })),
        "{what}: expected Corrupt, got {res:?}"
    );
}

/// A fencing call on a record that does not decode: `Corrupt`, or `Fenced` where the store
/// refuses before decoding (the forged lease matches nothing). Never `Ok`.
fn refused<T: Debug>(what: &str, res: Result<T>) {
    assert!(
        matches!(res, Err(Error::Corrupt { .. } | Error::Fenced { .. })),
        "{what}: expected Corrupt or Fenced, got {res:?}"
    );
}

/// Values idem never writes, planted where a record lives (every kind the factory knows):
/// claim, claim_many and get answer `Corrupt`; complete, fail, extend and release never
/// succeed; keys beside it still work; `delete` clears it and the key starts afresh.
pub async fn corrupt_record<F: Remote>(f: &F) {
    let fx = f.setup().await;
    let b = &fx.backend;
    let mut kinds = 0;
    loop {
        let key = fx.key(&format!("corrupt-{kinds}"));
        let Some(what) = f.plant_corrupt(&fx, &key, kinds).await else {
            break;
        };
        kinds += 1;
        corrupt(&what, b.claim(&fx.claim(&key, "w")).await);
        corrupt(&what, b.get(&key).await);
        let fresh = fx.key(&format!("fresh-{kinds}"));
        let batch = [fx.claim(&fresh, "w"), fx.claim(&key, "w")];
        corrupt(&format!("{what} in a batch"), b.claim_many(&batch).await);
        let lease = forged(&key);
        let body = Bytes::from_static(b"x");
        refused(&what, b.complete(&lease, body, HOUR).await);
        refused(&what, b.fail(&lease, "e", FailureKind::Retry, HOUR).await);
        refused(&what, b.extend(&lease, HOUR).await);
        refused(&what, b.release(&lease).await);
        let beside = fx.key(&format!("beside-{kinds}"));
        fx.acquire(&fx.claim(&beside, "w")).await;
        assert!(b.delete(&key).await.expect("delete"), "{what}: was there");
        let again = fx.acquire(&fx.claim(&key, "w")).await;
        assert_eq!((again.token, again.kind), (1, ClaimKind::First), "{what}");
    }
    assert!(kinds > 0, "the factory planted no corrupt record");
}

/// A response over the configured limit (16 bytes where the factory can configure one, else
/// the backend's own limit) is `TooLarge`, alone or in a batch, and changes nothing: the
/// lease then completes at the limit and the replay is byte for byte.
pub async fn oversized_response<F: Factory>(f: &F) {
    const SMALL: usize = 16;
    let fx = match f.setup_with_response_limit(SMALL).await {
        Some(fx) => {
            let limit = fx.backend.capabilities().max_response_bytes;
            assert_eq!(limit, SMALL, "the configured response limit");
            fx
        }
        None => f.setup().await,
    };
    let b = &fx.backend;
    let limit = b.capabilities().max_response_bytes;
    let key = fx.key("oversized");
    let lease = fx.acquire(&fx.claim(&key, "a")).await;
    let before = b.get(&key).await.expect("get");
    let big = Bytes::from(vec![9u8; limit + 1]);
    let res = b.complete(&lease, big.clone(), HOUR).await;
    assert!(
        matches!(res, Err(Error::TooLarge { size, limit: l, .. }) if size == limit + 1 && l == limit),
        "complete: {res:?}"
    );
    let answers = b
        .settle_many(&[Settlement::complete(lease.clone(), big)], HOUR)
        .await
        .expect("settle_many");
    assert!(
        matches!(answers.as_slice(), [Err(Error::TooLarge { .. })]),
        "settle_many: {answers:?}"
    );
    assert_eq!(
        b.get(&key).await.expect("get"),
        before,
        "refusals changed it"
    );
    let full = Bytes::from(vec![7u8; limit]);
    b.complete(&lease, full.clone(), HOUR)
        .await
        .expect("complete at the limit");
    match b.claim(&fx.claim(&key, "b")).await.expect("claim") {
        ClaimOutcome::Completed(bytes) => assert!(bytes == full, "the replay differs"),
        other => panic!("expected Completed, got {other:?}"),
    }
}
