//! Commands that need no database: definition checks and offline replay.

use std::io::{BufRead, Read};

use rein_core::{
    Definition, DefinitionError, DefinitionProblem, Event, Format, GuardRegistry, RunState, apply,
    builtin,
};
use rein_ops::{load_definition, read_file_limited};
use serde_json::{Value, json};

use crate::print::print_json;
use crate::remote::{Backend, Conn};
use rein_process::exit;

/// Largest events file `rein replay` reads.
const REPLAY_BYTES_MAX: usize = 64 * 1024 * 1024;

#[derive(clap::Subcommand)]
pub enum DefinitionsCommand {
    /// Validate a definition file: exit 0 with a summary, or 1 with every problem. With
    /// --registered instead: list the registered versions whose model key the given
    /// --model-key bindings would not send to their base_url (exit 1 when there are any), so
    /// they can be fixed before workers with those bindings refuse their calls.
    Check {
        #[arg(required_unless_present = "registered")]
        file: Option<String>,
        /// The verdict as JSON on stdout: `ok`, the summary and `warnings`, or `problems`
        /// (each `{item, reason}`); the exit code is the same.
        #[arg(long)]
        json: bool,
        /// Check the versions registered in the database (DATABASE_URL, or the API with
        /// REIN_URL) against the model key bindings, instead of a file.
        #[arg(long, conflicts_with = "file")]
        registered: bool,
        #[command(flatten)]
        model_keys: rein_process::ModelKeyArgs,
        #[command(flatten)]
        conn: Conn,
    },
    /// Print a definition (built-in name or file, or a registered one with --registered or
    /// REIN_URL) as a mermaid diagram or normalised JSON.
    Show {
        definition: String,
        #[arg(long, value_enum, default_value = "mermaid")]
        format: ShowFormat,
        /// The version registered in the database (DATABASE_URL) rather than the built-in
        /// or file; implied when REIN_URL is set.
        #[arg(long)]
        registered: bool,
        /// With --registered: this version (default: the name's current one).
        #[arg(long = "definition-version", value_name = "N")]
        definition_version: Option<u32>,
        #[command(flatten)]
        conn: Conn,
    },
    /// List the built-in definitions, or the registered ones with --registered or REIN_URL.
    List {
        /// The versions registered in the database (DATABASE_URL); implied when REIN_URL is
        /// set.
        #[arg(long)]
        registered: bool,
        /// A JSON array of {name, version, hash, description, ...}; registered versions
        /// also say who registered them and which is current.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: Conn,
    },
    /// Validate a definition file and store it in the database as a new version, so runs
    /// can be enqueued with it. Runs enqueued without a version keep starting with the
    /// name's current version unless --make-current (a new name's first version is current).
    /// Through the API this needs the publish scope.
    Register {
        file: String,
        /// Make this version the one runs enqueued without a version start with.
        #[arg(long)]
        make_current: bool,
        #[command(flatten)]
        publisher: PublisherArgs,
        /// Print `{"name", "version", "created", "current_version"}`.
        #[arg(long)]
        json: bool,
        // On the database, the model key bindings to check against (as the API checks its
        // own).
        #[command(flatten)]
        model_keys: rein_process::ModelKeyArgs,
        #[command(flatten)]
        conn: Conn,
    },
    /// Move the unfinished runs of one version to a newer one, with the `[migration]` the
    /// newer version declares (a state map, data renames, defaults and drops, and states that
    /// stay); each moved run records DEFINITION_MIGRATED. --dry-run lists what would move and
    /// what would not, and why. Through the API this needs the admin scope.
    Migrate(crate::moves::MigrateArgs),
    /// Make a registered version the name's current one: runs enqueued without a version
    /// (and fan-out branches that name none) start with it from now on; runs already started
    /// keep theirs. Through the API this needs the publish scope.
    Current {
        /// Definition name.
        name: String,
        /// A registered version of it.
        #[arg(value_name = "VERSION")]
        definition_version: u32,
        #[command(flatten)]
        publisher: PublisherArgs,
        /// Print `{"name", "version", "previous"}`.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: Conn,
    },
}

/// Who publishes a version or moves a name's current one, and whether a built-in name may
/// take a version other than the one this binary ships.
#[derive(clap::Args)]
pub struct PublisherArgs {
    /// For a built-in name (lifecycle, research-agent, refund-agent, chain4), allow a
    /// version other than the one this binary ships; through the API it needs the admin
    /// scope.
    #[arg(long)]
    allow_builtin: bool,
    /// Who does it, recorded with the definition (through the API, the token's subject is).
    #[arg(long = "as", value_name = "NAME", env = "REIN_OPERATOR", default_value = rein_store::OPERATOR)]
    by: String,
}

impl DefinitionsCommand {
    /// Whether the command needs the database or the API (and so the async runtime).
    pub fn needs_service(&self) -> bool {
        match self {
            DefinitionsCommand::Check { registered, .. } => *registered,
            DefinitionsCommand::Register { .. }
            | DefinitionsCommand::Current { .. }
            | DefinitionsCommand::Migrate(_) => true,
            DefinitionsCommand::List {
                registered, conn, ..
            } => *registered || conn.api.url.is_some(),
            DefinitionsCommand::Show {
                definition,
                registered,
                conn,
                ..
            } => {
                (*registered || conn.api.url.is_some())
                    && !std::path::Path::new(definition).is_file()
            }
        }
    }
}

/// `definitions check --registered`: every registered version whose model key `keys` would
/// not send to its base_url, and where that key may go.
async fn check_registered(
    backend: &Backend,
    keys: &rein_core::model_keys::KeyBindings,
    json: bool,
) -> u8 {
    let list = match backend.definitions().await {
        Ok(list) => list,
        Err(e) => return crate::print::fail(&e),
    };
    let mut refused = Vec::new();
    let mut checked = 0usize;
    for row in list.as_array().into_iter().flatten() {
        let name = crate::print::text(row, "name");
        let Some(version) = row
            .get("version")
            .and_then(Value::as_u64)
            .and_then(|v| u32::try_from(v).ok())
        else {
            continue;
        };
        let view = match backend.definition(name, Some(version)).await {
            Ok(view) => view,
            Err(e) => return crate::print::fail(&e),
        };
        let spec: rein_core::definition::DefinitionSpec =
            match serde_json::from_value(view.get("spec").cloned().unwrap_or(Value::Null)) {
                Ok(spec) => spec,
                Err(e) => {
                    eprintln!(
                        "warning: {name} v{version}: its stored body does not read here: {e}"
                    );
                    continue;
                }
            };
        checked += 1;
        for (item, why) in keys.problems(&spec) {
            refused.push(json!({
                "name": name, "version": version, "item": item, "key": why.name,
                "base_url": why.base_url, "bound_to": why.endpoints, "reason": why.to_string(),
            }));
        }
    }
    if json {
        print_json(&json!({ "checked": checked, "refused": refused }));
    } else if refused.is_empty() {
        println!(
            "ok: the model keys of all {checked} registered versions go only to endpoints they are bound to"
        );
    } else {
        for r in &refused {
            println!(
                "{} v{}\t{}\t{}",
                crate::print::text(r, "name"),
                crate::print::cell(r, "version"),
                crate::print::text(r, "item"),
                crate::print::text(r, "reason")
            );
        }
        eprintln!(
            "{} model state{} of {checked} registered versions would be refused (key_not_bound): register a version with a bound base_url, or bind the key on the workers and the API",
            refused.len(),
            if refused.len() == 1 { "" } else { "s" }
        );
    }
    if refused.is_empty() {
        exit::OK
    } else {
        exit::INPUT
    }
}

/// What `definitions check --json` prints: the same facts as the text form, for a script.
fn check_verdict(file: &str, verdict: &Result<Definition, DefinitionError>) -> Value {
    let items = |list: &[DefinitionProblem]| -> Vec<Value> {
        list.iter()
            .map(|p| json!({"item": p.item, "reason": p.reason}))
            .collect()
    };
    match verdict {
        Ok(def) => json!({
            "ok": true,
            "file": file,
            "name": def.name(),
            "version": def.version(),
            "hash": def.hash(),
            "states": def.states().count(),
            "events": def.events().count(),
            "transitions": def.transitions().len(),
            "initial_state": def.initial_state(),
            "cancel_state": def.cancel_state(),
            "warnings": items(def.warnings()),
        }),
        Err(e) => json!({
            "ok": false,
            "file": file,
            "problems": items(&e.problems()),
        }),
    }
}

#[derive(clap::ValueEnum, Clone, Copy)]
pub enum ShowFormat {
    Mermaid,
    Json,
}

/// An offline replay (`rein replay --definition DEF EVENTS_FILE`, parsed by
/// [`crate::whatif::ReplayArgs`]).
pub struct ReplayArgs {
    /// Built-in definition name or definition file.
    pub definition: String,
    /// JSON-lines events file (`-` for stdin): {"type": "...", "payload": {...}} per line.
    pub events: String,
    /// Initial run input (business data) as JSON.
    pub input: String,
}

pub fn definitions(cmd: DefinitionsCommand) -> u8 {
    match cmd {
        DefinitionsCommand::Check { file, json, .. } => {
            let file = file.unwrap_or_default();
            let text = match read_file_limited(&file, rein_core::limits::DEFINITION_BYTES_MAX) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("error: {e}");
                    return exit::INPUT;
                }
            };
            let verdict = Definition::parse(&text, Format::from_path(&file), &GuardRegistry::new());
            if json {
                print_json(&check_verdict(&file, &verdict));
                return if verdict.is_ok() {
                    exit::OK
                } else {
                    exit::INPUT
                };
            }
            match verdict {
                Ok(def) => {
                    println!(
                        "ok: {} v{}: {} states, {} events, {} transitions, initial {}, cancel state {}",
                        def.name(),
                        def.version(),
                        def.states().count(),
                        def.events().count(),
                        def.transitions().len(),
                        def.initial_state(),
                        def.cancel_state()
                    );
                    for w in def.warnings() {
                        eprintln!("warning: {}: {}", w.item, w.reason);
                    }
                    exit::OK
                }
                Err(e) => {
                    let problems = e.problems();
                    eprintln!(
                        "{file}: {} problem{}",
                        problems.len(),
                        if problems.len() == 1 { "" } else { "s" }
                    );
                    for p in problems {
                        eprintln!("  {}: {}", p.item, p.reason);
                    }
                    exit::INPUT
                }
            }
        }
        DefinitionsCommand::Show {
            definition, format, ..
        } => match load_definition(&definition) {
            Ok(def) => {
                match format {
                    ShowFormat::Mermaid => print!("{}", def.to_mermaid()),
                    ShowFormat::Json => match serde_json::to_string_pretty(def.spec()) {
                        Ok(s) => println!("{s}"),
                        Err(e) => {
                            eprintln!("error: {e}");
                            return exit::INPUT;
                        }
                    },
                }
                exit::OK
            }
            Err(e) => {
                eprintln!("error: {e}");
                exit::INPUT
            }
        },
        DefinitionsCommand::List { json, .. } => {
            let defs: Vec<Definition> = builtin::ALL
                .iter()
                .filter_map(|(name, _)| builtin::load(name).and_then(Result::ok))
                .collect();
            if json {
                let list: Vec<Value> = defs
                    .iter()
                    .map(|d| {
                        json!({
                            "name": d.name(),
                            "version": d.version(),
                            "hash": d.hash(),
                            "description": d.spec().description,
                            "builtin": true,
                        })
                    })
                    .collect();
                print_json(&Value::Array(list));
                return exit::OK;
            }
            for def in defs {
                println!(
                    "{}\tv{}\t{}",
                    def.name(),
                    def.version(),
                    def.spec().description
                );
            }
            exit::OK
        }
        // Need the database or the API; main runs them on the async runtime.
        DefinitionsCommand::Register { .. }
        | DefinitionsCommand::Current { .. }
        | DefinitionsCommand::Migrate(_) => exit::INPUT,
    }
}

/// The definition commands that read or write registered versions, through the API when
/// REIN_URL is set and the database otherwise.
pub async fn registered(cmd: DefinitionsCommand) -> u8 {
    let cmd = match cmd {
        DefinitionsCommand::Migrate(args) => return crate::moves::migrate(args).await,
        other => other,
    };
    let conn = match &cmd {
        DefinitionsCommand::List { conn, .. }
        | DefinitionsCommand::Show { conn, .. }
        | DefinitionsCommand::Register { conn, .. }
        | DefinitionsCommand::Current { conn, .. } => conn.clone(),
        DefinitionsCommand::Check {
            registered: true,
            conn,
            ..
        } => conn.clone(),
        DefinitionsCommand::Check { .. } | DefinitionsCommand::Migrate(_) => {
            return definitions(cmd);
        }
    };
    let backend = match Backend::open(&conn).await {
        Ok(b) => b,
        Err(code) => return code,
    };
    match cmd {
        DefinitionsCommand::List { json, .. } => {
            crate::print::answer(backend.definitions().await, json, |list| {
                println!("name\tversion\tcurrent\tregistered by\tdescription");
                for d in list.as_array().into_iter().flatten() {
                    let current = d.get("current").and_then(Value::as_bool) == Some(true);
                    println!(
                        "{}\tv{}\t{}\t{}\t{}",
                        crate::print::text(d, "name"),
                        crate::print::cell(d, "version"),
                        if current { "current" } else { "-" },
                        crate::print::cell(d, "registered_by"),
                        crate::print::text(d, "description")
                    );
                }
            })
        }
        DefinitionsCommand::Show {
            definition,
            format,
            definition_version,
            ..
        } => {
            let view = match backend.definition(&definition, definition_version).await {
                Ok(v) => v,
                Err(e) => return crate::print::fail(&e),
            };
            // What the document cannot say about itself, where it does not mix with it.
            eprintln!(
                "{} v{}{}, registered by {} at {}",
                crate::print::text(&view, "name"),
                crate::print::cell(&view, "version"),
                if view.get("current").and_then(Value::as_bool) == Some(true) {
                    " (current)"
                } else {
                    " (not current)"
                },
                crate::print::cell(&view, "registered_by"),
                crate::print::short_time(crate::print::text(&view, "registered_at"))
            );
            let spec = view.get("spec").cloned().unwrap_or(Value::Null);
            match format {
                ShowFormat::Json => {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&spec).unwrap_or_else(|_| spec.to_string())
                    );
                    exit::OK
                }
                ShowFormat::Mermaid => {
                    match Definition::parse(&spec.to_string(), Format::Json, &GuardRegistry::new())
                    {
                        Ok(def) => {
                            print!("{}", def.to_mermaid());
                            exit::OK
                        }
                        Err(e) => {
                            eprintln!(
                                "error: the registered definition does not validate here: {e}"
                            );
                            exit::INPUT
                        }
                    }
                }
            }
        }
        DefinitionsCommand::Check {
            json, model_keys, ..
        } => match model_keys.bindings() {
            Ok(keys) => check_registered(&backend, &keys, json).await,
            Err(e) => {
                eprintln!("error: {e}");
                exit::INPUT
            }
        },
        DefinitionsCommand::Register {
            file,
            make_current,
            publisher,
            json,
            model_keys,
            ..
        } => {
            let model_keys = match model_keys.bindings() {
                Ok(keys) => keys,
                Err(e) => {
                    eprintln!("error: {e}");
                    return exit::INPUT;
                }
            };
            let text = match read_file_limited(&file, rein_core::limits::DEFINITION_BYTES_MAX) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("error: {e}");
                    return exit::INPUT;
                }
            };
            let publisher = rein_ops::service::Publisher {
                by: &publisher.by,
                make_current,
                allow_builtin: publisher.allow_builtin,
                model_keys: &model_keys,
            };
            let registered = backend
                .register(text, Format::from_path(&file), publisher)
                .await;
            if let Ok(done) = &registered {
                for w in done
                    .get("warnings")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    eprintln!(
                        "warning: {}: {}",
                        crate::print::text(w, "item"),
                        crate::print::text(w, "reason")
                    );
                }
            }
            match registered {
                Ok(done) if json => {
                    print_json(&done);
                    exit::OK
                }
                Ok(done) => {
                    let (name, version) = (
                        crate::print::text(&done, "name"),
                        crate::print::cell(&done, "version"),
                    );
                    if done.get("created").and_then(Value::as_bool) == Some(true) {
                        println!("registered {name} v{version}");
                    } else {
                        println!("{name} v{version} is already registered with this body");
                    }
                    let current = crate::print::cell(&done, "current_version");
                    if current == version {
                        println!(
                            "{name} v{version} is current: runs enqueued without a version start with it"
                        );
                    } else {
                        println!(
                            "{name} v{current} stays current; `rein definitions current {name} {version}` makes v{version} the one runs enqueued without a version start with"
                        );
                    }
                    exit::OK
                }
                Err(e) => {
                    if e.code == rein_ops::Code::ValidationFailed {
                        eprintln!("{file}: rejected");
                    }
                    crate::print::fail(&e)
                }
            }
        }
        DefinitionsCommand::Current {
            name,
            definition_version: version,
            publisher,
            json,
            ..
        } => crate::print::answer(
            backend
                .set_current(&name, version, (&publisher.by, publisher.allow_builtin))
                .await,
            json,
            |moved| {
                let previous = match moved.get("previous").and_then(Value::as_u64) {
                    Some(v) if v == u64::from(version) => " (it already was)".to_owned(),
                    Some(v) => format!(" (was v{v})"),
                    None => String::new(),
                };
                println!(
                    "{name} v{version} is current{previous}: runs enqueued without a version start with it"
                );
            },
        ),
        DefinitionsCommand::Migrate(_) => exit::INPUT,
    }
}

pub fn replay(args: ReplayArgs) -> u8 {
    let def = match load_definition(&args.definition) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("error: {e}");
            return exit::INPUT;
        }
    };
    let input: Value = match serde_json::from_str(&args.input) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: --input is not valid JSON: {e}");
            return exit::INPUT;
        }
    };
    let reader: Box<dyn BufRead> = if args.events == "-" {
        Box::new(std::io::BufReader::new(
            std::io::stdin().take(REPLAY_BYTES_MAX as u64),
        ))
    } else {
        match std::fs::File::open(&args.events) {
            Ok(f) => Box::new(std::io::BufReader::new(f.take(REPLAY_BYTES_MAX as u64))),
            Err(e) => {
                eprintln!("error: cannot open `{}`: {e}", args.events);
                return exit::INPUT;
            }
        }
    };
    let mut state = RunState::initial(&def, input);
    for (i, line) in reader.lines().enumerate() {
        let line_no = i + 1;
        let line = match line {
            Ok(l) => l,
            Err(e) => {
                eprintln!("line {line_no}: cannot read: {e}");
                return exit::INPUT;
            }
        };
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("line {line_no}: not valid JSON: {e}");
                return exit::INPUT;
            }
        };
        let Some(kind) = value.get("type").and_then(Value::as_str) else {
            eprintln!("line {line_no}: missing string field `type`");
            return exit::INPUT;
        };
        let payload = value.get("payload").cloned().unwrap_or_else(|| json!({}));
        let event = Event::new(state.sequence + 1, kind, payload);
        match apply(&def, &state, &event) {
            Ok(next) => state = next,
            Err(e) => {
                eprintln!(
                    "line {line_no}: rejected: state {} event {}: {} ({})",
                    e.state,
                    e.event,
                    e.reason,
                    e.reason.code()
                );
                return exit::REFUSED;
            }
        }
    }
    let out = json!({
        "definition": def.name(),
        "version": def.version(),
        "status": state.state,
        "run_status": state.status(&def).as_str(),
        "sequence": state.sequence,
        "attempt": state.attempt,
        "steps_completed": state.steps_completed,
        "pending_call": state.pending_call(),
        "terminal_reason": state.terminal_reason,
        "data": state.data,
        "results": state.results,
    });
    println!("{out}");
    exit::OK
}
