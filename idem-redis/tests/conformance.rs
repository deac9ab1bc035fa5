//! The whole conformance suite against a real Redis: standalone (`IDEM_REDIS_URL`), a
//! real cluster (`IDEM_REDIS_CLUSTER_URL`, comma-separated node URLs) and a standalone
//! Valkey 8.1 (`IDEM_VALKEY_URL`, where a single complete is a compare-and-set), with
//! 500 ms leases and real waiting, and the failure cases of `idem_conformance::remote_suite!`.
//! `eval "$(scripts/services up)"` starts all three.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::{cluster_config, raw, raw_cluster, standalone_config};
use idem_conformance::{Factory, Fixture, Remote, in_every_layer, service_env};
use idem_core::{Backend, Key, Result};
use idem_redis::{RedisBackend, RedisConfig};

const LEASE: Duration = Duration::from_millis(500);
/// The timeout the failure cases configure, and the slack a shared two-core machine adds.
const TIMEOUT: Duration = Duration::from_millis(300);
const SLACK: Duration = Duration::from_millis(400);

async fn fixture(config: RedisConfig) -> Fixture<RedisBackend> {
    let backend = RedisBackend::connect(config)
        .await
        .expect("connect to the configured Redis");
    Fixture::real(backend, LEASE)
}

/// Values idem never writes at a record's key: strings that do not decode as a record
/// (far-future expiries, so only the decoding can refuse them), and a hash. Each is the
/// command that writes it and its arguments after the key.
fn corrupt_value(kind: usize) -> Option<(&'static str, String, Vec<Vec<u8>>)> {
    let far = "99999999999999";
    let text = |what: &str, v: String| Some(("SET", what.to_owned(), vec![v.into_bytes()]));
    match kind {
        0 => text("no header", "hello".into()),
        1 => text("bad state", format!("z1,1,,{far},0,1,0,,;w")),
        2 => text("bad token", format!("p0x1,1,,{far},0,1,0,,;w")),
        3 => text("missing expiry", "c1,1,,,0,1,0,0,;w".into()),
        4 => text("short fingerprint", format!("p1,1,,{far},0,1,3,,;wabc")),
        5 => text("lengths disagree", format!("c1,1,,{far},0,1,0,9,;wok")),
        6 => text("huge number", "p1,1,,99999999999999999999,0,1,0,,;w".into()),
        7 => Some(("HSET", "a hash".into(), vec![b"s".to_vec(), b"c".to_vec()])),
        _ => None,
    }
}

/// Plants the `kind`th corrupt value at `key`'s record through `conn`.
async fn plant<C: redis::aio::ConnectionLike>(
    conn: &mut C,
    backend: &RedisBackend,
    key: &Key,
    kind: usize,
) -> Option<String> {
    let (command, what, args) = corrupt_value(kind)?;
    let _: () = redis::cmd(command)
        .arg(backend.record_key(key))
        .arg(args)
        .query_async(conn)
        .await
        .expect("plant a foreign value");
    Some(what)
}

/// A standalone server, a Redis Cluster of several primaries, or a standalone Valkey 8.1
/// (whose compare-and-set takes the single complete's fast path).
#[derive(Clone, Copy)]
enum Redis {
    Standalone,
    Cluster,
    Valkey,
}

impl Redis {
    fn config(self) -> RedisConfig {
        match self {
            Redis::Standalone => standalone_config(),
            Redis::Cluster => cluster_config(),
            Redis::Valkey => RedisConfig::new(service_env("IDEM_VALKEY_URL")),
        }
    }
}

impl Factory for Redis {
    type Backend = RedisBackend;
    async fn setup(&self) -> Fixture<RedisBackend> {
        fixture(self.config()).await
    }
    async fn setup_with_response_limit(&self, limit: usize) -> Option<Fixture<RedisBackend>> {
        Some(fixture(self.config().with_max_response_bytes(limit)).await)
    }
}

impl Remote for Redis {
    /// Standalone lazily: the connect succeeds, and each call must time out on its own. A
    /// cluster eagerly: the client reads the slot map at connect, so the connect answers.
    async fn connect_to(&self, addr: SocketAddr) -> Result<RedisBackend> {
        let url = format!("redis://{addr}/");
        match self {
            Redis::Standalone | Redis::Valkey => {
                RedisBackend::connect_lazy(RedisConfig::new(url).with_timeout(TIMEOUT))
            }
            Redis::Cluster => {
                RedisBackend::connect(RedisConfig::cluster([url]).with_timeout(TIMEOUT)).await
            }
        }
    }
    fn unavailable_within(&self) -> Duration {
        TIMEOUT + SLACK
    }
    async fn plant_corrupt(
        &self,
        fixture: &Fixture<RedisBackend>,
        key: &Key,
        kind: usize,
    ) -> Option<String> {
        let backend = &fixture.backend;
        match self {
            Redis::Standalone => {
                let mut conn = raw(&service_env("IDEM_REDIS_URL")).await;
                plant(&mut conn, backend, key, kind).await
            }
            Redis::Valkey => {
                let mut conn = raw(&service_env("IDEM_VALKEY_URL")).await;
                plant(&mut conn, backend, key, kind).await
            }
            Redis::Cluster => plant(&mut raw_cluster().await, backend, key, kind).await,
        }
    }
}

mod standalone {
    idem_conformance::suite!(super::Redis::Standalone);
    idem_conformance::remote_suite!(super::Redis::Standalone);
}

mod cluster {
    idem_conformance::suite!(super::Redis::Cluster);
    idem_conformance::remote_suite!(super::Redis::Cluster);
}

mod valkey {
    idem_conformance::suite!(super::Redis::Valkey);
}

/// The cluster in every layer of idem-core (`idem_conformance::in_every_layer`): concurrent
/// single calls joined into batch calls, which the cluster splits by slot.
struct Layers;

impl Factory for Layers {
    type Backend = Arc<dyn Backend>;
    async fn setup(&self) -> Fixture<Arc<dyn Backend>> {
        let bare = fixture(cluster_config()).await;
        Fixture::real(in_every_layer(bare.backend), LEASE)
    }
    async fn setup_with_response_limit(&self, limit: usize) -> Option<Fixture<Arc<dyn Backend>>> {
        let bare = fixture(cluster_config().with_max_response_bytes(limit)).await;
        Some(Fixture::real(in_every_layer(bare.backend), LEASE))
    }
}

mod layers {
    idem_conformance::suite!(super::Layers);
}
