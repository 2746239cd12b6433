//! `rein bench --backlog-runs N --parked-runs M`: a database that already holds history.
//!
//! After the empty-database point, the benchmark copies one finished run of that point N
//! times (row, log, grants, ledger) with creation times spread over the previous calendar
//! month (UTC), in that month's partition of the log, and
//! one lifecycle run parked on an approval M times with creation times over the past fifty
//! minutes, so their approval timers fall between ten minutes and an hour from now; one in
//! [`DUE_EVERY`] of them is due at once. Copies are written by SQL in chunks (no run goes through a worker), then the same
//! point is measured again, the scheduler's ticks over the due share are timed, and reading
//! one run's history is timed before and after. Last, history leaves both ways on the same
//! database: the previous month by moving its partition (`rein retention detach`), and the
//! finished runs of this month run by run (`rein retention archive`), each with its time and
//! WAL.

use std::time::{Duration, Instant};

use chrono::Datelike;

use crate::ratio;
use rein_scheduler::{Scheduler, SchedulerConfig};
use rein_store::{EnqueueRequest, MonthMoved, RunCopies, Store, StoreError};
use rein_worker::{Worker, WorkerConfig};
use serde::Serialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// Copies written per statement: large enough to be fast, small enough to show progress.
const CHUNK: u64 = 25_000;
/// One parked copy in this many is due at once.
pub const DUE_EVERY: i64 = 100;
/// Histories read to time a read.
const HISTORY_READS: i64 = 200;
/// Longest wait for the parked template to reach its approval.
const TEMPLATE_WAIT: Duration = Duration::from_secs(30);
/// Most scheduler ticks timed over the due share.
const TICKS_MAX: usize = 1000;
const PARKED_SPAN_MS: f64 = 3600.0 * 1000.0;
/// The soonest a parked copy that is not due comes due: long after the fill, the point
/// measured on it and the scheduler's ticks, however slow the machine, so only the due share
/// moves while they are measured.
const PARKED_MARGIN_MS: f64 = 600.0 * 1000.0;
/// Runs archived one by one when timing that way (the rest stay hot).
const ROW_ARCHIVE_RUNS_MAX: i64 = 50_000;
/// Runs per transaction when archiving run by run (`rein retention archive`'s default).
const ROW_ARCHIVE_BATCH: i64 = 500;

#[derive(Debug, Clone, Serialize)]
pub struct Filled {
    pub backlog_runs: u64,
    pub parked_runs: u64,
    pub fill_seconds: f64,
    /// Of that, the VACUUM (ANALYZE) after the copies (`Store::settle_filled_tables`).
    pub vacuum_seconds: f64,
    /// Of that, the CHECKPOINT after the VACUUM (`Store::checkpoint`); none when the role
    /// may not checkpoint, and then `checkpoint_unavailable` says why.
    pub checkpoint_seconds: Option<f64>,
    pub checkpoint_unavailable: Option<String>,
    /// Rows (planner estimate after VACUUM and ANALYZE) and bytes with indexes, per table.
    pub tables: Vec<TableSize>,
}

impl Filled {
    /// How the fill settled its tables, for the report: "3 s vacuuming and 1 s
    /// checkpointing" ("none" for a checkpoint the role may not make).
    pub fn settling(&self) -> String {
        let checkpoint = self
            .checkpoint_seconds
            .map_or_else(|| "none".to_string(), |c| format!("{c:.0} s"));
        format!(
            "{:.0} s vacuuming and {checkpoint} checkpointing",
            self.vacuum_seconds
        )
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct TableSize {
    pub table: String,
    pub rows: i64,
    pub mb: f64,
}

/// Reading one run's log (`Store::history`), over a sample of runs.
#[derive(Debug, Clone, Serialize)]
pub struct HistoryReads {
    pub reads: usize,
    pub events_per_read: f64,
    pub us_p50: f64,
    pub us_p99: f64,
}

/// The scheduler's ticks until the due share of the parked runs was handled.
#[derive(Debug, Clone, Serialize)]
pub struct Ticks {
    pub period_ms: u64,
    pub batch: i64,
    pub parked_runs: u64,
    pub due_at_once: u64,
    pub ticks: usize,
    pub runs_moved: usize,
    pub tick_ms_p50: f64,
    pub tick_ms_max: f64,
    /// Whether every tick ended within the scheduler's period.
    pub within_period: bool,
}

fn sorted_percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Times reading the history of up to [`HISTORY_READS`] runs of `queue`.
pub async fn history_reads(store: &Store, queue: &str) -> Result<HistoryReads, StoreError> {
    let runs = store.sample_runs(queue, HISTORY_READS).await?;
    let (mut times, events) = store.time_history_reads(&runs).await?;
    times.sort_by(f64::total_cmp);
    Ok(HistoryReads {
        reads: times.len(),
        events_per_read: events as f64 / times.len().max(1) as f64,
        us_p50: sorted_percentile(&times, 0.5),
        us_p99: sorted_percentile(&times, 0.99),
    })
}

/// Fills the database: `backlog` copies of a finished run of `finished_queue`, `parked`
/// copies of a lifecycle run waiting on an approval. Shows progress on stderr unless `quiet`.
pub async fn fill(
    store: &Store,
    finished_queue: &str,
    backlog: u64,
    parked: u64,
    quiet: bool,
) -> Result<Filled, StoreError> {
    let started = Instant::now();
    let pid = std::process::id();
    let now = chrono::Utc::now();
    if backlog > 0 {
        let template = store
            .template_run(finished_queue, "terminal")
            .await?
            .ok_or_else(|| {
                StoreError::Invalid(format!(
                    "no run of {finished_queue} finished: there is nothing to copy into a backlog (let the first point finish runs: raise --duration-s)"
                ))
            })?;
        // The previous calendar month (UTC), with a partition of its own.
        let this_month = chrono::NaiveDate::from_ymd_opt(now.year(), now.month(), 1)
            .map(|d| d.and_time(chrono::NaiveTime::MIN).and_utc())
            .unwrap_or(now);
        let month_start = this_month
            .checked_sub_months(chrono::Months::new(1))
            .unwrap_or(this_month);
        store.add_event_month(month_start).await?;
        store.add_event_month(now).await?;
        let span_ms = (this_month - month_start).num_milliseconds().max(1) as f64;
        let every = span_ms / backlog as f64;
        copy_in_chunks(
            store,
            RunCopies {
                template,
                queue: &format!("bench-{pid}-backlog"),
                salt: &format!("{pid}-backlog"),
                first: 0,
                last: backlog as i64 - 1,
                created_from: month_start,
                created_every_ms: every,
                due_every: 0,
            },
            "finished runs",
            quiet,
        )
        .await?;
    }
    if parked > 0 {
        let template = parked_template(store, &format!("bench-{pid}-parked")).await?;
        let every = (PARKED_SPAN_MS - PARKED_MARGIN_MS) / parked as f64;
        copy_in_chunks(
            store,
            RunCopies {
                template,
                queue: &format!("bench-{pid}-parked"),
                salt: &format!("{pid}-parked"),
                first: 1,
                last: parked as i64,
                created_from: now
                    - chrono::Duration::milliseconds((PARKED_SPAN_MS - PARKED_MARGIN_MS) as i64),
                created_every_ms: every,
                due_every: DUE_EVERY,
            },
            "parked runs",
            quiet,
        )
        .await?;
    }
    if !quiet {
        eprintln!(
            "vacuuming and analyzing the filled tables, as autovacuum would have over the month…"
        );
    }
    let vacuum_started = Instant::now();
    store.settle_filled_tables().await?;
    let vacuum_seconds = vacuum_started.elapsed().as_secs_f64();
    if !quiet {
        eprintln!(
            "checkpointing the filled tables, as the checkpointer would have over the month…"
        );
    }
    let checkpoint_started = Instant::now();
    let (checkpoint_seconds, checkpoint_unavailable) = match store.checkpoint().await {
        Ok(()) => (Some(checkpoint_started.elapsed().as_secs_f64()), None),
        Err(e) => {
            let why = format!(
                "the fill's WAL was not checkpointed ({e}); the points after it may run inside the checkpoints it sets off: measure as a superuser or a member of pg_checkpoint"
            );
            if !quiet {
                eprintln!("{why}");
            }
            (None, Some(why))
        }
    };
    let tables = store
        .table_sizes()
        .await?
        .into_iter()
        .map(|(table, rows, bytes)| TableSize {
            table,
            rows,
            mb: bytes as f64 / (1024.0 * 1024.0),
        })
        .collect();
    Ok(Filled {
        backlog_runs: backlog,
        parked_runs: parked,
        fill_seconds: started.elapsed().as_secs_f64(),
        vacuum_seconds,
        checkpoint_seconds,
        checkpoint_unavailable,
        tables,
    })
}

async fn copy_in_chunks(
    store: &Store,
    all: RunCopies<'_>,
    what: &str,
    quiet: bool,
) -> Result<(), StoreError> {
    let total = (all.last - all.first + 1) as u64;
    let progress = if quiet {
        indicatif::ProgressBar::hidden()
    } else {
        crate::progress_bar(
            total,
            &format!("copying {{bar:30}} {{pos}}/{{len}} {what} ({{per_sec}}, {{eta}} left)"),
        )
    };
    let mut first = all.first;
    while first <= all.last {
        let last = (first + CHUNK as i64 - 1).min(all.last);
        let wrote = store
            .copy_runs(&RunCopies {
                first,
                last,
                ..all.clone()
            })
            .await?;
        progress.inc(wrote);
        first = last + 1;
    }
    progress.finish_and_clear();
    Ok(())
}

/// A lifecycle run parked on an approval nobody answers (`sim.approval = "expire"`), driven
/// there by a worker of its own in `queue`.
async fn parked_template(store: &Store, queue: &str) -> Result<uuid::Uuid, StoreError> {
    let def = rein_core::builtin::lifecycle();
    match store.register_definition(&def).await {
        Ok(_) | Err(StoreError::DefinitionConflict { .. }) => {}
        Err(e) => return Err(e),
    }
    let mut request = EnqueueRequest::new(def.clone(), json!({ "sim": { "approval": "expire" } }));
    request.queue = queue.to_owned();
    store.enqueue_batch(&[request]).await?;
    let stop = CancellationToken::new();
    let mut config = WorkerConfig::new(format!("{queue}-template"));
    config.queues = vec![queue.to_owned()];
    config.poll_interval_ms = 20;
    let worker = Worker::new(
        store.clone(),
        config,
        rein_worker::builtin_registry(store.clone()),
    );
    let task = {
        let (w, s) = (worker.clone(), stop.clone());
        tokio::spawn(async move {
            let _ = w.run(s).await;
        })
    };
    let deadline = Instant::now() + TEMPLATE_WAIT;
    let found = loop {
        if let Some(run) = store.template_run(queue, "parked").await? {
            break Some(run);
        }
        if Instant::now() > deadline {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    stop.cancel();
    let _ = task.await;
    found.ok_or_else(|| {
        StoreError::Invalid(format!(
            "the lifecycle run in {queue} did not park on its approval within {} s",
            TEMPLATE_WAIT.as_secs()
        ))
    })
}

/// Runs the scheduler's tick, as its leader would every period, until a tick finds nothing
/// due; times each.
pub async fn scheduler_ticks(url: &str, parked: u64) -> Result<Ticks, StoreError> {
    let store = Store::connect_without_migrating(url, 2).await?;
    let config = SchedulerConfig::new(format!("bench-{}-ticks", std::process::id()));
    let (period_ms, batch) = (config.tick_ms, config.batch);
    let mut scheduler = Scheduler::new(store.clone(), config);
    let mut times = Vec::new();
    let mut moved = 0;
    while times.len() < TICKS_MAX {
        let start = Instant::now();
        let n = scheduler.tick().await?;
        times.push(start.elapsed().as_secs_f64() * 1000.0);
        moved += n;
        if n == 0 {
            break;
        }
    }
    store.pool().close().await;
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let max = sorted.last().copied().unwrap_or(0.0);
    Ok(Ticks {
        period_ms,
        batch,
        parked_runs: parked,
        due_at_once: parked / DUE_EVERY as u64,
        ticks: times.len(),
        runs_moved: moved,
        tick_ms_p50: sorted_percentile(&sorted, 0.5),
        tick_ms_max: max,
        within_period: max <= period_ms as f64,
    })
}

/// History leaving the hot log both ways on the same database.
#[derive(Debug, Clone, Serialize)]
pub struct RetentionBothWays {
    /// The previous month, moved as one partition; none when no month could move.
    pub month: Option<MonthMoved>,
    pub month_events: i64,
    pub month_us_per_run: f64,
    pub month_wal_bytes_per_run: f64,
    /// Finished runs of this month, archived run by run.
    pub rows: RowArchive,
    /// Row by row ÷ by partition, per run: time and WAL.
    pub time_ratio: f64,
    pub wal_ratio: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct RowArchive {
    pub runs: i64,
    pub events: i64,
    pub seconds: f64,
    pub wal_bytes: i64,
    pub us_per_run: f64,
    pub wal_bytes_per_run: f64,
}

/// Moves the months whose runs all ended out of the hot log by partition, then archives up
/// to [`ROW_ARCHIVE_RUNS_MAX`] finished runs of the rest run by run, timing both.
pub async fn retention_both_ways(
    store: &Store,
    quiet: bool,
) -> Result<RetentionBothWays, StoreError> {
    let cutoff = store.archive_cutoff(1).await?;
    let mut month = None;
    let mut month_events = 0;
    for candidate in store.month_candidates(cutoff).await? {
        if candidate.unfinished > 0 || month.is_some() {
            continue;
        }
        if !quiet {
            eprintln!(
                "moving {} ({} runs) to the archive by its partition…",
                candidate.name, candidate.runs
            );
        }
        let moved = store.archive_month(&candidate.name, cutoff).await?;
        month_events = store.archived_month_events(&moved.archived_as).await?;
        month = Some(moved);
    }
    let row_runs = store
        .archive_candidates(cutoff)
        .await?
        .runs
        .min(ROW_ARCHIVE_RUNS_MAX);
    let progress = if quiet {
        indicatif::ProgressBar::hidden()
    } else {
        crate::progress_bar(
            row_runs as u64,
            "archiving run by run {bar:30} {pos}/{len} runs ({per_sec}, {eta} left)",
        )
    };
    let before = store.db_cost(false).await?;
    let started = Instant::now();
    let (mut runs, mut events) = (0, 0);
    while runs < row_runs {
        let batch = store
            .archive_batch(cutoff, ROW_ARCHIVE_BATCH.min(row_runs - runs))
            .await?;
        if batch.runs == 0 {
            break;
        }
        runs += batch.runs;
        events += batch.events;
        progress.inc(batch.runs as u64);
    }
    progress.finish_and_clear();
    let seconds = started.elapsed().as_secs_f64();
    let wal_bytes = store.db_cost(false).await?.wal_lsn - before.wal_lsn;
    let rows = RowArchive {
        runs,
        events,
        seconds,
        wal_bytes,
        us_per_run: ratio(seconds * 1e6, runs as f64),
        wal_bytes_per_run: ratio(wal_bytes as f64, runs as f64),
    };
    let (month_us_per_run, month_wal_bytes_per_run) = month
        .as_ref()
        .map(|m| {
            (
                ratio(m.seconds * 1e6, m.runs as f64),
                ratio(m.wal_bytes as f64, m.runs as f64),
            )
        })
        .unwrap_or((0.0, 0.0));
    Ok(RetentionBothWays {
        time_ratio: ratio(rows.us_per_run, month_us_per_run),
        wal_ratio: ratio(rows.wal_bytes_per_run, month_wal_bytes_per_run),
        month,
        month_events,
        month_us_per_run,
        month_wal_bytes_per_run,
        rows,
    })
}
