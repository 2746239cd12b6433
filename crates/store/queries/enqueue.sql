-- Creates runs; $11 (client keys, NULL for none) make enqueue idempotent: the same key from
-- the same caller ($14) returns the run it created first, with the hash of the body it was
-- created with ($15, compared by the caller). A key stored before keys had callers (caller
-- NULL) still stands for its run, for any caller. $13: the wall-time budget in ms, NULL for
-- none. $16: the API token creating the run, NULL for none. $17: who enqueues each run
-- (NULL: nobody named). $18: the engine protocol each run's definition needs.
WITH req AS (
    SELECT *
    FROM unnest($1::uuid[], $2::text[], $3::int[], $4::text[], $5::text[], $6::jsonb[], $7::jsonb[],
                $8::int[], $9::text[], $10::uuid[], $11::text[], $12::bigint[], $13::bigint[],
                $14::text[], $15::text[], $16::uuid[], $17::text[], $18::smallint[]) WITH ORDINALITY
        AS r(run_id, definition, version, state, status, projection, input, priority, queue, parent_run_id, client_key, timer_ms,
             deadline_ms, caller, body_hash, enqueued_token, enqueued_by, protocol, ord)
),
keys AS (
    INSERT INTO rein_enqueue_keys (caller, client_key, run_id, body_hash)
    SELECT q.caller, q.client_key, q.run_id, q.body_hash FROM req q
    WHERE q.client_key IS NOT NULL
      AND NOT EXISTS (SELECT 1 FROM rein_enqueue_keys l
                      WHERE l.caller IS NULL AND l.client_key = q.client_key)
    ON CONFLICT (caller, client_key) DO NOTHING
    RETURNING client_key, run_id
),
created AS (
    INSERT INTO rein_runs (run_id, definition, version, state, status, projection, input, priority, queue, parent_run_id, wake_at,
                           deadline_at, enqueued_token, enqueued_by, protocol)
    SELECT q.run_id, q.definition, q.version, q.state, q.status, q.projection, q.input, q.priority, q.queue, q.parent_run_id,
           clock_timestamp() + q.timer_ms * interval '1 millisecond',
           -- created_at + the wall-time budget (both now(): the same instant)
           now() + q.deadline_ms * interval '1 millisecond',
           q.enqueued_token, q.enqueued_by,
           -- a new log holds no event of a newer engine protocol than the first; its
           -- definition may need a newer one
           q.protocol
    FROM req q
    WHERE q.client_key IS NULL OR q.run_id IN (SELECT run_id FROM keys)
    RETURNING run_id
)
SELECT q.run_id AS requested, COALESCE(c.run_id, k.run_id) AS run_id, c.run_id IS NOT NULL AS created,
       k.body_hash
FROM req q
LEFT JOIN created c ON c.run_id = q.run_id
LEFT JOIN rein_enqueue_keys k ON k.client_key = q.client_key AND c.run_id IS NULL
                             AND (k.caller = q.caller OR k.caller IS NULL)
ORDER BY q.ord
