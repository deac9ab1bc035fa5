-- Claims a batch of distinct keys in one statement. Parameters, one element per claim as
-- arrays (or scalars for a single claim, see INPUT_ONE in src/sql.rs): $1 namespace, $2 id,
-- $3 owner, $4 lease ttl (ms), $5 fingerprint (bytea or null), $6 max attempts, $7 retention
-- (ms). The database clock now() decides; it is fixed for the
-- whole statement, so every condition below sees the same instant.
--
-- `fresh` first inserts every key with ON CONFLICT DO NOTHING: a key that does not exist
-- costs that insert and nothing else, since everything after it is driven by `rest`, the
-- keys that conflicted, which is then empty.
--
-- For the rest, `current` reads the keys without locking. A key that exists and is not
-- claimable (a duplicate, a live lease, a poisoned key, another payload) is answered from
-- that read: no row lock, no write, nothing to flush at commit. Only claimable keys (or
-- keys gone since `fresh` saw them) reach the INSERT … ON CONFLICT … DO UPDATE, which
-- checks claimability again under the row lock.
-- Written rows come back with written = true (a lapsed lease with no attempts left turns
-- failed, claim_kind 'poisoned'); the others with written = false, and the client answers
-- from them with idem_core::machine, using now_ms, rounded up as the record's times are
-- (claim_read.sql says why: rounded down, a repeat of a key released within the same
-- millisecond answered InProgress). A key that conflicted in `fresh` but is
-- not in this statement's snapshot (a concurrent first insert that committed meanwhile)
-- comes back not at all: the client asks again.
WITH input AS (
    {input}
),
fresh AS (
    INSERT INTO {schema}.idem_records AS r
        (namespace, id, state, owner, token, attempts, max_attempts, claim_kind, lease_until,
         fingerprint, response, error, permanent, expires_at, updated_at)
    SELECT namespace, id, 'processing', owner, 1, 1, max_attempts, 'first',
           now() + ttl_ms * interval '1 millisecond', fingerprint, NULL, NULL, false,
           now() + (ttl_ms + retention_ms) * interval '1 millisecond', now()
    FROM input i
    ON CONFLICT (namespace, id) DO NOTHING
    RETURNING r.*
),
rest AS (
    SELECT i.* FROM input i
    WHERE NOT EXISTS (SELECT 1 FROM fresh f WHERE f.namespace = i.namespace AND f.id = i.id)
),
current AS (
    SELECT c.*
    FROM rest i
    CROSS JOIN LATERAL (
        SELECT * FROM {schema}.idem_records r WHERE r.namespace = i.namespace AND r.id = i.id
    ) c
),
claimed AS (
    INSERT INTO {schema}.idem_records AS r
        (namespace, id, state, owner, token, attempts, max_attempts, claim_kind, lease_until,
         fingerprint, response, error, permanent, expires_at, updated_at)
    SELECT namespace, id, 'processing', owner, 1, 1, max_attempts, 'first',
           now() + ttl_ms * interval '1 millisecond', fingerprint, NULL, NULL, false,
           now() + (ttl_ms + retention_ms) * interval '1 millisecond', now()
    FROM rest i
    WHERE NOT EXISTS (
        SELECT 1 FROM current c
        WHERE c.namespace = i.namespace AND c.id = i.id AND NOT {claimable_current}
    )
    ON CONFLICT (namespace, id) DO UPDATE SET
        state = CASE WHEN {poison} THEN 'failed' ELSE 'processing' END,
        owner = CASE WHEN {poison} THEN r.owner ELSE excluded.owner END,
        token = CASE WHEN {expired_r} THEN 1 WHEN {poison} THEN r.token ELSE r.token + 1 END,
        attempts = CASE WHEN {expired_r} THEN 1 WHEN {poison} THEN r.attempts
                        ELSE r.attempts + 1 END,
        max_attempts = excluded.max_attempts,
        claim_kind = CASE WHEN {expired_r} THEN 'first' WHEN {poison} THEN 'poisoned'
                          WHEN r.state = 'failed' THEN 'retry' ELSE 'takeover' END,
        lease_until = CASE WHEN {poison} THEN NULL ELSE excluded.lease_until END,
        fingerprint = CASE WHEN {expired_r} THEN excluded.fingerprint ELSE r.fingerprint END,
        response = NULL,
        error = CASE WHEN {poison} THEN 'lease lapsed during attempt ' || r.attempts END,
        permanent = false,
        expires_at = CASE WHEN {poison} THEN now() + (excluded.expires_at - excluded.lease_until)
                          ELSE excluded.expires_at END,
        updated_at = now()
    WHERE {claimable_existing}
    RETURNING r.*
),
answer AS (
    SELECT true AS written, f.* FROM fresh f
    UNION ALL
    SELECT true AS written, d.* FROM claimed d
    UNION ALL
    SELECT false AS written, c.* FROM current c
    WHERE NOT EXISTS (SELECT 1 FROM claimed d WHERE d.namespace = c.namespace AND d.id = c.id)
)
SELECT written, {columns},
       ceil(extract(epoch FROM now()) * 1000)::int8 AS now_ms
FROM answer {commit_mode}
