-- The scheduler's scans reach every due row (SPEC S1-S3). A row the scheduler looked at and
-- could not move (a timer into a false guard, inbox entries the run's state cannot take
-- yet, a run whose definition cannot be loaded) gets a next look: later with each look in a
-- row that could not move it, within a bound. Until then no scan returns it, so such rows
-- never hold the head of a scan. Any commit to the run clears both (commit.sql): the run
-- changed, so it is looked at again at once. Kept by the database clock, so every
-- scheduler sees the same next looks.
ALTER TABLE rein_runs
    -- No scan (timers, lease recovery, wall-time budgets) returns the run before this.
    ADD COLUMN scan_after timestamptz,
    -- Looks in a row, since the run's last commit, that could not move it.
    ADD COLUMN scan_misses integer NOT NULL DEFAULT 0 CHECK (scan_misses >= 0);

-- Each scan walks its index in the order rows become due to it: the later of when the row
-- is due and its next look. A row pushed ahead sits past the range of due keys.
DROP INDEX rein_runs_timers;
CREATE INDEX rein_runs_timers ON rein_runs ((greatest(wake_at, scan_after)))
    WHERE wake_at IS NOT NULL AND lease_owner IS NULL;
DROP INDEX rein_runs_leases;
CREATE INDEX rein_runs_leases ON rein_runs ((greatest(lease_until, scan_after)))
    WHERE lease_owner IS NOT NULL;
DROP INDEX rein_runs_deadlines;
CREATE INDEX rein_runs_deadlines ON rein_runs ((greatest(deadline_at, scan_after)))
    WHERE deadline_at IS NOT NULL;

-- Inbox entries have their own next look: an entry is due when it arrives, when a commit
-- leaves its run without a lease, when its run's lease ends, or when it expires.
ALTER TABLE rein_inbox
    ADD COLUMN scan_after timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN scan_misses integer NOT NULL DEFAULT 0 CHECK (scan_misses >= 0);
CREATE INDEX rein_inbox_due ON rein_inbox (scan_after);

-- Schedulers push next looks and every commit clears them; an entry's content stays as sent.
GRANT UPDATE (scan_after, scan_misses) ON rein_inbox TO rein_runtime, rein_api_access;
