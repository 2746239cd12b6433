-- Commits events for many runs in one statement (SPEC X3). Per run, the projection update
-- happens only if the writer's fencing token is the run's current token, the sequence
-- continues the log, and either
--   * the writer holds a live lease (bump = false), or
--   * no live lease is held and the writer takes the token itself (bump = true, SPEC X3a).
-- Events, the grant, the ledger, consumed inbox entries, blobs and checkpoints are written only for
-- runs whose update matched, so one fenced run never aborts the others in its batch.
--
-- A `-- [name]` line opens an optional part: a batch that has nothing for it (no ledger
-- entries, no run ending, no child to start, ...) is sent without it (commit.rs), so a plain
-- step pays for none of them. `-- [result]` opens the final SELECT.
WITH RECURSIVE req AS (
    SELECT *
    FROM unnest($1::uuid[], $2::bigint[], $3::bigint[], $4::jsonb[], $5::text[], $6::text[],
                $7::bool[], $8::bool[], $9::bigint[], $10::text[], $35::uuid[], $51::bigint[],
                $52::bool[], $56::bool[], $58::bigint[])
        AS r(run_id, token, base_seq, projection, state, status, bump, release, timer_ms, terminal_reason,
             approval_id, defer_ms, first_try, cancelled, new_seq)
),
ev AS (
    SELECT *
    FROM unnest($11::uuid[], $12::bigint[], $13::uuid[], $14::text[], $15::jsonb[], $16::text[], $53::text[])
        AS e(run_id, sequence, event_id, type, payload, node, sender)
),
-- This statement records its blob references itself (`blob_refs`): the trigger kept for
-- older releases' commits leaves its events alone.
t AS (SELECT clock_timestamp() AS now, set_config('rein.blob_refs', 'commit', true) AS refs),
-- The ranges of months whose partition moved to the archive (rein_event_ranges): read once.
moved AS MATERIALIZED (
    SELECT lo, hi FROM rein_event_ranges WHERE moved_at IS NOT NULL
),
-- Runs some of whose events are stored already (a retried commit whose first attempt
-- landed): one probe of the (run_id, event_id) key per event, never a read of a whole log.
-- A scalar subquery, so the probe stays an index lookup whatever the tables' statistics.
stored AS MATERIALIZED (
    SELECT DISTINCT ev.run_id FROM ev
    WHERE (SELECT 1 FROM rein_events x
           WHERE x.run_id = ev.run_id AND x.event_id = ev.event_id LIMIT 1) IS NOT NULL
),
-- Row locks in run_id order: concurrent batches and renewals touching the same runs then
-- queue behind each other instead of deadlocking. The update only reaches a row this has
-- already locked. A locking read returns the newest version of each row, the one the
-- update judges, so a refused run's reason below is read from here. Each request is paired
-- with its row here, by primary key, so nothing later joins two lists of the batch.
locked AS (
    SELECT q.*, r.state AS from_state, r.state_entered_at, r.fencing_token, r.last_sequence,
           r.lease_owner, r.lease_until,
           -- Archived alone, or with its month's partition.
           r.archived_at IS NOT NULL OR EXISTS (
               SELECT 1 FROM moved g WHERE r.run_id >= g.lo AND r.run_id < g.hi) AS archived
    FROM req q
    JOIN rein_runs r ON r.run_id = q.run_id
    ORDER BY r.run_id
    FOR UPDATE OF r
),
upd AS (
    UPDATE rein_runs r SET
        projection = q.projection,
        state = q.state,
        status = q.status,
        last_sequence = q.new_seq,
        fencing_token = r.fencing_token + CASE WHEN q.bump THEN 1 ELSE 0 END,
        lease_owner = CASE WHEN q.release OR q.bump THEN NULL ELSE r.lease_owner END,
        lease_until = CASE WHEN q.release OR q.bump THEN NULL ELSE r.lease_until END,
        state_entered_at = CASE WHEN r.state <> q.state THEN t.now ELSE r.state_entered_at END,
        wake_at = CASE
            WHEN q.timer_ms IS NULL THEN NULL
            ELSE (CASE WHEN r.state <> q.state THEN t.now ELSE r.state_entered_at END)
                 + q.timer_ms * interval '1 millisecond'
        END,
        -- A run a fleet-wide limit deferred is claimable again only after the wait.
        ready_at = CASE WHEN q.defer_ms IS NOT NULL
                        THEN clock_timestamp() + q.defer_ms * interval '1 millisecond'
                        WHEN q.status = 'runnable' AND (r.status <> 'runnable' OR q.bump OR q.release)
                        THEN clock_timestamp() ELSE r.ready_at END,
        terminal_reason = COALESCE(q.terminal_reason, r.terminal_reason),
        -- Where a retry policy's deadline counts from (SPEC R1).
        first_try_at = CASE WHEN q.first_try THEN t.now ELSE r.first_try_at END,
        finished_at = CASE WHEN q.status = 'terminal' AND r.finished_at IS NULL
                           THEN clock_timestamp() ELSE r.finished_at END,
        deadline_at = CASE WHEN q.status = 'terminal' THEN NULL ELSE r.deadline_at END,
        -- The run changed: the scheduler's next look, judged on the old state, is void.
        scan_after = NULL,
        scan_misses = 0,
        updated_at = clock_timestamp()
    FROM locked q, t
    WHERE r.run_id = q.run_id
      -- An archived run's log has left rein_events for good: nothing is appended to it.
      AND NOT q.archived
      AND r.fencing_token = q.token
      AND r.last_sequence = q.base_seq
      AND CASE WHEN q.bump THEN (r.lease_owner IS NULL OR r.lease_until <= clock_timestamp())
               ELSE (r.lease_owner = $17 AND r.lease_until > clock_timestamp()) END
      AND q.run_id <> ALL (ARRAY(SELECT run_id FROM stored))
      -- A commit that uses an approval lands only while the grant is granted and unused.
      AND (q.approval_id IS NULL OR EXISTS (
          SELECT 1 FROM rein_approvals a
          WHERE a.approval_id = q.approval_id AND a.run_id = q.run_id
            AND a.status = 'granted' AND a.consumed_at IS NULL))
    RETURNING r.run_id, r.fencing_token, r.last_sequence, q.bump, q.base_seq, r.queue, r.priority,
        r.enqueued_by, r.root_run_id, r.depth,
        r.lease_owner IS NULL AS unleased,
        -- How long the run was in the state it leaves (none when it stays).
        CASE WHEN q.from_state <> q.state
             THEN extract(epoch FROM t.now - q.state_entered_at)::float8 END AS left_after_s,
        -- What the optional parts below need of the request, so none joins it again.
        q.state AS to_state, q.status AS to_status, q.terminal_reason AS reason, q.approval_id,
        CASE WHEN q.status = 'terminal' THEN q.projection->'data'->'result' END AS result
),
ins AS (
    INSERT INTO rein_events (run_id, sequence, event_id, type, payload, node, fencing_token, worker, sender)
    SELECT ev.run_id, ev.sequence, ev.event_id, ev.type, ev.payload, ev.node, upd.fencing_token, $17, ev.sender
    FROM ev JOIN upd ON upd.run_id = ev.run_id
),
-- [grants]
grants AS (
    INSERT INTO rein_lease_grants (run_id, fencing_token, worker, at_sequence)
    SELECT run_id, fencing_token, $17, base_seq FROM upd WHERE bump
),
-- [consumed]
consumed AS (
    DELETE FROM rein_inbox i
    USING unnest($18::uuid[], $19::bigint[]) AS c(run_id, id), upd
    WHERE i.run_id = c.run_id AND i.id = c.id AND upd.run_id = c.run_id
),
-- [inbox_due]
-- Inbox entries left over were judged on the old state: the scheduler looks at them again
-- at once. Only when no lease is left; a holder applies its inbox itself.
inbox_due AS (
    UPDATE rein_inbox i SET scan_after = clock_timestamp(), scan_misses = 0
    FROM upd
    WHERE upd.unleased AND i.run_id = upd.run_id
      AND (i.scan_after > clock_timestamp() OR i.scan_misses > 0)
      AND NOT (i.id = ANY($19::bigint[]))
),
-- [ledger]
ledger AS (
    INSERT INTO rein_actions (run_id, action_id, node, step, idempotency_key, call_id, status, tool, result, result_hash, finished_at)
    SELECT l.run_id, l.action_id, l.node, l.step, l.idempotency_key, l.call_id, l.status, l.tool, l.result, l.result_hash,
           CASE WHEN l.status IN ('SUCCEEDED', 'FAILED') THEN clock_timestamp() END
    FROM unnest($20::uuid[], $21::text[], $22::text[], $23::int[], $24::text[], $25::text[], $26::text[], $27::text[], $28::jsonb[], $29::text[])
        AS l(run_id, action_id, node, step, idempotency_key, call_id, status, tool, result, result_hash)
    JOIN upd ON upd.run_id = l.run_id
    ON CONFLICT (run_id, action_id) DO UPDATE SET
        call_id = EXCLUDED.call_id, status = EXCLUDED.status, result = EXCLUDED.result,
        result_hash = EXCLUDED.result_hash, finished_at = EXCLUDED.finished_at
),
-- [approvals_used]
approvals_used AS (
    UPDATE rein_approvals a SET consumed_at = clock_timestamp()
    FROM upd
    WHERE a.approval_id = upd.approval_id
),
-- [approvals_void]
-- A run that ends leaves no request waiting for a person: what is still pending (and not
-- yet expired, which keeps saying so) is void, so approvers are not asked about a run that
-- can no longer use the answer.
approvals_void AS (
    UPDATE rein_approvals a SET status = 'void',
        comment = COALESCE(a.comment || ' ', '') || '(void: the run ended)'
    FROM upd
    WHERE a.run_id = upd.run_id AND upd.to_status = 'terminal' AND a.status = 'pending'
      AND a.expires_at > clock_timestamp()
),
-- [blobs]
-- Large payload values the events refer to by hash (SPEC E5): stored once, by content
-- ($36..$38: only what was not stored already).
blobs AS (
    INSERT INTO rein_blobs (sha256, size_bytes, content)
    SELECT DISTINCT ON (b.sha256) b.sha256, octet_length(b.content), b.content
    FROM unnest($36::uuid[], $37::text[], $38::bytea[]) AS b(run_id, sha256, content)
    JOIN upd ON upd.run_id = b.run_id
    ORDER BY b.sha256
    ON CONFLICT (sha256) DO NOTHING
),
-- Which blobs the run refers to: those its own commit stored here, or found stored while
-- holding their content ($59, $60: every hash the worker computed for the run, never one
-- read from a payload). Readers resolve a reference only through these rows.
blob_refs AS (
    INSERT INTO rein_blob_refs (sha256, run_id)
    SELECT DISTINCT f.sha256, f.run_id
    FROM unnest($59::uuid[], $60::text[]) AS f(run_id, sha256)
    JOIN upd ON upd.run_id = f.run_id
    ON CONFLICT DO NOTHING
),
-- [children]
-- Child runs of a fan-out the commit opens (SPEC P1): same queue, priority and enqueuer as
-- the parent, one level deeper in the parent's tree (SPEC Z4); their ids are a function of
-- (parent, fan-out, branch), so a retried commit adds none.
children AS (
    INSERT INTO rein_runs (run_id, definition, version, state, status, projection, input, priority, queue,
                           enqueued_by, parent_run_id, branch, root_run_id, depth, wake_at, deadline_at, protocol)
    SELECT c.run_id, c.definition, c.version, c.state, c.status, c.projection, c.input, upd.priority, upd.queue,
           upd.enqueued_by, c.parent_run_id, c.branch, COALESCE(upd.root_run_id, upd.run_id), upd.depth + 1,
           clock_timestamp() + c.timer_ms * interval '1 millisecond',
           now() + c.deadline_ms * interval '1 millisecond',
           -- a child's log starts afresh: the first engine protocol, or the one its
           -- definition needs ($61)
           c.protocol
    FROM unnest($39::uuid[], $40::uuid[], $41::text[], $42::int[], $43::text[], $44::text[], $45::jsonb[],
                $46::jsonb[], $47::jsonb[], $48::bigint[], $49::bigint[], $61::smallint[])
        AS c(run_id, parent_run_id, definition, version, state, status, projection, input, branch, timer_ms, deadline_ms,
             protocol)
    JOIN upd ON upd.run_id = c.parent_run_id
    ON CONFLICT (run_id) DO NOTHING
),
-- [branch_results]
-- A branch's child that ends delivers its result to the parent's inbox in this same
-- statement, so the result cannot be lost between the child's end and the parent's join.
-- The event id is a function of the child: delivered once.
branch_results AS (
    INSERT INTO rein_inbox (run_id, event_id, type, payload, sender, expires_at)
    SELECT c.parent_run_id,
           md5('rein/branch-result/' || upd.run_id::text)::uuid,
           CASE WHEN (c.branch->'succeed_on') @> to_jsonb(upd.to_state)
                THEN 'BRANCH_SUCCEEDED' ELSE 'BRANCH_FAILED' END,
           jsonb_build_object(
               'branch', c.branch->'name', 'fan_out', c.branch->'fan_out', 'child_run_id', upd.run_id,
               'state', upd.to_state, 'reason', upd.reason,
               'result', CASE WHEN octet_length(COALESCE(upd.result, 'null'::jsonb)::text) <= $50
                              THEN upd.result
                              ELSE jsonb_build_object('too_large_bytes',
                                       octet_length(upd.result::text)) END),
           $17, clock_timestamp() + interval '30 days'
    FROM upd
    JOIN rein_runs c ON c.run_id = upd.run_id
    WHERE upd.to_status = 'terminal' AND c.branch IS NOT NULL AND c.parent_run_id IS NOT NULL
    ON CONFLICT (run_id, event_id) DO NOTHING
),
-- [losers]
-- A join this commit decides cancels the branches still running (SPEC P1): CANCEL with
-- reason join_decided goes into each such child's inbox in this same statement, and whoever
-- holds the child applies it (a worker also stops the running action). Once per child. The
-- children's rows are locked, so a child that ends at this moment is seen ended and gets
-- nothing. A child is found by its parent, fan-out and branch ($55, $57, $54), not by an id
-- derived again, so one started under an older release's id rule is found too.
losers AS (
    SELECT c.run_id, c.parent_run_id FROM rein_runs c
    JOIN unnest($54::text[], $55::uuid[], $57::bigint[]) AS x(branch, parent_run_id, fan_out)
      ON c.parent_run_id = x.parent_run_id AND c.branch IS NOT NULL
     AND c.branch->>'name' = x.branch AND (c.branch->>'fan_out')::bigint = x.fan_out
    WHERE c.status <> 'terminal'
    ORDER BY c.run_id
    FOR UPDATE OF c
),
cancel_losers AS (
    INSERT INTO rein_inbox (run_id, event_id, type, payload, sender, expires_at)
    SELECT l.run_id, md5('rein/join-decided/' || l.run_id::text)::uuid, 'CANCEL',
           jsonb_build_object('reason', 'join_decided', 'parent_run_id', l.parent_run_id),
           $17, clock_timestamp() + interval '30 days'
    FROM losers l
    JOIN upd ON upd.run_id = l.parent_run_id
    ON CONFLICT (run_id, event_id) DO NOTHING
),
-- [descendants]
-- A run this commit cancels cancels its live descendants (SPEC Z4): CANCEL with reason
-- parent_cancelled goes into the inbox of every run below it that has not ended, in this
-- same statement, and whoever holds each applies it. Once per run. A child started under it
-- after this statement looked is reached when its own parent applies its CANCEL: that
-- commit comes after the one that started the child.
descendants AS (
    SELECT c.run_id, c.parent_run_id, q.run_id AS cancelled_run_id
    FROM req q JOIN rein_runs c ON c.parent_run_id = q.run_id AND c.branch IS NOT NULL
    WHERE q.cancelled
    UNION
    SELECT c.run_id, c.parent_run_id, d.cancelled_run_id
    FROM descendants d JOIN rein_runs c ON c.parent_run_id = d.run_id AND c.branch IS NOT NULL
),
doomed AS (
    SELECT c.run_id FROM rein_runs c
    WHERE c.run_id IN (SELECT run_id FROM descendants) AND c.status <> 'terminal'
    ORDER BY c.run_id
    FOR UPDATE
),
cancel_descendants AS (
    INSERT INTO rein_inbox (run_id, event_id, type, payload, sender, expires_at)
    SELECT DISTINCT ON (d.run_id) d.run_id, md5('rein/parent-cancelled/' || d.run_id::text)::uuid, 'CANCEL',
           jsonb_build_object('reason', 'parent_cancelled', 'parent_run_id', d.parent_run_id,
                              'cancelled_run_id', d.cancelled_run_id),
           $17, clock_timestamp() + interval '30 days'
    FROM descendants d
    JOIN upd ON upd.run_id = d.cancelled_run_id
    JOIN doomed x ON x.run_id = d.run_id
    ORDER BY d.run_id
    ON CONFLICT (run_id, event_id) DO NOTHING
),
-- [checkpoints]
checkpoints AS (
    INSERT INTO rein_checkpoints (run_id, sequence, definition, version, state)
    SELECT c.run_id, c.sequence, c.definition, c.version, c.state
    FROM unnest($30::uuid[], $31::bigint[], $32::text[], $33::int[], $34::jsonb[])
        AS c(run_id, sequence, definition, version, state)
    JOIN upd ON upd.run_id = c.run_id
    ON CONFLICT DO NOTHING
)
-- [result]
-- A refused run says which condition refused it, checked in this order against the row the
-- update judged: archived, token, sequence, events already stored (a retried commit),
-- approval, and then, by elimination, the lease (a lease that was live when the update
-- looked may have run out since, so it is never re-judged by the clock here).
SELECT q.run_id,
       upd.run_id IS NOT NULL AS committed,
       upd.fencing_token AS new_token,
       upd.last_sequence AS new_sequence,
       upd.left_after_s,
       upd.queue,
       l.fencing_token AS current_token,
       l.last_sequence AS current_sequence,
       l.lease_owner AS current_owner,
       l.lease_until AS current_lease_until,
       clock_timestamp() AS db_now,
       CASE
           WHEN upd.run_id IS NOT NULL OR l.run_id IS NULL THEN NULL
           WHEN l.archived THEN 'archived'
           WHEN l.fencing_token <> q.token THEN 'token'
           WHEN l.last_sequence <> q.base_seq THEN 'sequence'
           WHEN q.run_id IN (SELECT run_id FROM stored) THEN 'already_stored'
           WHEN q.approval_id IS NOT NULL AND NOT EXISTS (
               SELECT 1 FROM rein_approvals a
               WHERE a.approval_id = q.approval_id AND a.run_id = q.run_id
                 AND a.status = 'granted' AND a.consumed_at IS NULL) THEN 'approval'
           WHEN q.bump THEN 'lease_held'
           WHEN l.lease_owner IS DISTINCT FROM $17 THEN 'lease_not_held'
           ELSE 'lease_expired'
       END AS fenced_by,
       EXISTS (SELECT 1 FROM rein_inbox b
               WHERE b.run_id = q.run_id AND NOT (b.id = ANY($19::bigint[]))) AS inbox_pending
FROM req q
LEFT JOIN upd ON upd.run_id = q.run_id
LEFT JOIN locked l ON l.run_id = q.run_id
