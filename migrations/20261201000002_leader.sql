-- Leader leases (SPEC S3): which scheduler does the periodic scanning. Efficiency only: every
-- firing is a fenced commit, so two leaders at once would waste work, never break a run.
-- A small reference table (one row per lease name), not keyed by run_id.
CREATE TABLE rein_leader_leases (
    name           text        PRIMARY KEY,
    holder         text        NOT NULL,
    -- Bumped on every change of holder (and when a holder comes back after its lease lapsed).
    fencing_token  bigint      NOT NULL CHECK (fencing_token > 0),
    acquired_at    timestamptz NOT NULL,
    renewed_at     timestamptz NOT NULL,
    -- By the database clock; the lease is held while expires_at > clock_timestamp().
    expires_at     timestamptz NOT NULL
);

GRANT SELECT, INSERT, UPDATE ON rein_leader_leases TO rein_runtime;
GRANT SELECT ON rein_leader_leases TO rein_api_access;
