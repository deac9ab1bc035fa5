//! What a failed TLS handshake means, for the crates whose TLS is rustls (the stores and
//! idem-rabbitmq): each maps its driver's error to [`Refusal`](crate::Refusal) with these.

use std::error::Error as StdError;

/// Why rustls refused the server's certificate, in words for an error message, if `err` or
/// an error it wraps (an I/O error's inner error included) is that refusal.
pub fn untrusted_certificate(err: &(dyn StdError + 'static)) -> Option<String> {
    use rustls::CertificateError as Why;
    let rustls::Error::InvalidCertificate(why) = find(err)? else {
        return None;
    };
    Some(match why {
        Why::UnknownIssuer => "signed by a CA not trusted here".to_owned(),
        Why::NotValidForName | Why::NotValidForNameContext { .. } => {
            format!("not issued for this host: {why}")
        }
        other => other.to_string(),
    })
}

/// Whether `err` (or an error it wraps) is rustls failing to read the server's answer as
/// TLS records: a server that answered in plaintext.
pub fn not_tls(err: &(dyn StdError + 'static)) -> bool {
    matches!(
        find(err),
        Some(rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. })
    )
}

/// The rustls error in `err`'s chain. An `io::Error`'s `source` skips the error it wraps,
/// so each I/O error's inner one is looked at too.
fn find<'a>(err: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    let mut next = Some(err);
    while let Some(e) = next {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(inner) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            if let Some(tls) = find(inner) {
                return Some(tls);
            }
        }
        next = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_certificate_is_found_inside_an_io_error() {
        let tls = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, tls);
        let why = untrusted_certificate(&io).expect("found");
        assert!(why.contains("not trusted"), "{why}");
        assert!(!not_tls(&io));
    }

    #[test]
    fn a_plaintext_answer_is_not_tls_and_other_errors_are_neither() {
        let tls = rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, tls);
        assert!(not_tls(&io));
        assert_eq!(untrusted_certificate(&io), None);
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        assert!(!not_tls(&refused));
        assert_eq!(untrusted_certificate(&refused), None);
    }
}
