//! The whole conformance suite against a real Redis: standalone (`IDEM_REDIS_URL`) and a
//! real cluster (`IDEM_REDIS_CLUSTER_URL`, comma-separated node URLs), with 500 ms leases
//! and real waiting. `eval "$(scripts/services up)"` starts both.

use std::time::Duration;

use conformance::{Factory, Fixture, service_env};
use idem_redis::{RedisBackend, RedisConfig};

const LEASE: Duration = Duration::from_millis(500);

/// A standalone server.
struct Standalone;

impl Factory for Standalone {
    type Backend = RedisBackend;
    async fn setup(&self) -> Fixture<RedisBackend> {
        let config = RedisConfig::new(service_env("IDEM_REDIS_URL"));
        let backend = RedisBackend::connect(config)
            .await
            .expect("connect to IDEM_REDIS_URL");
        Fixture::real(backend, LEASE)
    }
}

/// A Redis Cluster of several primaries.
struct Cluster;

impl Factory for Cluster {
    type Backend = RedisBackend;
    async fn setup(&self) -> Fixture<RedisBackend> {
        let urls = service_env("IDEM_REDIS_CLUSTER_URL");
        let config = RedisConfig::cluster(urls.split(',').map(str::trim));
        let backend = RedisBackend::connect(config)
            .await
            .expect("connect to IDEM_REDIS_CLUSTER_URL");
        Fixture::real(backend, LEASE)
    }
}

mod standalone {
    conformance::suite!(super::Standalone);
}

mod cluster {
    conformance::suite!(super::Cluster);
}
