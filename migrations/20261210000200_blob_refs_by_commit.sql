-- A blob reference is recorded by the commit that stored the blob for the run, or found it
-- already stored while holding its content (SPEC E5): the commit inserts (sha256, run_id)
-- for the hashes it computed itself (commit.sql, `blob_refs`). It is no longer parsed out
-- of event payloads: a node that replied `{"$blob": {"sha256": H}}` with another run's hash
-- H got a reference to content it never had, and every reader trusted it.
--
-- Expand only. Releases before this one commit without recording references; the trigger
-- stays for them until the contract step drops it (contract/20261210000201), but records a
-- reference only for a blob row this very transaction wrote (its xmin), so a hash copied
-- from another run's events, whose row an earlier transaction wrote, records nothing. (An
-- older worker's batch could still pair a named hash with another run storing that blob for
-- the first time in the same statement; the namer would need the hash of content nobody had
-- stored yet.) What
-- an older worker found already stored (written by an earlier transaction) is not recorded
-- either: its run cannot read that blob back until a newer worker commits it again.

-- true: recorded by a commit (or by the trigger for a row its transaction wrote); NULL:
-- parsed from a payload before this release (see rein_blob_refs_to_review).
ALTER TABLE rein_blob_refs ADD COLUMN proven boolean;
ALTER TABLE rein_blob_refs ALTER COLUMN proven SET DEFAULT true;

CREATE OR REPLACE FUNCTION rein_blob_refs_on_event() RETURNS trigger
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
    JOIN rein_blobs b ON b.sha256 = r.h AND b.xmin = pg_current_xact_id()::xid
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END $$;

-- This release's commit statement says it records its references itself
-- (`rein.blob_refs = commit`, local to its transaction): the trigger leaves its events
-- alone, so even a payload naming a blob another run of the same statement stores gets
-- nothing.
DROP TRIGGER rein_blob_refs_events ON rein_events;
CREATE TRIGGER rein_blob_refs_events AFTER INSERT ON rein_events
    FOR EACH ROW
    WHEN (NEW.sender IS NULL
          AND current_setting('rein.blob_refs', true) IS DISTINCT FROM 'commit'
          AND (NEW.type = 'MODEL_REPLIED' OR NEW.payload @? '$.*."$blob"'))
    EXECUTE FUNCTION rein_blob_refs_on_event();

-- A run and the runs it was forked (or run again) from, nearest first, at most p_depth
-- steps up (FORK_DEPTH_MAX): whose references a reader of the run may resolve. A fan-out
-- branch is a run of its own and stops the walk.
CREATE FUNCTION rein_run_line(p_run uuid, p_depth int) RETURNS TABLE (run_id uuid)
LANGUAGE sql STABLE AS $$
    WITH RECURSIVE line AS (
        SELECT r.run_id, r.parent_run_id, r.branch IS NULL AS forked, 0 AS depth
        FROM rein_runs r WHERE r.run_id = p_run
        UNION ALL
        SELECT p.run_id, p.parent_run_id, p.branch IS NULL, l.depth + 1
        FROM line l JOIN rein_runs p ON p.run_id = l.parent_run_id
        WHERE l.forked AND l.depth < p_depth
    )
    SELECT line.run_id FROM line
$$;

-- The references recorded before this release that an operator should look at: a forged
-- reply left one only where the blob is also referred to from another queue, so these are
-- the references parsed from payloads whose run is in another queue than the run that
-- referred to the blob first, and that was not forked from it. Identical content stored by
-- runs of several queues (a shared system prompt) shows here too. After review: delete the
-- forged ones, then `UPDATE rein_blob_refs SET proven = true WHERE proven IS NULL`.
CREATE VIEW rein_blob_refs_to_review AS
SELECT f.sha256, f.run_id, r.queue, r.definition, r.created_at,
       first.run_id AS first_run_id, first.queue AS first_queue
FROM rein_blob_refs f
JOIN rein_runs r ON r.run_id = f.run_id
CROSS JOIN LATERAL (
    SELECT o.run_id, q.queue
    FROM rein_blob_refs o JOIN rein_runs q ON q.run_id = o.run_id
    WHERE o.sha256 = f.sha256
    ORDER BY q.created_at, o.run_id
    LIMIT 1
) first
WHERE f.proven IS NULL
  AND r.queue <> first.queue
  AND first.run_id NOT IN (SELECT l.run_id FROM rein_run_line(f.run_id, 32) l);

-- Workers' commits record references; the API only reads them.
GRANT INSERT ON rein_blob_refs TO rein_runtime;
GRANT EXECUTE ON FUNCTION rein_run_line(uuid, int) TO rein_runtime, rein_api_access;
GRANT SELECT ON rein_blob_refs_to_review TO rein_runtime, rein_api_access;
