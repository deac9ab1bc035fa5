-- Batch transactional mode, first statement of the transaction: locks the records its
-- leases still hold (token, owner, Processing, not expired), in key order, until the
-- transaction ends, so nobody can take them over before COMMIT. Parameters are arrays,
-- one element per lease: $1 namespace, $2 id, $3 token, $4 owner. Returns the 1-based
-- positions of the leases still held; a lease missing from the answer is fenced. The
-- fencing rule is settle_many.sql's (`holds` in src/sql.rs), so the cached plan finds the
-- rows by their primary key.
SELECT i.n
FROM unnest($1::text[], $2::text[], $3::int8[], $4::text[])
    WITH ORDINALITY AS i (namespace, id, token, owner, n)
JOIN {schema}.idem_records r ON r.namespace = i.namespace AND r.id = i.id
WHERE {holds_batch}
ORDER BY r.namespace, r.id
FOR UPDATE OF r
