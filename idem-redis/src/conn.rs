//! One connection type for both deployments: a [`ConnectionManager`] (reconnects by itself)
//! for a standalone server, a [`ClusterConnection`] (follows slot moves) for a cluster.

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, Pipeline, RedisFuture, RedisResult, Value};

/// A cluster node, as `(host, port)`.
pub(crate) type Node = (String, u16);

#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Conn {
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
