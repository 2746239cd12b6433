//! `rein definitions migrate` and `rein fork`: changing runs in flight (SPEC V1, E6).

use rein_ops::moves::{ForkBody, MigrateBody, MigratedRun};
use rein_process::exit;
use serde_json::Value;
use uuid::Uuid;

use crate::print::{answer, printable, text};
use crate::remote::{Backend, Conn};

/// What `rein definitions migrate` was asked.
#[derive(clap::Args)]
pub struct MigrateArgs {
    /// Definition name.
    pub name: String,
    /// The version whose unfinished runs move.
    #[arg(long)]
    pub from: u32,
    /// The version they move to; it (or the versions between) declares `[migration]`.
    #[arg(long)]
    pub to: u32,
    /// List what would move and what would not, and why; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Only these runs (comma-separated ids, at most 10,000).
    #[arg(long, value_delimiter = ',', value_name = "ID,...")]
    pub runs: Vec<Uuid>,
    /// Wait up to this long (seconds, at most 3600) for runs a worker holds or that are
    /// between a call and its result; past it they are reported `busy`.
    #[arg(long, default_value_t = 0, value_name = "S")]
    pub wait_s: u64,
    /// Why, recorded with every move.
    #[arg(long)]
    pub reason: Option<String>,
    /// Who moves them, recorded in each DEFINITION_MIGRATED (through the API, the token's
    /// subject is).
    #[arg(long = "as", value_name = "NAME", env = "REIN_OPERATOR", default_value = rein_store::OPERATOR)]
    pub by: String,
    /// Print the whole plan or result as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: Conn,
}

pub async fn migrate(args: MigrateArgs) -> u8 {
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    let body = MigrateBody {
        from: Some(args.from),
        to: Some(args.to),
        dry_run: args.dry_run,
        runs: (!args.runs.is_empty()).then(|| args.runs.clone()),
        wait_s: Some(args.wait_s),
        reason: args.reason.clone(),
    };
    let json = args.json;
    let seen = std::sync::atomic::AtomicUsize::new(0);
    let progress = |_: &MigratedRun| {
        let n = seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if !json && n.is_multiple_of(1_000) {
            eprintln!("… {n} runs looked at");
        }
    };
    let done = backend
        .migrate(&args.name, &body, &args.by, &progress)
        .await;
    let busy = done
        .as_ref()
        .is_ok_and(|r| !args.dry_run && r.get("busy").and_then(Value::as_u64).unwrap_or(0) > 0);
    let code = answer(done, json, |r| print_migration(r, args.dry_run));
    // Runs left behind are worth a non-zero exit, so a deploy script notices.
    if busy && code == exit::OK {
        exit::REFUSED
    } else {
        code
    }
}

fn print_migration(r: &Value, dry_run: bool) {
    let count = |k: &str| r.get(k).and_then(Value::as_u64).unwrap_or(0);
    let (name, from, to) = (text(r, "definition"), &r["from"], &r["to"]);
    let runs = r["runs"].as_array().cloned().unwrap_or_default();
    if runs.is_empty() {
        println!("no unfinished run of {name} v{from}: nothing to move");
        return;
    }
    let mut plan: std::collections::BTreeMap<(String, String), usize> = Default::default();
    for run in &runs {
        let to_state = run.get("to_state").and_then(Value::as_str).unwrap_or("-");
        let outcome = text(run, "outcome");
        if outcome == "moved" || outcome == "would_move" {
            *plan
                .entry((text(run, "from_state").to_owned(), to_state.to_owned()))
                .or_default() += 1;
        }
    }
    let verb = if dry_run { "would move" } else { "moved" };
    println!(
        "{name} v{from} -> v{to}: {} {verb}, {} not migratable, {} busy",
        count(if dry_run { "would_move" } else { "moved" }),
        count("not_migratable"),
        count("busy")
    );
    for ((from_state, to_state), n) in &plan {
        println!("  {n:>6}  {from_state} -> {to_state}");
    }
    let refused: Vec<&Value> = runs
        .iter()
        .filter(|r| matches!(text(r, "outcome"), "not_migratable" | "busy"))
        .collect();
    for run in refused.iter().take(20) {
        println!(
            "  {} {} in {}: {}",
            text(run, "outcome"),
            text(run, "run_id"),
            text(run, "from_state"),
            printable(text(run, "why"))
        );
    }
    if refused.len() > 20 {
        println!(
            "  … and {} more (--json lists every run)",
            refused.len() - 20
        );
    }
    if !dry_run && count("busy") > 0 {
        println!("runs reported busy stay on v{from}: run the command again (or with --wait-s)");
    }
}

/// `rein fork RUN --at SEQ`.
#[derive(clap::Args)]
pub struct ForkArgs {
    /// The run to fork; it is never changed.
    pub run: Uuid,
    /// The sequence of its log to start after: the fork starts in the state the run was in
    /// right after that event (it must be between steps, not at an open or in-doubt call).
    #[arg(long)]
    pub at: i64,
    /// Continue on another version of the definition, `NAME@V` or `V` (the name must be the
    /// run's).
    #[arg(long, value_name = "NAME@V")]
    pub definition: Option<String>,
    /// A JSON object merged into the fork's data key by key (`null` removes a key).
    #[arg(long, value_name = "JSON")]
    pub input_patch: Option<String>,
    /// Why, recorded in the fork's first event.
    #[arg(long)]
    pub reason: Option<String>,
    /// Who forks it (through the API, the token's subject is).
    #[arg(long = "as", value_name = "NAME", env = "REIN_OPERATOR", default_value = rein_store::OPERATOR)]
    pub by: String,
    /// Print `{"run_id", "forked_from", "at_sequence", "definition", "version", "state"}`.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub conn: Conn,
}

/// `V` or `NAME@V` as a version.
fn version_of(text: &str) -> Result<u32, String> {
    let v = text.rsplit_once('@').map_or(text, |(_, v)| v);
    v.trim_start_matches('v')
        .parse()
        .map_err(|_| format!("--definition `{text}` is not NAME@VERSION (e.g. refund-agent@2)"))
}

pub async fn fork(args: ForkArgs) -> u8 {
    let version = match args.definition.as_deref().map(version_of).transpose() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::INPUT;
        }
    };
    let input_patch = match args
        .input_patch
        .as_deref()
        .map(serde_json::from_str::<Value>)
    {
        None => None,
        Some(Ok(v)) if v.is_object() => Some(v),
        Some(_) => {
            eprintln!("error: --input-patch must be a JSON object, e.g. '{{\"prompt\": \"…\"}}'");
            return exit::INPUT;
        }
    };
    let backend = match Backend::open(&args.conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    if let (Some(spec), Backend::Db(store)) = (&args.definition, &backend)
        && let Some((name, _)) = spec.rsplit_once('@')
        && let Ok(row) = store.run(args.run).await
        && row.definition != name
    {
        eprintln!(
            "error: run {} is of `{}`; a fork continues on a version of the same definition",
            args.run, row.definition
        );
        return exit::INPUT;
    }
    let body = ForkBody {
        at: Some(args.at),
        version,
        input_patch,
        reason: args.reason.clone(),
    };
    answer(
        backend.fork(args.run, &body, &args.by).await,
        args.json,
        |f| {
            println!(
                "{} (fork of {} at sequence {}, {}@v{} in {})",
                text(f, "run_id"),
                text(f, "forked_from"),
                f["at_sequence"],
                text(f, "definition"),
                f["version"],
                text(f, "state")
            );
        },
    )
}
