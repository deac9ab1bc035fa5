//! Engine behaviour on the in-memory backend, on tokio's paused clock: the backend's
//! clock follows tokio time, so leases lapse exactly when heartbeats stop.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idem_core::backend::ClaimOutcome;
use idem_core::clock::Clock;
use idem_core::layer::{BackendExt, ChaosLayer, Fault};
use idem_core::{
    Backend, Engine, Error, HandlerError, Key, MemoryBackend, Outcome, State, Timestamp, WaitPolicy,
};
use tokio::time::{Instant, sleep};

#[derive(Debug)]
struct TokioClock(Instant);

impl Clock for TokioClock {
    fn now(&self) -> Timestamp {
        Timestamp::from_millis(1_000_000).saturating_add(self.0.elapsed())
    }
}

const LEASE: Duration = Duration::from_secs(3);

fn memory() -> MemoryBackend {
    MemoryBackend::with_clock(TokioClock(Instant::now()))
}

fn engine(backend: Arc<dyn Backend>, owner: &str) -> Engine {
    Engine::builder(backend)
        .owner(owner)
        .lease_ttl(LEASE)
        .max_attempts(3)
        .build()
        .expect("engine")
}

fn key(id: &str) -> Key {
    Key::new("engine-tests", id).expect("key")
}

fn ok(text: &'static str) -> Result<Bytes, HandlerError> {
    Ok(Bytes::from_static(text.as_bytes()))
}

#[tokio::test(start_paused = true)]
async fn heartbeat_keeps_a_long_handler_lease_alive() {
    let backend: Arc<dyn Backend> = Arc::new(memory());
    let a = engine(Arc::clone(&backend), "a");
    let k = key("long");
    let run = tokio::spawn({
        let k = k.clone();
        async move {
            a.execute(&k, b"p", |_| async {
                sleep(LEASE * 4).await;
                ok("slow")
            })
            .await
        }
    });
    sleep(LEASE * 3).await; // three leases in: without heartbeats it would have lapsed
    let b = engine(Arc::clone(&backend), "b");
    let answer = b
        .execute(&k, b"p", |_| async { ok("b ran") })
        .await
        .expect("b");
    assert!(
        matches!(&answer, Outcome::InProgress { owner, .. } if &**owner == "a"),
        "{answer:?}"
    );
    let done = run.await.expect("task").expect("execute");
    assert_eq!(done, Outcome::Executed(Bytes::from_static(b"slow")));
    let rec = backend.get(&k).await.expect("get").expect("record");
    assert_eq!((rec.state, rec.token), (State::Completed, 1));
}

#[tokio::test(start_paused = true)]
async fn a_lost_lease_cancels_the_handler_and_yields_fenced() {
    let chaos = ChaosLayer::new();
    let faulty = memory().layer(chaos.clone());
    let backend: Arc<dyn Backend> = Arc::new(faulty.clone());
    let a = engine(Arc::clone(&backend), "a");
    let k = key("lost");
    chaos.set(Fault::Extend, true); // heartbeats fail: the lease lapses under a live worker
    let told = Arc::new(AtomicU32::new(0));
    let run = tokio::spawn({
        let (k, told) = (k.clone(), Arc::clone(&told));
        async move {
            a.execute(&k, b"p", |ctx| async move {
                tokio::select! {
                    _ = ctx.fenced() => {
                        told.fetch_add(1, Ordering::SeqCst);
                        Err(HandlerError::retry("stopped: lease lost"))
                    }
                    _ = sleep(LEASE * 20) => ok("too late"),
                }
            })
            .await
        }
    });
    sleep(LEASE + Duration::from_millis(100)).await;
    let taken = backend
        .claim(&engine(Arc::clone(&backend), "b").claim_for(&k, b"p"))
        .await
        .expect("claim");
    let ClaimOutcome::Acquired(b_lease) = taken else {
        panic!("b should take over, got {taken:?}");
    };
    assert_eq!(b_lease.token, 2);
    chaos.set(Fault::Extend, false); // the next heartbeat reaches the store and is fenced
    let outcome = run.await.expect("task").expect("execute");
    assert_eq!(outcome, Outcome::Fenced);
    assert_eq!(told.load(Ordering::SeqCst), 1, "the handler was told");
    let rec = backend.get(&k).await.expect("get").expect("record");
    assert_eq!(
        (rec.state, &*rec.owner, rec.token),
        (State::Processing, "b", 2)
    );
}

#[tokio::test(start_paused = true)]
async fn a_panic_is_a_failed_attempt_and_the_next_one_runs() {
    let backend: Arc<dyn Backend> = Arc::new(memory());
    let a = engine(Arc::clone(&backend), "a");
    let k = key("panic");
    let first = a
        .execute(&k, b"p", |_| async { panic!("card reader on fire") })
        .await
        .expect("execute");
    match first {
        Outcome::Failed { attempts: 1, error } => {
            assert!(error.contains("card reader on fire"), "{error}")
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    let rec = backend.get(&k).await.expect("get").expect("record");
    assert_eq!(rec.state, State::Failed);
    let second = a.execute(&k, b"p", |_| async { ok("fine") }).await;
    assert_eq!(
        second.expect("execute"),
        Outcome::Executed(Bytes::from_static(b"fine"))
    );
}

#[tokio::test(start_paused = true)]
async fn attempts_run_out_into_poisoned() {
    let backend: Arc<dyn Backend> = Arc::new(memory());
    let a = engine(Arc::clone(&backend), "a");
    let k = key("poison");
    let runs = Arc::new(AtomicU32::new(0));
    let mut outcomes = Vec::new();
    for _ in 0..5 {
        let runs = Arc::clone(&runs);
        let out = a
            .execute(&k, b"p", |_| async move {
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                Err::<Bytes, _>(HandlerError::retry(format!("declined {n}")))
            })
            .await
            .expect("execute");
        outcomes.push(out);
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        3,
        "the handler ran max_attempts times"
    );
    assert!(matches!(outcomes[0], Outcome::Failed { attempts: 1, .. }));
    assert!(matches!(outcomes[1], Outcome::Failed { attempts: 2, .. }));
    for out in &outcomes[2..] {
        assert_eq!(
            *out,
            Outcome::Poisoned {
                attempts: 3,
                error: "declined 3".into()
            }
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_permanent_error_poisons_at_once() {
    let backend: Arc<dyn Backend> = Arc::new(memory());
    let a = engine(backend, "a");
    let k = key("permanent");
    let out = a
        .execute(&k, b"p", |_| async {
            Err(HandlerError::permanent("no such account"))
        })
        .await
        .expect("execute");
    let poisoned = Outcome::Poisoned {
        attempts: 1,
        error: "no such account".into(),
    };
    assert_eq!(out, poisoned);
    let again = a.execute(&k, b"p", |_| async { ok("never") }).await;
    assert_eq!(again.expect("execute"), poisoned);
}

#[tokio::test(start_paused = true)]
async fn an_oversized_response_poisons_with_the_reason() {
    let backend: Arc<dyn Backend> = Arc::new(memory().with_max_response_bytes(16));
    let a = engine(backend, "a");
    let out = a
        .execute(&key("big"), b"p", |_| async {
            Ok(Bytes::from(vec![0u8; 17]))
        })
        .await
        .expect("execute");
    match out {
        Outcome::Poisoned { attempts: 1, error } => {
            assert_eq!(error, "response is 17 bytes, over the limit of 16")
        }
        other => panic!("expected Poisoned, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_failed_completion_surfaces_and_the_key_is_not_done() {
    let chaos = ChaosLayer::new();
    let faulty = memory().layer(chaos.clone());
    let backend: Arc<dyn Backend> = Arc::new(faulty.clone());
    let a = engine(Arc::clone(&backend), "a");
    let k = key("swallowed");
    chaos.set(Fault::Complete, true);
    let res = a.execute(&k, b"p", |_| async { ok("charged") }).await;
    assert!(matches!(res, Err(Error::Unavailable { .. })), "{res:?}");
    let rec = faulty.inner().get(&k).await.expect("get").expect("record");
    assert_eq!(
        rec.state,
        State::Processing,
        "not Completed: the offset must not move"
    );
}

#[tokio::test(start_paused = true)]
async fn another_payload_under_a_known_key_is_a_mismatch() {
    let a = engine(Arc::new(memory()), "a");
    let k = key("fp");
    a.execute(&k, b"pay 10", |_| async { ok("paid") })
        .await
        .expect("first");
    let out = a.execute(&k, b"pay 99", |_| async { ok("paid") }).await;
    assert_eq!(out.expect("second"), Outcome::Mismatch);
    let same = a
        .execute(&k, b"pay 10", |_| async { ok("paid again") })
        .await;
    assert_eq!(
        same.expect("third"),
        Outcome::Replayed(Bytes::from_static(b"paid"))
    );
}

#[tokio::test(start_paused = true)]
async fn json_helpers_store_and_replay_typed_responses() {
    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct Receipt {
        id: u64,
        amount_cents: i64,
    }
    let a = engine(Arc::new(memory()), "a");
    let k = key("json");
    let first = a
        .execute_json(&k, b"p", |ctx| async move {
            Ok(Receipt {
                id: ctx.token(),
                amount_cents: -250,
            })
        })
        .await
        .expect("first");
    let receipt = Receipt {
        id: 1,
        amount_cents: -250,
    };
    assert_eq!(first.response(), Some(&receipt));
    assert!(matches!(first, Outcome::Executed(_)));
    let second = a
        .execute_json::<Receipt, _, _>(&k, b"p", |_| async { Err(HandlerError::retry("x")) })
        .await
        .expect("second");
    assert_eq!(second, Outcome::Replayed(receipt));
    let wrong = a
        .execute_json::<Vec<String>, _, _>(&k, b"p", |_| async { Ok(vec![]) })
        .await;
    assert!(matches!(wrong, Err(Error::Corrupt { .. })), "{wrong:?}");
}

#[tokio::test(start_paused = true)]
async fn wait_policy_waits_for_the_holder_then_replays() {
    let backend: Arc<dyn Backend> = Arc::new(memory());
    let a = engine(Arc::clone(&backend), "a");
    let b = Engine::builder(Arc::clone(&backend))
        .owner("b")
        .lease_ttl(LEASE)
        .wait(WaitPolicy::Wait {
            poll: Duration::from_millis(100),
            max: LEASE * 10,
        })
        .build()
        .expect("engine");
    let k = key("wait");
    let run = tokio::spawn({
        let k = k.clone();
        async move {
            a.execute(&k, b"p", |_| async {
                sleep(LEASE * 2).await;
                ok("from a")
            })
            .await
        }
    });
    sleep(Duration::from_millis(10)).await;
    let out = b.execute(&k, b"p", |_| async { ok("from b") }).await;
    assert_eq!(
        out.expect("b"),
        Outcome::Replayed(Bytes::from_static(b"from a"))
    );
    assert!(matches!(run.await.expect("task"), Ok(Outcome::Executed(_))));
}

#[test]
fn builder_refuses_settings_that_cannot_work() {
    let backend: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let cases = [
        Engine::builder(Arc::clone(&backend)).heartbeat(Duration::from_secs(30)),
        Engine::builder(Arc::clone(&backend)).max_attempts(0),
        Engine::builder(Arc::clone(&backend)).lease_ttl(Duration::ZERO),
        Engine::builder(Arc::clone(&backend)).owner(""),
    ];
    for builder in cases {
        let res = builder.build();
        assert!(matches!(res, Err(Error::Config { .. })), "{res:?}");
    }
    let engine = Engine::builder(backend).build().expect("defaults build");
    assert!(engine.owner().contains(&std::process::id().to_string()));
}

/// `Duration::MAX` for "never" is a century: a handler runs and heartbeats under it, and
/// the record's lease and expiry are a century away, not an overflow.
#[tokio::test(start_paused = true)]
async fn durations_of_duration_max_are_a_century() {
    let backend: Arc<dyn Backend> = Arc::new(memory());
    let engine = Engine::builder(Arc::clone(&backend))
        .owner("a")
        .lease_ttl(Duration::MAX)
        .retention(Duration::MAX)
        .build()
        .expect("engine");
    assert_eq!(engine.lease_ttl(), idem_core::clock::capped(Duration::MAX));
    let k = key("forever");
    let answer = engine
        .execute(&k, b"p", |_| async {
            tokio::task::yield_now().await;
            ok("done")
        })
        .await
        .expect("execute");
    assert_eq!(answer, Outcome::Executed(Bytes::from_static(b"done")));
    let rec = backend.get(&k).await.expect("get").expect("record");
    let century =
        Timestamp::from_millis(1_000_000).saturating_add(Duration::from_secs(99 * 365 * 86_400));
    assert_eq!(rec.state, State::Completed);
    assert!(rec.expires_at.is_some_and(|at| at > century), "{rec:?}");
}
