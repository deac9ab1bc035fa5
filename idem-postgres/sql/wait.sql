-- A waiter on ($1, $2): settles of the key notify until $3 ms from now (see
-- migrations/0004_notify_only_waiters.sql). One row per key, whoever waits. The key's
-- record is marked watched, which the triggers test before anything else
-- (migrations/0006_settled_notify_watched_rows.sql).
WITH waiter AS (
    INSERT INTO {schema}.idem_waiters (namespace, id, until)
    VALUES ($1, $2, now() + $3 * interval '1 millisecond')
    ON CONFLICT (namespace, id) DO UPDATE
        SET until = greatest(idem_waiters.until, excluded.until)
    RETURNING namespace, id
)
UPDATE {schema}.idem_records AS r SET watched = true
FROM waiter w
WHERE r.namespace = w.namespace AND r.id = w.id AND NOT r.watched
