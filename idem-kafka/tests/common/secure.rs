//! The secured wires of `scripts/services up kafka-tls`: their brokers and the client
//! settings that reach them.

use idem_kafka::rdkafka::ClientConfig;

/// The `SSL` wire (`IDEM_KAFKA_SSL_BROKERS`): the broker verified against the test CA
/// (`IDEM_TLS_CA`), with the client certificate it requires (`IDEM_TLS_CLIENT_CERT`,
/// `IDEM_TLS_CLIENT_KEY`). Sets them on `config` and returns the brokers.
pub fn ssl(config: &mut ClientConfig) -> String {
    let brokers = idem_conformance::service_env("IDEM_KAFKA_SSL_BROKERS");
    config
        .set("bootstrap.servers", &brokers)
        .set("security.protocol", "SSL")
        .set(
            "ssl.ca.location",
            idem_conformance::service_env("IDEM_TLS_CA"),
        )
        .set(
            "ssl.certificate.location",
            idem_conformance::service_env("IDEM_TLS_CLIENT_CERT"),
        )
        .set(
            "ssl.key.location",
            idem_conformance::service_env("IDEM_TLS_CLIENT_KEY"),
        );
    brokers
}
