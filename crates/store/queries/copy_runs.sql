-- `rein bench --backlog-runs/--parked-runs`: copies of one template run ($1) with its log,
-- lease grants, ledger, checkpoints and approval requests, numbered $3..$4. Copy i is created
-- at $5 + i * $6 ms and every time of the template moves with it; its run id is UUIDv7-shaped
-- from that time (so ids order by creation, as real ones do) and unique by $2 and i. A copy
-- whose number is a multiple of $7 (0: none) is created early enough for its timer to be
-- due now: the share of parked runs that falls due at once.
WITH t AS (SELECT * FROM rein_runs WHERE run_id = $1),
ids AS MATERIALIZED (
    SELECT i, at, at - t.created_at AS shift,
           (lpad(to_hex((extract(epoch FROM at) * 1000)::bigint), 12, '0') || '7'
            || substr(h, 1, 3) || '8' || substr(h, 4, 15))::uuid AS run_id
    FROM t, generate_series($3::bigint, $4::bigint) AS i,
         -- A due copy was created as long before now as the template's timer runs, and a
         -- second more: its timer, judged from its own times as the scheduler judges it, is
         -- due.
         LATERAL (SELECT CASE WHEN $7 > 0 AND i % $7 = 0 AND t.wake_at IS NOT NULL
                              THEN clock_timestamp() - (t.wake_at - t.created_at) - interval '1 second'
                              ELSE $5::timestamptz + (i * $6::float8) * interval '1 millisecond'
                         END AS at,
                         md5($2 || ':' || i) AS h) x
),
runs AS (
    INSERT INTO rein_runs (run_id, definition, version, state, status, projection, last_sequence,
        fencing_token, wake_at, priority, queue, input, terminal_reason, created_at, updated_at,
        ready_at, state_entered_at, finished_at, deadline_at, first_try_at, enqueued_by,
        root_run_id, depth, descendants, protocol)
    SELECT ids.run_id, t.definition, t.version, t.state, t.status, t.projection, t.last_sequence,
        t.fencing_token, t.wake_at + ids.shift, t.priority, $8, t.input,
        t.terminal_reason, t.created_at + ids.shift, t.updated_at + ids.shift,
        t.ready_at + ids.shift, t.state_entered_at + ids.shift, t.finished_at + ids.shift,
        t.deadline_at + ids.shift, t.first_try_at + ids.shift, t.enqueued_by,
        ids.run_id, t.depth, t.descendants, t.protocol
    FROM ids, t
),
events AS (
    INSERT INTO rein_events (run_id, sequence, event_id, type, payload, node, schema_version,
        fencing_token, worker, occurred_at, sender)
    SELECT ids.run_id, e.sequence, gen_random_uuid(), e.type, e.payload, e.node,
        e.schema_version, e.fencing_token, e.worker, e.occurred_at + ids.shift, e.sender
    FROM ids, rein_events e WHERE e.run_id = $1
),
grants AS (
    INSERT INTO rein_lease_grants (run_id, fencing_token, worker, at_sequence, granted_at)
    SELECT ids.run_id, g.fencing_token, g.worker, g.at_sequence, g.granted_at + ids.shift
    FROM ids, rein_lease_grants g WHERE g.run_id = $1
),
ledger AS (
    INSERT INTO rein_actions (run_id, action_id, node, step, idempotency_key, call_id, status,
        tool, result, result_hash, dispatched_at, finished_at)
    SELECT ids.run_id, a.action_id, a.node, a.step, a.idempotency_key,
        a.call_id, a.status, a.tool, a.result, a.result_hash, a.dispatched_at + ids.shift,
        a.finished_at + ids.shift
    FROM ids, rein_actions a WHERE a.run_id = $1
),
checkpoints AS (
    INSERT INTO rein_checkpoints (run_id, sequence, definition, version, state, created_at)
    SELECT ids.run_id, c.sequence, c.definition, c.version, c.state, c.created_at + ids.shift
    FROM ids, rein_checkpoints c WHERE c.run_id = $1
),
approvals AS (
    INSERT INTO rein_approvals (approval_id, run_id, node, tool, args, action_hash, risk, status,
        requested_at, expires_at, decided_by, decided_at, comment, consumed_at)
    SELECT gen_random_uuid(), ids.run_id, a.node, a.tool, a.args, a.action_hash, a.risk, a.status,
        a.requested_at + ids.shift, a.expires_at + ids.shift, a.decided_by,
        a.decided_at + ids.shift, a.comment, a.consumed_at + ids.shift
    FROM ids, rein_approvals a WHERE a.run_id = $1
)
SELECT count(*) FROM ids
