-- Contract step (run by `rein migrate --contract` only, once no live member predates it).
-- Every writer of this release records the blob references its commits store or find
-- (commit.sql, `blob_refs`); the trigger kept for releases that did not goes.
DROP TRIGGER IF EXISTS rein_blob_refs_events ON rein_events;
DROP FUNCTION IF EXISTS rein_blob_refs_on_event();
