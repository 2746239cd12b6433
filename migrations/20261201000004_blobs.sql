-- Large payload values (SPEC E5), stored once by content: an event keeps a reference
-- {"$blob": {"sha256", "bytes"}} in place of the value. Keyed by the sha256 of the value's
-- canonical JSON rather than by run_id, because identical prompts and results of many runs
-- share one row, which is the point of the table. Like rein_enqueue_keys it is a justified
-- exception to "every table is keyed by run_id": distributed, it is sharded by its own key
-- (a hash spreads evenly) and no statement joins it with a run-keyed table. Rows are never
-- updated; content is checked against the key whenever it is read.
CREATE TABLE rein_blobs (
    sha256      text        PRIMARY KEY CHECK (length(sha256) = 64),
    size_bytes  bigint      NOT NULL CHECK (size_bytes >= 0),
    content     bytea       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Workers store results, the API stores sent payloads; both read them back.
GRANT SELECT, INSERT ON rein_blobs TO rein_runtime, rein_api_access;
