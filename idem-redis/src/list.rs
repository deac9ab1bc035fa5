//! `list`: walking the records under the prefix with `SCAN`, on every primary of a cluster.

use idem_core::backend::ListFilter;
use idem_core::{Error, Record, Result};
use redis::Value;

use crate::RedisBackend;
use crate::conn::{Conn, Node};
use crate::error::bad_reply;
use crate::record::decode_record;
use crate::reply::int;

/// Keys asked for per `SCAN` step.
const SCAN_COUNT: usize = 1000;

impl RedisBackend {
    /// [`Backend::list`](idem_core::Backend::list): `SCAN` under the prefix on every node
    /// that holds records, one pipelined `GET` and `PEXPIRETIME` per page.
    pub(crate) async fn scan_records(&self, filter: &ListFilter) -> Result<Vec<Record>> {
        let layout = &self.shared.layout;
        let pattern = layout.pattern(filter.namespace.as_deref());
        let limit = if filter.limit == 0 {
            usize::MAX
        } else {
            filter.limit
        };
        let mut out = Vec::new();
        for node in self.scan_nodes().await? {
            let mut cursor = 0;
            loop {
                let (next, raw_keys) = self.scan(node.as_ref(), cursor, &pattern).await?;
                let mut keys = Vec::with_capacity(raw_keys.len());
                let mut pipe = redis::pipe();
                for raw in &raw_keys {
                    let key = layout.parse(raw).ok_or_else(|| {
                        Error::corrupt(format!(
                            "a key under the prefix is not an idem key: {}",
                            String::from_utf8_lossy(raw)
                        ))
                    })?;
                    pipe.cmd("GET").arg(raw);
                    pipe.cmd("PEXPIRETIME").arg(raw);
                    keys.push(key);
                }
                let mut conn = self.conn.clone();
                let replies = if keys.is_empty() {
                    Vec::new()
                } else {
                    self.call("list", conn.pipe_on(node.as_ref(), pipe)).await?
                };
                if replies.len() != 2 * keys.len() {
                    return Err(bad_reply("list", format!("{replies:?}")));
                }
                let mut replies = replies.into_iter();
                for key in &keys {
                    let (value, expire) = (replies.next(), replies.next());
                    let expire = expire.as_ref().and_then(int);
                    let (Some(value), Some(expire)) = (value, expire) else {
                        return Err(bad_reply("list", "a record without its expiry time"));
                    };
                    if let Some(rec) = decode_record(key, value, expire)? {
                        if filter.matches(&rec) {
                            out.push(rec);
                            if out.len() >= limit {
                                return Ok(out);
                            }
                        }
                    }
                }
                cursor = next;
                if cursor == 0 {
                    break;
                }
            }
        }
        Ok(out)
    }

    /// The primaries of a cluster, each once; `[None]` standalone.
    async fn scan_nodes(&self) -> Result<Vec<Option<Node>>> {
        if !matches!(self.conn, Conn::Cluster(_)) {
            return Ok(vec![None]);
        }
        let mut conn = self.conn.clone();
        let mut cmd = redis::cmd("CLUSTER");
        cmd.arg("SLOTS");
        let reply = self.call("list", conn.query_on(None, cmd)).await?;
        let mut nodes: Vec<Option<Node>> = Vec::new();
        let Value::Array(ranges) = reply else {
            return Err(bad_reply("CLUSTER SLOTS", format!("{reply:?}")));
        };
        for range in ranges {
            let node = match range {
                Value::Array(parts) => match parts.get(2) {
                    Some(Value::Array(primary)) => match (primary.first(), primary.get(1)) {
                        (Some(Value::BulkString(host)), Some(Value::Int(port))) => {
                            let host = String::from_utf8_lossy(host).into_owned();
                            u16::try_from(*port).ok().map(|port| (host, port))
                        }
                        _ => None,
                    },
                    _ => None,
                },
                _ => None,
            };
            let node =
                node.ok_or_else(|| bad_reply("CLUSTER SLOTS", "a range without a primary"))?;
            if !nodes.contains(&Some(node.clone())) {
                nodes.push(Some(node));
            }
        }
        Ok(nodes)
    }

    /// One `SCAN` step on `node`: the next cursor and the keys found.
    async fn scan(
        &self,
        node: Option<&Node>,
        cursor: u64,
        pattern: &str,
    ) -> Result<(u64, Vec<Vec<u8>>)> {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT);
        let mut conn = self.conn.clone();
        let reply = self.call("list", conn.query_on(node, cmd)).await?;
        let parsed = match &reply {
            Value::Array(parts) => match (parts.first(), parts.get(1)) {
                (Some(Value::BulkString(c)), Some(Value::Array(keys))) => {
                    let cursor = std::str::from_utf8(c).ok().and_then(|c| c.parse().ok());
                    let keys: Option<Vec<Vec<u8>>> = keys
                        .iter()
                        .map(|k| match k {
                            Value::BulkString(k) => Some(k.clone()),
                            _ => None,
                        })
                        .collect();
                    cursor.zip(keys)
                }
                _ => None,
            },
            _ => None,
        };
        parsed.ok_or_else(|| bad_reply("SCAN", format!("{reply:?}")))
    }
}
