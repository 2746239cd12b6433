-- Who sent an event (SPEC E1, Z3): the API token's subject, the `--as` name of `rein send`,
-- the approver or the operator. The `worker` column stays the writer, the process whose
-- fencing token wrote the event (for an event applied from the inbox, the lease holder
-- that applied it). NULL: the engine's own event.
ALTER TABLE rein_events ADD COLUMN sender text;
ALTER TABLE rein_events_archive ADD COLUMN sender text;

CREATE OR REPLACE VIEW rein_events_all AS
    SELECT run_id, sequence, event_id, type, payload, node, schema_version, fencing_token,
           worker, occurred_at, sender
    FROM rein_events
    UNION ALL
    SELECT run_id, sequence, event_id, type, payload, node, schema_version, fencing_token,
           worker, occurred_at, sender
    FROM rein_events_archive;

-- Client keys are scoped to their caller (SPEC Z4): (caller, key) names a run, and keeps
-- the hash of the request it was made with, so the same key with another request is a
-- conflict instead of silently returning the first run. Keys stored before this have
-- neither: caller NULL stands for any caller and body_hash NULL for any request, so they
-- keep returning their runs as they did. No new key is stored without a caller.
ALTER TABLE rein_enqueue_keys ADD COLUMN caller text;
ALTER TABLE rein_enqueue_keys ADD COLUMN body_hash text;
ALTER TABLE rein_enqueue_keys DROP CONSTRAINT rein_enqueue_keys_pkey;
CREATE UNIQUE INDEX rein_enqueue_keys_caller_key ON rein_enqueue_keys (caller, client_key);
-- The keys stored before callers: still one per key.
CREATE UNIQUE INDEX rein_enqueue_keys_legacy ON rein_enqueue_keys (client_key)
    WHERE caller IS NULL;
