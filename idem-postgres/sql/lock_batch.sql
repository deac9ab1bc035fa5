-- Batch transactional mode, first statement of the transaction: locks the records its
-- leases still hold (token, owner, Processing, not expired), in key order, until the
-- transaction ends, so nobody can take them over before COMMIT. Parameters are arrays,
-- one element per lease: $1 namespace, $2 id, $3 token, $4 owner. Returns the 1-based
-- positions of the leases still held; a lease missing from the answer is fenced. The
-- expiry test matches no index, so the cached plan finds the rows by their primary key
-- (see settle_many.sql).
SELECT u.n
FROM unnest($1::text[], $2::text[], $3::int8[], $4::text[])
    WITH ORDINALITY AS u (namespace, id, token, owner, n)
JOIN {schema}.idem_records r ON r.namespace = u.namespace AND r.id = u.id
WHERE r.state = 'processing' AND r.token = u.token AND r.owner = u.owner
    AND coalesce(r.expires_at > now(), true)
ORDER BY r.namespace, r.id
FOR UPDATE OF r
