//! Coalescing: concurrent single claims and completes share statements, with the answers
//! each call would have got alone.

mod common;

use std::time::Duration;

use bytes::Bytes;
use futures::future::join_all;
use idem_core::{Backend, Claim, ClaimOutcome, Error, Key, Lease};
use idem_postgres::PgBackend;

const HOUR: Duration = Duration::from_secs(3600);

fn claim(id: &str, owner: &str) -> Claim {
    Claim {
        key: Key::new("co", id).expect("key"),
        owner: owner.into(),
        lease_ttl: Duration::from_secs(30),
        fingerprint: None,
        max_attempts: 3,
        retention: HOUR,
    }
}

/// A migrated backend whose calls coalesce behind a single statement in flight.
async fn one_in_flight() -> PgBackend {
    common::backend_with(|c| c.max_connections(8).coalesce(1)).await
}

async fn acquire(backend: &PgBackend, c: &Claim) -> Lease {
    match backend.claim(c).await.expect("claim") {
        ClaimOutcome::Acquired(lease) => lease,
        other => panic!("a fresh key must be acquired, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_claims_of_one_key_acquire_once() {
    let backend = one_in_flight().await;
    let claims: Vec<Claim> = (0..32).map(|i| claim("same", &format!("w{i}"))).collect();
    let answers = join_all(claims.iter().map(|c| backend.claim(c))).await;
    let acquired = answers
        .iter()
        .filter(|a| matches!(a, Ok(ClaimOutcome::Acquired(_))))
        .count();
    let waiting = answers
        .iter()
        .filter(|a| matches!(a, Ok(ClaimOutcome::InProgress { .. })))
        .count();
    assert_eq!((acquired, waiting), (1, 31), "{answers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_distinct_claims_each_acquire() {
    let backend = one_in_flight().await;
    let claims: Vec<Claim> = (0..40).map(|i| claim(&format!("k{i}"), "w")).collect();
    let answers = join_all(claims.iter().map(|c| backend.claim(c))).await;
    for (c, a) in claims.iter().zip(&answers) {
        match a {
            Ok(ClaimOutcome::Acquired(lease)) => assert_eq!(lease.key, c.key),
            other => panic!("{}: {other:?}", c.key),
        }
    }
}

#[tokio::test]
async fn complete_many_answers_each_lease_as_if_completed_in_turn() {
    let backend = common::backend().await;
    let a = acquire(&backend, &claim("a", "w")).await;
    let b = acquire(&backend, &claim("b", "w")).await;
    let mut stale = acquire(&backend, &claim("c", "w")).await;
    stale.token += 5;
    let big = Bytes::from(vec![b'x'; 65 * 1024]);
    let d = acquire(&backend, &claim("d", "w")).await;
    let answers = backend
        .complete_many(&[
            (a.clone(), Bytes::from_static(b"ra"), HOUR),
            (b.clone(), Bytes::from_static(b"rb"), HOUR),
            // The same lease again: completed already by the one before.
            (a.clone(), Bytes::from_static(b"again"), HOUR),
            (stale, Bytes::from_static(b"rc"), HOUR),
            (d.clone(), big, HOUR),
        ])
        .await
        .expect("complete_many");
    assert!(answers[0].is_ok(), "{:?}", answers[0]);
    assert!(answers[1].is_ok(), "{:?}", answers[1]);
    assert!(
        matches!(answers[2], Err(Error::Fenced { .. })),
        "{:?}",
        answers[2]
    );
    assert!(
        matches!(answers[3], Err(Error::Fenced { .. })),
        "{:?}",
        answers[3]
    );
    assert!(
        matches!(answers[4], Err(Error::TooLarge { .. })),
        "{:?}",
        answers[4]
    );
    for (lease, want) in [(&a, &b"ra"[..]), (&b, &b"rb"[..])] {
        match backend
            .claim(&claim(lease.key.id(), "late"))
            .await
            .expect("claim")
        {
            ClaimOutcome::Completed(bytes) => assert_eq!(bytes.as_ref(), want),
            other => panic!("{other:?}"),
        }
    }
    let c = backend
        .get(&Key::new("co", "c").expect("key"))
        .await
        .expect("get");
    assert_eq!(c.expect("record").state, idem_core::State::Processing);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_completes_coalesce_and_fence_only_the_stale_ones() {
    let backend = one_in_flight().await;
    let mut leases = Vec::new();
    for i in 0..24 {
        leases.push(acquire(&backend, &claim(&format!("k{i}"), "w")).await);
    }
    for lease in leases.iter_mut().step_by(3) {
        lease.token += 1;
    }
    let answers = join_all(
        leases
            .iter()
            .map(|l| backend.complete(l, Bytes::from_static(b"ok"), HOUR)),
    )
    .await;
    for (i, a) in answers.iter().enumerate() {
        if i % 3 == 0 {
            assert!(matches!(a, Err(Error::Fenced { .. })), "k{i}: {a:?}");
        } else {
            assert!(a.is_ok(), "k{i}: {a:?}");
        }
    }
}
