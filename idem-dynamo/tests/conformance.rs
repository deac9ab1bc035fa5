//! The whole conformance suite on Amazon DynamoDB Local (`IDEM_DYNAMO_ENDPOINT`), twice:
//!
//! - `real`: on the system clock with a one-second lease, as a deployment runs;
//! - `client_clock`: on a manual clock the backend reads. DynamoDB has no clock of its own
//!   in this backend (the client's decides), so this is the same code on the same server,
//!   with time moved in quarter leases: the property then lands claims exactly on lease
//!   and retention deadlines, which real time never does, and checks each against the
//!   reference model with no skew margin.
//!
//! Each case gets its own namespace, which is its own key prefix, in one shared table.
//! `real` also runs the failure cases of `idem_conformance::remote_suite!`.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;
use bytes::Bytes;
use idem_conformance::{Factory, Fixture, Remote};
use idem_core::backend::{Claim, ClaimOutcome};
use idem_core::clock::ManualClock;
use idem_core::{Backend, Key, Result, Timestamp};
use idem_dynamo::{DynamoBackend, DynamoConfig};

const TABLE: &str = "idem_conformance";
/// Long enough that 64 racing claims finish inside it on a loaded two-core machine (600 ms
/// was not, right after DynamoDB Local started); short enough that the property's sleeps,
/// one and a half leases each, stay in minutes.
const LEASE: Duration = Duration::from_secs(1);

async fn connect(config: DynamoConfig) -> DynamoBackend {
    static READY: AtomicBool = AtomicBool::new(false);
    let backend = DynamoBackend::connect(config).await.expect("connect");
    if !READY.load(Ordering::Acquire) {
        backend.create_table().await.expect("create table");
        warm_up(&backend).await;
        READY.store(true, Ordering::Release);
    }
    backend
}

/// Runs the claim paths a few hundred times before the first case. A DynamoDB Local that
/// has just started answers its first requests several times slower than later ones (its
/// JVM compiles as it goes), slow enough that 64 racing claims can outlast a lease, which
/// the race cases take as a second winner.
async fn warm_up(backend: &DynamoBackend) {
    let namespace = idem_conformance::unique_namespace();
    for round in 0..4 {
        let claims: Vec<Claim> = (0..64)
            .map(|i| {
                let id = format!("{}-{}", round / 2, i % 32); // odd rounds replay
                let key = Key::new(namespace.clone(), id).expect("key");
                let long = Duration::from_secs(60); // however slow the server still is
                idem_conformance::claim_of(&key, &format!("warm-{round}-{i}"), long)
            })
            .collect();
        let answers = backend.claim_many(&claims).await.expect("warm-up claims");
        for answer in answers {
            if let ClaimOutcome::Acquired(lease) = answer {
                let done = backend.complete(&lease, Bytes::from_static(b"w"), LEASE * 60);
                done.await.expect("warm-up complete");
            }
        }
    }
}

/// The system clock, the tests' skew margin.
struct Real;

impl Factory for Real {
    type Backend = DynamoBackend;

    async fn setup(&self) -> Fixture<DynamoBackend> {
        Fixture::real(connect(common::config(TABLE)).await, LEASE)
    }

    async fn setup_with_response_limit(&self, limit: usize) -> Option<Fixture<DynamoBackend>> {
        let config = common::config(TABLE).with_max_response_bytes(limit);
        Some(Fixture::real(connect(config).await, LEASE))
    }
}

impl Remote for Real {
    /// The client connects lazily: each call must give up on its own, within one operation
    /// timeout of 1 s (attempts of 300 ms, at most 3).
    async fn connect_to(&self, addr: SocketAddr) -> Result<DynamoBackend> {
        let config = DynamoConfig::local(format!("http://{addr}"), TABLE)
            .with_connect_timeout(Duration::from_millis(300))
            .with_attempt_timeout(Duration::from_millis(300))
            .with_operation_timeout(Duration::from_secs(1))
            .with_sdk_attempts(3);
        DynamoBackend::connect(config).await
    }

    /// The operation timeout, and 2 s for a loaded machine.
    fn unavailable_within(&self) -> Duration {
        Duration::from_secs(3)
    }

    /// Items idem never writes: attributes of the wrong type and a state it does not know,
    /// and a `processing` item missing its deadlines.
    async fn plant_corrupt(
        &self,
        fixture: &Fixture<DynamoBackend>,
        key: &Key,
        kind: usize,
    ) -> Option<String> {
        let s = |text: &str| AttributeValue::S(text.to_owned());
        let (what, attributes) = match kind {
            0 => (
                "an unknown state",
                [("st", s("dancing")), ("tok", s("not a number"))],
            ),
            1 => (
                "no deadlines",
                [
                    ("st", s("processing")),
                    ("tok", AttributeValue::N("1".into())),
                ],
            ),
            _ => return None,
        };
        let pk = format!("{}/{}", key.namespace(), key.id());
        let mut put = fixture
            .backend
            .client()
            .put_item()
            .table_name(TABLE)
            .item("pk", s(&pk));
        put = put.item("owner", s("w"));
        for (name, value) in attributes {
            put = put.item(name, value);
        }
        put.send().await.expect("plant a foreign item");
        Some(what.to_owned())
    }
}

/// A manual clock starting now (so that TTL, which runs on the server's clock, never
/// removes an item the test still reads), no skew margin.
struct ClientClock;

impl Factory for ClientClock {
    type Backend = DynamoBackend;

    async fn setup(&self) -> Fixture<DynamoBackend> {
        let clock = ManualClock::new(Timestamp::now());
        let config = common::config(TABLE).with_clock_skew(Duration::ZERO);
        let backend = connect(config).await.with_clock(clock.clone());
        Fixture::manual(backend, clock)
    }

    async fn setup_with_response_limit(&self, limit: usize) -> Option<Fixture<DynamoBackend>> {
        let clock = ManualClock::new(Timestamp::now());
        let config = common::config(TABLE)
            .with_clock_skew(Duration::ZERO)
            .with_max_response_bytes(limit);
        let backend = connect(config).await.with_clock(clock.clone());
        Some(Fixture::manual(backend, clock))
    }
}

mod real {
    idem_conformance::suite!(super::Real);
    idem_conformance::remote_suite!(super::Real);
}

mod client_clock {
    idem_conformance::suite!(super::ClientClock);
}
