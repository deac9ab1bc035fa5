//! Which table the backend uses, how it reaches DynamoDB and how it bounds its calls.

use std::fmt;
use std::time::Duration;

use idem_core::{Error, Result};

/// The largest item DynamoDB stores: 400 KB, attribute names and values included.
pub const ITEM_LIMIT_BYTES: usize = 400 * 1024;

/// How a [`DynamoBackend`](crate::DynamoBackend) reaches its table and bounds its calls.
///
/// Credentials come from the usual AWS chain (environment, profile, SSO, web identity,
/// container or instance role) unless [`DynamoConfig::with_static_credentials`] sets them,
/// which suits local servers. `Debug` never shows the secret key or session token.
#[derive(Clone)]
pub struct DynamoConfig {
    table: String,
    endpoint: Option<String>,
    region: Option<String>,
    credentials: Option<StaticCredentials>,
    clock_skew: Duration,
    max_response_bytes: usize,
    claim_parallelism: usize,
    sdk_attempts: u32,
    connect_timeout: Duration,
    attempt_timeout: Duration,
    operation_timeout: Duration,
}

/// An access key, written into the configuration instead of read from the AWS chain.
#[derive(Clone)]
#[non_exhaustive]
pub struct StaticCredentials {
    /// The access key id (shown by `Debug`).
    pub access_key_id: String,
    /// The secret access key (never shown).
    pub secret_access_key: String,
    /// A session token for temporary credentials (never shown).
    pub session_token: Option<String>,
}

impl fmt::Debug for StaticCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StaticCredentials")
            .field("access_key_id", &self.access_key_id)
            .field("secret_access_key", &"***")
            .field("session_token", &self.session_token.as_ref().map(|_| "***"))
            .finish()
    }
}

impl DynamoConfig {
    /// The default clock skew margin.
    pub const DEFAULT_CLOCK_SKEW: Duration = Duration::from_millis(500);
    /// The default largest response: 350 KiB, leaving room under the 400 KB item limit for
    /// the key and the other attributes.
    pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 350 * 1024;
    /// The default number of conditional writes `claim_many` keeps in flight.
    pub const DEFAULT_CLAIM_PARALLELISM: usize = 16;
    /// The default number of attempts the SDK makes per request, the first included (its
    /// standard retry mode, with exponential backoff and jitter).
    pub const DEFAULT_SDK_ATTEMPTS: u32 = 3;
    /// The default bound on opening a connection.
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
    /// The default bound on one attempt of a call.
    pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(3);
    /// The default bound on a whole call, retries included.
    pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(10);

    /// The table `table` in the region and account the AWS chain gives.
    pub fn new(table: impl Into<String>) -> Self {
        DynamoConfig {
            table: table.into(),
            endpoint: None,
            region: None,
            credentials: None,
            clock_skew: Self::DEFAULT_CLOCK_SKEW,
            max_response_bytes: Self::DEFAULT_MAX_RESPONSE_BYTES,
            claim_parallelism: Self::DEFAULT_CLAIM_PARALLELISM,
            sdk_attempts: Self::DEFAULT_SDK_ATTEMPTS,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            attempt_timeout: Self::DEFAULT_ATTEMPT_TIMEOUT,
            operation_timeout: Self::DEFAULT_OPERATION_TIMEOUT,
        }
    }

    /// The table `table` on a local server such as Amazon DynamoDB Local at `endpoint`
    /// (`http://127.0.0.1:8000`), with region `us-east-1` and fixed dummy credentials.
    pub fn local(endpoint: impl Into<String>, table: impl Into<String>) -> Self {
        DynamoConfig::new(table)
            .with_endpoint(endpoint)
            .with_region("us-east-1")
            .with_static_credentials("idem", "idem-local", None)
    }

    /// Sends requests to `endpoint` instead of the region's AWS endpoint.
    pub fn with_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = Some(endpoint.into());
        self
    }

    /// The AWS region, instead of the one the AWS chain gives.
    pub fn with_region(mut self, region: impl Into<String>) -> Self {
        self.region = Some(region.into());
        self
    }

    /// Fixed credentials instead of the AWS chain.
    pub fn with_static_credentials(
        mut self,
        access_key_id: impl Into<String>,
        secret_access_key: impl Into<String>,
        session_token: Option<String>,
    ) -> Self {
        self.credentials = Some(StaticCredentials {
            access_key_id: access_key_id.into(),
            secret_access_key: secret_access_key.into(),
            session_token,
        });
        self
    }

    /// How far apart the clocks of the workers sharing the table may be (default 500 ms).
    /// A lease counts as lapsed, and a record as expired, only once this client's clock is
    /// that far past the deadline. See the crate README for what a larger skew breaks.
    pub fn with_clock_skew(mut self, skew: Duration) -> Self {
        self.clock_skew = idem_core::clock::capped(skew);
        self
    }

    /// The largest response `complete` accepts, and the longest error text `fail` accepts
    /// (default 350 KiB). It may not exceed the 400 KB item limit.
    pub fn with_max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// How many conditional writes `claim_many` and `settle_many` keep in flight (default
    /// 16).
    pub fn with_claim_parallelism(mut self, n: usize) -> Self {
        self.claim_parallelism = n;
        self
    }

    /// Attempts the AWS SDK makes per request, the first included (default 3): throttling,
    /// timeouts and 5xx answers are retried with the SDK's standard backoff; once they are
    /// spent the call fails with [`Error::Unavailable`]. Not the engine's
    /// `max_attempts`, which counts runs of a handler.
    pub fn with_sdk_attempts(mut self, n: u32) -> Self {
        self.sdk_attempts = n;
        self
    }

    /// Bounds opening a connection (default 2 s).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = idem_core::clock::capped(timeout);
        self
    }

    /// Bounds one attempt of a call (default 3 s).
    pub fn with_attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = idem_core::clock::capped(timeout);
        self
    }

    /// Bounds a whole call, retries included (default 10 s). A call that takes longer
    /// fails with [`Error::Unavailable`]; its effect in the table is then unknown.
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = idem_core::clock::capped(timeout);
        self
    }

    /// The table name.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The endpoint override, if any.
    pub fn endpoint(&self) -> Option<&str> {
        self.endpoint.as_deref()
    }

    /// The region, if set here.
    pub fn region(&self) -> Option<&str> {
        self.region.as_deref()
    }

    /// The fixed credentials, if set here.
    pub fn static_credentials(&self) -> Option<&StaticCredentials> {
        self.credentials.as_ref()
    }

    /// The clock skew margin.
    pub fn clock_skew(&self) -> Duration {
        self.clock_skew
    }

    /// The largest response `complete` accepts.
    pub fn max_response_bytes(&self) -> usize {
        self.max_response_bytes
    }

    /// How many conditional writes `claim_many` and `settle_many` keep in flight.
    pub fn claim_parallelism(&self) -> usize {
        self.claim_parallelism
    }

    /// Attempts the AWS SDK makes per request (see [`DynamoConfig::with_sdk_attempts`]).
    pub fn sdk_attempts(&self) -> u32 {
        self.sdk_attempts
    }

    /// The bound on opening a connection.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// The bound on one attempt.
    pub fn attempt_timeout(&self) -> Duration {
        self.attempt_timeout
    }

    /// The bound on a whole call.
    pub fn operation_timeout(&self) -> Duration {
        self.operation_timeout
    }

    /// Checks what can be checked without a request.
    pub(crate) fn validate(&self) -> Result<()> {
        let name_ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.');
        if !(3..=255).contains(&self.table.len()) || !self.table.chars().all(name_ok) {
            return Err(Error::config(format!(
                "table name {:?} is not 3 to 255 characters of a-z, A-Z, 0-9, '_', '-', '.'",
                self.table
            )));
        }
        if self.max_response_bytes > ITEM_LIMIT_BYTES {
            return Err(Error::config(format!(
                "max_response_bytes {} is over DynamoDB's item limit of {ITEM_LIMIT_BYTES}",
                self.max_response_bytes
            )));
        }
        if self.claim_parallelism == 0 || self.sdk_attempts == 0 {
            return Err(Error::config(
                "claim_parallelism and sdk_attempts must be at least 1",
            ));
        }
        let timeouts = [
            self.connect_timeout,
            self.attempt_timeout,
            self.operation_timeout,
        ];
        if timeouts.iter().any(Duration::is_zero) {
            return Err(Error::config("a timeout is zero"));
        }
        Ok(())
    }
}

impl fmt::Debug for DynamoConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynamoConfig")
            .field("table", &self.table)
            .field("endpoint", &self.endpoint)
            .field("region", &self.region)
            .field("credentials", &self.credentials)
            .field("clock_skew", &self.clock_skew)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("claim_parallelism", &self.claim_parallelism)
            .field("sdk_attempts", &self.sdk_attempts)
            .field("connect_timeout", &self.connect_timeout)
            .field("attempt_timeout", &self.attempt_timeout)
            .field("operation_timeout", &self.operation_timeout)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_secrets() {
        let config = DynamoConfig::new("idem").with_static_credentials(
            "AKIDEXAMPLE",
            "wJalrXUtnFEMI-s3cret",
            Some("session-s3cret".into()),
        );
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(shown.contains("AKIDEXAMPLE"), "{shown}");
        assert!(shown.contains("***"), "{shown}");
    }

    #[test]
    fn validate_refuses_what_dynamodb_would() {
        let bad = |c: DynamoConfig| matches!(c.validate(), Err(Error::Config { .. }));
        assert!(DynamoConfig::new("idem").validate().is_ok());
        assert!(bad(DynamoConfig::new("x")));
        assert!(bad(DynamoConfig::new("a table")));
        assert!(bad(
            DynamoConfig::new("idem").with_max_response_bytes(ITEM_LIMIT_BYTES + 1)
        ));
        assert!(bad(DynamoConfig::new("idem").with_claim_parallelism(0)));
        assert!(bad(
            DynamoConfig::new("idem").with_operation_timeout(Duration::ZERO)
        ));
    }
}
