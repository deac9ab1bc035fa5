//! Shared set-up: a migrated backend on the test server (`IDEM_MYSQL_URL`). Cases keep
//! apart by namespace (the suite gives each its own), so they share the tables of the URL's
//! database.
#![allow(dead_code)]

use idem_mysql::{MySqlBackend, MySqlConfig};
use tokio::sync::OnceCell;

/// The test server's URL, or a failure naming the command that starts it.
pub fn url() -> String {
    idem_conformance::service_env("IDEM_MYSQL_URL")
}

/// A migrated backend.
pub async fn backend() -> MySqlBackend {
    backend_with(|c| c.with_max_connections(20)).await
}

/// A migrated backend with `configure` applied to its configuration.
pub async fn backend_with(configure: impl FnOnce(MySqlConfig) -> MySqlConfig) -> MySqlBackend {
    static MIGRATED: OnceCell<()> = OnceCell::const_new();
    let backend = MySqlBackend::connect(configure(MySqlConfig::new(url())))
        .await
        .expect("connect to IDEM_MYSQL_URL");
    MIGRATED
        .get_or_init(|| async { backend.migrate().await.expect("migrate") })
        .await;
    backend
}
