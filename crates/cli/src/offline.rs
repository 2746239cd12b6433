//! Commands that need no database: definition checks and offline replay.

use std::io::{BufRead, Read};

use rein_core::{Definition, Event, Format, GuardRegistry, RunState, apply, builtin};
use serde_json::{Value, json};

use crate::exit;

/// Largest events file `rein replay` reads.
const REPLAY_BYTES_MAX: usize = 64 * 1024 * 1024;

#[derive(clap::Subcommand)]
pub enum DefinitionsCommand {
    /// Validate a definition file: exit 0 with a summary, or 1 with every problem.
    Check { file: String },
    /// Print a definition (built-in name or file) as a mermaid diagram or normalised JSON.
    Show {
        definition: String,
        #[arg(long, value_enum, default_value = "mermaid")]
        format: ShowFormat,
    },
    /// List the built-in definitions.
    List,
    /// Validate a definition file and store it in the database as a new version, so runs
    /// can be enqueued with it.
    Register {
        file: String,
        #[command(flatten)]
        db: crate::DbArgs,
    },
}

#[derive(clap::ValueEnum, Clone, Copy)]
pub enum ShowFormat {
    Mermaid,
    Json,
}

#[derive(clap::Args)]
pub struct ReplayArgs {
    /// Built-in definition name or definition file.
    #[arg(long)]
    definition: String,
    /// JSON-lines events file (`-` for stdin): {"type": "...", "payload": {...}} per line.
    events: String,
    /// Initial run input (business data) as JSON.
    #[arg(long, default_value = "{}")]
    input: String,
}

/// Loads a definition from a built-in name or a file path.
pub fn load_definition(name_or_file: &str) -> Result<Definition, String> {
    if let Some(result) = builtin::load(name_or_file) {
        return result.map_err(|e| format!("built-in definition {name_or_file}: {e}"));
    }
    let text = read_file_limited(name_or_file, rein_core::limits::DEFINITION_BYTES_MAX)?;
    Definition::parse(
        &text,
        Format::from_path(name_or_file),
        &GuardRegistry::new(),
    )
    .map_err(|e| e.to_string())
}

fn read_file_limited(path: &str, limit: usize) -> Result<String, String> {
    let file = std::fs::File::open(path).map_err(|e| {
        format!(
            "cannot open `{path}`: {e} (built-in definitions: {})",
            builtin::ALL
                .iter()
                .map(|(n, _)| *n)
                .collect::<Vec<_>>()
                .join(", ")
        )
    })?;
    let mut text = String::new();
    file.take(limit as u64 + 1)
        .read_to_string(&mut text)
        .map_err(|e| format!("cannot read `{path}`: {e}"))?;
    if text.len() > limit {
        return Err(format!(
            "`{path}` is larger than the limit of {limit} bytes"
        ));
    }
    Ok(text)
}

pub fn definitions(cmd: DefinitionsCommand) -> u8 {
    match cmd {
        DefinitionsCommand::Check { file } => {
            let text = match read_file_limited(&file, rein_core::limits::DEFINITION_BYTES_MAX) {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("error: {e}");
                    return exit::INPUT;
                }
            };
            match Definition::parse(&text, Format::from_path(&file), &GuardRegistry::new()) {
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
        DefinitionsCommand::Show { definition, format } => match load_definition(&definition) {
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
        DefinitionsCommand::List => {
            for (name, _) in builtin::ALL {
                if let Some(Ok(def)) = builtin::load(name) {
                    println!(
                        "{}\tv{}\t{}",
                        def.name(),
                        def.version(),
                        def.spec().description
                    );
                }
            }
            exit::OK
        }
        // Needs the database; main runs it on the async runtime.
        DefinitionsCommand::Register { .. } => exit::INPUT,
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
