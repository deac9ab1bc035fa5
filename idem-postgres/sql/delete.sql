DELETE FROM {schema}.idem_records
WHERE namespace = $1 AND id = $2
RETURNING {live} AS live
