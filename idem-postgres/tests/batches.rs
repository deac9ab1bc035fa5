//! Batches: `claim_many` with a key repeated, and `settle_many`, answer each item as
//! if the calls were made one after another.

mod common;

use std::time::Duration;

use bytes::Bytes;
use idem_conformance::acquire;
use idem_core::backend::{Claim, ClaimOutcome, Settlement};
use idem_core::{Backend, Error, Fingerprint, Key};

const HOUR: Duration = Duration::from_secs(3600);

fn claim(id: &str, owner: &str) -> Claim {
    let key = Key::new("co", id).expect("key");
    idem_conformance::claim_of(&key, owner, Duration::from_secs(30))
}

#[tokio::test]
async fn a_key_repeated_in_claim_many_is_answered_as_if_claimed_in_turn() {
    let backend = common::backend().await;
    let fresh: Vec<Claim> = (0..4).map(|i| claim("fresh", &format!("w{i}"))).collect();
    let answers = backend.claim_many(&fresh).await.expect("claim_many");
    let ClaimOutcome::Acquired(lease) = &answers[0] else {
        panic!("the first claim of a fresh key acquires: {answers:?}");
    };
    for a in &answers[1..] {
        match a {
            ClaimOutcome::InProgress { owner, lease_until } => {
                assert_eq!((owner, *lease_until), (&lease.owner, lease.lease_until));
            }
            other => panic!("a repeat sees the lease just granted, got {other:?}"),
        }
    }
    backend
        .complete(lease, Bytes::from_static(b"receipt"), HOUR)
        .await
        .expect("complete");
    let mut mixed: Vec<Claim> = (0..3).map(|i| claim("fresh", &format!("v{i}"))).collect();
    let mut other = claim("fresh", "x");
    other.fingerprint = Some(Fingerprint::of(b"another payload"));
    mixed.push(other);
    mixed.push(claim("new", "v0"));
    let answers = backend.claim_many(&mixed).await.expect("claim_many");
    for a in &answers[..3] {
        assert_eq!(a, &ClaimOutcome::Completed(Bytes::from_static(b"receipt")));
    }
    assert!(
        matches!(
            answers[3],
            ClaimOutcome::Completed(_) | ClaimOutcome::Mismatch
        ),
        "{:?}",
        answers[3]
    );
    assert!(
        matches!(answers[4], ClaimOutcome::Acquired(_)),
        "{:?}",
        answers[4]
    );
}

#[tokio::test]
async fn settle_many_answers_each_lease_as_if_completed_in_turn() {
    let backend = common::backend().await;
    let a = acquire(&backend, &claim("a", "w")).await;
    let b = acquire(&backend, &claim("b", "w")).await;
    let mut stale = acquire(&backend, &claim("c", "w")).await;
    stale.token += 5;
    let big = Bytes::from(vec![b'x'; 65 * 1024]);
    let d = acquire(&backend, &claim("d", "w")).await;
    let answers = backend
        .settle_many(
            &[
                Settlement::complete(a.clone(), Bytes::from_static(b"ra")),
                Settlement::complete(b.clone(), Bytes::from_static(b"rb")),
                // The same lease again: completed already by the one before.
                Settlement::complete(a.clone(), Bytes::from_static(b"again")),
                Settlement::complete(stale, Bytes::from_static(b"rc")),
                Settlement::complete(d.clone(), big),
            ],
            HOUR,
        )
        .await
        .expect("settle_many");
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
