-- The engine protocol a run's log needs (SPEC V1, rolling upgrades): the newest engine event
-- kinds it holds. 1: the events every release knows; 2: DEFINITION_MIGRATED and RUN_FORKED.
-- A worker claims only runs whose protocol it knows, so a binary of an older release never
-- picks up a run whose log it could not read. Added with a default: no table rewrite, and
-- binaries that predate the column keep working on the expanded schema.
ALTER TABLE rein_runs ADD COLUMN protocol smallint NOT NULL DEFAULT 1 CHECK (protocol >= 1);
