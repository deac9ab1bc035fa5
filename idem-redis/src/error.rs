//! Driver errors mapped to idem's [`Error`] variants, the driver error kept as the source.

use idem_core::Error;
use redis::{ErrorKind, RedisError};

/// The error code the Lua functions raise for a record that does not decode.
const CORRUPT_CODE: &str = "IDEMCORRUPT";

/// Maps a driver error from `what` (an operation name). Records that do not decode (our
/// functions' `IDEMCORRUPT`, a foreign type's `WRONGTYPE`, a reply of the wrong shape) are
/// [`Error::Corrupt`]; everything else (refused, reset, timed out, cluster moving, server
/// busy or out of memory) is [`Error::Unavailable`], which callers retry later.
pub(crate) fn from_redis(what: &str, err: RedisError) -> Error {
    let corrupt = matches!(err.code(), Some(CORRUPT_CODE | "WRONGTYPE"))
        || matches!(
            err.kind(),
            ErrorKind::Parse | ErrorKind::UnexpectedReturnType
        );
    if corrupt {
        Error::Corrupt {
            message: format!("{what}: {}", err.detail().unwrap_or(err.category())),
            source: Some(Box::new(err)),
        }
    } else {
        Error::unavailable(format!("{what}: {}", err.category()), err)
    }
}

/// A reply whose shape is not what the function returns.
pub(crate) fn bad_reply(what: &str, why: impl std::fmt::Display) -> Error {
    Error::corrupt(format!("{what}: unexpected reply from Redis: {why}"))
}
