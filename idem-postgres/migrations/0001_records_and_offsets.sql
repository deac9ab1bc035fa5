-- One record per idempotency key. Runs inside the configured schema (search_path).
CREATE TABLE IF NOT EXISTS idem_records (
    namespace    text        NOT NULL,
    id           text        NOT NULL,
    state        text        NOT NULL,
    owner        text        NOT NULL,
    token        bigint      NOT NULL,
    attempts     integer     NOT NULL,
    max_attempts integer     NOT NULL,
    -- How the last claim was granted: first, retry, takeover; or poisoned when a claim found
    -- a lapsed lease with no attempts left.
    claim_kind   text        NOT NULL,
    lease_until  timestamptz,
    fingerprint  bytea,
    response     bytea,
    error        text,
    permanent    boolean     NOT NULL DEFAULT false,
    expires_at   timestamptz,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, id)
);

-- purge_expired deletes in bounded batches by this index.
CREATE INDEX IF NOT EXISTS idem_records_expires_at ON idem_records (expires_at);

-- Transactional mode: the next offset to read, per consumer group and partition, committed
-- in the same transaction as the handler's writes and the Completed record.
CREATE TABLE IF NOT EXISTS idem_offsets (
    consumer_group text        NOT NULL,
    topic          text        NOT NULL,
    partition      integer     NOT NULL,
    next_offset    bigint      NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, topic, partition)
);
