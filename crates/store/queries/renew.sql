-- Extends the leases a worker still holds. A lease that already expired is not revived: its
-- run may have been recovered, so the holder must stop (SPEC X4). Rows are locked in run_id
-- order, as commits lock them, so a renewal and a commit batch never deadlock.
WITH locked AS (
    SELECT run_id FROM rein_runs
    WHERE run_id = ANY($1::uuid[])
    ORDER BY run_id
    FOR UPDATE
)
UPDATE rein_runs r SET lease_until = clock_timestamp() + $3 * interval '1 millisecond'
FROM unnest($1::uuid[], $2::bigint[]) AS h(run_id, token)
WHERE r.run_id = h.run_id
  AND r.run_id IN (SELECT run_id FROM locked)
  AND r.fencing_token = h.token
  AND r.lease_owner = $4
  AND r.lease_until > clock_timestamp()
RETURNING r.run_id,
          EXISTS (SELECT 1 FROM rein_inbox b WHERE b.run_id = r.run_id) AS inbox_pending,
          EXISTS (SELECT 1 FROM rein_inbox b WHERE b.run_id = r.run_id AND b.type = 'CANCEL') AS cancel_pending
