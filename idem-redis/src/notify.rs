//! Waking waiters ([`Backend::watch`](idem_core::Backend::watch)): `lua/settle.lua`
//! publishes the keys each call settles on `<prefix>settled`, in one message joined by NUL
//! bytes (no key holds one), and one subscriber connection per backend forwards those keys
//! to the waiters in process.
//!
//! In a cluster the function's `PUBLISH` reaches every node (Redis forwards classic pub/sub
//! over the cluster bus), so the subscriber needs one node only; each reconnect tries the
//! next configured node, so losing a node costs one reconnect.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::{FutureExt, StreamExt};
use idem_core::backend::watch::Feed;

use crate::RedisBackend;
use crate::conn::{node_client, within};

impl RedisBackend {
    /// The feed of settled keys, connecting in its own task.
    pub(crate) fn feed(&self) -> Feed {
        let config = self.shared.config.clone();
        let channel = self.shared.channel.clone();
        let next = Arc::new(AtomicUsize::new(0));
        Feed::spawn(
            "redis",
            Box::new(move || {
                let (config, channel) = (config.clone(), channel.clone());
                let nodes = config.nodes().len().max(1);
                let node = next.fetch_add(1, Ordering::Relaxed) % nodes;
                async move {
                    let url = config.nodes().get(node).map_or("", String::as_str);
                    let client = node_client(&config, url)?;
                    let limit = config.timeout();
                    let mut pubsub = within("subscribe", limit, client.get_async_pubsub()).await?;
                    within("subscribe", limit, pubsub.subscribe(&channel)).await?;
                    let keys = pubsub.into_on_message().flat_map(|msg| {
                        futures::stream::iter(settled_keys(msg.get_payload_bytes()))
                    });
                    Ok(keys.boxed())
                }
                .boxed()
            }),
        )
    }
}

/// The keys of one message on the settled channel: Redis keys joined by NUL bytes. A part
/// that is not UTF-8 is no key of ours and is skipped.
fn settled_keys(payload: &[u8]) -> Vec<String> {
    payload
        .split(|&b| b == 0)
        .filter_map(|key| std::str::from_utf8(key).ok())
        .filter(|key| !key.is_empty())
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::settled_keys;

    #[test]
    fn a_message_names_each_settled_key() {
        assert_eq!(settled_keys(b"idem:ns:a"), ["idem:ns:a"]);
        assert_eq!(
            settled_keys(b"idem:ns:a\0idem:ns:b\nc"),
            ["idem:ns:a", "idem:ns:b\nc"]
        );
        assert_eq!(settled_keys(b"idem:ns:a\0\xff\0"), ["idem:ns:a"]);
    }
}
