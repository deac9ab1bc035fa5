-- Wakes engines waiting on a key (PgBackend::watch): a settle of a record in flight
-- (complete, fail, release, or a claim that turns a lapsed lease failed) and the delete of
-- one notify the channel `idem_settled` with
-- `<schema length>:<schema>:<namespace length>:<namespace>:<id>` (lengths in bytes).
-- PostgreSQL delivers it when the transaction commits, and only then. Claims and extends,
-- which leave a key in flight, notify nothing.
CREATE OR REPLACE FUNCTION idem_records_settled() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    IF TG_OP = 'DELETE' THEN r := OLD; ELSE r := NEW; END IF;
    PERFORM pg_notify('idem_settled', format('%s:%s:%s:%s:%s',
        octet_length(TG_TABLE_SCHEMA), TG_TABLE_SCHEMA,
        octet_length(r.namespace), r.namespace, r.id));
    RETURN NULL;
END
$$;

CREATE TRIGGER idem_records_settled AFTER UPDATE ON idem_records FOR EACH ROW
    WHEN (OLD.state = 'processing'
          AND (NEW.state <> 'processing' OR NEW.attempts < OLD.attempts))
    EXECUTE FUNCTION idem_records_settled();

CREATE TRIGGER idem_records_deleted AFTER DELETE ON idem_records FOR EACH ROW
    WHEN (OLD.state = 'processing')
    EXECUTE FUNCTION idem_records_settled();
