//! `rein chaos`: a real fleet of `rein` processes (workers and two schedulers) drives sim runs
//! of the built-in definitions while a seeded schedule kills and freezes workers, kills
//! schedulers, kills chaos's own private Redis for a while (when redis-server is installed)
//! and (on a private server only) crash-restarts PostgreSQL; then the fleet heals,
//! finishes every run, and the whole-database audit must find every invariant intact
//! (SPEC X1–X8, S1–S3, C1–C12). `--check-only` runs just the audit on an existing database,
//! live or not: unfinished runs are reported by what they wait for, and only broken
//! invariants fail it.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};
use rein_core::Definition;
use rein_devdb::{DevDbError, PrivatePostgres};
use rein_store::{AuditReport, EnqueueRequest, Sender, Store, counters};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::procs::Children;
use rein_process::report;
use rein_process::{DbArgs, exit};

const RUNS_MAX: u64 = 100_000;
const WORKERS_MAX: u64 = 16;
const DURATION_S_MAX: u64 = 3_600;
const LEASE_TTL_MS_MIN: u64 = 300;
const LEASE_TTL_MS_MAX: u64 = 60_000;
const SCHEDULER_TICK_MS_MIN: u64 = 10;
const SCHEDULER_TICK_MS_MAX: u64 = 10_000;
const TIMEOUT_S_MAX: u64 = 86_400;
const SCHEDULERS: usize = 2;
const WORKER_CONCURRENCY: u32 = 16;
/// Connections the whole fleet may open on a shared server (default max_connections is 100).
const FLEET_CONNECTIONS_MAX: u64 = 80;
/// How often the harness looks at the fleet and the database.
const TICK: Duration = Duration::from_millis(50);
/// New runs arrive in waves spread over the fault window, so faults always hit work in flight.
const WAVES_PER_S: u64 = 4;
/// How long a harness query may take before the tick moves on (the server may be down).
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);
/// Approval expiry of the copies of the built-ins that `expire` runs use: short enough that
/// the scheduler fires the expiry (and research-agent's reminder) within a short chaos run.
const APPROVAL_EXPIRES_AFTER_MS: u64 = 2_500;
const APPROVAL_REMIND_BEFORE_MS: u64 = 1_200;
/// Version offset of those copies, registered only in chaos's own database.
const EXPIRING_VERSION_OFFSET: u32 = 100;
/// Processes that may exit on their own (and be replaced) before chaos gives up on the fleet.
const EXITS_MAX: usize = 20;
/// How long past the window faults go on while some kind has not had its turn.
const FIRST_ROUND_GRACE: Duration = Duration::from_secs(60);
/// Beyond the fault window, its grace and the healing timeout: how long the harness itself
/// may take (starting processes, restarting the server) before it is stopped as stuck.
const HARNESS_MARGIN: Duration = Duration::from_secs(300);
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
const CHILD_LOG_FILTER: &str = "info,sqlx=warn";
/// How long the private Redis stays down after a `redis_stop` fault.
const REDIS_DOWN_FOR: Duration = Duration::from_secs(3);
/// After Redis returns, how long every worker may take to subscribe again beyond its own
/// reconnection backoff (2 s at most) and a stop of 2 × lease TTL + scheduler tick.
const RESUBSCRIBE_SLACK: Duration = Duration::from_secs(10);
/// How long the previous release's workers may take to start (`--old-bin`).
const OLD_START_MAX: Duration = Duration::from_secs(30);

#[derive(clap::Args)]
pub struct ChaosArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Runs to enqueue (1..=100000).
    #[arg(long, default_value_t = 500)]
    runs: u64,
    /// Worker processes (1..=16); two schedulers run beside them.
    #[arg(long, default_value_t = 3)]
    workers: u64,
    /// How long faults are injected, in seconds (1..=3600).
    #[arg(long, default_value_t = 30)]
    duration_s: u64,
    /// Seed of the fault schedule (default: from the clock, printed so the run can be repeated).
    #[arg(long)]
    seed: Option<u64>,
    /// Workers' lease TTL in ms (300..=60000).
    #[arg(long, default_value_t = 1_500)]
    lease_ttl_ms: u64,
    /// Schedulers' tick in ms (10..=10000).
    #[arg(long, default_value_t = 100)]
    scheduler_tick_ms: u64,
    /// After the faults, how long the healed fleet may take to finish every run (seconds).
    #[arg(long, default_value_t = 300)]
    timeout_s: u64,
    /// Also crash-restart PostgreSQL. Always on a private server started for the purpose
    /// (DATABASE_URL is ignored: a shared server is never restarted).
    #[arg(long)]
    allow_db_restart: bool,
    /// No fleet and no faults: audit the database given by DATABASE_URL or --database-url,
    /// live or not, and print the same report. Runs not finished yet are listed (queued,
    /// running, parked, needing an operator); only broken invariants exit 3.
    #[arg(long)]
    check_only: bool,
    /// Print the report as one JSON object on stdout.
    #[arg(long)]
    json: bool,
    /// Keep the fleet's logs even when every check holds.
    #[arg(long)]
    keep_logs: bool,
    /// Only these fault kinds, comma-separated (default: every kind this machine can
    /// inject): worker_kill, worker_stop, scheduler_kill, db_restart, redis_stop,
    /// session_kill, lock_stall, leader_stop, clock_skew, net_partition, net_latency,
    /// net_reset, backend_stop, statement_timeout, late_result, event_twice.
    #[arg(long, value_delimiter = ',', value_parser = fault_parser())]
    faults: Vec<String>,
    /// A rolling upgrade under the faults: `rein` of the previous release. It migrates the
    /// database to its own schema and starts `--old-workers` of the workers; then this
    /// release's migrations are applied beside them and the rest of the fleet starts from
    /// this binary. A killed old worker comes back as a new one; when the faults end the
    /// old ones left are drained (SIGTERM) and replaced, and `rein migrate --contract` must
    /// have been refused while they lived and go through once they are gone.
    #[arg(long, value_name = "PATH")]
    old_bin: Option<std::path::PathBuf>,
    /// How many of the workers start from --old-bin (default: half of --workers, at least 1).
    #[arg(long, requires = "old_bin", value_name = "N")]
    old_workers: Option<u64>,
}

fn fault_parser() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(Fault::ALL.map(Fault::name))
}

fn validate(args: &ChaosArgs) -> Result<(), String> {
    let within = |name: &str, value: u64, lo: u64, hi: u64| {
        if (lo..=hi).contains(&value) {
            Ok(())
        } else {
            Err(format!("--{name} must be {lo}..={hi}, not {value}"))
        }
    };
    if args.check_only && args.allow_db_restart {
        return Err("--check-only audits an existing database; it cannot be combined with --allow-db-restart".into());
    }
    within("runs", args.runs, 1, RUNS_MAX)?;
    within("workers", args.workers, 1, WORKERS_MAX)?;
    within("duration-s", args.duration_s, 1, DURATION_S_MAX)?;
    within(
        "lease-ttl-ms",
        args.lease_ttl_ms,
        LEASE_TTL_MS_MIN,
        LEASE_TTL_MS_MAX,
    )?;
    within(
        "scheduler-tick-ms",
        args.scheduler_tick_ms,
        SCHEDULER_TICK_MS_MIN,
        SCHEDULER_TICK_MS_MAX,
    )?;
    within("timeout-s", args.timeout_s, 1, TIMEOUT_S_MAX)?;
    // Faults the arguments alone rule out are refused before a server or fleet starts.
    for fault in args.faults.iter().filter_map(|name| Fault::parse(name)) {
        if let Some(why) = fault.ruled_out_by(args) {
            return Err(format!("--faults {} {why}", fault.name()));
        }
    }
    if let Some(bin) = &args.old_bin {
        if args.check_only {
            return Err(
                "--check-only audits an existing database; it starts no fleet for --old-bin".into(),
            );
        }
        if !bin.is_file() {
            return Err(format!(
                "--old-bin {}: no such file (build the previous release's `rein` and give its path)",
                bin.display()
            ));
        }
        within("old-workers", old_workers(args), 1, args.workers)?;
    }
    Ok(())
}

/// How many workers start from `--old-bin`.
fn old_workers(args: &ChaosArgs) -> u64 {
    args.old_workers.unwrap_or((args.workers / 2).max(1))
}

pub async fn chaos(args: ChaosArgs) -> u8 {
    // Chaos notes each Redis outage itself; its own publisher's warnings would repeat them.
    rein_process::init_logging_at(false, "warn,sqlx=error,rein_accel=error");
    if let Err(problem) = validate(&args) {
        eprintln!("error: {problem}");
        return exit::INPUT;
    }
    if args.check_only {
        return check_only(&args).await;
    }
    let seed = args.seed.unwrap_or_else(seed_from_clock);
    eprintln!("chaos: seed {seed} (repeat this schedule with --seed {seed})");
    let mut db = match Database::open(&args).await {
        Ok(db) => db,
        Err(code) => return code,
    };
    let log_dir = log_dir();
    let (code, summary) = match Harness::start(&args, seed, &db, &log_dir).await {
        Ok(mut harness) => {
            // A watchdog over the harness itself: should one of its own awaits never end,
            // the run ends as aborted (everything frozen is continued by `finish`) instead
            // of hanging whoever waits for it.
            let limit = Duration::from_secs(args.duration_s + args.timeout_s)
                + FIRST_ROUND_GRACE
                + HARNESS_MARGIN;
            let outcome = match tokio::time::timeout(limit, harness.drive(&mut db)).await {
                Ok(outcome) => outcome,
                Err(_) => Outcome::Aborted(format!(
                    "the harness did not end within {} s (fault window, grace, --timeout-s and a \
                     margin); one of its own steps is stuck: see the fleet's logs",
                    limit.as_secs()
                )),
            };
            harness.finish(outcome, &mut db).await
        }
        Err(code) => (code, None),
    };
    let ok = code == exit::OK;
    if let Some(summary) = &summary {
        if args.json {
            println!("{summary}");
        } else {
            print_table(summary);
        }
    }
    if ok && !args.keep_logs {
        let _ = std::fs::remove_dir_all(&log_dir);
    } else if log_dir.exists() {
        eprintln!("chaos: the fleet's logs are in {}", log_dir.display());
    }
    db.close(ok).await;
    code
}

/// `OLD migrate`: the previous release makes the schema its own before its workers start.
fn old_migrate(bin: &Path, url: &str) -> Result<(), u8> {
    let out = std::process::Command::new(bin)
        .args(["migrate", "--database-url", url])
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| {
            eprintln!("error: cannot run {} migrate: {e}", bin.display());
            exit::INPUT
        })?;
    if !out.status.success() {
        eprintln!(
            "error: {} migrate failed: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return Err(exit::INPUT);
    }
    Ok(())
}

fn seed_from_clock() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    // Fold in the pid so two runs started in the same instant differ; keep it printable.
    ((nanos as u64) ^ (u64::from(std::process::id()) << 32)) % 1_000_000_000
}

/// Where child logs go: beside the private servers' directory (`target/` from a checkout).
fn log_dir() -> PathBuf {
    let base = crate::privdb::base_dir();
    base.parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("rein-chaos-{}", std::process::id()))
}

/// The database the fleet runs against: a private server (restartable) or a fresh database
/// made for this run on the server DATABASE_URL names.
struct Database {
    url: String,
    /// `None` while a restart holds it.
    private: Option<PrivatePostgres>,
    /// The server's maintenance store and the scratch database's name.
    scratch: Option<(Store, String)>,
    describe: String,
}

impl Database {
    async fn open(args: &ChaosArgs) -> Result<Database, u8> {
        let shared = args.db.database_url.clone().filter(|u| !u.is_empty());
        if args.allow_db_restart || shared.is_none() {
            let why = if args.allow_db_restart && shared.is_some() {
                "--allow-db-restart: DATABASE_URL is ignored, a shared server is never restarted"
            } else if args.allow_db_restart {
                "--allow-db-restart"
            } else {
                "DATABASE_URL is unset"
            };
            let pg = crate::privdb::start_because("chaos", false, why).await?;
            return Ok(Database {
                url: pg.url(),
                describe: format!("private PostgreSQL on port {} (fsync on)", pg.port()),
                private: Some(pg),
                scratch: None,
            });
        }
        let server_url = shared.unwrap_or_default();
        let server = Store::connect_within(&server_url, 2, args.db.db_connect_timeout_ms)
            .await
            .map_err(|e| report(&e))?;
        let millis = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() % 1_000_000_000)
            .unwrap_or_default();
        let name = format!("rein_chaos_{}_{millis}", std::process::id());
        if let Err(e) = server.create_database(&name).await {
            let code = report(&e);
            eprintln!(
                "hint: chaos makes a fresh database on the DATABASE_URL server for each run, so its user needs CREATEDB; or unset DATABASE_URL to use a private server"
            );
            return Err(code);
        }
        eprintln!("chaos: fresh database {name} on the DATABASE_URL server");
        Ok(Database {
            url: rein_devdb::replace_database(&server_url, &name),
            describe: format!("fresh database {name} on the DATABASE_URL server"),
            private: None,
            scratch: Some((server, name)),
        })
    }

    /// Stops or drops what `open` made: removed when the run succeeded, kept otherwise.
    async fn close(self, ok: bool) {
        if let Some(pg) = self.private {
            crate::privdb::finish(pg, ok).await;
        }
        if let Some((server, name)) = self.scratch {
            if ok {
                if let Err(e) = server.drop_database(&name).await {
                    eprintln!("warning: could not drop the chaos database {name}: {e}");
                }
            } else {
                eprintln!("chaos: the database {name} is kept for a look at what went wrong");
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Fault {
    WorkerKill,
    WorkerStop,
    SchedulerKill,
    DbRestart,
    RedisStop,
    /// The fleet's database sessions terminated (`pg_terminate_backend`), mid-statement.
    SessionKill,
    /// Row locks on runs held by an outside transaction past the lease TTL.
    LockStall,
    /// The leading scheduler paused (SIGSTOP) past its leader lease, then resumed: for a
    /// while two schedulers believe they lead.
    LeaderStop,
    /// A worker started with its wall clock a minute ahead or behind (libfaketime).
    ClockSkew,
    /// A worker's network to PostgreSQL cut (bytes held, not refused) past its lease TTL,
    /// then healed.
    NetPartition,
    /// 50–800 ms added to every chunk between a worker and PostgreSQL for a while.
    NetLatency,
    /// Every connection between a worker and PostgreSQL reset (RST) mid-statement.
    NetReset,
    /// The PostgreSQL backends serving one worker frozen (SIGSTOP on the private server)
    /// past the lease TTL, then continued.
    BackendStop,
    /// Statements cut off by a statement timeout: the database's `statement_timeout` set
    /// low and the fleet's sessions made to reconnect under it, for 2 × lease TTL.
    StatementTimeout,
    /// A call's result delivered again after the run moved on (an HTTP reply that arrives
    /// twice, a result for a superseded call), through the engine's own send path.
    LateResult,
    /// An outside event (CANCEL) sent twice at once with one idempotency key, by two `rein
    /// send` processes.
    EventTwice,
}

impl Fault {
    const ALL: [Fault; 16] = [
        Fault::WorkerKill,
        Fault::WorkerStop,
        Fault::SchedulerKill,
        Fault::DbRestart,
        Fault::RedisStop,
        Fault::SessionKill,
        Fault::LockStall,
        Fault::LeaderStop,
        Fault::ClockSkew,
        Fault::NetPartition,
        Fault::NetLatency,
        Fault::NetReset,
        Fault::BackendStop,
        Fault::StatementTimeout,
        Fault::LateResult,
        Fault::EventTwice,
    ];

    fn name(self) -> &'static str {
        match self {
            Fault::WorkerKill => "worker_kill",
            Fault::WorkerStop => "worker_stop",
            Fault::SchedulerKill => "scheduler_kill",
            Fault::DbRestart => "db_restart",
            Fault::RedisStop => "redis_stop",
            Fault::SessionKill => "session_kill",
            Fault::LockStall => "lock_stall",
            Fault::LeaderStop => "leader_stop",
            Fault::ClockSkew => "clock_skew",
            Fault::NetPartition => "net_partition",
            Fault::NetLatency => "net_latency",
            Fault::NetReset => "net_reset",
            Fault::BackendStop => "backend_stop",
            Fault::StatementTimeout => "statement_timeout",
            Fault::LateResult => "late_result",
            Fault::EventTwice => "event_twice",
        }
    }

    fn parse(name: &str) -> Option<Fault> {
        Fault::ALL.into_iter().find(|f| f.name() == name)
    }

    /// What this fault needs that the arguments alone deny it, if anything. What depends
    /// on the machine (libfaketime, Redis, a database over TCP) is judged once it is up.
    fn ruled_out_by(self, args: &ChaosArgs) -> Option<String> {
        match self {
            Fault::DbRestart if !args.allow_db_restart => Some(
                "needs --allow-db-restart (which restarts a private server started for the purpose)"
                    .to_owned(),
            ),
            Fault::WorkerStop if args.workers < 2 => Some(format!(
                "needs --workers 2 or more (with {} the fleet would have none running)",
                args.workers
            )),
            _ => None,
        }
    }

    /// Relative frequency after every kind has had its turn.
    fn weight(self) -> u32 {
        match self {
            Fault::WorkerKill => 3,
            Fault::WorkerStop | Fault::SchedulerKill => 2,
            Fault::DbRestart
            | Fault::RedisStop
            | Fault::SessionKill
            | Fault::LockStall
            | Fault::LeaderStop
            | Fault::ClockSkew
            | Fault::NetPartition
            | Fault::NetLatency
            | Fault::NetReset
            | Fault::BackendStop
            | Fault::StatementTimeout
            | Fault::LateResult
            | Fault::EventTwice => 1,
        }
    }
}

/// What a clock-skewed worker's wall clock is off by.
const CLOCK_SKEW_S: i64 = 60;
/// The statement timeout a `statement_timeout` fault sets: a commit under load takes longer.
const STATEMENT_TIMEOUT_MS: u64 = 20;
/// How many runs' rows a lock stall holds.
const LOCK_STALL_ROWS: i64 = 20;

/// Where a worker's proxy forwards to, and the database URL that goes through a proxy on
/// a given port; `None` when `url` does not name a TCP host (a Unix socket).
#[allow(clippy::type_complexity)]
fn proxy_target(url: &str) -> Option<(std::net::SocketAddr, Box<dyn Fn(u16) -> String>)> {
    use std::net::ToSocketAddrs;
    let parsed = reqwest::Url::parse(url).ok()?;
    if parsed.query_pairs().any(|(k, _)| k == "host") {
        return None;
    }
    let host = parsed.host_str()?.to_owned();
    if host.starts_with('/') {
        return None;
    }
    let port = parsed.port().unwrap_or(5432);
    let upstream = (host.trim_matches(|c| c == '[' || c == ']'), port)
        .to_socket_addrs()
        .ok()?
        .next()?;
    let through = move |proxy_port: u16| {
        let mut via = parsed.clone();
        let _ = via.set_host(Some("127.0.0.1"));
        let _ = via.set_port(Some(proxy_port));
        via.to_string()
    };
    Some((upstream, Box::new(through)))
}

/// libfaketime's multi-threaded build, where Debian's `faketime` package puts it.
fn libfaketime() -> Option<std::path::PathBuf> {
    std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .flatten()
        .map(|arch| arch.path().join("faketime/libfaketimeMT.so.1"))
        .chain([std::path::PathBuf::from(
            "/usr/lib/faketime/libfaketimeMT.so.1",
        )])
        .find(|p| p.is_file())
}

/// The seeded fault schedule: first every enabled kind once in a seeded order, close
/// together so a short run sees them all; then weighted random kinds at random gaps.
struct Schedule {
    rng: StdRng,
    enabled: Vec<Fault>,
    first: VecDeque<Fault>,
    /// Gap scale while `first` lasts.
    slot: Duration,
    next: Option<Fault>,
    /// Whether `next` is one of the first round.
    next_is_first: bool,
    next_at: Instant,
}

impl Schedule {
    fn new(seed: u64, enabled: Vec<Fault>, window: Duration, start: Instant) -> Schedule {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut first = enabled.clone();
        first.shuffle(&mut rng);
        let slot = (window / (enabled.len() as u32 + 1)).min(Duration::from_secs(3));
        let lead = slot
            .mul_f64(rng.random_range(0.5..1.0))
            .max(Duration::from_millis(800));
        Schedule {
            rng,
            enabled,
            first: first.into(),
            slot,
            next: None,
            next_is_first: false,
            next_at: start + lead,
        }
    }

    /// The kind due next (kept until it is injected).
    fn peek(&mut self) -> Fault {
        if let Some(f) = self.next {
            return f;
        }
        self.next_is_first = !self.first.is_empty();
        let f = self.first.pop_front().unwrap_or_else(|| {
            let total: u32 = self.enabled.iter().map(|f| f.weight()).sum();
            let mut pick = self.rng.random_range(0..total);
            let mut chosen = self.enabled[0];
            for f in &self.enabled {
                if pick < f.weight() {
                    chosen = *f;
                    break;
                }
                pick -= f.weight();
            }
            chosen
        });
        self.next = Some(f);
        f
    }

    fn injected(&mut self, now: Instant) {
        self.next = None;
        let gap = if self.first.is_empty() {
            Duration::from_millis(self.rng.random_range(1_000..3_000))
        } else {
            self.slot.mul_f64(self.rng.random_range(0.5..1.0))
        };
        self.next_at = now + gap;
    }

    /// Whether every enabled kind has been injected at least once.
    fn all_kinds_done(&self) -> bool {
        self.first.is_empty() && !(self.next.is_some() && self.next_is_first)
    }
}

/// Runs a faulted worker held when the fault hit; recovered once each has a higher fencing
/// token or is terminal.
struct Recovery {
    victim: String,
    at: Instant,
    held: Vec<(Uuid, i64)>,
    /// Index of the fault in the fault log.
    fault: usize,
}

/// A `redis_stop` whose Redis is back: done once every worker is subscribed again.
struct Resubscription {
    fault: usize,
    back_at: Instant,
}

/// Chaos's own Redis, which every worker and scheduler it starts is given.
struct Redis {
    server: crate::privredis::PrivateRedis,
    args: rein_process::RedisArgs,
    /// Stops the harness's own publisher.
    stop: tokio_util::sync::CancellationToken,
    /// Set while a `redis_stop` fault holds it down: when it starts again.
    down_until: Option<Instant>,
    waiting: Option<Resubscription>,
    resubscribed_ms: Vec<u64>,
    not_resubscribed: u64,
}

/// One injected fault, for the report.
struct FaultRecord {
    at: Instant,
    kind: Fault,
    victim: Option<String>,
    /// Live leases the victim held; `None` when not a worker or they could not be read.
    held: Option<usize>,
    /// For a worker holding leases: until every run it held moved on. For a Redis stop:
    /// until every worker subscribed again. For the others: until the fleet finished
    /// another run.
    recovery_ms: Option<u64>,
    /// Runs terminal when the fault was injected.
    terminal_at: i64,
}

struct Progress {
    bar: Option<ProgressBar>,
    started: Instant,
    last: Instant,
}

impl Progress {
    fn new(runs: u64, started: Instant) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(runs);
            if let Ok(style) =
                ProgressStyle::with_template("{elapsed:>4} [{bar:20}] {pos}/{len} terminal, {msg}")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            bar
        });
        Progress {
            bar,
            started,
            last: Instant::now()
                .checked_sub(Duration::from_secs(1))
                .unwrap_or_else(Instant::now),
        }
    }

    fn note(&self, line: &str) {
        let line = format!("[{:>6.1}s] {line}", self.started.elapsed().as_secs_f64());
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    fn update(&mut self, terminal: i64, total: u64, message: String) {
        if let Some(bar) = &self.bar {
            bar.set_position(terminal.max(0) as u64);
            bar.set_message(message);
            return;
        }
        if self.last.elapsed() >= Duration::from_secs(1) {
            self.last = Instant::now();
            self.note(&format!("{terminal}/{total} terminal, {message}"));
        }
    }

    fn done(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// How the drive ended.
enum Outcome {
    Finished,
    TimedOut,
    /// Something outside the system under test failed (a process would not start, the
    /// server would not come back, an interrupt).
    Aborted(String),
}

struct Harness<'a> {
    args: &'a ChaosArgs,
    seed: u64,
    store: Store,
    url: String,
    children: Children,
    workers: Vec<String>,
    schedulers: Vec<String>,
    spawned_workers: u32,
    spawned_schedulers: u32,
    /// Stopped workers and when they are continued.
    stopped: Vec<(String, Instant)>,
    /// Each worker's TCP proxy to PostgreSQL, for the network faults.
    proxies: HashMap<String, crate::netproxy::Proxy>,
    /// Workers whose network is faulty, until when.
    degraded: Vec<(String, Instant)>,
    /// PostgreSQL backends frozen by SIGSTOP, until when they are continued.
    frozen: Vec<(i32, Instant)>,
    /// Until when the database's statement timeout is set low.
    timeouts_until: Option<Instant>,
    schedule: Schedule,
    /// Picks victims; apart from the schedule's so that which process is hit (which depends
    /// on who holds leases at the time) never shifts the seeded kinds and gaps.
    victims: StdRng,
    faults: BTreeMap<Fault, u64>,
    recoveries: Vec<Recovery>,
    recovery_ms: Vec<u64>,
    fault_log: Vec<FaultRecord>,
    exited: Vec<String>,
    restarting: Option<tokio::task::JoinHandle<(PrivatePostgres, Result<(), DevDbError>)>>,
    /// `None` when redis-server is not installed (`redis_stop` skipped).
    redis: Option<Redis>,
    requests: Vec<EnqueueRequest>,
    enqueued: u64,
    decided: HashSet<Uuid>,
    approvals: BTreeMap<&'static str, u64>,
    totals: (i64, i64),
    needs_operator: i64,
    progress: Progress,
    started: Instant,
    window_end: Instant,
    healing_since: Option<Instant>,
    /// Call results delivered again (`late_result`): run, event type, call id.
    late: Vec<(Uuid, String, String)>,
    /// Late results the engine applied: each one a violation.
    late_applied: u64,
    /// Runs sent CANCEL twice with one key (`event_twice`).
    twice: Vec<Uuid>,
    /// Pairs of sends with one key that did not answer alike: each one a violation.
    twice_differed: u64,
    /// Workers running the previous release (`--old-bin`), while they live.
    old: Vec<String>,
    /// Old workers asked to stop when the faults ended: their exit is expected.
    draining: Vec<String>,
    upgrade: Option<Upgrade>,
}

/// What a rolling upgrade (`--old-bin`) showed.
struct Upgrade {
    old_workers: u64,
    /// The old workers' ids.
    ids: Vec<String>,
    /// Events the old workers committed (evidence that they worked beside the new ones).
    events: i64,
    /// Who `rein migrate --contract --dry-run` named in the way while old workers ran.
    blocked_by: Vec<String>,
    /// Contract steps applied once the old workers were gone, or why not.
    contracted: Result<Vec<i64>, String>,
    /// Old workers replaced by new ones: killed by a fault, or drained at the end.
    replaced: u64,
}

impl<'a> Harness<'a> {
    async fn start(
        args: &'a ChaosArgs,
        seed: u64,
        db: &Database,
        log_dir: &Path,
    ) -> Result<Harness<'a>, u8> {
        // In a rolling upgrade the previous release makes the schema its own first; this
        // release migrates only once its workers run.
        let store = match &args.old_bin {
            Some(bin) => {
                old_migrate(bin, &db.url)?;
                Store::connect_without_migrating(&db.url, 4)
                    .await
                    .map_err(|e| report(&e))?
            }
            None => Store::connect(&db.url, 4).await.map_err(|e| report(&e))?,
        };
        let children = Children::new(log_dir).map_err(|e| {
            eprintln!(
                "error: cannot create the log directory {}: {e}",
                log_dir.display()
            );
            exit::INPUT
        })?;
        let redis = start_redis(log_dir)?;
        // The harness's enqueues and approvals wake the workers, as a user's would.
        let store = match &redis {
            Some(r) => r.args.publishing(store, &r.stop),
            None => store,
        };
        let mut enabled = vec![Fault::WorkerKill];
        if Fault::WorkerStop.ruled_out_by(args).is_none() {
            enabled.push(Fault::WorkerStop);
        } else {
            eprintln!(
                "chaos: one worker only, so no worker is stopped (the fleet would have none running)"
            );
        }
        enabled.push(Fault::SchedulerKill);
        if db.private.is_some() && Fault::DbRestart.ruled_out_by(args).is_none() {
            enabled.push(Fault::DbRestart);
        }
        if redis.is_some() {
            enabled.push(Fault::RedisStop);
        }
        enabled.push(Fault::SessionKill);
        enabled.push(Fault::LockStall);
        enabled.push(Fault::LeaderStop);
        enabled.push(Fault::StatementTimeout);
        enabled.extend([Fault::LateResult, Fault::EventTwice]);
        // Only the private server's processes are ever signalled.
        if db.private.is_some() {
            enabled.push(Fault::BackendStop);
        }
        if proxy_target(&db.url).is_some() {
            enabled.extend([Fault::NetPartition, Fault::NetLatency, Fault::NetReset]);
        } else {
            eprintln!(
                "chaos: the database is not reached over TCP, so there are no network faults"
            );
        }
        let faketime = libfaketime();
        match &faketime {
            Some(_) => enabled.push(Fault::ClockSkew),
            None => eprintln!(
                "chaos: libfaketime is not installed (Debian: apt-get install faketime), so no worker runs on a skewed clock"
            ),
        }
        if !args.faults.is_empty() {
            let wanted: Vec<Fault> = args.faults.iter().filter_map(|f| Fault::parse(f)).collect();
            for f in &wanted {
                if !enabled.contains(f) {
                    eprintln!(
                        "error: --faults {}: this run cannot inject it here (clock_skew needs libfaketime, redis_stop redis-server, backend_stop a private server, the net_ faults a database reached over TCP; the notes above say which is missing)",
                        f.name()
                    );
                    return Err(exit::INPUT);
                }
            }
            enabled.retain(|f| wanted.contains(f));
        }
        let started = Instant::now();
        let window = Duration::from_secs(args.duration_s);
        eprintln!(
            "chaos: {} runs, {} workers + {SCHEDULERS} schedulers, faults for {} s ({}), lease TTL {} ms, scheduler tick {} ms; {}{}",
            args.runs,
            args.workers,
            args.duration_s,
            enabled
                .iter()
                .map(|f| f.name())
                .collect::<Vec<_>>()
                .join(", "),
            args.lease_ttl_ms,
            args.scheduler_tick_ms,
            db.describe,
            redis
                .as_ref()
                .map(|r| format!("; private Redis on port {} for wake-ups", r.server.port()))
                .unwrap_or_default()
        );
        let mut harness = Harness {
            args,
            seed,
            store,
            url: db.url.clone(),
            children,
            workers: Vec::new(),
            schedulers: Vec::new(),
            spawned_workers: 0,
            spawned_schedulers: 0,
            stopped: Vec::new(),
            proxies: HashMap::new(),
            degraded: Vec::new(),
            frozen: Vec::new(),
            timeouts_until: None,
            schedule: Schedule::new(seed, enabled.clone(), window, started),
            victims: StdRng::seed_from_u64(seed.rotate_left(32) ^ 0x5eed),
            faults: enabled.iter().map(|f| (*f, 0)).collect(),
            recoveries: Vec::new(),
            recovery_ms: Vec::new(),
            fault_log: Vec::new(),
            exited: Vec::new(),
            restarting: None,
            redis,
            enqueued: 0,
            decided: HashSet::new(),
            approvals: BTreeMap::new(),
            totals: (0, 0),
            needs_operator: 0,
            progress: Progress::new(args.runs, started),
            started,
            window_end: started + window,
            healing_since: None,
            late: Vec::new(),
            late_applied: 0,
            twice: Vec::new(),
            twice_differed: 0,
            old: Vec::new(),
            draining: Vec::new(),
            upgrade: None,
            requests: Vec::new(),
        };
        let mut new_workers = args.workers;
        if let Some(bin) = &args.old_bin {
            harness.start_old_workers(bin).await?;
            new_workers -= harness.old.len() as u64;
        }
        harness.requests = match workload(&harness.store, args.runs).await {
            Ok(r) => r,
            Err(e) => return Err(report(&e)),
        };
        harness.enqueue_due().await;
        for _ in 0..new_workers {
            harness.spawn_worker()?;
        }
        for _ in 0..SCHEDULERS {
            harness.spawn_scheduler()?;
        }
        Ok(harness)
    }

    fn child_pool_max(&self) -> u64 {
        (FLEET_CONNECTIONS_MAX / (self.args.workers + SCHEDULERS as u64)).clamp(3, 8)
    }

    /// The schedulers' leader lease: the worker lease TTL, within what `rein scheduler`
    /// accepts for the tick.
    fn leader_ttl_ms(&self) -> u64 {
        self.args
            .lease_ttl_ms
            .max(3 * self.args.scheduler_tick_ms)
            .clamp(rein_store::LEADER_TTL_MS_MIN, rein_store::LEADER_TTL_MS_MAX)
    }

    fn spawn_worker(&mut self) -> Result<String, u8> {
        self.spawn_worker_with(&[])
    }

    /// [`Harness::spawn_worker`] with extra environment variables.
    fn spawn_worker_with(&mut self, env: &[(&str, String)]) -> Result<String, u8> {
        self.spawn_worker_from(None, env)
    }

    /// Starts a worker from `bin` (this binary when `None`).
    fn spawn_worker_from(
        &mut self,
        bin: Option<&Path>,
        env: &[(&str, String)],
    ) -> Result<String, u8> {
        self.spawned_workers += 1;
        let id = format!("chaos-w{}", self.spawned_workers);
        // Each worker reaches PostgreSQL through a proxy of its own, where the network
        // faults happen.
        let mut url = self.url.clone();
        if let Some((upstream, through)) = proxy_target(&self.url) {
            match crate::netproxy::Proxy::start_in_runtime(upstream) {
                Ok(proxy) => {
                    url = through(proxy.addr.port());
                    self.proxies.insert(id.clone(), proxy);
                }
                Err(e) => eprintln!("warning: no network proxy for {id}: {e}"),
            }
        }
        let args = crate::procs::role_args(
            "worker",
            &url,
            &id,
            &[
                ("--concurrency", WORKER_CONCURRENCY.to_string()),
                ("--lease-ttl-ms", self.args.lease_ttl_ms.to_string()),
                ("--poll-interval-ms", "50".to_owned()),
                ("--shutdown-grace-ms", "2000".to_owned()),
                ("--db-pool-max", self.child_pool_max().to_string()),
            ],
        );
        self.spawn_from(bin, &id, &args, env)?;
        self.workers.push(id.clone());
        Ok(id)
    }

    /// Starts the previous release's workers on the schema it migrated, waits until each
    /// has heartbeated (it passed its schema check), then applies this release's
    /// migrations beside them and notes whom the contract step finds in the way.
    async fn start_old_workers(&mut self, bin: &Path) -> Result<(), u8> {
        let n = old_workers(self.args);
        for _ in 0..n {
            let id = self.spawn_worker_from(Some(bin), &[])?;
            self.old.push(id);
        }
        let deadline = Instant::now() + OLD_START_MAX;
        loop {
            let beating: i64 =
                sqlx::query_scalar("SELECT count(*) FROM rein_workers WHERE worker_id = ANY($1)")
                    .bind(&self.old)
                    .fetch_one(self.store.pool())
                    .await
                    .unwrap_or(0);
            if beating == n as i64 {
                break;
            }
            let gone = self.children.exited();
            if !gone.is_empty() || Instant::now() > deadline {
                eprintln!(
                    "error: the previous release's workers did not start ({} of {n} heartbeating); see {}",
                    beating,
                    self.children.log_dir.display()
                );
                return Err(exit::INPUT);
            }
            tokio::time::sleep(TICK).await;
        }
        if let Err(e) = self.store.migrate().await {
            eprintln!(
                "error: this release's migrations beside the previous release's workers: {e}"
            );
            return Err(report(&e));
        }
        let plan = self.store.contract(false).await.map_err(|e| report(&e))?;
        let blocked_by: Vec<String> = plan.blockers.iter().map(|b| b.worker_id.clone()).collect();
        self.progress.note(&format!(
            "rolling upgrade: {n} worker(s) of the previous release ({}) run on this release's expanded schema; the contract step is held by {}",
            self.old.join(", "),
            if blocked_by.is_empty() { "nothing".to_owned() } else { blocked_by.join(", ") }
        ));
        self.upgrade = Some(Upgrade {
            old_workers: n,
            ids: self.old.clone(),
            events: 0,
            blocked_by,
            contracted: Err("not tried".into()),
            replaced: 0,
        });
        Ok(())
    }

    /// An old worker that left the fleet (killed, or exited): its replacement is new.
    fn replaced_old(&mut self, name: &str) {
        if self.old.iter().any(|o| o == name) {
            self.old.retain(|o| o != name);
            if let Some(u) = self.upgrade.as_mut() {
                u.replaced += 1;
            }
        }
    }

    /// When the faults end, the old workers left stop the way a deploy stops them
    /// (SIGTERM: finish or release what they hold); new ones take their places.
    fn drain_old_workers(&mut self) {
        for name in std::mem::take(&mut self.old) {
            if let Some(p) = self.children.get(&name) {
                let _ = p.signal(libc::SIGCONT);
                let _ = p.signal(libc::SIGTERM);
            }
            self.workers.retain(|w| *w != name);
            self.stopped.retain(|(w, _)| *w != name);
            self.draining.push(name.clone());
            if let Some(u) = self.upgrade.as_mut() {
                u.replaced += 1;
            }
            self.progress.note(&format!(
                "rolling upgrade: {name} (previous release) drained; a new worker takes its place"
            ));
        }
    }

    /// Once the old workers are gone, the contract step must go through (the heartbeats
    /// of the drained ones age out within a lease TTL).
    async fn contract_after_upgrade(&mut self) {
        let Some(mut upgrade) = self.upgrade.take() else {
            return;
        };
        let deadline =
            Instant::now() + Duration::from_millis(3 * self.args.lease_ttl_ms) + OLD_START_MAX;
        upgrade.events =
            sqlx::query_scalar("SELECT count(*) FROM rein_events_all WHERE worker = ANY($1)")
                .bind(&upgrade.ids)
                .fetch_one(self.store.pool())
                .await
                .unwrap_or(0);
        upgrade.contracted = loop {
            match self.store.contract(true).await {
                Ok(plan) if plan.applied || plan.pending.is_empty() => {
                    break Ok(plan.pending.iter().map(|p| p.version).collect());
                }
                Ok(plan) if Instant::now() > deadline => {
                    break Err(format!(
                        "still held by {}",
                        plan.blockers
                            .iter()
                            .map(|b| b.worker_id.clone())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                }
                Ok(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                Err(e) => break Err(e.to_string()),
            }
        };
        self.upgrade = Some(upgrade);
    }

    fn upgrade_summary(&self) -> Value {
        let Some(u) = &self.upgrade else {
            return json!({ "enabled": false });
        };
        json!({
            "enabled": true,
            "old_bin": self.args.old_bin.as_ref().map(|b| b.display().to_string()),
            "old_workers": u.old_workers,
            "old_worker_events": u.events,
            "replaced": u.replaced,
            "contract_blocked_by": u.blocked_by,
            "contract_applied": u.contracted.as_ref().ok(),
            "contract_error": u.contracted.as_ref().err(),
            // The contract step must have waited for the old workers, then gone through,
            // and the old workers must have worked beside the new ones.
            "violations": u64::from(u.blocked_by.is_empty())
                + u64::from(u.contracted.is_err())
                + u64::from(u.events == 0),
        })
    }

    fn spawn_scheduler(&mut self) -> Result<String, u8> {
        self.spawned_schedulers += 1;
        let id = format!("chaos-s{}", self.spawned_schedulers);
        let args = crate::procs::role_args(
            "scheduler",
            &self.url,
            &id,
            &[
                ("--tick-ms", self.args.scheduler_tick_ms.to_string()),
                // A killed leading scheduler is replaced as fast as a killed worker's runs.
                ("--leader-ttl-ms", self.leader_ttl_ms().to_string()),
                ("--db-pool-max", self.child_pool_max().to_string()),
            ],
        );
        self.spawn(&id, &args)?;
        self.schedulers.push(id.clone());
        Ok(id)
    }

    /// Starts `rein ARGS` with chaos's own Redis, if any, and never one inherited from the
    /// environment.
    fn spawn(&mut self, id: &str, args: &[String]) -> Result<(), u8> {
        self.spawn_env(id, args, &[])
    }

    fn spawn_env(&mut self, id: &str, args: &[String], env: &[(&str, String)]) -> Result<(), u8> {
        self.spawn_from(None, id, args, env)
    }

    fn spawn_from(
        &mut self,
        bin: Option<&Path>,
        id: &str,
        args: &[String],
        env: &[(&str, String)],
    ) -> Result<(), u8> {
        let mut args = args.to_vec();
        if let Some(r) = &self.redis {
            args.extend(["--redis-url".to_owned(), r.server.url()]);
        }
        let mut vars = vec![("REIN_LOG", CHILD_LOG_FILTER)];
        vars.extend(env.iter().map(|(k, v)| (*k, v.as_str())));
        let unset = ["REDIS_URL", "REIN_REDIS_PREFIX"];
        match bin {
            Some(bin) => Ok(crate::procs::command_of(bin, &args, &vars, &unset)),
            None => crate::procs::rein_command(&args, &vars, &unset),
        }
        .and_then(|cmd| self.children.spawn_command(id, cmd))
        .map_err(|e| {
            eprintln!("error: cannot start {id}: {e}");
            exit::INPUT
        })
    }

    fn db_up(&self) -> bool {
        self.restarting.is_none()
    }

    /// Drives the workload through the fault window and the healing until every run is
    /// terminal, the timeout passes, or something outside the system under test fails.
    async fn drive(&mut self, db: &mut Database) -> Outcome {
        let interrupted = rein_process::shutdown_signal();
        loop {
            if interrupted.is_cancelled() {
                return Outcome::Aborted("interrupted".into());
            }
            let now = Instant::now();
            if let Err(why) = self.settle_restart(db).await {
                return Outcome::Aborted(why);
            }
            self.continue_stopped(now);
            self.heal_network(now, false);
            self.thaw_backends(now, false);
            self.lift_statement_timeout(now, false).await;
            if let Err(why) = self.start_redis_due(now) {
                return Outcome::Aborted(why);
            }
            self.check_resubscribed().await;
            if let Err(why) = self.replace_exited() {
                return Outcome::Aborted(why);
            }
            if self.db_up() {
                self.enqueue_due().await;
                self.approve().await;
                self.check_recoveries().await;
                self.note_progress_after_faults();
                self.refresh_totals().await;
            }
            let faulting = now < self.window_end
                || (!self.schedule.all_kinds_done() && now < self.window_end + FIRST_ROUND_GRACE);
            if faulting {
                if now >= self.schedule.next_at
                    && let Err(why) = self.inject(db).await
                {
                    return Outcome::Aborted(why);
                }
            } else if self.healing_since.is_none() {
                self.healing_since = Some(now);
                self.drain_old_workers();
                self.heal_network(now, true);
                self.thaw_backends(now, true);
                self.lift_statement_timeout(now, true).await;
                self.progress.note(&format!(
                    "faults over ({} injected: {}); the fleet heals and must finish within {} s",
                    self.faults.values().sum::<u64>(),
                    self.faults
                        .iter()
                        .map(|(f, n)| format!("{} {n}", f.name()))
                        .collect::<Vec<_>>()
                        .join(", "),
                    self.args.timeout_s
                ));
            }
            self.show_progress();
            if self.healing_since.is_some() && self.finished() {
                // With the new fleet still at work, as after a real rolling upgrade.
                self.contract_after_upgrade().await;
                self.progress.done();
                eprintln!(
                    "chaos: all {} runs terminal after {:.1} s",
                    self.args.runs,
                    self.started.elapsed().as_secs_f64()
                );
                return Outcome::Finished;
            }
            if let Some(since) = self.healing_since
                && since.elapsed() > Duration::from_secs(self.args.timeout_s)
            {
                self.progress.done();
                return Outcome::TimedOut;
            }
            tokio::time::sleep(TICK).await;
        }
    }

    fn finished(&self) -> bool {
        let runs = self.args.runs as i64;
        self.enqueued == self.args.runs
            && self.totals == (runs, runs)
            && self.stopped.is_empty()
            && self.db_up()
            && self
                .redis
                .as_ref()
                .is_none_or(|r| r.down_until.is_none() && r.waiting.is_none())
    }

    /// Starts the private Redis again once its `redis_stop` is over.
    fn start_redis_due(&mut self, now: Instant) -> Result<(), String> {
        let Some(r) = self.redis.as_mut() else {
            return Ok(());
        };
        if r.down_until.is_none_or(|at| at > now) {
            return Ok(());
        }
        r.down_until = None;
        tokio::task::block_in_place(|| r.server.start_again())
            .map_err(|e| format!("the private Redis did not come back: {e}"))?;
        r.waiting = self
            .fault_log
            .iter()
            .rposition(|f| f.kind == Fault::RedisStop)
            .map(|fault| Resubscription {
                fault,
                back_at: Instant::now(),
            });
        self.progress.note(&format!(
            "Redis is back on port {}; waiting for every worker to subscribe again",
            r.server.port()
        ));
        Ok(())
    }

    /// Whether every worker listens for wake-ups again since Redis returned, as Redis sees
    /// it: as many subscribers to the channel every worker subscribes to as there are
    /// workers (killed ones' connections are gone; replacements subscribe when they start).
    async fn check_resubscribed(&mut self) {
        let workers = self.workers.len() as u64;
        let bound = self.resubscribe_bound();
        let Some(r) = self.redis.as_mut() else {
            return;
        };
        let Some(waiting) = &r.waiting else {
            return;
        };
        let Some(config) = r.args.config() else {
            return;
        };
        let since = waiting.back_at.elapsed();
        let fault = waiting.fault;
        let subscribed = tokio::time::timeout(
            QUERY_TIMEOUT,
            rein_accel::subscribers(&config, &config.any_channel()),
        )
        .await;
        let line = if matches!(subscribed, Ok(Ok(n)) if n >= workers) {
            let ms = since.as_millis() as u64;
            r.resubscribed_ms.push(ms);
            if let Some(record) = self.fault_log.get_mut(fault) {
                record.recovery_ms = Some(ms);
            }
            format!("all {workers} workers subscribed to Redis again, {ms} ms after it returned")
        } else if since > bound {
            r.not_resubscribed += 1;
            format!(
                "not every worker subscribed to Redis again within {} ms of its return",
                bound.as_millis()
            )
        } else {
            return;
        };
        r.waiting = None;
        self.progress.note(&line);
    }

    fn resubscribe_bound(&self) -> Duration {
        Duration::from_millis(2 * self.args.lease_ttl_ms + self.args.scheduler_tick_ms)
            + RESUBSCRIBE_SLACK
    }

    /// Takes the server back once a restart finished.
    async fn settle_restart(&mut self, db: &mut Database) -> Result<(), String> {
        if !self.restarting.as_ref().is_some_and(|h| h.is_finished()) {
            return Ok(());
        }
        let Some(handle) = self.restarting.take() else {
            return Ok(());
        };
        match handle.await {
            Ok((pg, Ok(()))) => {
                db.private = Some(pg);
                self.progress.note("PostgreSQL is back");
                let soon = Instant::now() + Duration::from_millis(500);
                self.schedule.next_at = self.schedule.next_at.max(soon);
                Ok(())
            }
            Ok((pg, Err(e))) => {
                db.private = Some(pg);
                Err(format!(
                    "PostgreSQL did not come back after the restart: {e}"
                ))
            }
            Err(e) => Err(format!("the PostgreSQL restart task failed: {e}")),
        }
    }

    fn continue_stopped(&mut self, now: Instant) {
        let (due, waiting): (Vec<_>, Vec<_>) =
            self.stopped.drain(..).partition(|(_, at)| *at <= now);
        self.stopped = waiting;
        for (name, _) in due {
            if let Some(p) = self.children.get(&name) {
                let _ = p.signal(libc::SIGCONT);
            }
            self.progress.note(&format!("continued {name} (SIGCONT)"));
        }
    }

    /// A process that exited on its own is reaped, reported and replaced (once the server is
    /// up, since a process that cannot connect at start exits).
    fn replace_exited(&mut self) -> Result<(), String> {
        for name in self.children.exited() {
            let _ = self.children.kill(&name);
            if self.draining.contains(&name) {
                self.draining.retain(|d| *d != name);
                self.progress
                    .note(&format!("{name} (previous release) drained and exited"));
                continue;
            }
            self.workers.retain(|w| *w != name);
            self.replaced_old(&name);
            self.schedulers.retain(|s| *s != name);
            self.progress.note(&format!(
                "{name} exited on its own; see {}",
                self.children.log_dir.join(format!("{name}.err")).display()
            ));
            self.exited.push(name);
        }
        if self.exited.len() > EXITS_MAX {
            return Err(format!(
                "{} processes exited on their own; see the logs",
                self.exited.len()
            ));
        }
        if !self.db_up() {
            return Ok(());
        }
        while self.workers.len() < self.args.workers as usize {
            let id = self.spawn_worker().map_err(|_| "cannot start a worker")?;
            self.progress
                .note(&format!("started {id} to keep the fleet whole"));
        }
        while self.schedulers.len() < SCHEDULERS {
            let id = self
                .spawn_scheduler()
                .map_err(|_| "cannot start a scheduler")?;
            self.progress
                .note(&format!("started {id} to keep the fleet whole"));
        }
        Ok(())
    }

    /// Enqueues the runs due by now: they arrive evenly over the fault window. Client keys
    /// make a retry after an in-doubt enqueue (server restarting) return the same runs.
    async fn enqueue_due(&mut self) {
        let waves = (self.args.duration_s * WAVES_PER_S).max(1);
        let wave_len = Duration::from_secs(self.args.duration_s) / waves as u32;
        let waves_due = (self.started.elapsed().as_nanos() / wave_len.as_nanos().max(1)) as u64 + 1;
        let due = (self.args.runs * waves_due.min(waves)).div_ceil(waves);
        while self.enqueued < due {
            let from = self.enqueued as usize;
            let to = (due as usize).min(from + 1_000);
            let batch = &self.requests[from..to];
            match tokio::time::timeout(QUERY_TIMEOUT, self.store.enqueue_batch(batch)).await {
                Ok(Ok(done)) if done.len() == batch.len() => self.enqueued = to as u64,
                _ => return,
            }
        }
    }

    /// The simulated approver: grants or denies parked approvals as each run's input says,
    /// and leaves `expire` ones to the scheduler's expiry timer.
    async fn approve(&mut self) {
        let Ok(Ok(waiting)) = tokio::time::timeout(
            QUERY_TIMEOUT,
            self.store
                .runs_in_states(&rein_worker::sim::APPROVAL_WAIT_STATES, 200),
        )
        .await
        else {
            return;
        };
        for row in waiting {
            if self.decided.contains(&row.run_id) {
                continue;
            }
            let Some((event, deny)) =
                rein_worker::sim::approver_answer(&row.definition, &row.projection.data)
            else {
                continue;
            };
            let payload = json!({ "approver": "chaos", "reason": if deny { "denied by the chaos approver" } else { "granted" } });
            let sent = tokio::time::timeout(
                QUERY_TIMEOUT,
                self.store.send(
                    row.run_id,
                    event,
                    payload,
                    &Sender::Approver("chaos-approver".into()),
                    60_000,
                ),
            )
            .await;
            if matches!(sent, Ok(Ok(_))) {
                self.decided.insert(row.run_id);
                *self
                    .approvals
                    .entry(if deny { "denied" } else { "granted" })
                    .or_default() += 1;
            }
        }
    }

    async fn check_recoveries(&mut self) {
        let mut open = Vec::new();
        for r in std::mem::take(&mut self.recoveries) {
            match tokio::time::timeout(QUERY_TIMEOUT, self.store.not_taken_over(&r.held)).await {
                Ok(Ok(0)) => {
                    let ms = r.at.elapsed().as_millis() as u64;
                    self.progress.note(&format!(
                        "the {} run(s) {} held are taken over or finished, {ms} ms after the fault",
                        r.held.len(),
                        r.victim
                    ));
                    self.recovery_ms.push(ms);
                    if let Some(record) = self.fault_log.get_mut(r.fault) {
                        record.recovery_ms = Some(ms);
                    }
                }
                _ => open.push(r),
            }
        }
        self.recoveries = open;
    }

    async fn refresh_totals(&mut self) {
        if let Ok(Ok(totals)) = tokio::time::timeout(QUERY_TIMEOUT, self.store.run_totals()).await {
            self.totals = totals;
        }
        if let Ok(Ok(counts)) =
            tokio::time::timeout(QUERY_TIMEOUT, self.store.count_by_state()).await
        {
            self.needs_operator = counts
                .iter()
                .filter(|c| c.2 == "needs_operator")
                .map(|c| c.3)
                .sum();
        }
    }

    /// A fault whose recovery is not measured otherwise has recovered once the fleet
    /// finished another run after it.
    fn note_progress_after_faults(&mut self) {
        let tracked: HashSet<usize> = self.recoveries.iter().map(|r| r.fault).collect();
        let terminal = self.totals.1;
        for (i, record) in self.fault_log.iter_mut().enumerate() {
            let measured_elsewhere = tracked.contains(&i) || record.kind == Fault::RedisStop;
            if record.recovery_ms.is_none() && !measured_elsewhere && terminal > record.terminal_at
            {
                record.recovery_ms = Some(record.at.elapsed().as_millis() as u64);
            }
        }
    }

    fn show_progress(&mut self) {
        let mut message = format!(
            "enqueued {}/{}, faults {}",
            self.enqueued,
            self.args.runs,
            self.faults.values().sum::<u64>()
        );
        if !self.stopped.is_empty() {
            let names: Vec<&str> = self.stopped.iter().map(|s| s.0.as_str()).collect();
            message.push_str(&format!(", stopped {}", names.join(" ")));
        }
        if !self.db_up() {
            message.push_str(", PostgreSQL restarting");
        }
        if self.needs_operator > 0 {
            message.push_str(&format!(", needs operator {}", self.needs_operator));
        }
        if self.healing_since.is_some() {
            message.push_str(", healing");
        }
        self.progress.update(self.totals.1, self.args.runs, message);
    }

    /// Injects the fault due now, if the fleet allows it; otherwise tries again next tick.
    async fn inject(&mut self, db: &mut Database) -> Result<(), String> {
        if !self.db_up() {
            return Ok(());
        }
        let fault = self.schedule.peek();
        let injected = match fault {
            Fault::WorkerKill => self.kill_worker().await?,
            Fault::WorkerStop => self.stop_worker().await,
            Fault::SchedulerKill => self.kill_scheduler()?,
            Fault::DbRestart => self.restart_db(db),
            Fault::RedisStop => self.stop_redis(),
            Fault::SessionKill => self.kill_sessions().await,
            Fault::LockStall => self.stall_locks().await,
            Fault::LeaderStop => self.stop_leader().await,
            Fault::ClockSkew => self.skew_a_worker()?,
            Fault::NetPartition => self.degrade_network(Fault::NetPartition).await,
            Fault::NetLatency => self.degrade_network(Fault::NetLatency).await,
            Fault::NetReset => self.reset_network().await,
            Fault::BackendStop => self.freeze_backends().await,
            Fault::StatementTimeout => self.cut_statements().await,
            Fault::LateResult => self.deliver_late_result().await,
            Fault::EventTwice => self.send_event_twice().await,
        };
        if injected {
            *self.faults.entry(fault).or_default() += 1;
            self.schedule.injected(Instant::now());
        }
        Ok(())
    }

    /// A victim among `candidates`, preferring workers that hold leases right now.
    async fn pick_worker(&mut self, candidates: Vec<String>) -> Option<String> {
        let holding: Vec<String> =
            match tokio::time::timeout(QUERY_TIMEOUT, self.store.live_leases_by_owner()).await {
                Ok(Ok(rows)) => candidates
                    .iter()
                    .filter(|c| rows.iter().any(|(owner, n)| owner == *c && *n > 0))
                    .cloned()
                    .collect(),
                _ => Vec::new(),
            };
        let pool = if holding.is_empty() {
            candidates
        } else {
            holding
        };
        pool.choose(&mut self.victims).cloned()
    }

    fn running_workers(&self) -> Vec<String> {
        self.workers
            .iter()
            .filter(|w| !self.stopped.iter().any(|(s, _)| s == *w))
            .cloned()
            .collect()
    }

    /// The live leases `victim` holds, read right after the fault (a killed or stopped
    /// process writes nothing more).
    async fn held_by(&self, victim: &str) -> Option<Vec<(Uuid, i64)>> {
        for _ in 0..3 {
            if let Ok(Ok(held)) =
                tokio::time::timeout(QUERY_TIMEOUT, self.store.live_leases_of(victim)).await
            {
                return Some(held);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }

    /// Logs a fault on `victim` and, when it held leases, waits for their takeover.
    /// Logs a fault that is not tracked by held leases; its recovery is measured later.
    fn record_fault(&mut self, kind: Fault, victim: Option<String>, at: Instant) {
        self.fault_log.push(FaultRecord {
            at,
            kind,
            victim,
            held: None,
            recovery_ms: None,
            terminal_at: self.totals.1,
        });
    }

    fn track(
        &mut self,
        kind: Fault,
        victim: &str,
        at: Instant,
        held: Option<Vec<(Uuid, i64)>>,
    ) -> String {
        self.fault_log.push(FaultRecord {
            at,
            kind,
            victim: Some(victim.to_owned()),
            held: held.as_ref().map(Vec::len),
            recovery_ms: None,
            terminal_at: self.totals.1,
        });
        match held {
            Some(held) if !held.is_empty() => {
                let n = held.len();
                self.recoveries.push(Recovery {
                    victim: victim.to_owned(),
                    at,
                    held,
                    fault: self.fault_log.len() - 1,
                });
                format!("holding {n} lease(s)")
            }
            Some(_) => "holding no lease".into(),
            None => "(its leases could not be read)".into(),
        }
    }

    /// SIGKILL a running worker; its replacement (a new id) starts first, so a worker is
    /// always alive.
    async fn kill_worker(&mut self) -> Result<bool, String> {
        let Some(victim) = self.pick_worker(self.running_workers()).await else {
            return Ok(false);
        };
        let replacement = self.spawn_worker().map_err(|_| "cannot start a worker")?;
        let _ = self.children.kill(&victim);
        let at = Instant::now();
        self.workers.retain(|w| *w != victim);
        self.replaced_old(&victim);
        let held = self.held_by(&victim).await;
        let what = self.track(Fault::WorkerKill, &victim, at, held);
        self.progress.note(&format!(
            "fault: kill -9 {victim} {what}; {replacement} replaces it"
        ));
        Ok(true)
    }

    /// SIGSTOP a worker past its lease TTL (2 × TTL + a scheduler tick), then SIGCONT: by
    /// then its runs are someone else's and its next write must be fenced. Another worker
    /// keeps running meanwhile.
    async fn stop_worker(&mut self) -> bool {
        let running = self.running_workers();
        if running.len() < 2 {
            return false;
        }
        let Some(victim) = self.pick_worker(running).await else {
            return false;
        };
        let Some(p) = self.children.get(&victim) else {
            return false;
        };
        if p.signal(libc::SIGSTOP).is_err() {
            return false;
        }
        let at = Instant::now();
        let stop_for =
            Duration::from_millis(2 * self.args.lease_ttl_ms + self.args.scheduler_tick_ms);
        self.stopped.push((victim.clone(), at + stop_for));
        let held = self.held_by(&victim).await;
        let what = self.track(Fault::WorkerStop, &victim, at, held);
        self.progress.note(&format!(
            "fault: SIGSTOP {victim} {what}, for {} ms",
            stop_for.as_millis()
        ));
        true
    }

    /// SIGKILL a scheduler; a new one (new id) starts first, so one is always alive.
    fn kill_scheduler(&mut self) -> Result<bool, String> {
        // Not a paused one: a leader stop ends with its scheduler resumed, stale.
        let running: Vec<String> = self
            .schedulers
            .iter()
            .filter(|s| !self.stopped.iter().any(|(p, _)| p == *s))
            .cloned()
            .collect();
        let Some(victim) = running.choose(&mut self.victims).cloned() else {
            return Ok(false);
        };
        let replacement = self
            .spawn_scheduler()
            .map_err(|_| "cannot start a scheduler")?;
        let _ = self.children.kill(&victim);
        self.schedulers.retain(|s| *s != victim);
        self.record_fault(Fault::SchedulerKill, Some(victim.clone()), Instant::now());
        self.progress.note(&format!(
            "fault: kill -9 {victim}; {replacement} replaces it"
        ));
        Ok(true)
    }

    /// Cuts (or slows) one running worker's network to PostgreSQL, preferring one that holds
    /// leases, for 2 × lease TTL + a tick: a cut worker must lose its leases without one
    /// stale write accepted, and work again after the heal.
    async fn degrade_network(&mut self, kind: Fault) -> bool {
        let candidates: Vec<String> = self
            .running_workers()
            .into_iter()
            .filter(|w| self.proxies.contains_key(w) && !self.degraded.iter().any(|(d, _)| d == w))
            .collect();
        if candidates.len() < 2 {
            return false;
        }
        let Some(victim) = self.pick_worker(candidates).await else {
            return false;
        };
        let at = Instant::now();
        let lasts = Duration::from_millis(2 * self.args.lease_ttl_ms + self.args.scheduler_tick_ms);
        let (mode, what) = if kind == Fault::NetPartition {
            (
                crate::netproxy::Mode::Partition,
                "cut (bytes held)".to_owned(),
            )
        } else {
            let ms = self.victims.random_range(50..=800);
            (
                crate::netproxy::Mode::Latency(Duration::from_millis(ms)),
                format!("slowed by {ms} ms a chunk"),
            )
        };
        let Some(proxy) = self.proxies.get(&victim) else {
            return false;
        };
        proxy.set(mode);
        self.degraded.push((victim.clone(), at + lasts));
        let held = if kind == Fault::NetPartition {
            self.held_by(&victim).await
        } else {
            None
        };
        let holding = match held {
            Some(h) => self.track(kind, &victim, at, Some(h)),
            None => {
                self.record_fault(kind, Some(victim.clone()), at);
                String::new()
            }
        };
        self.progress.note(&format!(
            "fault: {victim}'s network to PostgreSQL {what} {holding} for {} ms",
            lasts.as_millis()
        ));
        true
    }

    /// Heals the networks due now, or all of them.
    fn heal_network(&mut self, now: Instant, all: bool) {
        let (due, waiting): (Vec<_>, Vec<_>) = self
            .degraded
            .drain(..)
            .partition(|(_, until)| all || *until <= now);
        self.degraded = waiting;
        for (name, _) in due {
            if let Some(p) = self.proxies.get(&name) {
                p.set(crate::netproxy::Mode::Forward);
            }
            self.progress.note(&format!("healed {name}'s network"));
        }
    }

    /// Freezes (SIGSTOP) the private server's backends that serve one running worker, found
    /// by its application name `rein-PID`, for 2 × lease TTL + a tick: its statements hang
    /// mid-way as on a stalled database, and it must lose its leases without a stale write.
    async fn freeze_backends(&mut self) -> bool {
        let candidates = self.running_workers();
        let Some(victim) = self.pick_worker(candidates).await else {
            return false;
        };
        let Some(pid) = self.children.get(&victim).map(|p| p.pid()) else {
            return false;
        };
        let backends: Vec<i32> = match sqlx::query_scalar(
            "SELECT pid FROM pg_stat_activity
             WHERE datname = current_database()
               AND (application_name = $1 OR application_name LIKE $1 || '-%')",
        )
        .bind(rein_store::application_name_of(pid))
        .fetch_all(self.store.pool())
        .await
        {
            Ok(b) if !b.is_empty() => b,
            _ => return false,
        };
        let at = Instant::now();
        let until =
            at + Duration::from_millis(2 * self.args.lease_ttl_ms + self.args.scheduler_tick_ms);
        let mut stopped = Vec::new();
        for backend in &backends {
            // SAFETY: kill(2) with a pid read from the private server's own activity view.
            if unsafe { libc::kill(*backend, libc::SIGSTOP) } == 0 {
                self.frozen.push((*backend, until));
                stopped.push(*backend);
            }
        }
        let frozen = stopped.len();
        if frozen == 0 {
            return false;
        }
        // Continued on time by a timer of their own, not only by the loop: a backend frozen
        // mid-fsync holds the WAL write lock every other session waits for, the harness's
        // own queries (the next one is just below) included, so a thaw that waited for the
        // loop could wait forever.
        tokio::spawn(async move {
            tokio::time::sleep_until(tokio::time::Instant::from_std(until)).await;
            for backend in stopped {
                // SAFETY: as above; continuing a backend that exited since is a no-op.
                unsafe { libc::kill(backend, libc::SIGCONT) };
            }
        });
        let held = self.held_by(&victim).await;
        let what = self.track(Fault::BackendStop, &victim, at, held);
        self.progress.note(&format!(
            "fault: SIGSTOP {frozen} PostgreSQL backend(s) serving {victim} {what}, for {} ms",
            (until - at).as_millis()
        ));
        true
    }

    /// Sets this database's `statement_timeout` to [`STATEMENT_TIMEOUT_MS`] and terminates
    /// the fleet's sessions, so they reconnect under it: statements that take longer are
    /// cancelled mid-way (SQLSTATE 57014) until it is lifted, 2 × lease TTL later.
    async fn cut_statements(&mut self) -> bool {
        if self.timeouts_until.is_some() {
            return false;
        }
        let set = format!(
            "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I SET statement_timeout = %L', current_database(), '{STATEMENT_TIMEOUT_MS}ms'); END $$"
        );
        if sqlx::query(sqlx::AssertSqlSafe(set))
            .execute(self.store.pool())
            .await
            .is_err()
        {
            return false;
        }
        let at = Instant::now();
        self.timeouts_until = Some(at + Duration::from_millis(2 * self.args.lease_ttl_ms));
        let reconnected = self.terminate_fleet_sessions().await.unwrap_or(0);
        self.record_fault(
            Fault::StatementTimeout,
            Some(format!("{reconnected} sessions")),
            at,
        );
        self.progress.note(&format!(
            "fault: statement_timeout {STATEMENT_TIMEOUT_MS} ms for the fleet ({reconnected} sessions made to reconnect under it) for {} ms",
            2 * self.args.lease_ttl_ms
        ));
        true
    }

    /// Delivers a call's result again after its run moved on (preferring a run still in
    /// flight, whose pending call, if any, is another one): the engine's own send path must
    /// refuse it (the call is no longer pending), or, while a worker holds the run, queue it
    /// for the holder, which refuses it; it is never applied. The log is checked at the end.
    async fn deliver_late_result(&mut self) -> bool {
        type Delivered = (Uuid, String, Value);
        let picked: Result<Result<Vec<Delivered>, sqlx::Error>, _> = tokio::time::timeout(
            QUERY_TIMEOUT,
            sqlx::query_as(
                "SELECT e.run_id, e.type, e.payload FROM rein_events e
                     JOIN rein_runs r ON r.run_id = e.run_id
                     WHERE e.sender IS NULL AND e.payload ? 'call_id'
                       AND e.type <> 'ACTION_DISPATCHED' AND e.sequence < r.last_sequence
                     ORDER BY r.status = 'terminal', random() LIMIT 8",
            )
            .fetch_all(self.store.pool()),
        )
        .await;
        let Ok(Ok(rows)) = picked else { return false };
        let Some((run, kind, payload)) = rows
            .into_iter()
            .find(|(_, kind, _)| rein_core::EngineEvent::parse(kind).is_none())
        else {
            return false;
        };
        let call_id = payload["call_id"].as_str().unwrap_or_default().to_owned();
        let at = Instant::now();
        let sent = self
            .store
            .send(
                run,
                &kind,
                payload,
                &Sender::Engine("chaos-late".into()),
                60_000,
            )
            .await;
        let what = match &sent {
            Ok(rein_store::SendOutcome::Applied { sequence }) => {
                self.late_applied += 1;
                format!("APPLIED at sequence {sequence} (a violation)")
            }
            Ok(rein_store::SendOutcome::Queued { .. }) => {
                "queued for the worker holding the run".to_owned()
            }
            Err(rein_store::StoreError::Unreachable(_)) => return false,
            Err(e) => format!("refused: {e}"),
        };
        self.late.push((run, kind.clone(), call_id.clone()));
        self.record_fault(Fault::LateResult, Some(run.to_string()), at);
        self.progress.note(&format!(
            "fault: {kind} of call {call_id} delivered again to run {run}: {what}"
        ));
        true
    }

    /// Sends CANCEL to a run in flight twice at once with one idempotency key, from two
    /// `rein send` processes: both must answer alike, and the log holds one CANCEL.
    async fn send_event_twice(&mut self) -> bool {
        let picked: Result<Result<Option<Uuid>, sqlx::Error>, _> = tokio::time::timeout(
            QUERY_TIMEOUT,
            sqlx::query_scalar(
                "SELECT run_id FROM rein_runs WHERE status <> 'terminal' ORDER BY random() LIMIT 1",
            )
            .fetch_optional(self.store.pool()),
        )
        .await;
        let Ok(Ok(Some(run))) = picked else {
            return false;
        };
        let key = format!("chaos-twice-{}", self.twice.len() + 1);
        let args: Vec<String> = [
            "send",
            &run.to_string(),
            "CANCEL",
            "--key",
            &key,
            "--payload",
            r#"{"reason":"chaos: sent twice with one key"}"#,
            "--as",
            "chaos",
            "--json",
            "--db-pool-max",
            "2",
            "--database-url",
            &self.url,
        ]
        .iter()
        .map(|a| a.to_string())
        .collect();
        let spawn = || -> std::io::Result<tokio::process::Child> {
            let mut cmd = tokio::process::Command::from(crate::procs::rein_command(
                &args,
                &[("REIN_LOG", "warn")],
                &["REDIS_URL"],
            )?);
            cmd.stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .process_group(0)
                .kill_on_drop(true);
            cmd.spawn()
        };
        let (Ok(first), Ok(second)) = (spawn(), spawn()) else {
            return false;
        };
        let at = Instant::now();
        let (a, b) = tokio::join!(first.wait_with_output(), second.wait_with_output());
        let (Ok(a), Ok(b)) = (a, b) else { return false };
        let answer = |o: &std::process::Output| {
            let doc: Value = serde_json::from_slice(&o.stdout).unwrap_or(Value::Null);
            (
                o.status.code(),
                doc["outcome"].clone(),
                doc["sequence"].clone(),
                doc["inbox_id"].clone(),
            )
        };
        let alike = answer(&a) == answer(&b);
        if !alike {
            self.twice_differed += 1;
        }
        self.twice.push(run);
        self.record_fault(Fault::EventTwice, Some(run.to_string()), at);
        self.progress.note(&format!(
            "fault: CANCEL sent twice at once with key {key} to run {run}: {}",
            if alike {
                format!("both answered {:?}", answer(&a))
            } else {
                format!(
                    "they answered differently: {:?} and {:?} (a violation)",
                    answer(&a),
                    answer(&b)
                )
            }
        ));
        true
    }

    /// The log after the message faults: each late result is in it once (its first
    /// delivery), and each run sent CANCEL twice holds it at most once.
    async fn message_evidence(&self) -> Value {
        let mut late_doubled = 0u64;
        for (run, kind, call_id) in &self.late {
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM rein_events_all
                 WHERE run_id = $1 AND type = $2 AND payload->>'call_id' = $3",
            )
            .bind(run)
            .bind(kind)
            .bind(call_id)
            .fetch_one(self.store.pool())
            .await
            .unwrap_or(i64::MAX);
            if n != 1 {
                late_doubled += 1;
            }
        }
        let cancels_doubled: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM (SELECT run_id FROM rein_events_all
             WHERE run_id = ANY($1) AND type = 'CANCEL' GROUP BY run_id HAVING count(*) > 1) d",
        )
        .bind(&self.twice)
        .fetch_one(self.store.pool())
        .await
        .unwrap_or(i64::MAX);
        json!({
            "late_results": self.late.len(),
            "late_results_applied": self.late_applied,
            "late_results_not_once_in_log": late_doubled,
            "events_sent_twice": self.twice.len(),
            "sends_answered_differently": self.twice_differed,
            "cancels_applied_twice": cancels_doubled,
            "violations": self.late_applied + late_doubled + self.twice_differed
                + cancels_doubled.max(0) as u64,
        })
    }

    /// Lifts the low statement timeout when due (or now), and makes the fleet reconnect
    /// without it.
    async fn lift_statement_timeout(&mut self, now: Instant, all: bool) {
        match self.timeouts_until {
            Some(until) if all || until <= now => {}
            _ => return,
        }
        let reset = "DO $$ BEGIN EXECUTE format('ALTER DATABASE %I RESET statement_timeout', current_database()); END $$";
        if sqlx::query(reset).execute(self.store.pool()).await.is_ok() {
            self.timeouts_until = None;
            let _ = self.terminate_fleet_sessions().await;
            self.progress.note("statement_timeout lifted");
        }
    }

    /// Terminates the fleet's sessions (not the harness's own); how many.
    async fn terminate_fleet_sessions(&self) -> Result<i64, sqlx::Error> {
        let ours = rein_store::application_name();
        sqlx::query_scalar(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
             FROM pg_stat_activity
             WHERE datname = current_database() AND pid <> pg_backend_pid()
               AND application_name LIKE 'rein-%' AND application_name <> $1",
        )
        .bind(&ours)
        .fetch_one(self.store.pool())
        .await
    }

    /// Continues the frozen backends due now, or all of them.
    fn thaw_backends(&mut self, now: Instant, all: bool) {
        let (due, waiting): (Vec<_>, Vec<_>) = self
            .frozen
            .drain(..)
            .partition(|(_, until)| all || *until <= now);
        self.frozen = waiting;
        for (backend, _) in &due {
            // SAFETY: as in `freeze_backends`.
            unsafe {
                libc::kill(*backend, libc::SIGCONT);
            }
        }
        if !due.is_empty() {
            self.progress.note(&format!(
                "continued {} PostgreSQL backend(s) (SIGCONT)",
                due.len()
            ));
        }
    }

    /// Resets every connection between one running worker and PostgreSQL.
    async fn reset_network(&mut self) -> bool {
        let candidates: Vec<String> = self
            .running_workers()
            .into_iter()
            .filter(|w| {
                self.proxies
                    .get(w)
                    .is_some_and(|p| p.open_connections() > 0)
            })
            .collect();
        let Some(victim) = self.pick_worker(candidates).await else {
            return false;
        };
        let Some(reset) = self.proxies.get(&victim).map(|p| p.reset_all()) else {
            return false;
        };
        self.record_fault(Fault::NetReset, Some(victim.clone()), Instant::now());
        self.progress.note(&format!(
            "fault: reset {reset} of {victim}'s connections to PostgreSQL mid-statement"
        ));
        true
    }

    /// Terminates every database session of the fleet's roles (`rein-PID` application
    /// names), but the harness's own, wherever they are in a statement.
    async fn kill_sessions(&mut self) -> bool {
        let Ok(killed) = self.terminate_fleet_sessions().await else {
            return false;
        };
        if killed == 0 {
            return false;
        }
        self.record_fault(
            Fault::SessionKill,
            Some(format!("{killed} sessions")),
            Instant::now(),
        );
        self.progress.note(&format!(
            "fault: pg_terminate_backend on {killed} of the fleet's sessions"
        ));
        true
    }

    /// Locks up to [`LOCK_STALL_ROWS`] unfinished runs' rows from an outside transaction
    /// for twice the lease TTL: their holders' commits and renewals wait on the locks, and
    /// may lose their leases, while the other runs go on.
    async fn stall_locks(&mut self) -> bool {
        let pool = self.store.pool().clone();
        let hold = Duration::from_millis(2 * self.args.lease_ttl_ms);
        let (locked_tx, locked_rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let Ok(mut tx) = pool.begin().await else {
                let _ = locked_tx.send(0);
                return;
            };
            let rows: Result<Vec<Uuid>, _> = sqlx::query_scalar(
                "SELECT run_id FROM rein_runs WHERE status <> 'terminal'
                 ORDER BY run_id LIMIT $1 FOR UPDATE SKIP LOCKED",
            )
            .bind(LOCK_STALL_ROWS)
            .fetch_all(&mut *tx)
            .await;
            let n = rows.map(|r| r.len()).unwrap_or(0);
            let _ = locked_tx.send(n);
            if n > 0 {
                tokio::time::sleep(hold).await;
            }
            let _ = tx.rollback().await;
        });
        let locked = locked_rx.await.unwrap_or(0);
        if locked == 0 {
            return false;
        }
        self.record_fault(
            Fault::LockStall,
            Some(format!("{locked} runs' rows")),
            Instant::now(),
        );
        self.progress.note(&format!(
            "fault: an outside transaction holds {locked} runs' row locks for {} ms",
            hold.as_millis()
        ));
        true
    }

    /// SIGSTOPs the scheduler holding the live leader lease past that lease, so another
    /// takes the lead; continued later with the stopped workers, it believes it leads
    /// until its next renewal is refused.
    async fn stop_leader(&mut self) -> bool {
        let Ok(Some(lease)) = self.store.leader(rein_scheduler::LEADER_LEASE).await else {
            return false;
        };
        let victim = lease.holder.clone();
        if !lease.live
            || !self.schedulers.contains(&victim)
            || self.stopped.iter().any(|(s, _)| *s == victim)
        {
            return false;
        }
        let Some(p) = self.children.get(&victim) else {
            return false;
        };
        if p.signal(libc::SIGSTOP).is_err() {
            return false;
        }
        let at = Instant::now();
        let stop_for =
            Duration::from_millis(2 * self.leader_ttl_ms() + self.args.scheduler_tick_ms);
        self.stopped.push((victim.clone(), at + stop_for));
        self.record_fault(Fault::LeaderStop, Some(victim.clone()), at);
        self.progress.note(&format!(
            "fault: SIGSTOP the leading scheduler {victim} past its leader lease, for {} ms",
            stop_for.as_millis()
        ));
        true
    }

    /// Starts one more worker whose wall clock is [`CLOCK_SKEW_S`] ahead or behind, in
    /// turn: leases and deadlines are judged by the database clock, so it works as any.
    fn skew_a_worker(&mut self) -> Result<bool, String> {
        let Some(lib) = libfaketime() else {
            return Ok(false);
        };
        let skewed = self
            .fault_log
            .iter()
            .filter(|f| f.kind == Fault::ClockSkew)
            .count();
        let offset = if skewed % 2 == 0 {
            CLOCK_SKEW_S
        } else {
            -CLOCK_SKEW_S
        };
        let env = [
            ("LD_PRELOAD", lib.display().to_string()),
            ("FAKETIME", format!("{offset:+}s")),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1".to_owned()),
        ];
        let id = self
            .spawn_worker_with(&env)
            .map_err(|_| "cannot start a clock-skewed worker")?;
        self.record_fault(Fault::ClockSkew, Some(id.clone()), Instant::now());
        self.progress.note(&format!(
            "fault: {id} starts with its clock {offset:+} s off the database's"
        ));
        Ok(true)
    }

    /// Crash-stop and start the private server on the same port, off the async threads.
    fn restart_db(&mut self, db: &mut Database) -> bool {
        // A frozen backend would hold up the server's stop: not while one is.
        if !self.frozen.is_empty() {
            return false;
        }
        let Some(mut pg) = db.private.take() else {
            return false;
        };
        self.progress
            .note("fault: PostgreSQL crash-restart (immediate stop, then start)");
        self.record_fault(Fault::DbRestart, None, Instant::now());
        self.restarting = Some(tokio::task::spawn_blocking(move || {
            let result = pg.restart_immediate();
            (pg, result)
        }));
        true
    }

    /// SIGKILL the private Redis; it starts again on the same port after [`REDIS_DOWN_FOR`].
    /// One outage at a time, and only once the workers came back from the last one.
    fn stop_redis(&mut self) -> bool {
        let Some(r) = self.redis.as_mut() else {
            return false;
        };
        if r.down_until.is_some() || r.waiting.is_some() {
            return false;
        }
        tokio::task::block_in_place(|| r.server.stop());
        let at = Instant::now();
        r.down_until = Some(at + REDIS_DOWN_FOR);
        let port = r.server.port();
        self.record_fault(Fault::RedisStop, Some("redis-server".to_owned()), at);
        self.progress.note(&format!(
            "fault: kill -9 the private redis-server (port {port}) for {} ms; the fleet polls meanwhile",
            REDIS_DOWN_FOR.as_millis()
        ));
        true
    }

    /// Stops the fleet, audits the database and builds the report.
    async fn finish(&mut self, outcome: Outcome, db: &mut Database) -> (u8, Option<Value>) {
        self.thaw_backends(Instant::now(), true);
        self.heal_network(Instant::now(), true);
        self.lift_statement_timeout(Instant::now(), true).await;
        let children = &mut self.children;
        tokio::task::block_in_place(|| {
            for (name, _) in &self.stopped {
                if let Some(p) = children.get(name) {
                    let _ = p.signal(libc::SIGCONT);
                }
            }
            children.shutdown(SHUTDOWN_GRACE)
        });
        self.stopped.clear();
        if let Some(r) = self.redis.as_mut() {
            r.stop.cancel();
            tokio::task::block_in_place(|| r.server.stop());
        }
        if let Some(handle) = self.restarting.take()
            && let Ok((pg, _)) = handle.await
        {
            db.private = Some(pg);
        }
        match &outcome {
            Outcome::Finished => {}
            Outcome::Aborted(why) => {
                eprintln!("error: chaos aborted: {why}");
                return (exit::DATABASE, None);
            }
            Outcome::TimedOut => eprintln!(
                "error: the fleet did not finish: {} of {} runs terminal ({} enqueued, {} needing an operator) {} s after the faults ended",
                self.totals.1,
                self.args.runs,
                self.enqueued,
                self.needs_operator,
                self.args.timeout_s
            ),
        }
        eprintln!("chaos: auditing every run (replaying each log)…");
        let audit = match self.store.audit().await {
            Ok(a) => a,
            Err(e) => return (report(&e), None),
        };
        let extra = self.extra_evidence().await;
        let mut summary = summarize(
            &audit,
            self.enqueued as i64,
            &self.faults,
            &self.recovery_ms,
        );
        let bound = self.args.lease_ttl_ms + self.args.scheduler_tick_ms;
        summary["recovery_ms"]["bound"] = json!(bound);
        summary["recovery_ms"]["unresolved"] = json!(self.recoveries.len());
        summary["redis"] = self.redis_summary();
        summary["upgrade"] = self.upgrade_summary();
        summary["messages"] = self.message_evidence().await;
        if let Some(n) = summary["messages"]["violations"].as_i64() {
            summary["violations"] = json!(summary["violations"].as_i64().unwrap_or(0) + n);
        }
        if let Some(n) = summary["upgrade"]["violations"].as_i64() {
            summary["violations"] = json!(summary["violations"].as_i64().unwrap_or(0) + n);
        }
        if let Some(n) = summary["redis"]["not_resubscribed"].as_i64() {
            summary["violations"] = json!(summary["violations"].as_i64().unwrap_or(0) + n);
        }
        summary["seed"] = json!(self.seed);
        summary["finished"] = json!(matches!(outcome, Outcome::Finished));
        summary["elapsed_s"] = json!((self.started.elapsed().as_secs_f64() * 10.0).round() / 10.0);
        summary["params"] = json!({
            "runs": self.args.runs,
            "workers": self.args.workers,
            "schedulers": SCHEDULERS,
            "worker_concurrency": WORKER_CONCURRENCY,
            "duration_s": self.args.duration_s,
            "lease_ttl_ms": self.args.lease_ttl_ms,
            "scheduler_tick_ms": self.args.scheduler_tick_ms,
            "timeout_s": self.args.timeout_s,
            "allow_db_restart": self.args.allow_db_restart,
            "database": db.describe,
        });
        summary["log_dir"] = json!(self.children.log_dir.display().to_string());
        summary["approvals"] = json!({
            "granted": self.approvals.get("granted").copied().unwrap_or(0),
            "denied": self.approvals.get("denied").copied().unwrap_or(0),
        });
        summary["exited_on_their_own"] = json!(self.exited);
        summary["recovery_by_kind"] = recovery_by_kind(&self.fault_log);
        summary["fault_log"] = self
            .fault_log
            .iter()
            .map(|f| {
                json!({
                    "at_ms": f.at.duration_since(self.started).as_millis() as u64,
                    "kind": f.kind.name(),
                    "victim": f.victim,
                    "leases_held": f.held,
                    "recovery_ms": f.recovery_ms,
                })
            })
            .collect();
        for (k, v) in extra {
            summary[k] = v;
        }
        let violations = summary["violations"].as_i64().unwrap_or(1);
        let code = if violations == 0 && matches!(outcome, Outcome::Finished) {
            exit::OK
        } else {
            exit::DATABASE
        };
        (code, Some(summary))
    }

    /// Whether chaos had a Redis and, after each `redis_stop`, how long until every worker
    /// was subscribed again.
    fn redis_summary(&self) -> Value {
        let Some(r) = &self.redis else {
            return json!({ "enabled": false, "skipped": "redis-server is not installed" });
        };
        let mut sorted = r.resubscribed_ms.clone();
        sorted.sort_unstable();
        let pending = u64::from(r.waiting.is_some() || r.down_until.is_some());
        json!({
            "enabled": true,
            "resubscribed_ms": {
                "p50": (!sorted.is_empty()).then(|| sorted[(sorted.len() - 1) / 2]),
                "max": sorted.last(),
                "count": sorted.len(),
                "bound": self.resubscribe_bound().as_millis() as u64,
            },
            // An outage chaos ended before the workers could come back from counts too.
            "not_resubscribed": r.not_resubscribed + pending,
        })
    }

    /// Evidence beyond the audit: what the workload went through.
    async fn extra_evidence(&self) -> Vec<(&'static str, Value)> {
        let events = self.store.count_events_by_type().await.unwrap_or_default();
        let count = |names: &[&str]| crate::events_of(&events, names);
        let recovered = self
            .store
            .counter(counters::LEASES_RECOVERED)
            .await
            .unwrap_or(0);
        let by_final: BTreeMap<String, i64> = self
            .store
            .count_by_state()
            .await
            .unwrap_or_default()
            .into_iter()
            .fold(BTreeMap::new(), |mut m, (d, s, _, n)| {
                *m.entry(format!("{d}/{s}")).or_default() += n;
                m
            });
        vec![
            ("leases_recovered", json!(recovered)),
            ("events", json!(events.iter().map(|e| e.1).sum::<i64>())),
            ("retries", json!(count(&["retry", "RETRY_DUE"]))),
            (
                "approval_timers_fired",
                json!(count(&["timeout", "APPROVAL_TIMEOUT"])),
            ),
            (
                "in_doubt_reconciled",
                json!(count(&["ACTION_RESULT_IN_DOUBT"])),
            ),
            ("runs_by_final_state", json!(by_final)),
        ]
    }
}

/// Chaos's own Redis when redis-server is installed; without it the `redis_stop` fault is
/// skipped (said once), except in CI, where a missing redis-server is an error.
fn start_redis(log_dir: &Path) -> Result<Option<Redis>, u8> {
    let Some(program) = crate::privredis::installed() else {
        if std::env::var("CI").as_deref() == Ok("true") {
            eprintln!(
                "error: redis-server is not installed, and in CI (CI=true) the redis_stop fault may not be skipped; install it (e.g. apt-get install redis-server)"
            );
            return Err(exit::INPUT);
        }
        eprintln!(
            "chaos: redis-server is not installed, so the redis_stop fault is skipped and the fleet runs without Redis (install redis-server to include it)"
        );
        return Ok(None);
    };
    let server =
        tokio::task::block_in_place(|| crate::privredis::PrivateRedis::start(program, log_dir))
            .map_err(|e| {
                eprintln!("error: cannot start a private redis-server: {e}");
                exit::INPUT
            })?;
    let args = rein_process::RedisArgs {
        redis_url: Some(server.url()),
        redis_prefix: "rein".to_owned(),
    };
    Ok(Some(Redis {
        server,
        args,
        stop: tokio_util::sync::CancellationToken::new(),
        down_until: None,
        waiting: None,
        resubscribed_ms: Vec::new(),
        not_resubscribed: 0,
    }))
}

/// The workload: alternating lifecycle and research-agent runs whose sim input covers
/// retries (and exhausted retries), approvals granted, denied and left to expire, fatal
/// failures, multi-step agents, and side effects on most runs.
async fn workload(store: &Store, runs: u64) -> Result<Vec<EnqueueRequest>, rein_store::StoreError> {
    let lifecycle = store
        .load_definition("lifecycle", Some(rein_core::builtin::lifecycle().version()))
        .await?;
    let research = store
        .load_definition(
            "research-agent",
            Some(rein_core::builtin::research_agent().version()),
        )
        .await?;
    let lifecycle_expiring = expiring_copy(&lifecycle)?;
    let research_expiring = expiring_copy(&research)?;
    store.register_definition(&lifecycle_expiring).await?;
    store.register_definition(&research_expiring).await?;
    Ok((0..runs)
        .map(|i| {
            let lifecycle_run = i.is_multiple_of(2);
            let variant = (i / 2) % 20;
            let mut sim = json!({ "work_ms": 40 + (i * 37) % 161 });
            let mut expiring = false;
            match variant {
                0..=3 => sim["transient_failures"] = json!(1 + (i / 2) % 2),
                4 => sim["transient_failures"] = json!(5),
                5 | 6 => {
                    sim["approval"] = json!("grant");
                    sim["amount"] = json!(150);
                }
                7 => {
                    sim["approval"] = json!("deny");
                    sim["amount"] = json!(500);
                }
                8 => {
                    sim["approval"] = json!("expire");
                    sim["amount"] = json!(300);
                    expiring = true;
                }
                9 => sim["fatal_at_step"] = json!(1),
                10 | 11 => sim["steps"] = json!(3),
                12 => {
                    sim["steps"] = json!(2);
                    sim["approval"] = json!("grant");
                    sim["amount"] = json!(150);
                }
                // A research-agent tool step without a side effect never counts as
                // completed, so only lifecycle runs go without one.
                13 if lifecycle_run => sim["side_effect"] = json!(false),
                _ => {}
            }
            let def = match (lifecycle_run, expiring) {
                (true, false) => &lifecycle,
                (true, true) => &lifecycle_expiring,
                (false, false) => &research,
                (false, true) => &research_expiring,
            };
            let mut request = EnqueueRequest::new(def.clone(), json!({ "sim": sim }));
            request.client_key = Some(rein_store::ClientKey::new("chaos", format!("chaos-{i}")));
            request
        })
        .collect())
}

/// The built-in with every approval expiring after [`APPROVAL_EXPIRES_AFTER_MS`], as a new
/// version of the same name.
fn expiring_copy(def: &Definition) -> Result<Definition, rein_store::StoreError> {
    rein_worker::sim::with_fast_approval_expiry(
        def,
        APPROVAL_EXPIRES_AFTER_MS,
        APPROVAL_REMIND_BEFORE_MS,
        EXPIRING_VERSION_OFFSET,
    )
    .map_err(rein_store::StoreError::Invalid)
}

/// Each fault kind's recovery times: how many were measured, p50 and max in ms.
fn recovery_by_kind(log: &[FaultRecord]) -> Value {
    let mut by: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for f in log {
        let times = by.entry(f.kind.name()).or_default();
        if let Some(ms) = f.recovery_ms {
            times.push(ms);
        }
    }
    let out: serde_json::Map<String, Value> = by
        .into_iter()
        .map(|(kind, mut times)| {
            times.sort_unstable();
            let p50 = (!times.is_empty()).then(|| times[(times.len() - 1) / 2]);
            (
                kind.to_owned(),
                json!({ "measured": times.len(), "p50": p50, "max": times.last() }),
            )
        })
        .collect();
    Value::Object(out)
}

/// The report's core: the audit's counts, the faults and the recovery times. `violations`
/// sums every count that must be zero, runs enqueued but not terminal included.
fn summarize(
    audit: &AuditReport,
    runs_enqueued: i64,
    faults: &BTreeMap<Fault, u64>,
    recovery_ms: &[u64],
) -> Value {
    let violations = audit.sequence_gaps
        + audit.stale_token_events
        + audit.token_regressions
        + audit.duplicate_effects
        + audit.replay_mismatches
        + audit.terminal_without_reason
        + audit.denied_but_applied
        + (runs_enqueued - audit.runs_terminal).abs()
        + (audit.runs - runs_enqueued).abs();
    let mut sorted = recovery_ms.to_vec();
    sorted.sort_unstable();
    let p50 = (!sorted.is_empty()).then(|| sorted[(sorted.len() - 1) / 2]);
    let faults: BTreeMap<&str, u64> = Fault::ALL
        .iter()
        .map(|f| (f.name(), faults.get(f).copied().unwrap_or(0)))
        .collect();
    let unfinished = audit.unfinished;
    json!({
        "runs_enqueued": runs_enqueued,
        "runs_in_database": audit.runs,
        "runs_terminal": audit.runs_terminal,
        "runs_unfinished": {
            "total": unfinished.total(),
            "queued": unfinished.queued,
            "running": unfinished.running,
            "parked": unfinished.parked,
            "needs_operator": unfinished.needs_operator,
        },
        "integrity_violations": audit.integrity_violations(),
        "sequence_gaps": audit.sequence_gaps,
        "stale_token_events": audit.stale_token_events,
        "token_regressions": audit.token_regressions,
        "fenced_writes_rejected": audit.fenced_writes_rejected,
        "duplicate_effects": audit.duplicate_effects,
        "replay_mismatches": audit.replay_mismatches,
        "denied_but_applied": audit.denied_but_applied,
        "terminal_without_reason": audit.terminal_without_reason,
        "faults": faults,
        "recovery_ms": { "p50": p50, "max": sorted.last(), "count": sorted.len() },
        "violations": violations,
    })
}

async fn check_only(args: &ChaosArgs) -> u8 {
    let store = match rein_process::connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    eprintln!("chaos: auditing the database (no fleet, no faults)…");
    let audit = match store.audit().await {
        Ok(a) => a,
        Err(e) => return report(&e),
    };
    let mut summary = summarize(&audit, audit.runs, &BTreeMap::new(), &[]);
    // A live database always has runs queued, running and parked: they are reported, and
    // only broken invariants fail the audit.
    summary["violations"] = json!(audit.integrity_violations());
    summary["seed"] = Value::Null;
    summary["params"] = json!({ "check_only": true });
    summary["log_dir"] = Value::Null;
    if args.json {
        println!("{summary}");
    } else {
        print_table(&summary);
    }
    if summary["violations"].as_i64() == Some(0) {
        exit::OK
    } else {
        exit::DATABASE
    }
}

fn print_table(s: &Value) {
    let verdict = |ok: bool| if ok { "ok" } else { "VIOLATED" };
    let zero = |key: &str| s[key].as_i64() == Some(0);
    let title = match s["seed"].as_u64() {
        Some(seed) => format!("Rein chaos (seed {seed})"),
        None => "Rein chaos --check-only".to_owned(),
    };
    println!("\n== {title} ==");
    println!("{:<48} {:>8}  must be", "check", "count");
    let row = |label: &str, value: &Value, must: &str, status: &str| {
        println!("{label:<48} {:>8}  {must:<10} {status}", value.to_string());
    };
    let check_only = s["params"]["check_only"] == json!(true);
    let unfinished = &s["runs_unfinished"];
    if check_only {
        row("runs in the database", &s["runs_in_database"], "", "");
        row("runs terminal", &s["runs_terminal"], "", "");
        row(
            "runs not finished yet (not a violation)",
            &unfinished["total"],
            "",
            "",
        );
        for (key, label) in [
            ("queued", "  queued for a worker"),
            ("running", "  running under a live lease"),
            ("parked", "  parked (timer, event, approval)"),
            ("needs_operator", "  needing an operator"),
        ] {
            row(label, &unfinished[key], "", "");
        }
    } else {
        row("runs enqueued", &s["runs_enqueued"], "", "");
        let all_done =
            s["runs_terminal"] == s["runs_enqueued"] && s["runs_in_database"] == s["runs_enqueued"];
        row(
            "runs terminal",
            &s["runs_terminal"],
            "= enqueued",
            verdict(all_done),
        );
    }
    for (key, label) in [
        ("sequence_gaps", "runs with sequence gaps"),
        ("stale_token_events", "events under a stale fencing token"),
        ("token_regressions", "fencing tokens that went backwards"),
        (
            "duplicate_effects",
            "side effects applied twice (run, step)",
        ),
        (
            "replay_mismatches",
            "logs that do not replay to the projection",
        ),
        ("denied_but_applied", "denied approvals applied anyway"),
        ("terminal_without_reason", "terminal runs without a reason"),
    ] {
        row(label, &s[key], "0", verdict(zero(key)));
    }
    row(
        "writes rejected as fenced (evidence)",
        &s["fenced_writes_rejected"],
        "",
        "",
    );
    if let Some(faults) = s["faults"].as_object()
        && !check_only
    {
        println!("faults injected");
        for (kind, n) in faults {
            let note = if kind == Fault::DbRestart.name()
                && s["params"]["allow_db_restart"] != json!(true)
            {
                "  (needs --allow-db-restart)"
            } else if kind == Fault::RedisStop.name() && s["redis"]["enabled"] == json!(false) {
                "  (needs redis-server)"
            } else {
                ""
            };
            let recovered = &s["recovery_by_kind"][kind.as_str()];
            let times = match (recovered["p50"].as_u64(), recovered["max"].as_u64()) {
                (Some(p50), Some(max)) => format!("  recovered p50 {p50} ms, max {max} ms"),
                _ => String::new(),
            };
            println!("  {kind:<46} {:>8}{times}{note}", n.to_string());
        }
        let r = &s["recovery_ms"];
        match (r["p50"].as_u64(), r["max"].as_u64()) {
            (Some(p50), Some(max)) => println!(
                "recovery after a worker kill/stop: p50 {p50} ms, max {max} ms over {} fault(s); bound lease TTL + scheduler tick = {} ms",
                r["count"], r["bound"]
            ),
            _ if r["unresolved"].as_u64() > Some(0) => {}
            _ => {
                println!("recovery after a worker kill/stop: no fault hit a worker holding leases")
            }
        }
        let redis = &s["redis"];
        if let (Some(p50), Some(max)) = (
            redis["resubscribed_ms"]["p50"].as_u64(),
            redis["resubscribed_ms"]["max"].as_u64(),
        ) {
            println!(
                "wake-ups after Redis returned: every worker subscribed again after p50 {p50} ms, max {max} ms over {} fault(s); bound {} ms",
                redis["resubscribed_ms"]["count"], redis["resubscribed_ms"]["bound"]
            );
        }
        if redis["enabled"] == json!(true) {
            row(
                "Redis outages not followed by resubscription",
                &redis["not_resubscribed"],
                "0",
                verdict(redis["not_resubscribed"].as_i64() == Some(0)),
            );
        }
        let m = &s["messages"];
        if m["late_results"].as_u64() > Some(0) || m["events_sent_twice"].as_u64() > Some(0) {
            println!(
                "messages: {} call results delivered again after their run moved on, {} events sent twice at once with one key",
                m["late_results"], m["events_sent_twice"]
            );
            for (label, key) in [
                ("late results applied", "late_results_applied"),
                (
                    "late results not exactly once in the log",
                    "late_results_not_once_in_log",
                ),
                (
                    "sends with one key answered differently",
                    "sends_answered_differently",
                ),
                (
                    "events applied twice despite one key",
                    "cancels_applied_twice",
                ),
            ] {
                row(label, &m[key], "0", verdict(m[key].as_i64() == Some(0)));
            }
        }
        let upgrade = &s["upgrade"];
        if upgrade["enabled"] == json!(true) {
            println!(
                "rolling upgrade: {} worker(s) of the previous release committed {} events, {} replaced by this release; contract step held by [{}] while they ran",
                upgrade["old_workers"],
                upgrade["old_worker_events"],
                upgrade["replaced"],
                upgrade["contract_blocked_by"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            row(
                "contract step waited for old workers, then ran",
                &upgrade["violations"],
                "0",
                verdict(upgrade["violations"].as_i64() == Some(0)),
            );
            match upgrade["contract_error"].as_str() {
                Some(why) => println!("contract step after the upgrade: {why}"),
                None => println!(
                    "contract step after the upgrade applied: {}",
                    upgrade["contract_applied"]
                ),
            }
        }
        println!(
            "leases recovered {}, retries {}, approvals granted {} / denied {}, approval timers fired {}",
            s["leases_recovered"],
            s["retries"],
            s["approvals"]["granted"],
            s["approvals"]["denied"],
            s["approval_timers_fired"]
        );
        if r["unresolved"].as_u64() > Some(0) {
            println!(
                "worker faults whose runs were not yet taken over when chaos ended: {}",
                r["unresolved"]
            );
        }
        if let Some(exited) = s["exited_on_their_own"].as_array()
            && !exited.is_empty()
        {
            println!(
                "processes that exited on their own (restarted): {}",
                exited
                    .iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    if s["finished"] == json!(false) {
        println!("the fleet did not finish every run within --timeout-s after the faults");
    }
    println!(
        "{:<48} {:>8}  {:<10} {}",
        "violations",
        s["violations"].to_string(),
        "0",
        verdict(zero("violations"))
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kinds and gaps the schedule yields, as if each fault were injected when due.
    fn draw(seed: u64, enabled: &[Fault], n: usize) -> Vec<(Fault, Duration)> {
        let start = Instant::now();
        let mut schedule = Schedule::new(seed, enabled.to_vec(), Duration::from_secs(12), start);
        let mut at = schedule.next_at;
        (0..n)
            .map(|_| {
                let kind = schedule.peek();
                // Peeking again before injecting keeps the same kind.
                assert_eq!(schedule.peek(), kind);
                schedule.injected(at);
                let gap = schedule.next_at - at;
                at = schedule.next_at;
                (kind, gap)
            })
            .collect()
    }

    #[test]
    fn first_round_is_every_enabled_kind_once_then_a_seeded_mix() {
        let all = Fault::ALL.to_vec();
        for seed in 0..50 {
            let drawn = draw(seed, &all, all.len() + 6);
            let mut first: Vec<Fault> = drawn[..all.len()].iter().map(|d| d.0).collect();
            first.sort();
            assert_eq!(first, all, "seed {seed}");
            // A 12 s window fits the first round: the gaps between its faults stay under
            // window / (kinds + 1).
            assert!(
                drawn[..all.len() - 1]
                    .iter()
                    .all(|d| d.1 <= Duration::from_millis(2_400)),
                "seed {seed}: {drawn:?}"
            );
            assert!(drawn[all.len()..].iter().all(|d| all.contains(&d.0)));
        }
        let without_restart = [Fault::WorkerKill, Fault::SchedulerKill];
        assert!(
            draw(3, &without_restart, 20)
                .iter()
                .all(|d| without_restart.contains(&d.0))
        );
    }

    #[test]
    fn same_seed_same_schedule() {
        assert_eq!(draw(7, &Fault::ALL, 20), draw(7, &Fault::ALL, 20));
        assert_ne!(draw(7, &Fault::ALL, 20), draw(8, &Fault::ALL, 20));
    }

    #[test]
    fn all_kinds_done_only_after_the_first_round_is_injected() {
        let mut schedule = Schedule::new(
            1,
            vec![Fault::WorkerKill, Fault::WorkerStop],
            Duration::from_secs(5),
            Instant::now(),
        );
        assert!(!schedule.all_kinds_done());
        schedule.peek();
        schedule.injected(Instant::now());
        schedule.peek();
        // The last kind of the first round is due but not injected yet.
        assert!(!schedule.all_kinds_done());
        schedule.injected(Instant::now());
        assert!(schedule.all_kinds_done());
    }
}
