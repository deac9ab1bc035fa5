//! The consumer on a real RabbitMQ (`IDEM_RABBITMQ_URL`): each key runs once and every
//! delivery is acked; bad messages are dead-lettered with their reason; a crash between
//! the settle and the ack redelivers, and the store replays; a store outage acks nothing
//! until the store is back; a lost connection is made again.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{Effects, Queue, Watch};
use idem_core::layer::{BackendExt, ChaosLayer, Fault};
use idem_core::{Engine, HandlerError, MemoryBackend};
use idem_rabbitmq::{HEADER_ATTEMPTS, HEADER_QUEUE, HEADER_REASON, IdemConsumer, Point};
use tokio_util::sync::CancellationToken;

const WITHIN: Duration = Duration::from_secs(30);

fn engine(backend: Arc<dyn idem_core::Backend>) -> Engine {
    Engine::builder(backend)
        .lease_ttl(Duration::from_secs(2))
        .max_attempts(3)
        .build()
        .expect("engine")
}

/// A consumer of `queue` whose handler records its effect, fails permanently on a payload
/// starting with `bad`, and answers the payload reversed.
fn consumer(
    queue: &str,
    engine: Engine,
    effects: &Effects,
    watch: &Arc<Watch>,
    stop: &CancellationToken,
) -> IdemConsumer {
    let effects = effects.clone();
    IdemConsumer::builder(common::url())
        .queue(queue)
        .engine(engine)
        .probe(watch.clone())
        .backoff(Duration::from_millis(10), Duration::from_millis(100))
        .shutdown(stop.clone().cancelled_owned())
        .handler(move |m, _ctx| {
            let effects = effects.clone();
            async move {
                effects.record(&m);
                if m.payload().starts_with(b"bad") {
                    return Err(HandlerError::permanent("a bad payment"));
                }
                Ok(Bytes::from(
                    m.payload().iter().rev().copied().collect::<Vec<u8>>(),
                ))
            }
        })
        .build()
        .expect("build")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_runs_once_and_every_delivery_is_acked() {
    let conn = common::connect().await;
    let q = Queue::fresh(&conn, "once").await;
    for copy in 0..3 {
        for k in 0..20 {
            let key = format!("pay-{k}");
            q.publish(Some(key.as_bytes()), format!("charge {k}").as_bytes())
                .await;
        }
        let _ = copy;
    }
    let (effects, watch, stop) = (Effects::default(), Watch::new(), CancellationToken::new());
    let engine = engine(Arc::new(MemoryBackend::new()));
    let run = tokio::spawn(consumer(&q.name, engine, &effects, &watch, &stop).run());
    watch.acked(60, WITHIN).await;
    stop.cancel();
    run.await.expect("join").expect("run");

    for k in 0..20 {
        assert_eq!(
            effects.of(&format!("pay-{k}")),
            1,
            "pay-{k} ran more or less than once"
        );
    }
    assert_eq!(watch.acks(), 60, "each delivery acked once");
    assert_eq!(q.ready(&q.name).await, 0, "nothing left in the queue");
    assert_eq!(
        q.ready(&format!("{}.dlq", q.name)).await,
        0,
        "nothing dead-lettered"
    );
    q.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_messages_are_dead_lettered_with_their_reason_and_acked() {
    let conn = common::connect().await;
    let q = Queue::fresh(&conn, "letters").await;
    q.publish(None, b"no key").await;
    q.publish(Some(&[0xff, 0xfe]), b"binary key").await;
    q.publish(
        Some("k".repeat(idem_core::MAX_ID_BYTES + 1).as_bytes()),
        b"long key",
    )
    .await;
    q.publish(Some(b"poison"), b"bad payment").await;
    q.publish(Some(b"twice"), b"first payload").await;
    q.publish(Some(b"twice"), b"second payload").await;
    q.publish(Some(b"fine"), b"good payment").await;

    let (effects, watch, stop) = (Effects::default(), Watch::new(), CancellationToken::new());
    let engine = engine(Arc::new(MemoryBackend::new()));
    let run = tokio::spawn(consumer(&q.name, engine, &effects, &watch, &stop).run());
    watch.acked(7, WITHIN).await;
    stop.cancel();
    run.await.expect("join").expect("run");

    let dlq = format!("{}.dlq", q.name);
    let mut letters = q.take_all(&dlq).await;
    letters.sort_by(|a, b| a.0.cmp(&b.0));
    let got: Vec<(String, String)> = letters
        .iter()
        .map(|(payload, h)| {
            (
                String::from_utf8_lossy(payload).into_owned(),
                h[HEADER_REASON].clone(),
            )
        })
        .collect();
    let want = [
        ("bad payment", "poisoned"),
        ("binary key", "invalid-key"),
        ("long key", "invalid-key"),
        ("no key", "missing-key"),
        ("second payload", "mismatch"),
    ];
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(p, r)| ((*p).to_owned(), (*r).to_owned()))
        .collect();
    assert_eq!(got, want);
    for (payload, h) in &letters {
        assert_eq!(h[HEADER_QUEUE], q.name, "{payload:?} names its queue");
    }
    let poisoned = &letters[0].1;
    assert_eq!(
        poisoned[HEADER_ATTEMPTS], "1",
        "a permanent failure poisons at once"
    );
    assert_eq!(effects.of("poison"), 1);
    assert_eq!((effects.of("twice"), effects.of("fine")), (1, 1));
    assert_eq!(q.ready(&q.name).await, 0, "every message acked");
    q.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_settle_redelivers_and_the_store_replays() {
    let conn = common::connect().await;
    let q = Queue::fresh(&conn, "crash").await;
    for k in 0..10 {
        q.publish(
            Some(format!("pay-{k}").as_bytes()),
            format!("charge {k}").as_bytes(),
        )
        .await;
    }
    let store: Arc<dyn idem_core::Backend> = Arc::new(MemoryBackend::new());
    let effects = Effects::default();

    // The first consumer settles the fifth message, then dies before its ack.
    let (first, stop) = (Watch::new(), CancellationToken::new());
    first.crash_at(Point::AfterSettle, b"charge 4");
    let dead = consumer(&q.name, engine(store.clone()), &effects, &first, &stop);
    tokio::time::timeout(WITHIN, dead.run())
        .await
        .expect("the crashed consumer returns")
        .expect("run");
    assert_eq!(first.acks(), 4, "acked up to the crash");
    assert_eq!(effects.of("pay-4"), 1, "the fifth ran before the crash");

    // The second gets the unacked ones back; the fifth is a redelivery the store replays.
    let (second, stop) = (Watch::new(), CancellationToken::new());
    let run = tokio::spawn(consumer(&q.name, engine(store), &effects, &second, &stop).run());
    second.acked(6, WITHIN).await;
    stop.cancel();
    run.await.expect("join").expect("run");
    let acked = second.acked.lock().expect("lock").clone();
    assert!(
        acked.contains(&("pay-4".to_owned(), true)),
        "the fifth came back redelivered: {acked:?}"
    );
    for k in 0..10 {
        assert_eq!(
            effects.of(&format!("pay-{k}")),
            1,
            "pay-{k}'s effect ran once"
        );
    }
    assert_eq!(q.ready(&q.name).await, 0);
    q.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_acks_nothing_until_the_store_is_back() {
    let conn = common::connect().await;
    let q = Queue::fresh(&conn, "outage").await;
    for k in 0..5 {
        q.publish(Some(format!("pay-{k}").as_bytes()), b"charge")
            .await;
    }
    let chaos = ChaosLayer::new();
    chaos.set(Fault::Claim, true);
    let store = MemoryBackend::new().layer(chaos.clone());
    let (effects, watch, stop) = (Effects::default(), Watch::new(), CancellationToken::new());
    let run =
        tokio::spawn(consumer(&q.name, engine(Arc::new(store)), &effects, &watch, &stop).run());

    // Claims are refused and asked again; nothing runs, nothing is acked.
    watch.claimed(5, WITHIN).await;
    assert_eq!((watch.acks(), effects.total()), (0, 0));
    chaos.set(Fault::Claim, false);
    watch.acked(5, WITHIN).await;
    stop.cancel();
    run.await.expect("join").expect("run");
    for k in 0..5 {
        assert_eq!(effects.of(&format!("pay-{k}")), 1);
    }
    q.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_is_made_again_and_nothing_runs_twice() {
    let conn = common::connect().await;
    let q = Queue::fresh(&conn, "reconnect").await;
    let upstream = idem_conformance::proxy::split_url(&common::url(), 5672).1;
    let proxy = idem_conformance::proxy::Proxy::start(&upstream).await;
    let through = idem_conformance::proxy::through(&common::url(), 5672, &proxy);

    let (effects, watch, stop) = (Effects::default(), Watch::new(), CancellationToken::new());
    let handler_effects = effects.clone();
    let consumer = IdemConsumer::builder(through)
        .queue(&q.name)
        .engine(engine(Arc::new(MemoryBackend::new())))
        .probe(watch.clone())
        .backoff(Duration::from_millis(10), Duration::from_millis(100))
        .shutdown(stop.clone().cancelled_owned())
        .handler(move |m, _| {
            let effects = handler_effects.clone();
            async move {
                effects.record(&m);
                Ok(Bytes::new())
            }
        })
        .build()
        .expect("build");
    let run = tokio::spawn(consumer.run());
    for k in 0..10 {
        q.publish(Some(format!("pay-{k}").as_bytes()), b"charge")
            .await;
    }
    watch.acked(10, WITHIN).await;
    let cut = proxy.reset();
    assert!(cut > 0, "the consumer's connection went through the proxy");
    for k in 10..20 {
        q.publish(Some(format!("pay-{k}").as_bytes()), b"charge")
            .await;
    }
    watch.acked_ids(20, WITHIN).await;
    assert!(proxy.accepted() >= 2, "a second connection was made");
    stop.cancel();
    run.await.expect("join").expect("run");
    for k in 0..20 {
        assert_eq!(effects.of(&format!("pay-{k}")), 1, "pay-{k}");
    }
    q.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_that_does_not_exist_is_an_error() {
    let consumer = IdemConsumer::builder(common::url())
        .queue("idem-test-no-such-queue")
        .engine(engine(Arc::new(MemoryBackend::new())))
        .handler(|_, _| async { Ok(Bytes::new()) })
        .build()
        .expect("build");
    let err = tokio::time::timeout(WITHIN, consumer.run())
        .await
        .expect("answers in time")
        .expect_err("no such queue");
    assert!(
        matches!(err, idem_rabbitmq::Error::UnknownQueue(ref q) if q == "idem-test-no-such-queue"),
        "{err}"
    );
}

#[test]
fn settings_that_cannot_work_are_refused_at_build() {
    let no_queue = IdemConsumer::builder("amqp://127.0.0.1:1/%2f")
        .handler(|_, _| async { Ok(Bytes::new()) })
        .build();
    assert!(matches!(no_queue, Err(idem_rabbitmq::Error::Config(m)) if m.contains("queue")));
    let no_handler = IdemConsumer::builder("amqp://127.0.0.1:1/%2f")
        .queue("q")
        .build();
    assert!(matches!(no_handler, Err(idem_rabbitmq::Error::Config(m)) if m.contains("handler")));
    let pointer = IdemConsumer::builder("amqp://127.0.0.1:1/%2f")
        .queue("q")
        .key_source(idem_rabbitmq::KeySource::json_pointer("id"))
        .handler(|_, _| async { Ok(Bytes::new()) })
        .build();
    assert!(matches!(pointer, Err(idem_rabbitmq::Error::Config(m)) if m.contains("JSON pointer")));
}

/// Lease mode with no engine once fell back to an in-memory store, which every restart and
/// every second replica forgets: now it is refused, as idem-kafka refuses it.
#[test]
fn lease_mode_without_an_engine_is_refused_at_build() {
    let err = IdemConsumer::builder("amqp://127.0.0.1:1/%2f")
        .queue("q")
        .handler(|_, _| async { Ok(Bytes::new()) })
        .build()
        .expect_err("no engine");
    assert!(
        matches!(err, idem_rabbitmq::Error::Config(ref m) if m == "an engine is required"),
        "{err}"
    );
    let with_one = IdemConsumer::builder("amqp://127.0.0.1:1/%2f")
        .queue("q")
        .engine(engine(Arc::new(MemoryBackend::new())))
        .handler(|_, _| async { Ok(Bytes::new()) })
        .build();
    assert!(with_one.is_ok(), "{with_one:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_runs_keys_at_once_and_each_key_alone_in_order() {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let conn = common::connect().await;
    let q = Queue::fresh(&conn, "lanes").await;
    // A key's copies next to each other: without lanes they would run at once, and all
    // but one would find the key in progress and ask again.
    for k in 0..16 {
        for copy in 0..3 {
            let payload = format!("charge {k} copy {copy}");
            q.publish(Some(format!("pay-{k}").as_bytes()), payload.as_bytes())
                .await;
        }
    }
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let keys_running = Arc::new(Mutex::new(std::collections::HashSet::new()));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let ran = Arc::new(Mutex::new(Vec::new()));
    let (effects, watch, stop) = (Effects::default(), Watch::new(), CancellationToken::new());
    let h = (
        effects.clone(),
        running.clone(),
        most.clone(),
        keys_running.clone(),
        overlaps.clone(),
        ran.clone(),
    );
    // The fingerprint is off: the copies' payloads differ, and each copy after the first
    // replays.
    let engine = Engine::builder(Arc::new(MemoryBackend::new()))
        .fingerprint(false)
        .build()
        .expect("engine");
    let consumer = IdemConsumer::builder(common::url())
        .queue(&q.name)
        .engine(engine)
        .in_flight(8)
        .probe(watch.clone())
        .shutdown(stop.clone().cancelled_owned())
        .handler(move |m, _| {
            let (effects, running, most, keys, overlaps, ran) = h.clone();
            async move {
                let id = m
                    .idempotency_key()
                    .map(|k| k.id().to_owned())
                    .unwrap_or_default();
                if !keys.lock().expect("lock").insert(id.clone()) {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                // The handler's work.
                tokio::time::sleep(Duration::from_millis(20)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                keys.lock().expect("lock").remove(&id);
                effects.record(&m);
                ran.lock()
                    .expect("lock")
                    .push(String::from_utf8_lossy(m.payload()).into_owned());
                Ok(Bytes::copy_from_slice(m.payload()))
            }
        })
        .build()
        .expect("build");
    let run = tokio::spawn(consumer.run());
    watch.acked(48, WITHIN).await;
    stop.cancel();
    run.await.expect("join").expect("run");
    assert!(most.load(Ordering::SeqCst) > 1, "handlers ran at once");
    assert!(
        most.load(Ordering::SeqCst) <= 8,
        "at most in_flight at once"
    );
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "a key ran in two handlers at once"
    );
    for k in 0..16 {
        assert_eq!(effects.of(&format!("pay-{k}")), 1, "pay-{k}");
    }
    assert_eq!(
        watch.claims.load(Ordering::SeqCst),
        48,
        "each delivery claimed once: none found its key in progress"
    );
    let ran = ran.lock().expect("lock").clone();
    assert!(
        ran.iter().all(|p| p.ends_with("copy 0")),
        "each key's first copy ran, its later copies replayed it: {ran:?}"
    );
    assert_eq!(q.ready(&q.name).await, 0);
    q.delete().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_byte_budget_bounds_the_deliveries_in_hand() {
    use std::sync::atomic::{AtomicUsize, Ordering};

    let conn = common::connect().await;
    let q = Queue::fresh(&conn, "budget").await;
    let payload = vec![b'p'; 1000];
    for k in 0..24 {
        q.publish(Some(format!("pay-{k}").as_bytes()), &payload)
            .await;
    }
    let running = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (effects, watch, stop) = (Effects::default(), Watch::new(), CancellationToken::new());
    let h = (effects.clone(), running.clone(), most.clone());
    let consumer = IdemConsumer::builder(common::url())
        .queue(&q.name)
        .engine(engine(Arc::new(MemoryBackend::new())))
        .in_flight(8)
        // Two deliveries of about 1,040 bytes fit; the third goes over, so no fourth.
        .max_bytes(2_500)
        .probe(watch.clone())
        .shutdown(stop.clone().cancelled_owned())
        .handler(move |m, _| {
            let (effects, running, most) = h.clone();
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                // The handler's work.
                tokio::time::sleep(Duration::from_millis(20)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                effects.record(&m);
                Ok(Bytes::new())
            }
        })
        .build()
        .expect("build");
    let run = tokio::spawn(consumer.run());
    watch.acked(24, WITHIN).await;
    stop.cancel();
    run.await.expect("join").expect("run");
    let most = most.load(Ordering::SeqCst);
    assert!(
        (2..=3).contains(&most),
        "{most} handlers at once under a budget of three"
    );
    assert_eq!(effects.total(), 24);
    q.delete().await;
}
