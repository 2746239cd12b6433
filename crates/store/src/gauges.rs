//! What the fleet looks like right now, for the gauges a scheduler exports (SPEC O2): runs by
//! status, queue depth and age, the oldest run in each waiting status, runs retrying, and
//! open approvals. Ages are measured by the database clock; every query reads an index.

use sqlx::Row;

use crate::{Store, StoreError};

/// One reading of the fleet's gauges.
#[derive(Debug, Clone, Default)]
pub struct FleetGauges {
    /// (definition, status, runs): status is `running` for a live lease, otherwise the
    /// run's own status (runnable, parked, needs_operator, terminal).
    pub runs: Vec<(String, String, i64)>,
    /// (definition, status, seconds) of the run longest in its state, unfinished runs only.
    pub oldest_in_state: Vec<(String, String, f64)>,
    /// (definition, runs) of unfinished runs on their third retry or later.
    pub retrying: Vec<(String, i64)>,
    /// (queue, runnable unleased runs, seconds since the oldest became claimable).
    pub queues: Vec<(String, i64, f64)>,
    pub approvals_pending: i64,
    pub approvals_oldest_s: f64,
}

/// Attempts from which an unfinished run counts as retrying (seed 003 §7: retry flapping).
pub const RETRYING_ATTEMPTS_MIN: i32 = 3;

impl Store {
    pub async fn fleet_gauges(&self) -> Result<FleetGauges, StoreError> {
        let mut g = FleetGauges::default();
        let rows = sqlx::query(
            "SELECT definition,
                    CASE WHEN lease_owner IS NOT NULL AND lease_until > clock_timestamp()
                         THEN 'running' ELSE status END AS status,
                    count(*) AS runs,
                    extract(epoch FROM clock_timestamp() - min(state_entered_at))::float8 AS oldest_s,
                    count(*) FILTER (WHERE (projection->>'attempt')::int >= $1) AS retrying
             FROM rein_runs WHERE status <> 'terminal' GROUP BY 1, 2",
        )
        .bind(RETRYING_ATTEMPTS_MIN)
        .fetch_all(self.pool())
        .await?;
        let mut retrying: std::collections::BTreeMap<String, i64> = Default::default();
        for row in rows {
            let definition: String = row.try_get("definition")?;
            let status: String = row.try_get("status")?;
            g.runs
                .push((definition.clone(), status.clone(), row.try_get("runs")?));
            if status != "runnable" {
                g.oldest_in_state.push((
                    definition.clone(),
                    status,
                    row.try_get::<Option<f64>, _>("oldest_s")?.unwrap_or(0.0),
                ));
            }
            *retrying.entry(definition).or_default() += row.try_get::<i64, _>("retrying")?;
        }
        g.retrying = retrying.into_iter().collect();
        let finished: Vec<(String, i64)> = sqlx::query_as(
            "SELECT definition, count(*) FROM rein_runs WHERE status = 'terminal' GROUP BY 1",
        )
        .fetch_all(self.pool())
        .await?;
        g.runs.extend(
            finished
                .into_iter()
                .map(|(d, n)| (d, "terminal".to_owned(), n)),
        );
        g.queues = sqlx::query_as(
            "SELECT queue, count(*),
                    greatest(coalesce(extract(epoch FROM clock_timestamp() - min(ready_at)), 0), 0)::float8
             FROM rein_runs WHERE status = 'runnable' AND lease_owner IS NULL GROUP BY queue",
        )
        .fetch_all(self.pool())
        .await?;
        let (pending, oldest): (i64, f64) = sqlx::query_as(
            "SELECT count(*),
                    coalesce(extract(epoch FROM clock_timestamp() - min(requested_at)), 0)::float8
             FROM rein_approvals WHERE status = 'pending' AND expires_at > clock_timestamp()",
        )
        .fetch_one(self.pool())
        .await?;
        g.approvals_pending = pending;
        g.approvals_oldest_s = oldest;
        Ok(g)
    }
}
