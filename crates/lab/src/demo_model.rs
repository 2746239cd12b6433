//! The demo's real agent: the built-in `support-agent` definition, whose `model` node asks an
//! OpenAI-compatible Chat Completions endpoint what to do next. With `REIN_MODEL_URL` set the
//! workers call that endpoint with the key in `OPENAI_API_KEY` (bound to it in
//! `REIN_MODEL_KEYS` unless it is `https://api.openai.com/v1`); without it the demo starts
//! the stand-in model server in this process and says so, and runs a copy of the definition
//! that sends no key (the stand-in needs none).

use rein_core::Definition;
use rein_store::Store;
use rein_worker::model::ModelOptions;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::model_standin::StandIn;

/// The support agent's definition.
pub const DEFINITION: &str = "support-agent";

/// Where the demo's support agent gets its model.
pub struct ModelSetup {
    /// What the workers' `model` actions are given.
    pub options: ModelOptions,
    /// The endpoint, as the output names it.
    pub endpoint: String,
    /// Whether it is the local stand-in.
    pub stand_in: bool,
    /// The definition the demo's support runs use.
    pub definition: Definition,
}

/// The version offset of the demo's key-less copy (far from any published version).
const STAND_IN_VERSION_OFFSET: u32 = 1000;

/// Chooses the endpoint and registers what the support runs need.
pub async fn setup(store: &Store) -> Result<ModelSetup, String> {
    let builtin = store
        .load_definition(DEFINITION, None)
        .await
        .map_err(|e| format!("the built-in {DEFINITION}: {e}"))?;
    let options = ModelOptions::from_env()?;
    if let Some(url) = options.default_base_url.clone() {
        return Ok(ModelSetup {
            options,
            endpoint: url,
            stand_in: false,
            definition: builtin,
        });
    }
    let (_, endpoint) = start_stand_in().await?;
    let copy = keyless_copy(store).await?;
    Ok(ModelSetup {
        options: ModelOptions {
            default_base_url: Some(endpoint.clone()),
            ..options
        },
        endpoint,
        stand_in: true,
        definition: copy,
    })
}

/// Starts the stand-in model server in this process on a free port, serving until the process
/// exits; with no script it plays the support agent's policy (look the order up, refund it,
/// finish). It, and its base URL.
pub async fn start_stand_in() -> Result<(StandIn, String), String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| format!("cannot open a port for the stand-in model: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("cannot read the stand-in model's address: {e}"))?;
    let standin = StandIn::default();
    tokio::spawn(standin.clone().serve(listener));
    Ok((standin, format!("http://{addr}/v1")))
}

/// Registers (once) and returns a copy of the support agent that sends no key: the stand-in
/// needs none, and a demo or benchmark must not need one either.
pub async fn keyless_copy(store: &Store) -> Result<Definition, String> {
    let builtin = store
        .load_definition(DEFINITION, None)
        .await
        .map_err(|e| format!("the built-in {DEFINITION}: {e}"))?;
    let mut spec = builtin.spec().clone();
    spec.version += STAND_IN_VERSION_OFFSET;
    spec.description = format!("{} (a local stand-in model, no key)", spec.description);
    for state in &mut spec.states {
        if let Some(model) = &mut state.model {
            model.api_key_env = None;
        }
    }
    let copy = Definition::from_spec(spec, &rein_core::GuardRegistry::new())
        .map_err(|e| format!("the key-less copy of {DEFINITION}: {e}"))?;
    store
        .register_definition(&copy)
        .await
        .map_err(|e| format!("register the key-less copy of {DEFINITION}: {e}"))?;
    Ok(copy)
}

/// The support runs' inputs: a refund the agent may make, and one over 100 that waits for
/// the demo's approver.
pub fn inputs() -> [Value; 2] {
    [
        json!({ "order_id": "A-1001", "amount": 40 }),
        json!({ "order_id": "A-1002", "amount": 150 }),
    ]
}

/// What each support run did: its end, its log, what the model chose at each step, and the
/// tokens it spent.
pub async fn report(store: &Store, runs: &[Uuid]) -> Value {
    let mut out = Vec::new();
    for run in runs {
        let Ok(row) = store.run(*run).await else {
            continue;
        };
        let events = store.history(*run).await.unwrap_or_default();
        let why = rein_ops::service::why(store, *run)
            .await
            .unwrap_or(Value::Null);
        let log: Vec<Value> = events
            .iter()
            .map(|e| {
                let mut line = json!({ "sequence": e.sequence, "type": e.kind });
                if e.kind == "MODEL_REPLIED" {
                    let call = &e.payload["reply"]["tool_calls"][0]["function"];
                    line["model_chose"] = call["name"].clone();
                    line["arguments"] = call["arguments"].clone();
                    line["tokens"] = e.payload["usage"]["tokens"].clone();
                }
                line
            })
            .collect();
        // Usage as the model endpoint reported it, step by step (the run's own usage counts
        // only under a budget, and this definition declares none).
        let replies = events.iter().filter(|e| e.kind == "MODEL_REPLIED");
        let tokens: u64 = replies
            .clone()
            .filter_map(|e| e.payload["usage"]["tokens"].as_u64())
            .sum();
        let cost: f64 = replies
            .filter_map(|e| e.payload["usage"]["cost"].as_f64())
            .sum();
        out.push(json!({
            "run_id": run,
            "input": row.projection.data.get("order_id").map(|_| json!({
                "order_id": row.projection.data["order_id"],
                "amount": row.projection.data["amount"],
            })),
            "state": row.state,
            "status": row.status,
            "tokens": tokens,
            "cost": cost,
            "why": { "waiting_for": why["waiting_for"], "next_step": why["next_step"] },
            "log": log,
        }));
    }
    Value::Array(out)
}

/// Prints [`report`] for a person.
pub fn print_report(setup: &Value, runs: &Value) {
    println!("\n== A real agent: {DEFINITION} ==");
    println!(
        "model endpoint {}{}",
        setup["endpoint"].as_str().unwrap_or(""),
        if setup["stand_in"] == true {
            " — a local stand-in model server (no REIN_MODEL_URL set; set it and OPENAI_API_KEY to use a real one)"
        } else {
            ""
        }
    );
    for run in runs.as_array().into_iter().flatten() {
        println!(
            "run {} {}: {} ({}), {} tokens, cost {:.6}",
            run["run_id"].as_str().unwrap_or(""),
            run["input"],
            run["state"].as_str().unwrap_or(""),
            run["status"].as_str().unwrap_or(""),
            run["tokens"],
            run["cost"].as_f64().unwrap_or(0.0),
        );
        for line in run["log"].as_array().into_iter().flatten() {
            let chose = match line["model_chose"].as_str() {
                Some(name) => format!(
                    "  model chose {name} {}  ({} tokens)",
                    line["arguments"].as_str().unwrap_or(""),
                    line["tokens"]
                ),
                None => String::new(),
            };
            println!(
                "  {:>3} {}{chose}",
                line["sequence"],
                line["type"].as_str().unwrap_or("")
            );
        }
        println!(
            "  why: {}",
            run["why"]["waiting_for"].as_str().unwrap_or("-")
        );
    }
    println!("follow one live: rein runs watch RUN (through REIN_URL); explain it: rein why RUN");
}
