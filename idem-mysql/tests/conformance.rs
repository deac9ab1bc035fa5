//! The whole conformance suite on a real MySQL or MariaDB (`IDEM_MYSQL_URL`), and the
//! failure cases of `idem_conformance::remote_suite!`; then the suite again with the backend
//! in every layer (timeout, retry, observe), which must change no answer.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use idem_conformance::{Factory, Fixture, Remote, in_every_layer};
use idem_core::{Backend, Key, Result};
use idem_mysql::{MySqlBackend, MySqlConfig};
use sqlx::AssertSqlSafe;

const LEASE: Duration = Duration::from_secs(1);
/// The connect timeout the failure cases configure, and the slack a shared two-core
/// machine adds.
const TIMEOUT: Duration = Duration::from_millis(500);
const SLACK: Duration = Duration::from_secs(1);

struct MySql;

impl Factory for MySql {
    type Backend = MySqlBackend;
    async fn setup(&self) -> Fixture<MySqlBackend> {
        Fixture::real(common::backend().await, LEASE)
    }

    async fn setup_with_response_limit(&self, limit: usize) -> Option<Fixture<MySqlBackend>> {
        let backend =
            common::backend_with(|c| c.with_max_connections(20).with_max_response_bytes(limit));
        Some(Fixture::real(backend.await, LEASE))
    }
}

impl Remote for MySql {
    /// The pool connects at once, within the connect timeout; calls are bounded by the
    /// same.
    async fn connect_to(&self, addr: SocketAddr) -> Result<MySqlBackend> {
        let url = format!("mysql://root@{addr}/test");
        let config = MySqlConfig::new(url)
            .with_connect_timeout(TIMEOUT)
            .with_query_timeout(TIMEOUT);
        MySqlBackend::connect(config).await
    }

    fn unavailable_within(&self) -> Duration {
        TIMEOUT + SLACK
    }

    /// Rows idem never writes: a fingerprint of the wrong length, a state it does not
    /// know, an owner that is not UTF-8.
    async fn plant_corrupt(
        &self,
        fixture: &Fixture<MySqlBackend>,
        key: &Key,
        kind: usize,
    ) -> Option<String> {
        let (what, state, fingerprint, owner) = match kind {
            0 => (
                "a two-byte fingerprint",
                "processing",
                Some(vec![1u8, 2]),
                vec![b'x'],
            ),
            1 => ("an unknown state", "exploded", None, vec![b'x']),
            2 => (
                "an owner that is not UTF-8",
                "processing",
                None,
                vec![0xff, 0xfe],
            ),
            _ => return None,
        };
        let insert = "INSERT INTO idem_records (namespace, id, state, owner, token, attempts, \
             lease_until_ms, fingerprint, expires_at_ms) VALUES (?, ?, ?, ?, 1, 1, \
             (UNIX_TIMESTAMP() + 3600) * 1000, ?, (UNIX_TIMESTAMP() + 7200) * 1000)";
        sqlx::query(AssertSqlSafe(insert))
            .bind(key.namespace().as_bytes())
            .bind(key.id().as_bytes())
            .bind(state)
            .bind(owner)
            .bind(fingerprint)
            .execute(fixture.backend.pool())
            .await
            .expect("insert a foreign row");
        Some(what.to_owned())
    }
}

idem_conformance::suite!(MySql);
idem_conformance::remote_suite!(MySql);

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
