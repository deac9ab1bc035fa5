-- A waiter on ($1, $2): settles of the key notify until $3 ms from now (see
-- migrations/0004_notify_only_waiters.sql). One row per key, whoever waits.
INSERT INTO {schema}.idem_waiters (namespace, id, until)
VALUES ($1, $2, now() + $3 * interval '1 millisecond')
ON CONFLICT (namespace, id) DO UPDATE SET until = greatest(idem_waiters.until, excluded.until)
