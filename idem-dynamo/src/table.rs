//! Creating the table, with TTL on `expires_at`.

use std::time::Duration;

use aws_sdk_dynamodb::client::Waiters;
use aws_sdk_dynamodb::error::{DisplayErrorContext, ProvideErrorMetadata};
use aws_sdk_dynamodb::operation::create_table::CreateTableError;
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
    TimeToLiveSpecification, TimeToLiveStatus,
};
use idem_core::{Error, Result};

use crate::DynamoBackend;
use crate::error::sdk_error;
use crate::item::{PK, TTL};

/// How long [`DynamoBackend::create_table`] waits for a new table to turn `ACTIVE`.
const ACTIVE_WAIT: Duration = Duration::from_secs(120);

fn build_error(e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::Config {
        message: format!("building a table request: {e}"),
        source: Some(Box::new(e)),
    }
}

impl DynamoBackend {
    /// Creates the configured table if it does not exist (on-demand billing, partition
    /// key `pk` of type string), waits until it is `ACTIVE`, and enables TTL on the
    /// `expires_at` attribute if it is not enabled yet. Safe to call when the table exists
    /// already, and from several processes at once.
    ///
    /// Needs `dynamodb:CreateTable`, `DescribeTable`, `DescribeTimeToLive` and
    /// `UpdateTimeToLive`; production deployments may prefer to create the table with
    /// their infrastructure tools instead (the crate README gives the schema).
    pub async fn create_table(&self) -> Result<()> {
        let client = self.client();
        let created = client
            .create_table()
            .table_name(self.table())
            .attribute_definitions(
                AttributeDefinition::builder()
                    .attribute_name(PK)
                    .attribute_type(ScalarAttributeType::S)
                    .build()
                    .map_err(build_error)?,
            )
            .key_schema(
                KeySchemaElement::builder()
                    .attribute_name(PK)
                    .key_type(KeyType::Hash)
                    .build()
                    .map_err(build_error)?,
            )
            .billing_mode(BillingMode::PayPerRequest)
            .send()
            .await;
        if let Err(err) = created {
            let exists = matches!(
                err.as_service_error(),
                Some(CreateTableError::ResourceInUseException(_))
            );
            if !exists {
                return Err(sdk_error("create table", 0, err));
            }
        }
        client
            .wait_until_table_exists()
            .table_name(self.table())
            .wait(ACTIVE_WAIT)
            .await
            .map_err(|e| {
                let message = format!(
                    "waiting for table {} to be active: {}",
                    self.table(),
                    DisplayErrorContext(&e)
                );
                Error::unavailable(message, e)
            })?;
        let ttl = client
            .describe_time_to_live()
            .table_name(self.table())
            .send()
            .await
            .map_err(|e| sdk_error("describe TTL", 0, e))?;
        let description = ttl.time_to_live_description();
        let status = description.and_then(|d| d.time_to_live_status());
        let on = matches!(
            status,
            Some(TimeToLiveStatus::Enabled | TimeToLiveStatus::Enabling)
        );
        if on {
            let attribute = description.and_then(|d| d.attribute_name());
            return match attribute {
                Some(TTL) => Ok(()),
                other => Err(Error::config(format!(
                    "table {} has TTL on {other:?}, not on {TTL:?}",
                    self.table()
                ))),
            };
        }
        let spec = TimeToLiveSpecification::builder()
            .enabled(true)
            .attribute_name(TTL)
            .build()
            .map_err(build_error)?;
        let updated = client
            .update_time_to_live()
            .table_name(self.table())
            .time_to_live_specification(spec)
            .send()
            .await;
        match updated {
            Ok(_) => Ok(()),
            // Another process enabled it between our describe and update.
            Err(err) if is_already_enabled(err.message()) => Ok(()),
            Err(err) => Err(sdk_error("enable TTL", 0, err)),
        }
    }
}

fn is_already_enabled(message: Option<&str>) -> bool {
    message.is_some_and(|m| m.contains("already enabled"))
}
