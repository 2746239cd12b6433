//! `rein replay`: an events file offline ([`crate::offline::replay`]), or a stored run (or
//! every run of a definition) replayed on another definition to see where it would decide
//! differently ([`rein_ops::whatif`]).

use chrono::{DateTime, Utc};
use serde_json::Value;
use uuid::Uuid;

use rein_ops::whatif::{self, AllRuns, RUNS_DEFAULT};
use rein_process::{DbArgs, exit};

use crate::print::{cell, printable, text};

#[derive(clap::Args)]
#[command(after_help = "\
Forms:
  rein replay --definition DEF EVENTS_FILE [--input JSON]
      re-reduce a JSON-lines events file offline (DEF: built-in name or file).
  rein replay RUN_ID --definition NAME@VERSION|NAME|FILE [--json]
      replay a stored run's log (DATABASE_URL) on its own definition version and on DEF,
      and print the first event DEF decides differently, or `same outcome`.
  rein replay --all --definition NAME@VERSION|NAME|FILE [--source NAME[@VERSION]]
              [--since RFC3339] [--until RFC3339] [--limit N] [--json]
      do that for every run of the source definition (default: every version of DEF's
      name) created in the window, oldest first: how many would end the same, diverge, be
      refused, with up to 20 examples; --json lists every run.
A positional that is a UUID names a stored run; write ./FILE for an events file named
like one. Nothing is written and no action runs: recorded tool and model results are
reused as they are.")]
pub struct ReplayArgs {
    /// A JSON-lines events file (`-` for stdin: {"type": "...", "payload": {...}} per line),
    /// or the id of a stored run to replay from the database.
    #[arg(
        value_name = "EVENTS_FILE|RUN_ID",
        required_unless_present = "all",
        conflicts_with = "all"
    )]
    target: Option<String>,
    /// The definition to replay on. For an events file: a built-in name or a file. For a
    /// stored run or --all: NAME@VERSION (registered), NAME (its current version) or a file.
    #[arg(long)]
    definition: String,
    /// Initial run input (business data) as JSON, for an events file (default `{}`); a
    /// stored run starts from the input it was enqueued with.
    #[arg(long)]
    input: Option<String>,
    /// Replay every run of the source definition (see --source, --since, --until, --limit).
    #[arg(long)]
    all: bool,
    /// With --all: the runs of this definition (NAME: every version; NAME@VERSION: that
    /// one). Default: every version of --definition's name.
    #[arg(long, requires = "all", value_name = "NAME[@VERSION]")]
    source: Option<String>,
    /// With --all: only runs created at or after this time (RFC 3339, e.g.
    /// 2026-12-01T00:00:00Z).
    #[arg(long, requires = "all", value_name = "RFC3339")]
    since: Option<DateTime<Utc>>,
    /// With --all: only runs created before this time (RFC 3339).
    #[arg(long, requires = "all", value_name = "RFC3339")]
    until: Option<DateTime<Utc>>,
    /// With --all: compare at most this many runs, the oldest first (1 to 100000).
    #[arg(long, requires = "all", default_value_t = RUNS_DEFAULT, value_name = "N")]
    limit: usize,
    /// For a stored run or --all: the report as one JSON object (with --all, every run's).
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    db: DbArgs,
}

impl ReplayArgs {
    /// Whether the replay reads the database: --all, or a run id.
    pub fn needs_database(&self) -> bool {
        self.all || self.run_id().is_some()
    }

    fn run_id(&self) -> Option<Uuid> {
        self.target.as_deref().and_then(|t| Uuid::parse_str(t).ok())
    }

    /// The offline form: an events file.
    pub fn offline(self) -> crate::offline::ReplayArgs {
        crate::offline::ReplayArgs {
            definition: self.definition,
            events: self.target.unwrap_or_else(|| "-".to_owned()),
            input: self.input.unwrap_or_else(|| "{}".to_owned()),
        }
    }
}

/// Seconds between two progress lines of --all on stderr.
const PROGRESS_EVERY_S: u64 = 2;

pub async fn replay(args: ReplayArgs) -> u8 {
    if args.input.is_some() {
        eprintln!(
            "error: --input is for an events file; a stored run starts from the input it was \
             enqueued with"
        );
        return exit::INPUT;
    }
    rein_process::init_logging_at(false, "warn,sqlx=error");
    let store = match rein_process::connect(&args.db, false).await {
        Ok(s) => s,
        Err(code) => return code,
    };
    let new = match whatif::resolve_definition(&store, &args.definition).await {
        Ok(d) => d,
        Err(e) => return crate::print::fail(&e),
    };
    if let Some(run_id) = args.run_id() {
        return crate::print::answer(whatif::run(&store, run_id, &new).await, args.json, |r| {
            print_run(r)
        });
    }
    let (source, version) = match args.source.as_deref() {
        None => (new.name().to_owned(), None),
        Some(named) => match whatif::split_version(named) {
            Ok((name, version)) => (name.to_owned(), version),
            Err(e) => return crate::print::fail(&e),
        },
    };
    let of = AllRuns {
        definition: &source,
        version,
        since: args.since,
        until: args.until,
        limit: args.limit,
        every_run: args.json,
    };
    let started = std::time::Instant::now();
    let mut shown_at = 0;
    let mut progress = |done: usize| {
        let s = started.elapsed().as_secs();
        if s >= shown_at + PROGRESS_EVERY_S {
            shown_at = s;
            eprintln!("compared {done} runs ({s} s)");
        }
    };
    let result = whatif::all(&store, of, &new, &mut progress).await;
    crate::print::answer(result, args.json, print_all)
}

fn version_text(d: &Value) -> String {
    format!("{} v{}", text(d, "name"), cell(d, "version"))
}

fn end_text(e: &Value) -> String {
    let reason = match text(e, "terminal_reason") {
        "" => String::new(),
        r => format!(", reason {}", printable(r)),
    };
    format!(
        "{} ({}{reason}) at sequence {}",
        text(e, "state"),
        text(e, "status"),
        cell(e, "sequence")
    )
}

fn step_text(s: &Value) -> String {
    match s.get("transition").filter(|t| !t.is_null()) {
        Some(t) => format!(
            "{} + {} -> {} ({}, transition {})",
            text(t, "from"),
            text(t, "event"),
            text(s, "state"),
            text(s, "status"),
            cell(t, "index")
        ),
        None => format!("-> {} ({})", text(s, "state"), text(s, "status")),
    }
}

/// The report on one stored run, for a person.
fn print_run(r: &Value) {
    let null = Value::Null;
    let old = r.get("recorded_definition").unwrap_or(&null);
    let new = r.get("definition").unwrap_or(&null);
    println!(
        "run {}: recorded on {}, replayed on {} ({} events)",
        text(r, "run_id"),
        version_text(old),
        version_text(new),
        cell(r, "events")
    );
    let recorded = r.get("recorded").unwrap_or(&null);
    match r.get("divergence").filter(|d| !d.is_null()) {
        None => {
            println!("same outcome: every event is decided the same way");
            println!("  ends in     {}", end_text(recorded));
        }
        Some(d) => {
            println!(
                "{} at sequence {} ({}) in state {}: {}",
                text(r, "verdict"),
                cell(d, "sequence"),
                text(d, "event"),
                text(d, "state_before"),
                text(d, "kind")
            );
            let did = match d.get("recorded").filter(|s| !s.is_null()) {
                Some(s) => step_text(s),
                None => "refused it".to_owned(),
            };
            let would = match d.get("would").filter(|s| !s.is_null()) {
                Some(s) => step_text(s),
                None => "refuse it".to_owned(),
            };
            println!("  recorded    {did}");
            println!("  would       {would}");
            println!("  why         {}", printable(text(d, "why")));
            println!("  run ended   {}", end_text(recorded));
        }
    }
}

/// The summary of --all, for a person.
fn print_all(a: &Value) {
    let null = Value::Null;
    let counts = a.get("counts").unwrap_or(&null);
    let n = |k: &str| counts.get(k).and_then(Value::as_u64).unwrap_or(0);
    println!(
        "{} runs replayed on {}: {} same, {} diverge, {} refused, {} do not replay on their own version",
        cell(a, "compared"),
        version_text(a.get("definition").unwrap_or(&null)),
        n("same"),
        n("diverged"),
        n("refused"),
        n("unreplayable")
    );
    if a.get("truncated").and_then(Value::as_bool) == Some(true) {
        println!(
            "only the oldest {} runs were compared: narrow the window (--since, --until) or raise --limit",
            cell(a, "limit")
        );
    }
    if let Some(kinds) = a.get("by_kind").and_then(Value::as_object)
        && !kinds.is_empty()
    {
        let kinds: Vec<String> = kinds.iter().map(|(k, v)| format!("{k} {v}")).collect();
        println!("by kind: {}", kinds.join(", "));
    }
    for e in a
        .get("examples")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let d = e.get("divergence").unwrap_or(&null);
        println!(
            "  {} v{}: {} at sequence {} ({}) in {}: {}",
            text(e, "run_id"),
            cell(e.get("recorded_definition").unwrap_or(&null), "version"),
            text(e, "verdict"),
            cell(d, "sequence"),
            text(d, "event"),
            text(d, "state_before"),
            printable(text(d, "why"))
        );
    }
}
