//! `rein`: one binary, every role. `rein worker`, `rein scheduler`, `rein demo`, and the
//! operator and offline commands.

mod api;
mod approvals;
mod bench;
mod brief;
mod chaos;
mod demo;
mod offline;
mod ops;
mod privdb;
mod privredis;
mod procs;
mod remote;
mod retention;
mod service;
mod telemetry;
mod tokens;
mod why;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Exit codes shared by every command.
pub mod exit {
    pub const OK: u8 = 0;
    /// Usage or input error.
    pub const INPUT: u8 = 1;
    /// Refused: invalid transition, fenced, a conflict, an event the sender may not send.
    pub const REFUSED: u8 = 2;
    /// Database, API or Redis unreachable or failing, or the schema too old or too new.
    pub const DATABASE: u8 = 3;
    /// The API refused the token: missing, revoked or lacking the scope.
    pub const AUTH: u8 = 4;
}

#[derive(Parser)]
#[command(
    name = "rein",
    version,
    about = "A durable runtime for LLM agent runs",
    propagate_version = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone)]
pub struct DbArgs {
    /// PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// Connections this process may open (sized for 2 cores and Postgres' 100 connections).
    #[arg(long, default_value_t = rein_store::POOL_MAX_DEFAULT, value_parser = clap::value_parser!(u32).range(1..=90))]
    pub db_pool_max: u32,
    /// How long connecting to PostgreSQL may take before the command fails (exit 3); a
    /// server that refuses connections is asked again until then.
    #[arg(long, env = "REIN_DB_CONNECT_TIMEOUT_MS", value_name = "MS",
          default_value_t = rein_store::CONNECT_FIRST_TIMEOUT_MS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub db_connect_timeout_ms: u64,
    /// How deep a tree of fan-outs may grow (SPEC Z4): a run enqueued is at depth 0 and a
    /// run at this depth may not fan out; such a fan-out takes its failure path (reason
    /// `fan_out_depth_exceeded`). Every process that commits (worker, scheduler, api, send)
    /// enforces the value it is given: give them all the same.
    #[arg(long, env = "REIN_FAN_OUT_DEPTH_MAX", value_name = "N",
          default_value_t = rein_core::join::DEPTH_MAX_DEFAULT,
          value_parser = clap::value_parser!(u32).range(0..=rein_core::join::DEPTH_MAX_LIMIT as i64))]
    pub fan_out_depth_max: u32,
    /// Most runs one root's tree of fan-outs may start over its life (SPEC Z4); a fan-out
    /// that would pass it takes its failure path (reason `fan_out_descendants_exceeded`).
    #[arg(long, env = "REIN_FAN_OUT_DESCENDANTS_MAX", value_name = "N",
          default_value_t = rein_core::join::DESCENDANTS_MAX_DEFAULT,
          value_parser = clap::value_parser!(u64).range(0..=rein_core::join::DESCENDANTS_MAX_LIMIT))]
    pub fan_out_descendants_max: u64,
}

impl DbArgs {
    /// The bounds on fan-out trees these arguments set (clap keeps them in range).
    pub fn tree_bounds(&self) -> rein_core::join::TreeBounds {
        rein_core::join::TreeBounds {
            depth_max: self.fan_out_depth_max,
            descendants_max: self.fan_out_descendants_max,
        }
    }
}

/// Optional Redis (SPEC K1): wake-ups for idle workers. Never a source of truth.
#[derive(clap::Args, Clone, Default)]
pub struct RedisArgs {
    /// Redis URL; absent: workers poll only.
    #[arg(long, env = "REDIS_URL", hide_env_values = true)]
    pub redis_url: Option<String>,
    /// Prefix of Rein's Redis channels and keys (deployments sharing one Redis).
    #[arg(long, env = "REIN_REDIS_PREFIX", default_value = "rein")]
    pub redis_prefix: String,
}

impl RedisArgs {
    pub fn config(&self) -> Option<rein_accel::RedisConfig> {
        let url = self.redis_url.as_deref().filter(|u| !u.is_empty())?;
        Some(rein_accel::RedisConfig::new(url).with_prefix(self.redis_prefix.clone()))
    }

    /// Makes `store` publish wake-ups after commits that make work runnable.
    pub fn publishing(
        &self,
        store: rein_store::Store,
        stop: &tokio_util::sync::CancellationToken,
    ) -> rein_store::Store {
        match self.config() {
            Some(config) => {
                let publisher = rein_accel::Publisher::start(config, stop.clone());
                store.with_wake_hook(std::sync::Arc::new(move |q| publisher.wake(q)))
            }
            None => store,
        }
    }

    /// Makes `worker` claim at once when a wake-up for one of its queues arrives.
    pub fn subscribe(
        &self,
        worker: &rein_worker::Worker,
        queues: &[String],
        stop: &tokio_util::sync::CancellationToken,
    ) {
        if let Some(config) = self.config() {
            rein_accel::subscribe(config, queues, worker.wakeups(), stop.clone());
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Validate, show and list state-machine definitions.
    #[command(subcommand)]
    Definitions(offline::DefinitionsCommand),
    /// Re-reduce a recorded event log offline (changes nothing).
    Replay(offline::ReplayArgs),
    /// Apply database migrations.
    Migrate(DbArgs),
    /// Run a worker: claims runs and executes their node actions.
    Worker(ops::WorkerArgs),
    /// Run a scheduler: fires timers and recovers expired leases.
    Scheduler(ops::SchedulerArgs),
    /// Create a run; prints its id.
    Enqueue(ops::EnqueueArgs),
    /// Send an event to a run (reply, approval, cancel).
    Send(ops::SendArgs),
    /// Settle a run's in-doubt call by hand: `applied` (with its result event) or
    /// `not-applied` (the step is dispatched again with the same idempotency key).
    Resolve(ops::ResolveArgs),
    /// Start a new run like a finished one (same definition version, input, queue), linked
    /// to it.
    Rerun(ops::RerunArgs),
    /// Cancel a run, with a reason.
    Cancel(ops::CancelArgs),
    /// Live workers and schedulers: last heartbeat and leases held (one silent for longer
    /// than its lease TTL is gone).
    Workers(ops::WorkersArgs),
    /// Fleet-wide limits in Redis: how far ahead each rate is booked, deferrals, slot holders.
    Limits(ops::LimitsArgs),
    /// Inspect runs.
    #[command(subcommand)]
    Runs(ops::RunsCommand),
    /// Why a run is where it is: state, last event, lease, pending action, rejections, side
    /// effects, approvals, timers, and what would move it.
    Why(why::WhyArgs),
    /// The resume brief of a run: task, steps done and their results, pending step.
    Brief(brief::BriefArgs),
    /// List approval requests waiting for a person.
    #[command(subcommand)]
    Approvals(approvals::ApprovalsCommand),
    /// Grant an approval request; the run gets its granted event.
    Approve(approvals::DecideArgs),
    /// Deny an approval request; the run gets its denied event.
    Deny(approvals::DecideArgs),
    /// Manage API bearer tokens.
    #[command(subcommand)]
    Tokens(tokens::TokensCommand),
    /// Serve the HTTP API (JSON, OpenAPI document at /openapi.json).
    Api(api::ApiArgs),
    /// Print the HTTP API's OpenAPI 3.1 document (what `rein api` serves at /openapi.json).
    Openapi,
    /// Start a private PostgreSQL, a scheduler pair and workers, drive real runs and show
    /// what happened.
    Demo(demo::DemoArgs),
    /// Measure throughput and latency against the database's own insert rate.
    Bench(bench::BenchArgs),
    /// Run a real fleet under seeded faults and check every invariant afterwards.
    Chaos(chaos::ChaosArgs),
    /// Event history retention: archive the logs of runs that finished long ago.
    #[command(subcommand)]
    Retention(retention::RetentionCommand),
}

impl Command {
    /// Commands that print an answer and exit. The others (roles, and demo, bench and chaos,
    /// which own a private server and child processes) must handle a closed socket or pipe
    /// as an error and clean up, not die of it.
    fn ends_on_a_closed_pipe(&self) -> bool {
        !matches!(
            self,
            Command::Worker(_)
                | Command::Scheduler(_)
                | Command::Api(_)
                | Command::Demo(_)
                | Command::Bench(_)
                | Command::Chaos(_)
        )
    }
}

/// Output to a closed pipe (`rein runs list | head`) ends the command quietly the way it
/// ends `ls`: killed by SIGPIPE, which a shell reports as status 141. Rust starts with
/// SIGPIPE ignored, which turns that write into a panic instead.
fn end_on_a_closed_pipe() {
    // SAFETY: signal(2) with SIG_DFL changes only this process's disposition of SIGPIPE,
    // before any other thread exists; no handler code runs.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() -> ExitCode {
    // Usage errors exit 1 like every other input error (clap's own code, 2, means "refused").
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() {
                exit::INPUT
            } else {
                exit::OK
            });
        }
    };
    if cli.command.ends_on_a_closed_pipe() {
        end_on_a_closed_pipe();
    }
    let code = match cli.command {
        Command::Definitions(cmd) if !cmd.needs_service() => offline::definitions(cmd),
        Command::Replay(args) => offline::replay(args),
        other => {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("error: cannot start the async runtime: {e}");
                    return ExitCode::from(exit::INPUT);
                }
            };
            runtime.block_on(async move {
                match other {
                    Command::Definitions(cmd) => offline::registered(cmd).await,
                    Command::Migrate(db) => ops::migrate(db).await,
                    Command::Worker(args) => ops::worker(args).await,
                    Command::Scheduler(args) => ops::scheduler(args).await,
                    Command::Enqueue(args) => ops::enqueue(args).await,
                    Command::Send(args) => ops::send(args).await,
                    Command::Resolve(args) => ops::resolve(args).await,
                    Command::Rerun(args) => ops::rerun(args).await,
                    Command::Cancel(args) => ops::cancel(args).await,
                    Command::Workers(args) => ops::workers(args).await,
                    Command::Limits(args) => ops::limits(args).await,
                    Command::Runs(cmd) => ops::runs(cmd).await,
                    Command::Why(args) => why::why(args).await,
                    Command::Brief(args) => brief::brief(args).await,
                    Command::Approvals(cmd) => approvals::approvals(cmd).await,
                    Command::Approve(args) => approvals::decide(args, true).await,
                    Command::Deny(args) => approvals::decide(args, false).await,
                    Command::Tokens(cmd) => tokens::tokens(cmd).await,
                    Command::Api(args) => api::serve(args).await,
                    Command::Openapi => api::print_document(),
                    Command::Demo(args) => demo::demo(args).await,
                    Command::Bench(args) => bench::bench(args).await,
                    Command::Chaos(args) => chaos::chaos(args).await,
                    Command::Retention(cmd) => retention::retention(cmd).await,
                    Command::Replay(_) => exit::INPUT,
                }
            })
        }
    };
    telemetry::flush_traces();
    ExitCode::from(code)
}

/// Logs to stderr: JSON lines for long-running roles unless on a terminal.
pub fn init_logging(json: bool) {
    init_logging_at(json, "info,sqlx=warn");
}

/// Like [`init_logging`] with another default filter (`REIN_LOG` still wins). `json` asks
/// for JSON lines, which a terminal gets in human format instead; `REIN_LOG_FORMAT=json` or
/// `text` decides outright.
pub fn init_logging_at(json: bool, default_filter: &str) {
    use tracing_subscriber::EnvFilter;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let json = match std::env::var("REIN_LOG_FORMAT").as_deref() {
        Ok("json") => true,
        Ok("text") => false,
        _ => json && !std::io::IsTerminal::is_terminal(&std::io::stderr()),
    };
    let filter =
        EnvFilter::try_from_env("REIN_LOG").unwrap_or_else(|_| EnvFilter::new(default_filter));
    let fmt_json = json.then(|| {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
    });
    let fmt_text = (!json).then(|| tracing_subscriber::fmt::layer().with_writer(std::io::stderr));
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(fmt_json)
        .with(fmt_text)
        .with(telemetry::otel_layer())
        .try_init();
}
