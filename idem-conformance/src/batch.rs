//! Cases for the batch settle and for release: each item answers as the single call would,
//! in order, and release gives the attempt back without lowering the token.

use std::time::Duration;

use bytes::Bytes;
use idem_core::backend::{ClaimOutcome, Settlement};
use idem_core::{Backend, ClaimKind, Error, FailureKind, State};

use crate::Factory;

const HOUR: Duration = Duration::from_secs(3600);

/// `settle_many` answers each item as `complete`, `fail` or `release` would in turn:
/// completes, failures and releases mixed in one batch, a stale lease fenced without
/// touching its record, an oversized response refused alone, and a key settled twice in one
/// batch (the second is fenced by the first); then completes and fails of distinct keys
/// alone, all held, and with a lease taken over and a key deleted among them.
pub async fn settle_many_agrees<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let b = &fx.backend;
    let ids = ["s-done", "s-fail", "s-poison", "s-back", "s-stale", "s-big"];
    let keys: Vec<_> = ids.iter().map(|id| fx.key(id)).collect();
    let mut leases = Vec::new();
    for key in &keys {
        leases.push(fx.acquire(&fx.claim(key, "a")).await);
    }
    // The stale lease: taken over by "b" after a lapse.
    let stale = leases[4].clone();
    fx.lapse().await;
    for (i, lease) in leases.iter_mut().enumerate() {
        if i != 4 {
            *lease = fx.acquire(&fx.claim(&keys[i], "a")).await;
        }
    }
    let taken = fx.acquire(&fx.claim(&keys[4], "b")).await;
    let limit = b.capabilities().max_response_bytes;
    let batch = vec![
        Settlement::complete(leases[0].clone(), Bytes::from_static(b"\x00ok\xff")),
        Settlement::fail(leases[1].clone(), "try later", FailureKind::Retry),
        Settlement::fail(leases[2].clone(), "never", FailureKind::Permanent),
        Settlement::release(leases[3].clone()),
        Settlement::complete(stale, Bytes::from_static(b"late")),
        Settlement::complete(leases[5].clone(), Bytes::from(vec![7u8; limit + 1])),
        Settlement::complete(leases[0].clone(), Bytes::from_static(b"twice")),
    ];
    let answers = b.settle_many(&batch, HOUR).await.expect("settle_many");
    assert_eq!(answers.len(), batch.len());
    assert!(answers[0].is_ok(), "complete: {:?}", answers[0]);
    assert!(answers[1].is_ok(), "fail: {:?}", answers[1]);
    assert!(answers[2].is_ok(), "fail permanently: {:?}", answers[2]);
    assert!(answers[3].is_ok(), "release: {:?}", answers[3]);
    assert!(
        matches!(answers[4], Err(Error::Fenced { .. })),
        "stale lease: {:?}",
        answers[4]
    );
    assert!(
        matches!(answers[5], Err(Error::TooLarge { .. })),
        "oversized response: {:?}",
        answers[5]
    );
    assert!(
        matches!(answers[6], Err(Error::Fenced { .. })),
        "second settle of one key in a batch: {:?}",
        answers[6]
    );

    let get = |i: usize| {
        let key = keys[i].clone();
        async move { b.get(&key).await.expect("get").expect("record") }
    };
    let done = get(0).await;
    assert_eq!(done.state, State::Completed);
    assert_eq!(done.response, Some(Bytes::from_static(b"\x00ok\xff")));
    let failed = get(1).await;
    assert_eq!((failed.state, failed.permanent), (State::Failed, false));
    assert_eq!(failed.error.as_deref(), Some("try later"));
    let poisoned = get(2).await;
    assert_eq!((poisoned.state, poisoned.permanent), (State::Failed, true));
    let stolen = get(4).await;
    assert_eq!(
        (stolen.state, &*stolen.owner, stolen.token),
        (State::Processing, "b", taken.token),
        "a fenced item leaves its record alone"
    );
    let big = get(5).await;
    assert_eq!(
        big.state,
        State::Processing,
        "a refused item leaves its record alone"
    );
    b.complete(&leases[5], Bytes::from_static(b"fits"), HOUR)
        .await
        .expect("the lease of a refused item still completes");

    let again = b.claim(&fx.claim(&keys[0], "c")).await.expect("claim");
    assert_eq!(
        again,
        ClaimOutcome::Completed(Bytes::from_static(b"\x00ok\xff"))
    );
    let retry = fx.acquire(&fx.claim(&keys[1], "c")).await;
    assert_eq!((retry.kind, retry.attempts), (ClaimKind::Retry, 3));
    assert!(
        b.settle_many(&[], HOUR)
            .await
            .expect("empty batch")
            .is_empty()
    );
    distinct_settles_answer_each(&fx).await;
}

/// Completes and fails of distinct keys only (the shape a consumer's batch has), first all
/// held, then with one lease taken over and one key deleted among them: each item is
/// answered for itself, and only the held ones change their records.
async fn distinct_settles_answer_each<B: Backend>(fx: &crate::Fixture<B>) {
    let b = &fx.backend;
    let keys: Vec<_> = (0..8).map(|i| fx.key(&format!("d-{i}"))).collect();
    let mut leases = Vec::new();
    for key in &keys {
        leases.push(fx.acquire(&fx.claim(key, "a")).await);
    }
    let settle = |lease: &idem_core::Lease, i: usize| {
        if i % 2 == 0 {
            Settlement::complete(lease.clone(), Bytes::from(format!("r{i}")))
        } else {
            Settlement::fail(lease.clone(), format!("e{i}"), FailureKind::Retry)
        }
    };
    let first: Vec<_> = (0..4).map(|i| settle(&leases[i], i)).collect();
    let answers = b.settle_many(&first, HOUR).await.expect("settle_many");
    assert!(answers.iter().all(Result::is_ok), "all held: {answers:?}");
    fx.lapse().await;
    let taken = fx.acquire(&fx.claim(&keys[5], "b")).await;
    assert!(b.delete(&keys[6]).await.expect("delete"), "key 6 deleted");
    let second: Vec<_> = (4..8).map(|i| settle(&leases[i], i)).collect();
    let answers = b.settle_many(&second, HOUR).await.expect("settle_many");
    assert!(
        answers[0].is_ok(),
        "a lapsed lease nobody took: {:?}",
        answers[0]
    );
    for (i, what) in [(1, "taken over"), (2, "deleted")] {
        assert!(
            matches!(answers[i], Err(Error::Fenced { .. })),
            "{what}: {:?}",
            answers[i]
        );
    }
    assert!(answers[3].is_ok(), "held: {:?}", answers[3]);
    for i in [0, 1, 2, 3, 4, 7] {
        let rec = b.get(&keys[i]).await.expect("get").expect("record");
        let want = if i % 2 == 0 {
            State::Completed
        } else {
            State::Failed
        };
        assert_eq!(rec.state, want, "key {i}");
        if i % 2 == 0 {
            assert_eq!(rec.response, Some(Bytes::from(format!("r{i}"))), "key {i}");
        } else {
            assert_eq!(rec.error, Some(format!("e{i}")), "key {i}");
        }
    }
    let stolen = b.get(&keys[5]).await.expect("get").expect("record");
    assert_eq!(
        (stolen.state, stolen.token),
        (State::Processing, taken.token)
    );
    assert_eq!(
        b.get(&keys[6]).await.expect("get"),
        None,
        "nothing written back"
    );
}

/// Release hands a lease back unrun: the attempt it counted is taken back, the next claim
/// takes over at once with the next token, and only the holder of a live lease can
/// release (a stranger, a stale token and a second release are fenced).
pub async fn release_hands_back<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let b = &fx.backend;
    let key = fx.key("release");
    let lease = fx.acquire(&fx.claim(&key, "a")).await;
    let stranger = idem_core::Lease {
        owner: "z".into(),
        ..lease.clone()
    };
    let res = b.release(&stranger).await;
    assert!(
        matches!(res, Err(Error::Fenced { .. })),
        "stranger: {res:?}"
    );
    let res = b.release(&lease).await;
    assert!(res.is_ok(), "holder: {res:?}");
    let rec = b.get(&key).await.expect("get").expect("record kept");
    assert_eq!(
        (rec.state, rec.token, rec.attempts),
        (State::Processing, 1, 0)
    );
    let res = b.release(&lease).await;
    assert!(
        matches!(res, Err(Error::Fenced { .. })),
        "a second release must not take back a second attempt: {res:?}"
    );

    // No wait for a lapse: the released lease is over already.
    let next = fx.acquire(&fx.claim(&key, "b")).await;
    assert_eq!(
        (next.token, next.attempts, next.kind),
        (2, 1, ClaimKind::Takeover)
    );
    let res = b.release(&lease).await;
    assert!(
        matches!(res, Err(Error::Fenced { .. })),
        "stale token: {res:?}"
    );
    let res = b.complete(&lease, Bytes::from_static(b"late"), HOUR).await;
    assert!(
        matches!(res, Err(Error::Fenced { .. })),
        "stale complete: {res:?}"
    );

    // Released again and again, a key is never poisoned by attempts it did not run.
    let mut held = next;
    for round in 0..4u64 {
        b.release(&held).await.expect("release");
        held = fx.acquire(&fx.claim(&key, "b")).await;
        assert_eq!((held.token, held.attempts), (3 + round, 1));
    }

    // A released key is claimable at once by a repeat in a batch too: the batch's first
    // item, another payload, is answered `Mismatch` from the record, and the second takes
    // over. Many rounds, so that on a store with a finer clock than its answers some
    // release falls in the same millisecond as the claim after it.
    for round in 0..40 {
        let key = fx.key(&format!("release-batch-{round}"));
        let held = fx.acquire(&fx.claim(&key, "a")).await;
        b.release(&held).await.expect("release");
        let other = idem_core::backend::Claim {
            fingerprint: Some(idem_core::Fingerprint::of(b"other")),
            ..fx.claim(&key, "a")
        };
        let answers = b
            .claim_many(&[other, fx.claim(&key, "a")])
            .await
            .expect("claim_many");
        assert!(
            matches!(
                answers.as_slice(),
                [ClaimOutcome::Mismatch, ClaimOutcome::Acquired(l)]
                    if (l.token, l.kind) == (2, ClaimKind::Takeover)
            ),
            "round {round}: a batch right after a release: {answers:?}"
        );
    }

    // A lapsed lease has nothing to hand back.
    fx.lapse().await;
    let res = b.release(&held).await;
    assert!(
        matches!(res, Err(Error::Fenced { .. })),
        "lapsed lease: {res:?}"
    );
    b.complete(&held, Bytes::from_static(b"late but unopposed"), HOUR)
        .await
        .expect("a lapsed lease nobody took over still completes");

    // An extend revives a released lease, not its attempt: a second release stays fenced
    // and attempts never go below zero.
    let key = fx.key("release-extend");
    let revived = fx.acquire(&fx.claim(&key, "c")).await;
    b.release(&revived).await.expect("release");
    b.extend(&revived, fx.lease)
        .await
        .expect("extend a released lease");
    let res = b.release(&revived).await;
    assert!(
        matches!(res, Err(Error::Fenced { .. })),
        "release after extend gives back no attempt: {res:?}"
    );
    let rec = b.get(&key).await.expect("get").expect("record kept");
    assert_eq!(
        (rec.state, rec.token, rec.attempts),
        (State::Processing, 1, 0)
    );
}
