//! What a bench runs against: a backend opened in a place of its own (a fresh schema, key
//! prefix or table, through its driver's isolation), and its store's raw conditional write
//! through the same client.

use std::sync::Arc;
use std::time::Duration;

use idem_core::Backend;
use idem_core::layer::Coalesce;
use idem_once::backend::driver::{Options, RAW_RETENTION, RawWrite, Store};

use crate::error::{Result, StoreContext};
use crate::target::Target;

/// How long bench records and raw keys are kept; stores with native expiry drop them.
pub const RETENTION: Duration = RAW_RETENTION;

/// One backend under bench.
pub struct Subject {
    /// `memory`, `redis`, `postgres`, `mysql`, `dynamodb` (`+coalesce` when coalesced).
    pub kind: &'static str,
    /// The URL, password hidden.
    pub shown: String,
    /// The backend.
    pub backend: Arc<dyn Backend>,
    /// The raw baseline through the same client.
    pub raw: Arc<dyn RawWrite>,
    /// The opened store, closed (its place removed) at the end; `None` for a second view
    /// of another subject's store.
    store: Option<Box<dyn Store>>,
}

impl Subject {
    /// Opens `target` in a place of its own for a bench tagged `tag`, with connections for
    /// `workers`.
    pub async fn open(target: &Target, tag: &str, workers: u32) -> Result<Self> {
        let options = Options::new()
            .with_connections(workers.clamp(4, 64))
            .with_isolation(&format!("bench_{tag}"));
        let store = target.connect(&options).await?;
        let raw = store.raw().await.store("set up the raw baseline")?;
        Ok(Subject {
            kind: target.kind(),
            shown: target.to_string(),
            backend: store.backend(),
            raw,
            store: Some(store),
        })
    }

    /// The same store with its single calls joined into batch calls
    /// (`idem_core::layer::Coalesce`), shown as `<kind>+coalesce`.
    pub fn coalesced(&self) -> Self {
        Subject {
            // Any backend's kind, not a list of the ones known when this was written (a
            // backend added later was shown under its plain kind, twice): one small string
            // leaked per subject per bench run, which `Cell` keeps as `&'static str`.
            kind: Box::leak(format!("{}+coalesce", self.kind).into_boxed_str()),
            shown: format!("{} (coalesced)", self.shown),
            backend: Arc::new(Coalesce::new(Arc::clone(&self.backend))),
            raw: Arc::clone(&self.raw),
            store: None,
        }
    }

    /// Removes the schema, keys or table the bench made.
    pub async fn close(self) -> Result<()> {
        match self.store {
            Some(store) => store.close().await.store("remove what the bench created"),
            None => Ok(()),
        }
    }
}
