-- claim_fresh.sql for a batch of distinct keys: every key that does not exist yet is
-- inserted as a first claim, and only those come back, each with its new lease's deadline
-- by the database clock (token 1, attempt 1). Parameters as claim.sql's batch input, one
-- array element per claim: $1 namespace, $2 id, $3 owner, $4 lease ttl (ms), $5
-- fingerprint (bytea or null), $6 max attempts, $7 retention (ms). The keys that did not
-- come back existed: claim.sql then claims them (PgBackend::claim_with). A fresh key costs
-- this insert alone, and its answer two narrow columns instead of a whole record
-- (docs/performance.md, "a fresh key's claim").
INSERT INTO {schema}.idem_records AS r
    (namespace, id, state, owner, token, attempts, max_attempts, claim_kind, lease_until,
     fingerprint, response, error, permanent, expires_at, updated_at)
SELECT namespace, id, 'processing', owner, 1, 1, greatest(max_attempts, 1), 'first',
       now() + ttl_ms * interval '1 millisecond', fingerprint, NULL, NULL, false,
       now() + (ttl_ms + retention_ms) * interval '1 millisecond', now()
FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::bytea[], $6::int4[],
            $7::int8[]) AS u (namespace, id, owner, ttl_ms, fingerprint, max_attempts,
                              retention_ms)
ON CONFLICT (namespace, id) DO NOTHING
RETURNING namespace, id, ceil(extract(epoch FROM lease_until) * 1000)::int8 AS lease_until_ms{commit_mode}
