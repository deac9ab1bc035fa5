//! Driver errors mapped to idem's [`Error`] variants, the driver error kept as the source.

use idem_core::{Error, Refusal};
use redis::{ErrorKind, RedisError};

/// The error code the Lua functions raise for a record that does not decode.
const CORRUPT_CODE: &str = "IDEMCORRUPT";

/// Maps a driver error from `what` (an operation name). Records that do not decode (our
/// functions' `IDEMCORRUPT`, a foreign type's `WRONGTYPE`, a reply of the wrong shape) are
/// [`Error::Corrupt`]; everything else (refused, reset, timed out, cluster moving, server
/// busy or out of memory) is [`Error::Unavailable`], which callers retry later.
///
/// An `IDEMCORRUPT` names the key and what it holds (`<key>: holds a Redis hash, not an
/// idem record`), and is the message as it is; what Redis appends to an error a function
/// raised (`script: <function>, on @user_function:<line>.`) is dropped from every message,
/// and so is the driver's error, which repeats it, as the source.
pub(crate) fn from_redis(what: &str, err: RedisError) -> Error {
    let corrupt = matches!(err.code(), Some(CORRUPT_CODE | "WRONGTYPE"))
        || matches!(
            err.kind(),
            ErrorKind::Parse | ErrorKind::UnexpectedReturnType
        );
    if corrupt {
        let raw = err.detail().unwrap_or(err.category());
        let detail = without_script(raw);
        let ours = err.code() == Some(CORRUPT_CODE);
        let message = if ours {
            detail.to_owned()
        } else {
            format!("{what}: {detail}")
        };
        // The driver's error repeats the message with the function's place in it: kept
        // only where it adds something.
        let source: Option<idem_core::BoxError> = if ours || detail.len() < raw.len() {
            None
        } else {
            Some(Box::new(err))
        };
        Error::Corrupt { message, source }
    } else {
        Error::unavailable(format!("{what}: {}", err.category()), err)
    }
}

/// `detail` without the place Redis appends to an error raised in a function or a script:
/// ` script: <name>, on @user_function:<line>.` (`@user_script` for `EVAL`).
fn without_script(detail: &str) -> &str {
    match detail.rfind(" script: ") {
        Some(at) if detail[at..].contains(", on @user_") => detail[..at].trim_end(),
        _ => detail,
    }
}

/// A reply whose shape is not what the function returns.
pub(crate) fn bad_reply(what: &str, why: impl std::fmt::Display) -> Error {
    Error::corrupt(format!("{what}: unexpected reply from Redis: {why}"))
}

/// Maps a failed first connection to `server` (`host:port`): a wrong password, an untrusted
/// certificate or a TLS/plaintext mismatch is [`Error::Refused`], which no retry heals;
/// anything else is what [`from_redis`] makes of it.
pub(crate) fn from_connect(server: &str, tls: bool, err: RedisError) -> Error {
    let why = refusal(tls, &err);
    match why {
        Some(why) => {
            let message = match why {
                Refusal::TlsMismatch if tls => {
                    "the server does not speak TLS: use redis:// (or its TLS port)".to_owned()
                }
                Refusal::TlsMismatch => {
                    "the server closed the connection unanswered: a TLS port? use rediss://"
                        .to_owned()
                }
                _ => err.to_string(),
            };
            Error::Refused {
                server: server.to_owned(),
                why,
                message,
                source: Some(Box::new(err)),
            }
        }
        None => from_redis(&format!("connect to {server}"), err),
    }
}

/// Which setting a connection error points at, if any.
fn refusal(tls: bool, err: &RedisError) -> Option<Refusal> {
    if err.kind() == ErrorKind::AuthenticationFailed
        || matches!(err.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM"))
    {
        return Some(Refusal::Authentication);
    }
    let text = chain_text(err).to_ascii_lowercase();
    if text.contains("invalid peer certificate")
        || text.contains("certificate") && (text.contains("unknown") || text.contains("not valid"))
    {
        return Some(Refusal::UntrustedCertificate);
    }
    if tls && (text.contains("corrupt message") || text.contains("invalid content type")) {
        return Some(Refusal::TlsMismatch);
    }
    // A TLS port closes a plaintext connection at its first bytes, with no reply (a
    // server that is down refuses the connection instead: that stays `Unavailable`).
    let closed = io_kind(err).is_some_and(|kind| {
        matches!(
            kind,
            std::io::ErrorKind::ConnectionReset
                | std::io::ErrorKind::BrokenPipe
                | std::io::ErrorKind::UnexpectedEof
        )
    });
    let closed = closed
        || ["connection reset", "broken pipe", "unexpected eof"]
            .iter()
            .any(|t| text.contains(t));
    (!tls && closed).then_some(Refusal::TlsMismatch)
}

/// The kind of the I/O error in `err`'s sources, if any.
fn io_kind(err: &RedisError) -> Option<std::io::ErrorKind> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(s) = source {
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            return Some(io.kind());
        }
        source = s.source();
    }
    None
}

/// The error's text and its sources', one after another.
fn chain_text(err: &RedisError) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_place_a_function_raised_an_error_is_dropped() {
        let detail = "idem:{2:ns:id}: holds a Redis hash, not an idem record script: \
                      idem_v2_0123456789abcdef_get, on @user_function:12.";
        assert_eq!(
            without_script(detail),
            "idem:{2:ns:id}: holds a Redis hash, not an idem record"
        );
        let eval = "WRONGTYPE Operation script: 5a1b, on @user_script:1.";
        assert_eq!(without_script(eval), "WRONGTYPE Operation");
        let key_with_the_words = "a script: b: not an idem record";
        assert_eq!(without_script(key_with_the_words), key_with_the_words);
    }
}
