//! `rein webhooks add|list|remove|deliveries`: signed notifications of approvals and runs'
//! ends to outside systems, managed against the database directly (an admin's job, like
//! tokens). The signing secret is read from an environment variable, never from the command
//! line (which other users of the machine can see), and no command prints it.

use rein_process::{DbArgs, exit};
use rein_store::{NewWebhook, Store, WEBHOOK_DELIVERIES_LIST_MAX, WEBHOOK_KINDS};
use rein_worker::egress::{Allow, Caller, Policy, rule};

use crate::print::{print_json, printable};

#[derive(clap::Subcommand)]
pub enum WebhooksCommand {
    /// Register a webhook: deliveries of the chosen kinds (default all) for runs of one
    /// definition (default every one) on one queue (default every one), signed with the
    /// secret in the environment variable --secret-env names.
    Add(AddArgs),
    /// The live webhooks: id, URL, kinds, definition, queue, who added them. Never a secret.
    List(ListArgs),
    /// Stop a webhook by its id: nothing more is queued for it, and its pending deliveries
    /// fail.
    Remove(RemoveArgs),
    /// Deliveries, newest first: kind, status, attempts, the receiver's last answer.
    Deliveries(DeliveriesArgs),
}

/// `--webhook-allow`, the egress rules of webhooks: where `rein scheduler` posts them and
/// what `rein webhooks add` registers.
#[derive(clap::Args)]
pub struct WebhookAllowArgs {
    /// Where webhooks may be posted (repeat or comma-separate): `hooks.example.com`,
    /// `hooks.example.com:8443`, `*.example.com`, `10.1.2.3`, `[fd00::1]:80`, `10.0.0.0/8`.
    /// Absent: anywhere but link-local and cloud metadata addresses and this process's
    /// database and Redis, which only an entry naming them exactly opens. A scheduler
    /// disables a stored webhook these rules refuse, recording why.
    #[arg(long, env = "REIN_WEBHOOK_ALLOW", value_name = "HOST|HOST:PORT|CIDR",
          value_delimiter = ',', value_parser = Allow::parse)]
    webhook_allow: Vec<Allow>,
}

impl WebhookAllowArgs {
    /// The rules, protecting `store`'s database and the Redis at `redis_url`.
    pub fn policy(&self, store: &Store, redis_url: Option<&str>) -> Result<Policy, String> {
        let mut policy = Policy::allowing(self.webhook_allow.clone())
            .map_err(|e| format!("--webhook-allow: {e}"))?
            .for_caller(Caller::WEBHOOKS);
        if let Some((host, port)) = store.database_address() {
            policy = policy.protect(rule::DATABASE, &host, port);
        }
        if let Some(url) = redis_url.filter(|u| !u.is_empty()) {
            policy = policy.protect_url(rule::REDIS, url, 6379);
        }
        Ok(policy)
    }
}

#[derive(clap::Args)]
pub struct AddArgs {
    #[command(flatten)]
    db: DbArgs,
    #[command(flatten)]
    egress: WebhookAllowArgs,
    /// Where to POST: an http(s) URL with a host, at most 2048 bytes, no credentials.
    #[arg(long, value_name = "URL")]
    url: String,
    /// The environment variable holding the signing secret (at least 16 bytes; e.g.
    /// `export REIN_WEBHOOK_SECRET=$(openssl rand -hex 32)`).
    #[arg(long, value_name = "VAR")]
    secret_env: String,
    /// A kind to deliver: approval.requested, approval.reminder, approval.expired,
    /// approval.decided, run.finished or run.failed. Repeat for several; without it, all.
    #[arg(long = "kind", value_name = "KIND")]
    kinds: Vec<String>,
    /// Only runs of this definition (without it, the deployment's: every definition).
    #[arg(long, value_name = "NAME")]
    definition: Option<String>,
    /// Only runs on this queue.
    #[arg(long, value_name = "QUEUE")]
    queue: Option<String>,
    /// Who adds it, recorded with it.
    #[arg(long = "as", value_name = "NAME", env = "REIN_OPERATOR", default_value = rein_store::OPERATOR)]
    by: String,
    /// Print the webhook as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    db: DbArgs,
    /// A JSON array of the webhooks.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct RemoveArgs {
    #[command(flatten)]
    db: DbArgs,
    webhook_id: uuid::Uuid,
}

#[derive(clap::Args)]
pub struct DeliveriesArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Only the failed ones (attempts used up, or the webhook removed).
    #[arg(long)]
    failed: bool,
    /// At most this many.
    #[arg(long, value_name = "N", default_value_t = 50,
          value_parser = clap::value_parser!(i64).range(1..=WEBHOOK_DELIVERIES_LIST_MAX))]
    limit: i64,
    /// A JSON array of the deliveries.
    #[arg(long)]
    json: bool,
}

pub async fn webhooks(cmd: WebhooksCommand) -> u8 {
    match cmd {
        WebhooksCommand::Add(args) => add(args).await,
        WebhooksCommand::List(args) => list(args).await,
        WebhooksCommand::Remove(args) => remove(args).await,
        WebhooksCommand::Deliveries(args) => deliveries(args).await,
    }
}

async fn add(args: AddArgs) -> u8 {
    let secret = match std::env::var(&args.secret_env) {
        Ok(s) => s,
        Err(std::env::VarError::NotPresent) => {
            eprintln!(
                "error: --secret-env {}: the variable is not set; export it with the secret \
                 (at least 16 bytes, e.g. `openssl rand -hex 32`)",
                printable(&args.secret_env)
            );
            return exit::INPUT;
        }
        Err(std::env::VarError::NotUnicode(_)) => {
            eprintln!(
                "error: --secret-env {}: the secret is not UTF-8 text",
                printable(&args.secret_env)
            );
            return exit::INPUT;
        }
    };
    let hook = NewWebhook {
        url: &args.url,
        secret: &secret,
        kinds: &args.kinds,
        definition: args.definition.as_deref(),
        queue: args.queue.as_deref(),
        created_by: &args.by,
    };
    if let Err(e) = hook.check() {
        eprintln!("error: {e}");
        return exit::INPUT;
    }
    let store = match rein_process::connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    // The schedulers' rules, as far as this command knows them: their database is this one,
    // their Redis REDIS_URL's.
    let redis_url = std::env::var("REDIS_URL").ok();
    let policy = match args.egress.policy(&store, redis_url.as_deref()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::INPUT;
        }
    };
    if let Err(refused) = policy.check_url(&args.url).await {
        eprintln!(
            "error: --url: {refused}; to register it anyway, give `rein webhooks add` the same \
             --webhook-allow entry as the schedulers"
        );
        return exit::INPUT;
    }
    match store.add_webhook(&hook).await {
        Ok(w) => {
            if args.json {
                print_json(&serde_json::to_value(&w).unwrap_or_default());
            } else {
                println!("{}", w.webhook_id);
                eprintln!(
                    "added webhook {} to {}: {} of {} on {}",
                    w.webhook_id,
                    printable(&w.url),
                    kinds(&w.kinds),
                    w.definition
                        .as_deref()
                        .map_or_else(|| "every definition".into(), printable),
                    w.queue
                        .as_deref()
                        .map_or_else(|| "every queue".into(), printable),
                );
            }
            exit::OK
        }
        Err(e) => rein_process::report(&e),
    }
}

fn kinds(kinds: &[String]) -> String {
    if kinds.is_empty() {
        "every kind".to_owned()
    } else {
        kinds.join(",")
    }
}

async fn list(args: ListArgs) -> u8 {
    let store = match rein_process::connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let hooks = match store.webhooks().await {
        Ok(h) => h,
        Err(e) => return rein_process::report(&e),
    };
    if args.json {
        print_json(&serde_json::to_value(&hooks).unwrap_or_default());
        return exit::OK;
    }
    println!(
        "{:<36}  {:<19}  {:<20}  {:<12}  {:<24}  URL",
        "WEBHOOK", "CREATED", "DEFINITION", "QUEUE", "KINDS"
    );
    for w in &hooks {
        println!(
            "{:<36}  {:<19}  {:<20}  {:<12}  {:<24}  {}",
            w.webhook_id,
            w.created_at.format("%Y-%m-%d %H:%M:%S"),
            w.definition
                .as_deref()
                .map_or_else(|| "*".into(), printable),
            w.queue.as_deref().map_or_else(|| "*".into(), printable),
            if w.kinds.is_empty() {
                "*".to_owned()
            } else {
                w.kinds.join(",")
            },
            printable(&w.url),
        );
    }
    eprintln!(
        "{} webhook{} (kinds: {})",
        hooks.len(),
        if hooks.len() == 1 { "" } else { "s" },
        WEBHOOK_KINDS.join(", ")
    );
    exit::OK
}

async fn remove(args: RemoveArgs) -> u8 {
    let store = match rein_process::connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    match store.remove_webhook(args.webhook_id).await {
        Ok(true) => {
            println!("removed webhook {}", args.webhook_id);
            exit::OK
        }
        Ok(false) => {
            eprintln!(
                "error: no live webhook {} (unknown, or already removed; `rein webhooks list` shows them)",
                args.webhook_id
            );
            exit::INPUT
        }
        Err(e) => rein_process::report(&e),
    }
}

async fn deliveries(args: DeliveriesArgs) -> u8 {
    let store = match rein_process::connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let status = args.failed.then_some("failed");
    let rows = match store.webhook_deliveries(status, args.limit).await {
        Ok(r) => r,
        Err(e) => return rein_process::report(&e),
    };
    if args.json {
        print_json(&serde_json::to_value(&rows).unwrap_or_default());
        return exit::OK;
    }
    println!(
        "{:<36}  {:<19}  {:<18}  {:<9}  {:>8}  {:>4}  {:<36}  LAST ERROR",
        "DELIVERY", "CREATED", "KIND", "STATUS", "ATTEMPTS", "CODE", "RUN"
    );
    for d in &rows {
        println!(
            "{:<36}  {:<19}  {:<18}  {:<9}  {:>8}  {:>4}  {:<36}  {}",
            d.delivery_id,
            d.created_at.format("%Y-%m-%d %H:%M:%S"),
            d.kind,
            d.status,
            d.attempts,
            d.last_status_code
                .map_or_else(|| "-".into(), |c| c.to_string()),
            d.run_id,
            d.last_error
                .as_deref()
                .map_or_else(|| "-".into(), printable),
        );
    }
    eprintln!(
        "{} deliver{}{}",
        rows.len(),
        if rows.len() == 1 { "y" } else { "ies" },
        if args.failed { " failed" } else { "" }
    );
    exit::OK
}
