-- A claim of one key, for the case that it does not exist yet: claim.sql's `fresh` insert,
-- alone. Parameters as claim.sql's single claim: $1 namespace, $2 id, $3 owner, $4 lease
-- ttl (ms), $5 fingerprint (bytea or null), $6 max attempts, $7 retention (ms). Returns
-- the new lease's deadline by the database clock (token 1, attempt 1, a first claim), or
-- no row when the key exists: the caller then reads it (claim_read.sql), and runs
-- claim.sql only if the claim could take it. For one key claim.sql costs about twice this
-- insert on the server even when the key is new (its other parts start up empty); the
-- insert of an existing key writes nothing (docs/performance.md, "a fresh key's claim").
INSERT INTO {schema}.idem_records AS r
    (namespace, id, state, owner, token, attempts, max_attempts, claim_kind, lease_until,
     fingerprint, response, error, permanent, expires_at, updated_at)
VALUES ($1::text, $2::text, 'processing', $3::text, 1, 1, greatest($6::int4, 1), 'first',
        now() + $4::int8 * interval '1 millisecond', $5::bytea, NULL, NULL, false,
        now() + ($4::int8 + $7::int8) * interval '1 millisecond', now())
ON CONFLICT (namespace, id) DO NOTHING
RETURNING ceil(extract(epoch FROM lease_until) * 1000)::int8 AS lease_until_ms{commit_mode}
