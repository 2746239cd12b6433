//! `rein`: one binary, every role. `rein worker`, `rein scheduler`, `rein demo`, and the
//! operator and offline commands.

mod approvals;
mod blobs;
mod brief;
mod commands;
mod moves;
mod offline;
mod print;
mod remote;
mod retention;
mod tokens;
mod watch;
mod webhooks;
mod whatif;
mod why;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use rein_lab::{bench, chaos, demo};
use rein_process::exit;

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

#[derive(Subcommand)]
enum Command {
    /// Validate, show and list state-machine definitions.
    #[command(subcommand)]
    Definitions(offline::DefinitionsCommand),
    /// Re-reduce an events file offline, or replay a stored run (or every run of a
    /// definition) on another definition and show where it would decide differently
    /// (changes nothing).
    Replay(whatif::ReplayArgs),
    /// Apply database migrations: the expand steps (safe while older releases run), or with
    /// --contract the contract steps, once no live member predates them.
    Migrate(commands::MigrateSchemaArgs),
    /// Run a worker: claims runs and executes their node actions.
    Worker(commands::WorkerArgs),
    /// Run a scheduler: fires timers and recovers expired leases.
    Scheduler(commands::SchedulerArgs),
    /// Create a run; prints its id (with --wait, follows it to its end).
    Enqueue(commands::EnqueueArgs),
    /// Send an event to a run (reply, approval, cancel).
    Send(commands::SendArgs),
    /// Settle a run's in-doubt call by hand: `applied` (with its result event) or
    /// `not-applied` (the step is dispatched again with the same idempotency key).
    Resolve(commands::ResolveArgs),
    /// Start a new run like a finished one (same definition version, input, queue), linked
    /// to it.
    Rerun(commands::RerunArgs),
    /// Start a new run from a run's state at a sequence of its log, optionally on another
    /// version or with patched data; the source is never changed.
    Fork(moves::ForkArgs),
    /// Cancel a run, with a reason.
    Cancel(commands::CancelArgs),
    /// Live workers and schedulers: last heartbeat and leases held (one silent for longer
    /// than its lease TTL is gone).
    Workers(commands::WorkersArgs),
    /// Fleet-wide limits in Redis: how far ahead each rate is booked, deferrals, slot holders.
    Limits(commands::LimitsArgs),
    /// Inspect runs.
    #[command(subcommand)]
    Runs(commands::RunsCommand),
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
    /// Large payload values stored once by content hash: read one back, or count them.
    #[command(subcommand)]
    Blobs(blobs::BlobsCommand),
    /// Manage API bearer tokens.
    #[command(subcommand)]
    Tokens(tokens::TokensCommand),
    /// Signed webhook notifications of approvals and runs' ends to outside systems.
    #[command(subcommand)]
    Webhooks(webhooks::WebhooksCommand),
    /// Serve the HTTP API (JSON, OpenAPI document at /openapi.json).
    Api(rein_api::ApiArgs),
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
    /// Print a shell completion script: `source <(rein completions bash)`, or save it where
    /// your shell loads completions from (see README).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// A stand-in OpenAI-compatible model server for tests and the demo.
    #[command(hide = true)]
    StandInModel(rein_lab::model_standin::StandInArgs),
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
                | Command::StandInModel(_)
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

/// Writes `shell`'s completion script for every command and flag, generated from the same
/// definitions clap parses with, so it cannot drift from the binary.
fn completions(shell: clap_complete::Shell) -> u8 {
    let mut command = <Cli as clap::CommandFactory>::command();
    clap_complete::generate(shell, &mut command, "rein", &mut std::io::stdout());
    exit::OK
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
        Command::Replay(args) if !args.needs_database() => offline::replay(args.offline()),
        Command::Completions { shell } => completions(shell),
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
                    Command::Migrate(args) => commands::migrate(args).await,
                    Command::Worker(args) => commands::worker(args).await,
                    Command::Scheduler(args) => commands::scheduler(args).await,
                    Command::Enqueue(args) => commands::enqueue(args).await,
                    Command::Send(args) => commands::send(args).await,
                    Command::Resolve(args) => commands::resolve(args).await,
                    Command::Rerun(args) => commands::rerun(args).await,
                    Command::Fork(args) => moves::fork(args).await,
                    Command::Cancel(args) => commands::cancel(args).await,
                    Command::Workers(args) => commands::workers(args).await,
                    Command::Limits(args) => commands::limits(args).await,
                    Command::Runs(cmd) => commands::runs(cmd).await,
                    Command::Why(args) => why::why(args).await,
                    Command::Brief(args) => brief::brief(args).await,
                    Command::Approvals(cmd) => approvals::approvals(cmd).await,
                    Command::Approve(args) => approvals::decide(args, true).await,
                    Command::Deny(args) => approvals::decide(args, false).await,
                    Command::Blobs(cmd) => blobs::blobs(cmd).await,
                    Command::Tokens(cmd) => tokens::tokens(cmd).await,
                    Command::Webhooks(cmd) => webhooks::webhooks(cmd).await,
                    Command::Api(args) => rein_api::serve(args).await,
                    Command::Openapi => commands::openapi(),
                    Command::Demo(args) => demo::demo(args).await,
                    Command::Bench(args) => bench::bench(args).await,
                    Command::Chaos(args) => chaos::chaos(args).await,
                    Command::Retention(cmd) => retention::retention(cmd).await,
                    Command::StandInModel(args) => {
                        rein_lab::model_standin::stand_in_model(args).await
                    }
                    Command::Replay(args) => whatif::replay(args).await,
                    Command::Completions { .. } => exit::INPUT,
                }
            })
        }
    };
    rein_process::telemetry::flush_traces();
    ExitCode::from(code)
}
