//! Event history retention (SPEC L2): the logs of runs that finished long enough ago move from
//! the hot `rein_events` to `rein_events_archive`, whole runs at a time, one transaction per
//! batch. Reads (`rein_events_all`) see both tables, so history, replay and audits do not
//! change; commits refuse archived runs, so no event lands in `rein_events` after the move.

use chrono::{DateTime, Utc};
use serde::Serialize;
use uuid::Uuid;

use crate::{Store, StoreError};

/// Most runs moved by one transaction.
pub const ARCHIVE_BATCH_MAX: i64 = 10_000;

/// What would be (or was not yet) archived: terminal runs finished before the cutoff.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct ArchiveCandidates {
    pub runs: i64,
    pub events: i64,
}

/// What one batch moved.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq, Default)]
pub struct ArchivedBatch {
    pub runs: i64,
    pub events: i64,
    /// Checkpoints of those runs, dropped: they are derived from the log and a finished run
    /// is never recovered from one.
    pub checkpoints: i64,
}

/// The hot event table's size: exact row count and `pg_total_relation_size` (heap, indexes,
/// TOAST).
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct EventsTableSize {
    pub rows: i64,
    pub bytes: i64,
}

const CANDIDATES: &str = "
SELECT count(*), COALESCE(sum(last_sequence), 0)::bigint FROM rein_runs
WHERE status = 'terminal' AND archived_at IS NULL AND finished_at < $1";

/// Locks the batch's runs first, so no commit can touch them until the move is done, and the
/// move (a later statement) sees every event committed before the lock was taken.
const LOCK_BATCH: &str = "
SELECT run_id, last_sequence FROM rein_runs
WHERE status = 'terminal' AND archived_at IS NULL AND finished_at < $1
ORDER BY finished_at, run_id
LIMIT $2
FOR UPDATE SKIP LOCKED";

const MOVE_BATCH: &str = "
WITH moved AS (
    DELETE FROM rein_events e WHERE e.run_id = ANY($1)
    RETURNING e.run_id, e.sequence, e.event_id, e.type, e.payload, e.node, e.schema_version,
              e.fencing_token, e.worker, e.occurred_at, e.sender
),
archived AS (
    INSERT INTO rein_events_archive (run_id, sequence, event_id, type, payload, node,
                                     schema_version, fencing_token, worker, occurred_at, sender)
    SELECT * FROM moved
    RETURNING 1
),
checkpoints AS (
    DELETE FROM rein_checkpoints c WHERE c.run_id = ANY($1) RETURNING 1
),
marked AS (
    UPDATE rein_runs r SET archived_at = clock_timestamp()
    WHERE r.run_id = ANY($1) AND r.archived_at IS NULL
    RETURNING 1
)
SELECT (SELECT count(*) FROM marked), (SELECT count(*) FROM archived),
       (SELECT count(*) FROM checkpoints)";

impl Store {
    /// The database clock minus `older_than_ms`: runs finished before it may be archived.
    pub async fn archive_cutoff(&self, older_than_ms: u64) -> Result<DateTime<Utc>, StoreError> {
        let ms = i64::try_from(older_than_ms)
            .map_err(|_| StoreError::Invalid(format!("{older_than_ms} ms is too long")))?;
        Ok(
            sqlx::query_scalar("SELECT clock_timestamp() - $1 * interval '1 millisecond'")
                .bind(ms)
                .fetch_one(self.pool())
                .await?,
        )
    }

    /// Terminal runs finished before `cutoff` whose logs are still hot.
    pub async fn archive_candidates(
        &self,
        cutoff: DateTime<Utc>,
    ) -> Result<ArchiveCandidates, StoreError> {
        let (runs, events): (i64, i64) = sqlx::query_as(CANDIDATES)
            .bind(cutoff)
            .fetch_one(self.pool())
            .await?;
        Ok(ArchiveCandidates { runs, events })
    }

    /// Moves the logs of up to `batch` terminal runs finished before `cutoff`, oldest first,
    /// in one transaction: all of a run's events or none. Zero runs means nothing is left.
    pub async fn archive_batch(
        &self,
        cutoff: DateTime<Utc>,
        batch: i64,
    ) -> Result<ArchivedBatch, StoreError> {
        if !(1..=ARCHIVE_BATCH_MAX).contains(&batch) {
            return Err(StoreError::Invalid(format!(
                "batch {batch} is outside 1..={ARCHIVE_BATCH_MAX}"
            )));
        }
        let mut tx = self.pool().begin().await?;
        let locked: Vec<(Uuid, i64)> = sqlx::query_as(LOCK_BATCH)
            .bind(cutoff)
            .bind(batch)
            .fetch_all(&mut *tx)
            .await?;
        if locked.is_empty() {
            return Ok(ArchivedBatch::default());
        }
        let ids: Vec<Uuid> = locked.iter().map(|r| r.0).collect();
        let (runs, events, checkpoints): (i64, i64, i64) = sqlx::query_as(MOVE_BATCH)
            .bind(&ids)
            .fetch_one(&mut *tx)
            .await?;
        // Every run's log is exactly 1..=last_sequence: anything else means a log is not
        // whole, and nothing is moved.
        let expected: i64 = locked.iter().map(|r| r.1).sum();
        if runs != ids.len() as i64 || events != expected {
            tx.rollback().await?;
            return Err(StoreError::Corrupt(format!(
                "archiving {} runs found {events} events where their sequences say {expected} \
                 ({runs} runs marked); nothing was moved: run `rein chaos --check-only` on this \
                 database to find the broken log",
                ids.len()
            )));
        }
        tx.commit().await?;
        Ok(ArchivedBatch {
            runs,
            events,
            checkpoints,
        })
    }

    /// Rows and bytes of the hot event table.
    pub async fn events_table_size(&self) -> Result<EventsTableSize, StoreError> {
        let (rows, bytes): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM rein_events),
                    pg_total_relation_size('rein_events'::regclass)",
        )
        .fetch_one(self.pool())
        .await?;
        Ok(EventsTableSize { rows, bytes })
    }

    /// `VACUUM` (or `VACUUM FULL`, which rewrites the table under an exclusive lock and gives
    /// the space back to the operating system) of the hot event table.
    pub async fn vacuum_events(&self, full: bool) -> Result<(), StoreError> {
        let sql = if full {
            "VACUUM (FULL, ANALYZE) rein_events"
        } else {
            "VACUUM (ANALYZE) rein_events"
        };
        sqlx::query(sql).execute(self.pool()).await?;
        Ok(())
    }
}
