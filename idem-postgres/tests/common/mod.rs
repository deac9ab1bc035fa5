//! Shared set-up: each call gets a backend in a schema of its own, migrated.

use std::sync::atomic::{AtomicU64, Ordering};

use idem_postgres::{PgBackend, PgConfig};

/// The test server's URL, or a failure naming the command that starts it; in plaintext
/// (`sslmode=disable`) unless the URL says otherwise. The machine's server offers TLS, which
/// sqlx's default `prefer` then takes, and sqlx 0.9.0 leaves Nagle on: each TLS connection
/// costs about 90 ms more here, which the suite's timing cases do not allow for. TLS is
/// `tests/tls.rs`'s.
pub fn url() -> String {
    let url = idem_conformance::service_env("IDEM_POSTGRES_URL");
    if url.contains("sslmode=") {
        url
    } else if url.contains('?') {
        format!("{url}&sslmode=disable")
    } else {
        format!("{url}?sslmode=disable")
    }
}

/// A fresh schema name, unique to this process and call.
pub fn fresh_schema() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "idemtest_{}_{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// A migrated backend in its own schema.
pub async fn backend() -> PgBackend {
    backend_with(|c| c.with_max_connections(20)).await
}

/// A migrated backend in its own schema, with `configure` applied to its configuration.
pub async fn backend_with(configure: impl FnOnce(PgConfig) -> PgConfig) -> PgBackend {
    let config = configure(PgConfig::new(url()).with_schema(fresh_schema()));
    let backend = PgBackend::connect(config)
        .await
        .expect("connect to IDEM_POSTGRES_URL");
    drop_stale_schemas(&backend).await;
    backend.migrate().await.expect("migrate");
    backend
}

/// Drops test schemas left by processes that are gone, so runs do not pile them up.
async fn drop_stale_schemas(backend: &PgBackend) {
    static DONE: AtomicU64 = AtomicU64::new(0);
    if DONE.swap(1, Ordering::SeqCst) == 1 {
        return;
    }
    let rows: Vec<(String,)> =
        sqlx::query_as("SELECT nspname::text FROM pg_namespace WHERE nspname LIKE 'idemtest\\_%'")
            .fetch_all(backend.pool())
            .await
            .expect("list schemas");
    for (name,) in rows {
        let pid = name.split('_').nth(1).unwrap_or("");
        let alive = std::path::Path::new(&format!("/proc/{pid}")).exists();
        let plain = name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !alive && plain {
            let drop = format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE");
            let _ = sqlx::query(sqlx::AssertSqlSafe(drop))
                .execute(backend.pool())
                .await;
        }
    }
}
