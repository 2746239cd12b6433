-- Redacting through the API (SPEC E5, E6), and forgetting the blobs only redacted runs
-- referred to. `rein api` has no UPDATE on the log, so the writes of a redaction go through
-- one function owned by the schema owner. It takes only what a redaction may change: every
-- value it writes must equal the stored one except the named data keys, and each of those
-- must be a redaction marker (`{"$redacted": {"sha256": HEX}}`). The caller computes the
-- markers and checks that the redacted log still replays; the function checks the run has
-- not moved since (its last sequence) and that no worker holds it, under the row lock.
--
-- Expand only: a new column with a default and new functions; older releases neither read
-- nor write them.
ALTER TABLE rein_redactions ADD COLUMN blobs_deleted text[] NOT NULL DEFAULT '{}';

-- Whether object `new` is object `old` with some of `fields` replaced by redaction markers
-- (both absent counts as equal).
CREATE FUNCTION rein_is_redaction_of(old jsonb, new jsonb, fields text[]) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN old IS NULL OR new IS NULL THEN old IS NOT DISTINCT FROM new
        WHEN jsonb_typeof(old) <> 'object' OR jsonb_typeof(new) <> 'object' THEN old = new
        ELSE (old - fields) = (new - fields) AND NOT EXISTS (
            SELECT 1 FROM unnest(fields) AS f
            WHERE (old ? f) <> (new ? f)
               OR (new ? f AND (new -> f) <> (old -> f) AND NOT (
                      jsonb_typeof(new -> f) = 'object'
                      AND (SELECT count(*) FROM jsonb_object_keys(new -> f)) = 1
                      AND jsonb_typeof(new -> f -> '$redacted') = 'object'
                      AND (SELECT count(*) FROM jsonb_object_keys(new -> f -> '$redacted')) = 1
                      AND (new -> f -> '$redacted' ->> 'sha256') ~ '^[0-9a-f]{64}$')))
    END
$$;

-- Applies a redaction computed by the caller: p_events and p_checkpoints are arrays of
-- {"sequence", "payload"} and {"sequence", "state"}. Answers 'redacted' with the blobs it
-- deleted, or 'not_found', 'leased' or 'moved' (the run gained events since it was read)
-- having written nothing. Raises when a value is not a redaction of the stored one.
-- Blobs are deleted only for a finished run: those that no run refers to except finished,
-- redacted ones (the references stay, so a read says the content was forgotten).
CREATE FUNCTION rein_apply_redaction(
    p_run uuid, p_last_sequence bigint, p_fields text[], p_input jsonb, p_projection jsonb,
    p_events jsonb, p_checkpoints jsonb, p_hashes jsonb, p_by text, p_reason text)
RETURNS TABLE (outcome text, blobs_deleted text[])
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    run rein_runs%ROWTYPE;
    item jsonb;
    stored jsonb;
    seq bigint;
    deleted text[] := '{}';
BEGIN
    SELECT * INTO run FROM rein_runs WHERE run_id = p_run FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 'not_found'::text, deleted;
        RETURN;
    END IF;
    IF run.lease_until IS NOT NULL AND run.lease_until > clock_timestamp() THEN
        RETURN QUERY SELECT 'leased'::text, deleted;
        RETURN;
    END IF;
    IF run.last_sequence <> p_last_sequence THEN
        RETURN QUERY SELECT 'moved'::text, deleted;
        RETURN;
    END IF;
    IF NOT rein_is_redaction_of(run.input, p_input, p_fields)
       OR (run.projection - 'data') <> (p_projection - 'data')
       OR NOT rein_is_redaction_of(run.projection -> 'data', p_projection -> 'data', p_fields) THEN
        RAISE EXCEPTION 'run %: the input or projection given is not a redaction of %', p_run, p_fields;
    END IF;
    PERFORM set_config('rein.redacting', 'on', true);
    FOR item IN SELECT value FROM jsonb_array_elements(p_events) LOOP
        seq := (item ->> 'sequence')::bigint;
        SELECT payload INTO stored FROM rein_events WHERE run_id = p_run AND sequence = seq;
        IF NOT FOUND THEN
            SELECT payload INTO stored FROM rein_events_archive
            WHERE run_id = p_run AND sequence = seq;
            IF NOT FOUND THEN
                RAISE EXCEPTION 'run %: no event %', p_run, seq;
            END IF;
        END IF;
        IF (stored - 'data') <> ((item -> 'payload') - 'data')
           OR NOT rein_is_redaction_of(stored -> 'data', item -> 'payload' -> 'data', p_fields) THEN
            RAISE EXCEPTION 'run % event %: the payload given is not a redaction of %', p_run, seq, p_fields;
        END IF;
        UPDATE rein_events SET payload = item -> 'payload' WHERE run_id = p_run AND sequence = seq;
        UPDATE rein_events_archive SET payload = item -> 'payload'
        WHERE run_id = p_run AND sequence = seq;
    END LOOP;
    FOR item IN SELECT value FROM jsonb_array_elements(p_checkpoints) LOOP
        seq := (item ->> 'sequence')::bigint;
        SELECT state INTO stored FROM rein_checkpoints WHERE run_id = p_run AND sequence = seq;
        IF NOT FOUND
           OR (stored - 'data') <> ((item -> 'state') - 'data')
           OR NOT rein_is_redaction_of(stored -> 'data', item -> 'state' -> 'data', p_fields) THEN
            RAISE EXCEPTION 'run % checkpoint %: the state given is not a redaction of %', p_run, seq, p_fields;
        END IF;
        UPDATE rein_checkpoints SET state = item -> 'state' WHERE run_id = p_run AND sequence = seq;
    END LOOP;
    UPDATE rein_runs SET input = p_input, projection = p_projection WHERE run_id = p_run;
    IF run.status = 'terminal' THEN
        WITH gone AS (
            DELETE FROM rein_blobs b
            WHERE b.sha256 IN (SELECT f.sha256 FROM rein_blob_refs f WHERE f.run_id = p_run)
              AND NOT EXISTS (
                  SELECT 1 FROM rein_blob_refs o JOIN rein_runs r ON r.run_id = o.run_id
                  WHERE o.sha256 = b.sha256 AND o.run_id <> p_run
                    AND (r.status <> 'terminal'
                         OR NOT EXISTS (SELECT 1 FROM rein_redactions x WHERE x.run_id = o.run_id)))
            RETURNING b.sha256)
        SELECT COALESCE(array_agg(g.sha256 ORDER BY g.sha256), '{}') INTO deleted FROM gone g;
    END IF;
    INSERT INTO rein_redactions (run_id, fields, hashes, redacted_by, reason, blobs_deleted)
    VALUES (p_run, p_fields, p_hashes, p_by, p_reason, deleted);
    RETURN QUERY SELECT 'redacted'::text, deleted;
END $$;

REVOKE ALL ON FUNCTION rein_apply_redaction(uuid, bigint, text[], jsonb, jsonb, jsonb, jsonb, jsonb, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION rein_apply_redaction(uuid, bigint, text[], jsonb, jsonb, jsonb, jsonb, jsonb, text, text)
    TO rein_api_access;
