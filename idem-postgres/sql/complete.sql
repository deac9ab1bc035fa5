-- Fenced: only the current holder (token and owner) of a live Processing record.
-- Within the lease the claim's expiry (lease_until + retention) is kept, so no indexed
-- column changes and the update can be HOT; see settled_expiry in src/sql.rs.
UPDATE {schema}.idem_records AS r
SET state = 'completed', response = $5, lease_until = NULL, error = NULL,
    expires_at = {settled_expiry_6}, updated_at = now()
WHERE namespace = $1 AND id = $2 AND {holds}
