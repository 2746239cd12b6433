-- A scheduler claims at most a few due deliveries of one webhook at a time, so a receiver
-- that hangs holds only those few of its posting slots: the claim looks for each webhook's
-- earliest due deliveries, which this index finds without reading the ones delivered.
--
-- Expand only: a new index; older releases claim as before.
CREATE INDEX rein_webhook_deliveries_due_by_webhook
    ON rein_webhook_deliveries (webhook_id, next_attempt_at) WHERE status = 'pending';
