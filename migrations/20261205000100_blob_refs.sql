-- Which runs refer to which blobs (SPEC E5), so `GET /v1/blobs/{sha256}` answers a token
-- only for a blob some run it may read refers to, with one index probe instead of a scan of
-- every payload. Keyed by (sha256, run_id): the lookup goes by hash, and a run refers to a
-- blob once however many of its events do.
--
-- Filled by a trigger on the engine's own events (sender IS NULL), the only writers of
-- blob references: a top-level payload value `{"$blob": {"sha256": H, ...}}` (a large
-- result, reply or argument list) and the prompt record of MODEL_REPLIED (`prompt.new`, the
-- hashes of the messages it stored). A reference written into a payload sent from outside
-- is not counted, so knowing a hash and being able to send to some run reads nothing.
-- Rows outlive an archived log (the run still refers to the blob).
CREATE TABLE rein_blob_refs (
    sha256  text NOT NULL CHECK (length(sha256) = 64),
    run_id  uuid NOT NULL,
    PRIMARY KEY (sha256, run_id)
);

CREATE FUNCTION rein_blob_refs_on_event() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    INSERT INTO rein_blob_refs (sha256, run_id)
    SELECT DISTINCT r.h, NEW.run_id
    FROM (
        SELECT jsonb_path_query(NEW.payload, '$.*."$blob".sha256') #>> '{}' AS h
        UNION ALL
        SELECT jsonb_path_query(NEW.payload, '$.prompt.new[*]') #>> '{}'
        WHERE NEW.type = 'MODEL_REPLIED'
    ) r
    WHERE r.h ~ '^[0-9a-f]{64}$'
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END $$;

-- Events without a reference pay only this WHEN clause.
CREATE TRIGGER rein_blob_refs_events AFTER INSERT ON rein_events
    FOR EACH ROW
    WHEN (NEW.sender IS NULL
          AND (NEW.type = 'MODEL_REPLIED' OR NEW.payload @? '$.*."$blob"'))
    EXECUTE FUNCTION rein_blob_refs_on_event();

-- The references already in the logs, hot and archived.
INSERT INTO rein_blob_refs (sha256, run_id)
SELECT DISTINCT r.h, r.run_id
FROM (
    SELECT e.run_id, jsonb_path_query(e.payload, '$.*."$blob".sha256') #>> '{}' AS h
    FROM rein_events_all e
    WHERE e.sender IS NULL AND e.payload @? '$.*."$blob"'
    UNION ALL
    SELECT e.run_id, jsonb_path_query(e.payload, '$.prompt.new[*]') #>> '{}'
    FROM rein_events_all e
    WHERE e.sender IS NULL AND e.type = 'MODEL_REPLIED'
) r
WHERE r.h ~ '^[0-9a-f]{64}$'
ON CONFLICT DO NOTHING;

-- Only the trigger writes references; the API reads them to authorise a blob read.
GRANT SELECT ON rein_blob_refs TO rein_runtime, rein_api_access;
