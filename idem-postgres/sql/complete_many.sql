-- complete.sql for a batch of distinct keys, in one statement (PgBackend::complete_many).
-- Parameters are arrays, one element per lease: $1 namespace, $2 id,
-- $3 token, $4 owner, $5 response, $6 retention (ms). Returns the 1-based positions of the
-- leases it completed; a position missing from the answer was fenced.
WITH i AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::text[], $5::bytea[], $6::int8[])
        WITH ORDINALITY AS u (namespace, id, token, owner, response, retention_ms, n)
)
UPDATE {schema}.idem_records AS r
SET state = 'completed', response = i.response, lease_until = NULL, error = NULL,
    expires_at = {settled_expiry_batch}, updated_at = now()
FROM i
WHERE r.namespace = i.namespace AND r.id = i.id AND r.state = 'processing'
    AND r.token = i.token AND r.owner = i.owner
    AND (r.expires_at IS NULL OR r.expires_at > now())
RETURNING i.n
