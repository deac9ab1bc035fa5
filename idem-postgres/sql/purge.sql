-- One bounded batch: a short transaction that never holds many locks.
DELETE FROM {schema}.idem_records
WHERE ctid IN (
    SELECT ctid FROM {schema}.idem_records
    WHERE expires_at <= now()
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
