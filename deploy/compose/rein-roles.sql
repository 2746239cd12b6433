-- Least-privilege PostgreSQL roles for one Rein database.
--
-- Run once as a superuser (or a role with CREATEROLE that may change the database's owner),
-- connected to the Rein database:
--
--   psql -v ON_ERROR_STOP=1 -d rein \
--        -v dbname=rein \
--        -v owner_password='...' -v worker_password='...' -v api_password='...' \
--        -f deploy/compose/rein-roles.sql
--
-- Safe to run again: roles are created only when missing; passwords are set every time.
--
--   rein_owner       LOGIN   owns the database and its public schema; runs `rein migrate`.
--   rein_runtime     NOLOGIN group for workers and schedulers.
--   rein_api_access  NOLOGIN group for `rein api`.
--   rein_worker      LOGIN   member of rein_runtime (workers and schedulers log in as it).
--   rein_api         LOGIN   member of rein_api_access.
--
-- What the two groups may do on Rein's tables is granted by a Rein migration (run by
-- rein_owner). The groups are created here as well, so that the migration finds them and
-- rein_owner needs no CREATEROLE.

\set ON_ERROR_STOP on

DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'rein_runtime') THEN
        CREATE ROLE rein_runtime NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'rein_api_access') THEN
        CREATE ROLE rein_api_access NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'rein_owner') THEN
        CREATE ROLE rein_owner LOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'rein_worker') THEN
        CREATE ROLE rein_worker LOGIN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'rein_api') THEN
        CREATE ROLE rein_api LOGIN;
    END IF;
END
$$;

-- Passwords come from psql variables (quoted by format %L, never pasted into SQL text).
SELECT format('ALTER ROLE rein_owner  WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD %L', :'owner_password') \gexec
SELECT format('ALTER ROLE rein_worker WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD %L', :'worker_password') \gexec
SELECT format('ALTER ROLE rein_api    WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD %L', :'api_password') \gexec

GRANT rein_runtime TO rein_worker;
GRANT rein_api_access TO rein_api;

-- The owner owns the database and the schema the migrations write to.
ALTER DATABASE :"dbname" OWNER TO rein_owner;
ALTER SCHEMA public OWNER TO rein_owner;

-- Nobody else creates objects or connects unless granted (PostgreSQL 14 and older let every
-- role create in public and connect to every database).
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
REVOKE ALL ON DATABASE :"dbname" FROM PUBLIC;
GRANT CONNECT ON DATABASE :"dbname" TO rein_runtime, rein_api_access;
GRANT USAGE ON SCHEMA public TO rein_runtime, rein_api_access;
