-- Call the notify function only for records someone watches, decided per row without a
-- function call. 0005's statement trigger spared a batch settle a function call per row,
-- but it ran once for every UPDATE statement, claims included (INSERT … ON CONFLICT DO
-- UPDATE fires it even when it updates nothing), so a claim and a complete of one key
-- each paid a function call, a transition table and a join. Measured on this machine with
-- pgbench (16 clients, a record insert then idem's complete, statement pairs per second;
-- raw single inserts 8.9k-9.0k/s in the same runs): statement trigger 3.0k, row trigger
-- 2.7k-3.2k, no trigger 3.3k-3.9k.
--
-- A watch now marks the key's record (`watched`, set by sql/wait.sql with its waiter row),
-- a claim that creates a record marks it when a waiter row exists already (an engine
-- watches before its first claim, so the waiter may come first), and the triggers' WHEN
-- clauses, which PostgreSQL evaluates without calling a function, test the mark first: a
-- record nobody watched costs its settle nothing. The function then checks for a live
-- waiter row as before (0004). A watch and the first insert of its key racing (neither
-- sees the other's uncommitted row) leave the record unmarked: that waiter misses the
-- notification and reads again at its next poll, as after any lost notification.
ALTER TABLE idem_records ADD COLUMN IF NOT EXISTS watched boolean NOT NULL DEFAULT false;

DROP TRIGGER idem_records_settled ON idem_records;
DROP FUNCTION idem_records_settled_rows();

CREATE TRIGGER idem_records_settled AFTER UPDATE ON idem_records FOR EACH ROW
    WHEN (NEW.watched AND OLD.state = 'processing'
          AND (NEW.state <> 'processing' OR NEW.attempts < OLD.attempts))
    EXECUTE FUNCTION idem_records_settled();

DROP TRIGGER idem_records_deleted ON idem_records;

CREATE TRIGGER idem_records_deleted AFTER DELETE ON idem_records FOR EACH ROW
    WHEN (OLD.watched AND OLD.state = 'processing')
    EXECUTE FUNCTION idem_records_settled();
