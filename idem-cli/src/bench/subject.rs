//! What a bench runs against: a backend set up in a place of its own (a fresh schema or
//! key prefix), and its store's raw conditional write through the same client.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use idem_core::{Backend, MemoryBackend};

use crate::error::{Error, Result, StoreContext};
use crate::target::Target;

/// How long bench records and raw keys are kept; stores with native expiry drop them.
pub const RETENTION: Duration = Duration::from_secs(600);

/// The store's own "write this key if absent", the floor idem is measured against.
#[async_trait]
pub trait Raw: Send + Sync {
    /// What it is, for the report (`SET NX PX`, …).
    fn name(&self) -> &'static str;
    /// Writes each of `keys` with `value` if absent: one round trip where the store can.
    async fn insert(&self, keys: &[String], value: &Bytes) -> Result<()>;
}

/// One backend under bench.
pub struct Subject {
    /// `memory`, `redis`, `postgres`, `dynamodb`.
    pub kind: &'static str,
    /// The URL, password hidden.
    pub shown: String,
    /// The backend.
    pub backend: Arc<dyn Backend>,
    /// The raw baseline through the same client.
    pub raw: Arc<dyn Raw>,
    /// Removes what the bench created; run at the end.
    cleanup: Option<Cleanup>,
}

enum Cleanup {
    #[cfg(feature = "postgres")]
    DropSchema(sqlx::PgPool, String),
    #[cfg(feature = "redis")]
    DeletePrefix(redis::aio::ConnectionManager, String),
    #[cfg(feature = "dynamo")]
    DeleteTable(aws_sdk_dynamodb::Client, String),
}

impl Subject {
    /// Sets `target` up for a bench tagged `tag` with connections for `workers`.
    pub async fn open(target: &Target, tag: &str, workers: u32) -> Result<Self> {
        let shown = target.to_string();
        match target {
            Target::Memory => Ok(Subject {
                kind: "memory",
                shown,
                backend: Arc::new(MemoryBackend::new()),
                raw: Arc::new(MapInsert::default()),
                cleanup: None,
            }),
            #[cfg(feature = "redis")]
            Target::Redis { urls, .. } => redis_subject(urls, tag, shown).await,
            #[cfg(feature = "postgres")]
            Target::Postgres { url, .. } => postgres(url, tag, workers, shown).await,
            #[cfg(feature = "dynamo")]
            Target::Dynamo {
                table,
                endpoint,
                region,
            } => {
                let table = format!("{table}-bench-{tag}");
                let config =
                    crate::target::dynamo_config(&table, endpoint.as_deref(), region.as_deref());
                dynamo(config, shown).await
            }
            #[allow(unreachable_patterns)]
            other => {
                let _ = (tag, workers);
                Err(Error::Refused(format!(
                    "{} is not compiled into this build",
                    other.kind()
                )))
            }
        }
    }

    /// Removes the schema or keys the bench made, where the store does not expire them.
    pub async fn close(self) -> Result<()> {
        match self.cleanup {
            None => Ok(()),
            #[cfg(feature = "postgres")]
            Some(Cleanup::DropSchema(pool, schema)) => {
                let drop = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
                sqlx::query(sqlx::AssertSqlSafe(drop))
                    .execute(&pool)
                    .await
                    .map_err(|e| idem_core::Error::unavailable("DROP SCHEMA", e))
                    .store(format!("drop the bench schema {schema}"))?;
                Ok(())
            }
            #[cfg(feature = "dynamo")]
            Some(Cleanup::DeleteTable(client, table)) => {
                client
                    .delete_table()
                    .table_name(&table)
                    .send()
                    .await
                    .map_err(|e| idem_core::Error::unavailable("DeleteTable", e))
                    .store(format!("delete the bench table {table}"))?;
                Ok(())
            }
            #[cfg(feature = "redis")]
            Some(Cleanup::DeletePrefix(mut conn, prefix)) => {
                let pattern = format!("{prefix}*");
                let unavailable = |e| idem_core::Error::unavailable("delete bench keys", e);
                let mut cursor = 0u64;
                loop {
                    let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(&pattern)
                        .arg("COUNT")
                        .arg(1000)
                        .query_async(&mut conn)
                        .await
                        .map_err(unavailable)
                        .store("scan the bench keys")?;
                    if !keys.is_empty() {
                        redis::cmd("UNLINK")
                            .arg(&keys)
                            .query_async::<()>(&mut conn)
                            .await
                            .map_err(unavailable)
                            .store("delete the bench keys")?;
                    }
                    if next == 0 {
                        return Ok(());
                    }
                    cursor = next;
                }
            }
        }
    }
}

/// The memory baseline: a plain map insert under one lock.
#[derive(Default)]
struct MapInsert {
    map: Mutex<HashMap<String, Bytes>>,
}

#[async_trait]
impl Raw for MapInsert {
    fn name(&self) -> &'static str {
        "HashMap insert"
    }

    async fn insert(&self, keys: &[String], value: &Bytes) -> Result<()> {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        for k in keys {
            map.entry(k.clone()).or_insert_with(|| value.clone());
        }
        Ok(())
    }
}

/// Redis: the backend under a prefix of its own, deleted at the end on a single server
/// (on a cluster, records and raw keys expire by themselves after [`RETENTION`]).
#[cfg(feature = "redis")]
async fn redis_subject(urls: &str, tag: &str, shown: String) -> Result<Subject> {
    use idem_redis::{RedisBackend, RedisConfig};

    let prefix = format!("idem:bench:{tag}:");
    let config = RedisConfig::from_urls(urls).with_prefix(prefix.clone());
    let cluster = config.is_cluster();
    let nodes = config.nodes().to_vec();
    let backend = RedisBackend::connect(config)
        .await
        .store(format!("connect to {shown}"))?;
    let unavailable = |e: redis::RedisError| idem_core::Error::unavailable("connect", e);
    let mut cleanup = None;
    let conn = if cluster {
        let client = redis::cluster::ClusterClient::new(nodes).map_err(unavailable);
        let conn = async { client?.get_async_connection().await.map_err(unavailable) };
        RedisConn::Cluster(conn.await.store("raw baseline client")?)
    } else {
        let client = redis::Client::open(nodes.first().map_or("", String::as_str));
        let conn = async {
            redis::aio::ConnectionManager::new(client.map_err(unavailable)?)
                .await
                .map_err(unavailable)
        };
        let conn = conn.await.store("raw baseline client")?;
        cleanup = Some(Cleanup::DeletePrefix(conn.clone(), prefix.clone()));
        RedisConn::Single(conn)
    };
    Ok(Subject {
        kind: "redis",
        shown,
        backend: Arc::new(backend),
        raw: Arc::new(SetNx {
            conn,
            prefix: format!("{prefix}raw:"),
        }),
        cleanup,
    })
}

#[cfg(feature = "redis")]
#[derive(Clone)]
enum RedisConn {
    Single(redis::aio::ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

/// `SET key value NX PX ms`: pipelined for a batch on one server, one call per key on a
/// cluster (whose keys spread over nodes).
#[cfg(feature = "redis")]
struct SetNx {
    conn: RedisConn,
    prefix: String,
}

#[cfg(feature = "redis")]
impl SetNx {
    fn set(&self, key: &str, value: &Bytes) -> redis::Cmd {
        let mut cmd = redis::cmd("SET");
        cmd.arg(format!("{}{key}", self.prefix))
            .arg(value.as_ref())
            .arg("NX")
            .arg("PX")
            .arg(RETENTION.as_millis() as u64);
        cmd
    }
}

#[cfg(feature = "redis")]
#[async_trait]
impl Raw for SetNx {
    fn name(&self) -> &'static str {
        "SET NX PX"
    }

    async fn insert(&self, keys: &[String], value: &Bytes) -> Result<()> {
        let done: redis::RedisResult<()> = match self.conn.clone() {
            RedisConn::Single(mut c) => {
                let mut pipe = redis::pipe();
                for k in keys {
                    pipe.add_command(self.set(k, value)).ignore();
                }
                pipe.query_async(&mut c).await
            }
            RedisConn::Cluster(c) => {
                let calls = keys.iter().map(|k| {
                    let mut c = c.clone();
                    let cmd = self.set(k, value);
                    async move { cmd.query_async::<redis::Value>(&mut c).await }
                });
                futures::future::try_join_all(calls).await.map(drop)
            }
        };
        done.map_err(|e| idem_core::Error::unavailable("SET NX PX", e))
            .store("raw baseline")
    }
}

/// DynamoDB: the backend on a table of its own, created here and deleted at the end.
#[cfg(feature = "dynamo")]
async fn dynamo(config: idem_dynamo::DynamoConfig, shown: String) -> Result<Subject> {
    let table = config.table().to_owned();
    let backend = idem_dynamo::DynamoBackend::connect(config)
        .await
        .store(format!("connect to {shown}"))?;
    backend
        .create_table()
        .await
        .store(format!("create the bench table {table}"))?;
    let client = backend.client().clone();
    let parallelism = backend.config().claim_parallelism();
    Ok(Subject {
        kind: "dynamodb",
        shown,
        backend: Arc::new(backend),
        raw: Arc::new(PutIfAbsent {
            client: client.clone(),
            table: table.clone(),
            parallelism,
        }),
        cleanup: Some(Cleanup::DeleteTable(client, table)),
    })
}

/// A conditional `PutItem` (`attribute_not_exists(pk)`) per key, through the backend's
/// own SDK client; a batch runs its puts concurrently, at most as many at once as the
/// backend's `claim_many` (DynamoDB has no conditional batch write outside transactions).
#[cfg(feature = "dynamo")]
struct PutIfAbsent {
    client: aws_sdk_dynamodb::Client,
    table: String,
    parallelism: usize,
}

#[cfg(feature = "dynamo")]
#[async_trait]
impl Raw for PutIfAbsent {
    fn name(&self) -> &'static str {
        "conditional PutItem"
    }

    async fn insert(&self, keys: &[String], value: &Bytes) -> Result<()> {
        use aws_sdk_dynamodb::error::SdkError;
        use aws_sdk_dynamodb::operation::put_item::PutItemError;
        use aws_sdk_dynamodb::primitives::Blob;
        use aws_sdk_dynamodb::types::AttributeValue;
        use futures::StreamExt;

        let expires = idem_core::Timestamp::now()
            .saturating_add(RETENTION)
            .as_millis()
            / 1000;
        let puts: Vec<_> = keys
            .iter()
            .map(|k| {
                self.client
                    .put_item()
                    .table_name(&self.table)
                    .item("pk", AttributeValue::S(format!("raw/{k}")))
                    .item("v", AttributeValue::B(Blob::new(value.to_vec())))
                    .item("expires_at", AttributeValue::N(expires.to_string()))
                    .condition_expression("attribute_not_exists(pk)")
                    .send()
            })
            .collect();
        let results = futures::stream::iter(puts)
            .buffer_unordered(self.parallelism)
            .collect::<Vec<_>>()
            .await;
        // Like `ON CONFLICT DO NOTHING` and `SET NX`, a key already there is not an error.
        // It happens when the SDK retries a put that had in fact succeeded.
        let present = |e: &SdkError<PutItemError, _>| {
            e.as_service_error()
                .is_some_and(PutItemError::is_conditional_check_failed_exception)
        };
        match results
            .into_iter()
            .find_map(|r| r.err().filter(|e| !present(e)))
        {
            None => Ok(()),
            Some(e) => Err(idem_core::Error::unavailable("conditional PutItem", e)),
        }
        .store("raw baseline")
    }
}

#[cfg(feature = "postgres")]
async fn postgres(url: &str, tag: &str, workers: u32, shown: String) -> Result<Subject> {
    use idem_postgres::{PgBackend, PgConfig};

    let schema = format!("idem_bench_{tag}");
    let config = PgConfig::new(url)
        .with_schema(schema.clone())
        .with_max_connections(workers.clamp(4, 64));
    let backend = PgBackend::connect(config)
        .await
        .store(format!("connect to {shown}"))?;
    backend.migrate().await.store("migrate the bench schema")?;
    let pool = backend.pool().clone();
    let create =
        format!("CREATE TABLE \"{schema}\".raw_baseline (k text PRIMARY KEY, v bytea NOT NULL)");
    sqlx::query(sqlx::AssertSqlSafe(create))
        .execute(&pool)
        .await
        .map_err(|e| idem_core::Error::unavailable("CREATE TABLE", e))
        .store("create the raw baseline table")?;
    let raw = PgInsert {
        pool: pool.clone(),
        one: format!(
            "INSERT INTO \"{schema}\".raw_baseline (k, v) VALUES ($1, $2) ON CONFLICT DO NOTHING"
        ),
        many: format!(
            "INSERT INTO \"{schema}\".raw_baseline (k, v) SELECT k, $2 FROM unnest($1::text[]) AS t(k) ON CONFLICT DO NOTHING"
        ),
    };
    Ok(Subject {
        kind: "postgres",
        shown,
        backend: Arc::new(backend),
        raw: Arc::new(raw),
        cleanup: Some(Cleanup::DropSchema(pool, schema)),
    })
}

/// `INSERT … ON CONFLICT DO NOTHING` (one statement per batch, `unnest` of the keys).
#[cfg(feature = "postgres")]
struct PgInsert {
    pool: sqlx::PgPool,
    one: String,
    many: String,
}

#[cfg(feature = "postgres")]
#[async_trait]
impl Raw for PgInsert {
    fn name(&self) -> &'static str {
        "INSERT … ON CONFLICT DO NOTHING"
    }

    async fn insert(&self, keys: &[String], value: &Bytes) -> Result<()> {
        let done = match keys {
            [one] => {
                sqlx::query(sqlx::AssertSqlSafe(self.one.as_str()))
                    .bind(one)
                    .bind(value.as_ref())
                    .execute(&self.pool)
                    .await
            }
            many => {
                sqlx::query(sqlx::AssertSqlSafe(self.many.as_str()))
                    .bind(many)
                    .bind(value.as_ref())
                    .execute(&self.pool)
                    .await
            }
        };
        done.map(drop)
            .map_err(|e| idem_core::Error::unavailable("INSERT … ON CONFLICT", e))
            .store("raw baseline")
    }
}
