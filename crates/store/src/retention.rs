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

/// Runs of a month whose partition moved to the archive (`rein retention detach`) are archived
/// already.
const CANDIDATES: &str = "
SELECT count(*), COALESCE(sum(last_sequence), 0)::bigint FROM rein_runs r
WHERE status = 'terminal' AND archived_at IS NULL AND finished_at < $1
  AND NOT EXISTS (SELECT 1 FROM rein_event_ranges g
                  WHERE g.moved_at IS NOT NULL AND r.run_id >= g.lo AND r.run_id < g.hi)";

/// Locks the batch's runs first, so no commit can touch them until the move is done, and the
/// move (a later statement) sees every event committed before the lock was taken.
const LOCK_BATCH: &str = "
SELECT run_id, last_sequence FROM rein_runs r
WHERE status = 'terminal' AND archived_at IS NULL AND finished_at < $1
  AND NOT EXISTS (SELECT 1 FROM rein_event_ranges g
                  WHERE g.moved_at IS NOT NULL AND r.run_id >= g.lo AND r.run_id < g.hi)
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
        // A month's partition moving meanwhile (it locks the table exclusively) waits for this
        // batch, or this batch waits for it and then leaves that month's runs out.
        sqlx::query("LOCK TABLE rein_events IN ROW EXCLUSIVE MODE")
            .execute(&mut *tx)
            .await?;
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
                    (SELECT COALESCE(sum(pg_total_relation_size(relid)), 0)::bigint
                     FROM pg_partition_tree('rein_events'::regclass))",
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

/// A partition of `rein_events` or `rein_events_archive` (`rein_event_ranges`): a range of
/// run ids, which for UUIDv7 ids is a range of creation times.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, sqlx::FromRow)]
pub struct EventRange {
    pub name: String,
    /// Lowest run id in it; none: from the lowest there is.
    pub lo: Option<Uuid>,
    /// First run id past it; none with `lo` none: the default partition, for ids no range
    /// holds.
    pub hi: Option<Uuid>,
    /// The calendar month (UTC) of the runs it holds, for a month's partition.
    pub month: Option<chrono::NaiveDate>,
    /// `hot` (in `rein_events`) or `archive`.
    pub place: String,
    pub moved_at: Option<DateTime<Utc>>,
}

/// A hot month partition as a move would judge it now.
#[derive(Debug, Clone, Serialize, PartialEq, Eq, sqlx::FromRow)]
pub struct MonthCandidate {
    pub name: String,
    pub month: chrono::NaiveDate,
    pub runs: i64,
    /// Runs that have not ended before the cutoff: while any is left the month stays.
    pub unfinished: i64,
    /// One of them, to look at with `rein why`.
    pub example: Option<Uuid>,
    pub bytes: i64,
}

/// What moving one month cost.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MonthMoved {
    pub name: String,
    /// Its name in the archive (`rein_events_archive_YYYYMM`).
    pub archived_as: String,
    pub runs: i64,
    pub bytes: i64,
    pub seconds: f64,
    /// WAL the move wrote (`pg_current_wal_lsn()` before and after, fleet-wide).
    pub wal_bytes: i64,
}

/// How long a month's move waits for the statements writing events to finish before it gives
/// up (it retries with the next `rein retention detach`): meanwhile new ones queue behind it.
const MOVE_LOCK_TIMEOUT: &str = "5s";

impl Store {
    /// Every partition of the event tables, oldest range first.
    pub async fn event_ranges(&self) -> Result<Vec<EventRange>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT name, lo, hi, month, place, moved_at FROM rein_event_ranges
             ORDER BY hi IS NULL, hi, name",
        )
        .fetch_all(self.pool())
        .await?)
    }

    /// Makes the partitions of this month and the next two (UTC) where they are missing;
    /// returns the names made. What a leading scheduler does now and then, so events always
    /// land in their month's partition and not in the default one.
    pub async fn ensure_event_months(&self) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT m FROM generate_series(0, 2) AS n,
                 LATERAL rein_events_add_month(clock_timestamp() + n * interval '1 month') AS m
             WHERE m IS NOT NULL",
        )
        .fetch_all(self.pool())
        .await?)
    }

    /// Makes the partition of the month (UTC) that holds `at`, if missing: for filling a
    /// database with history (`rein bench --backlog-runs`).
    pub async fn add_event_month(&self, at: DateTime<Utc>) -> Result<Option<String>, StoreError> {
        Ok(sqlx::query_scalar("SELECT rein_events_add_month($1)")
            .bind(at)
            .fetch_one(self.pool())
            .await?)
    }

    /// Hot month partitions whose whole range was created before `cutoff`, oldest first,
    /// with how many of their runs would hold a move back.
    pub async fn month_candidates(
        &self,
        cutoff: DateTime<Utc>,
    ) -> Result<Vec<MonthCandidate>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT g.name, g.month, c.runs, c.unfinished, c.example,
                    pg_total_relation_size(g.name::regclass) AS bytes
             FROM rein_event_ranges g,
             LATERAL (SELECT count(*) AS runs,
                             count(*) FILTER (WHERE NOT (r.status = 'terminal'
                                              AND r.finished_at < $1)) AS unfinished,
                             (array_agg(r.run_id) FILTER (WHERE NOT (r.status = 'terminal'
                                              AND r.finished_at < $1)))[1] AS example
                      FROM rein_runs r WHERE r.run_id >= g.lo AND r.run_id < g.hi) c
             WHERE g.place = 'hot' AND g.month IS NOT NULL AND g.hi <= rein_uuid_at($1)
             ORDER BY g.hi",
        )
        .bind(cutoff)
        .fetch_all(self.pool())
        .await?)
    }

    /// Moves the month partition `name` from `rein_events` to `rein_events_archive` if every
    /// run in its range ended before `cutoff` (checked again under the lock). Every statement
    /// on `rein_events` waits for the second check and the catalog changes; no rows move.
    pub async fn archive_month(
        &self,
        name: &str,
        cutoff: DateTime<Utc>,
    ) -> Result<MonthMoved, StoreError> {
        let mut conn = self.pool().acquire().await?;
        let (bytes, wal_before): (i64, String) = sqlx::query_as(
            "SELECT COALESCE((SELECT pg_total_relation_size(g.name::regclass)
                              FROM rein_event_ranges g WHERE g.name = $1), 0),
                    pg_current_wal_lsn()::text",
        )
        .bind(name)
        .fetch_one(&mut *conn)
        .await?;
        let started = std::time::Instant::now();
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "SET LOCAL lock_timeout = '{MOVE_LOCK_TIMEOUT}'"
        )))
        .execute(&mut *tx)
        .await?;
        let moved: Result<i64, sqlx::Error> =
            sqlx::query_scalar("SELECT rein_events_archive_month($1, $2)")
                .bind(name)
                .bind(cutoff)
                .fetch_one(&mut *tx)
                .await;
        let runs = match moved {
            Ok(runs) => runs,
            Err(sqlx::Error::Database(e)) => {
                let message = match e.code().as_deref() {
                    Some("55P03") => format!(
                        "{name} stays: the statements writing events did not let go within \
                         {MOVE_LOCK_TIMEOUT}; run `rein retention detach` again, at a quieter time"
                    ),
                    _ => format!("{name} stays: {}", e.message()),
                };
                return Err(StoreError::Invalid(message));
            }
            Err(e) => return Err(e.into()),
        };
        tx.commit().await?;
        let seconds = started.elapsed().as_secs_f64();
        let wal_bytes: i64 =
            sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint")
                .bind(&wal_before)
                .fetch_one(&mut *conn)
                .await?;
        Ok(MonthMoved {
            name: name.to_owned(),
            // As rein_events_archive_month names it.
            archived_as: name.replacen("rein_events_", "rein_events_archive_", 1),
            runs,
            bytes,
            seconds,
            wal_bytes,
        })
    }

    /// Events in the archive's partition `name` (a moved month), counted exactly.
    pub async fn archived_month_events(&self, name: &str) -> Result<i64, StoreError> {
        let range: Option<(Uuid, Uuid)> = sqlx::query_as(
            "SELECT lo, hi FROM rein_event_ranges
             WHERE name = $1 AND place = 'archive' AND lo IS NOT NULL AND hi IS NOT NULL",
        )
        .bind(name)
        .fetch_optional(self.pool())
        .await?;
        let Some((lo, hi)) = range else {
            return Err(StoreError::Invalid(format!(
                "{name} is not a month in the archive"
            )));
        };
        Ok(sqlx::query_scalar(
            "SELECT count(*) FROM rein_events_archive WHERE run_id >= $1 AND run_id < $2",
        )
        .bind(lo)
        .bind(hi)
        .fetch_one(self.pool())
        .await?)
    }
}
