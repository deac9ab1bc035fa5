//! Where the backend connects and how it names and bounds things.

use std::fmt;
use std::time::Duration;

use idem_core::backend::Capabilities;
use idem_core::backend::driver::redact;
use idem_core::{Error, Result};

/// How a [`RedisBackend`](crate::RedisBackend) connects, names its keys and bounds its calls.
///
/// `Debug` shows the URLs with their passwords replaced by `***`.
#[derive(Clone)]
pub struct RedisConfig {
    nodes: Vec<String>,
    cluster: bool,
    prefix: String,
    timeout: Duration,
    max_response_bytes: usize,
    #[cfg(feature = "tls")]
    tls_root_cert: Option<Vec<u8>>,
}

impl RedisConfig {
    /// The default key prefix.
    pub const DEFAULT_PREFIX: &'static str = "idem:";
    /// The default bound on every call, connecting included.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);

    /// One standalone server (or a primary behind a proxy), as a `redis://` URL, or
    /// `rediss://` with the `tls` feature: `redis://:password@host:6379/0`.
    pub fn new(url: impl Into<String>) -> Self {
        RedisConfig {
            nodes: vec![url.into()],
            cluster: false,
            prefix: Self::DEFAULT_PREFIX.to_owned(),
            timeout: Self::DEFAULT_TIMEOUT,
            max_response_bytes: Capabilities::default().max_response_bytes,
            #[cfg(feature = "tls")]
            tls_root_cert: None,
        }
    }

    /// A Redis Cluster, given one or more of its nodes; the rest are discovered.
    pub fn cluster<I, S>(nodes: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisConfig {
            nodes: nodes.into_iter().map(Into::into).collect(),
            cluster: true,
            ..RedisConfig::new(String::new())
        }
    }

    /// Standalone for one URL, cluster for a comma-separated list of node URLs: the form
    /// of `IDEM_REDIS_URL` and `IDEM_REDIS_CLUSTER_URL`.
    pub fn from_urls(urls: &str) -> Self {
        let nodes: Vec<&str> = urls
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        match nodes.as_slice() {
            [one] => RedisConfig::new(*one),
            many => RedisConfig::cluster(many.iter().copied()),
        }
    }

    /// Puts every key under `prefix` (default `idem:`). It may not contain `{` or `}`,
    /// which Redis Cluster reads as a hash tag.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Bounds every call, connecting included (default 2 s). A call that takes longer
    /// fails with [`Error::Unavailable`]; its effect in the store is then unknown.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = idem_core::clock::capped(timeout);
        self
    }

    /// The largest response `complete` accepts (default 64 KiB); a larger one is
    /// [`Error::TooLarge`].
    pub fn with_max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// Trusts the certificate authorities in `pem` (PEM certificates) for `rediss://`
    /// instead of the system's and webpki's roots: for servers with a private CA.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn with_tls_root_cert(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_root_cert = Some(pem.into());
        self
    }

    /// The private CA certificates given to [`RedisConfig::with_tls_root_cert`], if any.
    #[cfg(feature = "tls")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tls")))]
    pub fn tls_root_cert(&self) -> Option<&[u8]> {
        self.tls_root_cert.as_deref()
    }

    /// The node URLs.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// Whether this is a cluster.
    pub fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The bound on every call.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The largest response `complete` accepts.
    pub fn max_response_bytes(&self) -> usize {
        self.max_response_bytes
    }

    /// Checks what can be checked without connecting.
    pub(crate) fn validate(&self) -> Result<()> {
        if self.nodes.is_empty() || self.nodes.iter().any(|n| n.trim().is_empty()) {
            return Err(Error::config("no Redis URL given"));
        }
        if self.prefix.contains(['{', '}']) {
            return Err(Error::config(format!(
                "prefix {:?} contains a brace, which Redis Cluster reads as a hash tag",
                self.prefix
            )));
        }
        if self.timeout.is_zero() {
            return Err(Error::config("timeout is zero"));
        }
        Ok(())
    }
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes: Vec<String> = self.nodes.iter().map(|n| redact(n)).collect();
        let mut f = f.debug_struct("RedisConfig");
        f.field("nodes", &nodes)
            .field("cluster", &self.cluster)
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("max_response_bytes", &self.max_response_bytes);
        #[cfg(feature = "tls")]
        f.field("tls_root_cert", &self.tls_root_cert.as_ref().map(|_| "set"));
        f.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_passwords() {
        let config = RedisConfig::cluster([
            "redis://user:s3cret@127.0.0.1:7000/",
            "redis+unix:///run/redis.sock?db=1&pass=s3cret",
            "redis://:s3cret@[not a url",
        ]);
        let shown = format!("{config:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(
            shown.contains("redis://user:***@127.0.0.1:7000/"),
            "{shown}"
        );
        assert!(shown.contains("pass=***"), "{shown}");
        assert!(shown.contains("<unparsable URL>"), "{shown}");
    }

    #[test]
    fn from_urls_picks_the_mode() {
        let one = RedisConfig::from_urls("redis://a:1/");
        assert!(!one.is_cluster());
        let many = RedisConfig::from_urls("redis://a:1/, redis://b:2/,");
        assert!(many.is_cluster());
        assert_eq!(many.nodes(), ["redis://a:1/", "redis://b:2/"]);
    }

    #[test]
    fn validate_refuses_braces_and_empty_urls() {
        let braces = RedisConfig::new("redis://a/").with_prefix("x{y}");
        assert!(matches!(braces.validate(), Err(Error::Config { .. })));
        assert!(matches!(
            RedisConfig::from_urls(" ").validate(),
            Err(Error::Config { .. })
        ));
        assert!(RedisConfig::new("redis://a/").validate().is_ok());
    }
}
