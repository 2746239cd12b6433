-- Least-privilege access for the two kinds of Rein process (SPEC Z1):
--   rein_runtime     workers and schedulers
--   rein_api_access  `rein api` (and the operator commands that go through it)
-- Both are NOLOGIN groups; login users are made members of them (deploy/compose/rein-roles.sql).
-- Neither may change the schema, delete or rewrite events, or truncate anything; only
-- rein_api_access may read API tokens.
--
-- Rule for later migrations: a migration that creates a table or sequence grants what each
-- group needs on it in the same file (the schema test fails on a table granted to neither).

-- Roles are global to the server while grants are per database, and many databases on one
-- server may be migrated at once: create each group only when missing and accept losing the
-- race to another migration. Checking first also spares a role without CREATEROLE (the
-- deployment's rein_owner, for which the roles script made the groups) the attempt.
DO $$
DECLARE
    name text;
BEGIN
    FOREACH name IN ARRAY ARRAY['rein_runtime', 'rein_api_access'] LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = name) THEN
            BEGIN
                EXECUTE format('CREATE ROLE %I NOLOGIN', name);
            EXCEPTION WHEN duplicate_object OR unique_violation THEN
                NULL;
            END;
        END IF;
    END LOOP;
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO rein_runtime, rein_api_access',
                   current_database());
END
$$;

GRANT USAGE ON SCHEMA public TO rein_runtime, rein_api_access;

-- Schema version checks at start.
GRANT SELECT ON _sqlx_migrations TO rein_runtime, rein_api_access;

-- Both groups commit events (a worker under its lease; a scheduler, or the API delivering a
-- send or an approval, by taking the token), so both need what the commit statement touches:
-- events are INSERT only.
GRANT SELECT, INSERT ON rein_events, rein_lease_grants, rein_checkpoints
    TO rein_runtime, rein_api_access;
GRANT SELECT, UPDATE ON rein_runs TO rein_runtime, rein_api_access;
GRANT SELECT, INSERT, UPDATE ON rein_actions, rein_approvals, rein_counters
    TO rein_runtime, rein_api_access;
-- Inbox entries are deleted by the commit that applies them.
GRANT SELECT, INSERT, DELETE ON rein_inbox TO rein_runtime, rein_api_access;
GRANT SELECT ON rein_definitions TO rein_runtime, rein_api_access;

-- Workers run the built-in sim tools (an external system's ledger) and heartbeat.
GRANT SELECT, INSERT ON rein_sim_idempotency, rein_sim_effects TO rein_runtime;
GRANT SELECT, INSERT, UPDATE, DELETE ON rein_workers TO rein_runtime;

-- The API creates runs (enqueue, rerun) and definitions, shows sim effects and the fleet in
-- `why` and `workers`, and looks up bearer tokens.
GRANT INSERT ON rein_runs, rein_definitions TO rein_api_access;
GRANT SELECT, INSERT ON rein_enqueue_keys TO rein_api_access;
GRANT SELECT ON rein_sim_effects, rein_sim_idempotency, rein_workers, rein_tokens
    TO rein_api_access;

-- Identity columns (rein_inbox, rein_sim_effects) draw from sequences.
GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO rein_runtime, rein_api_access;
