SELECT topic, partition, next_offset
FROM {schema}.idem_offsets
WHERE consumer_group = $1
ORDER BY topic, partition
