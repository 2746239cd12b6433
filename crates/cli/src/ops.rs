//! Commands against the database: roles (worker, scheduler) and operator commands.

use rein_scheduler::{Scheduler, SchedulerConfig};
use rein_store::{EnqueueRequest, SendOutcome, Store, StoreError};
use rein_worker::{Worker, WorkerConfig};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::{DbArgs, exit, init_logging};

#[derive(clap::Args)]
pub struct WorkerArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Runs driven at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    #[arg(long, default_value_t = 10_000)]
    lease_ttl_ms: u64,
    #[arg(long, default_value_t = 16)]
    claim_batch: u32,
    #[arg(long, default_value_t = 100)]
    poll_interval_ms: u64,
    /// Grace period for in-flight actions after SIGTERM.
    #[arg(long, default_value_t = 10_000)]
    shutdown_grace_ms: u64,
    /// Worker id (default: host-pid).
    #[arg(long)]
    id: Option<String>,
    /// Commit one run per statement instead of grouping.
    #[arg(long)]
    no_commit_batching: bool,
    /// Queues to claim from (repeat or comma-separate).
    #[arg(long, value_delimiter = ',', default_value = "default")]
    queue: Vec<String>,
}

#[derive(clap::Args)]
pub struct SchedulerArgs {
    #[command(flatten)]
    db: DbArgs,
    #[arg(long, default_value_t = 200)]
    tick_ms: u64,
    #[arg(long)]
    id: Option<String>,
}

#[derive(clap::Args)]
pub struct EnqueueArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Definition name (registered in the database).
    #[arg(long)]
    definition: String,
    /// Definition version (default: newest).
    #[arg(long = "definition-version")]
    definition_version: Option<u32>,
    /// Run input as JSON.
    #[arg(long, default_value = "{}")]
    input: String,
    /// Client idempotency key: the same key returns the same run.
    #[arg(long)]
    key: Option<String>,
    #[arg(long, default_value_t = 0)]
    priority: i32,
    #[arg(long, default_value = "default")]
    queue: String,
}

#[derive(clap::Args)]
pub struct SendArgs {
    #[command(flatten)]
    db: DbArgs,
    run: Uuid,
    event: String,
    #[arg(long, default_value = "{}")]
    payload: String,
    /// Who sends it (recorded with the event).
    #[arg(long, default_value = "cli")]
    sender: String,
}

#[derive(clap::Args)]
pub struct RerunArgs {
    #[command(flatten)]
    db: DbArgs,
    /// A finished run; the new run gets its definition version, input, queue and priority.
    run: Uuid,
}

#[derive(clap::Args)]
pub struct CancelArgs {
    #[command(flatten)]
    db: DbArgs,
    run: Uuid,
    /// Why (recorded as the run's terminal reason).
    #[arg(long)]
    reason: String,
    /// Who cancels it.
    #[arg(long = "as", env = "REIN_OPERATOR", default_value = "cli")]
    by: String,
}

#[derive(clap::Args)]
pub struct WorkersArgs {
    #[command(flatten)]
    db: DbArgs,
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum Resolution {
    /// The call took effect: commit its result event (`--event`, a call result).
    Applied,
    /// The call did not take effect: the step may be dispatched again with the same key.
    NotApplied,
}

#[derive(clap::Args)]
pub struct ResolveArgs {
    #[command(flatten)]
    db: DbArgs,
    run: Uuid,
    /// What the operator found out about the run's open call.
    #[arg(value_enum)]
    resolution: Resolution,
    /// For `applied`: the call's result event (one of the definition's call results).
    #[arg(long)]
    event: Option<String>,
    /// For `applied`: the result event's payload, as JSON.
    #[arg(long, default_value = "{}")]
    payload: String,
    /// Who resolves it (recorded with the event).
    #[arg(long = "as", env = "REIN_OPERATOR")]
    by: String,
}

#[derive(clap::Subcommand)]
pub enum RunsCommand {
    /// One run: state, status, sequence, attempt, lease.
    Show {
        #[command(flatten)]
        db: DbArgs,
        run: Uuid,
        #[arg(long)]
        json: bool,
    },
    /// The run's events in order, with fencing token and worker.
    History {
        #[command(flatten)]
        db: DbArgs,
        run: Uuid,
        #[arg(long)]
        json: bool,
    },
    /// Recent runs, optionally filtered.
    List {
        #[command(flatten)]
        db: DbArgs,
        #[arg(long)]
        status: Option<String>,
        #[arg(long)]
        definition: Option<String>,
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i64).range(1..=1000))]
        limit: i64,
        #[arg(long)]
        json: bool,
    },
    /// Replay the run's log and compare it with the stored projection.
    Verify {
        #[command(flatten)]
        db: DbArgs,
        run: Uuid,
    },
}

/// Connects (and migrates when `migrate`), mapping failures to exit codes.
pub async fn connect(db: &DbArgs, migrate: bool) -> Result<Store, u8> {
    let Some(url) = db.database_url.as_deref() else {
        eprintln!(
            "error: no database: set DATABASE_URL or pass --database-url (or run `rein demo`, which starts its own)"
        );
        return Err(exit::INPUT);
    };
    let store = match Store::connect_without_migrating(url, db.db_pool_max).await {
        Ok(s) => s,
        Err(e) => return Err(report(&e)),
    };
    let checked = if migrate {
        store.migrate().await
    } else {
        store.check_schema().await
    };
    match checked {
        Ok(()) => Ok(store),
        Err(e) => Err(report(&e)),
    }
}

/// How many of `events` (type, count) have one of `names` as their type.
pub fn events_of(events: &[(String, i64)], names: &[&str]) -> i64 {
    events
        .iter()
        .filter(|e| names.contains(&e.0.as_str()))
        .map(|e| e.1)
        .sum()
}

/// Prints an error and picks the exit code for it.
pub fn report(e: &StoreError) -> u8 {
    eprintln!("error: {e}");
    match e {
        StoreError::Unreachable(_)
        | StoreError::SchemaMismatch(_)
        | StoreError::Migrate(_)
        | StoreError::BadUrl(_) => exit::DATABASE,
        StoreError::InvalidTransition(_) => exit::REFUSED,
        StoreError::Db(_) | StoreError::Corrupt(_) => exit::DATABASE,
        _ => exit::INPUT,
    }
}

fn parse_json(what: &str, text: &str) -> Result<Value, u8> {
    serde_json::from_str(text).map_err(|e| {
        eprintln!("error: {what} is not valid JSON: {e}");
        exit::INPUT
    })
}

/// `rein definitions register FILE`: validates the file and stores it as a new version.
pub async fn register_definition(file: &str, db: DbArgs) -> u8 {
    let def = match crate::offline::load_definition(file) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::INPUT;
        }
    };
    let store = match connect(&db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    match store.register_definition(&def).await {
        Ok(true) => {
            println!("registered {} v{}", def.name(), def.version());
            exit::OK
        }
        Ok(false) => {
            println!(
                "{} v{} is already registered with this body; nothing changed",
                def.name(),
                def.version()
            );
            exit::OK
        }
        Err(e @ StoreError::DefinitionConflict { .. }) => {
            eprintln!("error: {e}");
            exit::REFUSED
        }
        Err(e) => report(&e),
    }
}

pub async fn migrate(db: DbArgs) -> u8 {
    match connect(&db, true).await {
        Ok(_) => {
            println!("migrations applied");
            exit::OK
        }
        Err(code) => code,
    }
}

fn default_id(role: &str) -> String {
    let host = std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "host".into());
    format!("{role}-{}-{}", host.trim(), std::process::id())
}

/// A token cancelled by SIGTERM or SIGINT.
pub fn shutdown_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let t = token.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        t.cancel();
    });
    token
}

pub async fn worker(args: WorkerArgs) -> u8 {
    init_logging(true);
    let store = match connect(&args.db, true).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let mut config = WorkerConfig::new(args.id.unwrap_or_else(|| default_id("worker")));
    config.concurrency = args.concurrency;
    config.lease_ttl_ms = args.lease_ttl_ms;
    config.claim_batch = args.claim_batch;
    config.poll_interval_ms = args.poll_interval_ms;
    config.shutdown_grace_ms = args.shutdown_grace_ms;
    config.commit_batching = !args.no_commit_batching;
    config.queues = args.queue;
    if let Err(e) = config.validate() {
        eprintln!("error: {e}");
        return exit::INPUT;
    }
    let registry = rein_worker::builtin_registry(store.clone());
    let worker = Worker::new(store, config, registry);
    match worker.run(shutdown_signal()).await {
        Ok(()) => exit::OK,
        Err(e) => report(&e),
    }
}

pub async fn scheduler(args: SchedulerArgs) -> u8 {
    init_logging(true);
    let store = match connect(&args.db, true).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let mut config = SchedulerConfig::new(args.id.unwrap_or_else(|| default_id("scheduler")));
    config.tick_ms = args.tick_ms.clamp(10, 60_000);
    let mut scheduler = Scheduler::new(store, config);
    match scheduler.run(shutdown_signal()).await {
        Ok(()) => exit::OK,
        Err(e) => report(&e),
    }
}

pub async fn enqueue(args: EnqueueArgs) -> u8 {
    let input = match parse_json("--input", &args.input) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let store = match connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let def = match store
        .load_definition(&args.definition, args.definition_version)
        .await
    {
        Ok(d) => d,
        Err(e) => return report(&e),
    };
    let mut request = EnqueueRequest::new(def, input);
    request.client_key = args.key;
    request.priority = args.priority;
    request.queue = args.queue;
    match store.enqueue(request).await {
        Ok(e) => {
            println!("{}", e.run_id);
            exit::OK
        }
        Err(e) => report(&e),
    }
}

pub async fn send(args: SendArgs) -> u8 {
    let payload = match parse_json("--payload", &args.payload) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let store = match connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    match store
        .send(
            args.run,
            &args.event,
            payload,
            &args.sender,
            rein_store::INBOX_TTL_MS_DEFAULT,
        )
        .await
    {
        Ok(SendOutcome::Applied { sequence }) => {
            println!("applied at sequence {sequence}");
            exit::OK
        }
        Ok(SendOutcome::Queued { inbox_id }) => {
            println!("queued in the run's inbox (entry {inbox_id}); the lease holder applies it");
            exit::OK
        }
        Err(e) => report(&e),
    }
}

/// `rein rerun RUN`: a new run like a finished one, linked to it (SPEC E6).
pub async fn rerun(args: RerunArgs) -> u8 {
    let store = match connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    match store.rerun(args.run).await {
        Ok(run) => {
            println!("{run}");
            exit::OK
        }
        Err(StoreError::Invalid(m)) => {
            eprintln!("error: {m}");
            exit::REFUSED
        }
        Err(e) => report(&e),
    }
}

/// `rein cancel RUN --reason R`: sends CANCEL with the reason (SPEC M8).
pub async fn cancel(args: CancelArgs) -> u8 {
    if args.reason.trim().is_empty() || args.reason.len() > 1024 {
        eprintln!("error: --reason must say why, in 1..=1024 bytes");
        return exit::INPUT;
    }
    let store = match connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    match store
        .send(
            args.run,
            "CANCEL",
            json!({ "reason": args.reason, "by": args.by }),
            &args.by,
            rein_store::INBOX_TTL_MS_DEFAULT,
        )
        .await
    {
        Ok(SendOutcome::Applied { sequence }) => {
            println!("cancelled at sequence {sequence}");
            exit::OK
        }
        Ok(SendOutcome::Queued { .. }) => {
            println!("cancel queued: the worker holding the run stops its action and applies it");
            exit::OK
        }
        Err(e) => report(&e),
    }
}

/// `rein workers`: who is alive and what they hold, by the database clock.
pub async fn workers(args: WorkersArgs) -> u8 {
    let store = match connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let members = match store.members().await {
        Ok(m) => m,
        Err(e) => return report(&e),
    };
    if args.json {
        println!("{}", json!(members));
        return exit::OK;
    }
    println!(
        "{:<40} {:<10} {:>14} {:>7}  started",
        "id", "role", "last heard", "leases"
    );
    for m in members {
        println!(
            "{:<40} {:<10} {:>12.1} s {:>7}  {}",
            m.worker_id,
            m.role,
            m.silent_ms / 1000.0,
            m.leases_held,
            m.started_at.format("%Y-%m-%d %H:%M:%S")
        );
    }
    exit::OK
}

/// Settles a run's in-doubt call by hand (SPEC M9, X7): the operator says whether it took
/// effect, and the run moves on.
pub async fn resolve(args: ResolveArgs) -> u8 {
    if args.by.trim().is_empty() || args.by.len() > 256 {
        eprintln!("error: --as must name who resolves the call (1..=256 bytes)");
        return exit::INPUT;
    }
    let mut payload = match parse_json("--payload", &args.payload) {
        Ok(Value::Object(map)) => Value::Object(map),
        Ok(_) => {
            eprintln!("error: --payload must be a JSON object");
            return exit::INPUT;
        }
        Err(code) => return code,
    };
    let store = match connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let row = match store.run(args.run).await {
        Ok(r) => r,
        Err(e) => return report(&e),
    };
    let Some(call_id) = row.projection.pending_call().map(str::to_owned) else {
        eprintln!(
            "error: run {} has no open call to resolve (state {}, status {})",
            args.run, row.state, row.status
        );
        return exit::REFUSED;
    };
    let sender = format!("operator:{}", args.by);
    let event = match (args.resolution, args.event.as_deref()) {
        (Resolution::NotApplied, None) => {
            payload = json!({ "call_id": call_id, "by": sender });
            "ACTION_NOT_APPLIED".to_owned()
        }
        (Resolution::NotApplied, Some(_)) => {
            eprintln!("error: `not-applied` takes no --event");
            return exit::INPUT;
        }
        (Resolution::Applied, None) => {
            eprintln!(
                "error: `applied` needs --event naming the call's result (e.g. TOOL_SUCCEEDED)"
            );
            return exit::INPUT;
        }
        (Resolution::Applied, Some(event)) => {
            payload["call_id"] = json!(call_id);
            payload["resolved_by"] = json!(sender);
            event.to_owned()
        }
    };
    match store
        .send(
            args.run,
            &event,
            payload,
            &sender,
            rein_store::INBOX_TTL_MS_DEFAULT,
        )
        .await
    {
        Ok(_) => {
            println!(
                "resolved call {call_id} of run {}: committed {event}",
                args.run
            );
            exit::OK
        }
        Err(e) => report(&e),
    }
}

pub fn run_json(row: &rein_store::RunRow) -> Value {
    json!({
        "run_id": row.run_id,
        "definition": row.definition,
        "version": row.version,
        "status": row.status,
        "state": row.state,
        "sequence": row.last_sequence,
        "attempt": row.projection.attempt,
        "steps_completed": row.projection.steps_completed,
        "pending_action": row.projection.action,
        "terminal_reason": row.terminal_reason,
        "lease": {
            "worker": row.lease_owner,
            "token": row.fencing_token,
            "until": row.lease_until,
            "live": row.lease_live,
        },
        "wake_at": row.wake_at,
        "created_at": row.created_at,
        "updated_at": row.updated_at,
        "state_entered_at": row.state_entered_at,
        "data": row.projection.data,
    })
}

pub async fn runs(cmd: RunsCommand) -> u8 {
    match cmd {
        RunsCommand::Show { db, run, json } => {
            let store = match connect(&db, false).await {
                Ok(s) => s,
                Err(code) => return code,
            };
            match store.run(run).await {
                Ok(row) => {
                    if json {
                        println!("{}", run_json(&row));
                    } else {
                        println!("run         {}", row.run_id);
                        println!("definition  {} v{}", row.definition, row.version);
                        println!("state       {} ({})", row.state, row.status);
                        println!("sequence    {}", row.last_sequence);
                        println!("attempt     {}", row.projection.attempt);
                        match (&row.lease_owner, row.lease_until) {
                            (Some(w), Some(u)) => println!(
                                "lease       {w} token {} until {u}{}",
                                row.fencing_token,
                                if row.lease_live { "" } else { " (expired)" }
                            ),
                            _ => println!("lease       none (token {})", row.fencing_token),
                        }
                        if let Some(reason) = &row.terminal_reason {
                            println!("reason      {reason}");
                        }
                    }
                    exit::OK
                }
                Err(e) => report(&e),
            }
        }
        RunsCommand::History { db, run, json } => {
            let store = match connect(&db, false).await {
                Ok(s) => s,
                Err(code) => return code,
            };
            match store.history(run).await {
                Ok(events) => {
                    if json {
                        println!(
                            "{}",
                            serde_json::to_string(&events).unwrap_or_else(|_| "[]".into())
                        );
                    } else {
                        println!(
                            "{:>5}  {:<26}  {:>5}  {:<28}  occurred_at",
                            "seq", "type", "token", "worker"
                        );
                        for e in events {
                            println!(
                                "{:>5}  {:<26}  {:>5}  {:<28}  {}",
                                e.sequence, e.kind, e.token, e.worker, e.occurred_at
                            );
                        }
                    }
                    exit::OK
                }
                Err(e) => report(&e),
            }
        }
        RunsCommand::List {
            db,
            status,
            definition,
            limit,
            json,
        } => {
            let store = match connect(&db, false).await {
                Ok(s) => s,
                Err(code) => return code,
            };
            match store
                .list_runs(status.as_deref(), definition.as_deref(), limit)
                .await
            {
                Ok(rows) => {
                    if json {
                        let list: Vec<Value> = rows.iter().map(run_json).collect();
                        println!("{}", Value::Array(list));
                    } else {
                        println!(
                            "{:<36}  {:<15}  {:<18}  {:<15}  {:>4}",
                            "run", "definition", "state", "status", "seq"
                        );
                        for r in rows {
                            println!(
                                "{:<36}  {:<15}  {:<18}  {:<15}  {:>4}",
                                r.run_id, r.definition, r.state, r.status, r.last_sequence
                            );
                        }
                    }
                    exit::OK
                }
                Err(e) => report(&e),
            }
        }
        RunsCommand::Verify { db, run } => {
            let store = match connect(&db, false).await {
                Ok(s) => s,
                Err(code) => return code,
            };
            match store.verify_run(run).await {
                Ok(None) => {
                    println!("ok: the log replays to the stored projection");
                    exit::OK
                }
                Ok(Some(problem)) => {
                    eprintln!("integrity error: {problem}");
                    exit::REFUSED
                }
                Err(e) => report(&e),
            }
        }
    }
}
