//! Waking waiters ([`Backend::watch`](idem_core::Backend::watch)): a watch records its key
//! in `idem_waiters` and marks its record watched; triggers on the records table
//! (`migrations/0003_settled_notify.sql`, `0004_notify_only_waiters.sql`,
//! `0006_settled_notify_watched_rows.sql`) notify the channel `idem_settled` at the commit
//! of a settle of such a key, and one `LISTEN` connection per backend (taken from its pool)
//! forwards the settled keys to the waiters in process.

use std::time::Duration;

use futures::{FutureExt, StreamExt};
use idem_core::Key;
use idem_core::backend::watch::Feed;
use sqlx::postgres::PgListener;

use crate::PgBackend;
use crate::error::{map, within};

/// The channel the triggers notify.
const CHANNEL: &str = "idem_settled";

/// How long a watch's row keeps its key notified: a wait longer than this polls.
const WAITER_HORIZON: Duration = Duration::from_secs(600);

impl PgBackend {
    /// Records a waiter on `key`, so that its settles notify. A failure only costs the
    /// waiter its notification (it polls), so it is logged, not returned.
    pub(crate) async fn register_waiter(&self, key: &Key) {
        let query = sqlx::query(self.sql.wait.sql())
            .bind(key.namespace())
            .bind(key.id())
            .bind(i64::try_from(WAITER_HORIZON.as_millis()).unwrap_or(i64::MAX));
        if let Err(e) = self.timed("watch", query.execute(&self.pool)).await {
            tracing::warn!(error = %e, %key, "could not record a waiter: the wait polls");
        }
    }

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
