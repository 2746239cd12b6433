//! Commands against the database: roles (worker, scheduler) and operator commands.

use rein_core::RunStatus;
use rein_scheduler::{Scheduler, SchedulerConfig};
use rein_store::RunFilter;
use rein_worker::{Worker, WorkerConfig};
use serde_json::{Value, json};
use uuid::Uuid;

use rein_ops::recovery::ResolveBody;
use rein_ops::service::EnqueueBody;
use rein_process::{DbArgs, RedisArgs, connect, exit, init_logging, open, report, shutdown_signal};

use crate::print::{
    answer, cell, fail, print_history_header, print_history_row, print_json, printable, short_time,
    text,
};
use crate::remote::{ApiConn, Backend, Conn};

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
    /// When busy (its last claim got all it asked for), wait up to this long for a claim
    /// batch of free slots (or half the slots, when that is fewer) before claiming, so a
    /// claim takes many runs at once; 0 claims as soon as one slot is free.
    #[arg(long, default_value_t = rein_worker::CLAIM_GATHER_MS_DEFAULT,
          value_parser = clap::value_parser!(u64).range(0..=10_000))]
    claim_gather_ms: u64,
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
    /// Serve Prometheus `/metrics`, `/healthz` and `/readyz` on this address.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    #[command(flatten)]
    redis: RedisArgs,
    /// A fleet-wide limit on actions, KEY=SPEC (repeat): `tool:search=10/s,burst=2`,
    /// `model:gpt-x=60/min`, `action:charge=concurrency=4`. Keys: `action:NAME` and
    /// `tool:NAME` implicitly, or those a state lists in `limits`. Overrides the definition's
    /// value for the key. Kept in Redis (--redis-url); without it, applied per process.
    #[arg(long = "limit", value_name = "KEY=SPEC", value_parser = parse_limit)]
    limit: Vec<(String, rein_core::LimitSpec)>,
    /// Longest an action waits in process for its limits before the run is handed back
    /// (ACTION_DEFERRED) until they allow it.
    #[arg(long, default_value_t = 2_000, value_parser = clap::value_parser!(u64).range(0..=60_000))]
    limit_wait_max_ms: u64,
    /// Where http nodes may connect (repeat or comma-separate): `api.example.com`,
    /// `api.example.com:8443`, `*.example.com`, `10.1.2.3`, `[fd00::1]:80`, `10.0.0.0/8`.
    /// Absent: anywhere but link-local and cloud metadata addresses and this worker's
    /// database and Redis, which only an entry naming them exactly opens.
    #[arg(long, env = "REIN_HTTP_ALLOW", value_name = "HOST|HOST:PORT|CIDR",
          value_delimiter = ',', value_parser = rein_worker::egress::Allow::parse)]
    http_allow: Vec<rein_worker::egress::Allow>,
    /// Quote the first 512 bytes of an http node's error reply in the error event, which
    /// every `read` token can see (off: only its status, type, length and hash).
    #[arg(long, env = "REIN_HTTP_QUOTE_ERROR_BODIES")]
    http_quote_error_bodies: bool,
    /// An environment variable a `model` state may name as its `api_key_env` (repeat or
    /// comma-separate); a --model-key binding allows its variable too. DATABASE_URL, REIN_*
    /// (but REIN_MODEL_KEY), AWS_*, GOOGLE_*, AZURE_* are refused whatever is listed. A key
    /// is sent only to the endpoints --model-key binds it to.
    #[arg(
        long = "model-key-env",
        value_name = "VAR",
        value_delimiter = ',',
        default_value = "OPENAI_API_KEY,REIN_MODEL_KEY"
    )]
    model_key_env: Vec<String>,
    #[command(flatten)]
    model_keys: rein_process::ModelKeyArgs,
}

/// `KEY=SPEC` of `--limit`.
fn parse_limit(text: &str) -> Result<(String, rein_core::LimitSpec), String> {
    let Some((key, spec)) = text.split_once('=') else {
        return Err("give KEY=SPEC, e.g. tool:search=10/s,burst=2".into());
    };
    if let Some(problem) = rein_core::limit_key_problem(key.trim()) {
        return Err(problem);
    }
    Ok((key.trim().to_owned(), rein_core::LimitSpec::parse(spec)?))
}

#[derive(clap::Args)]
pub struct SchedulerArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    redis: RedisArgs,
    #[arg(long, default_value_t = 200)]
    tick_ms: u64,
    #[arg(long)]
    id: Option<String>,
    /// Serve Prometheus `/metrics` (with the fleet gauges read from the database),
    /// `/healthz` and `/readyz` on this address.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Leader lease TTL: only the leading scheduler scans; another takes over within about
    /// this long when it dies.
    #[arg(long, default_value_t = rein_scheduler::LEADER_TTL_MS_DEFAULT)]
    leader_ttl_ms: u64,
    /// How often to look for due webhook deliveries when none was due (every scheduler
    /// delivers, leader or not).
    #[arg(long, value_name = "MS", default_value_t = 500,
          value_parser = clap::value_parser!(u64).range(10..=60_000))]
    webhook_poll_interval_ms: u64,
    /// Attempts at a webhook delivery before it is failed (backoff 1 s doubling, at most
    /// 10 minutes apart).
    #[arg(long, value_name = "N", default_value_t = 10,
          value_parser = clap::value_parser!(u32).range(1..=rein_scheduler::webhooks::ATTEMPTS_MAX_LIMIT as i64))]
    webhook_attempts_max: u32,
    /// Most posts in flight to one webhook at a time (of the scheduler's 16): its further
    /// due deliveries wait, so a receiver that hangs leaves slots to the others.
    #[arg(long, value_name = "N", default_value_t = rein_scheduler::webhooks::PER_WEBHOOK_DEFAULT,
          value_parser = clap::value_parser!(i64).range(1..=1000))]
    webhook_posts_per_webhook: i64,
    #[command(flatten)]
    webhook_egress: crate::webhooks::WebhookAllowArgs,
}

#[derive(clap::Args)]
pub struct EnqueueArgs {
    #[command(flatten)]
    conn: Conn,
    /// Definition name (registered in the database).
    #[arg(long)]
    definition: String,
    /// Definition version (default: the name's current version, `rein definitions list`
    /// marks it).
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
    /// Queue (default `default`; through the API with a token bound to queues, the first of
    /// them).
    #[arg(long)]
    queue: Option<String>,
    /// Who enqueues it, recorded with the run (through the API, the token's subject is).
    #[arg(long = "as", value_name = "NAME", env = "REIN_OPERATOR", default_value = rein_store::OPERATOR)]
    by: String,
    /// Print `{"run_id", "created"}` instead of the id alone (with --wait, and `end`: how
    /// the run ended).
    #[arg(long)]
    json: bool,
    /// Then follow the run to its end and print how it ended; exit 0 when it succeeded, 5
    /// when it failed or was cancelled (as `rein runs watch`).
    #[arg(long)]
    wait: bool,
    /// With --wait: give up after this many seconds, saying the run is still going (exit 6).
    #[arg(long, value_name = "SECS", requires = "wait",
          value_parser = clap::value_parser!(u64).range(1..=crate::watch::TIMEOUT_S_MAX))]
    timeout: Option<u64>,
}

#[derive(clap::Args)]
pub struct SendArgs {
    #[command(flatten)]
    conn: Conn,
    run: Uuid,
    event: String,
    #[arg(long, default_value = "{}")]
    payload: String,
    /// Who sends it (recorded with the event; through the API, the token's subject is).
    #[arg(
        long = "as",
        alias = "sender",
        env = "REIN_OPERATOR",
        default_value = "cli"
    )]
    sender: String,
    /// Idempotency key: sending again with the same key returns what became of the first
    /// send instead of applying the event twice.
    #[arg(long)]
    key: Option<String>,
    /// Print `{"outcome", "sequence", "inbox_id"}`.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct RerunArgs {
    #[command(flatten)]
    conn: Conn,
    /// A finished run; the new run gets its definition version, input, queue and priority.
    run: Uuid,
    /// Who enqueues the new run, recorded with it (through the API, the token's subject is).
    #[arg(long = "as", value_name = "NAME", env = "REIN_OPERATOR", default_value = rein_store::OPERATOR)]
    by: String,
    /// Print `{"run_id", "parent_run_id"}` instead of the new id alone.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct CancelArgs {
    #[command(flatten)]
    conn: Conn,
    run: Uuid,
    /// Why (recorded as the run's terminal reason).
    #[arg(long)]
    reason: String,
    /// Who cancels it.
    #[arg(long = "as", env = "REIN_OPERATOR", default_value = "cli")]
    by: String,
    /// Print `{"outcome", "sequence", "inbox_id"}`.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct WorkersArgs {
    #[command(flatten)]
    conn: Conn,
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct LimitsArgs {
    /// Keys to show (default: every key with entries under the prefix, at most 1000).
    keys: Vec<String>,
    #[command(flatten)]
    redis: RedisArgs,
    #[command(flatten)]
    api: ApiConn,
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
    conn: Conn,
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
    /// Who resolves it (recorded with the event; through the API, the token's subject is).
    #[arg(long = "as", env = "REIN_OPERATOR")]
    by: String,
    /// The committed settlement as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Subcommand)]
pub enum RunsCommand {
    /// One run: state, status, sequence, attempt, lease.
    Show {
        #[command(flatten)]
        conn: Conn,
        run: Uuid,
        #[arg(long)]
        json: bool,
    },
    /// What the run's model calls used, by model: calls, input, output, reasoning and
    /// cached tokens, and cost where the model has a price.
    Usage {
        #[command(flatten)]
        conn: Conn,
        run: Uuid,
        #[arg(long)]
        json: bool,
    },
    /// The run's events in order, with fencing token and worker.
    History {
        #[command(flatten)]
        conn: Conn,
        run: Uuid,
        #[arg(long)]
        json: bool,
    },
    /// Runs, newest first, optionally filtered; the next page's cursor goes to stderr.
    List {
        #[command(flatten)]
        conn: Conn,
        /// Only runs with this status.
        #[arg(long, value_parser = run_status_parser())]
        status: Option<String>,
        #[arg(long)]
        definition: Option<String>,
        /// Only runs created after this instant (RFC 3339).
        #[arg(long)]
        created_after: Option<chrono::DateTime<chrono::Utc>>,
        /// Only runs created before this instant (RFC 3339).
        #[arg(long)]
        created_before: Option<chrono::DateTime<chrono::Utc>>,
        /// Only runs in this state of their definition.
        #[arg(long)]
        state: Option<String>,
        /// Only runs in this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Only the branches (child runs) of this run.
        #[arg(long, value_name = "RUN")]
        parent: Option<Uuid>,
        /// Continue after a previous page (the cursor it printed).
        #[arg(long)]
        cursor: Option<String>,
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i64).range(1..=1000))]
        limit: i64,
        /// With `--json`, each run with its `data` (a list leaves the business data out).
        #[arg(long)]
        data: bool,
        #[arg(long)]
        json: bool,
    },
    /// Follow a run to its end: each committed event as a row of `runs history` (and, on a
    /// terminal, a model's tokens as they stream in); exits 0 when it succeeded, 5 when it
    /// failed or was cancelled, 6 when --timeout passed first.
    Watch(crate::watch::WatchArgs),
    /// Replay the run's log and compare it with the stored projection.
    Verify {
        #[command(flatten)]
        conn: Conn,
        run: Uuid,
        /// The verdict as JSON (`ok`, and the `problem` when there is one); the exit code
        /// is the same.
        #[arg(long)]
        json: bool,
    },
    /// Forget personal data: replace the named keys of the run's data by markers holding
    /// their hash, in its input, every event that carries them, its projection and
    /// checkpoints. Refused when the definition reads a key (the replay would then differ)
    /// or a worker holds the run; recorded with who and why. Of a finished run, the blobs
    /// only finished, redacted runs refer to are deleted. Also `POST /v1/runs/{id}/redact`.
    Redact {
        #[command(flatten)]
        db: rein_process::DbArgs,
        run: Uuid,
        /// Data keys to forget, comma-separated (e.g. `email,phone`).
        #[arg(long, value_delimiter = ',', required = true, value_name = "KEY,...")]
        fields: Vec<String>,
        /// Why (recorded with the redaction).
        #[arg(long)]
        reason: String,
        /// Who redacts.
        #[arg(long = "as", value_name = "NAME", env = "REIN_OPERATOR", default_value = rein_store::OPERATOR)]
        by: String,
        /// Print what `POST /v1/runs/{id}/redact` answers.
        #[arg(long)]
        json: bool,
    },
    /// List the keys of runs whose markers a redaction wrote before markers were keyed (a
    /// plain sha256 of the value, which a reader of the log can reverse for a guessable
    /// value such as a phone number). `rein runs redact RUN --fields KEY` with
    /// REIN_REDACTION_KEY set replaces them by keyed ones, and the key leaves this list.
    UnkeyedRedactions {
        #[command(flatten)]
        db: rein_process::DbArgs,
        /// Only this run's keys.
        #[arg(long)]
        run: Option<Uuid>,
        /// One JSON object per key (`run_id`, `field`, `redacted_at`), as an array.
        #[arg(long)]
        json: bool,
    },
}

/// `--status` takes exactly the statuses a run can have: anything else is a usage error
/// (exit 1) that lists them, not a filter that matches nothing.
fn run_status_parser() -> clap::builder::PossibleValuesParser {
    clap::builder::PossibleValuesParser::new(RunStatus::ALL.map(RunStatus::as_str))
}

/// Connects, mapping failures to exit codes. With `migrate` (roles that start work) the
/// schema is migrated only when it is missing or behind, so a database user that may not
/// change the schema starts against a current one; otherwise the schema must be current.
fn parse_json(what: &str, text: &str) -> Result<Value, u8> {
    serde_json::from_str(text).map_err(|e| {
        eprintln!("error: {what} is not valid JSON: {e}");
        exit::INPUT
    })
}

#[derive(clap::Args)]
pub struct MigrateSchemaArgs {
    #[command(flatten)]
    pub db: DbArgs,
    /// Also apply the contract steps: they take away what only older releases use, so they
    /// run only when no live worker, scheduler or API (as `rein workers` lists them) predates
    /// them; otherwise nothing is contracted and the members in the way are named (exit 2).
    #[arg(long)]
    pub contract: bool,
    /// With --contract: say what would be contracted and what is in the way; change nothing.
    #[arg(long, requires = "contract")]
    pub dry_run: bool,
    /// Print the contract plan as JSON.
    #[arg(long, requires = "contract")]
    pub json: bool,
}

pub async fn migrate(args: MigrateSchemaArgs) -> u8 {
    let store = match open(&args.db).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let permission = |e: &rein_store::StoreError| {
        eprintln!(
            "error: {e}\nthis database user may not change the schema: run `rein migrate` as the schema owner (rein_owner)"
        );
        exit::DATABASE
    };
    if !args.contract {
        return match store.migrate().await {
            Ok(()) => {
                println!("migrations applied");
                exit::OK
            }
            Err(e) if e.is_permission_denied() => permission(&e),
            Err(e) => report(&e),
        };
    }
    let plan = match store.contract(!args.dry_run).await {
        Ok(plan) => plan,
        Err(e) if e.is_permission_denied() => return permission(&e),
        Err(e) => return report(&e),
    };
    let code = if plan.blockers.is_empty() || plan.pending.is_empty() {
        exit::OK
    } else {
        exit::REFUSED
    };
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&plan).unwrap_or_default()
        );
        return code;
    }
    print!("{}", contract_report(&plan, args.dry_run));
    code
}

fn contract_report(plan: &rein_store::ContractPlan, dry_run: bool) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    if plan.pending.is_empty() {
        out.push_str("nothing to contract: every contract step this release ships is applied\n");
        return out;
    }
    let verb = if plan.applied {
        "contracted"
    } else if dry_run && plan.blockers.is_empty() {
        "would contract"
    } else {
        "not contracted"
    };
    for p in &plan.pending {
        let _ = writeln!(out, "{verb}: {} {}", p.version, p.description);
    }
    if !plan.blockers.is_empty() {
        let _ = writeln!(
            out,
            "{} live member(s) or connected process(es) predate these steps and may use what they remove:",
            plan.blockers.len()
        );
        for b in &plan.blockers {
            let schema = b.schema.map_or("older".to_owned(), |s| s.to_string());
            let seen = match b.silent_ms {
                Some(ms) => format!("heartbeat {:.1}s ago", ms / 1000.0),
                None => format!("{} connection(s) open now", b.connections),
            };
            let _ = writeln!(
                out,
                "  {:<40} {:<12} schema {schema:<16} {seen}",
                b.worker_id, b.role
            );
        }
        out.push_str(
            "upgrade or stop them (a member that died leaves `rein workers` when its heartbeat TTL \
             runs out; a connection's name holds its pid, `rein-PID`), then run \
             `rein migrate --contract` again\n",
        );
    }
    out
}

fn default_id(role: &str) -> String {
    let host = std::fs::read_to_string("/etc/hostname").unwrap_or_else(|_| "host".into());
    format!("{role}-{}-{}", host.trim(), std::process::id())
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
    config.claim_gather_ms = args.claim_gather_ms;
    config.poll_interval_ms = args.poll_interval_ms;
    config.shutdown_grace_ms = args.shutdown_grace_ms;
    config.commit_batching = !args.no_commit_batching;
    config.queues = args.queue;
    config.limits = args.limit.into_iter().collect();
    config.limit_wait_max_ms = args.limit_wait_max_ms;
    config.redis = args.redis.config();
    config.model_key_envs = args.model_key_env;
    // A binding allows its variable.
    for binding in &args.model_keys.model_key {
        if !config.model_key_envs.contains(&binding.name) {
            config.model_key_envs.push(binding.name.clone());
        }
    }
    config.model_keys = match args.model_keys.bindings() {
        Ok(keys) => keys,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::INPUT;
        }
    };
    if let Err(e) = config.validate() {
        eprintln!("error: {e}");
        return exit::INPUT;
    }
    let stop = shutdown_signal();
    let store = args.redis.publishing(store, &stop);
    let queues = config.queues.clone();
    if let Some(addr) = args.metrics_listen {
        rein_process::telemetry::install("worker");
        if let Err(code) =
            rein_api::metrics_endpoint::serve(addr, store.clone(), stop.clone()).await
        {
            return code;
        }
    }
    let mut egress = match rein_worker::egress::Policy::allowing(args.http_allow) {
        Ok(policy) => policy,
        Err(e) => {
            eprintln!("error: --http-allow: {e}");
            return exit::INPUT;
        }
    };
    if let Some(redis) = &config.redis {
        egress = egress.protect_url(rein_worker::egress::rule::REDIS, &redis.url, 6379);
    }
    if !egress.allow_list().is_empty() {
        let allowed: Vec<String> = egress.allow_list().iter().map(|a| a.to_string()).collect();
        tracing::info!(allow = %allowed.join(","), "http nodes may call only what --http-allow names");
    }
    let http = rein_worker::http::HttpOptions {
        egress,
        quote_error_bodies: args.http_quote_error_bodies,
    };
    let model = rein_worker::model::ModelOptions {
        key_envs: config.model_key_envs.clone(),
        default_base_url: args.model_keys.model_url(),
        keys: config.model_keys.clone(),
    };
    let registry = rein_worker::builtin_registry_full(store.clone(), http, model);
    let worker = Worker::new(store, config, registry);
    args.redis.subscribe(&worker, &queues, &stop);
    match worker.run(stop).await {
        Ok(()) => exit::OK,
        Err(e) => report(&e),
    }
}

pub async fn scheduler(args: SchedulerArgs) -> u8 {
    init_logging(true);
    let mut config = SchedulerConfig::new(args.id.unwrap_or_else(|| default_id("scheduler")));
    config.tick_ms = args.tick_ms.clamp(10, 60_000);
    config.leader_ttl_ms = args.leader_ttl_ms;
    if let Err(e) = config.validate() {
        eprintln!("error: {e}");
        return exit::INPUT;
    }
    let store = match connect(&args.db, true).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let stop = shutdown_signal();
    let store = args.redis.publishing(store, &stop);
    if let Some(addr) = args.metrics_listen {
        rein_process::telemetry::install("scheduler");
        if let Err(code) =
            rein_api::metrics_endpoint::serve(addr, store.clone(), stop.clone()).await
        {
            return code;
        }
        tokio::spawn(rein_process::telemetry::fleet_gauges(
            store.clone(),
            stop.clone(),
        ));
    }
    let egress = match args
        .webhook_egress
        .policy(&store, args.redis.redis_url.as_deref())
    {
        Ok(policy) => policy,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::INPUT;
        }
    };
    let webhooks = rein_scheduler::webhooks::WebhookConfig {
        poll_ms: args.webhook_poll_interval_ms,
        attempts_max: args.webhook_attempts_max,
        per_webhook: args.webhook_posts_per_webhook,
        egress: std::sync::Arc::new(egress),
        ..Default::default()
    };
    let delivering = tokio::spawn(rein_scheduler::webhooks::deliver(
        store.clone(),
        webhooks,
        stop.clone(),
    ));
    let mut scheduler = Scheduler::new(store, config);
    let ended = scheduler.run(stop.clone()).await;
    stop.cancel();
    // Posts in flight finish (each within its timeout); what is left stays claimed until its
    // claim runs out, and another scheduler delivers it.
    let _ = delivering.await;
    match ended {
        Ok(()) => exit::OK,
        Err(e) => report(&e),
    }
}

pub async fn enqueue(args: EnqueueArgs) -> u8 {
    let input = match parse_json("--input", &args.input) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    let body = EnqueueBody {
        definition: args.definition,
        version: args.definition_version,
        input,
        queue: args.queue,
        priority: Some(args.priority),
    };
    let done = backend.enqueue(body, args.key, &args.by).await;
    if !args.wait {
        return answer(done, args.json, |done| {
            println!("{}", text(done, "run_id"));
        });
    }
    let done = match done {
        Ok(done) => done,
        Err(e) => return fail(&e),
    };
    let Some(run) = done
        .get("run_id")
        .and_then(Value::as_str)
        .and_then(|id| id.parse::<Uuid>().ok())
    else {
        eprintln!("error: the enqueue answered no run id: {done}");
        return exit::DATABASE;
    };
    if !args.json {
        println!("{run}");
    }
    let timeout = args.timeout.map(std::time::Duration::from_secs);
    let watched = crate::watch::follow_run(
        &backend,
        run,
        &RedisArgs::default(),
        crate::watch::Show::Quiet,
        timeout,
    )
    .await;
    crate::watch::finish(&backend, run, watched, timeout, |end| {
        if args.json {
            let mut done = done.clone();
            done["end"] = json!(end);
            print_json(&done);
        } else {
            println!("{}", crate::watch::ended_line(end));
        }
    })
    .await
}

/// What a sent event became, for a person: `applied_msg` with its sequence, or queued.
fn say_sent(sent: &Value, applied_msg: &str, queued_msg: &str) {
    if text(sent, "outcome") == "applied" {
        println!("{applied_msg} at sequence {}", cell(sent, "sequence"));
    } else {
        println!("{queued_msg} (inbox entry {})", cell(sent, "inbox_id"));
    }
}

pub async fn send(args: SendArgs) -> u8 {
    let payload = match parse_json("--payload", &args.payload) {
        Ok(v) => v,
        Err(code) => return code,
    };
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    let sent = backend
        .send(
            args.run,
            (&args.event, payload),
            &args.sender,
            args.key.as_deref(),
        )
        .await;
    answer(sent, args.json, |sent| {
        say_sent(
            sent,
            "applied",
            "queued in the run's inbox; the lease holder applies it",
        )
    })
}

/// `rein rerun RUN`: a new run like a finished one, linked to it (SPEC E6).
pub async fn rerun(args: RerunArgs) -> u8 {
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    answer(backend.rerun(args.run, &args.by).await, args.json, |done| {
        println!("{}", text(done, "run_id"));
    })
}

/// `rein cancel RUN --reason R`: sends CANCEL with the reason (SPEC M8).
pub async fn cancel(args: CancelArgs) -> u8 {
    if args.reason.trim().is_empty() || args.reason.len() > 1024 {
        eprintln!("error: --reason must say why, in 1..=1024 bytes");
        return exit::INPUT;
    }
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    let payload = json!({ "reason": args.reason, "by": args.by });
    let sent = backend
        .send(args.run, ("CANCEL", payload), &args.by, None)
        .await;
    answer(sent, args.json, |sent| {
        say_sent(
            sent,
            "cancelled",
            "cancel queued: the worker holding the run stops its action and applies it",
        )
    })
}

/// `rein workers`: who is alive and what they hold, by the database clock.
/// `rein limits`: the fleet-wide limits' state in Redis (SPEC K1): how far ahead each rate
/// is booked, how far ahead deferred runs were sent, and who holds concurrency slots. Through
/// the API when REIN_URL is set, from Redis itself otherwise.
pub async fn limits(args: LimitsArgs) -> u8 {
    init_logging(false);
    // The keys are checked where the operation is defined (`rein_ops::recovery::limits`),
    // on either route.
    let (states, prefix) = match args.api.client() {
        Err(code) => return code,
        Ok(Some(client)) => (client.limits(&args.keys).await, None),
        Ok(None) => {
            let Some(config) = args.redis.config() else {
                eprintln!(
                    "error: give --redis-url (or REDIS_URL): fleet-wide limits live in Redis; without it each worker keeps its own"
                );
                return exit::INPUT;
            };
            let states = rein_ops::recovery::limits(&config, &args.keys).await;
            (states, Some(config.prefix))
        }
    };
    let states = match states {
        Ok(s) => s,
        Err(e) => return fail(&e),
    };
    if args.json {
        print_json(&json!(states));
        return exit::OK;
    }
    if states.is_empty() {
        match prefix {
            Some(prefix) => println!("no limit has entries in Redis under prefix `{prefix}`"),
            None => println!("no limit has entries in the API's Redis"),
        }
        return exit::OK;
    }
    println!(
        "{:<40} {:>12} {:>14} {:>6}  holders (expires in)",
        "key", "booked ahead", "deferred until", "slots"
    );
    for k in &states {
        let holders: Vec<String> = k
            .slots
            .iter()
            .take(3)
            .map(|s| format!("{} ({} ms)", s.holder, s.expires_in_ms))
            .collect();
        let more = k.slots.len().saturating_sub(3);
        println!(
            "{:<40} {:>9.0} ms {:>14} {:>6}  {}{}",
            k.key,
            k.booked_ahead_ms,
            k.deferred_until_ms
                .map_or("-".to_owned(), |ms| format!("+{ms:.0} ms")),
            k.slots.len(),
            holders.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        );
    }
    exit::OK
}

pub async fn workers(args: WorkersArgs) -> u8 {
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    let members = match backend.workers().await {
        Ok(m) => m,
        Err(e) => return crate::print::fail(&e),
    };
    if args.json {
        print_json(&members);
        return exit::OK;
    }
    println!(
        "{:<40} {:<18} {:>14} {:>7} {:>8} {:>14}  started",
        "id", "role", "last heard", "leases", "protocol", "schema"
    );
    for m in members.as_array().into_iter().flatten() {
        let silent_ms = m.get("silent_ms").and_then(Value::as_f64).unwrap_or(0.0);
        let leads = m.get("leader").and_then(Value::as_bool) == Some(true);
        let role = format!(
            "{}{}",
            text(m, "role"),
            if leads { " (leader)" } else { "" }
        );
        // A member that reports none predates protocols: it reads only protocol 1.
        let protocol = m["info"]["protocol"].as_u64().unwrap_or(1);
        // The newest migration it embeds: `rein migrate --contract` waits for every member
        // to embed the step it runs. One that reports none is of a release before that.
        let schema = m["info"]["schema"]
            .as_i64()
            .map_or_else(|| "older".to_owned(), |s| s.to_string());
        println!(
            "{:<40} {:<18} {:>12.1} s {:>7} {:>8} {:>14}  {}",
            text(m, "worker_id"),
            role,
            silent_ms / 1000.0,
            cell(m, "leases_held"),
            protocol,
            schema,
            short_time(text(m, "started_at"))
        );
        if let Some(keys) = m["info"]["model_keys"].as_object() {
            let said: Vec<String> = keys
                .iter()
                .map(|(name, urls)| {
                    let urls: Vec<&str> = urls
                        .as_array()
                        .into_iter()
                        .flatten()
                        .filter_map(Value::as_str)
                        .collect();
                    let urls = if urls.is_empty() {
                        "nowhere".to_owned()
                    } else {
                        urls.join(", ")
                    };
                    format!("{name} -> {urls}")
                })
                .collect();
            println!("    model keys: {}", said.join("; "));
        } else if text(m, "role") == "worker" {
            println!(
                "    model keys: not reported (an older release, which sends a key wherever base_url says)"
            );
        }
    }
    // A key goes only where each worker binds it: workers that disagree call differently.
    let mut reported = members
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["info"].get("model_keys"));
    if let Some(first) = reported.next()
        && reported.any(|keys| keys != first)
    {
        println!(
            "note: the workers bind model keys differently; give every worker and the API the same --model-key"
        );
    }
    exit::OK
}

/// Settles a run's in-doubt call by hand (SPEC M9, X7): the operator says whether it took
/// effect, and the run moves on.
pub async fn resolve(args: ResolveArgs) -> u8 {
    if args.by.trim().is_empty() || args.by.len() > rein_ops::recovery::RESOLVER_BYTES_MAX {
        eprintln!("error: --as must name who resolves the call (1..=256 bytes)");
        return exit::INPUT;
    }
    let payload = match parse_json("--payload", &args.payload) {
        Ok(Value::Object(map)) => Value::Object(map),
        Ok(_) => {
            eprintln!("error: --payload must be a JSON object");
            return exit::INPUT;
        }
        Err(code) => return code,
    };
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    let body = ResolveBody {
        resolution: match args.resolution {
            Resolution::Applied => rein_ops::recovery::Resolution::Applied,
            Resolution::NotApplied => rein_ops::recovery::Resolution::NotApplied,
        },
        event: args.event,
        payload: Some(payload),
    };
    match backend.resolve(args.run, body, &args.by).await {
        Ok(done) if args.json => {
            print_json(&json!(done));
            exit::OK
        }
        Ok(done) => {
            println!(
                "resolved call {} of run {}: committed {}",
                done.call_id, done.run_id, done.event
            );
            exit::OK
        }
        Err(e) => fail(&e),
    }
}

pub async fn runs(cmd: RunsCommand) -> u8 {
    match cmd {
        RunsCommand::Show { conn, run, json } => {
            let backend = match Backend::open(&conn).await {
                Ok(b) => b,
                Err(code) => return code,
            };
            let row = match backend.run(run).await {
                Ok(row) => row,
                Err(e) => return crate::print::fail(&e),
            };
            if json {
                print_json(&row);
                return exit::OK;
            }
            let lease = row.get("lease").cloned().unwrap_or(Value::Null);
            println!("run         {}", text(&row, "run_id"));
            println!(
                "definition  {} v{}",
                text(&row, "definition"),
                cell(&row, "version")
            );
            println!(
                "state       {} ({})",
                text(&row, "state"),
                text(&row, "status")
            );
            println!("sequence    {}", cell(&row, "sequence"));
            println!("attempt     {}", cell(&row, "attempt"));
            println!("enqueued by {}", cell(&row, "enqueued_by"));
            match (text(&lease, "worker"), text(&lease, "until")) {
                ("", _) | (_, "") => println!("lease       none (token {})", cell(&lease, "token")),
                (w, u) => println!(
                    "lease       {w} token {} until {}{}",
                    cell(&lease, "token"),
                    short_time(u),
                    if lease.get("live").and_then(Value::as_bool) == Some(true) {
                        ""
                    } else {
                        " (expired)"
                    }
                ),
            }
            println!(
                "usage       {}",
                crate::print::usage_line(row.get("usage").unwrap_or(&Value::Null))
            );
            let reason = printable(text(&row, "terminal_reason"));
            if !reason.is_empty() {
                println!("reason      {reason}");
            }
            exit::OK
        }
        RunsCommand::Usage { conn, run, json } => {
            let backend = match Backend::open(&conn).await {
                Ok(b) => b,
                Err(code) => return code,
            };
            let usage = match backend.usage(run).await {
                Ok(usage) => usage,
                Err(e) => return crate::print::fail(&e),
            };
            if json {
                print_json(&json!(usage));
                return exit::OK;
            }
            crate::print::usage_table(&usage);
            exit::OK
        }
        RunsCommand::History { conn, run, json } => {
            let backend = match Backend::open(&conn).await {
                Ok(b) => b,
                Err(code) => return code,
            };
            let events = match backend.history(run).await {
                Ok(events) => events,
                Err(e) => return crate::print::fail(&e),
            };
            if json {
                print_json(&events);
                return exit::OK;
            }
            print_history_header();
            for e in events.as_array().into_iter().flatten() {
                print_history_row(e);
            }
            exit::OK
        }
        RunsCommand::List {
            conn,
            status,
            definition,
            created_after,
            created_before,
            state,
            queue,
            parent,
            cursor,
            limit,
            data,
            json,
        } => {
            let backend = match Backend::open(&conn).await {
                Ok(b) => b,
                Err(code) => return code,
            };
            let filter = RunFilter {
                status,
                definition,
                created_after,
                created_before,
                state,
                queue,
                parent,
                id_range: None,
            };
            let page = match backend.runs(filter, cursor, limit, data).await {
                Ok(page) => page,
                Err(e) => return crate::print::fail(&e),
            };
            let rows = page.rows;
            if json {
                print_json(&rows);
            } else {
                println!(
                    "{:<36}  {:<15}  {:<18}  {:<15}  {:>4}  {:>8}",
                    "run", "definition", "state", "status", "seq", "tokens"
                );
                for r in rows.as_array().into_iter().flatten() {
                    // What its model calls used, in and out; "-" for a run with none.
                    let tokens = r["usage"]["input_tokens"]
                        .as_u64()
                        .zip(r["usage"]["output_tokens"].as_u64())
                        .map_or("-".to_owned(), |(i, o)| i.saturating_add(o).to_string());
                    println!(
                        "{:<36}  {:<15}  {:<18}  {:<15}  {:>4}  {:>8}",
                        text(r, "run_id"),
                        text(r, "definition"),
                        text(r, "state"),
                        text(r, "status"),
                        cell(r, "sequence"),
                        tokens
                    );
                }
            }
            if page.truncated {
                eprintln!(
                    "this page stopped short of --limit: more runs would pass its byte bound"
                );
            }
            if let Some(next) = page.next {
                eprintln!("more runs follow: add --cursor {next}");
            }
            exit::OK
        }
        RunsCommand::Watch(args) => crate::watch::watch(args).await,
        RunsCommand::Verify { conn, run, json } => {
            let backend = match Backend::open(&conn).await {
                Ok(b) => b,
                Err(code) => return code,
            };
            let verdict = match backend.verify(run).await {
                Ok(v) => v,
                Err(e) => return fail(&e),
            };
            if json {
                print_json(&json!(verdict));
            } else if let Some(problem) = &verdict.problem {
                eprintln!("integrity error: {problem}");
            } else {
                println!("ok: the log replays to the stored projection and to every checkpoint");
            }
            if verdict.ok { exit::OK } else { exit::REFUSED }
        }
        RunsCommand::Redact {
            db,
            run,
            fields,
            reason,
            by,
            json,
        } => {
            let key = match rein_process::redaction_key() {
                Ok(key) => key,
                Err(e) => {
                    eprintln!("error: {e}");
                    return exit::INPUT;
                }
            };
            let store = match connect(&db, false).await {
                Ok(s) => s.with_redaction_key(key),
                Err(code) => return code,
            };
            let body = rein_ops::moves::RedactBody { fields, reason };
            match rein_ops::moves::redact(&store, run, &body, &by, None).await {
                Ok(done) if json => {
                    print_json(&json!(done));
                    exit::OK
                }
                Ok(done) => {
                    println!(
                        "redacted {} in run {run}: {} value(s) replaced by their keyed hash, in {} event(s)",
                        done.fields.join(", "),
                        done.hashes.len(),
                        done.events
                    );
                    if !done.blobs_deleted.is_empty() {
                        println!(
                            "forgot {} blob(s) only finished, redacted runs referred to",
                            done.blobs_deleted.len()
                        );
                    } else if !done.finished {
                        println!(
                            "blobs kept: the run has not finished and may still read them; \
                             redact it again once it ends to forget them"
                        );
                    }
                    exit::OK
                }
                Err(e) => fail(&e),
            }
        }
        RunsCommand::UnkeyedRedactions { db, run, json } => {
            let store = match connect(&db, false).await {
                Ok(s) => s,
                Err(code) => return code,
            };
            match store.unkeyed_redactions(run).await {
                Ok(keys) if json => {
                    print_json(&json!(keys));
                    exit::OK
                }
                Ok(keys) if keys.is_empty() => {
                    println!("no unkeyed redaction markers");
                    exit::OK
                }
                Ok(keys) => {
                    for k in &keys {
                        println!(
                            "{}  {}  redacted {}",
                            k.run_id,
                            k.field,
                            k.redacted_at.to_rfc3339()
                        );
                    }
                    println!(
                        "{} key(s) hold unkeyed markers; with REIN_REDACTION_KEY set, \
                         `rein runs redact RUN --fields KEY --reason ...` replaces them by keyed ones",
                        keys.len()
                    );
                    exit::OK
                }
                Err(e) => rein_process::report(&e),
            }
        }
    }
}

/// `rein openapi`: prints the document, with no server or database needed.
pub fn openapi() -> u8 {
    match rein_api::document().to_pretty_json() {
        Ok(text) => {
            println!("{text}");
            exit::OK
        }
        Err(e) => {
            eprintln!("error: cannot render the OpenAPI document: {e}");
            exit::INPUT
        }
    }
}
