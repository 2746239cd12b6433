-- Event history leaves by partitions (SPEC L2). rein_events and rein_events_archive become
-- tables partitioned by ranges of run_id: PostgreSQL wants the partition key inside every
-- unique constraint, and both keys start with run_id. Run ids are UUIDv7, so a range of ids
-- is a range of creation times, and one partition holds the runs created in one calendar
-- month (UTC); a branch's child carries its root's time prefix and falls in the same month.
-- A month whose runs have all ended long enough ago moves from rein_events to
-- rein_events_archive by detaching and attaching its partition: catalog changes, not a
-- delete and an insert per event (`rein retention detach`).
--
-- What a table that already holds events becomes: its rows stay where they are, in a
-- partition `rein_events_before` for the ids below the moment this migration ran. The few
-- rows of ids above it (branch children of releases before this one have hashed ids,
-- spread over the whole range) go to the default partition `rein_events_other`, which takes
-- any id no month holds. Attaching the old table checks its rows once, under an exclusive
-- lock: on a large log this takes as long as reading it (about a second per GB).
--
-- Expand only: the tables keep their names, columns, keys, triggers and grants, so binaries
-- of the release before this one read and write them as before (their statements are
-- planned again against the new tables).

-- The lowest UUIDv7 of the millisecond `at`: where the ids of runs created from then on start.
CREATE FUNCTION rein_uuid_at(at timestamptz) RETURNS uuid
LANGUAGE sql STABLE AS $$
    SELECT (lpad(to_hex(floor(extract(epoch FROM at) * 1000)::bigint), 12, '0')
            || repeat('0', 20))::uuid
$$;

-- Each partition of rein_events and rein_events_archive: its range of run ids (lo NULL: from
-- the lowest; both NULL: the default partition), the month of creation it holds, and which
-- table it is attached to now.
CREATE TABLE rein_event_ranges (
    name      text        PRIMARY KEY,
    lo        uuid,
    hi        uuid,
    month     date,
    place     text        NOT NULL CHECK (place IN ('hot', 'archive')),
    added_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    moved_at  timestamptz,
    CHECK (lo IS NULL OR hi IS NULL OR lo < hi)
);

DO $$
DECLARE
    cut uuid := rein_uuid_at(clock_timestamp());
    t record;
    kept boolean;
    empty text[] := '{}';
    gone text;
BEGIN
    FOR t IN SELECT * FROM (VALUES ('rein_events', 'rein_events_before', 'rein_events_other'),
                                   ('rein_events_archive', 'rein_events_archive_before',
                                    'rein_events_archive_other')) AS x(tab, before, other)
    LOOP
        EXECUTE format('ALTER TABLE %I RENAME TO %I', t.tab, t.before);
        EXECUTE format('ALTER INDEX %I RENAME TO %I', t.tab || '_pkey', t.before || '_pkey');
        EXECUTE format('ALTER INDEX %I RENAME TO %I', t.tab || '_run_id_event_id_key',
                       t.before || '_run_id_event_id_key');
        EXECUTE format('CREATE TABLE %I (LIKE %I INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                       'INCLUDING STORAGE) PARTITION BY RANGE (run_id)', t.tab, t.before);
        EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I PRIMARY KEY (run_id, sequence), '
                       'ADD CONSTRAINT %I UNIQUE (run_id, event_id)',
                       t.tab, t.tab || '_pkey', t.tab || '_run_id_event_id_key');
        -- One name for the check in both tables: a month's partition moves from one to the
        -- other, and attaching wants the names of its checks to match.
        IF t.tab <> 'rein_events' THEN
            EXECUTE format('ALTER TABLE %I RENAME CONSTRAINT %I TO rein_events_sequence_check',
                           t.tab, t.tab || '_sequence_check');
            EXECUTE format('ALTER TABLE %I RENAME CONSTRAINT %I TO rein_events_sequence_check',
                           t.before, t.tab || '_sequence_check');
        END IF;
        -- The same triggers, now on the partitioned table (each partition gets a clone).
        EXECUTE (SELECT string_agg(format('DROP TRIGGER %I ON %I; ', g.tgname, t.before)
                                   || replace(pg_get_triggerdef(g.oid),
                                              ' ON public.' || t.before || ' ',
                                              ' ON ' || t.tab || ' ') || '; ', '')
                 FROM pg_trigger g
                 WHERE g.tgrelid = t.before::regclass AND NOT g.tgisinternal);
        EXECUTE format('CREATE TABLE %I PARTITION OF %I DEFAULT', t.other, t.tab);
        EXECUTE format('WITH moved AS (DELETE FROM %I WHERE run_id >= %L RETURNING *) '
                       'INSERT INTO %I SELECT * FROM moved', t.before, cut, t.other);
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I)', t.before) INTO kept;
        IF kept THEN
            EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES FROM (MINVALUE) TO (%L)',
                           t.tab, t.before, cut);
            INSERT INTO rein_event_ranges (name, lo, hi, place)
            VALUES (t.before, NULL, cut, CASE WHEN t.tab = 'rein_events' THEN 'hot' ELSE 'archive' END);
        ELSE
            -- Nothing to keep: every month from the first one gets a partition of its own.
            empty := empty || t.before;
        END IF;
        INSERT INTO rein_event_ranges (name, lo, hi, place)
        VALUES (t.other, NULL, NULL, CASE WHEN t.tab = 'rein_events' THEN 'hot' ELSE 'archive' END);
    END LOOP;
    -- The view named its tables by identity, so it followed them under their old names.
    CREATE OR REPLACE VIEW rein_events_all AS
        SELECT run_id, sequence, event_id, type, payload, node, schema_version, fencing_token,
               worker, occurred_at, sender
        FROM rein_events
        UNION ALL
        SELECT run_id, sequence, event_id, type, payload, node, schema_version, fencing_token,
               worker, occurred_at, sender
        FROM rein_events_archive;
    FOREACH gone IN ARRAY empty LOOP
        EXECUTE format('DROP TABLE %I', gone);
    END LOOP;
END $$;

-- Partitions are reached through their table, whose grants are checked instead.
DO $$
BEGIN
    IF to_regclass('rein_events_before') IS NOT NULL THEN
        REVOKE ALL ON rein_events_before FROM rein_runtime, rein_api_access;
    END IF;
    IF to_regclass('rein_events_archive_before') IS NOT NULL THEN
        REVOKE ALL ON rein_events_archive_before FROM rein_runtime, rein_api_access;
    END IF;
END $$;
GRANT SELECT, INSERT ON rein_events TO rein_runtime, rein_api_access;
GRANT SELECT ON rein_events_archive TO rein_runtime, rein_api_access;
GRANT SELECT ON rein_event_ranges TO rein_runtime, rein_api_access;

-- The partition of rein_events for the month (UTC) that holds `at`, made unless it exists
-- or the range kept from before partitioning covers the whole month: returns its name, or
-- NULL when nothing was made. Rows the default partition holds in its range move into it
-- first. Runs as the schema owner, so the scheduler may call it ahead of each month.
CREATE FUNCTION rein_events_add_month(at timestamptz) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    m date := date_trunc('month', at AT TIME ZONE 'UTC')::date;
    lo uuid := rein_uuid_at(m::timestamp AT TIME ZONE 'UTC');
    hi uuid := rein_uuid_at((m + interval '1 month')::timestamp AT TIME ZONE 'UTC');
    part text := 'rein_events_' || to_char(m, 'YYYYMM');
    floor uuid;
BEGIN
    IF at IS NULL THEN
        RAISE EXCEPTION 'rein_events_add_month: give the moment whose month needs a partition';
    END IF;
    -- One maker at a time; the second finds the first's partition.
    PERFORM pg_advisory_xact_lock(hashtext('rein_events_add_month'));
    IF EXISTS (SELECT 1 FROM rein_event_ranges r WHERE r.name IN (part, 'rein_events_archive_' || to_char(m, 'YYYYMM'))) THEN
        RETURN NULL;
    END IF;
    SELECT r.hi INTO floor FROM rein_event_ranges r
    WHERE r.name = 'rein_events_before';
    IF floor IS NOT NULL AND floor >= hi THEN
        RETURN NULL;
    END IF;
    IF floor IS NOT NULL AND floor > lo THEN
        lo := floor;
    END IF;
    EXECUTE format('CREATE TABLE %I (LIKE rein_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS '
                   'INCLUDING STORAGE)', part);
    -- Kept through a move to the archive: attaching there needs no scan of the partition.
    EXECUTE format('ALTER TABLE %I ADD CONSTRAINT %I CHECK (run_id >= %L AND run_id < %L)',
                   part, part || '_range', lo, hi);
    EXECUTE format('WITH moved AS (DELETE FROM rein_events_other WHERE run_id >= %L AND run_id < %L '
                   'RETURNING *) INSERT INTO %I SELECT * FROM moved', lo, hi, part);
    EXECUTE format('ALTER TABLE rein_events ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                   part, lo, hi);
    INSERT INTO rein_event_ranges (name, lo, hi, month, place) VALUES (part, lo, hi, m, 'hot');
    RETURN part;
END $$;
REVOKE ALL ON FUNCTION rein_events_add_month(timestamptz) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION rein_events_add_month(timestamptz) TO rein_runtime;

-- This month and the next two have partitions from the start.
SELECT rein_events_add_month(clock_timestamp() + n * interval '1 month') FROM generate_series(0, 2) AS n;

-- Moves the month partition `part` from rein_events to rein_events_archive, once every run in
-- its range has ended before `cutoff`: returns how many runs it holds, or raises naming a run
-- that holds it back. Events of runs archived one by one meanwhile (`rein retention archive`)
-- join it from the archive's default partition. Runs as the schema owner. Commits refuse runs
-- of a moved range (commit.sql), as they refuse a run archived alone.
CREATE FUNCTION rein_events_archive_month(part text, cutoff timestamptz) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    r rein_event_ranges%ROWTYPE;
    blocker record;
    runs bigint;
    target text;
BEGIN
    SELECT * INTO r FROM rein_event_ranges g WHERE g.name = part FOR UPDATE;
    IF NOT FOUND OR r.month IS NULL THEN
        RAISE EXCEPTION 'no month partition of rein_events is named %', part
            USING HINT = 'rein retention detach --dry-run lists them';
    END IF;
    IF r.place <> 'hot' THEN
        RAISE EXCEPTION '% is in the archive already', part;
    END IF;
    FOR pass IN 1..2 LOOP
        SELECT x.run_id, x.status, x.finished_at INTO blocker FROM rein_runs x
        WHERE x.run_id >= r.lo AND x.run_id < r.hi
          AND (x.status <> 'terminal' OR x.finished_at IS NULL OR x.finished_at >= cutoff)
        LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'run % of % has not ended before %: it is %, finished %',
                blocker.run_id, part, cutoff, blocker.status, COALESCE(blocker.finished_at::text, 'not yet')
                USING HINT = 'a month moves once all its runs ended before the cutoff: wait, or cancel the run';
        END IF;
        IF pass = 1 THEN
            -- From here on no statement writes rein_events until this one commits; the
            -- second look sees every run as the move leaves it.
            LOCK TABLE rein_events IN ACCESS EXCLUSIVE MODE;
        END IF;
    END LOOP;
    SELECT count(*) INTO runs FROM rein_runs x WHERE x.run_id >= r.lo AND x.run_id < r.hi;
    target := 'rein_events_archive_' || to_char(r.month, 'YYYYMM');
    EXECUTE format('ALTER TABLE rein_events DETACH PARTITION %I', part);
    EXECUTE format('ALTER TABLE %I RENAME TO %I', part, target);
    EXECUTE format('WITH moved AS (DELETE FROM rein_events_archive_other WHERE run_id >= %L '
                   'AND run_id < %L RETURNING *) INSERT INTO %I SELECT * FROM moved',
                   r.lo, r.hi, target);
    EXECUTE format('ALTER TABLE rein_events_archive ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                   target, r.lo, r.hi);
    UPDATE rein_event_ranges g SET name = target, place = 'archive', moved_at = clock_timestamp()
    WHERE g.name = part;
    RETURN runs;
END $$;
REVOKE ALL ON FUNCTION rein_events_archive_month(text, timestamptz) FROM PUBLIC;
