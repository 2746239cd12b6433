SELECT run_id, definition, version, state, status, projection, last_sequence, fencing_token,
       lease_owner, lease_until, (lease_until > clock_timestamp()) AS lease_live, wake_at,
       priority, queue, parent_run_id, enqueued_by, terminal_reason, created_at, updated_at,
       state_entered_at, finished_at,
       (extract(epoch FROM clock_timestamp() - state_entered_at) * 1000)::float8 AS in_state_ms,
       (extract(epoch FROM clock_timestamp() - COALESCE(first_try_at, created_at)) * 1000)::float8
           AS try_elapsed_ms
FROM rein_runs
