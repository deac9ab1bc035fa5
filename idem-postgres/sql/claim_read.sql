-- The record of one key and the database clock, read without a lock, for a claim whose
-- insert (claim_fresh.sql) found the key: a duplicate (completed), a live lease, a
-- poisoned key or another payload is answered from it by idem_core::machine, with no
-- write. Only a key the claim could take (failed and retryable, a lapsed lease, past its
-- retention) goes on to claim.sql, which checks again under the row lock.
-- The clock is rounded up, as the record's times are: a lease the client then sees live
-- (ceil(lease_until) > ceil(now)) is live to the database too, and one released or lapsed
-- within the same millisecond is not mistaken for live (rounded down, a claim right after
-- a release answered InProgress). A lease the client sees lapsed goes on to claim.sql,
-- where the database decides.
SELECT {columns}, ceil(extract(epoch FROM now()) * 1000)::int8 AS now_ms
FROM {schema}.idem_records
WHERE namespace = $1 AND id = $2
