//! Checks at start, before the consumer joins its group: a broker answers (and if none
//! does, why: a refused password, an untrusted certificate, TLS against a plaintext
//! listener or the reverse), and the source and dead-letter topics exist.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::metadata::Metadata;
use rdkafka::producer::{BaseProducer, DeliveryResult, Producer, ProducerContext};
use rdkafka::{ClientConfig, ClientContext};

use crate::settings::Settings;
use crate::{Error, Result};

/// The longest one metadata request waits before the client's reports are read again.
const SLICE: Duration = Duration::from_millis(100);

/// Why no broker answered at start, as [`Error::Connect`] says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectFailure {
    /// The broker refused the credentials: SASL authentication failed (a wrong user,
    /// password or mechanism), or the client certificate a broker requires was missing or
    /// refused (`ssl.certificate.location`, `ssl.key.location`).
    Authentication,
    /// The broker's certificate is not trusted: no CA the client trusts signed it
    /// (`ssl.ca.location`), or it names another host.
    UntrustedCertificate,
    /// TLS against a plaintext listener, or plaintext against a TLS listener: the
    /// `security.protocol` does not match the port.
    TlsMismatch,
    /// Nothing answered within the start timeout, for none of the reasons above (a
    /// refused connection, a wrong address, a broker down).
    Unreachable,
}

impl fmt::Display for ConnectFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ConnectFailure::Authentication => "authentication failed",
            ConnectFailure::UntrustedCertificate => "the broker's certificate is not trusted",
            ConnectFailure::TlsMismatch => {
                "TLS and plaintext mismatch (security.protocol does not match the listener)"
            }
            ConnectFailure::Unreachable => "no broker answered",
        })
    }
}

/// What the checks need of the settings, owned, to run on a blocking thread.
pub(crate) struct Checks {
    consumer_config: ClientConfig,
    dead_letter_config: ClientConfig,
    sources: Vec<String>,
    dead_letter: Vec<String>,
    topics_must_exist: bool,
    timeout: Duration,
}

impl Checks {
    pub fn new(settings: &Settings) -> Checks {
        let mut dead_letter: Vec<String> = settings
            .topics
            .iter()
            .map(|t| settings.dead_letter.for_topic(t))
            .collect();
        dead_letter.dedup();
        Checks {
            consumer_config: settings.consumer_config.clone(),
            dead_letter_config: settings.dead_letter_config.clone(),
            sources: settings.topics.clone(),
            dead_letter,
            topics_must_exist: settings.topic_check,
            timeout: settings.start_timeout,
        }
    }

    /// Reads the metadata of the source topics through a client of the consumer's config,
    /// and of the dead-letter topics through one of the dead-letter producer's (the same
    /// client when that config is the consumer's, as by default); blocks, up to the start
    /// timeout for each client.
    pub fn run(self) -> Result<()> {
        let config = crate::builder::config::producer_config(&self.consumer_config);
        let same = config.config_map() == self.dead_letter_config.config_map();
        let asker = Asker::new(config, self.timeout)?;
        let sources = asker.missing(&self.sources)?;
        let dead_letter = if same {
            asker.missing(&self.dead_letter)?
        } else {
            drop(asker);
            Asker::new(self.dead_letter_config.clone(), self.timeout)?.missing(&self.dead_letter)?
        };
        if !self.topics_must_exist || (sources.is_empty() && dead_letter.is_empty()) {
            return Ok(());
        }
        Err(Error::MissingTopics {
            sources,
            dead_letter,
        })
    }
}

/// A client that only asks for metadata: a producer (whose poll hands every error report
/// and log line to [`Reports`], with the client's words) that sends nothing.
struct Asker {
    producer: BaseProducer<Reports>,
    config: ClientConfig,
    timeout: Duration,
}

impl Asker {
    fn new(mut config: ClientConfig, timeout: Duration) -> Result<Asker> {
        // A producer's metadata request may create the topics it names, where the broker
        // allows it (librdkafka's producer default): this one asks only.
        config.set("allow.auto.create.topics", "false");
        // Unless the config sets it, a connection's setup (TCP, TLS handshake, SASL) is
        // bounded to half the start timeout, so that one that never completes is reported,
        // with the state it was stuck in, before the timeout: a TLS handshake that a
        // plaintext listener never answers shows only so. librdkafka's own bound is 30 s.
        const SETUP: &str = "socket.connection.setup.timeout.ms";
        if config.get(SETUP).is_none() {
            let ms = (timeout / 2).as_millis().clamp(1000, 2_147_483_647);
            config.set(SETUP, ms.to_string());
        }
        // librdkafka logs a broker's disconnect (a TLS listener resetting a plaintext
        // connection, say) at `Info`: let it out to the reports, and pass on to `tracing`
        // only what the config's own level lets out.
        let forward = config.log_level;
        if (config.log_level as u8) < RDKafkaLogLevel::Info as u8 {
            config.set_log_level(RDKafkaLogLevel::Info);
        }
        let plaintext = matches!(
            config
                .get("security.protocol")
                .map(str::to_ascii_lowercase)
                .as_deref(),
            None | Some("plaintext" | "sasl_plaintext")
        );
        let reports = Reports {
            seen: Mutex::default(),
            forward,
            plaintext,
        };
        let producer = config
            .create_with_context(reports)
            .map_err(|e| Error::kafka("creating the start-up client", e))?;
        Ok(Asker {
            producer,
            config,
            timeout,
        })
    }

    /// Those of `topics` that do not exist. A failure to reach any broker is
    /// [`Error::Connect`]: as soon as the client reported a refused login, an untrusted
    /// certificate or a protocol mismatch, else at the timeout.
    fn missing(&self, topics: &[String]) -> Result<Vec<String>> {
        let deadline = Instant::now() + self.timeout;
        let client = self.producer.client();
        let mut missing = Vec::new();
        for topic in topics {
            let metadata = loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let slice = left.min(SLICE).max(Duration::from_millis(1));
                let failed = match client.fetch_metadata(Some(topic), slice) {
                    Ok(metadata) => break metadata,
                    Err(e) => e,
                };
                // Serves the client's reports; and waits a little, so that a request
                // refused at once (no broker up yet) is not asked again in a spin.
                self.producer.poll(Duration::from_millis(20));
                let reports = client.context();
                if let Some(error) = reports.decisive(&self.config) {
                    return Err(error);
                }
                if Instant::now() >= deadline {
                    return Err(reports.unreachable(&self.config, &failed));
                }
            };
            if absent(&metadata, topic)? {
                missing.push(topic.clone());
            }
        }
        Ok(missing)
    }
}

/// Whether `topic` is absent from `metadata`: unknown to the broker, or without partitions.
fn absent(metadata: &Metadata, topic: &str) -> Result<bool> {
    let Some(t) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(true);
    };
    match t.error().map(RDKafkaErrorCode::from) {
        None => Ok(t.partitions().is_empty()),
        Some(RDKafkaErrorCode::UnknownTopicOrPartition) => Ok(true),
        Some(code) => Err(Error::kafka(
            "reading a topic's metadata at start",
            KafkaError::MetadataFetch(code),
        )),
    }
}

/// What the client reported, in its own words (which name the broker).
#[derive(Default)]
struct Seen {
    /// The first report that says why a broker cannot be reached.
    decisive: Option<(ConnectFailure, String)>,
    /// The last report of any kind.
    last: Option<String>,
}

/// The client's error reports while the checks run, and its log lines.
pub(crate) struct Reports {
    seen: Mutex<Seen>,
    /// The most verbose log level passed on to `tracing`: the config's.
    forward: RDKafkaLogLevel,
    /// Whether the client speaks plaintext (`PLAINTEXT`, `SASL_PLAINTEXT`).
    plaintext: bool,
}

impl Reports {
    fn note(&self, code: Option<RDKafkaErrorCode>, reason: &str) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.decisive.is_none() {
            if let Some(failure) = classify(code, reason, self.plaintext) {
                seen.decisive = Some((failure, reason.to_owned()));
            }
        }
        seen.last = Some(reason.to_owned());
    }

    /// A refused login, an untrusted certificate or a protocol mismatch, if reported.
    fn decisive(&self, config: &ClientConfig) -> Option<Error> {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let (failure, reason) = seen.decisive.as_ref()?;
        Some(connect(*failure, reason, config))
    }

    /// Nothing answered in time: [`ConnectFailure::Unreachable`], with the client's last
    /// report, or the request's own error if it made none.
    fn unreachable(&self, config: &ClientConfig, failed: &KafkaError) -> Error {
        let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let reason = seen.last.clone().unwrap_or_else(|| failed.to_string());
        connect(ConnectFailure::Unreachable, &reason, config)
    }
}

/// The error for `failure`, naming the broker the client's `reason` names (it starts
/// `ssl://host:port/id: `, or `host:port/id: ` in plaintext), or else the bootstrap
/// servers.
fn connect(failure: ConnectFailure, reason: &str, config: &ClientConfig) -> Error {
    // A log line starts with the thread, `[thrd:ssl://host:port/id]: `.
    let reason = match reason.strip_prefix("[thrd:") {
        Some(rest) => rest.split_once("]: ").map_or(reason, |(_, line)| line),
        None => reason,
    };
    let named = reason.split_once(": ").filter(|(broker, _)| {
        !broker.contains(' ') && (broker.contains("://") || broker.contains('/'))
    });
    let (broker, detail) = match named {
        Some((broker, detail)) => (broker.to_owned(), detail.to_owned()),
        None => (
            config.get("bootstrap.servers").unwrap_or("?").to_owned(),
            reason.to_owned(),
        ),
    };
    Error::Connect {
        broker,
        failure,
        detail,
    }
}

/// Which failure librdkafka's report `reason` (with its error `code`) is, if it is one
/// that no retry mends; `plaintext` if the client speaks plaintext.
fn classify(
    code: Option<RDKafkaErrorCode>,
    reason: &str,
    plaintext: bool,
) -> Option<ConnectFailure> {
    let r = reason.to_ascii_lowercase();
    let any = |words: &[&str]| words.iter().any(|w| r.contains(w));
    if code == Some(RDKafkaErrorCode::Authentication)
        || any(&[
            "sasl authentication error",
            "authentication failed",
            "invalid username or password",
            // The broker's TLS alerts about the client's certificate.
            "alert certificate required",
            "alert bad certificate",
            "alert unknown ca",
            "alert certificate unknown",
        ])
    {
        Some(ConnectFailure::Authentication)
    } else if any(&[
        "certificate verify failed",
        "unable to get local issuer certificate",
        "self signed certificate",
        "self-signed certificate",
        "hostname mismatch",
    ]) {
        Some(ConnectFailure::UntrustedCertificate)
    } else if any(&[
        "connecting to a ssl listener",
        "connecting to a plaintext",
        "incorrect security.protocol",
        "wrong version number",
        "packet length too long",
        "record layer failure",
        "unexpected eof while reading",
        // A TLS handshake never answered: a plaintext listener takes the client's hello
        // for the start of a request and waits for the rest.
        "in state ssl_handshake",
    ]) || (plaintext
        && r.contains("disconnected")
        && r.contains("in state apiversion_query"))
    {
        // The last: a plaintext connection dropped before the broker answered its first
        // request, which every Kafka broker since 0.10 answers; a TLS listener drops it.
        Some(ConnectFailure::TlsMismatch)
    } else {
        None
    }
}

impl ClientContext for Reports {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        if fac == "FAIL" || (level as u8) <= RDKafkaLogLevel::Warning as u8 {
            self.note(None, message);
        }
        if (level as u8) <= self.forward as u8 {
            crate::client::log_to_tracing(level, fac, message);
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.note(error.rdkafka_error_code(), reason);
        tracing::debug!(target: "librdkafka", %error, reason, "client error at start");
    }
}

impl ProducerContext for Reports {
    type DeliveryOpaque = ();

    fn delivery(&self, _: &DeliveryResult<'_>, _: Self::DeliveryOpaque) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_failure_is_told_from_the_clients_words() {
        let cases = [
            (
                Some(RDKafkaErrorCode::Authentication),
                "sasl_ssl://127.0.0.1:9094/bootstrap: SASL authentication error: x",
                Some(ConnectFailure::Authentication),
            ),
            (
                Some(RDKafkaErrorCode::SSL),
                "ssl://127.0.0.1:9093/bootstrap: SSL handshake failed: error:0A000086:SSL \
                 routines::certificate verify failed: broker certificate could not be verified",
                Some(ConnectFailure::UntrustedCertificate),
            ),
            (
                None,
                "127.0.0.1:9093/bootstrap: Disconnected while requesting ApiVersion: might be \
                 caused by incorrect security.protocol configuration (connecting to a SSL \
                 listener?)",
                Some(ConnectFailure::TlsMismatch),
            ),
            (
                Some(RDKafkaErrorCode::BrokerTransportFailure),
                "127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused",
                None,
            ),
        ];
        for (code, reason, want) in cases {
            assert_eq!(classify(code, reason, true), want, "{reason}");
        }
        let reset = "127.0.0.1:16390/bootstrap: Disconnected: connection reset by peer (after \
                     0ms in state APIVERSION_QUERY)";
        assert_eq!(
            classify(None, reset, true),
            Some(ConnectFailure::TlsMismatch)
        );
        assert_eq!(
            classify(None, reset, false),
            None,
            "a TLS client got that far"
        );
        let stuck = "ssl://127.0.0.1:19092/bootstrap: Connection setup timed out in state \
                     SSL_HANDSHAKE (after 2001ms in state SSL_HANDSHAKE)";
        assert_eq!(
            classify(None, stuck, false),
            Some(ConnectFailure::TlsMismatch)
        );
        let refused = "ssl://a:1/bootstrap: Receive failed: ssl/record/rec_layer_s3.c:918:\
                       ssl3_read_bytes error:0A00045C:SSL routines::tlsv13 alert certificate \
                       required: SSL alert number 116";
        assert_eq!(
            classify(None, refused, false),
            Some(ConnectFailure::Authentication)
        );
    }

    #[test]
    fn the_broker_is_the_one_the_report_names_else_the_bootstrap_servers() {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", "a:1,b:2");
        let named = connect(
            ConnectFailure::Authentication,
            "sasl_ssl://a:1/0: SASL authentication error: no",
            &config,
        );
        assert!(
            matches!(&named, Error::Connect { broker, detail, .. }
                if broker == "sasl_ssl://a:1/0" && detail == "SASL authentication error: no"),
            "{named:?}"
        );
        let logged = connect(
            ConnectFailure::TlsMismatch,
            "[thrd:ssl://a:1/bootstrap]: ssl://a:1/bootstrap: Connection setup timed out",
            &config,
        );
        assert!(
            matches!(&logged, Error::Connect { broker, .. } if broker == "ssl://a:1/bootstrap"),
            "{logged:?}"
        );
        let unnamed = connect(ConnectFailure::Unreachable, "1/1 brokers are down", &config);
        assert!(
            matches!(&unnamed, Error::Connect { broker, .. } if broker == "a:1,b:2"),
            "{unnamed:?}"
        );
    }
}
