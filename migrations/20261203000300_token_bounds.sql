-- What a token may reach beyond its scopes (SPEC Z4): the queues its runs may be in (NULL:
-- every queue), the highest priority it may give a run (NULL: any), how many runs it created
-- may be unfinished at once and how many it may create in a minute (NULL: no quota). Tokens
-- made before this have NULL everywhere: what they could do then.
ALTER TABLE rein_tokens
    ADD COLUMN queues                 text[]  CHECK (cardinality(queues) BETWEEN 1 AND 64),
    ADD COLUMN priority_max           integer,
    ADD COLUMN in_flight_max          integer CHECK (in_flight_max BETWEEN 1 AND 1000000),
    ADD COLUMN enqueue_per_minute_max integer CHECK (enqueue_per_minute_max BETWEEN 1 AND 1000000),
    -- A subject is printed into logs, tables and histories as it is: no control characters
    -- (newline, ESC, DEL, C1). Checked for new tokens only; older ones keep loading.
    ADD CONSTRAINT rein_tokens_subject_printable
        CHECK (subject !~ '[\x01-\x1f\x7f-\x9f]') NOT VALID;

-- The API token whose call created the run (NULL: made on the database, by the engine's
-- fan-out, or before this). A token's quotas count its unfinished runs and the runs it
-- created within the last minute, each through its own index.
ALTER TABLE rein_runs ADD COLUMN enqueued_token uuid;
CREATE INDEX rein_runs_token_unfinished ON rein_runs (enqueued_token)
    WHERE enqueued_token IS NOT NULL AND status <> 'terminal';
CREATE INDEX rein_runs_token_created ON rein_runs (enqueued_token, created_at)
    WHERE enqueued_token IS NOT NULL;
