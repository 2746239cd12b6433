-- Every Rein connection runs its statements on generic plans (plan_cache_mode =
-- force_generic_plan), made at a statement's first use and kept until a relcache
-- invalidation. A plan made while rein_runs had never been analyzed and was nearly empty
-- scans the table where it should probe its primary key (the claim's UPDATE, the commit's
-- join to its runs), and keeps scanning as the table grows, until autovacuum's first ANALYZE,
-- a minute or more later. A leading scheduler calls this until it answers true: once
-- rein_runs holds `at_least` runs and has no statistics yet, it analyzes the tables a claim
-- and a commit read. That invalidates every connection's plans that read them, and each is
-- made again on the tables as they are now. Expand only.
CREATE FUNCTION rein_first_statistics(at_least bigint) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    -- reltuples is -1 until the first VACUUM or ANALYZE, by anyone.
    IF (SELECT c.reltuples >= 0 FROM pg_class c WHERE c.oid = 'rein_runs'::regclass) THEN
        RETURN true;
    END IF;
    IF (SELECT count(*) FROM (SELECT 1 FROM rein_runs LIMIT at_least) r) < at_least THEN
        RETURN false;
    END IF;
    ANALYZE rein_runs;
    ANALYZE rein_inbox;
    ANALYZE rein_lease_grants;
    RETURN true;
END $$;

REVOKE ALL ON FUNCTION rein_first_statistics(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION rein_first_statistics(bigint) TO rein_runtime;
