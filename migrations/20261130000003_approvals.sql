-- Approval requests (SPEC H1–H4). A request names the exact action (tool + canonical
-- arguments + tool and policy versions, as `action_hash`); a grant covers only that action and
-- is used up by the commit that dispatches it (`consumed_at`, set in the same statement).
CREATE TABLE rein_approvals (
    approval_id  uuid        PRIMARY KEY,
    run_id       uuid        NOT NULL,
    node         text        NOT NULL,
    tool         text        NOT NULL,
    args         jsonb       NOT NULL,
    action_hash  text        NOT NULL,
    risk         text        NOT NULL DEFAULT 'normal',
    -- pending | granted | denied | void (superseded by a changed action)
    status       text        NOT NULL DEFAULT 'pending'
                 CHECK (status IN ('pending', 'granted', 'denied', 'void')),
    requested_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at   timestamptz NOT NULL,
    decided_by   text,
    decided_at   timestamptz,
    comment      text,
    consumed_at  timestamptz
);
CREATE INDEX rein_approvals_run ON rein_approvals (run_id);
CREATE INDEX rein_approvals_open ON rein_approvals (requested_at) WHERE status = 'pending';
