-- After a commit started children under parents $1 ($2 each, in the same transaction as
-- lock_trees.sql): their roots count them. Never decremented: the bound is on the runs a
-- tree starts over its life.
UPDATE rein_runs r SET descendants = r.descendants + s.n
FROM (
    SELECT COALESCE(p.root_run_id, p.run_id) AS root, sum(x.n)::bigint AS n
    FROM unnest($1::uuid[], $2::bigint[]) AS x(parent, n)
    JOIN rein_runs p ON p.run_id = x.parent
    GROUP BY 1
) s
WHERE r.run_id = s.root
