//! What `rein why` reads about one run (seed 000 §16): the run row, its newest events of
//! interest, its side-effect ledger, open approvals, inbox and the fleet's heartbeats, all from
//! one read-only snapshot, with every age and countdown measured by the database clock.

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use sqlx::Row;
use sqlx::postgres::PgRow;
use uuid::Uuid;

use crate::reads::RUN_ROW;
use crate::{RunRow, Store, StoreError};

/// The most rows of each list (ledger, sim effects, approvals, inbox) a diagnosis carries;
/// the newest are kept.
pub const WHY_ROWS_MAX: i64 = 100;
/// A worker or scheduler counts as alive when it sent a heartbeat this recently.
pub const HEARTBEAT_FRESH_MS: i64 = 60_000;

/// The run row, with the times that matter measured against the database clock of the
/// same snapshot. Derefs to the [`RunRow`] it extends.
#[derive(Debug, Clone, Serialize)]
pub struct WhyRun {
    #[serde(flatten)]
    pub row: RunRow,
    /// `lease_until - now`: negative once the lease expired.
    pub lease_left_ms: Option<f64>,
    /// `wake_at - now`: negative when the timer is overdue.
    pub wake_in_ms: Option<f64>,
    pub updated_ago_ms: f64,
}

impl std::ops::Deref for WhyRun {
    type Target = RunRow;

    fn deref(&self) -> &RunRow {
        &self.row
    }
}

/// Milliseconds from `now` to `at` (negative when `at` is past).
fn ms_from(now: DateTime<Utc>, at: DateTime<Utc>) -> f64 {
    (at - now).num_microseconds().unwrap_or(i64::MAX) as f64 / 1000.0
}

/// One event of the run's log, with its age.
#[derive(Debug, Clone, Serialize)]
pub struct WhyEvent {
    pub sequence: i64,
    #[serde(rename = "type")]
    pub kind: String,
    pub payload: Value,
    pub node: Option<String>,
    pub token: i64,
    pub worker: String,
    pub occurred_at: DateTime<Utc>,
    pub ago_ms: f64,
}

/// A row of the side-effect ledger (`rein_actions`).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct WhyAction {
    pub action_id: String,
    pub node: String,
    pub step: i32,
    pub idempotency_key: String,
    pub call_id: Option<String>,
    pub status: String,
    pub tool: Option<String>,
    pub dispatched_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

/// An application of a `sim` side effect (`rein_sim_effects`).
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct WhySimEffect {
    pub node: String,
    pub step: i32,
    pub idempotency_key: String,
    pub worker: String,
    pub applied_at: DateTime<Utc>,
}

/// An approval request that a person can still decide.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct WhyApproval {
    pub approval_id: Uuid,
    pub node: String,
    pub tool: String,
    pub args: Value,
    pub risk: String,
    pub requested_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub expires_in_ms: f64,
}

/// An event waiting in the run's inbox.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct WhyInbox {
    pub id: i64,
    #[serde(rename = "type")]
    #[sqlx(rename = "type")]
    pub kind: String,
    pub sender: String,
    pub created_at: DateTime<Utc>,
    pub expires_at: DateTime<Utc>,
    pub expires_in_ms: f64,
}

/// Workers and schedulers that sent a heartbeat within [`HEARTBEAT_FRESH_MS`].
#[derive(Debug, Clone, Copy, Serialize)]
pub struct WhyFleet {
    pub workers: i64,
    pub schedulers: i64,
}

/// Everything `rein why` knows about a run, read in one snapshot.
#[derive(Debug, Clone, Serialize)]
pub struct WhyFacts {
    pub db_now: DateTime<Utc>,
    pub run: WhyRun,
    pub last_event: Option<WhyEvent>,
    pub last_rejection: Option<WhyEvent>,
    pub last_operator_required: Option<WhyEvent>,
    pub actions: Vec<WhyAction>,
    pub sim_effects: Vec<WhySimEffect>,
    pub approvals: Vec<WhyApproval>,
    pub inbox: Vec<WhyInbox>,
    pub fleet: WhyFleet,
}

/// Milliseconds from the database clock to a timestamp column (negative when past).
macro_rules! ms_until {
    ($column:literal) => {
        concat!(
            "(extract(epoch FROM ",
            $column,
            " - clock_timestamp()) * 1000)::float8"
        )
    };
}

const WHY_EVENT_COLUMNS: &str = "sequence, type, payload, node, fencing_token, worker, occurred_at,
    (extract(epoch FROM clock_timestamp() - occurred_at) * 1000)::float8 AS ago_ms";

impl Store {
    /// Reads what `rein why` shows about `run_id`; [`StoreError::RunNotFound`] when there is
    /// no such run.
    pub async fn why(&self, run_id: Uuid) -> Result<WhyFacts, StoreError> {
        let mut tx = self.pool().begin().await?;
        // One snapshot: the run row, its log and its ledger agree with each other.
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await?;
        let row = sqlx::query(sqlx::AssertSqlSafe(format!("{RUN_ROW} WHERE run_id = $1")))
            .bind(run_id)
            .fetch_optional(&mut *tx)
            .await?
            .ok_or(StoreError::RunNotFound(run_id))?;
        let row = RunRow::from_row(&row)?;
        let db_now: DateTime<Utc> = sqlx::query_scalar("SELECT clock_timestamp()")
            .fetch_one(&mut *tx)
            .await?;
        let run = WhyRun {
            lease_left_ms: row.lease_until.map(|t| ms_from(db_now, t)),
            wake_in_ms: row.wake_at.map(|t| ms_from(db_now, t)),
            updated_ago_ms: -ms_from(db_now, row.updated_at),
            row,
        };

        let newest_of = |kind: Option<&'static str>| {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "SELECT {WHY_EVENT_COLUMNS} FROM rein_events_all
                 WHERE run_id = $1 AND ($2::text IS NULL OR type = $2)
                 ORDER BY sequence DESC LIMIT 1"
            )))
            .bind(run_id)
            .bind(kind)
        };
        let last_event = newest_of(None).fetch_optional(&mut *tx).await?;
        let last_rejection = newest_of(Some("DECISION_REJECTED"))
            .fetch_optional(&mut *tx)
            .await?;
        let last_operator_required = newest_of(Some("OPERATOR_REQUIRED"))
            .fetch_optional(&mut *tx)
            .await?;

        let mut actions: Vec<WhyAction> = sqlx::query_as(
            "SELECT action_id, node, step, idempotency_key, call_id, status, tool, dispatched_at,
                    finished_at
             FROM rein_actions WHERE run_id = $1
             ORDER BY dispatched_at DESC, action_id DESC LIMIT $2",
        )
        .bind(run_id)
        .bind(WHY_ROWS_MAX)
        .fetch_all(&mut *tx)
        .await?;
        actions.reverse();
        let mut sim_effects: Vec<WhySimEffect> = sqlx::query_as(
            "SELECT node, step, idempotency_key, worker, applied_at
             FROM rein_sim_effects WHERE run_id = $1 ORDER BY id DESC LIMIT $2",
        )
        .bind(run_id)
        .bind(WHY_ROWS_MAX)
        .fetch_all(&mut *tx)
        .await?;
        sim_effects.reverse();
        let approvals: Vec<WhyApproval> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT approval_id, node, tool, args, risk, requested_at, expires_at,
                    {} AS expires_in_ms
             FROM rein_approvals
             WHERE run_id = $1 AND status = 'pending' AND expires_at > clock_timestamp()
             ORDER BY requested_at DESC LIMIT $2",
            ms_until!("expires_at")
        )))
        .bind(run_id)
        .bind(WHY_ROWS_MAX)
        .fetch_all(&mut *tx)
        .await?;
        let inbox: Vec<WhyInbox> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT id, type, sender, created_at, expires_at, {} AS expires_in_ms
             FROM rein_inbox WHERE run_id = $1 ORDER BY id LIMIT $2",
            ms_until!("expires_at")
        )))
        .bind(run_id)
        .bind(WHY_ROWS_MAX)
        .fetch_all(&mut *tx)
        .await?;
        let (workers, schedulers): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE role = 'worker'),
                    count(*) FILTER (WHERE role = 'scheduler')
             FROM rein_workers
             WHERE heartbeat_at > clock_timestamp() - $1 * interval '1 millisecond'",
        )
        .bind(HEARTBEAT_FRESH_MS)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;

        Ok(WhyFacts {
            db_now,
            run,
            last_event: last_event.as_ref().map(why_event).transpose()?,
            last_rejection: last_rejection.as_ref().map(why_event).transpose()?,
            last_operator_required: last_operator_required.as_ref().map(why_event).transpose()?,
            actions,
            sim_effects,
            approvals,
            inbox,
            fleet: WhyFleet {
                workers,
                schedulers,
            },
        })
    }
}

fn why_event(row: &PgRow) -> Result<WhyEvent, StoreError> {
    Ok(WhyEvent {
        sequence: row.try_get("sequence")?,
        kind: row.try_get("type")?,
        payload: row.try_get("payload")?,
        node: row.try_get("node")?,
        token: row.try_get("fencing_token")?,
        worker: row.try_get("worker")?,
        occurred_at: row.try_get("occurred_at")?,
        ago_ms: row.try_get("ago_ms")?,
    })
}
