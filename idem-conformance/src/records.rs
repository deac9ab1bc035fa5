//! Cases for a record's life after its first claim: attempts and poison, fingerprints,
//! heartbeats, retention, deletes and lists, batch claims, response bytes, the engine on
//! top, and the model.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idem_core::backend::ClaimOutcome;
use idem_core::backend::machine::lapsed_error;
use idem_core::{
    Backend, ClaimKind, Engine, Error, FailureKind, Fingerprint, Outcome, State, WaitPolicy,
};

use crate::Factory;
use crate::support::{HOUR, assert_fenced, in_progress_by};

/// Invariant 6: retryable failures count; after `max_attempts` the key is `Poisoned` with
/// the last error.
pub async fn bounded_attempts_failures<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("bounded");
    let claim = fx.claim(&key, "a"); // max_attempts 3
    for n in 1..=3 {
        let l = fx.acquire(&claim).await;
        assert_eq!(l.attempts, n);
        let err = format!("error {n}");
        fx.backend
            .fail(&l, &err, FailureKind::Retry, HOUR)
            .await
            .expect("fail");
    }
    let poisoned = ClaimOutcome::Poisoned {
        attempts: 3,
        error: "error 3".into(),
    };
    for _ in 0..2 {
        let answer = fx.backend.claim(&claim).await.expect("claim");
        assert_eq!(answer, poisoned);
    }
    // The same in a batch that names the key twice (where a store may take another path).
    let batch = [claim.clone(), claim.clone()];
    let answers = fx.backend.claim_many(&batch).await.expect("claim_many");
    assert_eq!(answers, vec![poisoned.clone(), poisoned]);
}

/// Invariants 5 and 6: lapsed leases count as attempts; a lapsed lease whose attempts are
/// spent turns `Poisoned` at the next claim instead of being taken over.
pub async fn bounded_attempts_lapses<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("lapses");
    let claim = idem_core::backend::Claim {
        max_attempts: 2,
        ..fx.claim(&key, "a")
    };
    fx.acquire(&claim).await;
    fx.lapse().await;
    let l = fx.acquire(&claim).await;
    assert_eq!((l.attempts, l.kind), (2, ClaimKind::Takeover));
    fx.lapse().await;
    let answer = fx.backend.claim(&claim).await.expect("claim");
    let poisoned = ClaimOutcome::Poisoned {
        attempts: 2,
        error: lapsed_error(2),
    };
    assert_eq!(answer, poisoned);
    let rec = fx.backend.get(&key).await.expect("get").expect("record");
    assert_eq!((rec.state, rec.attempts), (State::Failed, 2));
    assert_fenced(
        "the lapsed holder",
        fx.backend.complete(&l, Bytes::new(), HOUR).await,
    );
    assert_eq!(fx.backend.claim(&claim).await.expect("claim"), poisoned);
}

/// Invariant 6: a permanent failure poisons the key at once.
pub async fn permanent_failure_poisons<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("permanent");
    let claim = fx.claim(&key, "a");
    let l = fx.acquire(&claim).await;
    fx.backend
        .fail(&l, "bad card", FailureKind::Permanent, HOUR)
        .await
        .expect("fail");
    let answer = fx.backend.claim(&claim).await.expect("claim");
    assert_eq!(
        answer,
        ClaimOutcome::Poisoned {
            attempts: 1,
            error: "bad card".into()
        }
    );
}

/// Invariant 7: another payload under an existing key is `Mismatch` and touches nothing, in
/// every state (live, completed, failed with attempts left, lapsed); the same payload, or
/// none, gets the ordinary answer.
pub async fn fingerprint_mismatch<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("fp");
    let same = fx.claim(&key, "a");
    let other = idem_core::backend::Claim {
        fingerprint: Some(Fingerprint::of(b"other payload")),
        owner: "b".into(),
        ..same.clone()
    };
    let unchecked = idem_core::backend::Claim {
        fingerprint: None,
        owner: "c".into(),
        ..same.clone()
    };
    let l = fx.acquire(&same).await;
    let before = fx.backend.get(&key).await.expect("get");
    assert_eq!(
        fx.backend.claim(&other).await.expect("claim"),
        ClaimOutcome::Mismatch
    );
    assert_eq!(
        fx.backend.get(&key).await.expect("get"),
        before,
        "mismatch touched it"
    );
    let answer = fx.backend.claim(&unchecked).await.expect("claim");
    assert!(in_progress_by(&answer, "a"), "{answer:?}");
    fx.backend
        .complete(&l, Bytes::from_static(b"ok"), HOUR)
        .await
        .expect("complete");
    assert_eq!(
        fx.backend.claim(&other).await.expect("claim"),
        ClaimOutcome::Mismatch
    );
    let replay = ClaimOutcome::Completed(Bytes::from_static(b"ok"));
    assert_eq!(fx.backend.claim(&same).await.expect("claim"), replay);
    assert_eq!(fx.backend.claim(&unchecked).await.expect("claim"), replay);
    mismatch_where_claimable(&fx).await;
}

/// Invariant 7 on records a claim could take: another payload is `Mismatch` before any
/// state is considered, for a retryable failure and for a lapsed lease alike.
async fn mismatch_where_claimable<B: Backend>(fx: &crate::Fixture<B>) {
    let b = &fx.backend;
    let (failed, lapsed) = (fx.key("fp-failed"), fx.key("fp-lapsed"));
    let l = fx.acquire(&fx.claim(&failed, "a")).await;
    b.fail(&l, "again", FailureKind::Retry, HOUR)
        .await
        .expect("fail");
    fx.acquire(&fx.claim(&lapsed, "a")).await;
    fx.lapse().await;
    for key in [&failed, &lapsed] {
        let other = idem_core::backend::Claim {
            fingerprint: Some(Fingerprint::of(b"other payload")),
            ..fx.claim(key, "b")
        };
        let before = b.get(key).await.expect("get");
        let answer = b.claim(&other).await.expect("claim");
        assert_eq!(answer, ClaimOutcome::Mismatch, "{}", key.id());
        assert_eq!(b.get(key).await.expect("get"), before, "{}", key.id());
    }
}

/// Invariant 8: `extend` keeps a lease past its first deadline; after a takeover it is
/// `Fenced`.
pub async fn heartbeat_extend<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("extend");
    let l = fx.acquire(&fx.claim(&key, "a")).await;
    fx.advance(fx.lease * 3 / 5).await;
    let until = fx.backend.extend(&l, fx.lease).await.expect("extend");
    assert!(
        until > l.lease_until,
        "the deadline moved: {until:?} vs {:?}",
        l.lease_until
    );
    fx.advance(fx.lease * 3 / 5).await; // past the first deadline, inside the second
    let answer = fx.backend.claim(&fx.claim(&key, "b")).await.expect("claim");
    assert!(
        in_progress_by(&answer, "a"),
        "extended lease still held: {answer:?}"
    );
    fx.lapse().await;
    let taken = fx.acquire(&fx.claim(&key, "b")).await;
    assert_eq!(taken.kind, ClaimKind::Takeover);
    assert_fenced(
        "extend after takeover",
        fx.backend.extend(&l, fx.lease).await,
    );
    let rec = fx.backend.get(&key).await.expect("get").expect("record");
    assert_eq!(&*rec.owner, "b");
}

/// Records past their retention count as absent: the key starts afresh. Where the store
/// has no native expiry, `purge_expired` removes them.
pub async fn retention_expiry<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("retained");
    let claim = fx.claim(&key, "a");
    let l = fx.acquire(&claim).await;
    let retention = fx.lease;
    fx.backend
        .complete(&l, Bytes::from_static(b"r"), retention)
        .await
        .expect("complete");
    fx.advance(retention / 2).await;
    assert_eq!(
        fx.backend.claim(&claim).await.expect("claim"),
        ClaimOutcome::Completed(Bytes::from_static(b"r")),
        "inside retention"
    );
    fx.lapse().await;
    assert_eq!(
        fx.backend.get(&key).await.expect("get"),
        None,
        "expired record is absent"
    );
    if !fx.backend.capabilities().native_expiry {
        let purged = fx.backend.purge_expired().await.expect("purge");
        assert!(purged >= 1, "purge removed {purged} records");
    }
    let again = fx.acquire(&claim).await;
    assert_eq!(
        (again.token, again.attempts, again.kind),
        (1, 1, ClaimKind::First)
    );
}

/// `delete` removes a record whatever its state, and says whether there was one.
pub async fn delete_and_get<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("delete");
    assert!(
        !fx.backend.delete(&key).await.expect("delete"),
        "nothing to delete"
    );
    let l = fx.acquire(&fx.claim(&key, "a")).await;
    fx.backend
        .complete(&l, Bytes::from_static(b"x"), HOUR)
        .await
        .expect("complete");
    assert!(fx.backend.delete(&key).await.expect("delete"));
    assert_eq!(fx.backend.get(&key).await.expect("get"), None);
    assert_fenced(
        "complete after delete",
        fx.backend.complete(&l, Bytes::new(), HOUR).await,
    );
    let again = fx.acquire(&fx.claim(&key, "b")).await;
    assert_eq!((again.token, again.kind), (1, ClaimKind::First));
}

/// `claim_many` answers each claim in order as `claim` would, for keys in every state,
/// including the same key twice in one batch.
pub async fn claim_many_agrees<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let b = &fx.backend;
    let (new, done, busy, other, bad) = (
        fx.key("m-new"),
        fx.key("m-done"),
        fx.key("m-busy"),
        fx.key("m-other"),
        fx.key("m-bad"),
    );
    let l = fx.acquire(&fx.claim(&done, "a")).await;
    b.complete(&l, Bytes::from_static(b"done"), HOUR)
        .await
        .expect("complete");
    fx.acquire(&fx.claim(&busy, "a")).await;
    fx.acquire(&fx.claim(&other, "a")).await;
    let l = fx.acquire(&fx.claim(&bad, "a")).await;
    b.fail(&l, "poison", FailureKind::Permanent, HOUR)
        .await
        .expect("fail");
    let mismatch = idem_core::backend::Claim {
        fingerprint: Some(Fingerprint::of(b"different")),
        ..fx.claim(&other, "z")
    };
    let batch = vec![
        fx.claim(&new, "z"),
        fx.claim(&done, "z"),
        fx.claim(&busy, "z"),
        mismatch,
        fx.claim(&bad, "z"),
        fx.claim(&new, "y"),
    ];
    let answers = b.claim_many(&batch).await.expect("claim_many");
    assert_eq!(answers.len(), batch.len());
    assert!(
        matches!(&answers[0], ClaimOutcome::Acquired(l) if &*l.owner == "z" && l.token == 1),
        "{:?}",
        answers[0]
    );
    assert_eq!(
        answers[1],
        ClaimOutcome::Completed(Bytes::from_static(b"done"))
    );
    assert!(in_progress_by(&answers[2], "a"), "{:?}", answers[2]);
    assert_eq!(answers[3], ClaimOutcome::Mismatch);
    assert!(matches!(
        &answers[4],
        ClaimOutcome::Poisoned { attempts: 1, .. }
    ));
    assert!(
        in_progress_by(&answers[5], "z"),
        "second claim in batch: {:?}",
        answers[5]
    );
    assert!(b.claim_many(&[]).await.expect("empty batch").is_empty());
}

/// Responses are kept byte for byte up to the backend's limit; a larger one is
/// `TooLarge` and leaves the lease able to complete.
pub async fn response_bytes_round_trip<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("bytes");
    let limit = fx.backend.capabilities().max_response_bytes;
    let l = fx.acquire(&fx.claim(&key, "a")).await;
    let too_big = Bytes::from(vec![1u8; limit + 1]);
    let res = fx.backend.complete(&l, too_big, HOUR).await;
    assert!(
        matches!(res, Err(Error::TooLarge { size, .. }) if size == limit + 1),
        "{res:?}"
    );
    let full: Bytes = (0..limit)
        .map(|i| (i % 251) as u8)
        .collect::<Vec<_>>()
        .into();
    fx.backend
        .complete(&l, full.clone(), HOUR)
        .await
        .expect("complete at the limit");
    match fx.backend.claim(&fx.claim(&key, "b")).await.expect("claim") {
        ClaimOutcome::Completed(bytes) => assert!(bytes == full, "replay differs"),
        other => panic!("expected Completed, got {other:?}"),
    }
}

/// Invariants 3 and 6 through the engine: 16 concurrent `execute` calls on one key run the
/// handler once; the others replay its response.
pub async fn engine_executes_once<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("engine");
    let lease = fx.lease;
    let backend: Arc<dyn Backend> = Arc::new(fx.backend);
    let runs = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    for i in 0..16 {
        let engine = Engine::builder(Arc::clone(&backend))
            .owner(format!("e{i}"))
            .lease_ttl(lease)
            .wait(WaitPolicy::Wait {
                poll: Duration::from_millis(5),
                max: Duration::from_secs(30),
            })
            .build()
            .expect("engine");
        let (key, runs) = (key.clone(), Arc::clone(&runs));
        tasks.push(tokio::spawn(async move {
            engine
                .execute(&key, b"payload", |ctx| async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Ok(Bytes::from(format!("charged by token {}", ctx.token())))
                })
                .await
                .expect("execute")
        }));
    }
    let mut executed = 0;
    for t in tasks {
        match t.await.expect("task") {
            Outcome::Executed(b) => {
                executed += 1;
                assert_eq!(b, Bytes::from_static(b"charged by token 1"));
            }
            Outcome::Replayed(b) => assert_eq!(b, Bytes::from_static(b"charged by token 1")),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(executed, 1, "one execute ran the handler");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
}

/// `list` filters by namespace and state and honours the limit, where the backend can list,
/// and skips nothing among records idem wrote; a backend that cannot answers `Unsupported`.
pub async fn list_records<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let b = &fx.backend;
    let filter = idem_core::backend::ListFilter {
        namespace: Some(fx.namespace.clone()),
        state: Some(State::Processing),
        limit: 0,
    };
    if !b.capabilities().list {
        let res = b.list(&filter).await;
        assert!(matches!(res, Err(Error::Unsupported { .. })), "{res:?}");
        return;
    }
    for id in ["l1", "l2", "l3"] {
        fx.acquire(&fx.claim(&fx.key(id), "a")).await;
    }
    let l = fx.acquire(&fx.claim(&fx.key("l4"), "a")).await;
    b.complete(&l, Bytes::from_static(b"x"), HOUR)
        .await
        .expect("complete");
    let listing = b.list(&filter).await.expect("list");
    assert_eq!(listing.skipped_total, 0, "{:?}", listing.skipped);
    assert!(listing.skipped.is_empty());
    let mut ids: Vec<String> = (listing.records.into_iter())
        .map(|r| r.key.id().to_owned())
        .collect();
    ids.sort();
    assert_eq!(ids, ["l1", "l2", "l3"]);
    let done = idem_core::backend::ListFilter {
        state: Some(State::Completed),
        ..filter.clone()
    };
    let listed = b.list(&done).await.expect("list").records;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].response, Some(Bytes::from_static(b"x")));
    let two = idem_core::backend::ListFilter { limit: 2, ..filter };
    assert_eq!(b.list(&two).await.expect("list").records.len(), 2);
}

/// Invariant 9: random operation sequences from several owners, with time moves, give the
/// reference model's answers. Cases: `PROPTEST_CASES` (default 256).
pub async fn model_agreement<F: Factory>(f: &F) {
    crate::property::model_agreement(f).await
}
