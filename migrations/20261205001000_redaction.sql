-- Forgetting personal data (SPEC E5, E6): the log stays append-only, except that the schema
-- owner may replace values in a payload by their redaction markers, in a transaction that
-- says so (`SET LOCAL rein.redacting = 'on'`); every other column of an event stays as it
-- was written. Workers and the API have no UPDATE on the log, so they cannot do even that.
CREATE OR REPLACE FUNCTION rein_events_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('rein.redacting', true) = 'on'
       AND NEW.run_id = OLD.run_id AND NEW.sequence = OLD.sequence
       AND NEW.event_id = OLD.event_id AND NEW.type = OLD.type
       AND NEW.fencing_token = OLD.fencing_token AND NEW.worker = OLD.worker
       AND NEW.occurred_at = OLD.occurred_at THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'rein_events is append-only (SPEC C3)';
END $$;

-- Who redacted what in which run, and why: the record of a redaction (the values' hashes,
-- never the values).
CREATE TABLE rein_redactions (
    run_id       uuid        NOT NULL,
    redacted_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    fields       text[]      NOT NULL,
    hashes       jsonb       NOT NULL,
    redacted_by  text        NOT NULL,
    reason       text        NOT NULL,
    PRIMARY KEY (run_id, redacted_at)
);
GRANT SELECT ON rein_redactions TO rein_api_access;
GRANT SELECT ON rein_redactions TO rein_runtime;
