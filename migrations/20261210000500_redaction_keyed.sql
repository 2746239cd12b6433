-- Keyed redaction markers: a marker is HMAC-SHA256 of the value under the deployment's
-- REIN_REDACTION_KEY, so a reader of the log cannot guess a value back by hashing
-- candidates. The marker's shape is unchanged, so `rein_apply_redaction` takes both kinds.
-- Markers written before stay as they are: `keyed` tells them apart (false for every
-- redaction recorded before this migration, and for one made by an older release).
--
-- Expand only: a new column with a default and a new function; older releases neither read
-- nor write them, and go on calling `rein_apply_redaction`.
ALTER TABLE rein_redactions ADD COLUMN keyed boolean NOT NULL DEFAULT false;

-- `rein_apply_redaction`, recording the redaction as keyed. The run's row stays locked by
-- the inner call until the transaction ends, so the newest record of the run is this one.
CREATE FUNCTION rein_apply_keyed_redaction(
    p_run uuid, p_last_sequence bigint, p_fields text[], p_input jsonb, p_projection jsonb,
    p_events jsonb, p_checkpoints jsonb, p_hashes jsonb, p_by text, p_reason text)
RETURNS TABLE (outcome text, blobs_deleted text[])
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    done record;
BEGIN
    SELECT * INTO done FROM rein_apply_redaction(p_run, p_last_sequence, p_fields, p_input,
        p_projection, p_events, p_checkpoints, p_hashes, p_by, p_reason);
    IF done.outcome = 'redacted' THEN
        UPDATE rein_redactions SET keyed = true
        WHERE run_id = p_run
          AND redacted_at = (SELECT max(redacted_at) FROM rein_redactions WHERE run_id = p_run);
    END IF;
    RETURN QUERY SELECT done.outcome, done.blobs_deleted;
END $$;

REVOKE ALL ON FUNCTION rein_apply_keyed_redaction(uuid, bigint, text[], jsonb, jsonb, jsonb, jsonb, jsonb, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION rein_apply_keyed_redaction(uuid, bigint, text[], jsonb, jsonb, jsonb, jsonb, jsonb, text, text)
    TO rein_api_access;
