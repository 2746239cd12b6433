//! Whole-database integrity audit for chaos and crash tests: every invariant a fleet must keep
//! (SPEC E2, E3, E4, X3, C6, C11, H1) counted with set-based queries, so a test can assert that a
//! run of the fleet under faults left nothing broken.

use serde::Serialize;
use sqlx::{FromRow, Row};
use uuid::Uuid;

use crate::{Store, StoreError, counters};

/// What [`Store::audit`] found. Every field but `runs`, `runs_terminal`, `unfinished` and
/// `fenced_writes_rejected` counts integrity violations; see
/// [`AuditReport::integrity_violations`] and [`AuditReport::violations`].
#[derive(Debug, Clone, Serialize, Default, PartialEq, Eq)]
pub struct AuditReport {
    pub runs: i64,
    pub runs_terminal: i64,
    /// The runs that are not terminal, by what they wait for: not a violation on a live
    /// database, where runs are queued, running and parked all the time.
    pub unfinished: Unfinished,
    /// Runs whose event sequences are not exactly `1..=last_sequence` (SPEC E2).
    pub sequence_gaps: i64,
    /// Events whose fencing token is not the token of the grant in force when they were
    /// written, or that have no grant in force at all (SPEC X3, C8, C9).
    pub stale_token_events: i64,
    /// Events whose fencing token is lower than an earlier event's of the same run: a token
    /// that went backwards (SPEC X3).
    pub token_regressions: i64,
    /// Writes refused by fencing, as the fleet counted them (evidence, not a violation).
    pub fenced_writes_rejected: i64,
    /// Extra applications of the sim side effect for the same (run, step) (SPEC C6).
    pub duplicate_effects: i64,
    /// Runs whose log does not replay to the stored projection (SPEC E3), or to one of the
    /// run's checkpoints at its sequence (SPEC E4, C10).
    pub replay_mismatches: i64,
    /// Terminal runs without a recorded reason (SPEC C11).
    pub terminal_without_reason: i64,
    /// Runs that ended by a denial and still had the side effect applied after it (SPEC H1).
    pub denied_but_applied: i64,
}

/// Runs not terminal yet, by status (the runnable ones split by whether a live lease is held).
#[derive(Debug, Clone, Copy, Serialize, Default, PartialEq, Eq, sqlx::FromRow)]
pub struct Unfinished {
    /// Runnable and waiting for a worker.
    pub queued: i64,
    /// Runnable under a live lease: a worker is on it.
    pub running: i64,
    /// Waiting for a timer, an event or an approval.
    pub parked: i64,
    /// Waiting for an operator (an in-doubt call, a rejected decision).
    pub needs_operator: i64,
}

impl Unfinished {
    pub fn total(&self) -> i64 {
        self.queued + self.running + self.parked + self.needs_operator
    }
}

impl AuditReport {
    /// Broken invariants: what no database, live or quiet, may ever hold.
    pub fn integrity_violations(&self) -> i64 {
        self.sequence_gaps
            + self.stale_token_events
            + self.token_regressions
            + self.duplicate_effects
            + self.replay_mismatches
            + self.terminal_without_reason
            + self.denied_but_applied
    }

    /// Every violation, non-terminal runs included: for a fleet that was meant to finish
    /// every run.
    pub fn violations(&self) -> i64 {
        self.integrity_violations() + (self.runs - self.runs_terminal)
    }
}

/// Runs by status, in one snapshot.
const RUN_TOTALS: &str = "
SELECT count(*) AS runs,
       count(*) FILTER (WHERE status = 'terminal') AS runs_terminal,
       count(*) FILTER (WHERE status = 'runnable'
                        AND NOT COALESCE(lease_until > clock_timestamp(), false)) AS queued,
       count(*) FILTER (WHERE status = 'runnable' AND lease_until > clock_timestamp()) AS running,
       count(*) FILTER (WHERE status = 'parked') AS parked,
       count(*) FILTER (WHERE status = 'needs_operator') AS needs_operator
FROM rein_runs";

/// Runs with event sequences other than exactly 1..=last_sequence. Sequences are positive and
/// unique per run, so count == max == last_sequence implies contiguity from 1.
const SEQUENCE_GAPS: &str = "
SELECT count(*)
FROM rein_runs r
LEFT JOIN (SELECT run_id, count(*) AS n, max(sequence) AS last
           FROM rein_events_all GROUP BY run_id) e USING (run_id)
WHERE COALESCE(e.n, 0) <> r.last_sequence OR COALESCE(e.last, 0) <> r.last_sequence";

/// The grant in force for event N is the one with the highest token among the run's grants
/// made at a sequence below N.
const STALE_TOKEN_EVENTS: &str = "
SELECT count(*)
FROM rein_events_all e
LEFT JOIN LATERAL (
    SELECT g.fencing_token FROM rein_lease_grants g
    WHERE g.run_id = e.run_id AND g.at_sequence < e.sequence
    ORDER BY g.fencing_token DESC LIMIT 1
) g ON true
WHERE g.fencing_token IS DISTINCT FROM e.fencing_token";

/// Events written under a lower token than one before them in the same run.
const TOKEN_REGRESSIONS: &str = "
SELECT count(*)
FROM (SELECT fencing_token < max(fencing_token) OVER (
                 PARTITION BY run_id ORDER BY sequence
                 ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS back
      FROM rein_events_all) e
WHERE back";

const DUPLICATE_EFFECTS: &str = "
SELECT COALESCE(sum(n - 1), 0)::bigint
FROM (SELECT count(*) AS n FROM rein_sim_effects GROUP BY run_id, step HAVING count(*) > 1) d";

const TERMINAL_WITHOUT_REASON: &str = "
SELECT count(*) FROM rein_runs
WHERE status = 'terminal' AND (terminal_reason IS NULL OR terminal_reason = '')";

/// A denial (`approval_denied`, `REJECTED`) sends the run to a terminal state, so a run that
/// ended there must have no effect applied after the denial.
const DENIED_BUT_APPLIED: &str = "
SELECT count(*)
FROM rein_runs r
WHERE r.status = 'terminal'
  AND EXISTS (
      SELECT 1
      FROM rein_events_all d
      JOIN rein_sim_effects s ON s.run_id = d.run_id AND s.applied_at > d.occurred_at
      WHERE d.run_id = r.run_id AND d.type IN ('approval_denied', 'REJECTED'))";

impl Store {
    /// Audits the whole database; see [`AuditReport`].
    pub async fn audit(&self) -> Result<AuditReport, StoreError> {
        let totals = sqlx::query(RUN_TOTALS).fetch_one(self.pool()).await?;
        let runs: i64 = totals.try_get("runs")?;
        let runs_terminal: i64 = totals.try_get("runs_terminal")?;
        let unfinished = Unfinished::from_row(&totals)?;
        let count = |sql: &'static str| async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(self.pool())
                .await
                .map_err(StoreError::from)
        };
        let mut report = AuditReport {
            runs,
            runs_terminal,
            unfinished,
            sequence_gaps: count(SEQUENCE_GAPS).await?,
            stale_token_events: count(STALE_TOKEN_EVENTS).await?,
            token_regressions: count(TOKEN_REGRESSIONS).await?,
            fenced_writes_rejected: self.counter(counters::FENCED_WRITES).await?,
            duplicate_effects: count(DUPLICATE_EFFECTS).await?,
            replay_mismatches: 0,
            terminal_without_reason: count(TERMINAL_WITHOUT_REASON).await?,
            denied_but_applied: count(DENIED_BUT_APPLIED).await?,
        };
        let run_ids: Vec<Uuid> = sqlx::query_scalar("SELECT run_id FROM rein_runs ORDER BY run_id")
            .fetch_all(self.pool())
            .await?;
        for run_id in run_ids {
            if let Some(problem) = self.verify_run(run_id).await? {
                tracing::warn!(%run_id, %problem, "audit: replay mismatch");
                report.replay_mismatches += 1;
            }
        }
        Ok(report)
    }
}

/// Live leases per worker, for a harness choosing which worker to fault.
const LIVE_LEASES_BY_OWNER: &str = "
SELECT lease_owner, count(*)
FROM rein_runs
WHERE lease_owner IS NOT NULL AND lease_until > clock_timestamp() AND status <> 'terminal'
GROUP BY lease_owner";

/// Runs of a snapshot still held under the token of the snapshot (or an older one) and not
/// terminal: nobody has taken them over yet.
const NOT_TAKEN_OVER: &str = "
SELECT count(*)
FROM rein_runs r
JOIN unnest($1::uuid[], $2::bigint[]) AS h(run_id, token) USING (run_id)
WHERE r.fencing_token <= h.token AND r.status <> 'terminal'";

impl Store {
    /// Runs in the database and how many of them are terminal.
    pub async fn run_totals(&self) -> Result<(i64, i64), StoreError> {
        Ok(sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE status = 'terminal') FROM rein_runs",
        )
        .fetch_one(self.pool())
        .await?)
    }

    /// How many live leases each worker holds right now.
    pub async fn live_leases_by_owner(&self) -> Result<Vec<(String, i64)>, StoreError> {
        Ok(sqlx::query_as(LIVE_LEASES_BY_OWNER)
            .fetch_all(self.pool())
            .await?)
    }

    /// The non-terminal runs `worker` holds a live lease on, with their fencing tokens: what a
    /// fault on that worker leaves for others to take over.
    pub async fn live_leases_of(&self, worker: &str) -> Result<Vec<(Uuid, i64)>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT run_id, fencing_token FROM rein_runs
             WHERE lease_owner = $1 AND lease_until > clock_timestamp() AND status <> 'terminal'",
        )
        .bind(worker)
        .fetch_all(self.pool())
        .await?)
    }

    /// How many of `held` (run, token) are neither terminal nor under a higher token yet.
    pub async fn not_taken_over(&self, held: &[(Uuid, i64)]) -> Result<i64, StoreError> {
        let ids: Vec<Uuid> = held.iter().map(|h| h.0).collect();
        let tokens: Vec<i64> = held.iter().map(|h| h.1).collect();
        Ok(sqlx::query_scalar(NOT_TAKEN_OVER)
            .bind(&ids)
            .bind(&tokens)
            .fetch_one(self.pool())
            .await?)
    }

    /// Creates an empty database on this store's server, for a run whose whole-database audit
    /// must see only its own data. `name` must be a plain identifier.
    pub async fn create_database(&self, name: &str) -> Result<(), StoreError> {
        let name = plain_identifier(name)?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE \"{name}\"")))
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Drops a database made by [`Store::create_database`], closing its sessions first.
    pub async fn drop_database(&self, name: &str) -> Result<(), StoreError> {
        let name = plain_identifier(name)?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
        )))
        .execute(self.pool())
        .await?;
        Ok(())
    }
}

fn plain_identifier(name: &str) -> Result<&str, StoreError> {
    let plain = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if plain {
        Ok(name)
    } else {
        Err(StoreError::Invalid(format!(
            "`{name}` is not a plain database name (a-z, 0-9, _; at most 63 bytes)"
        )))
    }
}
