-- The record of one key and the database clock, read without a lock, for a claim whose
-- insert (claim_fresh.sql) found the key: a duplicate (completed), a live lease, a
-- poisoned key or another payload is answered from it by idem_core::machine, with no
-- write. Only a key the claim could take (failed and retryable, a lapsed lease, past its
-- retention) goes on to claim.sql, which checks again under the row lock.
SELECT {columns}, floor(extract(epoch FROM now()) * 1000)::int8 AS now_ms
FROM {schema}.idem_records
WHERE namespace = $1 AND id = $2
