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
            #[cfg(feature = "postgres")]
            Target::Postgres { url, .. } => postgres(url, tag, workers, shown).await,
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

#[cfg(feature = "postgres")]
async fn postgres(url: &str, tag: &str, workers: u32, shown: String) -> Result<Subject> {
    use idem_postgres::{PgBackend, PgConfig};

    let schema = format!("idem_bench_{tag}");
    let config = PgConfig::new(url)
        .schema(schema.clone())
        .max_connections(workers.clamp(4, 64));
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
