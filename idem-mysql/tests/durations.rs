//! Leases and retentions far past any real one (up to `Duration::MAX`): every path, the
//! one-statement ones and the transaction, grants and settles them, and a lease's deadline
//! is the record's. The engine caps durations before they reach a backend; a caller of
//! the `Backend` trait may not.

mod common;

use std::time::Duration;

use bytes::Bytes;
use idem_core::backend::{Backend, ClaimOutcome, Settlement};
use idem_core::{Key, State};

#[tokio::test]
async fn huge_leases_and_retentions_are_granted_settled_and_read_back() {
    let b = common::backend().await;
    let ns = idem_conformance::unique_namespace();
    let key = |id: &str| Key::new(ns.clone(), id).expect("key");
    for (i, ttl) in [Duration::from_secs(3600 * 24 * 365 * 200), Duration::MAX]
        .into_iter()
        .enumerate()
    {
        let mut claims: Vec<_> = (0..3)
            .map(|j| idem_conformance::claim_of(&key(&format!("k{i}-{j}")), "w", ttl))
            .collect();
        for c in &mut claims {
            c.retention = ttl;
        }
        let one = b.claim(&claims[0]).await.expect("claim one");
        let many = b.claim_many(&claims[1..]).await.expect("claim a batch");
        let mut leases = Vec::new();
        for answer in std::iter::once(one).chain(many) {
            let ClaimOutcome::Acquired(lease) = answer else {
                panic!("ttl {ttl:?}: {answer:?}");
            };
            let rec = b.get(&lease.key).await.expect("get").expect("record");
            assert_eq!(rec.lease_until, Some(lease.lease_until), "ttl {ttl:?}");
            leases.push(lease);
        }
        b.complete(&leases[0], Bytes::from_static(b"one"), ttl)
            .await
            .expect("complete one");
        let batch: Vec<_> = leases[1..]
            .iter()
            .map(|l| Settlement::complete(l.clone(), Bytes::from_static(b"many")))
            .collect();
        let answers = b.settle_many(&batch, ttl).await.expect("settle a batch");
        assert!(answers.iter().all(Result::is_ok), "{answers:?}");
        for lease in &leases {
            let rec = b.get(&lease.key).await.expect("get").expect("record");
            assert_eq!(rec.state, State::Completed, "ttl {ttl:?}");
        }
    }
}
