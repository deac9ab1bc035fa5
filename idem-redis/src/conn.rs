//! One connection type for both deployments: a [`ConnectionManager`] (reconnects by itself)
//! for a standalone server, a [`ClusterConnection`] (follows slot moves) for a cluster.

use std::future::Future;
use std::time::Duration;

use idem_core::{Error, Result};
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{
    MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo, SingleNodeRoutingInfo,
};
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

use crate::RedisConfig;
use crate::error::{from_connect, from_redis};

/// A cluster node, as `(host, port)`.
pub(crate) type Node = (String, u16);

#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Conn {
    /// Connects now, within the configured timeout.
    pub(crate) async fn connect(config: &RedisConfig) -> Result<Self> {
        let limit = config.timeout();
        let first = config.nodes().first().map_or("", String::as_str);
        let (server, tls) = server_of(first);
        // What a timeout names: a plaintext port never answers a TLS handshake.
        let what = if tls {
            format!(
                "TLS connect to {server} (is it a TLS port? plaintext ones answer no handshake)"
            )
        } else {
            format!("connect to {server}")
        };
        Ok(if config.is_cluster() {
            let client = cluster_client(config)?;
            let connect = client.get_async_connection_with_config(cluster_config(limit));
            Conn::Cluster(
                idem_core::layer::within(&what, limit, async {
                    connect.await.map_err(|e| from_connect(&server, tls, e))
                })
                .await?,
            )
        } else {
            let connect =
                ConnectionManager::new_with_config(single_client(config)?, manager_config(limit));
            Conn::Single(
                idem_core::layer::within(&what, limit, async {
                    connect.await.map_err(|e| from_connect(&server, tls, e))
                })
                .await?,
            )
        })
    }

    /// A connection made on first use. Needs a running tokio runtime.
    pub(crate) fn connect_lazy(config: &RedisConfig) -> Result<Self> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(Error::config("connect_lazy needs a running tokio runtime"));
        }
        let limit = config.timeout();
        Ok(if config.is_cluster() {
            let client = cluster_client(config)?;
            Conn::Cluster(client.get_pending_async_connection_with_config(cluster_config(limit)))
        } else {
            let client = single_client(config)?;
            let manager = ConnectionManager::new_lazy_with_config(client, manager_config(limit))
                .map_err(|e| config_error(config, e))?;
            Conn::Single(manager)
        })
    }

    /// Sends `cmd` to `node` (a cluster's node; ignored standalone).
    pub(crate) async fn query_on(&mut self, node: Option<&Node>, cmd: Cmd) -> RedisResult<Value> {
        match (self, node) {
            (Conn::Cluster(c), Some((host, port))) => {
                let route = SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                };
                c.route_command(cmd, RoutingInfo::SingleNode(route)).await
            }
            (conn, _) => cmd.query_async(conn).await,
        }
    }

    /// Sends `cmd` to every primary of a cluster (an error if any refuses it), or to the
    /// one server.
    pub(crate) async fn query_all_primaries(&mut self, cmd: Cmd) -> RedisResult<Value> {
        match self {
            Conn::Cluster(c) => {
                let route = (
                    MultipleNodeRoutingInfo::AllMasters,
                    Some(ResponsePolicy::AllSucceeded),
                );
                c.route_command(cmd, RoutingInfo::MultiNode(route))
                    .await?
                    .extract_error()
            }
            conn => cmd.query_async(conn).await,
        }
    }

    /// Sends `pipe` to `node` in one round trip; errors of single commands come back as
    /// [`Value::ServerError`] in their place.
    pub(crate) async fn pipe_on(
        &mut self,
        node: Option<&Node>,
        mut pipe: Pipeline,
    ) -> RedisResult<Vec<Value>> {
        pipe.ignore_errors();
        match (self, node) {
            (Conn::Cluster(c), Some((host, port))) => {
                let route = SingleNodeRoutingInfo::ByAddress {
                    host: host.clone(),
                    port: *port,
                };
                let n = pipe.len();
                c.route_pipeline(pipe, 0, n, route).await
            }
            (conn, _) => pipe.query_async(conn).await,
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// `host:port` of a node's URL, and whether it is `rediss://`.
fn server_of(url: &str) -> (String, bool) {
    match url::Url::parse(url) {
        Ok(u) => (
            format!(
                "{}:{}",
                u.host_str().unwrap_or("?"),
                u.port().unwrap_or(6379)
            ),
            u.scheme() == "rediss",
        ),
        Err(_) => ("<unparsable URL>".to_owned(), false),
    }
}

fn single_client(config: &RedisConfig) -> Result<redis::Client> {
    node_client(config, config.nodes().first().map_or("", String::as_str))
}

/// A client of the one server at `url` (a standalone server, or a node of a cluster).
pub(crate) fn node_client(config: &RedisConfig, url: &str) -> Result<redis::Client> {
    #[cfg(feature = "tls")]
    {
        install_crypto_provider();
        if let Some(certs) = tls_certificates(config) {
            return redis::Client::build_with_tls(url, certs).map_err(|e| config_error(config, e));
        }
    }
    redis::Client::open(url).map_err(|e| config_error(config, e))
}

fn cluster_client(config: &RedisConfig) -> Result<ClusterClient> {
    let limit = config.timeout();
    let builder = ClusterClient::builder(config.nodes().iter().map(String::as_str))
        .connection_timeout(limit)
        .response_timeout(limit)
        .retries(2)
        .min_retry_wait(10)
        .max_retry_wait(limit.as_millis().try_into().unwrap_or(u64::MAX));
    #[cfg(feature = "tls")]
    let builder = {
        install_crypto_provider();
        match tls_certificates(config) {
            Some(certs) => builder.certs(certs),
            None => builder,
        }
    };
    builder.build().map_err(|e| config_error(config, e))
}

#[cfg(feature = "tls")]
fn tls_certificates(config: &RedisConfig) -> Option<redis::TlsCertificates> {
    config.tls_root_cert().map(|pem| redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(pem.to_vec()),
    })
}

/// rustls needs a process-wide crypto provider; install ring's unless one is set.
#[cfg(feature = "tls")]
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race with another installer is fine: a provider is then set.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

fn manager_config(limit: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(limit))
        .set_response_timeout(Some(limit))
        .set_number_of_retries(1)
        .set_min_delay(Duration::from_millis(10))
        .set_max_delay(limit)
}

fn cluster_config(limit: Duration) -> ClusterConfig {
    ClusterConfig::new()
        .set_connection_timeout(limit)
        .set_response_timeout(limit)
}

/// A URL the driver refuses; the message names the URLs with passwords hidden.
fn config_error(config: &RedisConfig, err: redis::RedisError) -> Error {
    let shown: Vec<String> = config
        .nodes()
        .iter()
        .map(|n| idem_core::backend::driver::redact(n))
        .collect();
    Error::Config {
        message: format!(
            "Redis URL refused ({}): {}",
            shown.join(", "),
            err.category()
        ),
        source: Some(Box::new(err)),
    }
}

/// Runs `fut` within `limit` (idem-core's one timeout), mapping its error; what ran out
/// of time is `Unavailable`.
pub(crate) async fn within<T>(
    what: &str,
    limit: Duration,
    fut: impl Future<Output = RedisResult<T>>,
) -> Result<T> {
    idem_core::layer::within(what, limit, async {
        fut.await.map_err(|e| from_redis(what, e))
    })
    .await
}
