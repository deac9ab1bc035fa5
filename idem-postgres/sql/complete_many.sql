-- settle_many.sql for a round in which every item completes (PgBackend::settle_many), the
-- common case: five arrays instead of nine and no per-row choice of action. Parameters are
-- arrays, one element per lease: $1 namespace, $2 id, $3 token, $4 owner, $5 response;
-- then $6 retention (ms). Returns the 1-based positions of the leases it settled; a
-- position missing from the answer was fenced. The fencing rule and the expiry kept
-- within the lease are complete.sql's (see settle_many.sql on `{holds_batch}`).
WITH i AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::text[], $5::bytea[])
        WITH ORDINALITY AS u (namespace, id, token, owner, response, n)
)
UPDATE {schema}.idem_records AS r
SET state = 'completed', response = i.response, lease_until = NULL, error = NULL,
    expires_at = {settled_expiry_6}, updated_at = now()
FROM i
WHERE r.namespace = i.namespace AND r.id = i.id AND {holds_batch}
RETURNING i.n
