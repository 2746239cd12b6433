-- Contract step (run by `rein migrate --contract` only, once no live member predates it).
-- Releases before the engine protocol column created runs without naming it, so it was added
-- with a default. Every writer of this release states the protocol of the run it creates
-- (a new run and a fan-out child 1, a fork the protocol of RUN_FORKED), so the default goes:
-- a writer that does not know protocols can no longer create a run a newer worker would read
-- as protocol 1 without anyone having said so.
ALTER TABLE rein_runs ALTER COLUMN protocol DROP DEFAULT;
