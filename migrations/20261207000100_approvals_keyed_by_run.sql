-- Approval requests are keyed by their run first, like every other per-run table, so the
-- schema distributes by run_id with co-located tables (docs/SCALING.md): the commit that
-- uses a grant finds it beside its run. The old key stays unique as an index of its own
-- (an approval is still looked up by id alone), and the index on run_id alone is covered by
-- the new key. Binaries of the release before keep working: no statement names either index,
-- and what they relied on (one request per id) still holds.
ALTER TABLE rein_approvals DROP CONSTRAINT rein_approvals_pkey;
ALTER TABLE rein_approvals ADD PRIMARY KEY (run_id, approval_id);
CREATE UNIQUE INDEX rein_approvals_id ON rein_approvals (approval_id);
DROP INDEX rein_approvals_run;
