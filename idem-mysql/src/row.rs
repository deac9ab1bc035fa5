//! A record as MySQL returns it: the row of the record columns, decoded.

use bytes::Bytes;
use idem_core::{Error, Fingerprint, Key, Record, Result, State, Timestamp};
use sqlx::Row;
use sqlx::mysql::MySqlRow;

use crate::error::map;

/// Text stored as bytes, which must be UTF-8.
fn text(row: &MySqlRow, column: &str, what: &str) -> Result<Option<String>> {
    let bytes: Option<Vec<u8>> = row.try_get(column).map_err(|e| map(what, e))?;
    bytes
        .map(|b| String::from_utf8(b).map_err(|_| Error::corrupt(format!("{column} is not UTF-8"))))
        .transpose()
}

/// A row's namespace and id, `namespace/id` (invalid UTF-8 replaced), to name a row that
/// does not decode.
pub(crate) fn row_key(row: &MySqlRow) -> String {
    let part = |name| {
        let bytes: Option<Vec<u8>> = row.try_get(name).ok().flatten();
        String::from_utf8_lossy(&bytes.unwrap_or_else(|| b"?".to_vec())).into_owned()
    };
    format!("{}/{}", part("namespace"), part("id"))
}

/// Decodes a row of the record columns; anything that is not an idem record is `Corrupt`.
pub(crate) fn decode(row: &MySqlRow) -> Result<Record> {
    let what = "decode record";
    let get = |e: sqlx::Error| map(what, e);
    let missing = |c: &str| Error::corrupt(format!("{c} is NULL"));
    let namespace = text(row, "namespace", what)?.ok_or_else(|| missing("namespace"))?;
    let id = text(row, "id", what)?.ok_or_else(|| missing("id"))?;
    let key = Key::new(namespace, id).map_err(|e| Error::Corrupt {
        message: "stored key is not a valid key".into(),
        source: Some(Box::new(e)),
    })?;
    let state: String = row.try_get("state").map_err(get)?;
    let state =
        State::parse(&state).ok_or_else(|| Error::corrupt(format!("state {state:?} of {key}")))?;
    let owner = text(row, "owner", what)?.ok_or_else(|| missing("owner"))?;
    let token: i64 = row.try_get("token").map_err(get)?;
    let attempts: i32 = row.try_get("attempts").map_err(get)?;
    let fingerprint: Option<Vec<u8>> = row.try_get("fingerprint").map_err(get)?;
    let fingerprint = match fingerprint {
        None => None,
        Some(bytes) => Some(Fingerprint(bytes.as_slice().try_into().map_err(|_| {
            Error::corrupt(format!(
                "fingerprint of {key} is {} bytes, not 32",
                bytes.len()
            ))
        })?)),
    };
    let time = |name: &str| -> Result<Option<Timestamp>> {
        let ms: Option<i64> = row.try_get(name).map_err(get)?;
        ms.map(|ms| {
            u64::try_from(ms)
                .map(Timestamp::from_millis)
                .map_err(|_| Error::corrupt(format!("negative {name} of {key}")))
        })
        .transpose()
    };
    let response: Option<Vec<u8>> = row.try_get("response").map_err(get)?;
    let permanent: bool = row.try_get("permanent").map_err(get)?;
    Ok(Record {
        state,
        owner: owner.into(),
        token: u64::try_from(token)
            .map_err(|_| Error::corrupt(format!("negative token of {key}")))?,
        attempts: u32::try_from(attempts)
            .map_err(|_| Error::corrupt(format!("negative attempts of {key}")))?,
        lease_until: time("lease_until_ms")?,
        fingerprint,
        response: response.map(Bytes::from),
        error: text(row, "error", what)?,
        permanent,
        expires_at: time("expires_at_ms")?,
        key,
    })
}
