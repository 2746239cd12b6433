-- Who may change what runs (SPEC Z4): publishing a definition version is its own privilege
-- and records who did it, and each definition name has a current version, the one runs
-- enqueued without a version (and fan-out branches naming none) start with. Registering a
-- version no longer changes what those runs get; moving the pointer does.

-- Who registered the version: an API token's subject, the `--as` name of the CLI on the
-- database, `rein` for the built-ins a binary ships. NULL: registered before this column.
ALTER TABLE rein_definitions ADD COLUMN registered_by text;

CREATE TABLE rein_definition_current (
    name        text        PRIMARY KEY,
    version     integer     NOT NULL,
    -- Who moved the pointer last (as `registered_by`); `rein` while the built-in a binary
    -- ships holds it; NULL for the pointers this migration set.
    moved_by    text,
    moved_at    timestamptz NOT NULL DEFAULT now(),
    -- Deleting the version it names deletes the pointer: the name then has no current
    -- version until one is named.
    FOREIGN KEY (name, version) REFERENCES rein_definitions (name, version) ON DELETE CASCADE
);

-- Until now an enqueue without a version took the highest one: that stays what those names
-- run until someone moves the pointer. (`rein migrate` then points each built-in name at
-- the version its binary ships.)
INSERT INTO rein_definition_current (name, version)
SELECT name, max(version) FROM rein_definitions GROUP BY name;

-- Who enqueued a run (SPEC H1 separation of duties): the token's subject, the `--as` name of
-- the CLI on the database; a fan-out branch records its parent's. NULL: created before this
-- column, or by code that named nobody.
ALTER TABLE rein_runs ADD COLUMN enqueued_by text;

-- Every process resolves the pointer; the API registers versions and moves pointers.
GRANT SELECT ON rein_definition_current TO rein_runtime, rein_api_access;
GRANT INSERT, UPDATE ON rein_definition_current TO rein_api_access;
