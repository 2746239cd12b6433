//! Reads: runs, history, integrity checks.

use chrono::{DateTime, Utc};
use rein_core::checkpoint::Checkpoint;
use rein_core::{Event, RunState};
use serde::Serialize;
use serde_json::Value;
use sqlx::Row;
use sqlx::postgres::PgRow;
use uuid::Uuid;

use crate::{Store, StoreError};

#[derive(Debug, Clone, Serialize)]
pub struct RunRow {
    pub run_id: Uuid,
    pub definition: String,
    pub version: u32,
    pub state: String,
    pub status: String,
    pub projection: RunState,
    pub last_sequence: i64,
    pub fencing_token: i64,
    pub lease_owner: Option<String>,
    pub lease_until: Option<DateTime<Utc>>,
    pub lease_live: bool,
    pub wake_at: Option<DateTime<Utc>>,
    pub priority: i32,
    pub queue: String,
    pub parent_run_id: Option<Uuid>,
    /// Who enqueued it: an API token's subject, the CLI's `--as` name; a fan-out branch
    /// records its parent's. Absent for runs created before Rein recorded it.
    pub enqueued_by: Option<String>,
    pub terminal_reason: Option<String>,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub state_entered_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// Time in the current state by the database clock.
    pub in_state_ms: f64,
    /// Time since the current action's first try by the database clock (SPEC R1): what a
    /// retry policy's `deadline_ms` is judged against.
    #[serde(skip)]
    pub try_elapsed_ms: f64,
}

impl RunRow {
    pub(crate) fn from_row(row: &PgRow) -> Result<RunRow, StoreError> {
        let projection: Value = row.try_get("projection")?;
        let version: i32 = row.try_get("version")?;
        Ok(RunRow {
            run_id: row.try_get("run_id")?,
            definition: row.try_get("definition")?,
            version: version as u32,
            state: row.try_get("state")?,
            status: row.try_get("status")?,
            projection: serde_json::from_value(projection)
                .map_err(|e| StoreError::Corrupt(format!("projection: {e}")))?,
            last_sequence: row.try_get("last_sequence")?,
            fencing_token: row.try_get("fencing_token")?,
            lease_owner: row.try_get("lease_owner")?,
            lease_until: row.try_get("lease_until")?,
            lease_live: row
                .try_get::<Option<bool>, _>("lease_live")?
                .unwrap_or(false),
            wake_at: row.try_get("wake_at")?,
            priority: row.try_get("priority")?,
            queue: row.try_get("queue")?,
            parent_run_id: row.try_get("parent_run_id")?,
            enqueued_by: row.try_get("enqueued_by")?,
            terminal_reason: row.try_get("terminal_reason")?,
            created_at: row.try_get("created_at")?,
            updated_at: row.try_get("updated_at")?,
            state_entered_at: row.try_get("state_entered_at")?,
            finished_at: row.try_get("finished_at")?,
            in_state_ms: row.try_get("in_state_ms")?,
            try_elapsed_ms: row.try_get("try_elapsed_ms")?,
        })
    }
}

/// Filters of a page of runs; `None` matches everything.
#[derive(Debug, Clone, Default)]
pub struct RunFilter {
    pub status: Option<String>,
    pub definition: Option<String>,
    /// Only runs created strictly after this instant.
    pub created_after: Option<DateTime<Utc>>,
    /// Only runs created strictly before this instant.
    pub created_before: Option<DateTime<Utc>>,
    /// Only runs in this state of their definition.
    pub state: Option<String>,
    /// Only runs in this queue.
    pub queue: Option<String>,
    /// Only the branches (child runs) of this run.
    pub parent: Option<Uuid>,
    /// Only runs whose id lies in this inclusive range: what a hex prefix of an id names
    /// (see [`id_prefix_range`]).
    pub id_range: Option<(Uuid, Uuid)>,
}

/// The longest id prefix [`id_prefix_range`] takes: a whole id with its dashes.
pub const ID_PREFIX_LEN_MAX: usize = 36;

/// The inclusive range of run ids that start with the hex digits `prefix` (dashes ignored,
/// 1 to 32 digits), or `None` when it is not such a prefix. A range, unlike a text match on
/// the id, reads the primary key's index.
pub fn id_prefix_range(prefix: &str) -> Option<(Uuid, Uuid)> {
    if prefix.len() > ID_PREFIX_LEN_MAX {
        return None;
    }
    let digits: String = prefix.chars().filter(|c| *c != '-').collect();
    if digits.is_empty() || digits.len() > 32 || !digits.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let pad = |fill: char| {
        let mut hex = digits.to_ascii_lowercase();
        hex.extend(std::iter::repeat_n(fill, 32 - digits.len()));
        Uuid::parse_str(&hex).ok()
    };
    Some((pad('0')?, pad('f')?))
}

#[derive(Debug, Clone, Serialize)]
pub struct StoredEvent {
    pub run_id: Uuid,
    pub sequence: i64,
    pub event_id: Uuid,
    #[serde(rename = "type")]
    pub kind: String,
    pub payload: Value,
    pub node: Option<String>,
    pub schema_version: i32,
    pub token: i64,
    pub worker: String,
    pub occurred_at: DateTime<Utc>,
    /// Who sent it from outside the engine (an API token's subject, `--as`, an approver or
    /// operator); absent for the engine's own events (SPEC Z3).
    pub sender: Option<String>,
}

impl RunRow {
    /// Seconds since the run's lease expired, by the database clock of the read (none while
    /// it is live or when no lease is held).
    pub fn expired_for_s(&self) -> Option<f64> {
        let until = self.lease_until.filter(|_| !self.lease_live)?;
        let now = self.state_entered_at
            + chrono::Duration::microseconds((self.in_state_ms * 1000.0) as i64);
        Some(((now - until).num_microseconds()? as f64 / 1e6).max(0.0))
    }
}

impl StoredEvent {
    pub fn as_event(&self) -> Event {
        Event::new(
            self.sequence as u64,
            self.kind.clone(),
            self.payload.clone(),
        )
    }
}

/// How much of each row a page carries, and about how many bytes at most.
#[derive(Debug, Clone, Copy)]
pub struct PageView {
    /// Runs keep their business data (`projection.data`); without it, it reads as null.
    pub with_data: bool,
    /// The page ends before the row that would take its size past this (it always holds
    /// its first row). A row's size is its JSON (a run's projection, an event's payload)
    /// plus [`ROW_BYTES_BESIDES_JSON`].
    pub bytes_max: i64,
}

/// A page kept within its byte bound ([`PageView::bytes_max`]): its first rows, and whether
/// rows were left out for the bound.
#[derive(Debug, Clone)]
pub struct Budgeted<T> {
    pub rows: Vec<T>,
    pub cut: bool,
}

/// Bytes a listed row is reckoned to take besides its JSON: ids, names, times.
pub const ROW_BYTES_BESIDES_JSON: i64 = 256;

pub(crate) const RUN_ROW: &str = include_str!("../queries/run_row.sql");

/// [`RUN_ROW`] with the run's business data read as null unless parameter `with_data` is
/// true: what a list view reads, so that data nobody asked for never leaves the database.
fn listed_run_row(with_data: usize) -> String {
    RUN_ROW.replacen(
        " projection,",
        &format!(
            " CASE WHEN ${with_data} THEN projection ELSE jsonb_set(projection, '{{data}}', 'null') END AS projection,"
        ),
        1,
    )
}

/// `page` (a query of one page of rows in `order`) kept to the first rows whose running size
/// (`json` of each row, plus [`ROW_BYTES_BESIDES_JSON`]) stays within parameter `bytes_max`,
/// the first row always. Each row carries `page_rows`, how many rows the page had.
fn within_bytes(page: &str, order: &str, json: &str, bytes_max: usize) -> String {
    format!(
        "SELECT * FROM (
           SELECT page.*, count(*) OVER () AS page_rows, row_number() OVER running AS page_row,
                  sum(octet_length(({json})::text) + {ROW_BYTES_BESIDES_JSON}) OVER running
                      AS bytes_through
           FROM ({page}) page
           WINDOW running AS (ORDER BY {order} ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
         ) sized
         WHERE page_row = 1 OR bytes_through <= ${bytes_max}
         ORDER BY {order}"
    )
}

/// The rows of a [`within_bytes`] query, and whether the bound left some out.
fn budgeted<T>(
    rows: &[PgRow],
    read: impl Fn(&PgRow) -> Result<T, StoreError>,
) -> Result<Budgeted<T>, StoreError> {
    let page_rows: i64 = match rows.first() {
        Some(first) => first.try_get("page_rows")?,
        None => 0,
    };
    Ok(Budgeted {
        cut: (rows.len() as i64) < page_rows,
        rows: rows.iter().map(read).collect::<Result<_, _>>()?,
    })
}
const EVENT_COLUMNS: &str = "run_id, sequence, event_id, type, payload, node, schema_version, fencing_token, worker, occurred_at, sender";

fn event_from_row(row: &PgRow) -> Result<StoredEvent, StoreError> {
    Ok(StoredEvent {
        run_id: row.try_get("run_id")?,
        sequence: row.try_get("sequence")?,
        event_id: row.try_get("event_id")?,
        kind: row.try_get("type")?,
        payload: row.try_get("payload")?,
        node: row.try_get("node")?,
        schema_version: row.try_get("schema_version")?,
        token: row.try_get("fencing_token")?,
        worker: row.try_get("worker")?,
        occurred_at: row.try_get("occurred_at")?,
        sender: row.try_get("sender")?,
    })
}

impl Store {
    pub async fn run(&self, run_id: Uuid) -> Result<RunRow, StoreError> {
        let row = sqlx::query(sqlx::AssertSqlSafe(format!("{RUN_ROW} WHERE run_id = $1")))
            .bind(run_id)
            .fetch_optional(self.pool())
            .await?
            .ok_or(StoreError::RunNotFound(run_id))?;
        RunRow::from_row(&row)
    }

    /// The run's log, in sequence order.
    pub async fn history(&self, run_id: Uuid) -> Result<Vec<StoredEvent>, StoreError> {
        self.history_after(run_id, 0).await
    }

    pub async fn history_after(
        &self,
        run_id: Uuid,
        after: i64,
    ) -> Result<Vec<StoredEvent>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "SELECT {EVENT_COLUMNS} FROM rein_events_all WHERE run_id = $1 AND sequence > $2 ORDER BY sequence"
        )))
        .bind(run_id)
        .bind(after)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(event_from_row).collect()
    }

    /// At most `limit` of the run's events after sequence `after`, in order, kept within
    /// `view`'s byte bound.
    pub async fn history_page(
        &self,
        run_id: Uuid,
        after: i64,
        limit: i64,
        view: PageView,
    ) -> Result<Budgeted<StoredEvent>, StoreError> {
        let page = format!(
            "SELECT {EVENT_COLUMNS} FROM rein_events_all WHERE run_id = $1 AND sequence > $2
             ORDER BY sequence LIMIT $3"
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(within_bytes(
            &page,
            "sequence",
            "page.payload",
            4,
        )))
        .bind(run_id)
        .bind(after)
        .bind(limit)
        .bind(view.bytes_max)
        .fetch_all(self.pool())
        .await?;
        budgeted(&rows, event_from_row)
    }

    pub async fn list_runs(
        &self,
        status: Option<&str>,
        definition: Option<&str>,
        limit: i64,
    ) -> Result<Vec<RunRow>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "{RUN_ROW} WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR definition = $2)
             ORDER BY created_at DESC, run_id LIMIT $3"
        )))
        .bind(status)
        .bind(definition)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(RunRow::from_row).collect()
    }

    /// One page of runs, newest first by (created_at, run_id), strictly after the row
    /// `after` names (keyset pagination: stable while runs are added), with their data.
    pub async fn list_runs_page(
        &self,
        filter: &RunFilter,
        after: Option<(DateTime<Utc>, Uuid)>,
        limit: i64,
    ) -> Result<Vec<RunRow>, StoreError> {
        let view = PageView {
            with_data: true,
            bytes_max: i64::MAX,
        };
        Ok(self.runs_page(filter, after, limit, view).await?.rows)
    }

    /// [`Store::list_runs_page`] carrying what `view` says: the runs' data or not (a run
    /// without reads `projection.data` as null), and within its byte bound.
    pub async fn runs_page(
        &self,
        filter: &RunFilter,
        after: Option<(DateTime<Utc>, Uuid)>,
        limit: i64,
        view: PageView,
    ) -> Result<Budgeted<RunRow>, StoreError> {
        for (field, value) in [
            ("status", &filter.status),
            ("definition", &filter.definition),
            ("state", &filter.state),
            ("queue", &filter.queue),
        ] {
            if let Some(value) = value {
                crate::input::check_text(field, value)?;
            }
        }
        let (after_at, after_id) = after.unzip();
        let order = "created_at DESC, run_id DESC";
        let page = format!(
            "{} WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR definition = $2)
               AND ($3::timestamptz IS NULL OR created_at > $3)
               AND ($4::timestamptz IS NULL OR created_at < $4)
               AND ($5::timestamptz IS NULL OR (created_at, run_id) < ($5, $6::uuid))
               AND ($10::text IS NULL OR state = $10)
               AND ($11::text IS NULL OR queue = $11)
               AND ($12::uuid IS NULL OR parent_run_id = $12)
               AND ($13::uuid IS NULL OR run_id BETWEEN $13 AND $14)
             ORDER BY {order} LIMIT $7",
            listed_run_row(8)
        );
        let rows = sqlx::query(sqlx::AssertSqlSafe(within_bytes(
            &page,
            order,
            "page.projection",
            9,
        )))
        .bind(filter.status.as_deref())
        .bind(filter.definition.as_deref())
        .bind(filter.created_after)
        .bind(filter.created_before)
        .bind(after_at)
        .bind(after_id)
        .bind(limit)
        .bind(view.with_data)
        .bind(view.bytes_max)
        .bind(filter.state.as_deref())
        .bind(filter.queue.as_deref())
        .bind(filter.parent)
        .bind(filter.id_range.map(|(lo, _)| lo))
        .bind(filter.id_range.map(|(_, hi)| hi))
        .fetch_all(self.pool())
        .await?;
        budgeted(&rows, RunRow::from_row)
    }

    /// The type and time of each run's event at the given sequence (its newest, when given
    /// the run's `last_sequence`), in one read; a run without such an event is absent.
    pub async fn events_at(
        &self,
        at: &[(Uuid, i64)],
    ) -> Result<std::collections::HashMap<Uuid, EventAt>, StoreError> {
        let (ids, sequences): (Vec<Uuid>, Vec<i64>) = at.iter().copied().unzip();
        let rows: Vec<(Uuid, i64, String, DateTime<Utc>)> = sqlx::query_as(
            "SELECT e.run_id, e.sequence, e.type, e.occurred_at
             FROM unnest($1::uuid[], $2::bigint[]) AS wanted(run_id, sequence)
             JOIN rein_events e USING (run_id, sequence)",
        )
        .bind(&ids)
        .bind(&sequences)
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|(run_id, sequence, kind, occurred_at)| {
                (
                    run_id,
                    EventAt {
                        sequence,
                        kind,
                        occurred_at,
                    },
                )
            })
            .collect())
    }

    pub(crate) async fn rows(&self, tail: &str, limit: i64) -> Result<Vec<RunRow>, StoreError> {
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!("{RUN_ROW} {tail}")))
            .bind(limit)
            .fetch_all(self.pool())
            .await?;
        rows.iter().map(RunRow::from_row).collect()
    }

    pub async fn newest_checkpoint(&self, run_id: Uuid) -> Result<Option<Checkpoint>, StoreError> {
        Ok(self.checkpoints(run_id, 1, i64::MAX).await?.pop())
    }

    /// The run's checkpoints at sequence `at_most` or below, newest first, at most `limit`.
    /// One whose state does not parse fails the read with [`StoreError::Corrupt`] naming it.
    async fn checkpoints(
        &self,
        run_id: Uuid,
        limit: i64,
        at_most: i64,
    ) -> Result<Vec<Checkpoint>, StoreError> {
        let rows: Vec<(i64, String, i32, Value)> = sqlx::query_as(
            "SELECT sequence, definition, version, state FROM rein_checkpoints
             WHERE run_id = $1 AND sequence <= $3 ORDER BY sequence DESC LIMIT $2",
        )
        .bind(run_id)
        .bind(limit)
        .bind(at_most)
        .fetch_all(self.pool())
        .await?;
        rows.into_iter()
            .map(|(sequence, definition, version, state)| {
                Ok(Checkpoint {
                    sequence: sequence as u64,
                    definition,
                    version: version as u32,
                    state: serde_json::from_value(state).map_err(|e| {
                        StoreError::Corrupt(format!("checkpoint at sequence {sequence}: {e}"))
                    })?,
                })
            })
            .collect()
    }

    /// Replays the run's whole log from `X_0` and compares it with the stored projection
    /// (SPEC E3) and with every checkpoint at its sequence (SPEC E4, C10). `Ok(None)` when
    /// they all agree; `Ok(Some(reason))` describes the first mismatch.
    pub async fn verify_run(&self, run_id: Uuid) -> Result<Option<String>, StoreError> {
        self.verify_run_until(run_id, &rein_core::replay_cost::Cancel::new())
            .await
    }

    /// [`Store::verify_run`], stopping early once `cancel` is set: the answer then says so.
    pub async fn verify_run_until(
        &self,
        run_id: Uuid,
        cancel: &rein_core::replay_cost::Cancel,
    ) -> Result<Option<String>, StoreError> {
        let row = self.run(run_id).await?;
        let input = self.run_input(run_id).await?;
        let events = self.history(run_id).await?;
        for (i, e) in events.iter().enumerate() {
            if e.sequence != i as i64 + 1 {
                return Ok(Some(format!(
                    "sequence gap: expected {} found {}",
                    i + 1,
                    e.sequence
                )));
            }
        }
        let checkpoints = match self.checkpoints(run_id, i64::MAX, i64::MAX).await {
            Ok(c) => c,
            Err(StoreError::Corrupt(problem)) => return Ok(Some(problem)),
            Err(e) => return Err(e),
        };
        let logged: Vec<Event> = events.iter().map(StoredEvent::as_event).collect();
        let defs = self
            .log_definitions(&row.definition, row.version, &logged)
            .await?;
        let first = rein_core::migration::first_version(row.version, logged.iter());
        let Some(first_def) = defs.get(&first) else {
            return Ok(Some(format!(
                "the log starts on v{first}, which is not registered"
            )));
        };
        let def_of = |v: u32| defs.get(&v);
        let (replayed, bad_checkpoints) = match rein_core::checkpoint::replay_judging_across(
            &def_of,
            RunState::initial(first_def, input),
            cancel.until_cancelled(logged.iter()),
            &checkpoints,
        ) {
            Ok(_) if cancel.is_cancelled() => {
                return Ok(Some("the check was cancelled before it ended".to_owned()));
            }
            Ok(judged) => judged,
            Err((i, e)) => return Ok(Some(format!("event {} does not replay: {e}", i + 1))),
        };
        // Replay uses the recorded results: every value an event refers to by hash must be
        // there and match it (SPEC E5), unless a redaction deleted it (only finished,
        // redacted runs referred to it): the reference stays, and says it was forgotten.
        for e in &events {
            for blob in rein_core::blob::references(&e.payload) {
                match self.read_blob(&blob).await {
                    Ok(_) => {}
                    Err(StoreError::Corrupt(_)) if self.blob_forgotten(&blob, run_id).await? => {}
                    Err(StoreError::Corrupt(err)) => {
                        return Ok(Some(format!(
                            "event {} refers to a bad blob: {err}",
                            e.sequence
                        )));
                    }
                    Err(err) => return Err(err),
                }
            }
        }
        if replayed != row.projection {
            return Ok(Some(format!(
                "replayed state differs from the stored projection (replayed {} at {}, stored {} at {})",
                replayed.state, replayed.sequence, row.projection.state, row.projection.sequence
            )));
        }
        if row.last_sequence != replayed.sequence as i64 || row.state != replayed.state {
            return Ok(Some("run row columns disagree with the projection".into()));
        }
        let usage = rein_core::model_usage::of_log(&logged);
        if let Some(problem) =
            rein_core::model_usage::disagreement(&usage, &self.run_usage(run_id).await?)
        {
            return Ok(Some(problem));
        }
        Ok(bad_checkpoints.into_iter().next())
    }

    /// Recovery as a new process does it (SPEC E4): the newest checkpoint plus the tail,
    /// up to the sequence of the stored projection. The checkpoint is trusted only when that
    /// reaches the projection exactly; otherwise the state is rebuilt from the whole log,
    /// which is the truth, and [`Recovered::warnings`] says why.
    pub async fn recover_run(&self, run_id: Uuid) -> Result<Recovered, StoreError> {
        let row = self.run(run_id).await?;
        let def = self
            .load_definition(&row.definition, Some(row.version))
            .await?;
        // Events are append-only and contiguous: those up to the projection's sequence are
        // fixed, whatever commits land meanwhile.
        let upto = row.last_sequence;
        let mut warnings = Vec::new();
        let checkpoint = match self.checkpoints(run_id, 1, upto).await {
            Ok(mut c) => c.pop(),
            Err(StoreError::Corrupt(problem)) => {
                warnings.push(format!("the newest checkpoint is unusable ({problem})"));
                None
            }
            Err(e) => return Err(e),
        };
        let mut unusable = None;
        if let Some(checkpoint) = &checkpoint {
            let tail = self
                .events_between(run_id, checkpoint.sequence as i64, upto)
                .await?;
            match checkpoint.recover(&def, tail.iter()) {
                Ok(state) if state == row.projection => {
                    return Ok(Recovered {
                        state,
                        from_checkpoint: Some(checkpoint.sequence),
                        warnings,
                    });
                }
                Ok(_) => {}
                Err(e) => {
                    unusable = Some(format!(
                        "checkpoint at sequence {} is unusable ({e})",
                        checkpoint.sequence
                    ))
                }
            }
        }
        let input = self.run_input(run_id).await?;
        let events = self.events_between(run_id, 0, upto).await?;
        let defs = self
            .log_definitions(&row.definition, row.version, &events)
            .await?;
        let first = rein_core::migration::first_version(row.version, events.iter());
        let first_def = defs
            .get(&first)
            .ok_or_else(|| StoreError::Corrupt(format!("the log starts on unknown v{first}")))?;
        let def_of = |v: u32| defs.get(&v);
        let (replayed, bad_checkpoint) = rein_core::checkpoint::replay_judging_across(
            &def_of,
            RunState::initial(first_def, input),
            events.iter(),
            checkpoint.as_slice(),
        )
        .map_err(|(_, e)| StoreError::Corrupt(format!("log does not replay: {e}")))?;
        if bad_checkpoint.is_empty() {
            warnings.extend(unusable);
        }
        warnings.extend(bad_checkpoint);
        if replayed != row.projection {
            warnings.push(format!(
                "the stored projection (sequence {}) differs from the state the log gives",
                row.projection.sequence
            ));
        }
        if !warnings.is_empty() {
            tracing::warn!(%run_id, problems = %warnings.join("; "),
                "recovery did not trust the stored state and rebuilt it from the log");
        }
        Ok(Recovered {
            state: replayed,
            from_checkpoint: None,
            warnings,
        })
    }

    /// The run's events with `after < sequence <= upto`, in order.
    async fn events_between(
        &self,
        run_id: Uuid,
        after: i64,
        upto: i64,
    ) -> Result<Vec<Event>, StoreError> {
        Ok(self
            .history_after(run_id, after)
            .await?
            .iter()
            .filter(|e| e.sequence <= upto)
            .map(StoredEvent::as_event)
            .collect())
    }

    /// The run's resume brief (SPEC D3), built from its newest checkpoint and the tail of
    /// its log (or from the whole log, when the checkpoint does not hold up).
    pub async fn resume_brief(
        &self,
        run_id: Uuid,
    ) -> Result<rein_core::brief::ResumeBrief, StoreError> {
        Ok(self.resume_brief_checked(run_id).await?.0)
    }

    /// [`Store::resume_brief`] with what recovery had to say about the stored checkpoint and
    /// projection ([`Recovered::warnings`]).
    pub async fn resume_brief_checked(
        &self,
        run_id: Uuid,
    ) -> Result<(rein_core::brief::ResumeBrief, Vec<String>), StoreError> {
        let row = self.run(run_id).await?;
        let def = self
            .load_definition(&row.definition, Some(row.version))
            .await?;
        let recovered = self.recover_run(run_id).await?;
        Ok((
            rein_core::brief::resume_brief(&def, &recovered.state),
            recovered.warnings,
        ))
    }

    /// Runs by (definition, state, status).
    pub async fn count_by_state(&self) -> Result<Vec<(String, String, String, i64)>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT definition, state, status, count(*) FROM rein_runs
             GROUP BY definition, state, status ORDER BY definition, state",
        )
        .fetch_all(self.pool())
        .await?)
    }

    /// Events by type.
    pub async fn count_events_by_type(&self) -> Result<Vec<(String, i64)>, StoreError> {
        Ok(
            sqlx::query_as("SELECT type, count(*) FROM rein_events GROUP BY type ORDER BY type")
                .fetch_all(self.pool())
                .await?,
        )
    }

    /// Events whose payload gives `reason` as theirs (e.g. `approval_expired`, which the
    /// scheduler writes when an approval runs out).
    pub async fn count_events_with_reason(&self, reason: &str) -> Result<i64, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT count(*) FROM rein_events WHERE payload->>'reason' = $1")
                .bind(reason)
                .fetch_one(self.pool())
                .await?,
        )
    }

    /// Every event of type `kind`, oldest first: its run, who wrote it, and when by the
    /// database clock (microseconds since the epoch). What a limit's accuracy is measured by.
    pub async fn event_times(&self, kind: &str) -> Result<Vec<EventTime>, StoreError> {
        let rows: Vec<(uuid::Uuid, i64, String, i64)> = sqlx::query_as(
            "SELECT run_id, sequence, worker,
                    (extract(epoch FROM occurred_at) * 1000000)::bigint
             FROM rein_events WHERE type = $1 ORDER BY occurred_at, run_id, sequence",
        )
        .bind(kind)
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|(run_id, sequence, worker, at_us)| EventTime {
                run_id,
                sequence,
                worker,
                at_us,
            })
            .collect())
    }

    /// Runs parked in one of `states`, oldest first (the demo's simulated approver).
    pub async fn runs_in_states(
        &self,
        states: &[&str],
        limit: i64,
    ) -> Result<Vec<RunRow>, StoreError> {
        let states: Vec<String> = states.iter().map(|s| s.to_string()).collect();
        let rows = sqlx::query(sqlx::AssertSqlSafe(format!(
            "{RUN_ROW} WHERE state = ANY($1) AND status <> 'terminal' ORDER BY state_entered_at LIMIT $2"
        )))
        .bind(&states)
        .bind(limit)
        .fetch_all(self.pool())
        .await?;
        rows.iter().map(RunRow::from_row).collect()
    }

    /// The input a run was enqueued with: its `X_0` business data.
    pub async fn run_input(&self, run_id: Uuid) -> Result<Value, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT input FROM rein_runs WHERE run_id = $1")
                .bind(run_id)
                .fetch_one(self.pool())
                .await?,
        )
    }
}

/// A run's state as recovery rebuilt it ([`Store::recover_run`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Recovered {
    pub state: RunState,
    /// The sequence of the checkpoint it was built from; `None` when built from the whole log.
    pub from_checkpoint: Option<u64>,
    /// Why the newest checkpoint (or the stored projection) was not trusted: it does not
    /// agree with the log. Empty when all is well.
    pub warnings: Vec<String>,
}

/// An event's type and time (see [`Store::events_at`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EventAt {
    pub sequence: i64,
    #[serde(rename = "type")]
    pub kind: String,
    pub occurred_at: DateTime<Utc>,
}

/// When one event was written and by whom (see [`Store::event_times`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventTime {
    pub run_id: uuid::Uuid,
    pub sequence: i64,
    pub worker: String,
    /// Microseconds since the epoch, by the database clock.
    pub at_us: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listed_run_row_decides_on_its_data() {
        let listed = listed_run_row(8);
        assert_ne!(listed, RUN_ROW, "run_row.sql selects ` projection,`");
        assert!(listed.contains("CASE WHEN $8 THEN projection"), "{listed}");
    }

    #[test]
    fn an_id_prefix_names_the_ids_that_start_with_it() {
        let id = Uuid::parse_str("0193a5f2-7c1e-7b3a-9d4e-5f6a7b8c9d0e").unwrap();
        for prefix in [
            "0193a5f2",
            "0193A5F2-7c",
            "0193a5f2-7c1e-7b3a-9d4e-5f6a7b8c9d0e",
            "0",
        ] {
            let (lo, hi) = id_prefix_range(prefix).unwrap();
            assert!(lo <= id && id <= hi, "{prefix}: {lo}..{hi}");
        }
        let (lo, hi) = id_prefix_range("0193a5f3").unwrap();
        assert!(!(lo <= id && id <= hi));
        assert_eq!(id_prefix_range(&id.to_string()), Some((id, id)));
        for bad in [
            "",
            "-",
            "xyz",
            "0193a5f2-7c1e-7b3a-9d4e-5f6a7b8c9d0e0",
            "é",
            &"-".repeat(37),
        ] {
            assert_eq!(id_prefix_range(bad), None, "{bad:?}");
        }
    }
}
