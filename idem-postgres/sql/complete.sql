-- Fenced: only the current holder (token and owner) of a live Processing record.
UPDATE {schema}.idem_records
SET state = 'completed', response = $5, lease_until = NULL, error = NULL,
    expires_at = now() + $6 * interval '1 millisecond', updated_at = now()
WHERE namespace = $1 AND id = $2 AND {holds}
