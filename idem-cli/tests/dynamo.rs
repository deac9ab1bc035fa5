//! Operator commands against DynamoDB Local (IDEM_DYNAMO_ENDPOINT), on a table of their
//! own that `idem migrate` creates.

mod common;

use std::sync::Arc;

use common::{fails, ok, operator_scenario};
use idem_dynamo::{DynamoBackend, DynamoConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_on_dynamodb() {
    let endpoint = idem_conformance::service_env("IDEM_DYNAMO_ENDPOINT");
    let table = format!("idemcli-{}-{}", std::process::id(), fastrand::u32(..));
    let url = format!("dynamodb://{table}?endpoint={endpoint}");

    let err = fails(&["migrate", "-b", &url], 2);
    assert!(err.contains("refusing to migrate"), "{err}");
    let out = ok(&["migrate", "-b", &url, "--yes"]);
    assert!(
        out.contains(&format!("table {table} exists, with TTL")),
        "{out}"
    );

    let config = DynamoConfig::local(endpoint, table.clone());
    let backend = DynamoBackend::connect(config)
        .await
        .expect("connect to IDEM_DYNAMO_ENDPOINT");
    let described = backend
        .client()
        .describe_table()
        .table_name(&table)
        .send()
        .await
        .expect("the table idem migrate created");
    assert_eq!(
        described.table().and_then(|t| t.table_name()),
        Some(table.as_str())
    );
    operator_scenario(&url, Arc::new(backend.clone()), "orders").await;
    backend
        .client()
        .delete_table()
        .table_name(&table)
        .send()
        .await
        .expect("delete the test table");
}
