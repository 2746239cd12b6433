-- Wall-time budgets: when a run's budget of wall time runs out, by the database clock
-- (created_at + the definition's budget.wall_time_ms). Cleared when the run ends or the
-- scheduler has delivered the budget event.
ALTER TABLE rein_runs ADD COLUMN deadline_at timestamptz;
CREATE INDEX rein_runs_deadlines ON rein_runs (deadline_at) WHERE deadline_at IS NOT NULL;

-- A branch's child run (SPEC P1): {"name", "fan_out", "succeed_on": [...]} of the parent's
-- fan-out (the parent is parent_run_id). When the child ends, the same commit delivers
-- BRANCH_SUCCEEDED or BRANCH_FAILED to the parent's inbox.
ALTER TABLE rein_runs ADD COLUMN branch jsonb;

-- The commit that enters a fan-out state creates the branches' child runs, so a worker (or
-- the scheduler) may insert runs.
GRANT INSERT ON rein_runs TO rein_runtime;
