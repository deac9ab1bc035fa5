//! The conformance cases. Each takes a [`Factory`] and panics on a broken guarantee.
//! The invariant each case proves is named in its doc, numbered as in CONTRACT.md.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idem_core::backend::{ClaimOutcome, Settlement};
use idem_core::{Backend, ClaimKind, FailureKind, Fingerprint, Lease, State};

use crate::Factory;
pub use crate::batch::{release_hands_back, settle_many_agrees};
pub use crate::failures::{closed_port, corrupt_record, oversized_response, silent_server};
pub use crate::records::{
    bounded_attempts_failures, bounded_attempts_lapses, claim_many_agrees, delete_and_get,
    engine_executes_once, fingerprint_mismatch, heartbeat_extend, list_records, model_agreement,
    permanent_failure_poisons, response_bytes_round_trip, retention_expiry,
};
use crate::support::{HOUR, assert_fenced, in_progress_by, race, split_race};
pub use crate::waiting::{
    wait_max_elapses, wait_survives_lost_notification, wait_wakes_on_complete,
    wait_watches_only_a_key_in_progress,
};

/// The first claim of a new key is granted with token 1, attempt 1, and the record shows it,
/// with the lease's deadline; so do the first claims of a batch of new keys.
pub async fn claim_new_key<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("new");
    assert_eq!(fx.backend.get(&key).await.expect("get"), None);
    let lease = fx.acquire(&fx.claim(&key, "a")).await;
    assert_eq!(
        (lease.token, lease.attempts, lease.kind),
        (1, 1, ClaimKind::First)
    );
    assert_eq!(&*lease.owner, "a");
    let rec = fx
        .backend
        .get(&key)
        .await
        .expect("get")
        .expect("record exists");
    assert_eq!(rec.state, State::Processing);
    assert_eq!((&*rec.owner, rec.token, rec.attempts), ("a", 1, 1));
    assert_eq!(rec.fingerprint, Some(Fingerprint::of(b"p")));
    assert_eq!(
        rec.lease_until,
        Some(lease.lease_until),
        "the lease's deadline"
    );
    let keys: Vec<_> = (0..3).map(|i| fx.key(&format!("new-{i}"))).collect();
    let claims: Vec<_> = keys.iter().map(|k| fx.claim(k, "b")).collect();
    let answers = fx.backend.claim_many(&claims).await.expect("claim_many");
    for (key, answer) in keys.iter().zip(answers) {
        let ClaimOutcome::Acquired(lease) = answer else {
            panic!("a new key in a batch: {answer:?}");
        };
        let rec = fx.backend.get(key).await.expect("get").expect("record");
        assert_eq!(
            (lease.token, lease.attempts, lease.kind, &*rec.owner),
            (1, 1, ClaimKind::First, "b")
        );
        assert_eq!(
            rec.lease_until,
            Some(lease.lease_until),
            "{key}: the deadline"
        );
    }
}

/// Invariant 1: while a lease is live, every other claim is `InProgress` naming the holder.
pub async fn mutual_exclusion<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("mutex");
    let lease = fx.acquire(&fx.claim(&key, "a")).await;
    for owner in ["b", "c", "a"] {
        let answer = fx
            .backend
            .claim(&fx.claim(&key, owner))
            .await
            .expect("claim");
        assert!(in_progress_by(&answer, "a"), "claim by {owner}: {answer:?}");
    }
    fx.advance(fx.lease / 2).await;
    let answer = fx.backend.claim(&fx.claim(&key, "b")).await.expect("claim");
    assert!(
        in_progress_by(&answer, "a"),
        "half-way through the lease: {answer:?}"
    );
    let rec = fx.backend.get(&key).await.expect("get").expect("record");
    assert_eq!(
        (rec.token, rec.attempts),
        (lease.token, 1),
        "losers changed nothing"
    );
}

/// Invariant 1 under real concurrency: 64 simultaneous claims, exactly one `Acquired`.
pub async fn claim_race<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("race");
    let answers = race(&Arc::new(fx.backend), &key, fx.lease, 64, "w").await;
    let (winners, holders) = split_race(answers);
    assert_eq!(winners.len(), 1, "exactly one Acquired of 64: {winners:?}");
    assert_eq!(winners[0].token, 1);
    assert!(
        holders.iter().all(|o| *o == winners[0].owner),
        "losers name the winner: {holders:?}"
    );
}

/// Invariant 2: after a takeover, the old lease's complete, fail and extend are `Fenced`
/// and leave the record as it was; the same holds for a lease used after completion.
pub async fn fencing_after_takeover<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("fence");
    let old = fx.acquire(&fx.claim(&key, "a")).await;
    fx.lapse().await;
    let new = fx.acquire(&fx.claim(&key, "b")).await;
    refuses_all("after takeover", &fx.backend, &old, fx.lease).await;
    let b = &fx.backend;
    b.complete(&new, Bytes::from_static(b"new"), HOUR)
        .await
        .expect("complete");
    refuses_all("after complete", b, &new, fx.lease).await;
}

/// Every fencing call with `lease` is `Fenced` and leaves the record as it was.
async fn refuses_all<B: Backend>(when: &str, b: &B, lease: &Lease, ttl: Duration) {
    let before = b.get(&lease.key).await.expect("get");
    let body = Bytes::from_static(b"stale");
    assert_fenced(when, b.complete(lease, body, HOUR).await);
    assert_fenced(when, b.fail(lease, "x", FailureKind::Permanent, HOUR).await);
    assert_fenced(when, b.extend(lease, ttl).await);
    let after = b.get(&lease.key).await.expect("get");
    assert_eq!(after, before, "fenced calls {when} changed the record");
}

/// Invariant 2: a lease with the right token but another owner, or for a key never claimed,
/// is `Fenced` and creates nothing.
pub async fn fencing_foreign_lease<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("foreign");
    let real = fx.acquire(&fx.claim(&key, "a")).await;
    let forged = Lease {
        owner: "mallory".into(),
        ..real.clone()
    };
    let b = &fx.backend;
    assert_fenced(
        "forged complete",
        b.complete(&forged, Bytes::from_static(b"x"), HOUR).await,
    );
    assert_fenced(
        "forged fail",
        b.fail(&forged, "x", FailureKind::Retry, HOUR).await,
    );
    let nowhere = Lease {
        key: fx.key("never-claimed"),
        ..real.clone()
    };
    assert_fenced(
        "complete of unclaimed key",
        b.complete(&nowhere, Bytes::new(), HOUR).await,
    );
    assert_fenced(
        "extend of unclaimed key",
        b.extend(&nowhere, fx.lease).await,
    );
    assert_eq!(
        b.get(&nowhere.key).await.expect("get"),
        None,
        "a record appeared"
    );
    let rec = b.get(&key).await.expect("get").expect("record");
    assert_eq!((rec.state, &*rec.owner), (State::Processing, "a"));
}

/// Invariant 2 inside one process: the engine gives every lease of a process the same
/// owner, so when a lease lapses and the same owner claims the key again (a stalled task, a
/// partition revoked and assigned back), only the token fences the stale lease. Its
/// complete, fail, extend and release are `Fenced` and leave the record as it was; the new
/// lease still completes.
pub async fn fencing_same_owner<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let b = &fx.backend;
    let key = fx.key("same-owner");
    let old = fx.acquire(&fx.claim(&key, "a")).await;
    fx.lapse().await;
    let new = fx.acquire(&fx.claim(&key, "a")).await;
    assert_eq!(
        (new.token, new.attempts, new.kind),
        (old.token + 1, 2, ClaimKind::Takeover)
    );
    let before = b.get(&key).await.expect("get");
    let stale = Bytes::from_static(b"stale");
    assert_fenced("old complete", b.complete(&old, stale.clone(), HOUR).await);
    assert_fenced(
        "old fail",
        b.fail(&old, "x", FailureKind::Permanent, HOUR).await,
    );
    assert_fenced("old extend", b.extend(&old, fx.lease).await);
    assert_fenced("old release", b.release(&old).await);
    // The same through the batch call, which a store may write on another path.
    let batch = [
        Settlement::complete(old.clone(), stale.clone()),
        Settlement::fail(old.clone(), "x", FailureKind::Permanent),
        Settlement::release(old.clone()),
    ];
    let answers = b.settle_many(&batch, HOUR).await.expect("settle_many");
    assert_eq!(answers.len(), batch.len());
    for (answer, what) in answers.into_iter().zip(["complete", "fail", "release"]) {
        assert_fenced(&format!("old {what} in a batch"), answer);
    }
    let after = b.get(&key).await.expect("get");
    assert_eq!(
        after, before,
        "the old lease's fenced calls changed the record"
    );
    b.complete(&new, Bytes::from_static(b"new"), HOUR)
        .await
        .expect("the new lease completes");
    let answer = b.claim(&fx.claim(&key, "a")).await.expect("claim");
    assert_eq!(answer, ClaimOutcome::Completed(Bytes::from_static(b"new")));
}

/// Invariant 3: of many racing workers, exactly one `complete` succeeds and every later
/// claim replays its response byte for byte.
pub async fn one_winner_replay<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("winner");
    let backend = Arc::new(fx.backend);
    let completes = Arc::new(AtomicU32::new(0));
    let mut tasks = Vec::new();
    for i in 0u8..32 {
        let (backend, completes) = (Arc::clone(&backend), Arc::clone(&completes));
        let claim = idem_core::backend::Claim {
            owner: format!("w{i}").into(),
            ..crate::claim_of(&key, "", fx.lease)
        };
        tasks.push(tokio::spawn(async move {
            // Binary, not UTF-8, with a NUL: stores must keep bytes, not text.
            let mine = Bytes::from(vec![0xff, 0x00, i, 0xfe]);
            for _ in 0..2000 {
                match backend.claim(&claim).await.expect("claim") {
                    ClaimOutcome::Acquired(lease) => {
                        let res = backend.complete(&lease, mine.clone(), HOUR).await;
                        if res.is_ok() {
                            completes.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    ClaimOutcome::Completed(bytes) => return bytes,
                    ClaimOutcome::InProgress { .. } => tokio::task::yield_now().await,
                    other => panic!("unexpected {other:?}"),
                }
            }
            panic!("never saw Completed");
        }));
    }
    let mut seen = Vec::new();
    for t in tasks {
        seen.push(t.await.expect("task"));
    }
    assert_eq!(
        completes.load(Ordering::SeqCst),
        1,
        "exactly one complete succeeds"
    );
    assert!(
        seen.windows(2).all(|w| w[0] == w[1]),
        "all replays agree: {seen:?}"
    );
    assert_eq!(seen[0].len(), 4);
    assert_eq!(&seen[0][..2], &[0xff, 0x00]);
}

/// CONTRACT.md: a late `complete` whose lease lapsed but that nobody took over succeeds; the
/// token fences, not the clock.
pub async fn late_complete_without_takeover<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("late");
    let lease = fx.acquire(&fx.claim(&key, "a")).await;
    fx.lapse().await;
    fx.backend
        .complete(&lease, Bytes::from_static(b"late"), HOUR)
        .await
        .expect("a late complete with no takeover succeeds");
    let answer = fx.backend.claim(&fx.claim(&key, "b")).await.expect("claim");
    assert_eq!(answer, ClaimOutcome::Completed(Bytes::from_static(b"late")));
}

/// Invariant 4: granted tokens strictly increase across retries and takeovers, and each
/// claim says which it was.
pub async fn tokens_monotonic<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("tokens");
    let claim = idem_core::backend::Claim {
        max_attempts: 10,
        ..fx.claim(&key, "a")
    };
    let mut tokens = Vec::new();
    let mut kinds = Vec::new();
    let l = fx.acquire(&claim).await;
    tokens.push(l.token);
    kinds.push(l.kind);
    fx.backend
        .fail(&l, "boom", FailureKind::Retry, HOUR)
        .await
        .expect("fail");
    let l = fx.acquire(&claim).await;
    tokens.push(l.token);
    kinds.push(l.kind);
    fx.lapse().await;
    let l = fx.acquire(&claim).await;
    tokens.push(l.token);
    kinds.push(l.kind);
    fx.backend
        .fail(&l, "boom", FailureKind::Retry, HOUR)
        .await
        .expect("fail");
    let l = fx.acquire(&claim).await;
    tokens.push(l.token);
    kinds.push(l.kind);
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "tokens {tokens:?}");
    assert_eq!(tokens, [1, 2, 3, 4]);
    assert_eq!(
        kinds,
        [
            ClaimKind::First,
            ClaimKind::Retry,
            ClaimKind::Takeover,
            ClaimKind::Retry
        ]
    );
    assert_eq!(l.attempts, 4);
}

/// Invariant 5: a claimer that vanishes blocks the key only until its lease lapses; then
/// exactly one of many racing claimers takes over, with token + 1 and attempts + 1.
pub async fn crash_recovery<F: Factory>(f: &F) {
    let fx = f.setup().await;
    let key = fx.key("crash");
    let dead = fx.acquire(&fx.claim(&key, "dead")).await;
    drop(dead.clone()); // the worker vanishes: no complete, no fail, no extend
    let answer = fx.backend.claim(&fx.claim(&key, "x")).await.expect("claim");
    assert!(in_progress_by(&answer, "dead"), "before lapse: {answer:?}");
    fx.lapse().await;
    let answers = race(&Arc::new(fx.backend), &key, fx.lease, 16, "r").await;
    let (takeovers, holders) = split_race(answers);
    assert_eq!(takeovers.len(), 1, "exactly one takeover: {takeovers:?}");
    let t = &takeovers[0];
    assert!(holders.iter().all(|o| *o == t.owner), "{holders:?}");
    assert_eq!(
        (t.token, t.attempts, t.kind),
        (dead.token + 1, 2, ClaimKind::Takeover)
    );
}
