-- The API runs the commit statement too (what it sends to a run without a lease, a fork's
-- first event), and that statement now records blob references itself: PostgreSQL checks
-- INSERT on every table a statement writes, even where it writes no row, so without this
-- grant every such commit by a `rein_api_access` login was refused. A fork also records the
-- references it reads through its source.
GRANT INSERT ON rein_blob_refs TO rein_api_access;
