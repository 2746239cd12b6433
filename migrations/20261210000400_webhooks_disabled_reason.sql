-- A scheduler disables a webhook whose URL its egress rules refuse (a metadata address, its
-- own database's or Redis' port, a host outside --webhook-allow), and says why here; its
-- pending deliveries fail with the same reason. NULL: removed by an operator, or live.
-- Webhooks stored before the rules are judged when a delivery of theirs is next due.
ALTER TABLE rein_webhooks ADD COLUMN disabled_reason text;

GRANT UPDATE (disabled_at, disabled_reason) ON rein_webhooks TO rein_runtime;
GRANT SELECT (disabled_reason) ON rein_webhooks TO rein_api_access;

-- A refusing receiver's answer is described (status and size), not quoted to operators:
-- errors recorded before quoted up to 256 bytes of its body, which are dropped here.
UPDATE rein_webhook_deliveries
SET last_error = regexp_replace(last_error, '^(the receiver answered [0-9]{3}[^:]*):.*$',
                                '\1 (body not shown)')
WHERE last_error LIKE 'the receiver answered %: %';
