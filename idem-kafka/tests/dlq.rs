//! Reading and replaying dead letters on the real broker (tansu, `IDEM_KAFKA_BROKERS`),
//! with Redis (`IDEM_REDIS_URL`) keeping the replay records.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Out, create_topics, produce, unique};
use idem_core::backend::{Claim, ClaimOutcome};
use idem_core::{Backend, FailureKind, Key, State};
use idem_kafka::rdkafka::ClientConfig;
use idem_kafka::rdkafka::consumer::{BaseConsumer, Consumer};
use idem_kafka::{DeadLetter, Error, Previous, Replay, Replayer, Reset, Selection, read_letters};
use idem_redis::{RedisBackend, RedisConfig};

const TIMEOUT: Duration = Duration::from_secs(10);

fn config(brokers: &str) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers);
    c
}

/// A dead letter as idem-kafka writes it, from `topic`/`partition`/`offset`, key `id`.
fn letter(topic: &str, partition: i32, offset: i64, id: &str, reason: &str) -> Out {
    let h = |k: &str, v: &str| (k.to_owned(), v.as_bytes().to_vec());
    Out {
        partition: Some(0),
        key: Some(id.as_bytes().to_vec()),
        payload: format!("payload of {id}").into_bytes(),
        headers: vec![
            h("idempotency-key", id),
            h("trace", "t-1"),
            h("idem-original-topic", topic),
            h("idem-original-partition", &partition.to_string()),
            h("idem-original-offset", &offset.to_string()),
            h("idem-key", &format!("billing/{id}")),
            h("idem-key-namespace", "billing"),
            h("idem-reason", reason),
            h("idem-error", "card declined"),
            h("idem-attempts", "3"),
        ],
    }
}

fn high_watermark(brokers: &str, topic: &str, partition: i32) -> i64 {
    let c: BaseConsumer = config(brokers).create().expect("consumer");
    c.fetch_watermarks(topic, partition, TIMEOUT)
        .expect("watermarks")
        .1
}

async fn redis() -> Arc<dyn Backend> {
    let url = idem_conformance::service_env("IDEM_REDIS_URL");
    let prefix = format!("{}:", unique("idem-dlq"));
    Arc::new(
        RedisBackend::connect(RedisConfig::new(url).with_prefix(prefix))
            .await
            .expect("connect to IDEM_REDIS_URL"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn letters_are_read_to_the_end_with_their_headers() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let dlq = unique("read.dlq");
    let empty = unique("empty.dlq");
    create_topics(&brokers, &[(&dlq, 2), (&empty, 3)]).await;

    // An empty topic answers at once, from its watermarks.
    let started = Instant::now();
    let none = read_letters(&config(&brokers), &empty, &Selection::default(), TIMEOUT);
    assert_eq!(none.expect("read the empty topic"), Vec::new());
    assert!(started.elapsed() < TIMEOUT, "the empty read waited");

    let mut bad_origin = letter("payments", 0, 9, "bad", "poisoned");
    bad_origin.headers[2].1 = vec![0xff, 0xfe];
    bad_origin
        .headers
        .retain(|(k, _)| k != "idem-original-partition");
    let mut second = letter("payments", 1, 4, "p2", "mismatch");
    second.partition = Some(1);
    produce(
        &brokers,
        &dlq,
        &[
            letter("payments", 2, 7, "p1", "poisoned"),
            bad_origin,
            Out {
                partition: Some(0),
                payload: b"no headers at all".to_vec(),
                ..Out::default()
            },
            second,
        ],
    )
    .await;

    let all = read_letters(&config(&brokers), &dlq, &Selection::default(), TIMEOUT)
        .expect("read the letters");
    let at: Vec<(i32, i64)> = all.iter().map(|l| (l.partition, l.offset)).collect();
    assert_eq!(at, [(0, 0), (0, 1), (0, 2), (1, 0)]);
    let p1 = &all[0];
    assert_eq!(p1.original_topic.as_deref(), Some("payments"));
    assert_eq!(
        (p1.original_partition, p1.original_offset),
        (Some(2), Some(7))
    );
    assert_eq!(p1.reason.as_deref(), Some("poisoned"));
    assert_eq!(p1.error.as_deref(), Some("card declined"));
    assert_eq!(p1.attempts, Some(3));
    assert_eq!(p1.key.as_deref(), Some("billing/p1"));
    assert_eq!(p1.idem_key(), Some(Ok(Key::new("billing", "p1").unwrap())));
    assert_eq!(p1.payload, Bytes::from_static(b"payload of p1"));
    assert!(p1.problems.is_empty(), "{:?}", p1.problems);
    assert_eq!(p1.destination(), Ok(("payments", 2)));

    let bad = &all[1];
    assert_eq!(bad.original_topic, None);
    assert!(bad.problems[0].contains("not UTF-8"), "{:?}", bad.problems);
    assert!(bad.destination().unwrap_err().contains("not UTF-8"));
    let bare = &all[2];
    assert_eq!((bare.reason.as_deref(), bare.attempts), (None, None));
    assert!(
        bare.destination()
            .unwrap_err()
            .contains("no header idem-original-topic")
    );

    // Selections: a partition, an offset range, a reason.
    let only = |s: Selection| -> Vec<(i32, i64)> {
        read_letters(&config(&brokers), &dlq, &s, TIMEOUT)
            .expect("read")
            .iter()
            .map(|l| (l.partition, l.offset))
            .collect()
    };
    let partition_1 = Selection::new().with_partitions([1]);
    assert_eq!(only(partition_1), [(1, 0)]);
    let range = Selection::new().with_from_offset(1).with_to_offset(1);
    assert_eq!(only(range), [(0, 1)]);
    let mismatch = Selection::new().with_reason("mismatch");
    assert_eq!(only(mismatch), [(1, 0)]);

    // A partition the topic lacks, a topic that does not exist, a broker that is down.
    let p9 = Selection::new().with_partitions([9]);
    let err = read_letters(&config(&brokers), &dlq, &p9, TIMEOUT).unwrap_err();
    assert!(
        matches!(&err, Error::Config(m) if m.contains("no partition 9")),
        "{err}"
    );
    let missing = unique("missing.dlq");
    let err = read_letters(&config(&brokers), &missing, &Selection::default(), TIMEOUT);
    assert!(matches!(err, Err(Error::UnknownTopic(t)) if t == missing));
    let down = read_letters(
        &config("127.0.0.1:1"),
        &dlq,
        &Selection::default(),
        Duration::from_millis(500),
    );
    assert!(matches!(down, Err(Error::Kafka { .. })), "{down:?}");
}

fn claim(key: &Key) -> Claim {
    Claim {
        key: key.clone(),
        owner: "worker".into(),
        lease_ttl: Duration::from_secs(60),
        fingerprint: None,
        max_attempts: 3,
        retention: Duration::from_secs(600),
    }
}

/// A record of `key` in `state` (`Failed` poisoned, or `Completed`).
async fn record(store: &dyn Backend, key: &Key, state: State) {
    let ClaimOutcome::Acquired(lease) = store.claim(&claim(key)).await.expect("claim") else {
        panic!("{key} is not new");
    };
    let ttl = Duration::from_secs(600);
    match state {
        State::Completed => store.complete(&lease, Bytes::from_static(b"ok"), ttl).await,
        _ => {
            store
                .fail(&lease, "declined", FailureKind::Permanent, ttl)
                .await
        }
    }
    .expect("settle");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_letter_is_sent_back_once_and_reset_deletes_only_failed_records() {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_BROKERS");
    let topic = unique("payments");
    let dlq = format!("{topic}.dlq");
    create_topics(&brokers, &[(&topic, 3), (&dlq, 1)]).await;
    produce(
        &brokers,
        &dlq,
        &[
            letter(&topic, 2, 7, "poisoned", "poisoned"),
            letter(&topic, 1, 3, "done", "mismatch"),
            Out {
                partition: Some(0),
                payload: b"not a letter".to_vec(),
                ..Out::default()
            },
            letter(&topic, 42, 1, "nowhere", "poisoned"),
        ],
    )
    .await;
    let store = redis().await;
    let poisoned = Key::new("billing", "poisoned").unwrap();
    let done = Key::new("billing", "done").unwrap();
    record(store.as_ref(), &poisoned, State::Failed).await;
    record(store.as_ref(), &done, State::Completed).await;

    let letters: Vec<DeadLetter> =
        read_letters(&config(&brokers), &dlq, &Selection::default(), TIMEOUT).expect("read");
    assert_eq!(letters.len(), 4);
    let replayer = Replayer::new(&config(&brokers), store.clone(), Duration::from_secs(600))
        .expect("replayer")
        .reset(true);
    assert_eq!(replayer.previous(&letters[0]).await.unwrap(), Previous::New);

    let first = replayer.replay(&letters[0]).await.expect("replay");
    let Replay::Sent { to, reset } = &first else {
        panic!("{first:?}");
    };
    assert_eq!(
        (to.topic.as_str(), to.partition, to.offset),
        (topic.as_str(), 2, 0)
    );
    assert_eq!(*reset, Reset::Deleted);
    assert_eq!(
        store.get(&poisoned).await.unwrap(),
        None,
        "reset deletes it"
    );
    let done_now = replayer.replay(&letters[1]).await.expect("replay");
    assert!(
        matches!(
            &done_now,
            Replay::Sent {
                reset: Reset::Kept(State::Completed),
                ..
            }
        ),
        "{done_now:?}"
    );
    assert_eq!(
        store.get(&done).await.unwrap().unwrap().state,
        State::Completed
    );
    let not_a_letter = replayer.replay(&letters[2]).await.expect("replay");
    assert!(
        matches!(not_a_letter, Replay::Unreplayable(_)),
        "{not_a_letter:?}"
    );

    // The copy on the original topic: key, payload and the original's headers, idem's
    // dead-letter headers off, the letter it came from on.
    let copies = common::read_all(&brokers, &topic, 3, 2, TIMEOUT);
    assert_eq!(copies.len(), 2, "{copies:?}");
    let copy = copies.iter().find(|c| c.partition == 2).expect("copy on 2");
    assert_eq!(copy.key.as_deref(), Some(&b"poisoned"[..]));
    assert_eq!(copy.payload, b"payload of poisoned");
    assert_eq!(copy.headers["idempotency-key"], "poisoned");
    assert_eq!(copy.headers["trace"], "t-1");
    assert_eq!(copy.headers["idem-replay-of"], format!("{dlq}/0/0"));
    assert!(
        !copy.headers.contains_key("idem-reason"),
        "{:?}",
        copy.headers
    );
    assert!(!copy.headers.contains_key("idem-original-topic"));

    // Replaying again sends nothing; a Failed record made since is not reset.
    record(store.as_ref(), &poisoned, State::Failed).await;
    let again = replayer.replay(&letters[0]).await.expect("replay");
    assert_eq!(again, Replay::AlreadySent(to.clone()));
    assert_eq!(
        store.get(&poisoned).await.unwrap().unwrap().state,
        State::Failed
    );
    assert_eq!(high_watermark(&brokers, &topic, 2), 1);
    assert_eq!(
        replayer.previous(&letters[0]).await.unwrap(),
        Previous::Sent(to.clone())
    );

    // A send that fails fails the replay record, and the next replay tries again.
    let nowhere = replayer.replay(&letters[3]).await.expect("replay");
    let Replay::Failed(error) = &nowhere else {
        panic!("{nowhere:?}");
    };
    assert!(error.contains(&format!("{topic}/42")), "{error}");
    assert!(matches!(
        replayer.previous(&letters[3]).await.unwrap(),
        Previous::Failed(_)
    ));
    let key = Replayer::record_key(&letters[3]).unwrap();
    let attempts = |r: Option<idem_core::Record>| r.map(|r| r.attempts);
    assert_eq!(attempts(store.get(&key).await.unwrap()), Some(1));
    assert!(matches!(
        replayer.replay(&letters[3]).await.unwrap(),
        Replay::Failed(_)
    ));
    assert_eq!(attempts(store.get(&key).await.unwrap()), Some(2));
}
