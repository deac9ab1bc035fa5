//! How many store calls a poll batch costs: a `Counting` wrapper logs every call the loop
//! makes to the in-memory store, on librdkafka's MockCluster.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Effects, Out, Recorder, builder, engine, mock_topic, produce, start, unique};
use idem_conformance::{CallLog, Counting};
use idem_core::layer::{BackendExt, ChaosLayer};
use idem_core::{Backend, MemoryBackend};

const WAIT: Duration = Duration::from_secs(30);

/// Runs a consumer of `topic` in a group of its own, over `store`, until `n` messages
/// settled; returns the store calls it made.
async fn consume<B: Backend + Clone + 'static>(
    brokers: &str,
    topic: &str,
    store: &Counting<B>,
    n: usize,
) -> Vec<(&'static str, usize)> {
    let before = store.hook().calls().len();
    let effects = Effects::new();
    let recorder = Recorder::new();
    let running = start(
        builder(brokers, topic, &unique("g"))
            .namespace("calls")
            .engine(engine(
                Arc::new(store.clone()),
                "w1",
                Duration::from_secs(30),
            ))
            .handler(effects.by_key()),
        &recorder,
    );
    recorder.wait_settled(n, WAIT).await;
    running.stop().await;
    store.hook().calls().split_off(before)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_of_fresh_keys_costs_one_claim_and_one_settle_and_a_batch_of_duplicates_one_claim()
{
    let topic = unique("calls");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    let n = 300;
    let msgs: Vec<Out> = (0..n)
        .map(|i| Out::keyed(0, &format!("k{i}"), &format!("p{i}")))
        .collect();
    produce(&brokers, &topic, &msgs).await;
    let store = MemoryBackend::new().layer(CallLog::new());

    let fresh = consume(&brokers, &topic, &store, n).await;
    let claims: Vec<usize> = fresh
        .iter()
        .filter(|c| c.0 == "claim_many")
        .map(|c| c.1)
        .collect();
    assert_eq!(
        claims.iter().sum::<usize>(),
        n,
        "every message claimed once: {fresh:?}"
    );
    let expected: Vec<(&str, usize)> = claims
        .iter()
        .flat_map(|&k| [("claim_many", k), ("settle_many", k)])
        .collect();
    assert_eq!(
        fresh, expected,
        "each batch of fresh keys: one claim_many, then one settle_many of the same size"
    );
    // How fetches split the messages is the broker's; that a claim ever covers more than
    // one message is idem's (all were produced before the consumer started).
    assert!(claims.len() < n, "messages were batched: {claims:?}");

    // The same messages in another group, same namespace: every one a duplicate.
    let again = consume(&brokers, &topic, &store, n).await;
    assert!(
        again.iter().all(|c| c.0 == "claim_many"),
        "a batch of duplicates costs its claim alone: {again:?}"
    );
    assert_eq!(again.iter().map(|c| c.1).sum::<usize>(), n);
}

/// A chunk is sized by its handlers' time, not its store calls': a store that refuses the
/// first claims (the partition stalls for the backoff, about 300 ms) made the first chunk
/// look like slow handlers, and the chunks after it a few messages each for dozens of
/// chunks, two store calls apiece.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_first_claim_does_not_shrink_the_chunks_after_it() {
    let topic = unique("slowfirst");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    let n = 3_000;
    let msgs: Vec<Out> = (0..n)
        .map(|i| Out::keyed(0, &format!("k{i}"), &format!("p{i}")))
        .collect();
    produce(&brokers, &topic, &msgs).await;
    let chaos = ChaosLayer::new();
    chaos.refuse_next(4);
    let store = MemoryBackend::new()
        .layer(chaos.clone())
        .layer(CallLog::new());

    let claims: Vec<usize> = consume(&brokers, &topic, &store, n)
        .await
        .into_iter()
        .filter(|c| c.0 == "claim_many")
        .map(|c| c.1)
        .collect();
    // Four refused, then 3,000 messages in batches of at most 500: about ten. Sized by
    // the chunk's whole time, they took 35, the chunks growing by an eighth from 2.
    assert!(
        claims.len() <= 20,
        "{} claims after a slow first one: {claims:?}",
        claims.len()
    );
}
