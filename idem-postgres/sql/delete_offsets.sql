DELETE FROM {schema}.idem_offsets
WHERE consumer_group = $1
  AND ($2::text IS NULL OR topic = $2)
  AND ($3::int IS NULL OR partition = $3)
