//! What a what-if replay over many runs reads (`rein replay --all`): the runs of a
//! definition created in a window, a bounded page at a time, and their logs, many at once.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use rein_core::Event;
use serde_json::Value;
use sqlx::Row;
use uuid::Uuid;

use crate::{Store, StoreError};

/// Most runs one page of [`Store::whatif_runs`] returns.
pub const WHATIF_PAGE_MAX: i64 = 1_000;
/// Most runs whose logs one [`Store::histories`] reads.
pub const HISTORIES_RUNS_MAX: usize = 1_000;

/// Which runs a what-if replay looks at.
#[derive(Debug, Clone)]
pub struct WhatIfRuns<'a> {
    pub definition: &'a str,
    /// Only this version; every version of the name when absent.
    pub version: Option<u32>,
    /// Only runs created at or after this instant.
    pub since: Option<DateTime<Utc>>,
    /// Only runs created before this instant.
    pub until: Option<DateTime<Utc>>,
}

/// A run as a what-if replay needs it: what it ran on and what it started with.
#[derive(Debug, Clone)]
pub struct WhatIfRun {
    pub run_id: Uuid,
    pub version: u32,
    pub input: Value,
    pub created_at: DateTime<Utc>,
}

impl Store {
    /// At most `limit` (1 to [`WHATIF_PAGE_MAX`]) runs of `of`, oldest first by
    /// (created_at, run_id), strictly after the run `after` names.
    pub async fn whatif_runs(
        &self,
        of: &WhatIfRuns<'_>,
        after: Option<(DateTime<Utc>, Uuid)>,
        limit: i64,
    ) -> Result<Vec<WhatIfRun>, StoreError> {
        crate::input::check_text("definition", of.definition)?;
        if !(1..=WHATIF_PAGE_MAX).contains(&limit) {
            return Err(StoreError::Invalid(format!(
                "a page of runs is 1 to {WHATIF_PAGE_MAX} runs, not {limit}"
            )));
        }
        let (after_at, after_id) = after.unzip();
        let rows = sqlx::query(
            "SELECT run_id, version, input, created_at FROM rein_runs
             WHERE definition = $1 AND ($2::int IS NULL OR version = $2)
               AND ($3::timestamptz IS NULL OR created_at >= $3)
               AND ($4::timestamptz IS NULL OR created_at < $4)
               AND ($5::timestamptz IS NULL OR (created_at, run_id) > ($5, $6::uuid))
             ORDER BY created_at, run_id LIMIT $7",
        )
        .bind(of.definition)
        .bind(of.version.map(|v| v as i32))
        .bind(of.since)
        .bind(of.until)
        .bind(after_at)
        .bind(after_id)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|row| {
                let version: i32 = row.try_get("version")?;
                Ok(WhatIfRun {
                    run_id: row.try_get("run_id")?,
                    version: version as u32,
                    input: row.try_get("input")?,
                    created_at: row.try_get("created_at")?,
                })
            })
            .collect()
    }

    /// The logs of `runs` (at most [`HISTORIES_RUNS_MAX`]), each in sequence order, in one
    /// read; a run without events has none in the map.
    pub async fn histories(&self, runs: &[Uuid]) -> Result<HashMap<Uuid, Vec<Event>>, StoreError> {
        if runs.len() > HISTORIES_RUNS_MAX {
            return Err(StoreError::Invalid(format!(
                "the logs of at most {HISTORIES_RUNS_MAX} runs are read at once, not {}",
                runs.len()
            )));
        }
        let rows: Vec<(Uuid, i64, String, Value)> = sqlx::query_as(
            "SELECT run_id, sequence, type, payload FROM rein_events_all
             WHERE run_id = ANY($1) ORDER BY run_id, sequence",
        )
        .bind(runs)
        .fetch_all(self.pool())
        .await?;
        let mut logs: HashMap<Uuid, Vec<Event>> = HashMap::new();
        for (run_id, sequence, kind, payload) in rows {
            logs.entry(run_id)
                .or_default()
                .push(Event::new(sequence as u64, kind, payload));
        }
        Ok(logs)
    }
}
