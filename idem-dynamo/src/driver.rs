//! The driver: `dynamodb://` URLs for tools that know only a URL (the `idem` CLI, benches).

use std::future::Future;
use std::sync::Arc;

use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::put_item::PutItemError;
use aws_sdk_dynamodb::primitives::Blob;
use aws_sdk_dynamodb::types::AttributeValue;
use futures::StreamExt;
use idem_core::backend::async_trait;
use idem_core::backend::driver::{self, Driver, Options, RAW_RETENTION, RawWrite, Store};
use idem_core::{Backend, Bytes, Error, Result, Timestamp};

use crate::error::sdk_error;
use crate::item::{PK, TTL};
use crate::{DynamoBackend, DynamoConfig};

/// The DynamoDB driver: `dynamodb://<table>?endpoint=http://host:port&region=…`. Without
/// `endpoint` the SDK resolves AWS's, and region and credentials come from the AWS chain
/// (environment, profile). With an `endpoint` (DynamoDB Local) the region defaults to
/// `us-east-1` and, when the environment has no `AWS_ACCESS_KEY_ID`, placeholder
/// credentials are used. Isolation is a table of its own, `<table>-<tag>`, created at open
/// and deleted by [`Store::close`].
pub static DRIVER: DynamoDriver = DynamoDriver;

/// See [`DRIVER`].
#[derive(Debug)]
pub struct DynamoDriver;

struct Parsed {
    table: String,
    endpoint: Option<String>,
    region: Option<String>,
}

fn parse(text: &str) -> Result<Parsed> {
    let text = text.trim();
    let bad = |reason: String| Error::config(reason);
    let url = url::Url::parse(text).map_err(|e| bad(e.to_string()))?;
    if url.scheme() != "dynamodb" {
        return Err(bad(format!("not a DynamoDB URL ({})", DRIVER.usage())));
    }
    let table = url.host_str().unwrap_or_default();
    if table.is_empty() {
        return Err(bad(
            "no table: write dynamodb://<table>?endpoint=…&region=…".into(),
        ));
    }
    if !url.path().is_empty() && url.path() != "/" {
        return Err(bad(format!(
            "unexpected path {:?} after the table",
            url.path()
        )));
    }
    driver::check_params(&url, &["endpoint", "region"])?;
    let (mut endpoint, mut region) = (None, None);
    for (k, v) in url.query_pairs() {
        match &*k {
            "endpoint" => {
                url::Url::parse(&v).map_err(|e| bad(format!("endpoint {v:?}: {e}")))?;
                endpoint = Some(v.into_owned());
            }
            "region" if !v.is_empty() => region = Some(v.into_owned()),
            _ => {}
        }
    }
    Ok(Parsed {
        table: table.to_owned(),
        endpoint,
        region,
    })
}

impl Parsed {
    fn config(&self, table: &str) -> DynamoConfig {
        let mut config = DynamoConfig::new(table);
        if let Some(endpoint) = &self.endpoint {
            config = config
                .with_endpoint(endpoint)
                .with_region(self.region.as_deref().unwrap_or("us-east-1"));
            if std::env::var_os("AWS_ACCESS_KEY_ID").is_none() {
                config = config.with_static_credentials("idem", "idem-local", None);
            }
        } else if let Some(region) = &self.region {
            config = config.with_region(region);
        }
        config
    }
}

#[async_trait]
impl Driver for DynamoDriver {
    fn name(&self) -> &'static str {
        "dynamodb"
    }
    fn schemes(&self) -> &'static [&'static str] {
        &["dynamodb"]
    }
    fn usage(&self) -> &'static str {
        "dynamodb://<table>?endpoint=http://host:port&region=…"
    }
    fn check(&self, url: &str) -> Result<String> {
        let p = parse(url)?;
        let params: Vec<String> = [("endpoint", &p.endpoint), ("region", &p.region)]
            .into_iter()
            .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={v}")))
            .collect();
        Ok(match params.is_empty() {
            true => format!("dynamodb://{}", p.table),
            false => format!("dynamodb://{}?{}", p.table, params.join("&")),
        })
    }
    async fn open(&self, url: &str, options: &Options) -> Result<Box<dyn Store>> {
        let parsed = parse(url)?;
        let table = match &options.isolate {
            Some(tag) => format!("{}-{tag}", parsed.table),
            None => parsed.table.clone(),
        };
        let backend = DynamoBackend::connect(parsed.config(&table)).await?;
        if options.isolate.is_some() {
            backend.create_table().await?;
        }
        Ok(Box::new(DynamoStore {
            backend,
            isolated: options.isolate.is_some(),
        }))
    }
    fn test_url(&self) -> Result<String> {
        let endpoint = driver::service_url("IDEM_DYNAMO_ENDPOINT")?;
        Ok(format!("dynamodb://idem_test?endpoint={endpoint}"))
    }
}

#[derive(Debug)]
struct DynamoStore {
    backend: DynamoBackend,
    isolated: bool,
}

#[async_trait]
impl Store for DynamoStore {
    fn backend(&self) -> Arc<dyn Backend> {
        Arc::new(self.backend.clone())
    }
    async fn migrate(&self) -> Result<String> {
        self.backend.create_table().await?;
        Ok(format!(
            "dynamodb: table {} exists, with TTL on {TTL}",
            self.backend.config().table()
        ))
    }
    async fn raw(&self) -> Result<Arc<dyn RawWrite>> {
        Ok(Arc::new(PutIfAbsent {
            backend: self.backend.clone(),
        }))
    }
    async fn close(self: Box<Self>) -> Result<()> {
        if self.isolated {
            let table = self.backend.config().table();
            let deleted = self
                .backend
                .client()
                .delete_table()
                .table_name(table)
                .send();
            deleted.await.map_err(|e| sdk_error("DeleteTable", 0, e))?;
        }
        Ok(())
    }
}

/// A conditional `PutItem` (`attribute_not_exists(pk)`) per key, and an `UpdateItem` of
/// its value and expiry over it, through the backend's own SDK client; a batch runs its
/// writes concurrently, at most as many at once as the backend's `claim_many` and
/// `settle_many` (DynamoDB has no conditional batch write outside transactions).
struct PutIfAbsent {
    backend: DynamoBackend,
}

impl PutIfAbsent {
    /// When a raw item written now expires, in epoch seconds (the TTL attribute's unit).
    fn expires() -> String {
        (Timestamp::now().saturating_add(RAW_RETENTION).as_millis() / 1000).to_string()
    }

    /// The item's key.
    fn pk(key: &str) -> AttributeValue {
        AttributeValue::S(format!("raw/{key}"))
    }

    /// Runs `writes`, at most the backend's claim parallelism at once, and returns every
    /// answer.
    async fn run<F: Future>(&self, writes: Vec<F>) -> Vec<F::Output> {
        let parallelism = self.backend.config().claim_parallelism();
        futures::stream::iter(writes)
            .buffer_unordered(parallelism)
            .collect()
            .await
    }
}

#[async_trait]
impl RawWrite for PutIfAbsent {
    fn name(&self) -> &'static str {
        "conditional PutItem"
    }
    fn settle_name(&self) -> &'static str {
        "UpdateItem"
    }
    async fn insert(&self, keys: &[String], value: &Bytes) -> Result<()> {
        let expires = Self::expires();
        let client = self.backend.client();
        let table = self.backend.config().table();
        let puts: Vec<_> = keys
            .iter()
            .map(|k| {
                client
                    .put_item()
                    .table_name(table)
                    .item(PK, Self::pk(k))
                    .item("v", AttributeValue::B(Blob::new(value.to_vec())))
                    .item(TTL, AttributeValue::N(expires.clone()))
                    .condition_expression(format!("attribute_not_exists({PK})"))
                    .send()
            })
            .collect();
        let results = self.run(puts).await;
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
            Some(e) => Err(sdk_error("conditional PutItem", value.len(), e)),
        }
    }
    async fn settle(&self, keys: &[String], value: &Bytes) -> Result<()> {
        let expires = Self::expires();
        let client = self.backend.client();
        let table = self.backend.config().table();
        let updates: Vec<_> = keys
            .iter()
            .map(|k| {
                client
                    .update_item()
                    .table_name(table)
                    .key(PK, Self::pk(k))
                    .update_expression("SET #v = :v, #ttl = :ttl")
                    .expression_attribute_names("#v", "v")
                    .expression_attribute_names("#ttl", TTL)
                    .expression_attribute_values(":v", AttributeValue::B(Blob::new(value.to_vec())))
                    .expression_attribute_values(":ttl", AttributeValue::N(expires.clone()))
                    .send()
            })
            .collect();
        let results = self.run(updates).await;
        match results.into_iter().find_map(Result::err) {
            None => Ok(()),
            Some(e) => Err(sdk_error("UpdateItem", value.len(), e)),
        }
    }
}
