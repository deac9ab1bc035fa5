-- Transactional mode: complete.sql and store_offset.sql in one statement, inside the
-- caller's transaction. The offset is stored only if the fenced update matched. Parameters:
-- $1-$4 the lease, $5 response, $6 retention (ms), $7 group, $8 topic, $9 partition,
-- $10 next offset (null: no offset to store).
WITH done AS (
    UPDATE {schema}.idem_records AS r
    SET state = 'completed', response = $5, lease_until = NULL, error = NULL,
        expires_at = {settled_expiry_6}, updated_at = now()
    WHERE namespace = $1 AND id = $2 AND {holds}
    RETURNING 1
),
moved AS (
    INSERT INTO {schema}.idem_offsets (consumer_group, topic, partition, next_offset, updated_at)
    SELECT $7, $8, $9, $10, now()
    WHERE $10::int8 IS NOT NULL AND EXISTS (SELECT 1 FROM done)
    ON CONFLICT (consumer_group, topic, partition)
    DO UPDATE SET next_offset = excluded.next_offset, updated_at = now()
    RETURNING 1
)
SELECT (SELECT count(*) FROM done) AS completed
