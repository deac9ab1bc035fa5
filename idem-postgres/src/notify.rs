//! Waking waiters ([`Backend::watch`](idem_core::Backend::watch)): triggers on the records
//! table (`migrations/0003_settled_notify.sql`) notify the channel `idem_settled` at the
//! commit of every settle, and one `LISTEN` connection per backend (taken from its pool)
//! forwards the settled keys to the waiters in process.

use futures::{FutureExt, StreamExt};
use idem_core::Key;
use idem_core::watch::Feed;
use sqlx::postgres::PgListener;

use crate::PgBackend;
use crate::error::{map, within};

/// The channel the triggers notify.
const CHANNEL: &str = "idem_settled";

impl PgBackend {
    /// The payload the triggers send for `key` in this backend's schema.
    pub(crate) fn topic(&self, key: &Key) -> String {
        let (schema, ns) = (self.schema(), key.namespace());
        format!("{}:{schema}:{}:{ns}:{}", schema.len(), ns.len(), key.id())
    }

    /// The feed of settled keys, listening in its own task. The task holds the pool, not
    /// the backend, so that dropping the last backend ends it.
    pub(crate) fn feed(&self) -> Feed {
        let (pool, limit) = (self.pool().clone(), self.timeout);
        Feed::spawn(
            "postgres",
            Box::new(move || {
                let pool = pool.clone();
                async move {
                    let mut listener =
                        within("listen", limit, PgListener::connect_with(&pool)).await?;
                    within("listen", limit, listener.listen(CHANNEL)).await?;
                    // A lost connection (`Ok(None)`) or an error ends the stream; the feed
                    // then wakes every waiter and listens again.
                    let keys = futures::stream::unfold(listener, |mut l| async move {
                        match l.try_recv().await {
                            Ok(Some(n)) => Some((n.payload().to_owned(), l)),
                            Ok(None) => None,
                            Err(e) => {
                                tracing::warn!(error = %map("listen", e), "LISTEN failed");
                                None
                            }
                        }
                    });
                    Ok(keys.boxed())
                }
                .boxed()
            }),
        )
    }
}
