INSERT INTO {schema}.idem_offsets (consumer_group, topic, partition, next_offset, updated_at)
VALUES ($1, $2, $3, $4, now())
ON CONFLICT (consumer_group, topic, partition)
DO UPDATE SET next_offset = excluded.next_offset, updated_at = now()
