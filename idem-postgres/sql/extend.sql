-- Fenced like complete.sql. The expiry moves with the lease, keeping its distance.
UPDATE {schema}.idem_records AS r
SET lease_until = now() + $5 * interval '1 millisecond',
    expires_at = now() + $5 * interval '1 millisecond'
                 + greatest(coalesce(expires_at - lease_until, interval '0'), interval '0'),
    updated_at = now()
WHERE namespace = $1 AND id = $2 AND {holds}
RETURNING ceil(extract(epoch FROM lease_until) * 1000)::int8 AS lease_until_ms
