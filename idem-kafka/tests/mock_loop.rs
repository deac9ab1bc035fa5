//! Loop tests on librdkafka's in-process MockCluster, with the in-memory backend (the
//! embedded real backend) as the store.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::wire::{RawRecord, produce_raw};
use common::{
    Effects, Out, Recorder, builder, committed, engine, memory_engine, mock, mock_topic, produce,
    start, unique, wait_committed,
};
use idem_core::{Backend, Engine, HandlerError, Key, MemoryBackend, State};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::{KeySource, Point, Probe, Selection, Verdict, read_letters};

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_is_replayed_not_rerun() {
    let topic = unique("dup");
    let (_cluster, brokers) = mock_topic(&topic, 2);
    let mut msgs = Vec::new();
    for i in 0..20 {
        msgs.push(Out::keyed(
            i % 2,
            &format!("pay-{i}"),
            &format!("amount {i}"),
        ));
    }
    // Every fourth payment sent again, on the same partition, same payload.
    for i in (0..20).step_by(4) {
        msgs.push(Out::keyed(
            i % 2,
            &format!("pay-{i}"),
            &format!("amount {i}"),
        ));
    }
    produce(&brokers, &topic, &msgs).await;

    let backend = Arc::new(MemoryBackend::new());
    let effects = Effects::new();
    let recorder = Recorder::new();
    let group = unique("g");
    let fx = effects.clone();
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(engine(backend.clone(), "w1", Duration::from_secs(5)))
            .handler(move |msg, ctx| {
                let fx = fx.clone();
                async move {
                    assert!(ctx.is_some(), "keyed messages run under a lease");
                    let id = msg
                        .idempotency_key()
                        .map(|k| k.id().to_owned())
                        .unwrap_or_default();
                    Ok::<_, HandlerError>(fx.apply(&id))
                }
            }),
        &recorder,
    );
    recorder.wait_settled(msgs.len(), WAIT).await;
    // Partition 0 holds the ten even payments and the five copies. Committed by a
    // periodic commit, before the one at shutdown.
    wait_committed(&brokers, &group, &topic, &[15, 10], WAIT).await;
    running.stop().await;

    assert_eq!(effects.distinct(), 20);
    assert_eq!(effects.total(), 20, "no duplicate ran the handler again");
    for i in 0..20 {
        let key = Key::new(group.as_str(), format!("pay-{i}")).unwrap();
        let rec = backend.get(&key).await.unwrap().expect("record");
        assert_eq!(rec.state, State::Completed);
        assert_eq!(rec.response, Some(Bytes::from(format!("done pay-{i}"))));
    }
    assert_eq!(committed(&brokers, &group, &topic, 2), vec![15, 10]);
    // The probe heard of the commits, up to the last message of each partition.
    let commits: Vec<(i32, i64)> = recorder
        .points()
        .into_iter()
        .filter(|(p, ..)| *p == Point::AfterCommit)
        .map(|(_, partition, offset)| (partition, offset))
        .collect();
    for (partition, last) in [(0, 14), (1, 9)] {
        assert!(commits.contains(&(partition, last)), "{commits:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn json_pointer_key_source() {
    let topic = unique("json");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    let msgs: Vec<Out> = (0..5)
        .chain(0..5)
        .map(|i| Out {
            partition: Some(0),
            payload: format!(r#"{{"payment":{{"id":"p{i}"}},"amount":{i}}}"#).into_bytes(),
            ..Out::default()
        })
        .collect();
    produce(&brokers, &topic, &msgs).await;
    let backend = Arc::new(MemoryBackend::new());
    let effects = Effects::new();
    let recorder = Recorder::new();
    let running = start(
        builder(&brokers, &topic, &unique("g"))
            .namespace("payments")
            .key_source(KeySource::json_pointer("/payment/id"))
            .engine(engine(backend.clone(), "w1", Duration::from_secs(5)))
            .handler(effects.by_key()),
        &recorder,
    );
    recorder.wait_settled(10, WAIT).await;
    running.stop().await;
    assert_eq!((effects.distinct(), effects.total()), (5, 5));
    let key = Key::new("payments", "p3").unwrap();
    assert_eq!(
        backend.get(&key).await.unwrap().unwrap().state,
        State::Completed
    );
}

/// Payloads on one partition that each end a different way.
fn json(v: &str) -> Out {
    Out {
        partition: Some(0),
        payload: v.as_bytes().to_vec(),
        ..Out::default()
    }
}

/// A message on partition 0 whose `idempotency-key` header is `id` (no header: `None`).
fn with_header(id: Option<&[u8]>) -> Out {
    Out {
        partition: Some(0),
        payload: b"p".to_vec(),
        headers: id
            .map(|id| vec![("idempotency-key".to_owned(), id.to_vec())])
            .unwrap_or_default(),
        ..Out::default()
    }
}

/// The one letter of `dlq`, read through `read_letters`.
fn the_one_letter(brokers: &str, dlq: &str) -> idem_kafka::DeadLetter {
    let mut reader = ClientConfig::new();
    reader.set("bootstrap.servers", brokers);
    let mut letters =
        read_letters(&reader, dlq, &Selection::default(), WAIT).expect("read the dead letters");
    assert_eq!(letters.len(), 1, "{letters:#?}");
    letters.remove(0)
}

/// Runs a consumer on the memory store whose handler applies each message's key id, until
/// `n` messages settled; returns the effects and the group.
async fn run_each_key_once(brokers: &str, topic: &str, n: usize) -> (Arc<Effects>, String) {
    let effects = Effects::new();
    let recorder = Recorder::new();
    let group = unique("g");
    let fx = effects.clone();
    let running = start(
        builder(brokers, topic, &group)
            .engine(memory_engine())
            .commit_interval(Duration::from_millis(100))
            .handler(move |msg, _| {
                let fx = fx.clone();
                async move {
                    let id = msg
                        .idempotency_key()
                        .map(Key::id)
                        .unwrap_or_default()
                        .to_owned();
                    fx.apply(&id);
                    Ok(Bytes::from(id))
                }
            }),
        &recorder,
    );
    recorder.wait_settled(n, WAIT).await;
    running.stop().await;
    (effects, group)
}

/// Header keys that are missing, empty, not UTF-8 or over the length limit are dead
/// letters with their reason, around good keys that run once; nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_header_keys_end_in_the_dead_letter_topic_with_their_reason() {
    let topic = unique("badkeys");
    let dlq = format!("{topic}.dlq");
    let cluster = mock(1, &[(&topic, 1), (&dlq, 1)]);
    let brokers = cluster.bootstrap_servers();
    let long = vec![b'k'; idem_core::MAX_ID_BYTES + 1];
    let msgs = [
        with_header(Some(b"a")),
        with_header(None),
        with_header(Some(b"")),
        with_header(Some(&[0xff, 0xfe, b'x'])),
        with_header(Some(&long)),
        with_header(Some(b"b")),
    ];
    produce(&brokers, &topic, &msgs).await;
    let (effects, group) = run_each_key_once(&brokers, &topic, msgs.len()).await;

    assert_eq!(
        (effects.runs("a"), effects.runs("b"), effects.total()),
        (1, 1, 2)
    );
    let letters = common::read_all(&brokers, &dlq, 1, 4, WAIT);
    let got: Vec<(String, String)> = letters
        .iter()
        .map(|l| {
            (
                l.headers["idem-original-offset"].clone(),
                l.headers["idem-reason"].clone(),
            )
        })
        .collect();
    let want = [
        ("1", "missing-key"),
        ("2", "missing-key"),
        ("3", "invalid-key"),
        ("4", "invalid-key"),
    ]
    .map(|(o, r)| (o.to_owned(), r.to_owned()));
    assert_eq!(got, want, "{letters:#?}");
    for letter in &letters {
        let offset: usize = letter.headers["idem-original-offset"]
            .parse()
            .expect("offset");
        assert_eq!(letter.payload, msgs[offset].payload);
        assert!(!letter.headers["idem-error"].is_empty(), "{letter:?}");
    }
    assert!(
        letters[2].headers["idem-error"].contains("UTF-8"),
        "{:?}",
        letters[2]
    );
    assert!(
        letters[3].headers["idem-error"].contains("512"),
        "{:?}",
        letters[3]
    );
    assert_eq!(committed(&brokers, &group, &topic, 1), vec![6]);
}

/// A header whose name is not UTF-8 (rdkafka panics where it reads one, and no client will
/// write one, so it goes out on the wire by hand) stops nothing: the message's other headers
/// still give its key, a message left without a key is a dead letter that keeps every
/// header it came with, and the loop commits past all of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_header_name_that_is_not_utf8_never_stops_the_loop() {
    let topic = unique("badname");
    let dlq = format!("{topic}.dlq");
    let cluster = mock(1, &[(&topic, 1), (&dlq, 1)]);
    let brokers = cluster.bootstrap_servers();
    let bad: &[u8] = &[0xff, 0xfe, b'h'];
    let key: &[u8] = b"idempotency-key";
    let records = [
        RawRecord {
            key: None,
            value: b"p0",
            headers: &[(bad, b"v0"), (key, b"a")],
        },
        RawRecord {
            key: None,
            value: b"p1",
            headers: &[(bad, b"v1"), (b"trace", b"t1")],
        },
        RawRecord {
            key: None,
            value: b"p2",
            headers: &[(key, b"b"), (bad, b"v2")],
        },
    ];
    assert_eq!(produce_raw(&brokers, &topic, 0, &records), Ok(0));
    let (effects, group) = run_each_key_once(&brokers, &topic, records.len()).await;

    assert_eq!(
        (effects.runs("a"), effects.runs("b"), effects.total()),
        (1, 1, 2)
    );
    assert_eq!(committed(&brokers, &group, &topic, 1), vec![3]);
    let letter = the_one_letter(&brokers, &dlq);
    let letter = &letter;
    assert_eq!(
        (letter.original_offset, letter.reason.as_deref()),
        (Some(1), Some("missing-key"))
    );
    assert_eq!(letter.payload, Bytes::from_static(b"p1"));
    let trace = letter.headers.iter().find(|(k, _)| k == "trace");
    assert_eq!(
        trace,
        Some(&("trace".to_owned(), Some(Bytes::from_static(b"t1"))))
    );
    assert!(
        letter.problems.iter().any(|p| p.contains("not UTF-8")),
        "the letter lost the header it could not read: {letter:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_messages_end_in_the_dead_letter_topic_with_headers() {
    let topic = unique("dlq");
    let dlq = format!("{topic}.dlq");
    let cluster = mock(1, &[(&topic, 1), (&dlq, 1)]);
    let brokers = cluster.bootstrap_servers();
    let msgs = [
        json(r#"{"id":"a","v":1}"#),
        json(r#"{"v":2}"#),
        json("not json"),
        json(r#"{"id":{"x":1}}"#),
        json(r#"{"id":"poison","v":4}"#),
        json(r#"{"id":"a","v":99}"#),
        json(r#"{"id":"flaky","v":6}"#),
        json(r#"{"id":"b","v":7}"#),
    ];
    produce(&brokers, &topic, &msgs).await;
    let backend = Arc::new(MemoryBackend::new());
    let effects = Effects::new();
    let recorder = Recorder::new();
    let group = unique("g");
    let fx = effects.clone();
    let running = start(
        builder(&brokers, &topic, &group)
            .key_source(KeySource::json_pointer("/id"))
            .engine(engine(backend.clone(), "w1", Duration::from_secs(5)))
            .retry_backoff(Duration::from_millis(5), Duration::from_millis(50))
            .commit_interval(Duration::from_millis(100))
            .handler(move |msg, _| {
                let fx = fx.clone();
                async move {
                    let id = msg
                        .idempotency_key()
                        .map(Key::id)
                        .unwrap_or_default()
                        .to_owned();
                    fx.apply(&id);
                    match id.as_str() {
                        "poison" => Err(HandlerError::permanent("card declined for good")),
                        "flaky" => Err(HandlerError::retry("bank timeout")),
                        _ => Ok(Bytes::from(id)),
                    }
                }
            }),
        &recorder,
    );
    recorder.wait_settled(msgs.len(), WAIT).await;
    running.stop().await;

    assert_eq!(effects.runs("a"), 1);
    assert_eq!(effects.runs("b"), 1);
    assert_eq!(
        effects.runs("poison"),
        1,
        "a permanent error is not retried"
    );
    assert_eq!(
        effects.runs("flaky"),
        3,
        "a retryable error gets max_attempts runs"
    );
    let letters = common::read_all(&brokers, &dlq, 1, 6, WAIT);
    assert_eq!(letters.len(), 6, "{letters:#?}");
    let expect = [
        (1, "missing-key", None, "0"),
        (2, "malformed-payload", None, "0"),
        (3, "invalid-key", None, "0"),
        (4, "poisoned", Some("poison"), "1"),
        (5, "mismatch", Some("a"), "0"),
        (6, "poisoned", Some("flaky"), "3"),
    ];
    for (letter, (offset, reason, key, attempts)) in letters.iter().zip(expect) {
        let h = &letter.headers;
        assert_eq!(h["idem-original-topic"], topic);
        assert_eq!(h["idem-original-partition"], "0");
        assert_eq!(h["idem-original-offset"], offset.to_string());
        assert_eq!(h["idem-reason"], reason, "{letter:?}");
        assert_eq!(h["idem-attempts"], attempts, "{letter:?}");
        assert!(!h["idem-error"].is_empty());
        let want_key = key.map(|id| format!("{group}/{id}"));
        assert_eq!(h.get("idem-key").cloned(), want_key);
        let want_namespace = key.map(|_| group.clone());
        assert_eq!(h.get("idem-key-namespace").cloned(), want_namespace);
        assert_eq!(letter.payload, msgs[offset].payload);
    }
    assert!(letters[1].headers["idem-error"].contains("not JSON"));
    assert!(letters[3].headers["idem-error"].contains("declined"));
    assert!(letters[5].headers["idem-error"].contains("bank timeout"));
    assert_eq!(committed(&brokers, &group, &topic, 1), vec![8]);
}

/// A handler written `|m, _| { ..unwrap()..; async move {..} }` that panics before its
/// future exists, and a key function that panics, fail like any panic: the handler's is
/// retried up to max_attempts then poisoned, the key function's is a malformed message;
/// both are dead letters and the messages after them run. (Before, the partition's worker
/// died and the partition stalled without a word.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panic_before_the_handler_future_exists_is_a_failure_not_a_stall() {
    let topic = unique("syncpanic");
    let dlq = format!("{topic}.dlq");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    let msgs = [
        Out::keyed(0, "a", "1"),
        Out::keyed(0, "boom", "2"),
        Out::keyed(0, "k", "key-panics"),
        Out::keyed(0, "b", "4"),
    ];
    produce(&brokers, &topic, &msgs).await;
    let effects = Effects::new();
    let recorder = Recorder::new();
    let group = unique("g");
    let booms = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let (fx, tries) = (effects.clone(), booms.clone());
    let running = start(
        builder(&brokers, &topic, &group)
            .key_source(KeySource::custom(|m| {
                assert_ne!(&m.payload()[..], b"key-panics", "key function bug");
                Ok(m.header("idempotency-key")
                    .map(|id| String::from_utf8_lossy(id).into_owned()))
            }))
            .engine(memory_engine())
            .handler(move |msg, _| {
                let id = msg
                    .idempotency_key()
                    .map(Key::id)
                    .unwrap_or_default()
                    .to_owned();
                if id == "boom" {
                    tries.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    panic!("sync boom");
                }
                fx.apply(&id);
                async move { Ok(Bytes::from(id)) }
            }),
        &recorder,
    );
    recorder.wait_settled(msgs.len(), WAIT).await;
    running.stop().await;

    assert_eq!(
        (effects.runs("a"), effects.runs("b"), effects.total()),
        (1, 1, 2)
    );
    assert_eq!(booms.load(std::sync::atomic::Ordering::SeqCst), 3);
    let letters = common::read_all(&brokers, &dlq, 1, 2, WAIT);
    let got: Vec<(&str, &str)> = letters
        .iter()
        .map(|l| {
            (
                &l.headers["idem-original-offset"][..],
                &l.headers["idem-reason"][..],
            )
        })
        .collect();
    assert_eq!(got, [("1", "poisoned"), ("2", "malformed-payload")]);
    assert!(
        letters[0].headers["idem-error"].contains("sync boom"),
        "{letters:?}"
    );
    assert!(
        letters[1].headers["idem-error"].contains("key function panicked: assertion"),
        "{letters:?}"
    );
    assert_eq!(committed(&brokers, &group, &topic, 1), vec![4]);
}

/// A partition's worker that panics (here through a probe with a bug) stops the consumer
/// with `Error::Worker`, naming the partition, instead of leaving that partition stalled
/// while `run()` goes on; the next consumer of the group finishes the work, each effect
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_that_panics_stops_the_consumer_with_its_reason() {
    struct Buggy;
    impl Probe for Buggy {
        fn reached(&self, point: Point, _: &str, _: i32, offset: i64) -> Verdict {
            assert!(
                !(point == Point::AfterSettle && offset == 1),
                "probe bug at offset 1"
            );
            Verdict::Continue
        }
    }
    let topic = unique("workerpanic");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    let msgs = [
        Out::keyed(0, "a", "1"),
        Out::keyed(0, "b", "2"),
        Out::keyed(0, "c", "3"),
    ];
    produce(&brokers, &topic, &msgs).await;
    let backend = Arc::new(MemoryBackend::new());
    let effects = Effects::new();
    let group = unique("g");
    let buggy = builder(&brokers, &topic, &group)
        .engine(engine(backend.clone(), "w1", Duration::from_secs(5)))
        .handler(effects.by_key())
        .probe(Arc::new(Buggy))
        .build()
        .expect("consumer");
    let ended = tokio::time::timeout(WAIT, buggy.run())
        .await
        .expect("the consumer stopped by itself");
    match ended {
        Err(idem_kafka::Error::Worker(why)) => assert!(
            why.contains(&format!("{topic}/0 panicked: probe bug at offset 1")),
            "{why}"
        ),
        other => panic!("expected Error::Worker, got {other:?}"),
    }

    let recorder = Recorder::new();
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(engine(backend, "w2", Duration::from_secs(5)))
            .handler(effects.by_key()),
        &recorder,
    );
    wait_committed(&brokers, &group, &topic, &[3], WAIT).await;
    running.stop().await;
    assert_eq!(
        (effects.runs("a"), effects.runs("b"), effects.runs("c")),
        (1, 1, 1)
    );
}

/// A dead letter over the dead-letter producer's size limit is written without the
/// original payload, key and headers, saying so, instead of stalling the partition on a
/// write that can never succeed; such a letter cannot be replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_over_the_size_limit_is_written_without_the_original() {
    let topic = unique("bigletter");
    let dlq = format!("{topic}.dlq");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    let big = "x".repeat(3000);
    let msgs = [Out::keyed(0, "big", &big), Out::keyed(0, "a", "1")];
    produce(&brokers, &topic, &msgs).await;
    let mut small = ClientConfig::new();
    small
        .set("bootstrap.servers", &brokers)
        .set("message.max.bytes", "1000");
    let effects = Effects::new();
    let recorder = Recorder::new();
    let group = unique("g");
    let fx = effects.clone();
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(memory_engine())
            .dead_letter_config(small)
            .handler(move |msg, _| {
                let id = msg
                    .idempotency_key()
                    .map(Key::id)
                    .unwrap_or_default()
                    .to_owned();
                fx.apply(&id);
                async move {
                    match id.as_str() {
                        // The error text holds the payload: the lean letter keeps its start.
                        "big" => Err(HandlerError::permanent(
                            format!("too big to handle: {}", msg.payload().len())
                                + &"x".repeat(3000),
                        )),
                        _ => Ok(Bytes::from(id)),
                    }
                }
            }),
        &recorder,
    );
    recorder.wait_settled(msgs.len(), WAIT).await;
    running.stop().await;

    assert_eq!((effects.runs("big"), effects.runs("a")), (1, 1));
    assert_eq!(committed(&brokers, &group, &topic, 1), vec![2]);
    let letter = the_one_letter(&brokers, &dlq);
    let letter = &letter;
    assert_eq!(
        (letter.original_offset, letter.reason.as_deref()),
        (Some(0), Some("poisoned"))
    );
    let error = letter.error.as_deref().expect("the error's start");
    assert!(error.starts_with("too big to handle: 3000xxx") && error.len() == 256);
    assert!(letter.payload.is_empty() && letter.message_key.is_none());
    assert!(!letter.headers.iter().any(|(k, _)| k == "idempotency-key"));
    let dropped = letter
        .dropped
        .as_deref()
        .expect("the letter says what it dropped");
    assert!(dropped.starts_with("payload (3000 bytes)"), "{dropped}");
    assert!(dropped.contains(&format!("{topic}/0/0")), "{dropped}");
    assert!(letter.destination().is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn in_progress_holds_the_partition_and_nothing_is_committed_past_it() {
    let topic = unique("held");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    let msgs = [
        Out::keyed(0, "a", "1"),
        Out::keyed(0, "held", "2"),
        Out::keyed(0, "b", "3"),
    ];
    produce(&brokers, &topic, &msgs).await;
    let group = unique("g");
    let backend = Arc::new(MemoryBackend::new());
    // Another worker holds "held" with a long lease.
    let other = engine(backend.clone(), "other", Duration::from_secs(60));
    let held = Key::new(group.as_str(), "held").unwrap();
    let lease = match backend.claim(&other.claim_for(&held, b"2")).await.unwrap() {
        idem_core::backend::ClaimOutcome::Acquired(l) => l,
        o => panic!("{o:?}"),
    };
    let effects = Effects::new();
    let recorder = Recorder::new();
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(engine(backend.clone(), "w1", Duration::from_secs(5)))
            .retry_backoff(Duration::from_millis(10), Duration::from_millis(100))
            .commit_interval(Duration::from_millis(50))
            .handler(effects.by_key()),
        &recorder,
    );
    recorder.wait_settled(1, WAIT).await;
    wait_committed(&brokers, &group, &topic, &[1], WAIT).await;
    // The partition waits on "held": for a while, nothing past it runs or is committed.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        recorder.settled_on(0).into_iter().collect::<Vec<_>>(),
        vec![0]
    );
    assert_eq!((effects.runs("held"), effects.runs("b")), (0, 0));
    assert_eq!(committed(&brokers, &group, &topic, 1), vec![1]);

    // The holder finishes: the partition replays its answer and moves on.
    backend
        .complete(
            &lease,
            Bytes::from_static(b"other's"),
            Duration::from_secs(3600),
        )
        .await
        .unwrap();
    recorder.wait_settled(3, WAIT).await;
    running.stop().await;
    assert_eq!(
        (effects.runs("a"), effects.runs("held"), effects.runs("b")),
        (1, 0, 1)
    );
    assert_eq!(committed(&brokers, &group, &topic, 1), vec![3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn store_outage_stalls_the_partition_and_it_resumes_with_nothing_lost() {
    use idem_core::layer::{BackendExt, ChaosLayer, Fault};
    let topic = unique("outage");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    let first: Vec<Out> = (0..10)
        .map(|i| Out::keyed(0, &format!("k{i}"), "x"))
        .collect();
    produce(&brokers, &topic, &first).await;
    let chaos = ChaosLayer::new();
    let faulty = MemoryBackend::new().layer(chaos.clone());
    chaos.set(Fault::Claim, true);
    let backend = Arc::new(faulty.clone());
    let effects = Effects::new();
    let recorder = Recorder::new();
    let group = unique("g");
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(engine(backend, "w1", Duration::from_secs(5)))
            .retry_backoff(Duration::from_millis(10), Duration::from_millis(100))
            .commit_interval(Duration::from_millis(50))
            .handler(effects.by_key()),
        &recorder,
    );
    // The claim is failing: the partition stalls before running anything.
    let deadline = std::time::Instant::now() + WAIT;
    while !recorder.points().iter().any(|p| p.0 == Point::BeforeClaim) {
        assert!(std::time::Instant::now() < deadline, "no claim attempted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(recorder.settled_count(), 0);
    assert_eq!(effects.total(), 0);
    assert_eq!(committed(&brokers, &group, &topic, 1), vec![-1]);
    chaos.set(Fault::Claim, false);
    recorder.wait_settled(10, WAIT).await;
    assert_eq!((effects.distinct(), effects.total()), (10, 10));

    // Now `complete` fails after the handlers ran: their responses are stored once the
    // store is back, and no handler runs twice.
    chaos.set(Fault::Complete, true);
    let second: Vec<Out> = (10..15)
        .map(|i| Out::keyed(0, &format!("k{i}"), "x"))
        .collect();
    produce(&brokers, &topic, &second).await;
    let deadline = std::time::Instant::now() + WAIT;
    while effects.runs("k10") == 0 {
        assert!(std::time::Instant::now() < deadline, "k10 never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        recorder.settled_count(),
        10,
        "nothing settles while complete fails"
    );
    let ran = effects.total();
    assert!(
        (11..=15).contains(&ran),
        "the chunk's handlers ran, once each: {ran}"
    );
    chaos.set(Fault::Complete, false);
    recorder.wait_settled(15, WAIT).await;
    running.stop().await;
    assert_eq!((effects.distinct(), effects.total()), (15, 15));
    for i in 0..15 {
        let key = Key::new(group.as_str(), format!("k{i}")).unwrap();
        let rec = faulty.inner().get(&key).await.unwrap().expect("record");
        assert_eq!(rec.state, State::Completed, "k{i}");
    }
    assert_eq!(committed(&brokers, &group, &topic, 1), vec![15]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_consumers_in_one_group_rebalance() {
    let topic = unique("rebal");
    let (_cluster, brokers) = mock_topic(&topic, 4);
    let msgs: Vec<Out> = (0..400)
        .map(|i| Out::keyed(i % 4, &format!("k{i}"), "x"))
        .collect();
    produce(&brokers, &topic, &msgs).await;
    let group = unique("g");
    let backend = Arc::new(MemoryBackend::new());
    let effects = Effects::new();
    let recorder = Recorder::new();
    let launch = |owner: &'static str, mine: Arc<Effects>| {
        let fx = effects.clone();
        let consumer = builder(&brokers, &topic, &group)
            .engine(engine(backend.clone(), owner, Duration::from_secs(5)))
            .batch_size(20)
            .handler(move |msg, _| {
                let (fx, mine) = (fx.clone(), mine.clone());
                async move {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    let id = msg.idempotency_key().map(Key::id).unwrap_or_default();
                    mine.apply(id);
                    Ok(fx.apply(id))
                }
            });
        start(consumer, &recorder)
    };
    let (a_runs, b_runs) = (Effects::new(), Effects::new());
    let a = launch("a", a_runs.clone());
    recorder.wait_settled(40, WAIT).await;
    let b = launch("b", b_runs.clone());
    recorder.wait_settled(400, WAIT).await;
    // Settles count replays too: after the rebalance, the new owner replays what the old
    // one settled past its last commit. Done is when every partition's offset is
    // committed through its last message (commits run every 50 ms).
    wait_committed(&brokers, &group, &topic, &[100; 4], WAIT).await;
    a.stop().await;
    b.stop().await;

    assert!(
        a_runs.total() > 0 && b_runs.total() > 0,
        "a ran {}, b ran {}",
        a_runs.total(),
        b_runs.total()
    );
    assert_eq!(effects.distinct(), 400);
    assert_eq!(
        effects.total(),
        400,
        "no message ran twice across the rebalance"
    );
    assert_eq!(committed(&brokers, &group, &topic, 4), vec![100; 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_commits_are_retried() {
    use idem_kafka::rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let topic = unique("commit");
    let (cluster, brokers) = mock_topic(&topic, 1);
    let msgs: Vec<Out> = (0..30)
        .map(|i| Out::keyed(0, &format!("k{i}"), "x"))
        .collect();
    produce(&brokers, &topic, &msgs).await;
    cluster.request_errors(
        RDKafkaApiKey::OffsetCommit,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_OFFSET_METADATA_TOO_LARGE; 4],
    );
    let group = unique("g");
    let recorder = Recorder::new();
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(memory_engine())
            .batch_size(5)
            .commit_interval(Duration::from_millis(50))
            .handler(|msg, _| async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                Ok(Bytes::from(msg.offset().to_string()))
            }),
        &recorder,
    );
    recorder.wait_settled(30, WAIT).await;
    // The first commits failed; a later periodic commit carries the settled offset.
    wait_committed(&brokers, &group, &topic, &[30], WAIT).await;
    running.stop().await;
}

/// A commit that fails after the last offset was stored is retried too: nothing new is
/// stored after it, so only the failure itself can bring the commit back. The failure of
/// these asynchronous commits is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_commit_of_the_last_offsets_is_retried() {
    use idem_kafka::rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    common::install_metrics();
    let topic = unique("lastcommit");
    let (cluster, brokers) = mock_topic(&topic, 1);
    let msgs: Vec<Out> = (0..3)
        .map(|i| Out::keyed(0, &format!("k{i}"), "x"))
        .collect();
    produce(&brokers, &topic, &msgs).await;
    let group = unique("g");
    let recorder = Recorder::new();
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(memory_engine())
            .commit_interval(Duration::from_millis(300))
            .handler(|msg, _| async move { Ok(Bytes::from(msg.offset().to_string())) }),
        &recorder,
    );
    // Every offset is stored before the first periodic commit, which then fails.
    recorder.wait_settled(3, WAIT).await;
    cluster.request_errors(
        RDKafkaApiKey::OffsetCommit,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_OFFSET_METADATA_TOO_LARGE; 2],
    );
    wait_committed(&brokers, &group, &topic, &[3], WAIT).await;
    running.stop().await;
    let failed = common::counter_by(idem_kafka::metrics::COMMIT_ERRORS, "group", &group);
    assert_eq!(failed, 2, "failed commits counted, for two refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_letter_broker_down_stalls_the_partition_until_acknowledged() {
    use idem_kafka::rdkafka::mocking::MockCoordinator;
    use idem_kafka::rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let topic = unique("dlqdown");
    let dlq = format!("{topic}.dlq");
    let cluster = mock(2, &[(&topic, 1), (&dlq, 1)]);
    let group = unique("g");
    cluster.partition_leader(&topic, 0, Some(1)).unwrap();
    cluster.partition_leader(&dlq, 0, Some(2)).unwrap();
    cluster
        .coordinator(MockCoordinator::Group(group.clone()), 1)
        .unwrap();
    let brokers = cluster.bootstrap_servers();
    let msgs = [
        Out::keyed(0, "a", "1"),
        Out {
            partition: Some(0),
            payload: b"no key".to_vec(),
            ..Out::default()
        },
        Out::keyed(0, "b", "3"),
        Out {
            partition: Some(0),
            payload: b"no key either".to_vec(),
            ..Out::default()
        },
        Out::keyed(0, "c", "5"),
    ];
    produce(&brokers, &topic, &msgs).await;
    cluster.broker_down(2).unwrap();
    let effects = Effects::new();
    let recorder = Recorder::new();
    let mut dlq_config = idem_kafka::rdkafka::ClientConfig::new();
    dlq_config
        .set("bootstrap.servers", &brokers)
        .set("message.timeout.ms", "1000");
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(memory_engine())
            .dead_letter_config(dlq_config)
            .retry_backoff(Duration::from_millis(10), Duration::from_millis(100))
            .commit_interval(Duration::from_millis(50))
            .handler(effects.by_key()),
        &recorder,
    );
    recorder.wait_settled(1, WAIT).await;
    // The dead letter cannot be written: the partition holds at offset 1.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        recorder.settled_on(0).into_iter().collect::<Vec<_>>(),
        vec![0]
    );
    assert_eq!(effects.runs("b"), 0);
    assert_eq!(committed(&brokers, &group, &topic, 1), vec![1]);
    cluster.broker_up(2).unwrap();
    recorder.wait_settled(3, WAIT).await;
    // Now produce requests fail a few times: the second dead letter waits for its ack too.
    cluster.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_INVALID_RECORD; 3],
    );
    recorder.wait_settled(5, WAIT).await;
    running.stop().await;
    assert_eq!(
        (effects.runs("a"), effects.runs("b"), effects.runs("c")),
        (1, 1, 1)
    );
    let letters = common::read_all(&brokers, &dlq, 1, 2, WAIT);
    let offsets: Vec<&str> = letters
        .iter()
        .map(|l| l.headers["idem-original-offset"].as_str())
        .collect();
    assert_eq!(offsets, ["1", "3"]);
    assert_eq!(committed(&brokers, &group, &topic, 1), vec![5]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partition_concurrency_bounds_handlers_across_partitions() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let run = |limit: Option<usize>| async move {
        let topic = unique("conc");
        let (_cluster, brokers) = mock_topic(&topic, 4);
        let msgs: Vec<Out> = (0..24)
            .map(|i| Out::keyed(i % 4, &format!("k{i}"), "x"))
            .collect();
        produce(&brokers, &topic, &msgs).await;
        let (now, max) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let recorder = Recorder::new();
        let (n, m) = (now.clone(), max.clone());
        let mut consumer = builder(&brokers, &topic, &unique("g"))
            .engine(memory_engine())
            .batch_size(1)
            .handler(move |_, _| {
                let (n, m) = (n.clone(), m.clone());
                async move {
                    let running = n.fetch_add(1, Ordering::SeqCst) + 1;
                    m.fetch_max(running, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    n.fetch_sub(1, Ordering::SeqCst);
                    Ok(Bytes::new())
                }
            });
        if let Some(limit) = limit {
            consumer = consumer.partition_concurrency(limit);
        }
        let running = start(consumer, &recorder);
        recorder.wait_settled(24, WAIT).await;
        running.stop().await;
        max.load(Ordering::SeqCst)
    };
    assert_eq!(run(Some(1)).await, 1, "one partition at a time");
    assert!(run(None).await > 1, "partitions run in parallel by default");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keyless_messages_can_be_processed_without_deduplication() {
    let topic = unique("keyless");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    let keyless = Out {
        partition: Some(0),
        payload: b"no key".to_vec(),
        ..Out::default()
    };
    let msgs = [keyless.clone(), Out::keyed(0, "a", "1"), keyless];
    produce(&brokers, &topic, &msgs).await;
    let effects = Effects::new();
    let recorder = Recorder::new();
    let group = unique("g");
    let fx = effects.clone();
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(memory_engine())
            .missing_key(idem_kafka::MissingKey::Process)
            .handler(move |msg, ctx| {
                let fx = fx.clone();
                async move {
                    let id = match (msg.idempotency_key(), ctx) {
                        (Some(k), Some(_)) => k.id().to_owned(),
                        (None, None) => "keyless".to_owned(),
                        other => panic!("a key comes with a lease: {other:?}"),
                    };
                    Ok(fx.apply(&id))
                }
            }),
        &recorder,
    );
    recorder.wait_settled(3, WAIT).await;
    running.stop().await;
    assert_eq!(effects.runs("a"), 1);
    assert_eq!(effects.runs("keyless"), 2, "no deduplication without a key");
    assert!(
        common::read_all(
            &brokers,
            &format!("{topic}.dlq"),
            1,
            1,
            Duration::from_secs(2)
        )
        .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_outliving_the_revoke_timeout_loses_its_lease() {
    use std::sync::Mutex;
    let topic = unique("slow");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    produce(&brokers, &topic, &[Out::keyed(0, "slow", "x")]).await;
    let group = unique("g");
    let backend = Arc::new(MemoryBackend::new());
    // Each run: (owner, claim kind, when it started, when it ended).
    type Run = (
        String,
        idem_core::ClaimKind,
        std::time::Instant,
        Option<std::time::Instant>,
    );
    let runs: Arc<Mutex<Vec<Run>>> = Arc::default();
    let recorder = Recorder::new();
    let launch = |owner: &'static str| {
        let runs = runs.clone();
        let consumer = builder(&brokers, &topic, &group)
            .engine(
                Engine::builder(backend.clone())
                    .owner(owner)
                    .lease_ttl(Duration::from_secs(1))
                    .build()
                    .unwrap(),
            )
            .revoke_timeout(Duration::from_millis(200))
            .handler(move |_, ctx| {
                let runs = runs.clone();
                async move {
                    let ctx = ctx.expect("lease");
                    let i = {
                        let mut runs = runs.lock().unwrap();
                        runs.push((
                            ctx.lease().owner.to_string(),
                            ctx.kind(),
                            std::time::Instant::now(),
                            None,
                        ));
                        runs.len() - 1
                    };
                    if ctx.kind() == idem_core::ClaimKind::First {
                        tokio::time::sleep(Duration::from_secs(6)).await;
                    }
                    runs.lock().unwrap()[i].3 = Some(std::time::Instant::now());
                    Ok(Bytes::from(ctx.lease().owner.to_string()))
                }
            });
        start(consumer, &recorder)
    };
    let a = launch("a");
    let deadline = std::time::Instant::now() + WAIT;
    while runs.lock().unwrap().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the handler never started"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // A second member: the partition is revoked from under the slow handler, which is
    // given up after the revoke timeout. Its heartbeat stops: the lease lapses while the
    // handler still runs.
    let b = launch("b");
    let key = Key::new(group.as_str(), "slow").unwrap();
    loop {
        let rec = backend.get(&key).await.unwrap().expect("claimed");
        let lapsed = rec
            .lease_until
            .is_some_and(|until| until < idem_core::Timestamp::now());
        if lapsed {
            assert!(
                runs.lock().unwrap()[0].3.is_none(),
                "the first handler still runs"
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the lease never lapsed: {rec:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    recorder.wait_settled(1, WAIT).await;
    a.stop().await;
    b.stop().await;

    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), 2, "{runs:?}");
    let (first, takeover) = (&runs[0], &runs[1]);
    assert_eq!(first.1, idem_core::ClaimKind::First);
    assert_eq!(
        takeover.1,
        idem_core::ClaimKind::Takeover,
        "its lease lapsed: no heartbeat"
    );
    let rec = backend.get(&key).await.unwrap().unwrap();
    assert_eq!(rec.state, State::Completed);
    assert_eq!(
        rec.response,
        Some(Bytes::from(takeover.0.clone())),
        "the takeover's result is stored"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_buffer_pauses_the_partition_and_it_resumes_with_each_message_once() {
    let topic = unique("backlog");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    let msgs: Vec<Out> = (0..40)
        .map(|i| Out::keyed(0, &format!("k{i}"), "x"))
        .collect();
    produce(&brokers, &topic, &msgs).await;
    let backend = Arc::new(MemoryBackend::new());
    let effects = Effects::new();
    let recorder = Recorder::new();
    let group = unique("g");
    // The first handler holds its batch until the test lets it go, so the poll thread
    // fills the four-message buffer behind it and pauses the partition. Each resume waits
    // for the fetch in flight at the pause (up to `fetch.wait.max.ms`, 500 ms), so the
    // partition moves in steps: few messages keep the test short.
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let started_tx = std::sync::Mutex::new(Some(started_tx));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (fx, g) = (effects.clone(), gate.clone());
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(engine(backend.clone(), "w1", Duration::from_secs(30)))
            .max_buffered(4)
            .batch_size(2)
            .handler(move |msg, _| {
                let (fx, g) = (fx.clone(), g.clone());
                let first = msg.offset() == 0;
                let tx = if first {
                    started_tx.lock().expect("lock").take()
                } else {
                    None
                };
                async move {
                    if let Some(tx) = tx {
                        let _ = tx.send(());
                        let _ = g.acquire().await;
                    }
                    let id = msg
                        .idempotency_key()
                        .map(|k| k.id().to_owned())
                        .unwrap_or_default();
                    Ok::<_, HandlerError>(fx.apply(&id))
                }
            }),
        &recorder,
    );
    started.await.expect("the first handler started");
    gate.add_permits(1);
    recorder.wait_settled(msgs.len(), WAIT).await;
    wait_committed(&brokers, &group, &topic, &[40], WAIT).await;
    running.stop().await;

    assert_eq!((effects.distinct(), effects.total()), (40, 40));
    let settles: Vec<i64> = recorder
        .points()
        .into_iter()
        .filter(|(p, ..)| *p == Point::AfterSettle)
        .map(|(_, _, offset)| offset)
        .collect();
    let expected: Vec<i64> = (0..40).collect();
    assert_eq!(settles, expected, "each offset settles once, in order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn messages_larger_than_the_byte_bound_get_through_each_once_on_every_partition() {
    use idem_kafka::Point;
    let topic = unique("bytes");
    let (_cluster, brokers) = mock_topic(&topic, 2);
    let payload = "x".repeat(1000);
    let msgs: Vec<Out> = (0..24)
        .map(|i| Out::keyed(i % 2, &format!("k{i}"), &payload))
        .collect();
    produce(&brokers, &topic, &msgs).await;
    let backend = Arc::new(MemoryBackend::new());
    let effects = Effects::new();
    let recorder = Recorder::new();
    let group = unique("g");
    // Every message is larger than the bound: each partition takes one message while it
    // holds nothing, is paused at the next, and resumes once it holds nothing again.
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(engine(backend.clone(), "w1", Duration::from_secs(30)))
            .max_buffered_bytes(1)
            .handler(effects.by_key()),
        &recorder,
    );
    recorder.wait_settled(msgs.len(), WAIT).await;
    wait_committed(&brokers, &group, &topic, &[12, 12], WAIT).await;
    running.stop().await;

    assert_eq!((effects.distinct(), effects.total()), (24, 24));
    for partition in 0..2 {
        let settles: Vec<i64> = recorder
            .points()
            .into_iter()
            .filter(|(p, part, _)| *p == Point::AfterSettle && *part == partition)
            .map(|(_, _, offset)| offset)
            .collect();
        let expected: Vec<i64> = (0..12).collect();
        assert_eq!(
            settles, expected,
            "partition {partition}: each offset once, in order"
        );
    }
}
