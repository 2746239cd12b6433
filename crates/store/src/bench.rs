//! Queries behind `rein bench`: progress and latency of one benchmark queue, the database's
//! transaction counter, and a scratch table for the database's own insert rate (the
//! reference every Rein figure is compared with).

use serde::Serialize;

use crate::{Store, StoreError};

/// p50/p90/p99 of a latency in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub samples: i64,
}

/// What the runs of one benchmark queue did, measured by the database clock.
#[derive(Debug, Clone, Default, Serialize)]
pub struct QueueStats {
    pub runs: i64,
    pub runs_terminal: i64,
    /// Every event of the queue's runs.
    pub events: i64,
    /// Events that complete a step: every type but the engine's own records.
    pub steps: i64,
    /// From the first claim to the last event, in seconds.
    pub span_s: f64,
    /// Run creation to its first claim.
    pub enqueue_to_start_ms: Percentiles,
    /// Claim (or previous step) to the event that completes the next step.
    pub step_ms: Percentiles,
}

/// Every lookup of events and grants goes through their run_id indexes (LATERAL; OFFSET 0
/// keeps the planner from flattening it into a scan of every event), so the
/// cost follows the queue's size, not the database's, whatever the planner believes about a
/// queue it has no statistics for yet.
const QUEUE_STATS: &str = "
WITH runs AS MATERIALIZED (
    SELECT run_id, created_at, status FROM rein_runs WHERE queue = $1
), ev AS MATERIALIZED (
    SELECT e.run_id, e.type, e.occurred_at
    FROM runs, LATERAL (SELECT x.run_id, x.type, x.occurred_at FROM rein_events x
                        WHERE x.run_id = runs.run_id OFFSET 0) e
), first_claim AS MATERIALIZED (
    SELECT runs.run_id, g.at
    FROM runs, LATERAL (SELECT min(x.granted_at) AS at FROM rein_lease_grants x
                        WHERE x.run_id = runs.run_id) g
    WHERE g.at IS NOT NULL
), marks AS (
    SELECT run_id, occurred_at AS at FROM ev WHERE type <> ALL($2::text[])
    UNION ALL
    SELECT run_id, at FROM first_claim
), gaps AS (
    SELECT extract(epoch FROM at - lag(at) OVER (PARTITION BY run_id ORDER BY at)) * 1000 AS ms
    FROM marks
), starts AS (
    SELECT extract(epoch FROM f.at - r.created_at) * 1000 AS ms
    FROM first_claim f JOIN runs r USING (run_id)
)
SELECT
    (SELECT count(*) FROM runs),
    (SELECT count(*) FROM runs WHERE status = 'terminal'),
    (SELECT count(*) FROM ev),
    (SELECT count(*) FROM ev WHERE type <> ALL($2::text[])),
    COALESCE((SELECT extract(epoch FROM (SELECT max(occurred_at) FROM ev) - min(at))
              FROM first_claim), 0)::float8,
    (SELECT percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY ms) FROM starts),
    (SELECT count(*) FROM starts),
    (SELECT percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY ms) FROM gaps
     WHERE ms IS NOT NULL),
    (SELECT count(*) FROM gaps WHERE ms IS NOT NULL)";

fn percentiles(values: Option<Vec<f64>>, samples: i64) -> Percentiles {
    let v = values.unwrap_or_default();
    let at = |i: usize| v.get(i).copied().unwrap_or(0.0);
    Percentiles {
        p50: at(0),
        p90: at(1),
        p99: at(2),
        samples,
    }
}

/// Rejects anything but a plain lower-case identifier, so it can be spliced into DDL.
fn scratch_ident(name: &str) -> Result<&str, StoreError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(name)
    } else {
        Err(StoreError::Invalid(format!(
            "scratch table name `{name}` must be a lower-case identifier"
        )))
    }
}

impl Store {
    /// Runs of `queue`: (all, terminal).
    pub async fn queue_progress(&self, queue: &str) -> Result<(i64, i64), StoreError> {
        Ok(sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE status = 'terminal')
             FROM rein_runs WHERE queue = $1",
        )
        .bind(queue)
        .fetch_one(self.pool())
        .await?)
    }

    /// Throughput and latency of the runs of `queue`; see [`QueueStats`].
    pub async fn queue_stats(&self, queue: &str) -> Result<QueueStats, StoreError> {
        let engine: Vec<&str> = rein_core::EngineEvent::ALL
            .iter()
            .map(|e| e.as_str())
            .collect();
        #[allow(clippy::type_complexity)]
        let row: (
            i64,
            i64,
            i64,
            i64,
            f64,
            Option<Vec<f64>>,
            i64,
            Option<Vec<f64>>,
            i64,
        ) = sqlx::query_as(QUEUE_STATS)
            .bind(queue)
            .bind(&engine)
            .fetch_one(self.pool())
            .await?;
        Ok(QueueStats {
            runs: row.0,
            runs_terminal: row.1,
            events: row.2,
            steps: row.3,
            span_s: row.4,
            enqueue_to_start_ms: percentiles(row.5, row.6),
            step_ms: percentiles(row.7, row.8),
        })
    }

    /// Transactions committed plus rolled back in this database so far. The statistics are
    /// flushed about once a second; callers wait that long before reading.
    pub async fn transactions_so_far(&self) -> Result<i64, StoreError> {
        let mut conn = self.pool().acquire().await?;
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut *conn)
            .await?;
        Ok(sqlx::query_scalar(
            "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database
             WHERE datname = current_database()",
        )
        .fetch_one(&mut *conn)
        .await?)
    }

    /// Connections open right now from processes with these ids (they name themselves
    /// `rein-PID`).
    pub async fn connections_of(&self, pids: &[u32]) -> Result<i64, StoreError> {
        let names: Vec<String> = pids.iter().map(|p| format!("rein-{p}")).collect();
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = ANY($1)",
        )
        .bind(&names)
        .fetch_one(self.pool())
        .await?)
    }

    /// The server's value of a run-time setting (e.g. `synchronous_commit`).
    pub async fn setting(&self, name: &str) -> Result<String, StoreError> {
        Ok(sqlx::query_scalar("SELECT current_setting($1)")
            .bind(name)
            .fetch_one(self.pool())
            .await?)
    }

    /// Creates (afresh) a scratch table shaped like a small event row.
    pub async fn scratch_create(&self, table: &str) -> Result<(), StoreError> {
        let t = scratch_ident(table)?;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
            .execute(self.pool())
            .await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "CREATE TABLE {t} (
                id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                run_id uuid NOT NULL,
                payload jsonb NOT NULL,
                at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )))
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// One transaction inserting `rows` rows into the scratch table (one statement).
    pub async fn scratch_insert(&self, table: &str, rows: usize) -> Result<(), StoreError> {
        let t = scratch_ident(table)?;
        if rows == 1 {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {t} (run_id, payload) VALUES ($1, $2)"
            )))
            .bind(uuid::Uuid::now_v7())
            .bind(serde_json::json!({ "step": 1, "ok": true }))
            .execute(self.pool())
            .await?;
        } else {
            let ids: Vec<uuid::Uuid> = (0..rows).map(|_| uuid::Uuid::now_v7()).collect();
            let payloads: Vec<serde_json::Value> = (0..rows)
                .map(|i| serde_json::json!({ "step": i, "ok": true }))
                .collect();
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "INSERT INTO {t} (run_id, payload) SELECT * FROM unnest($1::uuid[], $2::jsonb[])"
            )))
            .bind(&ids)
            .bind(&payloads)
            .execute(self.pool())
            .await?;
        }
        Ok(())
    }

    pub async fn scratch_drop(&self, table: &str) -> Result<(), StoreError> {
        let t = scratch_ident(table)?;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE IF EXISTS {t}")))
            .execute(self.pool())
            .await?;
        Ok(())
    }
}
