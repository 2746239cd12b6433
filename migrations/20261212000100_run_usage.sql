-- What each run's model calls used, by model: the sums of the `usage` its MODEL_REPLIED
-- events record, so that every run shows its tokens and cost, budget or not. Derived from
-- the log, never part of the projection: `verify` recomputes the sums from the events
-- (rein_core::model_usage, the same rules) and reports a difference.
--
-- The insert of the event adds it up (a trigger, in the commit's own transaction), so
-- every writer keeps it: this release's commit statement, the releases before it still
-- running beside it, a fork's first commit. Rows of runs recorded before are added up from
-- their logs below, once; the fields those logs never held (reasoning and cached tokens)
-- stay NULL.
--
-- A count counts when it is a whole number from 0 to bigint's largest, a cost when it is a
-- number from 0 to 1e300; sums stop at those ceilings. A malformed number is left out
-- rather than failing the commit that records the reply.
CREATE TABLE rein_run_usage (
    run_id           uuid             NOT NULL,
    -- The model the definition asked for (the event's requested_model); '' when none.
    model            text             NOT NULL,
    calls            bigint           NOT NULL,
    input_tokens     bigint           NOT NULL,
    output_tokens    bigint           NOT NULL,
    -- NULL until a call reports them.
    reasoning_tokens bigint,
    cached_tokens    bigint,
    -- NULL when no reply was priced (the model has no `price`).
    cost             double precision,
    PRIMARY KEY (run_id, model)
);

CREATE FUNCTION rein_usage_count(v jsonb) RETURNS numeric
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN jsonb_typeof(v) = 'number'
                 AND v::numeric >= 0
                 AND v::numeric <= 9223372036854775807
                 AND v::numeric = trunc(v::numeric)
           THEN v::numeric END
$$;

CREATE FUNCTION rein_usage_cost(v jsonb) RETURNS numeric
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN jsonb_typeof(v) = 'number' AND v::numeric >= 0 AND v::numeric <= 1e300
           THEN v::numeric END
$$;

-- A sum held at its ceiling; NULL stays NULL (which least() alone would not keep).
CREATE FUNCTION rein_usage_capped(v numeric, ceiling numeric) RETURNS numeric
LANGUAGE sql IMMUTABLE STRICT AS $$ SELECT least(v, ceiling) $$;

CREATE FUNCTION rein_usage_model(payload jsonb) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN jsonb_typeof(payload -> 'requested_model') = 'string'
           THEN payload ->> 'requested_model' ELSE '' END
$$;

CREATE FUNCTION rein_run_usage_on_event() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    u jsonb := NEW.payload -> 'usage';
BEGIN
    INSERT INTO rein_run_usage AS r (run_id, model, calls, input_tokens, output_tokens,
                                     reasoning_tokens, cached_tokens, cost)
    VALUES (NEW.run_id, rein_usage_model(NEW.payload), 1,
            coalesce(rein_usage_count(u -> 'input_tokens'), 0),
            coalesce(rein_usage_count(u -> 'output_tokens'), 0),
            rein_usage_count(u -> 'reasoning_tokens'),
            rein_usage_count(u -> 'cached_tokens'),
            rein_usage_cost(u -> 'cost'))
    ON CONFLICT (run_id, model) DO UPDATE SET
        calls = least(r.calls::numeric + 1, 9223372036854775807),
        input_tokens = least(r.input_tokens::numeric + EXCLUDED.input_tokens, 9223372036854775807),
        output_tokens = least(r.output_tokens::numeric + EXCLUDED.output_tokens, 9223372036854775807),
        reasoning_tokens = CASE WHEN r.reasoning_tokens IS NULL THEN EXCLUDED.reasoning_tokens
                                WHEN EXCLUDED.reasoning_tokens IS NULL THEN r.reasoning_tokens
                                ELSE least(r.reasoning_tokens::numeric + EXCLUDED.reasoning_tokens,
                                           9223372036854775807) END,
        cached_tokens = CASE WHEN r.cached_tokens IS NULL THEN EXCLUDED.cached_tokens
                             WHEN EXCLUDED.cached_tokens IS NULL THEN r.cached_tokens
                             ELSE least(r.cached_tokens::numeric + EXCLUDED.cached_tokens,
                                        9223372036854775807) END,
        cost = CASE WHEN r.cost IS NULL THEN EXCLUDED.cost
                    WHEN EXCLUDED.cost IS NULL THEN r.cost
                    ELSE least(r.cost + EXCLUDED.cost, 1e300) END;
    RETURN NULL;
END $$;

CREATE TRIGGER rein_run_usage_events AFTER INSERT ON rein_events
    FOR EACH ROW WHEN (NEW.type = 'MODEL_REPLIED')
    EXECUTE FUNCTION rein_run_usage_on_event();

-- The runs recorded before: their logs, hot and archived, added up once.
INSERT INTO rein_run_usage (run_id, model, calls, input_tokens, output_tokens,
                            reasoning_tokens, cached_tokens, cost)
SELECT run_id, rein_usage_model(payload),
       rein_usage_capped(count(*), 9223372036854775807),
       rein_usage_capped(coalesce(sum(rein_usage_count(payload -> 'usage' -> 'input_tokens')), 0),
                         9223372036854775807),
       rein_usage_capped(coalesce(sum(rein_usage_count(payload -> 'usage' -> 'output_tokens')), 0),
                         9223372036854775807),
       rein_usage_capped(sum(rein_usage_count(payload -> 'usage' -> 'reasoning_tokens')),
                         9223372036854775807),
       rein_usage_capped(sum(rein_usage_count(payload -> 'usage' -> 'cached_tokens')),
                         9223372036854775807),
       rein_usage_capped(sum(rein_usage_cost(payload -> 'usage' -> 'cost')), 1e300)
FROM rein_events_all
WHERE type = 'MODEL_REPLIED'
GROUP BY run_id, rein_usage_model(payload);

GRANT SELECT ON rein_run_usage TO rein_runtime, rein_api_access;
