//! The statements, built once per backend from the checked schema name. Values are always
//! bound (`?`); the only text put into a statement is the quoted schema, checked in
//! `MySqlConfig`, and the number of `?` groups of a batch.

use std::fmt::Write;

/// The server's clock in milliseconds since the Unix epoch: `NOW(6)`, on a connection
/// whose `time_zone` is `+00:00` (sqlx sets it at connect), so `UNIX_TIMESTAMP` reads it
/// back without a daylight-saving ambiguity.
pub(crate) const NOW_MS: &str = "CAST(FLOOR(UNIX_TIMESTAMP(NOW(6)) * 1000) AS SIGNED)";

/// The record columns, in the order every statement reads and binds them.
pub(crate) const COLUMNS: [&str; 12] = [
    "namespace",
    "id",
    "state",
    "owner",
    "token",
    "attempts",
    "lease_until_ms",
    "fingerprint",
    "response",
    "error",
    "permanent",
    "expires_at_ms",
];

/// The tables, as `schema.table` or `table`.
#[derive(Debug)]
pub(crate) struct Tables {
    pub records: String,
    pub offsets: String,
    schema: Option<String>,
}

impl Tables {
    /// `schema` is quoted and checked already (`MySqlConfig::quoted_schema`).
    pub fn new(schema: Option<String>) -> Tables {
        let prefix = schema.as_ref().map_or(String::new(), |s| format!("{s}."));
        Tables {
            records: format!("{prefix}idem_records"),
            offsets: format!("{prefix}idem_offsets"),
            schema,
        }
    }

    /// The statements that create what idem needs, each idempotent.
    pub fn migrations(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(schema) = &self.schema {
            out.push(format!("CREATE DATABASE IF NOT EXISTS {schema}"));
        }
        // Keys, owners and texts are bytes: compared byte for byte, stored as given,
        // whatever the server's default character set and collation. No index on the
        // expiry: it cost a quarter of the Kafka loop's throughput (docs/performance.md),
        // and `purge_expired` walks the primary key instead.
        out.push(format!(
            "CREATE TABLE IF NOT EXISTS {} (
                namespace VARBINARY(128) NOT NULL,
                id VARBINARY(512) NOT NULL,
                state VARCHAR(16) CHARACTER SET ascii NOT NULL,
                owner BLOB NOT NULL,
                token BIGINT NOT NULL,
                attempts INT NOT NULL,
                lease_until_ms BIGINT NULL,
                fingerprint VARBINARY(32) NULL,
                response LONGBLOB NULL,
                error MEDIUMBLOB NULL,
                permanent BOOLEAN NOT NULL DEFAULT FALSE,
                expires_at_ms BIGINT NULL,
                PRIMARY KEY (namespace, id)
            ) ENGINE = InnoDB",
            self.records
        ));
        out.push(format!(
            "CREATE TABLE IF NOT EXISTS {} (
                consumer_group VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
                topic VARCHAR(249) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
                kafka_partition INT NOT NULL,
                next_offset BIGINT NOT NULL,
                PRIMARY KEY (consumer_group, topic, kafka_partition)
            ) ENGINE = InnoDB",
            self.offsets
        ));
        out
    }

    /// Locks the records of `n` distinct keys (`?` pairs of namespace and id) and reads
    /// them with the server's clock: one row with `now_ms` and NULL columns when none
    /// exists. The scan of the primary key's ranges takes the row locks in key order.
    ///
    /// The primary key is forced: on a table whose statistics say it is empty (just
    /// created or truncated), MariaDB 10.11 plans this join as a full scan, which under
    /// `FOR UPDATE` reads and locks every row, and keeps that plan while the table grows
    /// (measured: 39 ms per claim of 35 keys at 16,000 rows, against 8 ms for 150 keys
    /// on the primary key).
    pub fn lock(&self, n: usize) -> String {
        let mut s = self.read(n);
        s.push_str(" FOR UPDATE");
        s
    }

    /// [`Tables::lock`]'s read without the locks: the records as committed now.
    pub fn read(&self, n: usize) -> String {
        let mut s = format!(
            "SELECT d.now_ms, {} FROM (SELECT {NOW_MS} AS now_ms) d LEFT JOIN {} r FORCE INDEX (PRIMARY) ON (r.namespace, r.id) IN (",
            columns("r."),
            self.records
        );
        for i in 0..n {
            s.push_str(if i == 0 { "(?, ?)" } else { ", (?, ?)" });
        }
        s.push(')');
        s
    }

    /// Inserts `n` records; a key that exists fails the statement (`ER_DUP_ENTRY`).
    pub fn insert(&self, n: usize) -> String {
        let mut s = format!(
            "INSERT INTO {} ({}) VALUES ",
            self.records,
            COLUMNS.join(", ")
        );
        let row = format!("({})", vec!["?"; COLUMNS.len()].join(", "));
        for i in 0..n {
            if i > 0 {
                s.push_str(", ");
            }
            s.push_str(&row);
        }
        s
    }

    /// Inserts the first claim of `n` keys, each where the key has no row (`INSERT IGNORE`):
    /// per key its namespace, id, owner, lease ttl (ms), fingerprint and ttl plus
    /// retention (ms), decided on the server's clock. With `returning` (MariaDB 10.5+) the
    /// keys inserted come back with their lease deadlines; without it (one key), the
    /// statement's answer carries the server's clock as `LAST_INSERT_ID`, and its row
    /// count says whether the key was inserted.
    pub fn claim_fresh(&self, n: usize, returning: bool) -> String {
        let now = if returning {
            NOW_MS.to_owned()
        } else {
            format!("LAST_INSERT_ID({NOW_MS})")
        };
        let row =
            format!("(?, ?, 'processing', ?, 1, 1, {now} + ?, ?, NULL, NULL, FALSE, {NOW_MS} + ?)");
        let mut s = format!(
            "INSERT IGNORE INTO {} ({}) VALUES ",
            self.records,
            COLUMNS.join(", ")
        );
        s.push_str(&vec![row; n].join(", "));
        if returning {
            s.push_str(" RETURNING namespace, id, lease_until_ms");
        }
        s
    }

    /// Completes or fails one record if the lease still holds it (a live `processing`
    /// record with the lease's token and owner): the retention (ms) twice, the state,
    /// response, error text and whether permanent, then the key, token and owner. One row
    /// affected is the lease held; none is fenced.
    pub fn settle_one(&self) -> String {
        format!(
            "UPDATE {} SET expires_at_ms = {}, state = ?, response = ?, error = ?, \
             permanent = ?, lease_until_ms = NULL \
             WHERE namespace = ? AND id = ? AND token = ? AND owner = ? \
             AND state = 'processing' AND {}",
            self.records,
            settled_expiry("", "?"),
            live()
        )
    }

    /// [`Tables::settle_one`] for `n` records of distinct keys, as one multi-row insert
    /// that updates where the lease holds (per item the key, token and owner, then the
    /// state, response, error text, whether permanent and the retention in ms). Every item
    /// whose lease held counts 2 rows affected; one that did not counts 1, and so does a
    /// key with no row, which the insert adds: the caller commits only if every item
    /// counted 2, and rolls back otherwise. Assignments run left to right, each seeing the
    /// ones before: the expiry goes first (it reads the lease's deadline), the state last
    /// (the fence reads it), and with a retention above zero an item that held still
    /// passes the fence after its new expiry.
    pub fn settle_many(&self, n: usize) -> String {
        let row = "(?, ?, ?, ?, ?, ?, ?, ?, ?, 0)";
        let fence = format!(
            "(token = VALUES(token) AND owner = VALUES(owner) AND state = 'processing' \
             AND {})",
            live()
        );
        let mut s = format!(
            "INSERT INTO {} (namespace, id, token, owner, state, response, error, permanent, \
             expires_at_ms, attempts) VALUES {} ON DUPLICATE KEY UPDATE ",
            self.records,
            vec![row; n].join(", ")
        );
        let keep = "VALUES(expires_at_ms)";
        let _ = write!(
            s,
            "expires_at_ms = IF({fence}, {}, expires_at_ms)",
            settled_expiry("", keep)
        );
        for c in ["response", "error", "permanent"] {
            let _ = write!(s, ", {c} = IF({fence}, VALUES({c}), {c})");
        }
        let _ = write!(
            s,
            ", lease_until_ms = IF({fence}, NULL, lease_until_ms), \
             state = IF({fence}, VALUES(state), state)"
        );
        s
    }

    /// Writes `n` records over rows this transaction holds locked.
    pub fn upsert(&self, n: usize) -> String {
        let mut s = self.insert(n);
        s.push_str(" ON DUPLICATE KEY UPDATE ");
        for (i, c) in COLUMNS[2..].iter().enumerate() {
            if i > 0 {
                s.push_str(", ");
            }
            let _ = write!(s, "{c} = VALUES({c})");
        }
        s
    }

    /// The live record of a key, with the server's clock.
    pub fn get(&self) -> String {
        format!(
            "SELECT {}, {NOW_MS} AS now_ms FROM {} WHERE namespace = ? AND id = ? AND {}",
            columns(""),
            self.records,
            live()
        )
    }

    /// Deletes a key's record if it is live.
    pub fn delete_live(&self) -> String {
        format!(
            "DELETE FROM {} WHERE namespace = ? AND id = ? AND {}",
            self.records,
            live()
        )
    }

    /// Deletes a key's record, live or not.
    pub fn delete_any(&self) -> String {
        format!(
            "DELETE FROM {} WHERE namespace = ? AND id = ?",
            self.records
        )
    }

    /// The key `?` rows into the next chunk of a purge's walk, in primary key order: the
    /// chunk starts after the key bound before it (namespace, namespace, id) unless `first`.
    pub fn purge_bound(&self, first: bool) -> String {
        let after = if first {
            ""
        } else {
            " WHERE (namespace > ? OR (namespace = ? AND id > ?))"
        };
        format!(
            "SELECT namespace, id FROM {}{after} ORDER BY namespace, id LIMIT 1 OFFSET ?",
            self.records
        )
    }

    /// Deletes the expired records of one chunk of a purge's walk: after a key (namespace,
    /// namespace, id) unless `first`, up to and including one (the same three) unless
    /// `last`.
    pub fn purge_chunk(&self, first: bool, last: bool) -> String {
        let mut s = format!(
            "DELETE FROM {} WHERE expires_at_ms <= {NOW_MS}",
            self.records
        );
        if !first {
            s.push_str(" AND (namespace > ? OR (namespace = ? AND id > ?))");
        }
        if !last {
            s.push_str(" AND (namespace < ? OR (namespace = ? AND id <= ?))");
        }
        s
    }

    /// Whether the records table has the expiry index that earlier versions created
    /// (`information_schema`; the schema bound, NULL for the connection's database).
    pub fn has_expiry_index(&self) -> &'static str {
        "SELECT COUNT(*) FROM information_schema.STATISTICS \
         WHERE TABLE_SCHEMA = COALESCE(?, DATABASE()) AND TABLE_NAME = 'idem_records' \
         AND INDEX_NAME = 'idem_records_expiry'"
    }

    /// Drops that index.
    pub fn drop_expiry_index(&self) -> String {
        format!(
            "ALTER TABLE {} DROP INDEX idem_records_expiry",
            self.records
        )
    }

    /// Live records, filtered by namespace and state where `namespace` and `state` say so,
    /// at most `?` of them where `limit`.
    pub fn list(&self, namespace: bool, state: bool, limit: bool) -> String {
        let mut s = format!(
            "SELECT {}, {NOW_MS} AS now_ms FROM {} WHERE {}",
            columns(""),
            self.records,
            live()
        );
        if namespace {
            s.push_str(" AND namespace = ?");
        }
        if state {
            s.push_str(" AND state = ?");
        }
        s.push_str(" ORDER BY namespace, id");
        if limit {
            s.push_str(" LIMIT ?");
        }
        s
    }

    /// Stores a group's next offset for a partition.
    pub fn store_offset(&self) -> String {
        format!(
            "INSERT INTO {} (consumer_group, topic, kafka_partition, next_offset) \
             VALUES (?, ?, ?, ?) ON DUPLICATE KEY UPDATE next_offset = VALUES(next_offset)",
            self.offsets
        )
    }

    /// Removes a group's stored offsets; the topic and partition conditions are each
    /// bound twice (`NULL` matches all).
    pub fn delete_offsets(&self) -> String {
        format!(
            "DELETE FROM {} WHERE consumer_group = ? AND (? IS NULL OR topic = ?) \
             AND (? IS NULL OR kafka_partition = ?)",
            self.offsets
        )
    }

    /// A group's stored next offsets.
    pub fn offsets(&self) -> String {
        format!(
            "SELECT topic, kafka_partition, next_offset FROM {} WHERE consumer_group = ?",
            self.offsets
        )
    }
}

/// The record columns, each prefixed with `prefix` (a table alias and a dot, or nothing).
fn columns(prefix: &str) -> String {
    COLUMNS
        .iter()
        .map(|c| format!("{prefix}{c}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The expiry a complete or fail of record `r` (a column prefix, or nothing) writes:
/// `retention` (ms, a placeholder or a column) from now, except that within the lease a
/// record whose expiry is still its claim's (`lease_until + retention`) keeps it. Then no
/// indexed column changes, so InnoDB writes no secondary index entry, and the record
/// lives up to one lease longer than `retention` past its settle (as in PostgreSQL).
/// Assigned first, while `lease_until_ms` is still the lease's.
fn settled_expiry(r: &str, retention: &str) -> String {
    format!(
        "IF({r}lease_until_ms >= {NOW_MS} AND {r}expires_at_ms = {r}lease_until_ms + {retention}, \
         {r}expires_at_ms, {NOW_MS} + {retention})"
    )
}

/// The condition of a live record: not past its retention on the server's clock.
fn live() -> String {
    format!("(expires_at_ms IS NULL OR expires_at_ms > {NOW_MS})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statements_bind_every_value() {
        let t = Tables::new(Some("`idem`".into()));
        assert_eq!(t.records, "`idem`.idem_records");
        let lock = t.lock(2);
        assert!(lock.ends_with("IN ((?, ?), (?, ?)) FOR UPDATE"), "{lock}");
        assert!(lock.contains("r FORCE INDEX (PRIMARY) ON"), "{lock}");
        assert_eq!(t.insert(3).matches('?').count(), 3 * COLUMNS.len());
        assert!(
            t.upsert(1)
                .contains("expires_at_ms = VALUES(expires_at_ms)")
        );
        assert!(!t.upsert(1).contains("id = VALUES(id)"));
        assert_eq!(Tables::new(None).offsets, "idem_offsets");
        assert_eq!(t.claim_fresh(3, true).matches('?').count(), 3 * 6);
        assert!(t.claim_fresh(1, false).contains("LAST_INSERT_ID(CAST("));
        assert!(!t.claim_fresh(1, false).contains("RETURNING"));
        assert_eq!(t.settle_one().matches('?').count(), 10);
        assert_eq!(t.settle_many(4).matches('?').count(), 4 * 9);
        let many = t.settle_many(1);
        let (expiry, state) = (
            many.find("expires_at_ms = IF").unwrap(),
            many.find("state = IF").unwrap(),
        );
        assert!(expiry < many.find("lease_until_ms = IF").unwrap() && expiry < state);
        assert!(many.ends_with("VALUES(state), state)"), "{many}");
    }
}
