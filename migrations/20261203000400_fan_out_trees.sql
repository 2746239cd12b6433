-- Trees of fan-outs are bounded (SPEC Z4). A branch's child run records the root of its tree
-- and its depth in it; the root counts the runs its tree started. A commit that would start
-- children deeper or more numerous than the bounds allow takes the fan-out's failure path
-- instead, judged under a lock on the root's row, so writers fanning out under one root at
-- once cannot pass the bound together.
--
-- root_run_id is NULL for a run that is its own root (every run enqueued): only branch
-- children are written here, so adding the columns rewrites no existing row but theirs.
ALTER TABLE rein_runs
    ADD COLUMN root_run_id uuid,
    ADD COLUMN depth integer NOT NULL DEFAULT 0 CHECK (depth >= 0),
    ADD COLUMN descendants bigint NOT NULL DEFAULT 0 CHECK (descendants >= 0);

-- Branch children already stored: walk up to the first run that is not a branch.
WITH RECURSIVE tree AS (
    SELECT c.run_id, p.run_id AS root, 1 AS depth
    FROM rein_runs c JOIN rein_runs p ON p.run_id = c.parent_run_id
    WHERE c.branch IS NOT NULL AND p.branch IS NULL
    UNION ALL
    SELECT c.run_id, t.root, t.depth + 1
    FROM rein_runs c JOIN tree t ON c.parent_run_id = t.run_id
    WHERE c.branch IS NOT NULL
)
UPDATE rein_runs r SET root_run_id = t.root, depth = t.depth
FROM tree t WHERE r.run_id = t.run_id;

UPDATE rein_runs r SET descendants = d.n
FROM (SELECT root_run_id, count(*) AS n FROM rein_runs
      WHERE root_run_id IS NOT NULL GROUP BY root_run_id) d
WHERE r.run_id = d.root_run_id;

-- Cancelling a run cancels its live descendants: found by walking down from it.
CREATE INDEX rein_runs_children ON rein_runs (parent_run_id) WHERE branch IS NOT NULL;
