-- Batch transactional mode: settle_many.sql stores the group's next offset for the
-- partition as well, whatever it settled. Parameters: $10 group, $11 topic, $12 partition,
-- $13 next offset (null: no offset to store).
, moved AS (
    INSERT INTO {schema}.idem_offsets (consumer_group, topic, partition, next_offset, updated_at)
    SELECT $10::text, $11::text, $12::int4, $13::int8, now()
    WHERE $13::int8 IS NOT NULL
    ON CONFLICT (consumer_group, topic, partition)
    DO UPDATE SET next_offset = excluded.next_offset, updated_at = now()
)
