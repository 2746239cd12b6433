-- A claim and every step that moves a run off its page rewrite the run's row with new index
-- entries (a non-HOT update), one in each index whose predicate the row meets. The index on
-- (status, definition) covered every run, so every claim paid for an entry in it, while
-- nothing reads it but the count of finished runs by definition (the fleet gauges): the
-- list and gauge queries on live runs filter in ways it cannot serve. A partial index on
-- finished runs serves that count and takes an entry only when a run ends. `rein bench`
-- measured the claim's statement time per claimed run about a quarter lower without it.
CREATE INDEX rein_runs_finished_by_definition ON rein_runs (definition)
    WHERE status = 'terminal';
DROP INDEX rein_runs_status;
