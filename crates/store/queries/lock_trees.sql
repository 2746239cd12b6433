-- Before a commit that starts children (SPEC Z4): locks the committing runs $1 and the roots
-- of the fanning runs $2 in run_id order (the order commit.sql locks runs in), and reads
-- where each sits in its tree. A root's `descendants` is then stable until the transaction
-- ends, so fan-outs under one root are judged one after the other.
WITH ids AS (
    SELECT unnest($1::uuid[]) AS run_id
    UNION
    SELECT COALESCE(root_run_id, run_id) FROM rein_runs WHERE run_id = ANY($2::uuid[])
)
SELECT r.run_id, r.root_run_id, r.depth, r.descendants
FROM rein_runs r
WHERE r.run_id IN (SELECT run_id FROM ids)
ORDER BY r.run_id
FOR UPDATE
