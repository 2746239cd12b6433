-- When the current action's first try began, by the database clock (SPEC R1): a retry
-- policy's `deadline_ms` counts from here. The commit that starts a first try (the run left
-- runnable at attempt 0 in a new state, a new step, or after retries) sets it. Runs created
-- before this column existed keep NULL and count from their creation. The default is set
-- after the column is added, so existing rows are not rewritten.
ALTER TABLE rein_runs ADD COLUMN first_try_at timestamptz;
ALTER TABLE rein_runs ALTER COLUMN first_try_at SET DEFAULT clock_timestamp();
