SELECT {columns}
FROM {schema}.idem_records
WHERE namespace = $1 AND id = $2 AND {live}
