-- complete.sql, fail.sql and release.sql for a batch of distinct keys, in one statement
-- (PgBackend::settle_many). Parameters are arrays, one element per lease: $1 namespace,
-- $2 id, $3 token, $4 owner, $5 action ('complete', 'fail' or 'release'), $6 response
-- (complete), $7 error (fail), $8 permanent (fail), $9 retention (ms). Returns the 1-based
-- positions of the leases it settled; a position missing from the answer was fenced.
-- In batch transactional mode batch_offset.sql follows `done`: it stores an offset too.
--
-- The fencing rule `{holds_batch}` (`holds` in src/sql.rs) tests expiry so that no index
-- matches it: the keys' primary key is then the only index this join can use. idem's connections force one generic plan per statement with sequential scans off
-- (`PLANNING` in src/backend.rs), made at the first run, while the table may be small; a
-- plan made then once read every live record through `idem_records_expires_at` and joined
-- the keys to them, and kept doing so as the table grew
-- (tests/storage.rs, `batch_settles_find_rows_by_index_after_the_table_grows_under_cached_plans`).
WITH i AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::text[], $5::text[],
                         $6::bytea[], $7::text[], $8::bool[], $9::int8[])
        WITH ORDINALITY AS u (namespace, id, token, owner, action, response, error, permanent,
                              retention_ms, n)
),
done AS (
UPDATE {schema}.idem_records AS r
SET state = CASE i.action WHEN 'complete' THEN 'completed' WHEN 'fail' THEN 'failed'
                          ELSE r.state END,
    response = CASE WHEN i.action = 'complete' THEN i.response ELSE r.response END,
    lease_until = CASE WHEN i.action = 'release' THEN now() END,
    error = CASE i.action WHEN 'complete' THEN NULL WHEN 'fail' THEN i.error ELSE r.error END,
    permanent = CASE WHEN i.action = 'fail' THEN i.permanent ELSE r.permanent END,
    attempts = CASE WHEN i.action = 'release' THEN r.attempts - 1
                    ELSE r.attempts END,
    expires_at = CASE WHEN i.action = 'release'
        THEN now() + greatest(coalesce(r.expires_at - r.lease_until, interval '0'), interval '0')
        ELSE {settled_expiry_batch} END,
    updated_at = now()
FROM i
WHERE r.namespace = i.namespace AND r.id = i.id AND {holds_batch}
    AND (i.action <> 'release' OR (r.lease_until > now() AND r.attempts > 0))
RETURNING i.n
){offset}
SELECT n FROM done
