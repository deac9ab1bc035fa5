//! The whole conformance suite on a real PostgreSQL (`IDEM_POSTGRES_URL`), and the failure
//! cases of `idem_conformance::remote_suite!`; then the suite again with the backend in every
//! layer (timeout, retry, observe), which must change no answer.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use std::sync::Arc;

use idem_conformance::{Factory, Fixture, Remote, in_every_layer};
use idem_core::{Backend, Key, Result};
use idem_postgres::{PgBackend, PgConfig};
use sqlx::AssertSqlSafe;

const LEASE: Duration = Duration::from_secs(1);
/// The connect timeout the failure cases configure, and the slack a shared two-core
/// machine adds.
const TIMEOUT: Duration = Duration::from_millis(500);
const SLACK: Duration = Duration::from_secs(1);

struct Postgres;

impl Factory for Postgres {
    type Backend = PgBackend;
    async fn setup(&self) -> Fixture<PgBackend> {
        Fixture::real(common::backend().await, LEASE)
    }

    async fn setup_with_response_limit(&self, limit: usize) -> Option<Fixture<PgBackend>> {
        let backend =
            common::backend_with(|c| c.with_max_connections(20).with_max_response_bytes(limit));
        Some(Fixture::real(backend.await, LEASE))
    }
}

impl Remote for Postgres {
    /// The pool connects at once, within the connect timeout; statements are bounded by
    /// the same.
    async fn connect_to(&self, addr: SocketAddr) -> Result<PgBackend> {
        let url = format!("postgres://postgres@{addr}/test");
        let config = PgConfig::new(url)
            .with_connect_timeout(TIMEOUT)
            .with_query_timeout(TIMEOUT);
        PgBackend::connect(config).await
    }

    fn unavailable_within(&self) -> Duration {
        TIMEOUT + SLACK
    }

    /// Rows idem never writes: a fingerprint of the wrong length, a state it does not know.
    async fn plant_corrupt(
        &self,
        fixture: &Fixture<PgBackend>,
        key: &Key,
        kind: usize,
    ) -> Option<String> {
        let (what, state, fingerprint) = match kind {
            0 => ("a two-byte fingerprint", "processing", Some(vec![1u8, 2])),
            1 => ("an unknown state", "exploded", None),
            _ => return None,
        };
        let insert = format!(
            "INSERT INTO \"{}\".idem_records (namespace, id, state, owner, token, attempts, \
             max_attempts, claim_kind, lease_until, fingerprint, expires_at) VALUES ($1, $2, \
             $3, 'x', 1, 1, 3, 'first', now() + interval '1 hour', $4, \
             now() + interval '2 hours')",
            fixture.backend.schema()
        );
        sqlx::query(AssertSqlSafe(insert))
            .bind(key.namespace())
            .bind(key.id())
            .bind(state)
            .bind(fingerprint)
            .execute(fixture.backend.pool())
            .await
            .expect("insert a foreign row");
        Some(what.to_owned())
    }
}

idem_conformance::suite!(Postgres);
idem_conformance::remote_suite!(Postgres);

/// The backend in every layer (`idem_conformance::in_every_layer`), over a real server.
struct Layers;

impl Factory for Layers {
    type Backend = Arc<dyn Backend>;
    async fn setup(&self) -> Fixture<Arc<dyn Backend>> {
        Fixture::real(in_every_layer(common::backend().await), LEASE)
    }

    async fn setup_with_response_limit(&self, limit: usize) -> Option<Fixture<Arc<dyn Backend>>> {
        let backend =
            common::backend_with(|c| c.with_max_connections(20).with_max_response_bytes(limit));
        Some(Fixture::real(in_every_layer(backend.await), LEASE))
    }
}

mod layers {
    idem_conformance::suite!(super::Layers);
}
