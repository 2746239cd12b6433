//! What the scheduler scans (SPEC S1–S3, X3a): expired leases, due wall-time budgets, due
//! timers and inbox entries, and the next looks of rows it could not move.
//!
//! A scan returns rows in the order they became due to it, by the database clock: the later
//! of when the row is due and its next look. A look that could not move a row (a timer into
//! a false guard, entries the state cannot take yet, a definition that cannot be loaded)
//! sets the row's next look ahead: `SCAN_BACKOFF_MS_MIN` after the first such look, twice as
//! far after each further one, at most `SCAN_BACKOFF_MS_MAX`, and never past a moment at which
//! the row could move by itself (a timer or budget still ahead, an entry's expiry). Until
//! then the scans pass over it, so rows that cannot move never hold the head of a scan, and
//! every due row is reached within one pass over the rows due before it. Any commit to the
//! run clears its next looks (`commit.sql`). Next looks live in the database, so every
//! scheduler honours them.

use chrono::{DateTime, Utc};
use sqlx::Row;
use uuid::Uuid;

use crate::reads::RunRow;
use crate::send::{INBOX_COLUMNS, InboxEntry};
use crate::{Store, StoreError};

/// The next look after the first look in a row that could not move a row.
pub const SCAN_BACKOFF_MS_MIN: u64 = 1_000;
/// The furthest ahead a next look is set.
pub const SCAN_BACKOFF_MS_MAX: u64 = 60_000;

/// The next look, in milliseconds from now, after `misses` earlier looks in a row that could
/// not move the row (`misses` is the SQL column of the row being updated).
fn backoff_ms_sql(misses: &str) -> String {
    format!(
        "least({SCAN_BACKOFF_MS_MIN}::float8 * power(2, least({misses}, 30)), {SCAN_BACKOFF_MS_MAX})"
    )
}

/// A run as a scan saw it. A next look is set only while the run is still exactly so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seen {
    pub run_id: Uuid,
    pub sequence: i64,
    pub token: i64,
}

impl RunRow {
    pub fn seen(&self) -> Seen {
        Seen {
            run_id: self.run_id,
            sequence: self.last_sequence,
            token: self.fencing_token,
        }
    }
}

/// Where a run's next look was set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NextLook {
    /// Looks in a row, since the run's last commit, that could not move it (1 = the first).
    pub misses: i32,
    pub at: DateTime<Utc>,
}

impl Store {
    /// Runs whose lease expired by the database clock (dead or stalled holder), in the order
    /// they became due.
    pub async fn expired_leases(&self, limit: i64) -> Result<Vec<RunRow>, StoreError> {
        self.rows(
            "WHERE lease_owner IS NOT NULL
               AND greatest(lease_until, scan_after) <= (SELECT clock_timestamp())
             ORDER BY greatest(lease_until, scan_after) LIMIT $1",
            limit,
        )
        .await
    }

    /// Unleased runs whose timer is due by the database clock, in the order they became due,
    /// with the time elapsed since they entered their state.
    pub async fn due_timers(&self, limit: i64) -> Result<Vec<RunRow>, StoreError> {
        self.rows(
            "WHERE wake_at IS NOT NULL AND lease_owner IS NULL
               AND greatest(wake_at, scan_after) <= (SELECT clock_timestamp())
             ORDER BY greatest(wake_at, scan_after) LIMIT $1",
            limit,
        )
        .await
    }

    /// Runs whose wall-time budget ran out by the database clock, in the order they became
    /// due.
    pub async fn due_deadlines(&self, limit: i64) -> Result<Vec<Seen>, StoreError> {
        let rows: Vec<(Uuid, i64, i64)> = sqlx::query_as(
            "SELECT run_id, last_sequence, fencing_token FROM rein_runs
             WHERE deadline_at IS NOT NULL
               AND greatest(deadline_at, scan_after) <= (SELECT clock_timestamp())
             ORDER BY greatest(deadline_at, scan_after) LIMIT $1",
        )
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|(run_id, sequence, token)| Seen {
                run_id,
                sequence,
                token,
            })
            .collect())
    }

    /// Runs with inbox entries due for a look (new, or their run changed, or their next look
    /// came), at most `limit` entries' worth, oldest due first.
    pub async fn runs_with_inbox(&self, limit: i64) -> Result<Vec<Uuid>, StoreError> {
        let ids: Vec<Uuid> = sqlx::query_scalar(
            "SELECT run_id FROM rein_inbox WHERE scan_after <= (SELECT clock_timestamp())
             ORDER BY scan_after LIMIT $1",
        )
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        let mut runs = Vec::with_capacity(ids.len());
        for id in ids {
            if !runs.contains(&id) {
                runs.push(id);
            }
        }
        Ok(runs)
    }

    /// The run's inbox entries due for a look with ids above `after`, oldest first, at most
    /// `INBOX_READ_MAX`. Entries not due were judged on the run as it is now (a commit makes
    /// them due again), so the run cannot take them yet either.
    pub async fn due_inbox(&self, run_id: Uuid, after: i64) -> Result<Vec<InboxEntry>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {INBOX_COLUMNS} FROM rein_inbox
             WHERE run_id = $1 AND id > $2 AND scan_after <= clock_timestamp()
             ORDER BY id LIMIT {}",
            crate::send::INBOX_READ_MAX
        )))
        .bind(run_id)
        .bind(after)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(InboxEntry::from_row).collect()
    }

    /// A look at the run could not move it: no scan returns it before its next look, which
    /// grows with each such look in a row and never passes a timer or a wall-time budget still
    /// ahead, nor `state_entered_at + next_change_ms` (when its timers offer other events).
    /// `None` when the run changed since `seen` (nothing is set: the change made it due).
    pub async fn look_later(
        &self,
        seen: Seen,
        next_change_ms: Option<u64>,
    ) -> Result<Option<NextLook>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE rein_runs SET
                 scan_misses = scan_misses + 1,
                 scan_after = least(
                     clock_timestamp() + {} * interval '1 millisecond',
                     CASE WHEN wake_at > clock_timestamp() THEN wake_at END,
                     CASE WHEN deadline_at > clock_timestamp() THEN deadline_at END,
                     state_entered_at + $4 * interval '1 millisecond')
             WHERE run_id = $1 AND last_sequence = $2 AND fencing_token = $3
             RETURNING scan_misses, scan_after",
            backoff_ms_sql("scan_misses")
        )))
        .bind(seen.run_id)
        .bind(seen.sequence)
        .bind(seen.token)
        .bind(next_change_ms.map(|ms| ms.min(i64::MAX as u64) as i64))
        .fetch_optional(self.pool())
        .await?;
        row.map(|row| {
            Ok(NextLook {
                misses: row.try_get("scan_misses")?,
                at: row.try_get("scan_after")?,
            })
        })
        .transpose()
    }

    /// A look at the run's inbox entries `ids` took none of them: they are not looked at
    /// again before their next look, which grows with each such look in a row and never
    /// passes an entry's expiry (when it is recorded as expired). With `seen`, only while the
    /// run is still so (under a share lock on its row, so a commit cannot slip in between);
    /// without, whatever the run's state (its row could not be read). Returns the first next
    /// look set, `None` when nothing was set.
    pub async fn look_at_inbox_later(
        &self,
        run_id: Uuid,
        seen: Option<Seen>,
        ids: &[i64],
    ) -> Result<Option<NextLook>, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!(
            "WITH run AS (
                 SELECT run_id FROM rein_runs
                 WHERE run_id = $1 AND last_sequence = $2 AND fencing_token = $3
                 FOR SHARE
             ),
             pushed AS (
                 UPDATE rein_inbox i SET
                     scan_misses = i.scan_misses + 1,
                     scan_after = least(
                         clock_timestamp() + {} * interval '1 millisecond',
                         CASE WHEN i.expires_at > clock_timestamp() THEN i.expires_at END)
                 WHERE i.run_id = $1 AND i.id = ANY($4)
                   AND ($5 OR EXISTS (SELECT 1 FROM run))
                 RETURNING i.scan_misses, i.scan_after
             )
             SELECT min(scan_misses) AS misses, min(scan_after) AS at FROM pushed",
            backoff_ms_sql("i.scan_misses")
        )))
        .bind(run_id)
        .bind(seen.map(|s| s.sequence))
        .bind(seen.map(|s| s.token))
        .bind(ids)
        .bind(seen.is_none())
        .fetch_one(self.pool())
        .await?;
        let misses: Option<i32> = row.try_get("misses")?;
        let at: Option<DateTime<Utc>> = row.try_get("at")?;
        Ok(misses.zip(at).map(|(misses, at)| NextLook { misses, at }))
    }

    /// The run's lease is live: its holder applies its inbox. The entries due now are not
    /// looked at again before the lease ends (a commit that ends it makes them due at once).
    /// Returns how many were put off.
    pub async fn look_at_inbox_after_lease(&self, run_id: Uuid) -> Result<u64, StoreError> {
        Ok(sqlx::query(
            "UPDATE rein_inbox i SET scan_after = r.lease_until
             FROM rein_runs r
             WHERE r.run_id = $1 AND r.lease_until > clock_timestamp()
               AND i.run_id = $1 AND i.scan_after <= clock_timestamp()",
        )
        .bind(run_id)
        .execute(self.pool())
        .await?
        .rows_affected())
    }
}
