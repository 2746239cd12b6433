//! `rein bench`: throughput and latency of a workload, against the database's own insert rate
//! measured in the same run on the same server, with the same durability settings.
//!
//! Every point runs in its own queue, so runs a point left unfinished never leak into the
//! next. Rates and latencies come from the database clock (event and grant timestamps);
//! transactions from `pg_stat_database`, with the benchmark's own queries subtracted.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rein_core::Definition;

use crate::ratio;
use rein_scheduler::{Scheduler, SchedulerConfig};
use rein_store::{
    DbCost, EnqueueRequest, FLOOR_EVENTS_PER_LIFE, FloorShape, Percentiles, QueueStats,
    StatementCost, StatementKind, Store, StoreError,
};
use rein_worker::{Worker, WorkerConfig};
use serde::Serialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::procs::Children;
use rein_process::report;
use rein_process::{DbArgs, exit};

#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Definition to run: a built-in name or a TOML/JSON file. Its actions must be `noop`
    /// or `sim`.
    #[arg(long, default_value = "chain4")]
    definition: String,
    /// Input of every run, as JSON (e.g. `{"sim":{"work_ms":5}}` for sim actions).
    #[arg(long, default_value = "{}")]
    input: String,
    /// Runs per point (a point also ends after --duration-s).
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    runs: u32,
    /// In-process workers.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=16))]
    workers: u32,
    /// Real `rein worker` processes instead of in-process workers.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=16))]
    processes: Option<u32>,
    /// Runs each worker drives at once.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=4096))]
    concurrency: u32,
    /// Most runs taken per claim query.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1000))]
    claim_batch: u32,
    /// How long a busy worker waits for a claim batch of free slots (or half its slots, when
    /// that is fewer) before it claims (`rein worker --claim-gather-ms`); 0 claims as soon
    /// as one slot is free.
    #[arg(long, default_value_t = rein_worker::CLAIM_GATHER_MS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(0..=10_000))]
    claim_gather_ms: u64,
    /// Commit one run per statement instead of grouping commits.
    #[arg(long)]
    no_commit_batching: bool,
    /// Connections each worker may open.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..=32))]
    worker_pool: u32,
    /// Longest a point may take.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=3600))]
    duration_s: u64,
    /// Run 1, 2, 4 and 8 workers (or processes), then a point at half the peak rate.
    #[arg(long)]
    scale: bool,
    /// Enqueue at this many runs per second while workers run (open loop) instead of
    /// enqueueing every run first; latency at a chosen load.
    #[arg(long)]
    rate: Option<f64>,
    /// Seconds each reference measurement lasts (after a 2 s warm-up).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=600))]
    reference_s: u64,
    /// Connections the reference (and --floor) write from [default: as many as the headline
    /// point's workers opened]. With fewer connections the reference is slower too (each
    /// waits out its own commit's flush), so a fleet of fewer, fuller workers meets a
    /// weaker reference; pin it to compare fleet shapes against the same one.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    reference_connections: Option<u32>,
    /// After the reference, measure the floor under a step's cost: the bare writes a commit
    /// cannot do without (each run's event; and its row locked and updated under its token;
    /// and its projection written; and, apart, each run's event alone under its share-locked
    /// token), one statement for 28 runs on scratch tables, for --reference-s each.
    #[arg(long)]
    floor: bool,
    /// Measure the point and then the reference this many times in turn, and report each
    /// pair's ratio with the median and the range. A shared machine's speed drifts between
    /// one measurement and the next, so a single pair's ratio can be off by a fifth; the
    /// headline figures are the median pair's. One point of --workers (or --processes),
    /// closed loop, on an empty database.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10))]
    repeat: u32,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
    /// Idle wait of the workers between claim queries when nothing was found [default: 20;
    /// with --compare-redis 100, a worker's own default].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    poll_interval_ms: Option<u64>,
    /// With `--redis-url`, enqueues, fired timers and released runs publish wake-ups that cut
    /// the workers' idle wait short.
    #[command(flatten)]
    redis: rein_process::RedisArgs,
    /// Run the open-loop point twice, first with workers polling only (no publishing, no
    /// subscription), then with Redis wake-ups, and compare enqueue → start latency and
    /// claim queries. Needs `--redis-url` (or REDIS_URL) and `--rate`.
    #[arg(long)]
    compare_redis: bool,
    /// Measure what Rein adds to each step of a model agent instead: `support-agent` runs
    /// against a stand-in model that answers at once (enqueue → first model request, reply →
    /// next request, p50/p99), next to one durable commit measured in the same run.
    #[arg(long)]
    model: bool,
    /// With --model: runs to drive.
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    model_runs: u32,
    /// With --model: runs enqueued per second (open loop).
    #[arg(long, default_value_t = 20.0)]
    model_rate: f64,
    /// After the empty-database point(s), copy this many finished runs of the first point,
    /// with their logs, into the database (by SQL, spread over the previous calendar month),
    /// then measure the headline point again, and time history leaving both ways: that month
    /// by its partition, this month's finished runs one by one.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=10_000_000))]
    backlog_runs: u64,
    /// With the backlog: this many lifecycle runs parked on approvals whose timers fall in
    /// the next hour, one in 100 due at once; the scheduler's ticks over them are timed.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    parked_runs: u64,
}

/// The benchmark's poll interval: short, so a closed-loop point measures the database
/// rather than idle waits.
const POLL_INTERVAL_MS_DEFAULT: u64 = 20;
/// With `--compare-redis`: what a `rein worker` polls at unless told otherwise, the wait that
/// wake-ups are there to cut short; a shorter one would hide what they save.
const POLL_INTERVAL_MS_COMPARE: u64 = 100;

const REFERENCE_BATCH: usize = 10;
const WARM_UP: Duration = Duration::from_secs(2);
const ENQUEUE_CHUNK: usize = 1000;
const POLL: Duration = Duration::from_millis(250);
/// Connections beyond the workers': the benchmark's own, the scheduler's.
const OVERHEAD_CONNECTIONS: u32 = 8;
/// Leave room under Postgres' default 100 connections for everything else.
const CONNECTIONS_MAX: u32 = 90;

#[derive(Debug, Clone, Serialize)]
struct Reference {
    connections: u32,
    seconds: f64,
    single_inserts_per_s: f64,
    batched_inserts_per_s: f64,
    batch_size: usize,
    /// What a scratch row cost the database, one row per transaction.
    single_cost: RowCost,
    /// What a scratch row cost the database at `batch_size` rows per transaction.
    batched_cost: RowCost,
}

/// The database's cost of one reference row.
#[derive(Debug, Clone, Default, Serialize)]
struct RowCost {
    /// WAL written per row (`pg_current_wal_lsn()` before and after; server-wide).
    wal_bytes_per_row: f64,
    /// Execution time of the insert statement per row (`pg_stat_statements`); None when it
    /// is unavailable.
    db_us_per_row: Option<f64>,
    /// CPU time the whole machine spent per row (see [`machine_busy_us`]).
    machine_cpu_us_per_row: Option<f64>,
    /// Of that, what this process spent, the client that sent the rows (see
    /// [`process_cpu_us`]); the rest is the database server's.
    client_cpu_us_per_row: Option<f64>,
    /// The machine's CPU less the client's: what the database server spent on a row.
    server_cpu_us_per_row: Option<f64>,
}

/// The machine's CPU less a client's (this process's), when both were read: what the
/// database server spent, its processes and the kernel's work for them. None when the
/// difference is not positive (the two counters' ticks differ; a tiny load can invert them).
fn server_cpu(machine: Option<f64>, client: Option<f64>) -> Option<f64> {
    let server = machine? - client?;
    (server > 0.0).then_some(server)
}

/// A reference row's CPU over an event's, when both were read: 0.5 means an event costs
/// twice a row.
fn cpu_ratio(row: Option<f64>, event: Option<f64>) -> Option<f64> {
    Some(ratio(row?, event?))
}

/// CPU time the whole machine has spent busy since boot, in µs: user, nice, system, irq and
/// softirq from /proc/stat (idle, I/O wait and time stolen by a hypervisor left out). A
/// point's delta divided by its events is what one event cost the machine, the database's
/// processes and the workers together; unlike a rate, it does not move when a neighbour
/// takes the CPU away. None where /proc/stat is not there.
fn machine_busy_us() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let ticks: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|t| t.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal ...
    let busy = [0, 1, 2, 5, 6]
        .iter()
        .filter_map(|&i| ticks.get(i))
        .sum::<f64>();
    // SAFETY: sysconf only reads a constant of the system.
    let per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (per_s > 0).then(|| busy * 1e6 / per_s as f64)
}

/// CPU time this process has spent, user and system, in µs (what its `process_cpu_seconds_total`
/// metric exports): with in-process workers, what the workers (and the benchmark's own polls)
/// cost, apart from the database's processes.
fn process_cpu_us() -> Option<f64> {
    metrics_process::collector::collect()
        .cpu_seconds_total
        .map(|s| s * 1e6)
}

/// The CPUs /proc/stat counts in its `cpu` line (one `cpuN` line each); None where it is not
/// there.
fn machine_cpus() -> Option<u32> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let n = stat
        .lines()
        .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
        .count();
    u32::try_from(n).ok().filter(|&n| n > 0)
}

/// How busy the machine's CPUs were over `secs` in which [`machine_busy_us`] moved by
/// `busy_us`: 1 is every CPU busy the whole time.
fn busy_share(busy_us: Option<f64>, secs: f64, cpus: Option<u32>) -> Option<f64> {
    let (busy_us, capacity) = (busy_us?, secs * 1e6 * f64::from(cpus?));
    (capacity > 0.0).then(|| busy_us / capacity)
}

/// At this share of the machine busy or more (in whole percent, as printed), a point is bound
/// by CPU: what the database and the workers compute, not what they wait for. Not 100: the
/// share is taken from the fleet's start to the last run's end, and the last few runs of a
/// closed-loop point cannot keep every CPU busy (about 7% of a 2-CPU machine stayed idle at
/// the steady state of a 4-worker point that was 90% busy over the whole).
const CPU_BOUND_PERCENT: f64 = 85.0;

/// CPU time spent between two readings of [`machine_busy_us`] or of [`process_cpu_us`].
fn cpu_between(from: Option<f64>, to: Option<f64>) -> Option<f64> {
    Some(to? - from?)
}

/// What the database spent on one point, per committed event and per claimed run.
#[derive(Debug, Clone, Default, Serialize)]
struct PointCost {
    /// WAL written during the point (`pg_current_wal_lsn()` before and after; server-wide,
    /// so other databases on a shared server are counted too).
    wal_bytes: i64,
    wal_bytes_per_event: f64,
    /// CPU time the whole machine spent per committed event (see [`machine_busy_us`]).
    machine_cpu_us_per_event: Option<f64>,
    /// Of that, what the in-process workers spent (this process's CPU, see
    /// [`process_cpu_us`]); None when the workers are `rein worker` processes.
    workers_cpu_us_per_event: Option<f64>,
    /// The machine's CPU less the workers': what the database server spent on an event,
    /// the figure that would stay if the workers ran on machines of their own. None with
    /// `rein worker` processes.
    server_cpu_us_per_event: Option<f64>,
    /// How busy the machine's CPUs were while the runs ran (from the fleet's start until
    /// the last run ended; 1 = all of them all the time), and how many CPUs that is. At
    /// [`CPU_BOUND_PERCENT`] or more the point is bound by CPU; below it, by waits.
    machine_busy_share: Option<f64>,
    machine_cpus: Option<u32>,
    /// Why the statement figures below are missing, when they are.
    statements_unavailable: Option<String>,
    /// Execution time of every statement this database ran during the point, per event.
    db_us_per_event: Option<f64>,
    /// The commit statement's execution time and WAL per committed event.
    commit_us_per_event: Option<f64>,
    commit_wal_bytes_per_event: Option<f64>,
    commit_calls: Option<i64>,
    /// Committed events per commit statement (the group commit's batch).
    events_per_commit: Option<f64>,
    /// The claim statement's execution time and WAL per run it took.
    claim_us_per_claimed_run: Option<f64>,
    claim_wal_bytes_per_claimed_run: Option<f64>,
    runs_claimed: Option<i64>,
    /// Claim statements, and runs each took on average (group claiming).
    claim_calls: Option<i64>,
    runs_per_claim: Option<f64>,
    /// The statements that cost the most, most first.
    top_statements: Vec<StatementFigures>,
}

#[derive(Debug, Clone, Serialize)]
struct StatementFigures {
    kind: StatementKind,
    text: String,
    calls: i64,
    rows: i64,
    total_ms: f64,
    us_per_event: f64,
    wal_bytes_per_event: f64,
}

/// Statements listed in a point's cost.
const TOP_STATEMENTS: usize = 10;

impl PointCost {
    /// `cpu_us`: the machine's busy CPU over the point ([`machine_busy_us`] after less
    /// before), when it could be read; `workers_cpu_us` the in-process workers' part of it.
    fn new(
        before: &DbCost,
        after: &DbCost,
        (cpu_us, workers_cpu_us): (Option<f64>, Option<f64>),
        events: i64,
        unavailable: Option<&str>,
    ) -> PointCost {
        let (wal, statements) = after.since(before);
        let per_event = |x: f64| ratio(x, events as f64);
        let mut cost = PointCost {
            wal_bytes: wal,
            wal_bytes_per_event: per_event(wal as f64),
            machine_cpu_us_per_event: cpu_us.map(per_event),
            workers_cpu_us_per_event: workers_cpu_us.map(per_event),
            server_cpu_us_per_event: server_cpu(cpu_us, workers_cpu_us).map(per_event),
            statements_unavailable: unavailable.map(str::to_owned),
            ..Default::default()
        };
        let Some(statements) = statements else {
            return cost;
        };
        let sum = |kind: StatementKind| {
            let of: Vec<&StatementCost> = statements.iter().filter(|s| s.kind == kind).collect();
            (
                of.iter().map(|s| s.calls).sum::<i64>(),
                of.iter().map(|s| s.rows).sum::<i64>(),
                of.iter().map(|s| s.total_ms).fold(0.0, |a, b| a + b),
                of.iter().map(|s| s.wal_bytes).sum::<i64>(),
            )
        };
        let total_ms = statements
            .iter()
            .map(|s| s.total_ms)
            .fold(0.0, |a, b| a + b);
        cost.db_us_per_event = Some(per_event(total_ms * 1000.0));
        let (calls, _, ms, wal) = sum(StatementKind::Commit);
        cost.commit_calls = Some(calls);
        cost.events_per_commit = Some(ratio(events as f64, calls as f64));
        cost.commit_us_per_event = Some(per_event(ms * 1000.0));
        cost.commit_wal_bytes_per_event = Some(per_event(wal as f64));
        let (claims, claimed, ms, wal) = sum(StatementKind::Claim);
        cost.runs_claimed = Some(claimed);
        cost.claim_calls = Some(claims);
        cost.runs_per_claim = Some(ratio(claimed as f64, claims as f64));
        cost.claim_us_per_claimed_run = Some(ratio(ms * 1000.0, claimed as f64));
        cost.claim_wal_bytes_per_claimed_run = Some(ratio(wal as f64, claimed as f64));
        cost.top_statements = statements
            .iter()
            .take(TOP_STATEMENTS)
            .map(|s| StatementFigures {
                kind: s.kind,
                text: s.text.clone(),
                calls: s.calls,
                rows: s.rows,
                total_ms: s.total_ms,
                us_per_event: per_event(s.total_ms * 1000.0),
                wal_bytes_per_event: per_event(s.wal_bytes as f64),
            })
            .collect();
        cost
    }
}

#[derive(Debug, Clone, Serialize)]
struct Point {
    /// Whether the fleet published and subscribed to Redis wake-ups.
    redis: bool,
    workers: u32,
    processes: bool,
    /// Open-loop enqueue rate, when the point had one.
    offered_runs_per_s: Option<f64>,
    runs: i64,
    runs_finished: i64,
    events: i64,
    steps: i64,
    seconds: f64,
    runs_per_s: f64,
    steps_per_s: f64,
    events_per_s: f64,
    db_transactions: i64,
    db_transactions_per_step: f64,
    enqueue_to_start_ms: Percentiles,
    step_ms: Percentiles,
    claim_ms_p50: f64,
    claim_ms_p99: f64,
    claim_queries: u64,
    /// Claim queries per finished run: how much polling (or waking) it took to start work.
    claim_queries_per_run: f64,
    /// Wake-ups published on the point's queue channel, as a listener of the benchmark's own
    /// saw them (`--compare-redis` only).
    wakeups_published: Option<u64>,
    /// Connections subscribed to the point's queue channel near the end of the load, the
    /// benchmark's listener not counted (`--compare-redis` only).
    wake_subscribers: Option<u64>,
    commit_statements: u64,
    /// Database connections the workers had open at the end of the point.
    connections: u32,
    /// Peak resident set per worker process (the benchmark's own when in-process).
    peak_rss_mb: Vec<f64>,
    /// What the database spent on the point.
    cost: PointCost,
}

impl Point {
    /// The database server's CPU per reference row at [`REFERENCE_BATCH`] rows per
    /// transaction over its CPU per committed event, each with its own client left out: 0.5
    /// means an event costs the server twice a row. None where a side's CPU was not read.
    fn server_cpu_ratio(&self, r: &Reference) -> Option<f64> {
        cpu_ratio(
            r.batched_cost.server_cpu_us_per_row,
            self.cost.server_cpu_us_per_event,
        )
    }
}

#[derive(Clone)]
struct Plan {
    definition: Definition,
    input: Value,
    url: String,
    args_runs: u32,
    concurrency: u32,
    claim_batch: u32,
    claim_gather_ms: u64,
    commit_batching: bool,
    worker_pool: u32,
    duration: Duration,
    processes: bool,
    /// Where child logs go.
    log_dir: std::path::PathBuf,
    json: bool,
    poll_interval_ms: u64,
    redis: rein_process::RedisArgs,
    /// Why statement costs cannot be measured (None: pg_stat_statements is there).
    statements_unavailable: Option<String>,
}

pub async fn bench(args: BenchArgs) -> u8 {
    rein_process::init_logging_at(false, "error");
    let input = match serde_json::from_str::<Value>(&args.input) {
        Ok(v) if v.is_object() => v,
        Ok(_) => {
            eprintln!("error: --input must be a JSON object");
            return exit::INPUT;
        }
        Err(e) => {
            eprintln!("error: --input is not valid JSON: {e}");
            return exit::INPUT;
        }
    };
    let definition = match rein_ops::load_definition(&args.definition) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::INPUT;
        }
    };
    let known = rein_worker::builtin_registry_actions();
    if let Some(action) = definition
        .states()
        .filter_map(|s| s.action.as_deref())
        .find(|a| !known.contains(a))
    {
        eprintln!(
            "error: the benchmark runs built-in actions only ({}); `{}` uses `{action}`",
            known.join(", "),
            definition.name()
        );
        return exit::INPUT;
    }
    if let Some(rate) = args.rate
        && !(rate.is_finite() && rate > 0.0 && rate <= 100_000.0)
    {
        eprintln!("error: --rate must be a number of runs per second in (0, 100000]");
        return exit::INPUT;
    }
    if args.compare_redis {
        if args.redis.config().is_none() {
            eprintln!(
                "error: --compare-redis measures with and without Redis wake-ups: pass --redis-url redis://HOST:PORT (or set REDIS_URL), and on a shared Redis a --redis-prefix of its own"
            );
            return exit::INPUT;
        }
        if args.rate.is_none() {
            eprintln!(
                "error: --compare-redis compares latency at one offered load: pass an open-loop --rate in runs per second (e.g. --rate 50)"
            );
            return exit::INPUT;
        }
        if args.scale {
            eprintln!("error: --compare-redis runs one point twice; leave out --scale");
            return exit::INPUT;
        }
    }
    if args.reference_connections.is_some() && (args.compare_redis || args.model) {
        eprintln!(
            "error: --reference-connections sets the insert reference's connections; --compare-redis and --model measure no such reference, leave it out"
        );
        return exit::INPUT;
    }
    if args.repeat > 1
        && (args.scale
            || args.rate.is_some()
            || args.compare_redis
            || args.model
            || args.backlog_runs > 0
            || args.parked_runs > 0)
    {
        eprintln!(
            "error: --repeat measures one closed-loop point and the reference in turn; leave out --scale, --rate, --compare-redis, --model, --backlog-runs and --parked-runs"
        );
        return exit::INPUT;
    }
    let widest = if args.scale {
        8
    } else {
        args.processes.unwrap_or(args.workers)
    };
    let connections = widest * args.worker_pool + OVERHEAD_CONNECTIONS;
    if connections > CONNECTIONS_MAX {
        eprintln!(
            "error: {widest} workers × {} connections + {OVERHEAD_CONNECTIONS} would open {connections} connections; keep it under {CONNECTIONS_MAX} (lower --worker-pool)",
            args.worker_pool
        );
        return exit::INPUT;
    }

    if (args.backlog_runs > 0 || args.parked_runs > 0) && (args.model || args.compare_redis) {
        eprintln!(
            "error: --backlog-runs and --parked-runs measure the workload's point on a full database; leave out --model and --compare-redis"
        );
        return exit::INPUT;
    }
    if args.model
        && !(args.model_rate.is_finite() && args.model_rate > 0.0 && args.model_rate <= 1000.0)
    {
        eprintln!("error: --model-rate must be a number of runs per second in (0, 1000]");
        return exit::INPUT;
    }
    let mut private = None;
    let url = match args.db.database_url.clone() {
        Some(url) => url,
        None => match crate::privdb::start_with_statement_stats("bench", false).await {
            Ok(pg) => {
                let url = pg.url();
                private = Some(pg);
                url
            }
            Err(code) => return code,
        },
    };
    let plan = Plan {
        definition,
        input,
        url,
        args_runs: args.runs,
        concurrency: args.concurrency,
        claim_batch: args.claim_batch,
        claim_gather_ms: args.claim_gather_ms,
        commit_batching: !args.no_commit_batching,
        worker_pool: args.worker_pool,
        duration: Duration::from_secs(args.duration_s),
        processes: args.processes.is_some(),
        log_dir: crate::privdb::base_dir()
            .with_file_name(format!("rein-bench-{}", std::process::id())),
        json: args.json,
        poll_interval_ms: args.poll_interval_ms.unwrap_or(if args.compare_redis {
            POLL_INTERVAL_MS_COMPARE
        } else {
            POLL_INTERVAL_MS_DEFAULT
        }),
        redis: args.redis.clone(),
        statements_unavailable: None,
    };
    let code = if args.model {
        run_model(&args, &plan.url, private.is_some()).await
    } else {
        run(&args, &plan, private.is_some()).await
    };
    if let Some(pg) = private {
        crate::privdb::finish(pg, code == exit::OK).await;
    }
    if code == exit::OK {
        let _ = std::fs::remove_dir_all(&plan.log_dir);
    } else if plan.log_dir.exists() {
        eprintln!("worker logs are kept in {}", plan.log_dir.display());
    }
    code
}

/// Connects with `pool` connections; a private server gets the schema, a given one must
/// have it current.
async fn open_store(args: &BenchArgs, url: &str, pool: u32, private: bool) -> Result<Store, u8> {
    let store = Store::connect_within(url, pool, args.db.db_connect_timeout_ms)
        .await
        .map_err(|e| report(&e))?;
    let checked = if private {
        store.migrate().await
    } else {
        store.check_schema().await
    };
    checked.map_err(|e| report(&e))?;
    Ok(store)
}

/// `--model`: the model-step overhead (see [`crate::bench_model`]).
async fn run_model(args: &BenchArgs, url: &str, private: bool) -> u8 {
    let store = match open_store(args, url, 8, private).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let bench = crate::bench_model::ModelBench {
        runs: args.model_runs,
        rate: args.model_rate,
        timeout: Duration::from_secs(args.duration_s.max(60) + u64::from(args.model_runs)),
    };
    match crate::bench_model::run(&store, &bench).await {
        Ok(figures) if args.json => {
            println!("{figures}");
            exit::OK
        }
        Ok(figures) => {
            crate::bench_model::print(&figures);
            exit::OK
        }
        Err(e) => {
            eprintln!("error: {e}");
            exit::REFUSED
        }
    }
}

async fn run(args: &BenchArgs, plan: &Plan, private: bool) -> u8 {
    let store = match open_store(args, &plan.url, 2, private).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    // A private server is ours to add the extension to; a given database is left as it is.
    let plan = &Plan {
        statements_unavailable: store.statement_stats(private).await.err(),
        ..plan.clone()
    };
    match store.register_definition(&plan.definition).await {
        Ok(_) => {}
        Err(StoreError::DefinitionConflict { name, version }) => {
            eprintln!(
                "error: the database already holds a different {name} v{version}; give the file a new version"
            );
            return exit::INPUT;
        }
        Err(e) => return report(&e),
    }
    let mut settings = BTreeMap::new();
    for name in [
        "server_version",
        "synchronous_commit",
        "fsync",
        "max_connections",
    ] {
        match store.setting(name).await {
            Ok(v) => {
                settings.insert(name, v);
            }
            Err(e) => return report(&e),
        }
    }
    let points: Vec<u32> = if args.scale {
        vec![1, 2, 4, 8]
    } else {
        vec![args.processes.unwrap_or(args.workers)]
    };
    if !plan.json {
        eprintln!(
            "rein bench: {} v{}, {} {}, {} runs at once each, claim batch {} (gathered for up to {} ms), commit batching {}",
            plan.definition.name(),
            plan.definition.version(),
            points
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join("/"),
            if plan.processes {
                "worker processes"
            } else {
                "in-process workers"
            },
            plan.concurrency,
            plan.claim_batch,
            plan.claim_gather_ms,
            if plan.commit_batching { "on" } else { "off" },
        );
        eprintln!(
            "database: PostgreSQL {}, synchronous_commit={}, fsync={}, max_connections={}",
            settings["server_version"],
            settings["synchronous_commit"],
            settings["fsync"],
            settings["max_connections"]
        );
        if let Some(why) = &plan.statements_unavailable {
            eprintln!("statement costs unavailable: {why}");
        }
    }

    if args.compare_redis {
        return compare_redis(args, plan, &store, &settings).await;
    }

    let mut results = Vec::new();
    for (i, &workers) in points.iter().enumerate() {
        let point = match run_point(plan, &store, i, workers, args.rate, None).await {
            Ok(p) => p,
            Err(code) => return code,
        };
        if !plan.json {
            eprintln!("{}", point_line(&point));
        }
        results.push(point);
    }
    let mut peak = results
        .iter()
        .max_by(|a, b| a.events_per_s.total_cmp(&b.events_per_s))
        .cloned()
        .expect("at least one point");
    let half_peak = if args.scale && args.rate.is_none() && peak.runs_per_s > 0.0 {
        let rate = peak.runs_per_s / 2.0;
        match run_point(plan, &store, results.len(), peak.workers, Some(rate), None).await {
            Ok(p) => {
                if !plan.json {
                    eprintln!("{}", point_line(&p));
                }
                Some(p)
            }
            Err(code) => return code,
        }
    } else {
        None
    };

    let backlog = if args.backlog_runs > 0 || args.parked_runs > 0 {
        match measure_backlog(args, plan, &store, &results, &peak).await {
            Ok(b) => Some(b),
            Err(code) => return code,
        }
    } else {
        None
    };

    // As many connections as the workers of the headline point had open, unless pinned.
    let reference_connections = args.reference_connections.unwrap_or(peak.connections);
    let mut reference = match reference_at(plan, reference_connections, args.reference_s).await {
        Ok(r) => r,
        Err(code) => return code,
    };

    // `--repeat`: the point and the reference again, in turn; the median pair leads.
    let mut pairs = vec![(peak.clone(), reference.clone())];
    for i in 1..args.repeat as usize {
        let point = match run_point(plan, &store, i, peak.workers, None, None).await {
            Ok(p) => p,
            Err(code) => return code,
        };
        if !plan.json {
            eprintln!("{}", point_line(&point));
        }
        let connections = args.reference_connections.unwrap_or(point.connections);
        let again = match reference_at(plan, connections, args.reference_s).await {
            Ok(r) => r,
            Err(code) => return code,
        };
        pairs.push((point, again));
    }
    let repeats = Repeats::of(&pairs);
    if repeats.headline != 0 {
        (peak, reference) = pairs[repeats.headline].clone();
        results = vec![peak.clone()];
    }

    let floor = if args.floor {
        match measure_floor(
            &plan.url,
            reference_connections,
            Duration::from_secs(args.reference_s),
            plan.statements_unavailable.is_none(),
            &reference,
        )
        .await
        {
            Ok(f) => Some(f),
            Err(e) => return report(&e),
        }
    } else {
        None
    };

    let mut own_rss = Vec::new();
    if let Some(b) = crate::procs::own_peak_rss_bytes() {
        own_rss.push(mb(b));
    }
    let params = params(
        plan,
        args.rate,
        &points,
        json!(plan.redis.config().is_some()),
        &settings,
    );
    // The headline figures: the single point, or the peak of the curve.
    let headline = &peak;
    let latency_from = half_peak.as_ref().unwrap_or(headline);
    let summary = json!({
        "runs_per_s": headline.runs_per_s,
        "steps_per_s": headline.steps_per_s,
        "events_per_s": headline.events_per_s,
        "db_transactions_per_step": headline.db_transactions_per_step,
        "db_cost": {
            "wal_bytes_per_event": headline.cost.wal_bytes_per_event,
            "db_us_per_event": headline.cost.db_us_per_event,
            "commit_us_per_event": headline.cost.commit_us_per_event,
            "commit_wal_bytes_per_event": headline.cost.commit_wal_bytes_per_event,
            "claim_us_per_claimed_run": headline.cost.claim_us_per_claimed_run,
            "runs_per_claim": headline.cost.runs_per_claim,
            "machine_cpu_us_per_event": headline.cost.machine_cpu_us_per_event,
            "workers_cpu_us_per_event": headline.cost.workers_cpu_us_per_event,
            "server_cpu_us_per_event": headline.cost.server_cpu_us_per_event,
            "machine_busy_share": headline.cost.machine_busy_share,
            "machine_cpus": headline.cost.machine_cpus,
            "events_per_commit": headline.cost.events_per_commit,
            "statements_unavailable": headline.cost.statements_unavailable,
            "reference_batched": reference.batched_cost,
            "reference_single": reference.single_cost,
        },
        "latency_ms": {
            "measured_at": if half_peak.is_some() { "half of peak throughput" } else { "the single point" },
            "enqueue_to_start_p50": latency_from.enqueue_to_start_ms.p50,
            "enqueue_to_start_p90": latency_from.enqueue_to_start_ms.p90,
            "enqueue_to_start_p99": latency_from.enqueue_to_start_ms.p99,
            "step_p50": latency_from.step_ms.p50,
            "step_p90": latency_from.step_ms.p90,
            "step_p99": latency_from.step_ms.p99,
            "claim_p50": latency_from.claim_ms_p50,
            "claim_p99": latency_from.claim_ms_p99,
        },
        "ratios": {
            "events_per_s_to_batched_rows_per_s": ratio(headline.events_per_s, reference.batched_inserts_per_s),
            "steps_per_s_to_single_inserts_per_s": ratio(headline.steps_per_s, reference.single_inserts_per_s),
            // The reference's machine CPU per row over the point's per event: 0.5 means an
            // event costs the machine twice a row at 10 rows per transaction.
            "batched_row_cpu_to_event_cpu": cpu_ratio(
                reference.batched_cost.machine_cpu_us_per_row,
                headline.cost.machine_cpu_us_per_event,
            ),
            // The same with each side's client left out (Rein's in-process workers, the
            // reference's inserting process): the database server's CPU per reference row
            // over its CPU per event, what the ratio would be with the workers elsewhere.
            "batched_row_server_cpu_to_event_server_cpu": headline.server_cpu_ratio(&reference),
            // With `--floor`: events/s over the bare writes of a step with its projection,
            // measured in the same run (1.0 would be a step costing only its writes).
            "events_per_s_to_floor": floor.as_ref().map(|f| f.share_of(headline.events_per_s)),
            // With `--floor`: a reference row's machine CPU over an event's if a step wrote
            // only its event (the `fenced_run` shape's server CPU and Rein's workers' own):
            // the most that layout would allow on this machine, before renewals, the
            // scheduler and the commit's checks.
            "event_only_layout_cpu_ratio": floor
                .as_ref()
                .and_then(|f| f.event_only_cpu_ratio(headline, &reference)),
        },
        "reference": reference,
        "repeats": repeats,
        "floor": floor,
        "peak_rss_mb": { "bench_process": own_rss, "workers": headline.peak_rss_mb },
        "points": results,
        "half_peak": half_peak,
        "backlog": backlog,
        "params": params,
    });
    if plan.json {
        println!("{summary}");
    } else {
        print_tables(&results, half_peak.as_ref(), &reference, &own_rss);
        print_costs(headline, &reference);
        if args.repeat > 1 {
            print_repeats(&repeats);
        }
        if let Some(f) = &floor {
            print_floor(f, headline, &reference);
        }
        if let Some(b) = &backlog {
            print_backlog(b);
        }
    }
    exit::OK
}

/// The headline point again on a database that holds a backlog, next to the empty one.
#[derive(Debug, Clone, Serialize)]
struct Backlog {
    filled: crate::backlog::Filled,
    empty: Point,
    full: Point,
    history_empty: crate::backlog::HistoryReads,
    history_full: crate::backlog::HistoryReads,
    scheduler: Option<crate::backlog::Ticks>,
    /// History leaving the hot log by partition and run by run, after the full point.
    retention: Option<crate::backlog::RetentionBothWays>,
    /// Full ÷ empty: steps/s (target ≥ 0.8) and claim p99 (target ≤ 1.5).
    steps_per_s_ratio: f64,
    claim_p99_ratio: f64,
    history_p50_ratio: f64,
}

async fn measure_backlog(
    args: &BenchArgs,
    plan: &Plan,
    store: &Store,
    results: &[Point],
    peak: &Point,
) -> Result<Backlog, u8> {
    let first_queue = format!("bench-{}-0", std::process::id());
    let history_empty = crate::backlog::history_reads(store, &first_queue)
        .await
        .map_err(|e| report(&e))?;
    if !plan.json {
        eprintln!(
            "filling the database: {} finished runs and {} parked runs…",
            args.backlog_runs, args.parked_runs
        );
    }
    let filled = crate::backlog::fill(
        store,
        &first_queue,
        args.backlog_runs,
        args.parked_runs,
        plan.json,
    )
    .await
    .map_err(|e| report(&e))?;
    if !plan.json {
        eprintln!(
            "filled in {:.0} s, of which {}: {}",
            filled.fill_seconds,
            filled.settling(),
            filled
                .tables
                .iter()
                .map(|t| format!("{} {} rows, {:.0} MB", t.table, t.rows, t.mb))
                .collect::<Vec<_>>()
                .join("; ")
        );
    }
    let scheduler = if args.parked_runs > 0 {
        Some(
            crate::backlog::scheduler_ticks(&plan.url, args.parked_runs)
                .await
                .map_err(|e| report(&e))?,
        )
    } else {
        None
    };
    let history_full = crate::backlog::history_reads(
        store,
        &format!(
            "bench-{}-{}",
            std::process::id(),
            if args.backlog_runs > 0 {
                "backlog"
            } else {
                "0"
            }
        ),
    )
    .await
    .map_err(|e| report(&e))?;
    let empty = results
        .iter()
        .find(|p| p.workers == peak.workers && p.offered_runs_per_s == peak.offered_runs_per_s)
        .unwrap_or(peak)
        .clone();
    let full = run_point(
        plan,
        store,
        results.len() + 1,
        empty.workers,
        empty.offered_runs_per_s,
        None,
    )
    .await?;
    if !plan.json {
        eprintln!("{} (with the backlog)", point_line(&full));
    }
    let retention = if args.backlog_runs > 0 {
        Some(
            crate::backlog::retention_both_ways(store, plan.json)
                .await
                .map_err(|e| report(&e))?,
        )
    } else {
        None
    };
    Ok(Backlog {
        retention,
        steps_per_s_ratio: ratio(full.steps_per_s, empty.steps_per_s),
        claim_p99_ratio: ratio(full.claim_ms_p99, empty.claim_ms_p99),
        history_p50_ratio: ratio(history_full.us_p50, history_empty.us_p50),
        filled,
        empty,
        full,
        history_empty,
        history_full,
        scheduler,
    })
}

fn print_backlog(b: &Backlog) {
    println!();
    println!(
        "with a backlog of {} finished and {} parked runs (filled in {:.0} s, of which {}):",
        b.filled.backlog_runs,
        b.filled.parked_runs,
        b.filled.fill_seconds,
        b.filled.settling()
    );
    if let Some(why) = &b.filled.checkpoint_unavailable {
        println!("  {why}");
    }
    for t in &b.filled.tables {
        println!("  {:<20} {:>12} rows {:>9.0} MB", t.table, t.rows, t.mb);
    }
    println!(
        "  steps/s {:.0} → {:.0} ({:.2}× the empty database; target ≥ 0.8×)",
        b.empty.steps_per_s, b.full.steps_per_s, b.steps_per_s_ratio
    );
    println!(
        "  claim p99 {:.1} → {:.1} ms ({:.2}×; target ≤ 1.5×)",
        b.empty.claim_ms_p99, b.full.claim_ms_p99, b.claim_p99_ratio
    );
    println!(
        "  one run's history: p50 {:.0} → {:.0} µs, p99 {:.0} → {:.0} µs ({:.1} → {:.1} events a read)",
        b.history_empty.us_p50,
        b.history_full.us_p50,
        b.history_empty.us_p99,
        b.history_full.us_p99,
        b.history_empty.events_per_read,
        b.history_full.events_per_read
    );
    if let Some(s) = &b.scheduler {
        println!(
            "  scheduler: {} of {} parked runs due at once, moved {} in {} ticks of ≤ {} runs; tick p50 {:.1} ms, max {:.1} ms against a {} ms period ({})",
            s.due_at_once,
            s.parked_runs,
            s.runs_moved,
            s.ticks,
            s.batch,
            s.tick_ms_p50,
            s.tick_ms_max,
            s.period_ms,
            if s.within_period {
                "within"
            } else {
                "OVER the period"
            }
        );
    }
    if let Some(r) = &b.retention {
        print_retention(r);
    }
}

fn print_retention(r: &crate::backlog::RetentionBothWays) {
    match &r.month {
        Some(m) => println!(
            "  history leaves by partition: {} ({} runs, {} events, {:.0} MB) in {:.3} s, {} B of WAL: {:.2} µs and {:.2} B of WAL a run",
            m.name,
            m.runs,
            r.month_events,
            m.bytes as f64 / (1024.0 * 1024.0),
            m.seconds,
            m.wal_bytes,
            r.month_us_per_run,
            r.month_wal_bytes_per_run
        ),
        None => println!("  history leaves by partition: no month could move"),
    }
    println!(
        "  history leaves run by run: {} runs ({} events) in {:.1} s, {:.1} MB of WAL: {:.0} µs and {:.0} B of WAL a run ({:.0}× the time and {:.0}× the WAL of the partition's, a run)",
        r.rows.runs,
        r.rows.events,
        r.rows.seconds,
        r.rows.wal_bytes as f64 / (1024.0 * 1024.0),
        r.rows.us_per_run,
        r.rows.wal_bytes_per_run,
        r.time_ratio,
        r.wal_ratio
    );
}

/// What a report was measured with.
fn params(
    plan: &Plan,
    rate: Option<f64>,
    points: &[u32],
    redis: Value,
    settings: &BTreeMap<&str, String>,
) -> Value {
    json!({
        "runs": plan.args_runs,
        "workers": if plan.processes { Value::Null } else { json!(points) },
        "processes": if plan.processes { json!(points) } else { Value::Null },
        "concurrency": plan.concurrency,
        "claim_batch": plan.claim_batch,
        "claim_gather_ms": plan.claim_gather_ms,
        "commit_batching": plan.commit_batching,
        "worker_pool": plan.worker_pool,
        "duration_s": plan.duration.as_secs(),
        "rate": rate,
        "poll_interval_ms": plan.poll_interval_ms,
        "definition": format!("{} v{}", plan.definition.name(), plan.definition.version()),
        "redis": redis,
        "database": settings,
    })
}

/// `--compare-redis`: the same open-loop point with workers polling only, then with Redis
/// wake-ups; latency and claim queries side by side. Polling first, so a warmer database
/// (if anything) favours the half without Redis.
async fn compare_redis(
    args: &BenchArgs,
    plan: &Plan,
    store: &Store,
    settings: &BTreeMap<&str, String>,
) -> u8 {
    let (Some(config), Some(rate)) = (plan.redis.config(), args.rate) else {
        return exit::INPUT;
    };
    let workers = args.processes.unwrap_or(args.workers);
    if !plan.json {
        eprintln!(
            "comparing at {rate:.0} runs/s offered, poll interval {} ms, up to {} s each: polling only, then with Redis wake-ups (prefix {})",
            plan.poll_interval_ms,
            plan.duration.as_secs(),
            config.prefix
        );
    }
    let polling = Plan {
        redis: rein_process::RedisArgs::default(),
        ..plan.clone()
    };
    let mut halves = Vec::new();
    for (i, half) in [&polling, plan].into_iter().enumerate() {
        match run_point(half, store, i, workers, Some(rate), Some(&config)).await {
            Ok(p) => {
                if !plan.json {
                    eprintln!("{}", point_line(&p));
                }
                halves.push(p);
            }
            Err(code) => return code,
        }
    }
    let (without, with) = (&halves[0], &halves[1]);
    let (a, b) = (&without.enqueue_to_start_ms, &with.enqueue_to_start_ms);
    let ratios = json!({
        "enqueue_to_start_p50": ratio(a.p50, b.p50),
        "enqueue_to_start_p90": ratio(a.p90, b.p90),
        "enqueue_to_start_p99": ratio(a.p99, b.p99),
        "claim_queries_per_run": ratio(without.claim_queries_per_run, with.claim_queries_per_run),
    });
    if plan.json {
        let summary = json!({
            "compare_redis": {
                "without": without,
                "with": with,
                "ratio_without_to_with": ratios,
            },
            "params": params(plan, Some(rate), &[workers], json!("compare"), settings),
        });
        println!("{summary}");
    } else {
        print_comparison(without, with, &ratios);
    }
    exit::OK
}

fn print_comparison(without: &Point, with: &Point, ratios: &Value) {
    println!();
    println!(
        "{:<22} {:>13} {:>8} {:>8} {:>8} {:>13} {:>8} {:>13}",
        "enqueue → start",
        "runs finished",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "claim queries",
        "per run",
        "wake-ups/subs"
    );
    for (label, p) in [("polling only", without), ("with Redis wake-ups", with)] {
        let e = &p.enqueue_to_start_ms;
        println!(
            "{label:<22} {:>13} {:>8.1} {:>8.1} {:>8.1} {:>13} {:>8.2} {:>13}",
            format!("{}/{}", p.runs_finished, p.runs),
            e.p50,
            e.p90,
            e.p99,
            p.claim_queries,
            p.claim_queries_per_run,
            format!(
                "{}/{}",
                p.wakeups_published.unwrap_or(0),
                p.wake_subscribers.unwrap_or(0)
            ),
        );
    }
    let r = |key: &str, digits: usize| format!("{:.digits$}×", ratios[key].as_f64().unwrap_or(0.0));
    println!(
        "{:<22} {:>13} {:>8} {:>8} {:>8} {:>13} {:>8}",
        "without ÷ with",
        "",
        r("enqueue_to_start_p50", 1),
        r("enqueue_to_start_p90", 1),
        r("enqueue_to_start_p99", 1),
        "",
        r("claim_queries_per_run", 2),
    );
    println!(
        "wake-ups/subs: wake-ups published on the point's queue channel / connections subscribed to it, as Redis saw them"
    );
}

/// A figure that may be unavailable, for a table cell.
fn optional(x: Option<f64>) -> String {
    x.map_or_else(|| "n/a".to_owned(), |x| format!("{x:.1}"))
}

/// A ratio to two places, or n/a.
fn optional_ratio(x: Option<f64>) -> String {
    x.map_or_else(|| "n/a".to_owned(), |x| format!("{x:.2}"))
}

/// The reference from `connections` connections for `seconds` each, its line printed
/// unless the report is JSON.
async fn reference_at(plan: &Plan, connections: u32, seconds: u64) -> Result<Reference, u8> {
    let r = measure_reference(
        &plan.url,
        connections,
        Duration::from_secs(seconds),
        plan.statements_unavailable.is_none(),
    )
    .await
    .map_err(|e| report(&e))?;
    if !plan.json {
        eprintln!("{}", reference_line(&r));
    }
    Ok(r)
}

fn reference_line(r: &Reference) -> String {
    format!(
        "reference ({} connections, {:.0} s each): {:.0} single-row insert transactions/s, {:.0} rows/s at {} rows per transaction",
        r.connections, r.seconds, r.single_inserts_per_s, r.batched_inserts_per_s, r.batch_size
    )
}

/// The point and the reference measured in turn (`--repeat`): each pair's own ratio, and
/// their spread.
#[derive(Debug, Clone, Serialize)]
struct Repeats {
    pairs: Vec<RepeatPair>,
    /// Which pair the headline figures are (0-based): the one with the median ratio (the
    /// lower of the middle two when there are an even number).
    headline: usize,
    ratio_median: f64,
    ratio_min: f64,
    ratio_max: f64,
}

#[derive(Debug, Clone, Serialize)]
struct RepeatPair {
    events_per_s: f64,
    batched_rows_per_s: f64,
    /// The point's workers' connections, and the reference's: the same unless
    /// `--reference-connections` pinned the reference's.
    connections: u32,
    reference_connections: u32,
    /// Committed events/s ÷ the reference's rows/s at 10 rows per transaction, both of
    /// this pair.
    events_per_s_to_batched_rows_per_s: f64,
    steps_per_s_to_single_inserts_per_s: f64,
    machine_cpu_us_per_event: Option<f64>,
    workers_cpu_us_per_event: Option<f64>,
    reference_machine_cpu_us_per_row: Option<f64>,
    /// The database server's CPU per reference row over its CPU per event
    /// ([`Point::server_cpu_ratio`]).
    server_cpu_ratio: Option<f64>,
    db_us_per_event: Option<f64>,
    claim_us_per_claimed_run: Option<f64>,
}

impl Repeats {
    fn of(pairs: &[(Point, Reference)]) -> Repeats {
        let pairs: Vec<RepeatPair> = pairs
            .iter()
            .map(|(p, r)| RepeatPair {
                events_per_s: p.events_per_s,
                batched_rows_per_s: r.batched_inserts_per_s,
                connections: p.connections,
                reference_connections: r.connections,
                events_per_s_to_batched_rows_per_s: ratio(p.events_per_s, r.batched_inserts_per_s),
                steps_per_s_to_single_inserts_per_s: ratio(p.steps_per_s, r.single_inserts_per_s),
                machine_cpu_us_per_event: p.cost.machine_cpu_us_per_event,
                workers_cpu_us_per_event: p.cost.workers_cpu_us_per_event,
                reference_machine_cpu_us_per_row: r.batched_cost.machine_cpu_us_per_row,
                server_cpu_ratio: p.server_cpu_ratio(r),
                db_us_per_event: p.cost.db_us_per_event,
                claim_us_per_claimed_run: p.cost.claim_us_per_claimed_run,
            })
            .collect();
        let mut order: Vec<usize> = (0..pairs.len()).collect();
        order.sort_by(|&a, &b| {
            pairs[a]
                .events_per_s_to_batched_rows_per_s
                .total_cmp(&pairs[b].events_per_s_to_batched_rows_per_s)
        });
        let ratio_at = |i: usize| pairs[i].events_per_s_to_batched_rows_per_s;
        let headline = order[(order.len() - 1) / 2];
        Repeats {
            ratio_median: ratio_at(headline),
            ratio_min: ratio_at(order[0]),
            ratio_max: ratio_at(order[order.len() - 1]),
            headline,
            pairs,
        }
    }
}

fn print_repeats(r: &Repeats) {
    println!();
    println!(
        "the point and the reference in turn, {} pairs (the figures above are pair {}'s, the median):",
        r.pairs.len(),
        r.headline + 1
    );
    println!(
        "{:>5} {:>9} {:>13} {:>9} {:>14} {:>14} {:>11} {:>11} {:>9} {:>13}",
        "pair",
        "events/s",
        "ref10 rows/s",
        "ev/ref10",
        "machine µs/ev",
        "workers µs/ev",
        "ref µs/row",
        "server cpu",
        "DB µs/ev",
        "claim µs/run"
    );
    for (i, p) in r.pairs.iter().enumerate() {
        println!(
            "{:>5} {:>9.0} {:>13.0} {:>9.2} {:>14} {:>14} {:>11} {:>11} {:>9} {:>13}",
            i + 1,
            p.events_per_s,
            p.batched_rows_per_s,
            p.events_per_s_to_batched_rows_per_s,
            optional(p.machine_cpu_us_per_event),
            optional(p.workers_cpu_us_per_event),
            optional(p.reference_machine_cpu_us_per_row),
            optional_ratio(p.server_cpu_ratio),
            optional(p.db_us_per_event),
            optional(p.claim_us_per_claimed_run),
        );
    }
    println!(
        "events/s ÷ rows/s at 10 rows per transaction: median {:.2}, range {:.2}–{:.2}",
        r.ratio_median, r.ratio_min, r.ratio_max
    );
}

/// The headline point's database cost next to the reference's, and the statements that
/// cost the most.
fn print_costs(p: &Point, r: &Reference) {
    let c = &p.cost;
    println!();
    println!(
        "database cost per committed event ({} workers): {} µs of statement time, {:.0} B of WAL; the commit statement {} µs and {} B ({} events a statement)",
        p.workers,
        optional(c.db_us_per_event),
        c.wal_bytes_per_event,
        optional(c.commit_us_per_event),
        c.commit_wal_bytes_per_event
            .map_or_else(|| "n/a".to_owned(), |x| format!("{x:.0}")),
        c.events_per_commit
            .map_or_else(|| "n/a".to_owned(), |x| format!("{x:.1}")),
    );
    if let Some(cpu) = c.machine_cpu_us_per_event {
        println!(
            "the machine's CPU per committed event (database and workers together): {cpu:.1} µs, {} times a reference row's at {} rows per transaction{}",
            r.batched_cost
                .machine_cpu_us_per_row
                .map_or_else(|| "n/a".to_owned(), |row| format!("{:.2}", ratio(cpu, row))),
            r.batch_size,
            c.workers_cpu_us_per_event
                .map_or_else(String::new, |w| format!("; the workers' share {w:.1} µs")),
        );
    }
    if let (Some(event), Some(row)) = (
        c.server_cpu_us_per_event,
        r.batched_cost.server_cpu_us_per_row,
    ) {
        println!(
            "the database server's CPU per committed event (the machine's less the workers'): {event:.1} µs against {row:.1} µs per reference row (the machine's less its client's): an event costs the server {:.2} rows, ratio {:.2} (what the ratio would be with the workers on machines of their own)",
            ratio(event, row),
            ratio(row, event),
        );
    }
    if let Some(line) = limit_line(c) {
        println!("{line}");
    }
    println!(
        "per claimed run: the claim statement {} µs and {} B of WAL ({} runs claimed, {} a statement)",
        optional(c.claim_us_per_claimed_run),
        c.claim_wal_bytes_per_claimed_run
            .map_or_else(|| "n/a".to_owned(), |x| format!("{x:.0}")),
        c.runs_claimed
            .map_or_else(|| "n/a".to_owned(), |n| n.to_string()),
        c.runs_per_claim
            .map_or_else(|| "n/a".to_owned(), |x| format!("{x:.1}")),
    );
    for (label, rc) in [
        (format!("{} rows", r.batch_size), &r.batched_cost),
        ("1 row".to_owned(), &r.single_cost),
    ] {
        println!(
            "reference row at {label} per transaction: {} µs of statement time, {:.0} B of WAL, {} µs of the machine's CPU",
            optional(rc.db_us_per_row),
            rc.wal_bytes_per_row,
            optional(rc.machine_cpu_us_per_row),
        );
    }
    match &c.statements_unavailable {
        Some(why) => println!("statement times unavailable: {why}"),
        None => {
            println!(
                "{:>10} {:>9} {:>9} {:>10} {:>9} {:>9}  statement",
                "kind", "calls", "rows", "total ms", "µs/ev", "WAL B/ev"
            );
            for s in &c.top_statements {
                println!(
                    "{:>10} {:>9} {:>9} {:>10.0} {:>9.1} {:>9.0}  {}",
                    serde_json::to_value(s.kind)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default(),
                    s.calls,
                    s.rows,
                    s.total_ms,
                    s.us_per_event,
                    s.wal_bytes_per_event,
                    s.text
                );
            }
        }
    }
    println!(
        "WAL is the server's (pg_current_wal_lsn); statement time is execution time (pg_stat_statements), the commit's fsync not included"
    );
}

fn print_floor(f: &Floor, p: &Point, r: &Reference) {
    println!();
    println!(
        "the floor under a step ({} connections, {} runs a statement, a {} B projection), next to Rein and the reference:",
        f.connections, f.runs_per_statement, f.projection_bytes
    );
    println!(
        "{:>22} {:>10} {:>9} {:>15} {:>14} {:>11} {:>9} {:>9}",
        "",
        "events/s",
        "ev/ref10",
        "machine µs/ev",
        "client µs/ev",
        "server cpu",
        "DB µs/ev",
        "WAL B/ev"
    );
    let line = |name: &str,
                per_s: f64,
                (machine, client, server): (Option<f64>, Option<f64>, Option<f64>),
                db: Option<f64>,
                wal: f64| {
        println!(
            "{name:>22} {per_s:>10.0} {:>9.2} {:>15} {:>14} {:>11} {:>9} {wal:>9.0}",
            ratio(per_s, r.batched_inserts_per_s),
            optional(machine),
            optional(client),
            optional_ratio(server),
            optional(db),
        );
    };
    for s in &f.shapes {
        let c = &s.cost;
        line(
            json!(s.shape).as_str().unwrap_or_default(),
            s.events_per_s,
            (
                c.machine_cpu_us_per_row,
                c.client_cpu_us_per_row,
                s.batched_row_server_cpu_to_event_server_cpu,
            ),
            c.db_us_per_row,
            c.wal_bytes_per_row,
        );
    }
    line(
        &format!("rein, {} workers", p.workers),
        p.events_per_s,
        (
            p.cost.machine_cpu_us_per_event,
            p.cost.workers_cpu_us_per_event,
            p.server_cpu_ratio(r),
        ),
        p.cost.db_us_per_event,
        p.cost.wal_bytes_per_event,
    );
    let c = &r.batched_cost;
    line(
        &format!("reference, {} rows/tx", r.batch_size),
        r.batched_inserts_per_s,
        (
            c.machine_cpu_us_per_row,
            c.client_cpu_us_per_row,
            cpu_ratio(c.server_cpu_us_per_row, c.server_cpu_us_per_row),
        ),
        c.db_us_per_row,
        c.wal_bytes_per_row,
    );
    println!(
        "client: this process's CPU (for Rein, its in-process workers); machine less client is the database server's; server cpu: a reference row's server CPU ÷ the line's per event"
    );
    println!(
        "rein runs at {:.2} of the floor with the projection: the rest of a step's cost is the claim, the commit's checks, the workers and the scheduler",
        f.share_of(p.events_per_s)
    );
    if let Some(s) = f.point(FloorShape::FencedEvent) {
        println!(
            "fenced_event is the floor if a step wrote only its event under its token (the projection folded from the log): {:.2}x the reference",
            s.events_per_s_to_batched_rows_per_s
        );
    }
    if let Some(s) = f.point(FloorShape::FencedRun) {
        println!(
            "fenced_run is a run's whole life in that layout (its claim, {FLOOR_EVENTS_PER_LIFE} such events, one row update at its end): {:.2}x the reference{}",
            s.events_per_s_to_batched_rows_per_s,
            f.event_only_cpu_ratio(p, r).map_or(String::new(), |x| format!(
                "; with Rein's workers' CPU an event in place of this process's, this machine's CPU allows that layout {x:.2}x at most (before renewals, the scheduler and the commit's checks)"
            ))
        );
    }
}

fn mb(bytes: u64) -> f64 {
    (bytes as f64 / (1024.0 * 1024.0) * 10.0).round() / 10.0
}

/// Inserts into a scratch table from `connections` connections at once: first one row per
/// transaction, then [`REFERENCE_BATCH`] rows per transaction; each after a warm-up.
async fn measure_reference(
    url: &str,
    connections: u32,
    measure: Duration,
    with_statements: bool,
) -> Result<Reference, StoreError> {
    let store = Store::connect_without_migrating(url, connections).await?;
    let table = format!("rein_bench_scratch_{}", std::process::id());
    store.scratch_create(&table).await?;
    let mut loads = Vec::new();
    for rows in [1, REFERENCE_BATCH] {
        let load = Load {
            store: &store,
            connections,
            measure,
            with_statements,
            kind: StatementKind::Reference,
            label: format!("reference, {rows} row(s)/transaction"),
            rows: rows as u64,
        };
        let (for_tasks, table_name) = (store.clone(), table.clone());
        match load
            .run(move |_, _| {
                let (store, table) = (for_tasks.clone(), table_name.clone());
                async move { store.scratch_insert(&table, rows).await }
            })
            .await
        {
            Ok(measured) => loads.push(measured),
            Err(e) => {
                let _ = store.scratch_drop(&table).await;
                return Err(e);
            }
        }
    }
    store.scratch_drop(&table).await?;
    store.pool().close().await;
    let batched = loads.pop().unwrap_or_default();
    let single = loads.pop().unwrap_or_default();
    Ok(Reference {
        connections,
        seconds: single.seconds.min(batched.seconds),
        single_inserts_per_s: single.rows_per_s,
        batched_inserts_per_s: batched.rows_per_s,
        batch_size: REFERENCE_BATCH,
        batched_cost: batched.cost,
        single_cost: single.cost,
    })
}

/// Runs per floor statement: about the events a commit statement carries at the headline
/// point (`events_per_commit`).
const FLOOR_RUNS_PER_STATEMENT: usize = 28;

/// The floor under a step's cost (`--floor`): each [`FloorShape`]'s bare statement, on
/// scratch copies of the run and event tables, from as many connections as the reference,
/// each connection stepping its own runs.
#[derive(Debug, Clone, Serialize)]
struct Floor {
    connections: u32,
    runs_per_statement: usize,
    /// Bytes of the projection each step of the last shape writes per run.
    projection_bytes: usize,
    shapes: Vec<FloorPoint>,
}

impl Floor {
    /// `events_per_s` over the events/s of the bare writes of a step with its projection
    /// (what Rein's commit writes today); 0 when that shape was not measured.
    fn share_of(&self, events_per_s: f64) -> f64 {
        self.point(FloorShape::Projection)
            .map_or(0.0, |s| ratio(events_per_s, s.events_per_s))
    }

    /// A reference row's machine CPU over an event's in the layout where a step writes only
    /// its event: the `fenced_run` shape's server CPU, plus the CPU Rein's workers spent an
    /// event at `p`.
    fn event_only_cpu_ratio(&self, p: &Point, r: &Reference) -> Option<f64> {
        let server = self
            .point(FloorShape::FencedRun)?
            .cost
            .server_cpu_us_per_row?;
        cpu_ratio(
            r.batched_cost.machine_cpu_us_per_row,
            Some(server + p.cost.workers_cpu_us_per_event?),
        )
    }

    /// What was measured of `shape`, if it was.
    fn point(&self, shape: FloorShape) -> Option<&FloorPoint> {
        self.shapes.iter().find(|s| s.shape == shape)
    }
}

#[derive(Debug, Clone, Serialize)]
struct FloorPoint {
    shape: FloorShape,
    events_per_s: f64,
    seconds: f64,
    cost: RowCost,
    /// events/s ÷ the reference's rows/s at 10 rows per transaction.
    events_per_s_to_batched_rows_per_s: f64,
    /// The reference row's machine CPU ÷ this shape's per event.
    batched_row_cpu_to_event_cpu: Option<f64>,
    /// The same with each side's client left out: the database server's CPU per reference
    /// row ÷ its CPU per event of this shape.
    batched_row_server_cpu_to_event_server_cpu: Option<f64>,
}

async fn measure_floor(
    url: &str,
    connections: u32,
    measure: Duration,
    with_statements: bool,
    reference: &Reference,
) -> Result<Floor, StoreError> {
    let store = Store::connect_without_migrating(url, connections).await?;
    let prefix = format!("rein_bench_floor_{}", std::process::id());
    let runs = FLOOR_RUNS_PER_STATEMENT * connections as usize;
    let mut shapes = Vec::new();
    let mut projection_bytes = 0;
    for shape in FloorShape::ALL.into_iter().chain([FloorShape::FencedRun]) {
        // Fresh tables and runs for each shape, so none measures on another's history.
        let (ids, projection) = store.floor_create(&prefix, runs).await?;
        // A step's shape writes an event a run a call; a run's life, each of its events.
        let life = shape == FloorShape::FencedRun;
        let events_per_call = if life {
            FLOOR_EVENTS_PER_LIFE as u64
        } else {
            1
        };
        projection_bytes = rein_core::hash::canonical_len(&projection);
        let statement = Arc::new(shape.statement(&prefix)?);
        let load = Load {
            store: &store,
            connections,
            measure,
            with_statements,
            kind: StatementKind::Floor,
            label: format!("floor, {}", json!(shape).as_str().unwrap_or_default()),
            rows: FLOOR_RUNS_PER_STATEMENT as u64 * events_per_call,
        };
        let for_tasks = store.clone();
        let (ids, projection) = (Arc::new(ids), Arc::new(projection));
        let measured = load
            .run(move |task, i| {
                let (store, statement) = (for_tasks.clone(), statement.clone());
                let (ids, projection) = (ids.clone(), projection.clone());
                async move {
                    let from = task as usize * FLOOR_RUNS_PER_STATEMENT;
                    let mine = &ids[from..from + FLOOR_RUNS_PER_STATEMENT];
                    if life {
                        store.floor_life(&statement, mine, i + 1, &projection).await
                    } else {
                        store.floor_step(&statement, mine, i + 1, &projection).await
                    }
                }
            })
            .await;
        let measured = match measured {
            Ok(m) => m,
            Err(e) => {
                let _ = store.floor_drop(&prefix).await;
                return Err(e);
            }
        };
        shapes.push(FloorPoint {
            shape,
            events_per_s: measured.rows_per_s,
            seconds: measured.seconds,
            events_per_s_to_batched_rows_per_s: ratio(
                measured.rows_per_s,
                reference.batched_inserts_per_s,
            ),
            batched_row_cpu_to_event_cpu: cpu_ratio(
                reference.batched_cost.machine_cpu_us_per_row,
                measured.cost.machine_cpu_us_per_row,
            ),
            batched_row_server_cpu_to_event_server_cpu: cpu_ratio(
                reference.batched_cost.server_cpu_us_per_row,
                measured.cost.server_cpu_us_per_row,
            ),
            cost: measured.cost,
        });
    }
    store.floor_drop(&prefix).await?;
    store.pool().close().await;
    Ok(Floor {
        connections,
        runs_per_statement: FLOOR_RUNS_PER_STATEMENT,
        projection_bytes,
        shapes,
    })
}

/// A timed load: one operation in a loop on each of `connections` tasks, each writing
/// `rows` rows in one transaction, measured for `measure` after a warm-up.
struct Load<'a> {
    store: &'a Store,
    connections: u32,
    measure: Duration,
    with_statements: bool,
    /// The statements whose time and WAL are the load's (`pg_stat_statements`).
    kind: StatementKind,
    label: String,
    rows: u64,
}

/// What a [`Load`] measured.
#[derive(Default)]
struct Measured {
    rows_per_s: f64,
    seconds: f64,
    cost: RowCost,
}

impl Load<'_> {
    /// `op(task, i)` is task `task`'s `i`-th operation (from 0). Err is the first
    /// operation's error, if any failed.
    async fn run<F, Fut>(self, op: F) -> Result<Measured, StoreError>
    where
        F: Fn(u32, i64) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), StoreError>> + Send + 'static,
    {
        let (store, connections, rows) = (self.store, self.connections, self.rows);
        let stop = CancellationToken::new();
        let done = Arc::new(AtomicU64::new(0));
        let op = Arc::new(op);
        let mut tasks = tokio::task::JoinSet::new();
        for task in 0..connections {
            let (stop, done, op) = (stop.clone(), done.clone(), op.clone());
            tasks.spawn(async move {
                let mut i = 0;
                while !stop.is_cancelled() {
                    op(task, i).await?;
                    i += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok::<(), StoreError>(())
            });
        }
        let total = (WARM_UP + self.measure).as_secs();
        let progress = crate::progress_bar(
            total,
            &format!("{} {{bar:30}} {{pos}}/{{len}} s  {{msg}}", self.label),
        );
        let started = Instant::now();
        let mut measured_from = None;
        let mut cost_from = None;
        let mut cpu_from = (None, None);
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let elapsed = started.elapsed();
            progress.set_position(elapsed.as_secs().min(total));
            if measured_from.is_none() && elapsed >= WARM_UP {
                cost_from = store.db_cost(self.with_statements).await.ok();
                cpu_from = (machine_busy_us(), process_cpu_us());
                measured_from = Some((Instant::now(), done.load(Ordering::Relaxed)));
            }
            if let Some((at, from)) = measured_from {
                let secs = at.elapsed().as_secs_f64();
                if secs > 0.0 {
                    let n = done.load(Ordering::Relaxed) - from;
                    progress.set_message(format!("{:.0} rows/s", (n * rows) as f64 / secs));
                }
                if at.elapsed() >= self.measure {
                    break;
                }
            }
            if tasks.len() < connections as usize {
                break; // a task failed; its error is collected below
            }
        }
        let (at, from) = measured_from.unwrap_or((started, 0));
        let n = done.load(Ordering::Relaxed) - from;
        let secs = at.elapsed().as_secs_f64();
        let cost_to = store.db_cost(self.with_statements).await;
        let cpu_to = (machine_busy_us(), process_cpu_us());
        stop.cancel();
        let mut failed = None;
        while let Some(joined) = tasks.join_next().await {
            if let Ok(Err(e)) = joined {
                failed.get_or_insert(e);
            }
        }
        progress.finish_and_clear();
        if let Some(e) = failed {
            return Err(e);
        }
        let cost = match (cost_from, cost_to) {
            (Some(from), Ok(to)) => row_cost(
                &from,
                &to,
                self.kind,
                (
                    cpu_between(cpu_from.0, cpu_to.0),
                    cpu_between(cpu_from.1, cpu_to.1),
                ),
                n * rows,
            ),
            _ => RowCost::default(),
        };
        Ok(Measured {
            rows_per_s: (n * rows) as f64 / secs,
            seconds: secs,
            cost,
        })
    }
}

/// A load's cost per row, from the counters before and after it: `cpu_us` is the
/// machine's and this process's CPU over it.
fn row_cost(
    before: &DbCost,
    after: &DbCost,
    kind: StatementKind,
    (cpu_us, client_cpu_us): (Option<f64>, Option<f64>),
    rows: u64,
) -> RowCost {
    let (wal, statements) = after.since(before);
    let rows = rows as f64;
    RowCost {
        wal_bytes_per_row: ratio(wal as f64, rows),
        db_us_per_row: statements.map(|s| {
            let ms = s
                .iter()
                .filter(|s| s.kind == kind)
                .map(|s| s.total_ms)
                .fold(0.0, |a, b| a + b);
            ratio(ms * 1000.0, rows)
        }),
        machine_cpu_us_per_row: cpu_us.map(|us| ratio(us, rows)),
        client_cpu_us_per_row: client_cpu_us.map(|us| ratio(us, rows)),
        server_cpu_us_per_row: server_cpu(cpu_us, client_cpu_us).map(|us| ratio(us, rows)),
    }
}

/// What the workers said about themselves when they stopped.
#[derive(Default)]
struct WorkerFigures {
    connections: u32,
    claim_samples_us: Vec<u32>,
    claim_queries: u64,
    commit_statements: u64,
    peak_rss_mb: Vec<f64>,
}

/// The fleet of one point: in-process workers or child processes, and one scheduler.
enum Fleet {
    InProcess {
        stop: CancellationToken,
        tasks: tokio::task::JoinSet<()>,
        workers: Vec<(Worker, Store)>,
    },
    Processes(Children),
}

async fn start_fleet(plan: &Plan, queue: &str, workers: u32) -> Result<Fleet, StoreError> {
    if plan.processes {
        let mut children = Children::new(&plan.log_dir).map_err(|e| {
            StoreError::Invalid(format!("cannot create {}: {e}", plan.log_dir.display()))
        })?;
        for i in 0..workers {
            let name = format!("{queue}-w{i}");
            let mut flags = vec![
                ("--queue", queue.to_owned()),
                ("--poll-interval-ms", plan.poll_interval_ms.to_string()),
                ("--lease-ttl-ms", "30000".to_owned()),
                ("--concurrency", plan.concurrency.to_string()),
                ("--claim-batch", plan.claim_batch.to_string()),
                ("--claim-gather-ms", plan.claim_gather_ms.to_string()),
                ("--db-pool-max", plan.worker_pool.to_string()),
            ];
            if !plan.commit_batching {
                flags.push(("--no-commit-batching", String::new()));
            }
            if let Some(url) = &plan.redis.redis_url {
                flags.push(("--redis-url", url.clone()));
                flags.push(("--redis-prefix", plan.redis.redis_prefix.clone()));
            }
            let a = crate::procs::role_args("worker", &plan.url, &name, &flags);
            // Exactly the Redis the plan names: none inherited from the environment.
            crate::procs::rein_command(
                &a,
                &[("REIN_LOG", "warn,rein_worker=info")],
                &["REDIS_URL", "REIN_REDIS_PREFIX"],
            )
            .and_then(|cmd| children.spawn_command(&name, cmd))
            .map_err(|e| StoreError::Invalid(format!("cannot start a worker process: {e}")))?;
        }
        Ok(Fleet::Processes(children))
    } else {
        let stop = CancellationToken::new();
        let mut tasks = tokio::task::JoinSet::new();
        let mut list = Vec::new();
        for i in 0..workers {
            let store = Store::connect_without_migrating(&plan.url, plan.worker_pool).await?;
            let mut config = WorkerConfig::new(format!("{queue}-w{i}"));
            config.concurrency = plan.concurrency as usize;
            config.claim_batch = plan.claim_batch;
            config.claim_gather_ms = plan.claim_gather_ms;
            config.commit_batching = plan.commit_batching;
            config.queues = vec![queue.to_owned()];
            config.poll_interval_ms = plan.poll_interval_ms;
            config.lease_ttl_ms = 30_000;
            let store = plan.redis.publishing(store, &stop);
            let worker = Worker::new(
                store.clone(),
                config,
                rein_worker::builtin_registry(store.clone()),
            );
            plan.redis.subscribe(&worker, &[queue.to_owned()], &stop);
            let (w, s) = (worker.clone(), stop.clone());
            tasks.spawn(async move {
                let _ = w.run(s).await;
            });
            list.push((worker, store));
        }
        Ok(Fleet::InProcess {
            stop,
            tasks,
            workers: list,
        })
    }
}

impl Fleet {
    /// Runs the in-process workers committed into a terminal state (None for processes).
    fn finished(&self) -> Option<u64> {
        match self {
            Fleet::InProcess { workers, .. } => Some(
                workers
                    .iter()
                    .map(|(w, _)| w.stats().runs_finished.load(Ordering::Relaxed))
                    .sum(),
            ),
            Fleet::Processes(_) => None,
        }
    }
}

/// Stops the fleet, closes its connections (which makes PostgreSQL flush their statistics)
/// and collects what the workers measured.
async fn stop_fleet(fleet: Fleet, store: &Store) -> WorkerFigures {
    let mut figures = WorkerFigures::default();
    match fleet {
        Fleet::InProcess {
            stop,
            mut tasks,
            workers,
        } => {
            stop.cancel();
            while tasks.join_next().await.is_some() {}
            for (worker, store) in workers {
                let stats = worker.stats();
                figures.claim_samples_us.extend(stats.claim_samples_us());
                figures.claim_queries += stats.claim_queries.load(Ordering::Relaxed);
                figures.commit_statements += stats.commit_statements.load(Ordering::Relaxed);
                figures.connections += store.pool().size();
                store.pool().close().await;
            }
            if let Some(b) = crate::procs::own_peak_rss_bytes() {
                figures.peak_rss_mb.push(mb(b));
            }
        }
        Fleet::Processes(mut children) => {
            let pids: Vec<u32> = children.procs.iter().map(|p| p.child.id()).collect();
            figures.connections = store
                .connections_of(&pids)
                .await
                .map_or(0, |n| u32::try_from(n).unwrap_or(0));
            for p in &children.procs {
                if let Some(b) = p.peak_rss_bytes() {
                    figures.peak_rss_mb.push(mb(b));
                }
            }
            let names: Vec<String> = children.procs.iter().map(|p| p.name.clone()).collect();
            let log_dir = children.log_dir.clone();
            let _ = tokio::task::spawn_blocking(move || {
                children.shutdown(Duration::from_secs(15));
            })
            .await;
            for name in names {
                let Some(stats) = stopped_stats(&log_dir.join(format!("{name}.err"))) else {
                    continue;
                };
                figures.claim_queries += stats["claim_queries"].as_u64().unwrap_or(0);
                figures.commit_statements += stats["commit_statements"].as_u64().unwrap_or(0);
                // A process reports percentiles, not samples: weigh each process alike by
                // turning its p50/p99 into samples at those values.
                for (key, n) in [("claim_ms_p50", 50), ("claim_ms_p99", 1)] {
                    let us = (stats[key].as_f64().unwrap_or(0.0) * 1000.0) as u32;
                    figures.claim_samples_us.extend(std::iter::repeat_n(us, n));
                }
            }
        }
    }
    figures
}

/// The statistics a `rein worker` logs as it stops (its last `worker stopped` line).
fn stopped_stats(log: &std::path::Path) -> Option<Value> {
    let text = std::fs::read_to_string(log).ok()?;
    text.lines().rev().find_map(|line| {
        let v: Value = serde_json::from_str(line).ok()?;
        if v["fields"]["message"] != "worker stopped" {
            return None;
        }
        serde_json::from_str(v["fields"]["stats"].as_str()?).ok()
    })
}

fn percentile_ms(sorted_us: &[u32], p: f64) -> f64 {
    if sorted_us.is_empty() {
        return 0.0;
    }
    let i = ((sorted_us.len() - 1) as f64 * p).round() as usize;
    f64::from(sorted_us[i]) / 1000.0
}

/// `n` runs of `definition` with `input` on `queue`.
fn requests(definition: &Definition, input: &Value, queue: &str, n: usize) -> Vec<EnqueueRequest> {
    (0..n)
        .map(|_| {
            let mut r = EnqueueRequest::new(definition.clone(), input.clone());
            r.queue = queue.to_owned();
            r
        })
        .collect()
}

/// One measured point: `workers` workers on a fresh queue, every run enqueued first (closed
/// loop) or at `rate` runs/s while they work (open loop).
async fn run_point(
    plan: &Plan,
    store: &Store,
    index: usize,
    workers: u32,
    rate: Option<f64>,
    observe: Option<&rein_accel::RedisConfig>,
) -> Result<Point, u8> {
    let queue = format!("bench-{}-{index}", std::process::id());
    // Every run of the point has an id from here on: the progress polls and the figures
    // read this range of run ids, whatever history the database holds.
    let since = rein_store::first_run_id_at(std::time::SystemTime::now() - Duration::from_secs(1));
    let runs_total = match rate {
        Some(r) => ((r * plan.duration.as_secs_f64()).ceil() as u64).max(1),
        None => u64::from(plan.args_runs),
    };
    // Short-lived pools: their statistics reach pg_stat_database when they close, before
    // the transaction count is read.
    let side = Store::connect_without_migrating(&plan.url, 2)
        .await
        .map_err(|e| report(&e))?;
    if rate.is_none() {
        let progress = crate::progress_bar(runs_total, "enqueueing {bar:30} {pos}/{len} runs");
        let mut done = 0u64;
        while done < runs_total {
            let k = (runs_total - done).min(ENQUEUE_CHUNK as u64);
            side.enqueue_batch(&requests(&plan.definition, &plan.input, &queue, k as usize))
                .await
                .map_err(|e| report(&e))?;
            done += k;
            progress.set_position(done);
        }
        progress.finish_and_clear();
    }
    side.pool().close().await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let txn_before = store.transactions_so_far().await.map_err(|e| report(&e))?;
    let with_statements = plan.statements_unavailable.is_none();
    let cost_before = store
        .db_cost(with_statements)
        .await
        .map_err(|e| report(&e))?;
    let cpu_before = machine_busy_us();
    let own_cpu_before = process_cpu_us();

    let observer = Store::connect_without_migrating(&plan.url, 2)
        .await
        .map_err(|e| report(&e))?;
    let own_queries = Arc::new(AtomicU64::new(0));
    let scheduler_stop = CancellationToken::new();
    let scheduler_store = Store::connect_without_migrating(&plan.url, 2)
        .await
        .map_err(|e| report(&e))?;
    let scheduler = {
        let mut config = SchedulerConfig::new(format!("{queue}-scheduler"));
        config.tick_ms = 50;
        let stop = scheduler_stop.clone();
        let mut s = Scheduler::new(
            plan.redis.publishing(scheduler_store.clone(), &stop),
            config,
        );
        tokio::spawn(async move {
            let _ = s.run(stop).await;
        })
    };
    // Listening before anything is enqueued, so every wake-up of the queue is counted.
    let tap = match observe {
        Some(config) => Some(
            rein_accel::Tap::start(config, &config.queue_channel(&queue))
                .await
                .map_err(|e| redis_error(&e))?,
        ),
        None => None,
    };
    let fleet = match start_fleet(plan, &queue, workers).await {
        Ok(f) => f,
        Err(e) => return Err(report(&e)),
    };
    let started = Instant::now();
    let busy_from = machine_busy_us();
    let feeder = rate.map(|r| {
        let (plan_def, input, q, url) = (
            plan.definition.clone(),
            plan.input.clone(),
            queue.clone(),
            plan.url.clone(),
        );
        let own = own_queries.clone();
        let duration = plan.duration;
        let (redis, feeder_stop) = (plan.redis.clone(), scheduler_stop.clone());
        tokio::spawn(async move {
            let store = Store::connect_without_migrating(&url, 1).await?;
            let store = redis.publishing(store, &feeder_stop);
            let tick = Duration::from_millis(100);
            let mut owed = 0.0;
            let mut sent = 0u64;
            let began = Instant::now();
            let mut next = tokio::time::Instant::now();
            while began.elapsed() < duration && sent < runs_total {
                owed += r * tick.as_secs_f64();
                let k = (owed.floor() as u64).min(runs_total - sent);
                if k > 0 {
                    owed -= k as f64;
                    store
                        .enqueue_batch(&requests(&plan_def, &input, &q, k as usize))
                        .await?;
                    own.fetch_add(1, Ordering::Relaxed);
                    sent += k;
                }
                next += tick;
                tokio::time::sleep_until(next).await;
            }
            store.pool().close().await;
            Ok::<u64, StoreError>(sent)
        })
    });

    let label = match rate {
        Some(r) => format!("{workers}w @ {r:.0} runs/s"),
        None => format!("{workers} worker(s)"),
    };
    let progress = crate::progress_bar(
        runs_total,
        &format!("{label:>18} {{bar:30}} {{pos}}/{{len}} runs  {{elapsed}}  {{msg}}"),
    );
    // Open-loop points wait for the runs they enqueued to finish (bounded), so latency
    // covers every run.
    let limit = match rate {
        Some(_) => plan.duration + Duration::from_secs(30),
        None => plan.duration,
    };
    // In-process workers count the runs they finish, so the database is asked only when
    // that count reaches the total, or stands still (the rest may be runs the scheduler
    // finishes): a poll is a read of the point's runs, so none is made while the workers'
    // count shows progress. Child processes are polled.
    let db_every = if plan.processes {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(3)
    };
    let mut last = (Instant::now(), 0u64);
    let mut asked = Instant::now();
    let mut counted = (Instant::now(), None::<u64>);
    let (mut all, mut terminal) = (0i64, 0i64);
    loop {
        tokio::time::sleep(POLL).await;
        let local = fleet.finished();
        if local != counted.1 {
            counted = (Instant::now(), local);
        }
        let feeding = feeder.as_ref().is_some_and(|f| !f.is_finished());
        let maybe_done = !feeding && local.is_some_and(|n| n >= runs_total);
        let still = local.is_none() || counted.0.elapsed() >= db_every;
        if maybe_done || (still && asked.elapsed() >= db_every) {
            (all, terminal) = observer
                .queue_progress(&queue, since)
                .await
                .map_err(|e| report(&e))?;
            own_queries.fetch_add(1, Ordering::Relaxed);
            asked = Instant::now();
        }
        let done = local.unwrap_or(0).max(terminal as u64);
        progress.set_position(done);
        let secs = last.0.elapsed().as_secs_f64();
        if secs >= 1.0 {
            progress.set_message(format!(
                "{:.0} runs/s",
                done.saturating_sub(last.1) as f64 / secs
            ));
            last = (Instant::now(), done);
        }
        if (!feeding && all > 0 && terminal == all) || started.elapsed() >= limit {
            break;
        }
    }
    progress.finish_and_clear();
    let busy = (
        cpu_between(busy_from, machine_busy_us()),
        started.elapsed().as_secs_f64(),
    );
    let wake_subscribers = match observe {
        Some(config) => Some(
            rein_accel::subscribers(config, &config.queue_channel(&queue))
                .await
                .map_err(|e| redis_error(&e))?
                // Not counting the benchmark's own listener.
                .saturating_sub(1),
        ),
        None => None,
    };
    if let Some(f) = feeder {
        match f.await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Err(report(&e)),
            Err(e) => {
                eprintln!("error: the enqueue task failed: {e}");
                return Err(exit::INPUT);
            }
        }
    }
    let figures = stop_fleet(fleet, &observer).await;
    let wakeups_published = tap.map(|t| t.count());
    own_queries.fetch_add(u64::from(plan.processes), Ordering::Relaxed);
    scheduler_stop.cancel();
    let _ = scheduler.await;
    scheduler_store.pool().close().await;
    observer.pool().close().await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let txn_after = store.transactions_so_far().await.map_err(|e| report(&e))?;
    let cost_after = store
        .db_cost(with_statements)
        .await
        .map_err(|e| report(&e))?;
    let cpu_after = machine_busy_us();
    let own_cpu_after = process_cpu_us();
    // The count read itself and the benchmark's polls are not Rein's work.
    let db_transactions =
        (txn_after - txn_before - own_queries.load(Ordering::Relaxed) as i64 - 1).max(0);

    let stats: QueueStats = store
        .queue_stats(&queue, since)
        .await
        .map_err(|e| report(&e))?;
    let mut cost = PointCost::new(
        &cost_before,
        &cost_after,
        (
            cpu_between(cpu_before, cpu_after),
            // `rein worker` processes' CPU is not this process's.
            (!plan.processes)
                .then(|| cpu_between(own_cpu_before, own_cpu_after))
                .flatten(),
        ),
        stats.events,
        plan.statements_unavailable.as_deref(),
    );
    cost.machine_cpus = machine_cpus();
    cost.machine_busy_share = busy_share(busy.0, busy.1, cost.machine_cpus);
    let mut claims = figures.claim_samples_us;
    claims.sort_unstable();
    let secs = stats.span_s.max(1e-9);
    Ok(Point {
        redis: plan.redis.config().is_some(),
        workers,
        processes: plan.processes,
        offered_runs_per_s: rate,
        runs: stats.runs,
        runs_finished: stats.runs_terminal,
        events: stats.events,
        steps: stats.steps,
        seconds: stats.span_s,
        runs_per_s: stats.runs_terminal as f64 / secs,
        steps_per_s: stats.steps as f64 / secs,
        events_per_s: stats.events as f64 / secs,
        db_transactions,
        db_transactions_per_step: ratio(db_transactions as f64, stats.steps as f64),
        enqueue_to_start_ms: stats.enqueue_to_start_ms,
        step_ms: stats.step_ms,
        claim_ms_p50: percentile_ms(&claims, 0.50),
        claim_ms_p99: percentile_ms(&claims, 0.99),
        claim_queries: figures.claim_queries,
        claim_queries_per_run: ratio(figures.claim_queries as f64, stats.runs_terminal as f64),
        wakeups_published,
        wake_subscribers,
        commit_statements: figures.commit_statements,
        connections: figures.connections.max(1),
        peak_rss_mb: figures.peak_rss_mb,
        cost,
    })
}

/// What bounds a point's throughput, from how busy the machine was while its runs ran.
fn limit_line(c: &PointCost) -> Option<String> {
    let (share, cpus) = (c.machine_busy_share?, c.machine_cpus?);
    let percent = (share * 100.0).round();
    let busy = format!("while the runs ran, the machine's {cpus} CPU(s) were {percent:.0}% busy");
    Some(if percent >= CPU_BOUND_PERCENT {
        format!(
            "{busy}: this point is bound by CPU (the database's and the workers' own work), so \
             fewer µs per event is what raises it, not more workers or connections"
        )
    } else {
        format!(
            "{busy}: this point is bound by waits (fsync, row locks, round trips, idle slots), \
             not by CPU; more runs at once or more workers may raise it"
        )
    })
}

fn redis_error(e: &dyn std::fmt::Display) -> u8 {
    eprintln!("error: Redis (--redis-url): {e}");
    exit::DATABASE
}

fn point_line(p: &Point) -> String {
    format!(
        "  {} {}{}{}: {}/{} runs in {:.1} s — {:.0} runs/s, {:.0} steps/s, {:.0} events/s, {} connections, step p99 {:.1} ms",
        p.workers,
        if p.processes {
            "process(es)"
        } else {
            "worker(s)"
        },
        p.offered_runs_per_s
            .map(|r| format!(" at {r:.0} runs/s offered"))
            .unwrap_or_default(),
        if p.redis { " with Redis wake-ups" } else { "" },
        p.runs_finished,
        p.runs,
        p.seconds,
        p.runs_per_s,
        p.steps_per_s,
        p.events_per_s,
        p.connections,
        p.step_ms.p99
    )
}

fn print_tables(points: &[Point], half: Option<&Point>, r: &Reference, own_rss: &[f64]) {
    println!();
    println!(
        "reference: {:.0} single-row insert transactions/s; {:.0} rows/s at {} rows per transaction ({} connections, {:.0} s each)",
        r.single_inserts_per_s, r.batched_inserts_per_s, r.batch_size, r.connections, r.seconds
    );
    println!();
    println!(
        "{:>7} {:>5} {:>9} {:>8} {:>9} {:>9} {:>9} {:>8} {:>9} {:>9} {:>12} {:>19} {:>23} {:>15} {:>10}",
        "workers",
        "conns",
        "runs/s",
        "steps/s",
        "events/s",
        "ev/ref10",
        "st/ref1",
        "txn/step",
        "DB µs/ev",
        "WAL B/ev",
        "claim µs/run",
        "start p50/p90/p99",
        "step p50/p90/p99 ms",
        "claim p50/p99",
        "rss MB"
    );
    let rows = points
        .iter()
        .map(|p| (p, ""))
        .chain(half.map(|p| (p, " ½")));
    for (p, mark) in rows {
        let rss = p.peak_rss_mb.iter().copied().fold(0.0f64, f64::max);
        println!(
            "{:>5}{:<2} {:>5} {:>9.0} {:>8.0} {:>9.0} {:>9.2} {:>9.2} {:>8.2} {:>9} {:>9.0} {:>12} {:>19} {:>23} {:>15} {:>10.1}",
            p.workers,
            mark,
            p.connections,
            p.runs_per_s,
            p.steps_per_s,
            p.events_per_s,
            ratio(p.events_per_s, r.batched_inserts_per_s),
            ratio(p.steps_per_s, r.single_inserts_per_s),
            p.db_transactions_per_step,
            optional(p.cost.db_us_per_event),
            p.cost.wal_bytes_per_event,
            optional(p.cost.claim_us_per_claimed_run),
            format!(
                "{:.0}/{:.0}/{:.0}",
                p.enqueue_to_start_ms.p50, p.enqueue_to_start_ms.p90, p.enqueue_to_start_ms.p99
            ),
            format!(
                "{:.1}/{:.1}/{:.1}",
                p.step_ms.p50, p.step_ms.p90, p.step_ms.p99
            ),
            format!("{:.1}/{:.1}", p.claim_ms_p50, p.claim_ms_p99),
            rss
        );
    }
    if let Some(h) = half {
        println!(
            "½ = open loop at {:.0} runs/s, half the peak: latency at a load the fleet can carry",
            h.offered_runs_per_s.unwrap_or(0.0)
        );
    }
    println!(
        "ev/ref10: committed events/s ÷ rows/s at 10 rows per transaction; st/ref1: steps/s ÷ single-row transactions/s"
    );
    println!(
        "start: enqueue → first claim (ms; at saturation this is time spent waiting in the backlog)"
    );
    if !own_rss.is_empty() {
        println!("benchmark process peak RSS: {:.1} MB", own_rss[0]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_busy_share_is_busy_time_over_every_cpus_time() {
        // 3 s of CPU over 2 s on 2 CPUs: three quarters busy.
        assert_eq!(busy_share(Some(3e6), 2.0, Some(2)), Some(0.75));
        assert_eq!(busy_share(None, 2.0, Some(2)), None);
        assert_eq!(busy_share(Some(3e6), 2.0, None), None);
        assert_eq!(busy_share(Some(3e6), 0.0, Some(2)), None);
    }

    #[test]
    fn the_limit_line_names_cpu_from_85_percent_busy_as_printed() {
        let cost = |share| PointCost {
            machine_busy_share: Some(share),
            machine_cpus: Some(2),
            ..Default::default()
        };
        let bound = limit_line(&cost(0.93)).expect("a line");
        assert!(bound.contains("2 CPU(s) were 93% busy"), "{bound}");
        assert!(bound.contains("bound by CPU"), "{bound}");
        // Judged on the percent as printed: what reads 85% is bound by CPU.
        let edge = limit_line(&cost(0.847)).expect("a line");
        assert!(
            edge.contains("85% busy") && edge.contains("bound by CPU"),
            "{edge}"
        );
        let waits = limit_line(&cost(0.6)).expect("a line");
        assert!(waits.contains("60% busy"), "{waits}");
        assert!(waits.contains("bound by waits"), "{waits}");
        assert_eq!(limit_line(&PointCost::default()), None);
    }
}
