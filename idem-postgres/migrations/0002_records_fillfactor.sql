-- Leave room on each page so that settling a record (complete, fail), which changes no
-- indexed column, can be a HOT update: the new row version goes on the same page and no
-- index is written. Applies to pages written from now on.
ALTER TABLE idem_records SET (fillfactor = 80);
