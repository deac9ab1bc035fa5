-- Notify only keys someone waits on. A transaction that runs pg_notify takes a database-wide
-- lock from its pre-commit until its commit has flushed, so every notifying commit waits
-- for the one before it: with 16 concurrent completes, claim+complete ran 4 to 5 times
-- slower with the 0003 triggers than without (pgbench, this machine). Now PgBackend::watch
-- records its key in `idem_waiters` (unlogged: no WAL, no flush; a crash empties it, which
-- costs waiters one poll), and the trigger notifies only a key with a live waiter row.
-- A settle whose trigger ran just before a waiter's row committed is not notified: that
-- waiter reads again at its next poll, as after any lost notification.
CREATE UNLOGGED TABLE idem_waiters (
    namespace text NOT NULL,
    id text NOT NULL,
    until timestamptz NOT NULL,
    PRIMARY KEY (namespace, id)
);

CREATE OR REPLACE FUNCTION idem_records_settled() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    r record;
BEGIN
    IF TG_OP = 'DELETE' THEN r := OLD; ELSE r := NEW; END IF;
    IF EXISTS (SELECT 1 FROM idem_waiters w
               WHERE w.namespace = r.namespace AND w.id = r.id AND w.until > now()) THEN
        PERFORM pg_notify('idem_settled', format('%s:%s:%s:%s:%s',
            octet_length(TG_TABLE_SCHEMA), TG_TABLE_SCHEMA,
            octet_length(r.namespace), r.namespace, r.id));
    END IF;
    RETURN NULL;
END
$$;
