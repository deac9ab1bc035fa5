//! What the integration tests share: a backend on DynamoDB Local.
#![allow(dead_code)] // each test binary uses its own part of this module

use std::time::Duration;

use idem_dynamo::{DynamoBackend, DynamoConfig};

/// The skew margin the tests run with: small next to their leases.
pub const SKEW: Duration = Duration::from_millis(50);

/// The configuration for `table` on the server `IDEM_DYNAMO_ENDPOINT` names; fails the test,
/// naming the command that starts the services, when it is unset.
pub fn config(table: &str) -> DynamoConfig {
    let endpoint = idem_conformance::service_env("IDEM_DYNAMO_ENDPOINT");
    DynamoConfig::local(endpoint, table).with_clock_skew(SKEW)
}

/// A backend on `table`, created if missing.
pub async fn backend(table: &str) -> DynamoBackend {
    let backend = DynamoBackend::connect(config(table))
        .await
        .expect("connect");
    backend.create_table().await.expect("create table");
    backend
}

/// A table name no other test uses.
pub fn unique_table(what: &str) -> String {
    format!("idem_{what}_{}", idem_conformance::unique_namespace())
}
