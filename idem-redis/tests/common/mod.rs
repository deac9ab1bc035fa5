//! Helpers shared by the test files: backends on the configured servers, raw clients to
//! write foreign values, and a private `redis-server` a test may stop and restart.

#![allow(dead_code)] // each test file uses a part

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem_conformance::service_env;
use idem_core::backend::Claim;
use idem_core::{Fingerprint, Key};
use idem_redis::{RedisBackend, RedisConfig};

pub const HOUR: Duration = Duration::from_secs(3600);

pub fn standalone_config() -> RedisConfig {
    RedisConfig::new(service_env("IDEM_REDIS_URL"))
}

pub fn cluster_config() -> RedisConfig {
    let urls = service_env("IDEM_REDIS_CLUSTER_URL");
    RedisConfig::cluster(urls.split(',').map(str::trim))
}

pub async fn connect(config: RedisConfig) -> RedisBackend {
    RedisBackend::connect(config).await.expect("connect")
}

/// A backend on `IDEM_REDIS_URL` under a key prefix of its own, for a test that lists the
/// whole prefix (other tests plant foreign values under the shared one), and a plain
/// connection to write beside it.
pub async fn own_prefix() -> (RedisBackend, redis::aio::MultiplexedConnection) {
    let prefix = format!("idem-own:{}:", idem_conformance::unique_namespace());
    let backend = connect(standalone_config().with_prefix(prefix)).await;
    (backend, raw(&service_env("IDEM_REDIS_URL")).await)
}

/// A plain connection for writing what idem would not.
pub async fn raw(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("raw connection")
}

/// A plain cluster connection.
pub async fn raw_cluster() -> redis::cluster_async::ClusterConnection {
    let urls = service_env("IDEM_REDIS_CLUSTER_URL");
    redis::cluster::ClusterClient::new(urls.split(',').map(str::trim).collect::<Vec<_>>())
        .expect("urls")
        .get_async_connection()
        .await
        .expect("raw cluster connection")
}

/// A claim of `key` by `owner` with a 10 s lease.
pub fn claim(key: &Key, owner: &str) -> Claim {
    Claim {
        key: key.clone(),
        owner: owner.into(),
        lease_ttl: Duration::from_secs(10),
        fingerprint: Some(Fingerprint::of(b"p")),
        max_attempts: 3,
        retention: HOUR,
    }
}

/// Claims by "w" of `n` fresh keys of one new namespace.
pub fn fresh_batch(n: usize) -> Vec<Claim> {
    let ns = idem_conformance::unique_namespace();
    (0..n)
        .map(|i| claim(&Key::new(ns.clone(), format!("k{i}")).expect("key"), "w"))
        .collect()
}

/// A loopback port nothing listens on (bound, then released).
pub fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// A `redis-server` (or `valkey-server`) of this test's own on a free loopback port,
/// killed on drop.
pub struct PrivateServer {
    pub port: u16,
    binary: String,
    child: Option<Child>,
}

impl PrivateServer {
    pub async fn start() -> Self {
        Self::start_binary("redis-server".into()).await
    }

    /// Valkey 8.1, which has compare-and-set (`SET … IFEQ`): the binary `scripts/services
    /// up` installs, named by `IDEM_VALKEY_SERVER`.
    pub async fn start_valkey() -> Self {
        Self::start_binary(service_env("IDEM_VALKEY_SERVER")).await
    }

    async fn start_binary(binary: String) -> Self {
        let mut server = PrivateServer {
            port: closed_port(),
            binary,
            child: None,
        };
        server.restart().await;
        server
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Starts the server (again) on the same port and waits until it answers.
    pub async fn restart(&mut self) {
        let child = Command::new(&self.binary)
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "{} did not start ({e}): run `eval \"$(scripts/services up)\"`, which \
                     installs it",
                    self.binary
                )
            });
        self.child = Some(child);
        let client = redis::Client::open(self.url()).expect("url");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                let pong: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut c).await;
                if pong.is_ok() {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "private {} did not start",
                self.binary
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Kills the server and waits for it to exit.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Calls per command so far (`INFO commandstats`), for the commands named.
pub async fn calls(conn: &mut impl redis::aio::ConnectionLike, commands: &[&str]) -> Vec<u64> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .expect("info");
    commands
        .iter()
        .map(|c| {
            info.lines()
                .find_map(|l| l.strip_prefix(&format!("cmdstat_{c}:calls=")))
                .and_then(|rest| rest.split(',').next())
                .map_or(0, |n| n.parse().expect("calls"))
        })
        .collect()
}

/// A private server, a backend on it and a raw connection to it, for a test that counts the
/// server's commands.
pub async fn private() -> (
    PrivateServer,
    RedisBackend,
    redis::aio::MultiplexedConnection,
) {
    on(PrivateServer::start().await).await
}

/// [`private`] on a Valkey 8.1 server.
pub async fn private_valkey() -> (
    PrivateServer,
    RedisBackend,
    redis::aio::MultiplexedConnection,
) {
    on(PrivateServer::start_valkey().await).await
}

async fn on(
    server: PrivateServer,
) -> (
    PrivateServer,
    RedisBackend,
    redis::aio::MultiplexedConnection,
) {
    let backend = connect(RedisConfig::new(server.url())).await;
    let conn = raw(&server.url()).await;
    (server, backend, conn)
}
