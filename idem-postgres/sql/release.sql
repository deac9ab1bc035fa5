-- Hands back a live lease (idem_core::machine::release): fenced like complete.sql, the
-- lease must not have lapsed, and an attempt must be left to give back (an extend after a
-- release revives the lease, not the attempt). The attempt is taken back, the lease lapses
-- now, the expiry keeps its distance from the lease deadline; the token stays.
UPDATE {schema}.idem_records AS r
SET attempts = attempts - 1, lease_until = now(),
    expires_at = now() + greatest(coalesce(expires_at - lease_until, interval '0'), interval '0'),
    updated_at = now()
WHERE namespace = $1 AND id = $2 AND {holds} AND lease_until > now() AND attempts > 0
