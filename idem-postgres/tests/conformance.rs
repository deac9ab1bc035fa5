//! The whole conformance suite on a real PostgreSQL (`IDEM_POSTGRES_URL`).

mod common;

use std::time::Duration;

use conformance::{Factory, Fixture};
use idem_postgres::PgBackend;

struct Postgres;

impl Factory for Postgres {
    type Backend = PgBackend;
    async fn setup(&self) -> Fixture<PgBackend> {
        Fixture::real(common::backend().await, Duration::from_secs(1))
    }
}

conformance::suite!(Postgres);
