//! `rein tokens create|list|revoke`: API bearer tokens with scopes (SPEC Z1), managed against
//! the database directly (an admin's job, so not through a token). The secret is printed
//! once, alone on stdout; only its hash is stored, and no command shows that.

use rein_store::{SCOPES, TOKEN_QUOTA_MAX, TokenBounds, check_token_request};

use rein_process::{DbArgs, exit};

use crate::print::{print_json, printable};

#[derive(clap::Subcommand)]
pub enum TokensCommand {
    /// Create a token; prints its secret alone on stdout (shown only this once).
    Create(CreateArgs),
    /// The live tokens (with --revoked, the revoked ones too): id, subject, scopes, bounds,
    /// created and revoked times. Never a secret or its hash.
    List(ListArgs),
    /// Revoke a token by its id (printed on stderr when it was created): the API refuses it
    /// from now on.
    Revoke(RevokeArgs),
}

#[derive(clap::Args)]
pub struct ListArgs {
    #[command(flatten)]
    db: DbArgs,
    /// Revoked tokens too.
    #[arg(long)]
    revoked: bool,
    /// A JSON array of the tokens.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
pub struct RevokeArgs {
    #[command(flatten)]
    db: DbArgs,
    token_id: uuid::Uuid,
}

#[derive(clap::Args)]
pub struct CreateArgs {
    #[command(flatten)]
    db: DbArgs,
    /// A scope the token grants: read, enqueue, approve, operate, publish (register
    /// definitions, choose current versions) or admin (admin implies all). Repeat for
    /// several.
    #[arg(long = "scope", value_name = "SCOPE", required = true)]
    scopes: Vec<String>,
    /// Who the token speaks for (recorded as the approver of its decisions), 1..=128 bytes
    /// of printable text.
    #[arg(long, value_name = "NAME")]
    subject: String,
    /// Bind the token to this queue: its runs (enqueued, rerun, sent events, decided) must
    /// be in one of its queues, and an enqueue that names none goes to the first. Repeat for
    /// several; without it, every queue.
    #[arg(long = "queue", value_name = "QUEUE")]
    queues: Vec<String>,
    /// The highest priority the token may give a run (enqueue, rerun).
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    max_priority: Option<i32>,
    /// How many runs the token created may be unfinished at once; past it the API answers
    /// 429 (quota_exceeded).
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=TOKEN_QUOTA_MAX as i64))]
    max_in_flight: Option<u32>,
    /// How many runs the token may create in any minute; past it the API answers 429 with
    /// Retry-After.
    #[arg(long, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=TOKEN_QUOTA_MAX as i64))]
    max_enqueue_per_minute: Option<u32>,
}

impl CreateArgs {
    fn bounds(&self) -> TokenBounds {
        TokenBounds {
            queues: (!self.queues.is_empty()).then(|| self.queues.clone()),
            priority_max: self.max_priority,
            in_flight_max: self.max_in_flight,
            enqueue_per_minute_max: self.max_enqueue_per_minute,
        }
    }
}

/// The bounds as `rein tokens create` reports them: "" for none.
fn describe(bounds: &TokenBounds) -> String {
    let mut parts = Vec::new();
    if let Some(queues) = &bounds.queues {
        parts.push(format!("queues {}", queues.join(", ")));
    }
    if let Some(max) = bounds.priority_max {
        parts.push(format!("priority at most {max}"));
    }
    if let Some(n) = bounds.in_flight_max {
        parts.push(format!("at most {n} runs in flight"));
    }
    if let Some(n) = bounds.enqueue_per_minute_max {
        parts.push(format!("at most {n} runs created per minute"));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(", bound to {}", parts.join("; "))
    }
}

pub async fn tokens(cmd: TokensCommand) -> u8 {
    match cmd {
        TokensCommand::Create(args) => create(args).await,
        TokensCommand::List(args) => list(args).await,
        TokensCommand::Revoke(args) => revoke(args).await,
    }
}

async fn list(args: ListArgs) -> u8 {
    let store = match rein_process::connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let tokens = match store.list_tokens(args.revoked).await {
        Ok(t) => t,
        Err(e) => return rein_process::report(&e),
    };
    if args.json {
        print_json(&serde_json::to_value(&tokens).unwrap_or_default());
        return exit::OK;
    }
    println!(
        "{:<36}  {:<20}  {:<19}  {:<19}  {:<28}  BOUNDS",
        "TOKEN", "SUBJECT", "CREATED", "REVOKED", "SCOPES"
    );
    for t in &tokens {
        let time = |t: &chrono::DateTime<chrono::Utc>| t.format("%Y-%m-%d %H:%M:%S").to_string();
        let bounds = describe(&t.bounds);
        println!(
            "{:<36}  {:<20}  {:<19}  {:<19}  {:<28}  {}",
            t.token_id,
            printable(&t.subject),
            time(&t.created_at),
            t.revoked_at.as_ref().map_or_else(|| "-".to_owned(), time),
            t.scopes.join(","),
            bounds.strip_prefix(", bound to ").unwrap_or("-"),
        );
    }
    eprintln!(
        "{} token{}{}",
        tokens.len(),
        if tokens.len() == 1 { "" } else { "s" },
        if args.revoked {
            ""
        } else {
            " live (--revoked for all)"
        }
    );
    exit::OK
}

async fn revoke(args: RevokeArgs) -> u8 {
    let store = match rein_process::connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    match store.revoke_token(args.token_id).await {
        Ok(true) => {
            println!("revoked token {}", args.token_id);
            exit::OK
        }
        Ok(false) => {
            eprintln!(
                "error: no live token {} (unknown, or already revoked)",
                args.token_id
            );
            exit::INPUT
        }
        Err(e) => rein_process::report(&e),
    }
}

async fn create(args: CreateArgs) -> u8 {
    let bounds = args.bounds();
    if let Err(e) = check_token_request(&args.subject, &args.scopes).and_then(|()| bounds.check()) {
        eprintln!("error: {e}");
        return exit::INPUT;
    }
    let store = match rein_process::connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    match store
        .create_bounded_token(&args.subject, &args.scopes, &bounds)
        .await
    {
        Ok((token_id, secret)) => {
            println!("{secret}");
            eprintln!(
                "created token {token_id} for `{}` with scopes {} (of {}){}; the secret above is not shown again",
                args.subject,
                args.scopes.join(", "),
                SCOPES.join(", "),
                describe(&bounds)
            );
            exit::OK
        }
        Err(e) => rein_process::report(&e),
    }
}
