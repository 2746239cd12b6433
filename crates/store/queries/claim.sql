-- Takes up to $2 runnable, unleased runs (SPEC X1): never double-claims (SKIP LOCKED), bumps
-- each run's fencing token, and records the grant. Lease expiry is by the database clock.
--
-- Fair across the queues $3 (SPEC Z4): each gets an equal share of the $2, and the remainder
-- goes to the queues from the $5-th on ($5 turns with every claim: round robin), so one
-- queue's backlog never starves another. A share a queue cannot fill goes to the others,
-- from the same turn on. Within a queue, the highest priority first, then the oldest. Each
-- queue is read from its own end of the claim index, and rows are locked only as they are
-- taken: no more than $2 are ever locked.
WITH queues AS (
    SELECT q.name, count(*) OVER () AS k,
           ((q.i - 1 - $5) % count(*) OVER () + count(*) OVER ()) % count(*) OVER () AS turn
    FROM unnest($3::text[]) WITH ORDINALITY AS q(name, i)
),
shares AS (
    SELECT name, turn, $2 / k + CASE WHEN turn < $2 % k THEN 1 ELSE 0 END AS share
    FROM queues
),
fair AS (
    SELECT p.run_id
    FROM shares s
    CROSS JOIN LATERAL (
        SELECT r.run_id
        FROM rein_runs r
        WHERE r.status = 'runnable' AND r.lease_owner IS NULL AND r.queue = s.name
          -- Not before a fleet-wide limit allows it (ACTION_DEFERRED sets ready_at ahead).
          AND r.ready_at <= clock_timestamp()
          -- Only runs whose log this binary can read (rolling upgrades).
          AND r.protocol <= $6
        ORDER BY r.priority DESC, r.ready_at
        LIMIT s.share
        FOR UPDATE SKIP LOCKED
    ) p
    WHERE s.share > 0
),
rest AS (
    SELECT p.run_id
    FROM (SELECT name FROM shares ORDER BY turn) s
    CROSS JOIN LATERAL (
        SELECT r.run_id
        FROM rein_runs r
        WHERE r.status = 'runnable' AND r.lease_owner IS NULL AND r.queue = s.name
          AND r.ready_at <= clock_timestamp()
          AND r.protocol <= $6
          AND r.run_id NOT IN (SELECT run_id FROM fair)
        ORDER BY r.priority DESC, r.ready_at
        LIMIT $2
        FOR UPDATE SKIP LOCKED
    ) p
    LIMIT (SELECT $2 - count(*) FROM fair)
),
picked AS (
    SELECT run_id FROM fair
    UNION ALL
    SELECT run_id FROM rest
),
upd AS (
    UPDATE rein_runs r SET
        lease_owner = $1,
        lease_until = clock_timestamp() + $4 * interval '1 millisecond',
        fencing_token = r.fencing_token + 1,
        updated_at = clock_timestamp()
    -- By primary key: the planner cannot tell how few the picked rows are.
    WHERE r.run_id = ANY (ARRAY(SELECT run_id FROM picked))
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
