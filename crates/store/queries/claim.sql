-- Takes up to $2 runnable, unleased runs (SPEC X1): never double-claims (SKIP LOCKED), bumps
-- each run's fencing token, and records the grant. Lease expiry is by the database clock.
WITH picked AS (
    SELECT run_id
    FROM rein_runs
    WHERE status = 'runnable' AND lease_owner IS NULL AND queue = ANY($3::text[])
      -- Not before a fleet-wide limit allows it (ACTION_DEFERRED sets ready_at ahead).
      AND ready_at <= clock_timestamp()
    ORDER BY queue, priority DESC, ready_at
    LIMIT $2
    FOR UPDATE SKIP LOCKED
),
upd AS (
    UPDATE rein_runs r SET
        lease_owner = $1,
        lease_until = clock_timestamp() + $4 * interval '1 millisecond',
        fencing_token = r.fencing_token + 1,
        updated_at = clock_timestamp()
    FROM picked
    WHERE r.run_id = picked.run_id
    RETURNING r.run_id, r.definition, r.version, r.projection, r.last_sequence, r.fencing_token,
              r.lease_until, r.ready_at
),
grants AS (
    INSERT INTO rein_lease_grants (run_id, fencing_token, worker, at_sequence)
    SELECT run_id, fencing_token, $1, last_sequence FROM upd
)
SELECT upd.run_id, upd.definition, upd.version, upd.projection, upd.last_sequence,
       upd.fencing_token, upd.lease_until,
       (extract(epoch FROM clock_timestamp() - upd.ready_at) * 1000)::float8 AS queued_ms,
       EXISTS (SELECT 1 FROM rein_inbox b WHERE b.run_id = upd.run_id) AS inbox_pending
FROM upd
