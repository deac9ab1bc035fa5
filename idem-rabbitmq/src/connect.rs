//! Connecting: the server's URI, TLS (a CA and a client certificate of the user's own), and
//! what a failed connect means.

use std::fmt;

use lapin::tcp::OwnedTLSConfig;
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties, ErrorKind};

use crate::{Error, Result};

/// Where the consumer connects, and with which TLS settings.
#[derive(Clone)]
pub(crate) struct Target {
    uri: AMQPUri,
    tls: OwnedTLSConfig,
    /// `host:port`, for errors.
    server: String,
}

impl Target {
    /// The target of `uri` with `tls`, or why the two do not go together.
    pub(crate) fn new(uri: &str, tls: OwnedTLSConfig) -> Result<Target> {
        // The parser's message never repeats the URI, whose password it would show.
        let uri: AMQPUri = uri
            .parse()
            .map_err(|e| Error::Config(format!("the AMQP URI does not parse: {e}")))?;
        let server = format!("{}:{}", uri.authority.host, uri.authority.port);
        let secure = uri.scheme == AMQPScheme::AMQPS;
        if !secure && (tls.cert_chain.is_some() || tls.identity.is_some()) {
            return Err(Error::Config(format!(
                "TLS settings are given but the URI of {server} is amqp://: use amqps://"
            )));
        }
        if secure && !cfg!(feature = "tls") {
            return Err(Error::Config(format!(
                "the URI of {server} is amqps://: enable idem-rabbitmq's feature `tls`"
            )));
        }
        Ok(Target { uri, tls, server })
    }

    /// A connection to the server, or a [`Error::Connect`] saying why not.
    pub(crate) async fn connect(&self, props: ConnectionProperties) -> Result<Connection> {
        let runtime = lapin::runtime::default_runtime().map_err(Error::amqp("runtime"))?;
        Connection::connect_uri_with_config(self.uri.clone(), props, self.tls.clone(), runtime)
            .await
            .map_err(|source| Error::Connect {
                server: self.server.clone(),
                failure: ConnectFailure::of(&source, self.uri.scheme == AMQPScheme::AMQPS),
                source,
            })
    }
}

/// Why a connect failed, as far as the client can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectFailure {
    /// No server accepts connections there (refused, unreachable, timed out, unknown name).
    Unreachable,
    /// The server's TLS certificate is not trusted: signed by a CA the client does not
    /// know, for another name, or expired.
    UntrustedCertificate,
    /// The TLS handshake failed otherwise, e.g. the server refused the client certificate.
    Tls,
    /// `amqps://` to a port that does not speak TLS (a plain `amqp://` port).
    NotTls,
    /// `amqp://` to a port that does not answer plain AMQP (a TLS port, `amqps://`).
    NotPlainAmqp,
    /// The server refused the login: the user name or password, or the client
    /// certificate's user with `auth_mechanism=external`.
    Authentication,
    /// Anything else; the source says what.
    Other,
}

impl ConnectFailure {
    fn of(e: &lapin::Error, secure: bool) -> ConnectFailure {
        match e.kind() {
            ErrorKind::ProtocolError(amqp) if amqp.get_id() == 403 => {
                ConnectFailure::Authentication
            }
            ErrorKind::AuthProviderError(_) => ConnectFailure::Authentication,
            ErrorKind::ParsingError(_) | ErrorKind::InvalidProtocolVersion(_) if !secure => {
                ConnectFailure::NotPlainAmqp
            }
            ErrorKind::IOError(io) => Self::of_io(io, secure),
            _ => ConnectFailure::Other,
        }
    }

    fn of_io(io: &std::io::Error, secure: bool) -> ConnectFailure {
        use std::io::ErrorKind as Io;
        #[cfg(feature = "tls")]
        if let Some(tls) = io.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()) {
            return match tls {
                rustls::Error::InvalidCertificate(_) => ConnectFailure::UntrustedCertificate,
                rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. } => {
                    ConnectFailure::NotTls
                }
                _ => ConnectFailure::Tls,
            };
        }
        match io.kind() {
            Io::ConnectionRefused
            | Io::TimedOut
            | Io::HostUnreachable
            | Io::NetworkUnreachable
            | Io::AddrNotAvailable
            | Io::NotFound => ConnectFailure::Unreachable,
            // A TLS server drops a client that opens with the AMQP header.
            Io::UnexpectedEof | Io::ConnectionReset | Io::ConnectionAborted if !secure => {
                ConnectFailure::NotPlainAmqp
            }
            _ => ConnectFailure::Other,
        }
    }
}

impl fmt::Display for ConnectFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ConnectFailure::Unreachable => "no server answers there",
            ConnectFailure::UntrustedCertificate => {
                "the server's TLS certificate is not trusted (give its CA with `tls_ca_file`)"
            }
            ConnectFailure::Tls => "the TLS handshake failed",
            ConnectFailure::NotTls => {
                "the server does not speak TLS on this port (a plain AMQP port? use amqp://)"
            }
            ConnectFailure::NotPlainAmqp => {
                "the server does not answer plain AMQP on this port (a TLS port? use amqps://)"
            }
            ConnectFailure::Authentication => {
                "the server refused the login (the user and password, or the client \
                 certificate's user)"
            }
            ConnectFailure::Other => "the connection failed",
        })
    }
}

/// The TLS settings of files the user named: a CA bundle and a client certificate.
#[cfg(feature = "tls")]
pub(crate) fn tls_config(
    ca_file: Option<&std::path::Path>,
    client: Option<(&std::path::Path, &std::path::Path)>,
) -> Result<OwnedTLSConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    let read = |what: &str, path: &std::path::Path| {
        std::fs::read(path)
            .map_err(|e| Error::Config(format!("the TLS {what} {}: {e}", path.display())))
    };
    let certs = |what: &str, path: &std::path::Path, pem: &[u8]| {
        let n = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Error::Config(format!("the TLS {what} {}: {e}", path.display())))?
            .len();
        if n == 0 {
            return Err(Error::Config(format!(
                "the TLS {what} {} holds no PEM certificate",
                path.display()
            )));
        }
        Ok(())
    };
    let mut config = OwnedTLSConfig::default();
    if let Some(path) = ca_file {
        let pem = read("CA file", path)?;
        certs("CA file", path, &pem)?;
        let pem = String::from_utf8(pem).map_err(|_| {
            Error::Config(format!("the TLS CA file {} is not text", path.display()))
        })?;
        config.cert_chain = Some(pem);
    }
    if let Some((cert_path, key_path)) = client {
        let pem = read("client certificate", cert_path)?;
        certs("client certificate", cert_path, &pem)?;
        let key = read("client key", key_path)?;
        PrivateKeyDer::from_pem_slice(&key).map_err(|e| {
            Error::Config(format!(
                "the TLS client key {} holds no PEM private key: {e}",
                key_path.display()
            ))
        })?;
        config.identity = Some(lapin::tcp::OwnedIdentity::PKCS8 { pem, key });
    }
    Ok(config)
}
