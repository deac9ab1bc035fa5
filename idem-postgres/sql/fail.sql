-- Fenced like complete.sql. Attempts were counted at the claim.
UPDATE {schema}.idem_records AS r
SET state = 'failed', error = $5, permanent = $6, lease_until = NULL,
    expires_at = {settled_expiry_7}, updated_at = now()
WHERE namespace = $1 AND id = $2 AND {holds}
