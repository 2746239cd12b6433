//! Operator reads and actions that are not part of a run's own life: who is alive, and
//! running a finished run again (SPEC E6).

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use uuid::Uuid;

use crate::{EnqueueRequest, Store, StoreError};

/// A worker or scheduler as its heartbeats describe it, by the database clock.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Member {
    pub worker_id: String,
    pub role: String,
    pub started_at: DateTime<Utc>,
    pub heartbeat_at: DateTime<Utc>,
    /// Milliseconds since its last heartbeat.
    pub silent_ms: f64,
    /// Runs it holds a live lease on right now.
    pub leases_held: i64,
    /// Whether it holds a live leader lease (a scheduler doing the scanning).
    pub leader: bool,
    pub info: Value,
}

impl Store {
    /// Every registered worker and scheduler, the most recently heard from first. A member
    /// that stopped cleanly is gone; one that died stays until `silent_ms` gives it away.
    pub async fn members(&self) -> Result<Vec<Member>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT w.worker_id, w.role, w.started_at, w.heartbeat_at,
                    (extract(epoch FROM clock_timestamp() - w.heartbeat_at) * 1000)::float8
                        AS silent_ms,
                    (SELECT count(*) FROM rein_runs r
                     WHERE r.lease_owner = w.worker_id AND r.lease_until > clock_timestamp())
                        AS leases_held,
                    EXISTS (SELECT 1 FROM rein_leader_leases l
                            WHERE l.holder = w.worker_id AND l.expires_at > clock_timestamp())
                        AS leader,
                    w.info
             FROM rein_workers w
             -- Only the living: heard from within the TTL each declares (a minute if none).
             WHERE w.heartbeat_at > clock_timestamp()
                   - coalesce((w.info->>'ttl_ms')::bigint, 60000) * interval '1 millisecond'
             ORDER BY w.heartbeat_at DESC
             LIMIT 1000",
        )
        .fetch_all(self.pool())
        .await?)
    }

    /// Starts a new run with the definition version, input, queue and priority of finished
    /// run `run_id`, linked to it as its parent (SPEC E6), enqueued by `by`. A run that has
    /// not finished is refused: it may still succeed.
    pub async fn rerun(&self, run_id: Uuid, by: Option<&str>) -> Result<Uuid, StoreError> {
        self.rerun_as(None, run_id, by).await
    }

    /// [`Store::rerun`] for `token`: the new run is created as [`Store::enqueue_as`]
    /// creates one, so it stays in the token's queues and priority ceiling and counts
    /// against its quotas.
    pub async fn rerun_as(
        &self,
        token: Option<&crate::TokenInfo>,
        run_id: Uuid,
        by: Option<&str>,
    ) -> Result<Uuid, StoreError> {
        let row: Option<(String, i32, String, Value, String, i32)> = sqlx::query_as(
            "SELECT definition, version, status, input, queue, priority
             FROM rein_runs WHERE run_id = $1",
        )
        .bind(run_id)
        .fetch_optional(self.pool())
        .await?;
        let Some((definition, version, status, input, queue, priority)) = row else {
            return Err(StoreError::RunNotFound(run_id));
        };
        if status != "terminal" {
            return Err(StoreError::Invalid(format!(
                "run {run_id} has not finished (status {status}); only a finished run is run again"
            )));
        }
        let def = self
            .load_definition(&definition, Some(version as u32))
            .await?;
        let mut request = EnqueueRequest::new(def, input);
        request.queue = queue;
        request.priority = priority;
        request.parent_run_id = Some(run_id);
        request.enqueued_by = by.map(str::to_owned);
        Ok(self.enqueue_as(token, request).await?.run_id)
    }
}
