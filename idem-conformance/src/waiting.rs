//! An engine waiting on a key another worker holds ([`WaitPolicy::Wait`]): it returns the
//! holder's response once it is stored (woken by the store where the backend notifies),
//! still returns when the notification is lost (by reading again), and answers
//! `InProgress` once `max` runs out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use idem_core::clock::Clock;
use idem_core::{Backend, Engine, Outcome, Timestamp, WaitPolicy};

use idem_core::layer::{BackendExt, ChaosLayer, Fault};

use crate::{CallLog, Factory, Fixture, Time};

const HOUR: Duration = Duration::from_secs(3600);

/// A manual clock set to the real time: the engine bounds a wait by the holder's lease,
/// read against the real clock, so the store's clock must agree with it here.
fn real_time<B>(fx: &Fixture<B>) {
    if let Time::Manual(clock) = &fx.time {
        clock.advance(Timestamp::now().since(clock.now()));
    }
}

/// What one wait came to, and how long after the holder's complete (if any) returned it
/// returned (after the waiter was answered a second time, past its watch, without a complete).
struct Waited {
    outcome: Outcome,
    after: Duration,
    /// Whether the backend says it notifies.
    notify: bool,
    poll: Duration,
    max: Duration,
    /// How many watches the waiter took.
    watches: usize,
}

/// Holds a key with the fixture's backend, runs a waiting engine on it with the `poll`
/// and `max` that `times` gives for the fixture's lease (notifications lost if `deaf`),
/// and once the waiter has watched the key and been answered `InProgress` again,
/// completes the key (if `complete`).
async fn wait_on<F: Factory>(
    f: &F,
    deaf: bool,
    complete: bool,
    times: impl Fn(Duration, bool) -> (Duration, Duration),
) -> Waited {
    let fx = f.setup().await;
    real_time(&fx);
    let notify = fx.backend.capabilities().notify;
    let (poll, max) = times(fx.lease, notify);
    let key = fx.key("watched");
    let holder = fx.acquire(&fx.claim(&key, "holder")).await;
    let backend = Arc::new(fx.backend);
    let chaos = ChaosLayer::new();
    chaos.set(Fault::Notify, deaf);
    let log = CallLog::new();
    let tap = Arc::new(Arc::clone(&backend).layer(chaos).layer(log.clone()));
    let engine = Engine::builder(tap.clone())
        .owner("waiter")
        .lease_ttl(fx.lease)
        .wait(WaitPolicy::Wait { poll, max })
        .build()
        .expect("engine");
    let waiter = tokio::spawn(async move {
        let outcome = engine
            .execute(&key, b"p", |_| async {
                Ok(Bytes::from_static(b"the waiter ran"))
            })
            .await;
        (outcome, Instant::now())
    });
    // Two claims answered: the one that found the key in progress, then the first after
    // the waiter took its watch. A complete before the watch would be read by that claim,
    // and the case would prove nothing about waking.
    log.claims_answered(2).await;
    if complete {
        let response = Bytes::from_static(b"the holder's response");
        backend
            .complete(&holder, response, HOUR)
            .await
            .expect("complete");
    }
    // The store may notify at its commit, before `complete` returns: then `after` is 0.
    let completed = Instant::now();
    let (outcome, returned) = waiter.await.expect("waiter task");
    Waited {
        outcome: outcome.expect("execute"),
        after: returned.saturating_duration_since(completed),
        notify,
        poll,
        max,
        watches: log.watches(),
    }
}

/// A waiter blocked on a key in flight returns the holder's response once it is stored;
/// where the backend notifies, well within half the poll interval (measured from the
/// return of the complete; the figure is printed).
pub async fn wait_wakes_on_complete<F: Factory>(f: &F) {
    let waited = wait_on(f, false, true, |lease, notify| {
        // Polling, only the answer is checked: a short poll keeps the case quick.
        let poll = if notify { lease } else { lease / 10 };
        (poll, 10 * lease)
    })
    .await;
    let (notify, poll) = (waited.notify, waited.poll);
    eprintln!(
        "wait_wakes_on_complete: returned {:?} after the complete (notify: {notify}, poll {poll:?})",
        waited.after
    );
    assert_eq!(
        waited.outcome,
        Outcome::Replayed(Bytes::from_static(b"the holder's response"))
    );
    assert_eq!(waited.watches, 1, "a waiter watches its key once");
    if notify {
        assert!(
            waited.after < poll / 2,
            "a notified waiter returned {:?} after the complete; poll is {poll:?}",
            waited.after
        );
    }
}

/// A waiter whose notifications are all lost still returns the holder's response, by
/// reading the record again at the poll interval.
pub async fn wait_survives_lost_notification<F: Factory>(f: &F) {
    let waited = wait_on(f, true, true, |lease, _| {
        ((lease / 5).min(Duration::from_millis(200)), 2 * lease)
    })
    .await;
    assert_eq!(
        waited.outcome,
        Outcome::Replayed(Bytes::from_static(b"the holder's response"))
    );
}

/// A waiter on a key whose holder never settles answers `InProgress` once `max` has run
/// out, before the holder's lease lapses.
pub async fn wait_max_elapses<F: Factory>(f: &F) {
    let waited = wait_on(f, false, false, |lease, _| {
        let max = (lease / 4).min(Duration::from_millis(300));
        (max / 4, max)
    })
    .await;
    let max = waited.max;
    assert!(
        matches!(&waited.outcome, Outcome::InProgress { owner, .. } if &**owner == "holder"),
        "expected InProgress by the holder, got {:?}",
        waited.outcome
    );
    assert!(
        waited.after >= max * 3 / 4,
        "answered after {:?}, before max ({max:?}) ran out",
        waited.after
    );
}

/// A waiting engine watches a key only once a claim has found it in progress: a free
/// key's `execute` is one claim and one complete, with no watch (on PostgreSQL a watch is
/// a statement of its own).
pub async fn wait_watches_only_a_key_in_progress<F: Factory>(f: &F) {
    let fx = f.setup().await;
    real_time(&fx);
    let key = fx.key("free");
    let log = CallLog::new();
    let tap = Arc::new(Arc::new(fx.backend).layer(log.clone()));
    let engine = Engine::builder(tap)
        .owner("waiter")
        .lease_ttl(fx.lease)
        .wait(WaitPolicy::Wait {
            poll: fx.lease,
            max: 10 * fx.lease,
        })
        .build()
        .expect("engine");
    let outcome = engine
        .execute(&key, b"p", |_| async { Ok(Bytes::from_static(b"ran")) })
        .await
        .expect("execute");
    assert_eq!(outcome, Outcome::Executed(Bytes::from_static(b"ran")));
    assert_eq!(log.watches(), 0, "a free key was watched");
    let calls = log.calls();
    assert!(
        matches!(calls[..], [("claim", 1), (_, 1)]),
        "a free key's execute: {calls:?}"
    );
}
