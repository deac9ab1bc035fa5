//! The state machine of CONTRACT.md as pure functions: given the record a store holds (or
//! none), a request and the deciding clock's `now`, they return the answer and the record
//! to store. The in-memory backend and the [`Model`](crate::backend::Model) apply them as they are;
//! the other backends implement the same table in their store's language (Lua, SQL,
//! condition expressions) and the conformance suite checks that they agree.

use std::time::Duration;

use bytes::Bytes;

use crate::backend::Settle;
use crate::backend::{Claim, ClaimOutcome};
use crate::{ClaimKind, FailureKind, Lease, Record, State, Timestamp};

/// The error text a record gets when a claim finds its lease lapsed with no attempts left.
pub fn lapsed_error(attempts: u32) -> String {
    format!("lease lapsed during attempt {attempts}")
}

/// Whether `record` still exists at `now`: a record past its `expires_at` counts as absent.
pub fn is_live(record: &Record, now: Timestamp) -> bool {
    record.expires_at.is_none_or(|at| now < at)
}

/// Whether `record` is `Processing` under a lease that has not lapsed at `now`.
pub fn lease_is_live(record: &Record, now: Timestamp) -> bool {
    record.state == State::Processing && record.lease_until.is_some_and(|until| now < until)
}

/// Whether a claim of `record` with `max_attempts` answers `Poisoned` at `now`: a
/// permanent failure, or attempts spent on a failure or on a lease that lapsed.
pub fn is_poisoned(record: &Record, max_attempts: u32, now: Timestamp) -> bool {
    let spent = record.attempts >= max_attempts.max(1);
    match record.state {
        State::Failed => record.permanent || spent,
        State::Processing => spent && !lease_is_live(record, now),
        State::Completed => false,
    }
}

/// The answer to `claim` against `current`, and the record to write (`None`: unchanged).
pub fn claim(
    current: Option<&Record>,
    claim: &Claim,
    now: Timestamp,
) -> (ClaimOutcome, Option<Record>) {
    let current = current.filter(|r| is_live(r, now));
    let Some(rec) = current else {
        return grant(None, claim, ClaimKind::First, now);
    };
    if let (Some(have), Some(want)) = (rec.fingerprint, claim.fingerprint) {
        if have != want {
            return (ClaimOutcome::Mismatch, None);
        }
    }
    let max = claim.max_attempts.max(1);
    match rec.state {
        State::Completed => (
            ClaimOutcome::Completed(rec.response.clone().unwrap_or_default()),
            None,
        ),
        State::Failed if is_poisoned(rec, max, now) => (poisoned(rec), None),
        State::Failed => grant(Some(rec), claim, ClaimKind::Retry, now),
        State::Processing if lease_is_live(rec, now) => (
            ClaimOutcome::InProgress {
                owner: rec.owner.clone(),
                lease_until: rec.lease_until.unwrap_or(now),
            },
            None,
        ),
        State::Processing if is_poisoned(rec, max, now) => {
            let spent = Record {
                state: State::Failed,
                lease_until: None,
                error: Some(lapsed_error(rec.attempts)),
                expires_at: Some(now.saturating_add(claim.retention)),
                ..rec.clone()
            };
            (poisoned(&spent), Some(spent))
        }
        State::Processing => grant(Some(rec), claim, ClaimKind::Takeover, now),
    }
}

fn poisoned(rec: &Record) -> ClaimOutcome {
    ClaimOutcome::Poisoned {
        attempts: rec.attempts,
        error: rec.error.clone().unwrap_or_default(),
    }
}

/// The lease and the record of a claim of a key with no live record, granted at `now`:
/// token 1, attempt 1. For stores whose insert of a fresh record ran on the store's
/// clock, which then tells `now`.
pub fn first(claim: &Claim, now: Timestamp) -> (Lease, Record) {
    granted(None, claim, ClaimKind::First, now)
}

fn grant(
    prev: Option<&Record>,
    claim: &Claim,
    kind: ClaimKind,
    now: Timestamp,
) -> (ClaimOutcome, Option<Record>) {
    let (lease, record) = granted(prev, claim, kind, now);
    (ClaimOutcome::Acquired(lease), Some(record))
}

fn granted(
    prev: Option<&Record>,
    claim: &Claim,
    kind: ClaimKind,
    now: Timestamp,
) -> (Lease, Record) {
    let lease_until = now.saturating_add(claim.lease_ttl);
    let record = Record {
        key: claim.key.clone(),
        state: State::Processing,
        owner: claim.owner.clone(),
        token: prev.map_or(0, |r| r.token) + 1,
        attempts: prev.map_or(0, |r| r.attempts) + 1,
        lease_until: Some(lease_until),
        fingerprint: prev.map_or(claim.fingerprint, |r| r.fingerprint),
        response: None,
        error: None,
        permanent: false,
        expires_at: Some(lease_until.saturating_add(claim.retention)),
    };
    let lease = Lease {
        key: record.key.clone(),
        owner: record.owner.clone(),
        token: record.token,
        attempts: record.attempts,
        lease_until,
        kind,
        fingerprint: record.fingerprint,
    };
    (lease, record)
}

/// Whether `lease` still holds `current`: the record exists, is `Processing`, and carries
/// the lease's token and owner. The clock plays no part: a lapsed lease that nobody took
/// over still holds.
pub fn holds(current: Option<&Record>, lease: &Lease, now: Timestamp) -> bool {
    current.is_some_and(|r| {
        is_live(r, now)
            && r.state == State::Processing
            && r.token == lease.token
            && r.owner == lease.owner
    })
}

/// The record after `complete`, or `None` if the lease is fenced.
pub fn complete(
    current: Option<&Record>,
    lease: &Lease,
    response: Bytes,
    retention: Duration,
    now: Timestamp,
) -> Option<Record> {
    let mut rec = current.filter(|_| holds(current, lease, now))?.clone();
    completed(&mut rec, response, retention, now);
    Some(rec)
}

fn completed(rec: &mut Record, response: Bytes, retention: Duration, now: Timestamp) {
    rec.state = State::Completed;
    rec.lease_until = None;
    rec.response = Some(response);
    rec.error = None;
    rec.expires_at = Some(now.saturating_add(retention));
}

/// The record after `fail`, or `None` if the lease is fenced.
pub fn fail(
    current: Option<&Record>,
    lease: &Lease,
    error: &str,
    kind: FailureKind,
    retention: Duration,
    now: Timestamp,
) -> Option<Record> {
    let mut rec = current.filter(|_| holds(current, lease, now))?.clone();
    failed(&mut rec, error, kind, retention, now);
    Some(rec)
}

fn failed(rec: &mut Record, error: &str, kind: FailureKind, retention: Duration, now: Timestamp) {
    rec.state = State::Failed;
    rec.lease_until = None;
    rec.error = Some(error.to_owned());
    rec.permanent = kind == FailureKind::Permanent;
    rec.expires_at = Some(now.saturating_add(retention));
}

/// The record after `release`, or `None` if the lease is fenced: the attempt is taken
/// back and the lease lapses at `now`, so the next claim takes the key over at once. The
/// token stays: tokens never go down. Unlike `complete`, a release needs a live lease: a
/// lease that lapsed (or was released already) has no attempt left to give back, so a
/// second release is fenced and cannot take back a second attempt.
pub fn release(current: Option<&Record>, lease: &Lease, now: Timestamp) -> Option<Record> {
    let mut rec = current.filter(|r| may_release(r, lease, now))?.clone();
    released(&mut rec, now);
    Some(rec)
}

fn may_release(rec: &Record, lease: &Lease, now: Timestamp) -> bool {
    holds(Some(rec), lease, now) && lease_is_live(rec, now) && rec.attempts > 0
}

fn released(rec: &mut Record, now: Timestamp) {
    let keep = match (rec.expires_at, rec.lease_until) {
        (Some(at), Some(until)) => at.since(until),
        _ => Duration::ZERO,
    };
    rec.attempts -= 1;
    rec.lease_until = Some(now);
    rec.expires_at = Some(now.saturating_add(keep));
}

/// The record after `settle` of `lease`, or `None` if the lease is fenced. A response
/// over `max_response_bytes` is not this function's business: callers check it first.
pub fn settle(
    current: Option<&Record>,
    lease: &Lease,
    settle: &Settle,
    retention: Duration,
    now: Timestamp,
) -> Option<Record> {
    let mut rec = current.cloned()?;
    settle_in_place(&mut rec, lease, settle, retention, now).then_some(rec)
}

/// [`settle`] applied to the stored record itself, without copying it: whether the lease
/// held (when it did not, `record` is left as it was). The same transition, for a store
/// that holds its records in memory.
pub fn settle_in_place(
    record: &mut Record,
    lease: &Lease,
    settle: &Settle,
    retention: Duration,
    now: Timestamp,
) -> bool {
    match settle {
        Settle::Complete(response) => {
            let held = holds(Some(record), lease, now);
            if held {
                completed(record, response.clone(), retention, now);
            }
            held
        }
        Settle::Fail { error, kind } => {
            let held = holds(Some(record), lease, now);
            if held {
                failed(record, error, *kind, retention, now);
            }
            held
        }
        Settle::Release => {
            let held = may_release(record, lease, now);
            if held {
                released(record, now);
            }
            held
        }
    }
}

/// The record after `extend` (lease until `now + ttl`, expiry moved by as much), or `None`
/// if the lease is fenced.
pub fn extend(
    current: Option<&Record>,
    lease: &Lease,
    ttl: Duration,
    now: Timestamp,
) -> Option<Record> {
    let rec = current.filter(|_| holds(current, lease, now))?;
    let old_until = rec.lease_until.unwrap_or(now);
    let new_until = now.saturating_add(ttl);
    let keep = rec
        .expires_at
        .map_or(Duration::ZERO, |at| at.since(old_until));
    Some(Record {
        lease_until: Some(new_until),
        expires_at: Some(new_until.saturating_add(keep)),
        ..rec.clone()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Fingerprint, Key};

    fn req(owner: &str) -> Claim {
        Claim {
            key: Key::new("ns", "k").unwrap(),
            owner: owner.into(),
            lease_ttl: Duration::from_secs(10),
            fingerprint: Some(Fingerprint::of(b"p")),
            max_attempts: 2,
            retention: Duration::from_secs(100),
        }
    }

    fn lease_of(out: ClaimOutcome) -> Lease {
        match out {
            ClaimOutcome::Acquired(l) => l,
            other => panic!("expected Acquired, got {other:?}"),
        }
    }

    #[test]
    fn lapsed_lease_with_attempts_spent_turns_poisoned_at_claim() {
        let t0 = Timestamp::from_millis(1_000);
        let (out, rec) = claim(None, &req("a"), t0);
        assert_eq!(lease_of(out).kind, ClaimKind::First);
        let t1 = t0.saturating_add(Duration::from_secs(11));
        let (out, rec) = claim(rec.as_ref(), &req("b"), t1);
        let lease = lease_of(out);
        assert_eq!(
            (lease.kind, lease.token, lease.attempts),
            (ClaimKind::Takeover, 2, 2)
        );
        let t2 = t1.saturating_add(Duration::from_secs(11));
        let (out, rec) = claim(rec.as_ref(), &req("c"), t2);
        assert_eq!(
            out,
            ClaimOutcome::Poisoned {
                attempts: 2,
                error: lapsed_error(2)
            }
        );
        let rec = rec.expect("the spent record is written");
        assert_eq!(rec.state, State::Failed);
        assert_eq!(rec.lease_until, None, "a failed record holds no lease");
        assert_eq!(
            rec.expires_at,
            Some(t2.saturating_add(Duration::from_secs(100))),
            "retention counts from the claim that found the lease spent"
        );
    }

    /// The text is part of the contract: Redis's claim script writes the same words.
    #[test]
    fn lapsed_error_names_the_attempt() {
        assert_eq!(lapsed_error(3), "lease lapsed during attempt 3");
    }

    /// A record is gone at its `expires_at` millisecond, not after it (Redis drops a key
    /// one millisecond past its `PEXPIRETIME`, which the Redis backend sets one earlier).
    #[test]
    fn a_record_expires_at_its_expiry_millisecond() {
        let (_, rec) = claim(None, &req("a"), Timestamp::from_millis(0));
        let rec = rec.unwrap();
        let at = rec.expires_at.unwrap();
        assert!(is_live(&rec, Timestamp::from_millis(at.as_millis() - 1)));
        assert!(!is_live(&rec, at));
    }

    /// Each transition writes its whole record: nothing of the attempt before it stays.
    #[test]
    fn settles_and_retries_rewrite_lease_error_and_expiry() {
        let t0 = Timestamp::from_millis(1_000);
        let (out, rec) = claim(None, &req("a"), t0);
        let lease = lease_of(out);
        let t1 = t0.saturating_add(Duration::from_secs(1));
        let retention = Duration::from_secs(50);
        let failed = fail(
            rec.as_ref(),
            &lease,
            "boom",
            FailureKind::Retry,
            retention,
            t1,
        );
        let failed = failed.expect("the holder fails");
        assert_eq!(failed.lease_until, None);
        assert_eq!(failed.expires_at, Some(t1.saturating_add(retention)));
        assert_eq!(failed.error.as_deref(), Some("boom"));

        let t2 = t1.saturating_add(Duration::from_secs(1));
        let (out, rec) = claim(Some(&failed), &req("a"), t2);
        let lease = lease_of(out);
        let retried = rec.expect("the retry is written");
        assert_eq!(lease.kind, ClaimKind::Retry);
        assert_eq!(
            retried.lease_until,
            Some(t2.saturating_add(Duration::from_secs(10)))
        );
        assert_eq!(
            retried.expires_at,
            Some(t2.saturating_add(Duration::from_secs(110)))
        );

        let t3 = t2.saturating_add(Duration::from_secs(1));
        let done = complete(
            Some(&retried),
            &lease,
            Bytes::from_static(b"ok"),
            retention,
            t3,
        );
        let done = done.expect("the holder completes");
        assert_eq!(done.state, State::Completed);
        assert_eq!(done.lease_until, None);
        assert_eq!(done.error, None, "the earlier attempt's error is gone");
        assert_eq!(done.expires_at, Some(t3.saturating_add(retention)));
    }

    #[test]
    fn release_takes_the_attempt_back_and_lapses_the_lease_now() {
        let t0 = Timestamp::from_millis(1_000);
        let (out, rec) = claim(None, &req("a"), t0);
        let lease = lease_of(out);
        let t1 = t0.saturating_add(Duration::from_secs(1));
        let rec = release(rec.as_ref(), &lease, t1).unwrap();
        assert_eq!((rec.attempts, rec.token), (0, 1));
        assert_eq!(rec.lease_until, Some(t1));
        assert_eq!(
            rec.expires_at,
            Some(t1.saturating_add(Duration::from_secs(100)))
        );
        assert!(
            release(Some(&rec), &lease, t1).is_none(),
            "a second release is fenced"
        );
        let (out, _) = claim(Some(&rec), &req("b"), t1);
        let next = lease_of(out);
        assert_eq!((next.token, next.attempts), (2, 1));
        let stranger = Lease {
            owner: "b".into(),
            ..lease
        };
        assert!(release(Some(&rec), &stranger, t1).is_none());
    }

    #[test]
    fn extend_moves_expiry_with_the_lease() {
        let t0 = Timestamp::from_millis(0);
        let (out, rec) = claim(None, &req("a"), t0);
        let lease = lease_of(out);
        let t1 = t0.saturating_add(Duration::from_secs(5));
        let rec = extend(rec.as_ref(), &lease, Duration::from_secs(10), t1).unwrap();
        assert_eq!(rec.lease_until, Some(Timestamp::from_millis(15_000)));
        assert_eq!(rec.expires_at, Some(Timestamp::from_millis(115_000)));
    }
}
