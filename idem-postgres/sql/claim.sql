-- Claims a batch of distinct keys in one statement. Parameters are arrays, one element per
-- claim: $1 namespace, $2 id, $3 owner, $4 lease ttl (ms), $5 fingerprint (bytea or null),
-- $6 max attempts, $7 retention (ms). The database clock now() decides; it is fixed for the
-- whole statement, so every condition below sees the same instant.
--
-- A claimable key (absent, expired, failed with attempts left, lapsed lease) is written and
-- returned with written = true; so is a lapsed lease with no attempts left, which turns
-- failed (claim_kind 'poisoned'). Any other key is returned as it stands, written = false,
-- and the client answers from it with idem_core::machine, using now_ms.
WITH input AS (
    SELECT *
    FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::bytea[], $6::int4[], $7::int8[])
        AS i (namespace, id, owner, ttl_ms, fingerprint, max_attempts, retention_ms)
),
claimed AS (
    INSERT INTO {schema}.idem_records AS r
        (namespace, id, state, owner, token, attempts, max_attempts, claim_kind, lease_until,
         fingerprint, response, error, permanent, expires_at, updated_at)
    SELECT namespace, id, 'processing', owner, 1, 1, greatest(max_attempts, 1), 'first',
           now() + ttl_ms * interval '1 millisecond', fingerprint, NULL, NULL, false,
           now() + (ttl_ms + retention_ms) * interval '1 millisecond', now()
    FROM input
    ON CONFLICT (namespace, id) DO UPDATE SET
        state = CASE WHEN {poison} THEN 'failed' ELSE 'processing' END,
        owner = CASE WHEN {poison} THEN r.owner ELSE excluded.owner END,
        token = CASE WHEN {expired} THEN 1 WHEN {poison} THEN r.token ELSE r.token + 1 END,
        attempts = CASE WHEN {expired} THEN 1 WHEN {poison} THEN r.attempts
                        ELSE r.attempts + 1 END,
        max_attempts = excluded.max_attempts,
        claim_kind = CASE WHEN {expired} THEN 'first' WHEN {poison} THEN 'poisoned'
                          WHEN r.state = 'failed' THEN 'retry' ELSE 'takeover' END,
        lease_until = CASE WHEN {poison} THEN NULL ELSE excluded.lease_until END,
        fingerprint = CASE WHEN {expired} THEN excluded.fingerprint ELSE r.fingerprint END,
        response = NULL,
        error = CASE WHEN {poison} THEN 'lease lapsed during attempt ' || r.attempts END,
        permanent = false,
        expires_at = CASE WHEN {poison} THEN now() + (excluded.expires_at - excluded.lease_until)
                          ELSE excluded.expires_at END,
        updated_at = now()
    WHERE {expired}
       OR ((r.fingerprint IS NULL OR excluded.fingerprint IS NULL
            OR r.fingerprint = excluded.fingerprint)
           AND ((r.state = 'failed' AND NOT r.permanent AND r.attempts < excluded.max_attempts)
                OR {lapsed}))
    RETURNING r.*
),
answer AS (
    SELECT true AS written, c.* FROM claimed c
    UNION ALL
    SELECT false AS written, r.*
    FROM {schema}.idem_records r
    JOIN input i ON i.namespace = r.namespace AND i.id = r.id
    WHERE NOT EXISTS (SELECT 1 FROM claimed c WHERE c.namespace = r.namespace AND c.id = r.id)
)
SELECT written, {columns},
       floor(extract(epoch FROM now()) * 1000)::int8 AS now_ms
FROM answer
