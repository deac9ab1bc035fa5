-- Waiter rows past their time (see wait.sql).
DELETE FROM {schema}.idem_waiters WHERE until <= now()
