-- Event history retention (SPEC L2). `rein retention archive` moves the whole log of runs
-- that finished long enough ago out of the hot rein_events into rein_events_archive, one
-- transaction per batch of whole runs. Keyed by run_id first, like every run table.
CREATE TABLE rein_events_archive (
    run_id          uuid        NOT NULL,
    sequence        bigint      NOT NULL CHECK (sequence > 0),
    event_id        uuid        NOT NULL,
    type            text        NOT NULL,
    payload         jsonb       NOT NULL,
    node            text,
    schema_version  integer     NOT NULL,
    fencing_token   bigint      NOT NULL,
    worker          text        NOT NULL,
    occurred_at     timestamptz NOT NULL,
    PRIMARY KEY (run_id, sequence),
    UNIQUE (run_id, event_id)
);
-- Archived events are as immutable as hot ones.
CREATE TRIGGER rein_events_archive_no_update BEFORE UPDATE ON rein_events_archive
    FOR EACH ROW EXECUTE FUNCTION rein_events_immutable();

-- When the run's log was archived. A commit never applies to an archived run (commit.sql),
-- so no late event can land in rein_events for it.
ALTER TABLE rein_runs ADD COLUMN archived_at timestamptz;
-- What `rein retention archive` scans: terminal, not yet archived, by finishing time.
CREATE INDEX rein_runs_archivable ON rein_runs (finished_at)
    WHERE status = 'terminal' AND archived_at IS NULL;

-- Every event of every run, hot or archived: what history, replay and audits read. A run's
-- events are all in one table or all in the other.
CREATE VIEW rein_events_all AS
    SELECT run_id, sequence, event_id, type, payload, node, schema_version, fencing_token,
           worker, occurred_at
    FROM rein_events
    UNION ALL
    SELECT run_id, sequence, event_id, type, payload, node, schema_version, fencing_token,
           worker, occurred_at
    FROM rein_events_archive;

-- Moving logs is the owner's job (it deletes from rein_events); both groups read them.
GRANT SELECT ON rein_events_archive, rein_events_all TO rein_runtime, rein_api_access;
