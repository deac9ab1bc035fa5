//! The conformance cases. Each takes a [`Factory`] and panics on a broken guarantee.
//! The invariant each case proves is named in its doc, numbered as in CONTRACT.md.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idem_core::backend::machine::lapsed_error;
use idem_core::backend::{ClaimOutcome, Settlement};
use idem_core::{
    Backend, ClaimKind, Engine, Error, FailureKind, Fingerprint, Lease, Outcome, State, WaitPolicy,
};

use crate::Factory;
pub use crate::batch::{release_hands_back, settle_many_agrees};
pub use crate::failures::{closed_port, corrupt_record, oversized_response, silent_server};
pub use crate::waiting::{
    wait_max_elapses, wait_survives_lost_notification, wait_wakes_on_complete,
    wait_watches_only_a_key_in_progress,
};

const HOUR: Duration = Duration::from_secs(3600);

fn in_progress_by(answer: &ClaimOutcome, owner: &str) -> bool {
    matches!(answer, ClaimOutcome::InProgress { owner: o, .. } if &**o == owner)
}

/// Panics unless `res` is `Fenced`. The panic names the caller's line, so a mutation run
/// can tell which check failed.
#[track_caller]
fn assert_fenced<T: std::fmt::Debug>(what: &str, res: Result<T, Error>) {
    assert!(
        matches!(res, Err(Error::Fenced { .. })),
        "{what}: expected Fenced, got {res:?}"
    );
}

/// The first claim of a new key is granted with token 1, attempt 1, and the record shows it.
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
    assert!(rec.lease_until.is_some());
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

/// `n` claims of `key` at once, by owners `{prefix}0`, `{prefix}1`, ..., on separate tasks.
async fn race<B: Backend + 'static>(
    backend: &Arc<B>,
    key: &idem_core::Key,
    lease: Duration,
    n: usize,
    prefix: &str,
) -> Vec<ClaimOutcome> {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let backend = Arc::clone(backend);
            let claim = crate::claim_of(key, &format!("{prefix}{i}"), lease);
            tokio::spawn(async move { backend.claim(&claim).await })
        })
        .collect();
    let mut answers = Vec::with_capacity(n);
    for t in tasks {
        answers.push(t.await.expect("task").expect("claim"));
    }
    answers
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

/// The granted leases, and the holders the other answers named; anything else panics.
fn split_race(answers: Vec<ClaimOutcome>) -> (Vec<Lease>, Vec<Arc<str>>) {
    let (mut winners, mut holders) = (Vec::new(), Vec::new());
    for answer in answers {
        match answer {
            ClaimOutcome::Acquired(l) => winners.push(l),
            ClaimOutcome::InProgress { owner, .. } => holders.push(owner),
            other => panic!("unexpected answer in a race: {other:?}"),
        }
    }
    (winners, holders)
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

/// `list` filters by namespace and state and honours the limit, where the backend can list;
/// a backend that cannot answers `Unsupported`.
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
    let mut ids: Vec<String> = (b.list(&filter).await.expect("list").into_iter())
        .map(|r| r.key.id().to_owned())
        .collect();
    ids.sort();
    assert_eq!(ids, ["l1", "l2", "l3"]);
    let done = idem_core::backend::ListFilter {
        state: Some(State::Completed),
        ..filter.clone()
    };
    let listed = b.list(&done).await.expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].response, Some(Bytes::from_static(b"x")));
    let two = idem_core::backend::ListFilter { limit: 2, ..filter };
    assert_eq!(b.list(&two).await.expect("list").len(), 2);
}

/// Invariant 9: random operation sequences from several owners, with time moves, give the
/// reference model's answers. Cases: `PROPTEST_CASES` (default 256).
pub async fn model_agreement<F: Factory>(f: &F) {
    crate::property::model_agreement(f).await
}
