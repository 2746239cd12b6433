-- Every step rewrites its run's row. Free space on each page lets PostgreSQL update the row
-- in place (a HOT update, no index writes) instead of moving it: `rein bench` measured about
-- 1.6x the committed events/s with this on 2 cores.
ALTER TABLE rein_runs SET (fillfactor = 70);
