SELECT {columns}
FROM {schema}.idem_records
WHERE {live}
  AND ($1::text IS NULL OR namespace = $1)
  AND ($2::text IS NULL OR state = $2)
ORDER BY namespace, id
LIMIT $3
