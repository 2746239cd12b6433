-- Signed webhook notifications for approvers and operators. Deliveries are an outbox filled
-- by triggers: the delivery row commits in the same transaction as the fact it announces, so
-- a crash loses none and a change that rolled back announces nothing. Schedulers POST them
-- (at least once; receivers deduplicate by delivery_id).

CREATE TABLE rein_webhooks (
    webhook_id  uuid        PRIMARY KEY,
    url         text        NOT NULL CHECK (octet_length(url) BETWEEN 1 AND 2048),
    -- HMAC-SHA256 key of the Rein-Signature header; never shown after it is added.
    secret      text        NOT NULL CHECK (octet_length(secret) BETWEEN 16 AND 1024),
    -- The kinds delivered; empty: every kind.
    kinds       text[]      NOT NULL DEFAULT '{}',
    -- NULL: runs of every definition (the deployment's hook); else only this definition's.
    definition  text,
    -- NULL: every queue.
    queue       text,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    created_by  text        NOT NULL,
    disabled_at timestamptz
);
CREATE INDEX rein_webhooks_live ON rein_webhooks (definition) WHERE disabled_at IS NULL;

CREATE TABLE rein_webhook_deliveries (
    -- The id a receiver deduplicates by (the body's `id`, header Rein-Delivery-Id).
    delivery_id      uuid        PRIMARY KEY,
    webhook_id       uuid        NOT NULL REFERENCES rein_webhooks (webhook_id),
    -- The fact announced (an event's id, a run's end): one delivery per fact and webhook.
    source_key       text        NOT NULL,
    kind             text        NOT NULL,
    run_id           uuid        NOT NULL,
    body             jsonb       NOT NULL,
    status           text        NOT NULL DEFAULT 'pending'
                     CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts         integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    -- A scheduler is posting it until then; past it, another may.
    claimed_until    timestamptz,
    last_status_code integer,
    last_error       text,
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    delivered_at     timestamptz,
    UNIQUE (webhook_id, source_key)
);
CREATE INDEX rein_webhook_deliveries_due ON rein_webhook_deliveries (next_attempt_at)
    WHERE status = 'pending';
CREATE INDEX rein_webhook_deliveries_recent ON rein_webhook_deliveries (created_at DESC);

-- Queues one delivery of `kind` about run `run` for every live webhook that wants it; the
-- body is `facts` plus the delivery's own id. Nothing when no webhook matches.
CREATE FUNCTION rein_webhooks_queue(fact_kind text, fact_key text, run rein_runs, facts jsonb)
RETURNS void LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    INSERT INTO rein_webhook_deliveries (delivery_id, webhook_id, source_key, kind, run_id, body)
    SELECT d.id, d.webhook_id, fact_key, fact_kind, run.run_id,
           jsonb_build_object('id', d.id, 'kind', fact_kind, 'run_id', run.run_id,
                              'definition', run.definition, 'version', run.version,
                              'queue', run.queue) || facts
    FROM (SELECT gen_random_uuid() AS id, w.webhook_id
          FROM rein_webhooks w
          WHERE w.disabled_at IS NULL
            AND (cardinality(w.kinds) = 0 OR fact_kind = ANY (w.kinds))
            AND (w.definition IS NULL OR w.definition = run.definition)
            AND (w.queue IS NULL OR w.queue = run.queue)) d
    ON CONFLICT (webhook_id, source_key) DO NOTHING
$$;

-- Approval facts from the log: a request (APPROVAL_REQUESTED), the scheduler's reminder and
-- expiry (engine events whose payload says `approval_reminder` / `approval_expired`), and a
-- decision (an approval event of the definition from a sender that decides approvals: its
-- payload carries the approver). A decision is announced when it reaches the run's log,
-- not when the request row changes: that change is undone when the decision cannot be
-- delivered, and a caller with the approve scope may send the event without a request row.
CREATE FUNCTION rein_webhooks_on_event() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    run rein_runs;
    approval rein_approvals;
    kind text;
    approval_status text;
    decider text;
    decision_comment text;
    wanted_id text := NEW.payload->>'approval_id';
BEGIN
    -- Checked before the block below, whose error handler costs a subtransaction.
    IF NOT EXISTS (SELECT 1 FROM rein_webhooks WHERE disabled_at IS NULL) THEN
        RETURN NULL;
    END IF;
    BEGIN
        SELECT * INTO run FROM rein_runs WHERE run_id = NEW.run_id;
        IF NOT FOUND THEN
            RETURN NULL;
        END IF;
        IF NEW.type = 'APPROVAL_REQUESTED' THEN
            kind := 'approval.requested';
        ELSIF NEW.sender IS NULL AND NEW.payload->>'reason' = 'approval_reminder' THEN
            kind := 'approval.reminder';
        ELSIF NEW.sender IS NULL AND NEW.payload->>'reason' = 'approval_expired' THEN
            kind := 'approval.expired';
            approval_status := 'expired';
        ELSIF NEW.sender IS NOT NULL AND NEW.payload ? 'approver' THEN
            SELECT CASE WHEN bool_or(NEW.type = COALESCE(s->'approval'->>'granted_event', 'APPROVED'))
                        THEN 'granted'
                        WHEN bool_or(NEW.type = COALESCE(s->'approval'->>'denied_event', 'REJECTED'))
                        THEN 'denied' END
            INTO approval_status
            FROM rein_definitions d, jsonb_array_elements(d.body->'states') s
            WHERE d.name = run.definition AND d.version = run.version AND s ? 'approval';
            IF approval_status IS NULL THEN
                RETURN NULL;
            END IF;
            kind := 'approval.decided';
            decider := NEW.payload->>'approver';
            decision_comment := NEW.payload->>'comment';
        ELSE
            RETURN NULL;
        END IF;
        IF wanted_id ~* '^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$' THEN
            SELECT * INTO approval FROM rein_approvals
            WHERE approval_id = wanted_id::uuid AND run_id = NEW.run_id;
        END IF;
        IF approval.approval_id IS NULL THEN
            SELECT * INTO approval FROM rein_approvals WHERE run_id = NEW.run_id
            ORDER BY requested_at DESC LIMIT 1;
        END IF;
        PERFORM rein_webhooks_queue(kind, NEW.event_id::text, run, jsonb_build_object(
            'occurred_at', NEW.occurred_at,
            'event', NEW.type,
            'sequence', NEW.sequence,
            'approval', jsonb_build_object(
                'approval_id', COALESCE(approval.approval_id::text, wanted_id),
                'node', COALESCE(approval.node, NEW.node),
                'tool', COALESCE(approval.tool, NEW.payload->>'tool'),
                'args', COALESCE(approval.args, NEW.payload->'args'),
                'action_hash', COALESCE(approval.action_hash, NEW.payload->>'action_hash'),
                'risk', approval.risk,
                'requested_at', approval.requested_at,
                'expires_at', approval.expires_at,
                'status', COALESCE(approval_status, approval.status),
                'decided_by', COALESCE(decider, approval.decided_by),
                'comment', COALESCE(decision_comment, approval.comment))));
    EXCEPTION WHEN OTHERS THEN
        -- A notification must never stop a run: the commit goes on without it.
        RAISE WARNING 'rein webhooks: no delivery queued for event % of run %: %',
            NEW.sequence, NEW.run_id, SQLERRM;
    END;
    RETURN NULL;
END $$;

-- Steps that are not approval facts pay only this WHEN clause.
CREATE TRIGGER rein_webhooks_events AFTER INSERT ON rein_events
    FOR EACH ROW
    WHEN (NEW.type = 'APPROVAL_REQUESTED'
          OR (NEW.sender IS NULL
              AND NEW.payload->>'reason' IN ('approval_reminder', 'approval_expired'))
          OR (NEW.sender IS NOT NULL AND NEW.payload ? 'approver'))
    EXECUTE FUNCTION rein_webhooks_on_event();

-- A run's end: `run.finished` when it succeeded, `run.failed` (status failed or cancelled)
-- otherwise, judged as rein_runs_finished_total judges it: cancelled when CANCEL ended it,
-- else the terminal state's declared outcome, else failed when the ending event carries an
-- error or is a backoff's exhausted event.
CREATE FUNCTION rein_webhooks_on_run_end() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    last_type text;
    last_payload jsonb;
    declared text;
    exhausted boolean;
    outcome text;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM rein_webhooks WHERE disabled_at IS NULL) THEN
        RETURN NULL;
    END IF;
    BEGIN
        SELECT type, payload INTO last_type, last_payload FROM rein_events
        WHERE run_id = NEW.run_id ORDER BY sequence DESC LIMIT 1;
        SELECT max(s->>'outcome') FILTER (WHERE s->>'name' = NEW.state),
               COALESCE(bool_or(s->'backoff'->>'exhausted' = last_type), false)
        INTO declared, exhausted
        FROM rein_definitions d, jsonb_array_elements(d.body->'states') s
        WHERE d.name = NEW.definition AND d.version = NEW.version;
        outcome := CASE
            WHEN last_type = 'CANCEL' THEN 'cancelled'
            WHEN declared IN ('succeeded', 'failed') THEN declared
            WHEN last_payload ? 'error' OR exhausted THEN 'failed'
            ELSE 'succeeded' END;
        PERFORM rein_webhooks_queue(
            CASE WHEN outcome = 'succeeded' THEN 'run.finished' ELSE 'run.failed' END,
            NEW.run_id::text || ':terminal', NEW, jsonb_build_object(
                'occurred_at', COALESCE(NEW.finished_at, clock_timestamp()),
                'status', outcome,
                'state', NEW.state,
                'terminal_reason', NEW.terminal_reason,
                'event', last_type));
    EXCEPTION WHEN OTHERS THEN
        RAISE WARNING 'rein webhooks: no delivery queued for the end of run %: %',
            NEW.run_id, SQLERRM;
    END;
    RETURN NULL;
END $$;

CREATE TRIGGER rein_webhooks_run_end AFTER UPDATE OF status ON rein_runs
    FOR EACH ROW
    WHEN (NEW.status = 'terminal' AND OLD.status IS DISTINCT FROM 'terminal')
    EXECUTE FUNCTION rein_webhooks_on_run_end();

-- Schedulers deliver (they read the secret to sign); the API lists webhooks without their
-- secrets and the deliveries. Deliveries are written by the triggers as the table owner.
GRANT SELECT ON rein_webhooks TO rein_runtime;
GRANT SELECT (webhook_id, url, kinds, definition, queue, created_at, created_by, disabled_at)
    ON rein_webhooks TO rein_api_access;
GRANT SELECT, UPDATE ON rein_webhook_deliveries TO rein_runtime;
GRANT SELECT ON rein_webhook_deliveries TO rein_api_access;

-- Only the triggers queue deliveries (Rein signs whatever is queued).
REVOKE EXECUTE ON FUNCTION rein_webhooks_queue(text, text, rein_runs, jsonb),
    rein_webhooks_on_event(), rein_webhooks_on_run_end() FROM PUBLIC;
