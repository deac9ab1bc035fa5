//! The span per message and the counters, seen through a global tracing subscriber and a
//! global metrics recorder (so this binary holds one test).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use common::{Out, Recorder, builder, counter, engine, mock_topic, produce, start, unique};
use idem_core::layer::{BackendExt, ChaosLayer, Fault};
use idem_core::{Backend, HandlerError, Key, MemoryBackend};
use idem_kafka::metrics as names;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

type Fields = HashMap<String, String>;

/// Keeps the fields of every closed `idem_kafka.message` span.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<Fields>>>);

struct Visitor<'a>(&'a mut Fields);

impl Visit for Visitor<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_owned(),
            format!("{value:?}").trim_matches('"').to_owned(),
        );
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: tracing::Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        if attrs.metadata().name() != "idem_kafka.message" {
            return;
        }
        let mut fields = Fields::new();
        attrs.record(&mut Visitor(&mut fields));
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(fields);
        }
    }
    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(fields) = span.extensions_mut().get_mut::<Fields>() {
                values.record(&mut Visitor(fields));
            }
        }
    }
    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(&id) {
            if let Some(fields) = span.extensions_mut().remove::<Fields>() {
                self.0.lock().expect("lock").push(fields);
            }
        }
    }
}

fn install() -> Spans {
    static ONCE: OnceLock<Spans> = OnceLock::new();
    ONCE.get_or_init(|| {
        let spans = Spans::default();
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(spans.clone()))
            .expect("subscriber");
        common::install_metrics();
        spans
    })
    .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spans_and_counters_follow_each_message() {
    let spans = install();
    let topic = unique("obs");
    let (_cluster, brokers) = mock_topic(&topic, 1);
    let group = unique("g");
    let chaos = ChaosLayer::new();
    let faulty = MemoryBackend::new().layer(chaos.clone());
    let backend = Arc::new(faulty.clone());
    // "held" is held by another worker until the test lets it go.
    let other = engine(backend.clone(), "other", Duration::from_secs(60));
    let held = Key::new(group.as_str(), "held").unwrap();
    let lease = match backend
        .claim(&other.claim_for(&held, b"held"))
        .await
        .unwrap()
    {
        idem_core::backend::ClaimOutcome::Acquired(l) => l,
        o => panic!("{o:?}"),
    };
    let msgs = [
        Out::keyed(0, "k1", "k1"),
        Out::keyed(0, "k2", "k2"),
        Out::keyed(0, "k1", "k1"),
        Out::keyed(0, "poison", "poison"),
        Out::keyed(0, "fence-me", "fence-me"),
        Out::keyed(0, "held", "held"),
    ];
    produce(&brokers, &topic, &msgs).await;
    let recorder = Recorder::new();
    let store = backend.clone();
    let fenced_once = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let running = start(
        builder(&brokers, &topic, &group)
            .engine(engine(backend.clone(), "w1", Duration::from_secs(5)))
            .retry_backoff(Duration::from_millis(10), Duration::from_millis(100))
            .handler(move |msg, ctx| {
                let (store, fenced_once) = (store.clone(), fenced_once.clone());
                async move {
                    let key = msg.idempotency_key().cloned().expect("keyed");
                    match key.id() {
                        "poison" => Err(HandlerError::permanent("never")),
                        // The record vanishes under the first run (as if an operator
                        // deleted it): its complete is fenced and the key runs again.
                        "fence-me"
                            if !fenced_once.swap(true, std::sync::atomic::Ordering::SeqCst) =>
                        {
                            store.delete(&key).await.map_err(HandlerError::retry)?;
                            Ok(Bytes::from_static(b"lost"))
                        }
                        _ => Ok(Bytes::from(format!(
                            "{}:{}",
                            key.id(),
                            ctx.map_or(0, |c| c.token())
                        ))),
                    }
                }
            }),
        &recorder,
    );
    recorder.wait_settled(5, Duration::from_secs(30)).await;
    // "held" waits; then the store fails for a while; then the holder completes.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while counter(names::IN_PROGRESS_WAITS, &topic) < 2 {
        assert!(std::time::Instant::now() < deadline, "no in-progress waits");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    chaos.set(Fault::Claim, true);
    while counter(names::STORE_ERRORS, &topic) < 2 {
        assert!(std::time::Instant::now() < deadline, "no store errors");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    faulty
        .inner()
        .complete(
            &lease,
            Bytes::from_static(b"other"),
            Duration::from_secs(3600),
        )
        .await
        .unwrap();
    chaos.set(Fault::Claim, false);
    recorder.wait_settled(6, Duration::from_secs(30)).await;
    running.stop().await;

    assert_eq!(counter(names::EXECUTED, &topic), 3, "k1, k2, fence-me");
    assert_eq!(counter(names::REPLAYED, &topic), 2, "k1 again, held");
    assert_eq!(counter(names::POISONED, &topic), 1);
    assert_eq!(counter(names::DEAD_LETTERED, &topic), 1);
    assert_eq!(counter(names::FENCED, &topic), 1);
    assert!(counter(names::IN_PROGRESS_WAITS, &topic) >= 2);
    assert!(counter(names::STORE_ERRORS, &topic) >= 2);

    let spans: Vec<Fields> = spans
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|f| f.get("topic") == Some(&topic))
        .cloned()
        .collect();
    let outcome = |offset: i64| {
        let s = spans
            .iter()
            .find(|f| f["offset"] == offset.to_string())
            .unwrap_or_else(|| panic!("no span for offset {offset}: {spans:?}"));
        assert_eq!(s["partition"], "0");
        (
            s["key"].clone(),
            s.get("outcome").cloned().unwrap_or_default(),
        )
    };
    let k = |id: &str| format!("{group}/{id}");
    assert_eq!(outcome(0), (k("k1"), "executed".into()));
    assert_eq!(outcome(1), (k("k2"), "executed".into()));
    assert_eq!(outcome(2), (k("k1"), "replayed".into()));
    assert_eq!(outcome(3), (k("poison"), "dead-lettered".into()));
    assert_eq!(outcome(4), (k("fence-me"), "executed".into()));
    assert_eq!(outcome(5), (k("held"), "replayed".into()));
}
