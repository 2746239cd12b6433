-- Rein's storage. Every table is keyed by run_id (first column of every primary key) so the
-- schema can be distributed by run_id with co-located tables. The one exception,
-- rein_enqueue_keys, maps client idempotency keys to runs and would be a reference table.

CREATE TABLE rein_definitions (
    name        text        NOT NULL,
    version     integer     NOT NULL CHECK (version > 0),
    hash        text        NOT NULL,
    body        jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, version)
);

CREATE TABLE rein_runs (
    run_id            uuid        PRIMARY KEY,
    definition        text        NOT NULL,
    version           integer     NOT NULL,
    state             text        NOT NULL,
    -- runnable | parked | needs_operator | terminal (SPEC M9); "leased" is lease_owner set.
    status            text        NOT NULL,
    projection        jsonb       NOT NULL,
    last_sequence     bigint      NOT NULL DEFAULT 0 CHECK (last_sequence >= 0),
    fencing_token     bigint      NOT NULL DEFAULT 0,
    lease_owner       text,
    lease_until       timestamptz,
    -- Next timer (retry backoff, waiting-state deadline, approval expiry) by the database clock.
    wake_at           timestamptz,
    priority          integer     NOT NULL DEFAULT 0,
    queue             text        NOT NULL DEFAULT 'default',
    input             jsonb       NOT NULL DEFAULT '{}'::jsonb,
    parent_run_id     uuid,
    terminal_reason   text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    -- When the run last became claimable; orders the queue (oldest first).
    ready_at          timestamptz NOT NULL DEFAULT now(),
    state_entered_at  timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz,
    CHECK ((lease_owner IS NULL) = (lease_until IS NULL))
);

-- What workers claim: runnable, unleased runs, by queue, priority and age.
CREATE INDEX rein_runs_claimable ON rein_runs (queue, priority DESC, ready_at)
    WHERE status = 'runnable' AND lease_owner IS NULL;
-- What the scheduler fires: timers of unleased runs.
CREATE INDEX rein_runs_timers ON rein_runs (wake_at) WHERE wake_at IS NOT NULL AND lease_owner IS NULL;
-- What the scheduler recovers: held leases, by expiry.
CREATE INDEX rein_runs_leases ON rein_runs (lease_until) WHERE lease_owner IS NOT NULL;
CREATE INDEX rein_runs_status ON rein_runs (status, definition);

CREATE TABLE rein_enqueue_keys (
    client_key  text        PRIMARY KEY,
    run_id      uuid        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- The log (SPEC E1, E2). Immutable: rows are only ever inserted.
CREATE TABLE rein_events (
    run_id          uuid        NOT NULL,
    sequence        bigint      NOT NULL CHECK (sequence > 0),
    event_id        uuid        NOT NULL,
    type            text        NOT NULL,
    payload         jsonb       NOT NULL DEFAULT '{}'::jsonb,
    node            text,
    schema_version  integer     NOT NULL DEFAULT 1,
    fencing_token   bigint      NOT NULL,
    worker          text        NOT NULL,
    occurred_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run_id, sequence),
    UNIQUE (run_id, event_id)
);

CREATE FUNCTION rein_events_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'rein_events is append-only (SPEC C3)';
END $$;
CREATE TRIGGER rein_events_no_update BEFORE UPDATE ON rein_events
    FOR EACH ROW EXECUTE FUNCTION rein_events_immutable();

-- Every grant of a fencing token (SPEC X3): a worker's claim or a lease-less writer taking
-- the token. at_sequence is the run's last sequence when the grant was made, so the grant in
-- force for event N is the one with the highest token among grants with at_sequence < N.
CREATE TABLE rein_lease_grants (
    run_id         uuid        NOT NULL,
    fencing_token  bigint      NOT NULL,
    worker         text        NOT NULL,
    at_sequence    bigint      NOT NULL,
    granted_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run_id, fencing_token)
);

-- Events sent while a worker holds the lease (SPEC X3a); the holder applies them.
CREATE TABLE rein_inbox (
    run_id      uuid        NOT NULL,
    id          bigint      GENERATED ALWAYS AS IDENTITY,
    event_id    uuid        NOT NULL,
    type        text        NOT NULL,
    payload     jsonb       NOT NULL DEFAULT '{}'::jsonb,
    sender      text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (run_id, id),
    UNIQUE (run_id, event_id)
);

-- Snapshots bound to (sequence, definition, version) (SPEC E4, C10).
CREATE TABLE rein_checkpoints (
    run_id      uuid        NOT NULL,
    sequence    bigint      NOT NULL,
    definition  text        NOT NULL,
    version     integer     NOT NULL,
    state       jsonb       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, sequence)
);

-- The side-effect ledger (SPEC C6), queryable by idempotency key.
CREATE TABLE rein_actions (
    run_id           uuid        NOT NULL,
    action_id        text        NOT NULL,
    node             text        NOT NULL,
    step             integer     NOT NULL,
    idempotency_key  text        NOT NULL,
    call_id          text,
    status           text        NOT NULL, -- DISPATCHED | SUCCEEDED | FAILED | IN_DOUBT
    tool             text,
    result           jsonb,
    result_hash      text,
    dispatched_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at      timestamptz,
    PRIMARY KEY (run_id, action_id)
);
CREATE INDEX rein_actions_key ON rein_actions (idempotency_key);

-- The built-in `sim` tool's external system: a payment-API-like store that applies an
-- effect once per idempotency key and records every application.
CREATE TABLE rein_sim_idempotency (
    idempotency_key  text        PRIMARY KEY,
    run_id           uuid        NOT NULL,
    result           jsonb       NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE rein_sim_effects (
    run_id           uuid        NOT NULL,
    id               bigint      GENERATED ALWAYS AS IDENTITY,
    node             text        NOT NULL,
    step             integer     NOT NULL,
    idempotency_key  text        NOT NULL,
    worker           text        NOT NULL,
    applied_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run_id, id)
);

-- Counters the fleet reports (fenced writes refused, ...), for chaos checks and metrics.
CREATE TABLE rein_counters (
    name   text   PRIMARY KEY,
    value  bigint NOT NULL DEFAULT 0
);

CREATE TABLE rein_workers (
    worker_id     text        PRIMARY KEY,
    role          text        NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    info          jsonb       NOT NULL DEFAULT '{}'::jsonb
);
