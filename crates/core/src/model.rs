//! The `model` action's pure half (SPEC D1–D3, E5): what Rein sends an OpenAI-compatible
//! Chat Completions endpoint and how it reads the answer. No sockets here; the worker's
//! `model` module does the call.
//!
//! - [`conversation`] builds the messages from the run alone: the system prompt (a template
//!   over run data), the task (the run input), and, walking the run's log, each earlier
//!   reply as an assistant message with its tool call, followed by what came of it (the tool
//!   result or error, an approval request and its decision, a rejection) as `tool` / `user`
//!   messages, and a resume note where the run was interrupted. Built from immutable
//!   events, the conversation only ever grows at its end.
//! - [`request_body`] offers the state's tools as function tools (their JSON Schema as
//!   parameters) and each decision event the state allows (`FINISH`, `GIVE_UP`, …) as a
//!   function taking an optional `payload` object, with `tool_choice` as the state's model
//!   table says (`"required"` unless set) and
//!   `parallel_tool_calls: false`: the model's whole choice arrives as one tool call.
//! - [`parse_reply`] turns that call into a decision for [`crate::decision::validate`];
//!   zero or several calls, arguments that are not a JSON object or an unknown name are
//!   refused at step `parse`.
//! - [`prompt_record`] is how the prompt is recorded (E5): every message is stored once
//!   under the sha256 of its canonical JSON; the event keeps only the hashes of the
//!   messages new since the previous reply, the hash of the whole list and of its prefix,
//!   so each step adds a roughly constant number of bytes to the log.

use serde_json::{Map, Value, json};

use crate::blob::Blob;
use crate::decision::CALL_TOOL;
use crate::definition::{Definition, DefinitionProblem, ModelSpec, StateSpec, ToolChoice};
use crate::event::{EngineEvent, Event};
use crate::hash::{canonical_json, sha256_hex};
use crate::limits;
use crate::state::RunState;

/// The engine event that records a model's reply: prompt (hashes), reply, model, usage.
pub const MODEL_REPLIED: &str = "MODEL_REPLIED";
/// Key variables a worker allows when started without `--model-key-env`.
pub const KEY_ENV_DEFAULTS: [&str; 2] = ["OPENAI_API_KEY", "REIN_MODEL_KEY"];
/// Longest system prompt template.
pub const SYSTEM_BYTES_MAX: usize = 64 * 1024;
/// Longest model name.
pub const MODEL_NAME_LEN_MAX: usize = 256;
/// Longest tool description offered to a model.
pub const DESCRIPTION_BYTES_MAX: usize = 4096;
/// Most tokens a definition may ask a model for per reply.
pub const MAX_TOKENS_MAX: u32 = 1_000_000;
/// Longest a model call may be given.
pub const TIMEOUT_MS_MAX: u64 = 600_000;
/// Largest tool result quoted into the conversation; larger ones are cut (their full value
/// stays in the log).
pub const RESULT_QUOTE_BYTES_MAX: usize = 16 * 1024;
/// Most earlier replies walked back into a conversation; older steps are summarised by
/// count, so one long run cannot make every request unbounded.
pub const TURNS_MAX: usize = 200;

/// Why a key variable may not be used, or `None`. A definition is written by a tenant: it
/// may name only a variable that looks like one and is none of the worker's own secrets.
pub fn key_env_problem(name: &str) -> Option<String> {
    let shaped = !name.is_empty()
        && name.len() <= 128
        && name.starts_with(|c: char| c.is_ascii_uppercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
    if !shaped {
        return Some(format!(
            "`{}` is not an environment variable name (A-Z, 0-9 and _, at most 128)",
            crate::text::storable(&name.chars().take(64).collect::<String>())
        ));
    }
    if key_env_forbidden(name) {
        return Some(format!(
            "`{name}` holds the worker's own credentials (DATABASE_URL, PG*, REIN_* other than REIN_MODEL_KEY, AWS_*, GOOGLE_*, GCP_*, AZURE_*); a definition may never name it: use OPENAI_API_KEY, REIN_MODEL_KEY or a variable the worker allows with --model-key-env"
        ));
    }
    None
}

/// Variables no definition may read, whatever a worker allows.
pub fn key_env_forbidden(name: &str) -> bool {
    name == "DATABASE_URL"
        || name.starts_with("PG")
        || (name.starts_with("REIN_") && name != "REIN_MODEL_KEY")
        || ["AWS_", "GOOGLE_", "AZURE_", "GCP_"]
            .iter()
            .any(|p| name.starts_with(p))
}

/// The problems of a state's `model` table, by item (called by the definition's checks).
pub(crate) fn problems(
    item: &str,
    state: &StateSpec,
    leaves: &dyn Fn(&str, &str) -> bool,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut p = |what: &str, reason: String| out.push((format!("{item}.{what}"), reason));
    let Some(model) = &state.model else {
        if state.action.as_deref() == Some("model") {
            p(
                "action",
                "a `model` action needs a `[states.model]` table with at least `model`".into(),
            );
        }
        return out;
    };
    if state.action.as_deref() != Some("model") {
        p(
            "model",
            "only a state whose action is `model` takes a `model` table".into(),
        );
    }
    if model.model.is_empty() || model.model.len() > MODEL_NAME_LEN_MAX {
        p(
            "model.model",
            format!("the model name must be 1..={MODEL_NAME_LEN_MAX} bytes"),
        );
    }
    if let Some(url) = &model.base_url
        && let Err(problem) = crate::http_url::parse(url)
    {
        p("model.base_url", problem.reason);
    }
    if let Some(name) = &model.api_key_env
        && let Some(problem) = key_env_problem(name)
    {
        p("model.api_key_env", problem);
    }
    if model
        .system
        .as_ref()
        .is_some_and(|s| s.len() > SYSTEM_BYTES_MAX)
    {
        p(
            "model.system",
            format!("the system prompt may be at most {SYSTEM_BYTES_MAX} bytes"),
        );
    }
    if model
        .temperature
        .is_some_and(|t| !t.is_finite() || !(0.0..=2.0).contains(&t))
    {
        p("model.temperature", "must be 0.0 ..= 2.0".into());
    }
    if model
        .max_tokens
        .is_some_and(|m| m == 0 || m > MAX_TOKENS_MAX)
    {
        p(
            "model.max_tokens",
            format!("must be 1 ..= {MAX_TOKENS_MAX}"),
        );
    }
    if model.timeout_ms == 0 || model.timeout_ms > TIMEOUT_MS_MAX {
        p(
            "model.timeout_ms",
            format!("must be 1 ..= {TIMEOUT_MS_MAX}"),
        );
    }
    if let Some(price) = &model.price
        && [price.input, price.output]
            .iter()
            .any(|x| !x.is_finite() || *x < 0.0)
    {
        p(
            "model.price",
            "`input` and `output` are non-negative prices per token".into(),
        );
    }
    for (what, event) in [
        ("transient_event", &model.transient_event),
        ("fatal_event", &model.fatal_event),
    ] {
        if let Some(event) = event
            && !leaves(&state.name, event)
        {
            p(
                &format!("model.{what}"),
                format!("event `{event}` does not leave state `{}`", state.name),
            );
        }
    }
    for (i, tool) in state.tools.iter().enumerate() {
        if tool
            .description
            .as_ref()
            .is_some_and(|d| d.len() > DESCRIPTION_BYTES_MAX)
        {
            p(
                &format!("tools[{i}].description"),
                format!("may be at most {DESCRIPTION_BYTES_MAX} bytes"),
            );
        }
    }
    let events = offered_events_of(state, &|_| true);
    for tool in &state.tools {
        if events.contains(&tool.name) {
            p(
                "tools",
                format!(
                    "tool `{}` has the name of a decision event; a model could not tell them apart",
                    tool.name
                ),
            );
        }
    }
    out
}

/// Fills `{{input.x.y}}` and `{{data.x.y}}` from the run's data (the input merged with what
/// events added); a name that is not there becomes empty text, a non-string value its JSON.
pub fn render(template: &str, data: &Value) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(start) = rest.find("{{") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else {
            out.push_str(&rest[start..]);
            return out;
        };
        let name = after[..end].trim();
        let path = name
            .strip_prefix("input.")
            .or_else(|| name.strip_prefix("data."));
        match path {
            Some(path) => {
                let found = path
                    .split('.')
                    .try_fold(data, |v, key| v.get(key))
                    .unwrap_or(&Value::Null);
                match found {
                    Value::String(s) => out.push_str(s),
                    Value::Null => {}
                    other => out.push_str(&canonical_json(other)),
                }
            }
            None => out.push_str(&rest[start..start + 2 + end + 2]),
        }
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    out
}

/// The decision events a state offers a model as functions: its `decisions` (but
/// `call_tool`), or when it declares none, the events it has a transition for that are no
/// call result, approval or failure event the engine commits itself.
pub fn offered_events(def: &Definition, state: &StateSpec) -> Vec<String> {
    let from_table: Vec<String> = def
        .transitions()
        .into_iter()
        .filter(|t| t.from == state.name)
        .map(|t| t.event.clone())
        .collect();
    let engine_commits = |e: &str| {
        def.is_call_result(e)
            || state.tools.iter().any(|t| t.approval_event() == e)
            || state.on_rejected_decision.as_deref() == Some(e)
            || def.budget().is_some_and(|b| b.event == e)
            || state.timeout.as_ref().is_some_and(|t| t.event == e)
            || state.model.as_ref().is_some_and(|m| {
                m.transient_event.as_deref() == Some(e) || m.fatal_event.as_deref() == Some(e)
            })
    };
    let mut out = if state.decisions.is_empty() {
        from_table
            .into_iter()
            .filter(|e| !engine_commits(e.as_str()))
            .collect()
    } else {
        offered_events_of(state, &|_| true)
    };
    out.sort_unstable();
    out.dedup();
    out
}

fn offered_events_of(state: &StateSpec, keep: &dyn Fn(&str) -> bool) -> Vec<String> {
    state
        .decisions
        .iter()
        .filter(|d| d.as_str() != CALL_TOOL && keep(d))
        .cloned()
        .collect()
}

/// The run input as the task message says it: `task` when it is text, else the input's
/// canonical JSON.
fn task_text(input: &Value) -> String {
    match input.get("task") {
        Some(Value::String(s)) => s.clone(),
        _ => canonical_json(input),
    }
}

fn quoted(value: &Value) -> String {
    let text = canonical_json(value);
    if text.len() <= RESULT_QUOTE_BYTES_MAX {
        return text;
    }
    let mut cut = RESULT_QUOTE_BYTES_MAX;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(
        "{}… (cut: {} bytes in all, sha256 {})",
        &text[..cut],
        text.len(),
        sha256_hex(text.as_bytes())
    )
}

fn tool_message(id: &str, content: String) -> Value {
    json!({ "role": "tool", "tool_call_id": id, "content": content })
}

fn user_message(content: String) -> Value {
    json!({ "role": "user", "content": content })
}

/// The ids of the tool calls of an assistant message.
fn call_ids(message: &Value) -> Vec<String> {
    message
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .filter_map(|c| c.get("id").and_then(Value::as_str).map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The messages of the conversation for the model call about to be made in `run`, from the
/// run's `input` and its `log` (every event so far, oldest first).
pub fn conversation(spec: &ModelSpec, run: &RunState, input: &Value, log: &[Event]) -> Vec<Value> {
    let mut messages = Vec::new();
    if let Some(system) = &spec.system {
        messages.push(json!({ "role": "system", "content": render(system, &run.data) }));
    }
    messages.push(user_message(task_text(input)));
    let replies = log.iter().filter(|e| e.kind == MODEL_REPLIED).count();
    let skip = replies.saturating_sub(TURNS_MAX);
    if skip > 0 {
        messages.push(user_message(format!(
            "({skip} earlier steps are left out; their results are in the run's log.)"
        )));
    }
    let mut seen = 0usize;
    let mut pending: Vec<String> = Vec::new();
    // The call waiting for a person (tool, args), and who granted it once they did: an
    // approved call is run by the engine, and its result answers the model's own call.
    let mut requested: Option<(Value, Value)> = None;
    let mut approved_by: Option<String> = None;
    // Tool messages must follow their call at once: a note that comes while a call is open
    // waits until the call is answered.
    let mut deferred: Vec<Value> = Vec::new();
    let answer_pending = |messages: &mut Vec<Value>,
                          pending: &mut Vec<String>,
                          deferred: &mut Vec<Value>,
                          text: String| {
        for id in pending.drain(..) {
            messages.push(tool_message(&id, text.clone()));
        }
        messages.append(deferred);
    };
    for event in log {
        if event.kind == MODEL_REPLIED {
            seen += 1;
        }
        if seen <= skip {
            continue;
        }
        let payload = &event.payload;
        match EngineEvent::parse(&event.kind) {
            _ if event.kind == MODEL_REPLIED => {
                // A call still open here never got a result: granted and not yet run (a log
                // from before Rein ran approved calls itself), or interrupted.
                let text = match approved_by.take() {
                    Some(who) => json!({ "status": "approved", "approved_by": who,
                                         "note": "approved; no result was recorded" }),
                    None => json!({ "error": "interrupted before a result was recorded" }),
                };
                requested = None;
                answer_pending(
                    &mut messages,
                    &mut pending,
                    &mut deferred,
                    canonical_json(&text),
                );
                let mut reply = payload.get("reply").cloned().unwrap_or(Value::Null);
                let ids = call_ids(&reply);
                if let Some(said) = reply.as_object_mut() {
                    pending = ids;
                    // A tool call's message without text says "" rather than null: OpenAI
                    // takes either, llama-cpp-python's server answers 500 to null and its
                    // function-calling template to a message with no content at all.
                    if said.get("content") == Some(&Value::Null) && said.contains_key("tool_calls")
                    {
                        said.insert("content".into(), Value::String(String::new()));
                    }
                    messages.push(reply);
                }
            }
            Some(EngineEvent::DecisionRejected) => {
                let text = format!(
                    "rejected at step `{}`: {}",
                    payload["step"].as_str().unwrap_or("?"),
                    payload["reason"].as_str().unwrap_or("")
                );
                if pending.is_empty() {
                    messages.push(user_message(format!("Your last reply was {text}")));
                } else {
                    answer_pending(
                        &mut messages,
                        &mut pending,
                        &mut deferred,
                        canonical_json(&json!({ "error": text })),
                    );
                }
            }
            Some(EngineEvent::ApprovalRequested) => {
                // The call stays open: a person's decision, or the approved call's own
                // result, answers it.
                requested = Some((payload["tool"].clone(), payload["args"].clone()));
            }
            Some(EngineEvent::ActionResultInDoubt | EngineEvent::LeaseExpired) => {
                let reason = payload["reason"].as_str().unwrap_or("its worker stopped");
                let to = if pending.is_empty() {
                    &mut messages
                } else {
                    &mut deferred
                };
                to.push(user_message(format!(
                    "Note: the run was interrupted here ({}: {reason}). Rein resumes it from its log; a call with side effects is reconciled by its idempotency key, never repeated blindly.",
                    event.kind
                )));
            }
            Some(_) => {}
            None => {
                if let Some(approval) = payload.get("data").and_then(|d| d.get("last_approval")) {
                    let granted = approval["granted"] == json!(true);
                    let (tool, args) = requested.take().unwrap_or((Value::Null, Value::Null));
                    let who = approval["approver"]
                        .as_str()
                        .unwrap_or("a person")
                        .to_owned();
                    let call =
                        format!("{} {}", tool.as_str().unwrap_or("?"), canonical_json(&args));
                    if granted && !pending.is_empty() {
                        approved_by = Some(who);
                    } else if granted {
                        messages.push(user_message(format!(
                            "{who} approved the call {call}; Rein runs it as approved."
                        )));
                    } else if pending.is_empty() {
                        messages.push(user_message(format!("{who} denied the call {call}.")));
                    } else {
                        let text = json!({ "status": "denied", "denied_by": who,
                                           "note": format!("{who} denied this call; it was not run") });
                        answer_pending(
                            &mut messages,
                            &mut pending,
                            &mut deferred,
                            canonical_json(&text),
                        );
                    }
                } else if !pending.is_empty() {
                    let mut answer = match (payload.get("result"), payload.get("error")) {
                        (Some(result), _) => json!({ "result": result }),
                        (None, Some(error)) => json!({ "error": error }),
                        (None, None) => continue,
                    };
                    if let Some(who) = approved_by.take() {
                        answer["approved_by"] = who.into();
                    }
                    let text = quoted(&answer);
                    answer_pending(&mut messages, &mut pending, &mut deferred, text);
                }
            }
        }
    }
    answer_pending(
        &mut messages,
        &mut pending,
        &mut deferred,
        canonical_json(&json!({ "error": "interrupted before a result was recorded" })),
    );
    messages
}

/// The problems of `tool_choice = "function"` in a compiled definition: it names the one
/// function a state offers, so the state must offer exactly one (a tool or a decision event).
pub(crate) fn tool_choice_problems(def: &Definition) -> Vec<DefinitionProblem> {
    let mut out = Vec::new();
    for (i, state) in def.spec().states.iter().enumerate() {
        if state
            .model
            .as_ref()
            .is_none_or(|m| m.tool_choice != ToolChoice::Function)
        {
            continue;
        }
        let mut offered: Vec<String> = state.tools.iter().map(|t| t.name.clone()).collect();
        offered.extend(offered_events(def, state));
        if offered.len() != 1 {
            out.push(DefinitionProblem {
                item: format!("states[{i}] ({}).model.tool_choice", state.name),
                reason: format!(
                    "`function` names the one function the state offers, but it offers {} ({}); use `required` or `auto`",
                    offered.len(),
                    offered.join(", ")
                ),
            });
        }
    }
    out
}

/// The Chat Completions request for `messages` in `state`.
pub fn request_body(
    def: &Definition,
    state: &StateSpec,
    spec: &ModelSpec,
    messages: &[Value],
) -> Value {
    let mut tools: Vec<Value> = state
        .tools
        .iter()
        .map(|t| {
            let mut function = Map::new();
            function.insert("name".into(), t.name.clone().into());
            if let Some(d) = &t.description {
                function.insert("description".into(), d.clone().into());
            }
            function.insert(
                "parameters".into(),
                t.schema
                    .clone()
                    .unwrap_or_else(|| json!({ "type": "object" })),
            );
            json!({ "type": "function", "function": function })
        })
        .collect();
    for event in offered_events(def, state) {
        tools.push(json!({
            "type": "function",
            "function": {
                "name": event,
                "description": format!("Decide `{event}`: the run moves on by the definition's rules."),
                "parameters": {
                    "type": "object",
                    "properties": { "payload": { "type": "object" } },
                    "additionalProperties": false,
                },
            },
        }));
    }
    let tool_choice = match spec.tool_choice {
        ToolChoice::Required => json!("required"),
        ToolChoice::Auto => json!("auto"),
        // Registration holds a `function` state to exactly one function offered.
        ToolChoice::Function => match tools.as_slice() {
            [one] => json!({ "type": "function", "function": { "name": one["function"]["name"] } }),
            _ => json!("required"),
        },
    };
    let mut body = Map::new();
    body.insert("model".into(), spec.model.clone().into());
    body.insert("messages".into(), Value::Array(messages.to_vec()));
    body.insert("tools".into(), Value::Array(tools));
    body.insert("tool_choice".into(), tool_choice);
    body.insert("parallel_tool_calls".into(), false.into());
    if let Some(t) = spec.temperature {
        body.insert("temperature".into(), t.into());
    }
    if let Some(m) = spec.max_tokens {
        body.insert("max_tokens".into(), m.into());
    }
    if spec.stream {
        body.insert("stream".into(), true.into());
        body.insert("stream_options".into(), json!({ "include_usage": true }));
    }
    Value::Object(body)
}

/// Token usage of one reply, as an event's `usage` (what the run's budgets add up).
pub fn usage(spec: &ModelSpec, input_tokens: u64, output_tokens: u64) -> Value {
    let mut usage = json!({
        "tokens": input_tokens.saturating_add(output_tokens),
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
    });
    if let Some(price) = &spec.price {
        let cost = input_tokens as f64 * price.input + output_tokens as f64 * price.output;
        if cost.is_finite() {
            usage["cost"] = cost.into();
        }
    }
    usage
}

/// What a reply says, read.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// The decision for [`crate::decision::validate`], or why none could be read (a
    /// rejection at step `parse`).
    pub decision: Result<Value, String>,
    /// The assistant message as the model said it (role, content, tool_calls), kept in the
    /// record so a later judge can read it again.
    pub message: Value,
    /// The model (and version) the endpoint says answered.
    pub model: Option<String>,
    pub finish_reason: Option<String>,
    /// `usage` for the event, from the reply's `usage`.
    pub usage: Option<Value>,
}

/// Reads a Chat Completions reply (`chat.completion` JSON) given in `state`.
pub fn parse_reply(def: &Definition, state: &StateSpec, spec: &ModelSpec, body: &Value) -> Reply {
    let model = body
        .get("model")
        .and_then(Value::as_str)
        .map(|m| crate::text::storable(&m.chars().take(MODEL_NAME_LEN_MAX).collect::<String>()));
    let usage = body.get("usage").and_then(|u| {
        let n = |k: &str| u.get(k).and_then(Value::as_u64);
        let mut out = match (n("prompt_tokens"), n("completion_tokens")) {
            (Some(i), Some(o)) => usage(spec, i, o),
            (None, None) => usage(spec, n("total_tokens")?, 0),
            (i, o) => usage(spec, i.unwrap_or(0), o.unwrap_or(0)),
        };
        // Where the server says them: what `rein_run_usage` sums besides input and output.
        let detail = |group: &str, k: &str| u.get(group)?.get(k)?.as_u64();
        if let Some(r) = detail("completion_tokens_details", "reasoning_tokens") {
            out["reasoning_tokens"] = r.into();
        }
        if let Some(c) = detail("prompt_tokens_details", "cached_tokens") {
            out["cached_tokens"] = c.into();
        }
        Some(out)
    });
    // A NUL cannot be stored: the reply is refused at step `parse` (as an http node's is)
    // and kept out of the record, instead of parking the run on a commit that fails.
    if let Some(at) = crate::text::nul_at(body) {
        return Reply {
            decision: Err(format!(
                "the reply holds a NUL character (\\u0000) at {at}, which cannot be stored"
            )),
            message: Value::Null,
            model,
            finish_reason: None,
            usage,
        };
    }
    let choice = body.get("choices").and_then(|c| c.get(0));
    let finish_reason = choice
        .and_then(|c| c.get("finish_reason"))
        .and_then(Value::as_str)
        .map(str::to_owned);
    let raw = choice.and_then(|c| c.get("message"));
    let message = raw.map(assistant_message).unwrap_or(Value::Null);
    let decision = match raw {
        None => Err("the reply has no `choices[0].message`".to_owned()),
        Some(m) => decision_of(def, state, m),
    }
    .and_then(|d| match crate::text::nul_at(&d) {
        // Escaped in the arguments' JSON text, a NUL arrives only once they are read.
        Some(at) => Err(format!(
            "the arguments hold a NUL character (\\u0000) at {at}, which cannot be stored"
        )),
        None => Ok(d),
    });
    Reply {
        decision,
        message,
        model,
        finish_reason,
        usage,
    }
}

/// The assistant message with only the fields a conversation carries.
fn assistant_message(message: &Value) -> Value {
    let mut out = Map::new();
    out.insert("role".into(), "assistant".into());
    out.insert(
        "content".into(),
        match message.get("content") {
            Some(Value::String(s)) => Value::String(s.clone()),
            _ => Value::Null,
        },
    );
    if let Some(Value::Array(calls)) = message.get("tool_calls") {
        let calls: Vec<Value> = calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({
                    "id": c.get("id").and_then(Value::as_str).map(str::to_owned).unwrap_or_else(|| format!("call_{i}")),
                    "type": "function",
                    "function": {
                        "name": c["function"]["name"].as_str().unwrap_or(""),
                        "arguments": c["function"]["arguments"].as_str().unwrap_or(""),
                    },
                })
            })
            .collect();
        out.insert("tool_calls".into(), Value::Array(calls));
    }
    Value::Object(out)
}

fn decision_of(def: &Definition, state: &StateSpec, message: &Value) -> Result<Value, String> {
    let calls: &[Value] = match message.get("tool_calls") {
        Some(Value::Array(calls)) => calls.as_slice(),
        None | Some(Value::Null) => &[],
        Some(_) => return Err("`tool_calls` is not a list".into()),
    };
    let call = match calls {
        [one] => one,
        [] => {
            let said = message
                .get("content")
                .and_then(Value::as_str)
                .unwrap_or("")
                .chars()
                .take(200)
                .collect::<String>();
            return Err(format!(
                "the model made no tool call (it said: {said:?}); every choice must be one tool call"
            ));
        }
        many => {
            return Err(format!(
                "the model made {} tool calls; exactly one is accepted per step (parallel_tool_calls is off)",
                many.len()
            ));
        }
    };
    let Some(name) = call["function"]["name"].as_str() else {
        return Err("the tool call names no function".into());
    };
    let arguments = match &call["function"]["arguments"] {
        Value::String(s) if s.trim().is_empty() => json!({}),
        Value::String(s) => serde_json::from_str::<Value>(s)
            .map_err(|e| format!("the arguments of `{name}` are not JSON: {e}"))?,
        Value::Object(_) => call["function"]["arguments"].clone(),
        Value::Null => json!({}),
        _ => return Err(format!("the arguments of `{name}` are not a JSON object")),
    };
    if !arguments.is_object() {
        return Err(format!("the arguments of `{name}` are not a JSON object"));
    }
    if state.tools.iter().any(|t| t.name == name) {
        return Ok(json!({ "decision": CALL_TOOL, "tool": name, "args": arguments }));
    }
    let events = offered_events(def, state);
    if events.iter().any(|e| e == name) {
        let payload = arguments.get("payload").cloned().unwrap_or(json!({}));
        if !payload.is_object() {
            return Err(format!("the `payload` of `{name}` is not a JSON object"));
        }
        return Ok(json!({ "decision": name, "payload": payload }));
    }
    let mut offered: Vec<&str> = state.tools.iter().map(|t| t.name.as_str()).collect();
    offered.extend(events.iter().map(String::as_str));
    Err(format!(
        "the model called `{}`, which is not offered here (offered: {})",
        crate::text::storable(&name.chars().take(64).collect::<String>()),
        offered.join(", ")
    ))
}

/// How a prompt is recorded: `{"messages": N, "sha256": H(all), "parent": H(prefix), "new":
/// [hashes]}` where `new` are the hashes of the messages from the previous reply on (all of
/// them on the first call) and `parent` the hash of the list before them — the previous
/// call's `sha256` when the conversation just grew. Every message is a blob stored once by
/// the sha256 of its canonical JSON; only the new ones are returned to store.
pub fn prompt_record(messages: &[Value]) -> (Value, Vec<Blob>) {
    let hashes: Vec<(String, String)> = messages
        .iter()
        .map(|m| {
            let text = canonical_json(m);
            (sha256_hex(text.as_bytes()), text)
        })
        .collect();
    let from = messages
        .iter()
        .rposition(|m| m["role"] == "assistant")
        .unwrap_or(0);
    let list_hash = |list: &[(String, String)]| {
        let joined: Vec<&str> = list.iter().map(|(h, _)| h.as_str()).collect();
        sha256_hex(joined.join(",").as_bytes())
    };
    let mut blobs: Vec<Blob> = Vec::new();
    for (sha256, text) in &hashes[from..] {
        if text.len() <= limits::BLOB_BYTES_MAX && !blobs.iter().any(|b| &b.sha256 == sha256) {
            blobs.push(Blob {
                sha256: sha256.clone(),
                content: text.clone().into_bytes(),
            });
        }
    }
    let record = json!({
        "messages": messages.len(),
        "sha256": list_hash(&hashes),
        "parent": list_hash(&hashes[..from]),
        "new": hashes[from..].iter().map(|(h, _)| h.clone()).collect::<Vec<_>>(),
    });
    (record, blobs)
}

/// The payload of MODEL_REPLIED: what was asked (by hash), what the model said, who said it
/// and what it cost.
pub fn replied_payload(spec: &ModelSpec, prompt: Value, reply: &Reply) -> Value {
    let mut out = Map::new();
    out.insert("requested_model".into(), spec.model.clone().into());
    if let Some(m) = &reply.model {
        out.insert("model".into(), m.clone().into());
    }
    out.insert("prompt".into(), prompt);
    out.insert("reply".into(), reply.message.clone());
    if let Some(f) = &reply.finish_reason {
        out.insert("finish_reason".into(), crate::text::storable(f).into());
    }
    if let Some(u) = &reply.usage {
        out.insert("usage".into(), u.clone());
    }
    Value::Object(out)
}

/// Accumulates a streamed reply (`chat.completion.chunk` events): content and tool-call
/// argument fragments by index, then the whole reply as one `chat.completion` JSON.
#[derive(Debug, Default)]
pub struct StreamReply {
    content: String,
    /// By index: id, name, arguments.
    calls: Vec<(Option<String>, String, String)>,
    model: Option<String>,
    finish_reason: Option<String>,
    usage: Option<Value>,
    done: bool,
    bytes: usize,
}

/// What a stream line meant.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamStep {
    /// Deltas to show watchers (`{"type":"delta",...}` / `{"type":"tool_call_delta",...}`).
    Deltas(Vec<Value>),
    /// `data: [DONE]`.
    Done,
}

impl StreamReply {
    /// Reads one line of the event stream. Comments, blank lines and other fields are
    /// skipped; a `data:` line that is not a JSON chunk is an error.
    pub fn line(&mut self, line: &str) -> Result<StreamStep, String> {
        self.bytes += line.len();
        if self.bytes > limits::DECISION_BYTES_MAX * 4 {
            return Err("the streamed reply is too large".into());
        }
        let Some(data) = line.strip_prefix("data:") else {
            return Ok(StreamStep::Deltas(Vec::new()));
        };
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(StreamStep::Done);
        }
        let chunk: Value =
            serde_json::from_str(data).map_err(|e| format!("a stream chunk is not JSON: {e}"))?;
        if let Some(m) = chunk.get("model").and_then(Value::as_str) {
            self.model = Some(m.to_owned());
        }
        if let Some(u) = chunk.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(u.clone());
        }
        let mut deltas = Vec::new();
        let Some(choice) = chunk.get("choices").and_then(|c| c.get(0)) else {
            return Ok(StreamStep::Deltas(deltas));
        };
        if let Some(f) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(f.to_owned());
        }
        let delta = &choice["delta"];
        if let Some(text) = delta.get("content").and_then(Value::as_str)
            && !text.is_empty()
        {
            self.content.push_str(text);
            deltas.push(json!({ "type": "delta", "content": text }));
        }
        if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
            for call in calls {
                let index = call
                    .get("index")
                    .and_then(Value::as_u64)
                    .and_then(|i| usize::try_from(i).ok())
                    .unwrap_or(0);
                if index >= 16 {
                    return Err("a stream names a tool call past index 15".into());
                }
                while self.calls.len() <= index {
                    self.calls.push((None, String::new(), String::new()));
                }
                let slot = &mut self.calls[index];
                if let Some(id) = call.get("id").and_then(Value::as_str) {
                    slot.0 = Some(id.to_owned());
                }
                if let Some(name) = call["function"].get("name").and_then(Value::as_str) {
                    slot.1.push_str(name);
                }
                let fragment = call["function"]
                    .get("arguments")
                    .and_then(Value::as_str)
                    .unwrap_or("");
                slot.2.push_str(fragment);
                deltas.push(json!({
                    "type": "tool_call_delta",
                    "name": slot.1,
                    "arguments": fragment,
                }));
            }
        }
        Ok(StreamStep::Deltas(deltas))
    }

    /// Whether `data: [DONE]` arrived: a stream that ends without it was cut.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The reply as a `chat.completion` JSON, for [`parse_reply`].
    pub fn finish(self) -> Value {
        let calls: Vec<Value> = self
            .calls
            .into_iter()
            .enumerate()
            .map(|(i, (id, name, arguments))| {
                json!({
                    "id": id.unwrap_or_else(|| format!("call_{i}")),
                    "type": "function",
                    "function": { "name": name, "arguments": arguments },
                })
            })
            .collect();
        let mut message = json!({ "role": "assistant", "content": self.content });
        if !calls.is_empty() {
            message["tool_calls"] = Value::Array(calls);
        }
        let mut body = json!({
            "object": "chat.completion",
            "choices": [{ "index": 0, "message": message, "finish_reason": self.finish_reason }],
        });
        if let Some(m) = self.model {
            body["model"] = m.into();
        }
        if let Some(u) = self.usage {
            body["usage"] = u;
        }
        body
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::definition::Format;
    use crate::guard::GuardRegistry;
    use proptest::prelude::*;

    const DEF: &str = r#"
name = "m"
version = 1
cancel_state = "DONE"
events = ["TOOL_SUCCEEDED", "TOOL_FAILED", "APPROVAL_REQUIRED", "APPROVED", "REJECTED", "APPROVAL_EXPIRED", "FINISH", "GIVE_UP", "BAD", "MODEL_FAILED"]
call_results = ["TOOL_SUCCEEDED", "TOOL_FAILED"]
[[states]]
name = "ACTING"
kind = "active"
initial = true
action = "model"
decisions = ["call_tool", "FINISH", "GIVE_UP"]
on_rejected_decision = "BAD"
[states.model]
model = "gpt-test"
api_key_env = "OPENAI_API_KEY"
system = "You help {{input.customer}} ({{data.tier}}){{data.missing}}."
price = { input = 0.001, output = 0.002 }
transient_event = "MODEL_FAILED"
fatal_event = "MODEL_FAILED"
[[states.tools]]
name = "lookup_order"
description = "Finds an order."
schema = { type = "object", required = ["order_id"], properties = { order_id = { type = "string" } } }
[[states.tools]]
name = "refund"
side_effect = true
requires_idempotency_key = true
approval = "args.amount > 100"
[[states]]
name = "WAIT"
kind = "waiting"
approval = { expires_after_ms = 60000, expiry_event = "APPROVAL_EXPIRED" }
[[states]]
name = "DONE"
kind = "terminal"
[[transitions]]
from = "ACTING"
event = "TOOL_SUCCEEDED"
to = "ACTING"
effects = ["append_result", "complete_step"]
[[transitions]]
from = "ACTING"
event = "TOOL_FAILED"
to = "DONE"
[[transitions]]
from = "ACTING"
event = "APPROVAL_REQUIRED"
to = "WAIT"
[[transitions]]
from = "WAIT"
event = "APPROVED"
to = "ACTING"
[[transitions]]
from = "WAIT"
event = "REJECTED"
to = "DONE"
[[transitions]]
from = "WAIT"
event = "APPROVAL_EXPIRED"
to = "DONE"
[[transitions]]
from = "ACTING"
event = "FINISH"
to = "DONE"
[[transitions]]
from = "ACTING"
event = "GIVE_UP"
to = "DONE"
[[transitions]]
from = "ACTING"
event = "BAD"
to = "DONE"
[[transitions]]
from = "ACTING"
event = "MODEL_FAILED"
to = "DONE"
"#;

    fn def() -> Definition {
        Definition::parse(DEF, Format::Toml, &GuardRegistry::new()).expect("valid")
    }

    fn parse(text: &str) -> Result<Definition, String> {
        Definition::parse(text, Format::Toml, &GuardRegistry::new()).map_err(|e| e.to_string())
    }

    fn acting(def: &Definition) -> (StateSpec, ModelSpec) {
        let state = def.state("ACTING").unwrap().clone();
        let spec = state.model.clone().unwrap();
        (state, spec)
    }

    fn reply_with(calls: Value) -> Value {
        json!({
            "model": "gpt-test-2026-01-01",
            "choices": [{ "index": 0, "finish_reason": "tool_calls",
                          "message": { "role": "assistant", "content": null, "tool_calls": calls } }],
            "usage": { "prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120 },
        })
    }

    fn call(name: &str, arguments: &str) -> Value {
        json!({ "id": "call_1", "type": "function", "function": { "name": name, "arguments": arguments } })
    }

    #[test]
    fn a_nul_in_a_reply_is_refused_at_parse_and_kept_out_of_the_record() {
        let def = def();
        let (state, spec) = acting(&def);
        let mut raw = reply_with(json!([call("FINISH", "{}")]));
        raw["choices"][0]["message"]["content"] = json!("done\u{0}");
        let escaped = reply_with(json!([call(
            "FINISH",
            r#"{"payload": {"summary": "a\u0000b"}}"#
        )]));
        for body in [raw, escaped] {
            let reply = parse_reply(&def, &state, &spec, &body);
            let reason = reply.decision.clone().expect_err("refused");
            assert!(reason.contains("NUL"), "{reason}");
            let record = replied_payload(&spec, json!({}), &reply);
            assert_eq!(crate::text::nul_at(&record), None, "{record}");
            assert!(record["usage"]["tokens"].as_u64().is_some(), "{record}");
        }
    }

    #[test]
    fn the_request_offers_tools_and_decisions_as_functions() {
        let def = def();
        let (state, spec) = acting(&def);
        let body = request_body(
            &def,
            &state,
            &spec,
            &[json!({"role": "user", "content": "x"})],
        );
        let names: Vec<&str> = body["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["lookup_order", "refund", "FINISH", "GIVE_UP"]);
        assert_eq!(body["tool_choice"], "required");
        assert_eq!(body["parallel_tool_calls"], false);
        assert_eq!(body["model"], "gpt-test");
        assert_eq!(
            body["tools"][0]["function"]["parameters"]["required"],
            json!(["order_id"])
        );
        assert_eq!(
            body["tools"][0]["function"]["description"],
            "Finds an order."
        );
        assert!(body.get("stream").is_none());
    }

    /// A model state offering one function only: the decision `FINISH`.
    const ONE_FUNCTION: &str = r#"
name = "one"
version = 1
cancel_state = "DONE"
events = ["FINISH", "MODEL_FAILED"]
[[states]]
name = "ACTING"
kind = "active"
initial = true
action = "model"
decisions = ["FINISH"]
[states.model]
model = "gpt-test"
tool_choice = "function"
transient_event = "MODEL_FAILED"
[[states]]
name = "DONE"
kind = "terminal"
[[transitions]]
from = "ACTING"
event = "FINISH"
to = "DONE"
[[transitions]]
from = "ACTING"
event = "MODEL_FAILED"
to = "DONE"
"#;

    fn with_tool_choice(value: &str) -> String {
        DEF.replacen(
            "model = \"gpt-test\"\n",
            &format!("model = \"gpt-test\"\ntool_choice = \"{value}\"\n"),
            1,
        )
    }

    fn tool_choice_sent(def: &Definition) -> Value {
        let (state, spec) = acting(def);
        request_body(
            def,
            &state,
            &spec,
            &[json!({"role": "user", "content": "x"})],
        )["tool_choice"]
            .clone()
    }

    #[test]
    fn tool_choice_is_sent_as_the_model_table_says() {
        assert_eq!(tool_choice_sent(&def()), json!("required"));
        assert!(!def().sets_tool_choice(), "the default needs nothing new");
        let required = parse(&with_tool_choice("required")).unwrap();
        assert_eq!(tool_choice_sent(&required), json!("required"));
        assert!(!required.sets_tool_choice());
        // Spelled out, the default is the same definition as left out.
        assert_eq!(required.hash(), def().hash());
        let auto = parse(&with_tool_choice("auto")).unwrap();
        assert_eq!(tool_choice_sent(&auto), json!("auto"));
        assert!(auto.sets_tool_choice());
        let function = parse(ONE_FUNCTION).unwrap();
        assert_eq!(
            tool_choice_sent(&function),
            json!({ "type": "function", "function": { "name": "FINISH" } })
        );
        assert!(function.sets_tool_choice());
    }

    #[test]
    fn registration_refuses_an_unknown_tool_choice_listing_the_allowed_ones() {
        let err = parse(&with_tool_choice("sometimes")).expect_err("refused");
        assert!(err.contains("sometimes"), "{err}");
        for allowed in ["required", "auto", "function"] {
            assert!(err.contains(allowed), "{err}");
        }
    }

    #[test]
    fn a_named_function_choice_needs_exactly_one_function_offered() {
        let err = parse(&with_tool_choice("function")).expect_err("refused");
        assert!(err.contains("model.tool_choice"), "{err}");
        assert!(
            err.contains("offers 4 (lookup_order, refund, FINISH, GIVE_UP)"),
            "{err}"
        );
    }

    #[test]
    fn under_auto_a_reply_without_a_tool_call_is_rejected_at_parse() {
        let def = parse(&with_tool_choice("auto")).unwrap();
        let (state, spec) = acting(&def);
        let mut body = reply_with(json!(null));
        body["choices"][0]["message"]["content"] = json!("Your refund is on its way.");
        body["choices"][0]["finish_reason"] = json!("stop");
        let reason = parse_reply(&def, &state, &spec, &body)
            .decision
            .expect_err("rejected");
        assert!(reason.contains("the model made no tool call"), "{reason}");
        assert!(reason.contains("Your refund is on its way."), "{reason}");
    }

    #[test]
    fn undeclared_decisions_offer_only_events_a_model_may_choose() {
        let text = DEF.replace("decisions = [\"call_tool\", \"FINISH\", \"GIVE_UP\"]\n", "");
        let def = parse(&text).unwrap();
        let (state, _) = acting(&def);
        assert_eq!(offered_events(&def, &state), ["FINISH", "GIVE_UP"]);
    }

    #[test]
    fn one_tool_call_becomes_a_decision() {
        let def = def();
        let (state, spec) = acting(&def);
        let r = parse_reply(
            &def,
            &state,
            &spec,
            &reply_with(json!([call("lookup_order", r#"{"order_id":"A1"}"#)])),
        );
        assert_eq!(
            r.decision,
            Ok(
                json!({"decision": "call_tool", "tool": "lookup_order", "args": {"order_id": "A1"}})
            )
        );
        assert_eq!(r.model.as_deref(), Some("gpt-test-2026-01-01"));
        let usage = r.usage.unwrap();
        assert_eq!(usage["tokens"], 120);
        assert_eq!(usage["input_tokens"], 100);
        assert!((usage["cost"].as_f64().unwrap() - 0.14).abs() < 1e-9);
        assert_eq!(
            usage.get("reasoning_tokens"),
            None,
            "not reported: not made up"
        );
        let mut detailed = reply_with(json!([call("lookup_order", r#"{"order_id":"A1"}"#)]));
        detailed["usage"]["completion_tokens_details"] = json!({ "reasoning_tokens": 12 });
        detailed["usage"]["prompt_tokens_details"] = json!({ "cached_tokens": 64 });
        let usage = parse_reply(&def, &state, &spec, &detailed).usage.unwrap();
        assert_eq!(usage["reasoning_tokens"], 12);
        assert_eq!(usage["cached_tokens"], 64);
        let finish = parse_reply(
            &def,
            &state,
            &spec,
            &reply_with(json!([call("FINISH", r#"{"payload":{"note":"ok"}}"#)])),
        );
        assert_eq!(
            finish.decision,
            Ok(json!({"decision": "FINISH", "payload": {"note": "ok"}}))
        );
        let bare = parse_reply(
            &def,
            &state,
            &spec,
            &reply_with(json!([call("GIVE_UP", "")])),
        );
        assert_eq!(
            bare.decision,
            Ok(json!({"decision": "GIVE_UP", "payload": {}}))
        );
    }

    #[test]
    fn replies_that_are_not_one_good_call_are_refused_with_a_reason() {
        let def = def();
        let (state, spec) = acting(&def);
        for (body, says) in [
            (reply_with(json!([])), "no tool call"),
            (
                reply_with(json!([call("lookup_order", "{}"), call("FINISH", "{}")])),
                "2 tool calls",
            ),
            (
                reply_with(json!([call("lookup_order", "{not json")])),
                "not JSON",
            ),
            (
                reply_with(json!([call("lookup_order", "[1]")])),
                "not a JSON object",
            ),
            (
                reply_with(json!([call("delete_db", "{}")])),
                "not offered here",
            ),
            (
                reply_with(json!([call("FINISH", r#"{"payload":3}"#)])),
                "payload",
            ),
            (json!({"choices": []}), "choices[0].message"),
            (json!("garbage"), "choices[0].message"),
        ] {
            let reason = parse_reply(&def, &state, &spec, &body)
                .decision
                .unwrap_err();
            assert!(reason.contains(says), "{reason} should say {says}");
        }
    }

    #[test]
    fn templates_fill_run_data() {
        let data = json!({"customer": "Ada", "tier": {"level": 2}});
        assert_eq!(
            render(
                "Hi {{input.customer}} {{ data.tier.level }}{{data.none}} {{other}} {{",
                &data
            ),
            "Hi Ada 2 {{other}} {{"
        );
    }

    #[test]
    fn key_variables_are_checked_at_registration() {
        for (name, says) in [
            ("DATABASE_URL", "worker's own credentials"),
            ("REIN_DATABASE_URL", "worker's own credentials"),
            ("AWS_SECRET_ACCESS_KEY", "worker's own credentials"),
            ("lower", "not an environment variable name"),
            ("A-B", "not an environment variable name"),
        ] {
            let text = DEF.replace(
                "api_key_env = \"OPENAI_API_KEY\"",
                &format!("api_key_env = \"{name}\""),
            );
            let err = parse(&text).unwrap_err();
            assert!(
                err.contains(says) && err.contains("api_key_env"),
                "{name}: {err}"
            );
        }
        assert!(key_env_problem("REIN_MODEL_KEY").is_none());
        assert!(key_env_problem("MY_LLM_KEY").is_none());
    }

    #[test]
    fn the_model_table_is_checked() {
        for (from, to, says) in [
            (
                "model = \"gpt-test\"",
                "model = \"gpt-test\"\nbogus = 1",
                "unknown field",
            ),
            (
                "model = \"gpt-test\"",
                "model = \"gpt-test\"\ntemperature = 3.0",
                "temperature",
            ),
            (
                "model = \"gpt-test\"",
                "model = \"gpt-test\"\nmax_tokens = 0",
                "max_tokens",
            ),
            (
                "model = \"gpt-test\"",
                "model = \"gpt-test\"\nbase_url = \"http://u:p@x/v1\"",
                "credentials",
            ),
            (
                "fatal_event = \"MODEL_FAILED\"",
                "fatal_event = \"APPROVED\"",
                "does not leave",
            ),
            (
                "action = \"model\"",
                "action = \"agent\"",
                "only a state whose action is `model`",
            ),
        ] {
            let err = parse(&DEF.replacen(from, to, 1)).unwrap_err();
            assert!(err.contains(says), "{to}: {err}");
        }
        let start = DEF.find("[states.model]").unwrap();
        let end = DEF.find("[[states.tools]]").unwrap();
        let no_table = format!("{}{}", &DEF[..start], &DEF[end..]);
        let err = parse(&no_table).unwrap_err();
        assert!(err.contains("needs a `[states.model]` table"), "{err}");
    }

    fn ev(seq: u64, kind: &str, payload: Value) -> Event {
        Event::new(seq, kind, payload)
    }

    #[test]
    fn the_conversation_replays_calls_results_and_approvals() {
        let def = def();
        let (_, spec) = acting(&def);
        let input = json!({"task": "Refund order A1", "customer": "Ada"});
        let run = RunState::initial(&def, input.clone());
        let reply = |id: &str, name: &str, args: &str| {
            json!({"reply": {"role": "assistant", "content": null, "tool_calls": [
                {"id": id, "type": "function", "function": {"name": name, "arguments": args}}]}})
        };
        let log = vec![
            ev(
                1,
                MODEL_REPLIED,
                reply("c1", "lookup_order", r#"{"order_id":"A1"}"#),
            ),
            ev(2, "TOOL_SUCCEEDED", json!({"result": {"amount": 150}})),
            ev(
                3,
                MODEL_REPLIED,
                reply("c2", "refund", r#"{"order_id":"A1","amount":150}"#),
            ),
            ev(
                4,
                "APPROVAL_REQUESTED",
                json!({"approval_id": "ap1", "tool": "refund", "args": {"order_id": "A1", "amount": 150}}),
            ),
            ev(5, "APPROVAL_REQUIRED", json!({})),
            ev(
                6,
                "APPROVED",
                json!({"data": {"last_approval": {"granted": true, "approver": "bob"}}}),
            ),
            ev(7, "ACTION_DISPATCHED", json!({"approval_id": "ap1"})),
            ev(8, "TOOL_SUCCEEDED", json!({"result": {"refunded": 150}})),
        ];
        let messages = conversation(&spec, &run, &input, &log);
        let roles: Vec<&str> = messages
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        // The approved call is answered by its own result, under its own id: the model is
        // never asked to make it again.
        assert_eq!(
            roles,
            ["system", "user", "assistant", "tool", "assistant", "tool"]
        );
        assert_eq!(messages[0]["content"], "You help Ada ().");
        assert_eq!(messages[1]["content"], "Refund order A1");
        assert_eq!(messages[3]["tool_call_id"], "c1");
        assert!(messages[3]["content"].as_str().unwrap().contains("150"));
        assert_eq!(messages[4]["tool_calls"][0]["id"], "c2");
        // A tool call without text is sent with "" (a real server refuses null and absent).
        assert_eq!(messages[2]["content"], "", "{}", messages[2]);
        assert_eq!(messages[4]["content"], "");
        assert_eq!(messages[5]["tool_call_id"], "c2");
        let answer = messages[5]["content"].as_str().unwrap();
        assert!(
            answer.contains("refunded") && answer.contains("bob"),
            "{answer}"
        );
        assert!(!answer.contains("again"), "{answer}");

        // Denied: the call is answered with the denial, under its own id.
        let mut denied = log[..5].to_vec();
        denied.push(ev(
            6,
            "DENIED",
            json!({"data": {"last_approval": {"granted": false, "approver": "carol"}}}),
        ));
        let messages = conversation(&spec, &run, &input, &denied);
        let last = messages.last().unwrap();
        assert_eq!(last["tool_call_id"], "c2");
        let said = last["content"].as_str().unwrap();
        assert!(said.contains("denied") && said.contains("carol"), "{said}");

        // A log from before Rein ran approved calls: granted, then the model was asked.
        let mut older = log[..6].to_vec();
        older.push(ev(
            7,
            MODEL_REPLIED,
            reply("c3", "refund", r#"{"order_id":"A1","amount":150}"#),
        ));
        let messages = conversation(&spec, &run, &input, &older);
        let answered = &messages[messages.len() - 3];
        assert_eq!(answered["tool_call_id"], "c2");
        assert!(answered["content"].as_str().unwrap().contains("approved"));
    }

    #[test]
    fn an_interrupted_call_gets_an_answer_and_a_resume_note() {
        let def = def();
        let (_, spec) = acting(&def);
        let input = json!({"task": "t"});
        let run = RunState::initial(&def, input.clone());
        let log = vec![
            ev(
                1,
                MODEL_REPLIED,
                json!({"reply": {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "refund", "arguments": "{}"}}]}}),
            ),
            ev(2, "ACTION_DISPATCHED", json!({})),
            ev(
                3,
                "ACTION_RESULT_IN_DOUBT",
                json!({"reason": "found dispatched without a result after takeover"}),
            ),
            ev(
                4,
                "TOOL_SUCCEEDED",
                json!({"result": {"refunded": true}, "reconciled": true}),
            ),
        ];
        let messages = conversation(&spec, &run, &input, &log);
        let roles: Vec<&str> = messages
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert!(
            messages[4]["content"]
                .as_str()
                .unwrap()
                .contains("interrupted")
        );
        // A reply whose call never got a result is answered before the next reply.
        let cut = vec![log[0].clone(), log[0].clone()];
        let messages = conversation(&spec, &run, &input, &cut);
        let roles: Vec<&str> = messages
            .iter()
            .map(|m| m["role"].as_str().unwrap())
            .collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "tool", "assistant", "tool"]
        );
    }

    #[test]
    fn a_stream_accumulates_into_the_reply() {
        let def = def();
        let (state, spec) = acting(&def);
        let mut s = StreamReply::default();
        let lines = [
            r#"data: {"model":"m-1","choices":[{"index":0,"delta":{"role":"assistant","content":"Look"}}]}"#,
            "",
            ": keep-alive",
            r#"data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c9","type":"function","function":{"name":"lookup_order","arguments":"{\"order"}}]}}]}"#,
            r#"data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"_id\":\"A1\"}"}}]},"finish_reason":"tool_calls"}]}"#,
            r#"data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}"#,
        ];
        let mut deltas = Vec::new();
        for line in lines {
            if let StreamStep::Deltas(d) = s.line(line).unwrap() {
                deltas.extend(d);
            }
        }
        assert!(!s.is_done());
        assert_eq!(s.line("data: [DONE]").unwrap(), StreamStep::Done);
        assert!(s.is_done());
        assert_eq!(deltas[0], json!({"type": "delta", "content": "Look"}));
        assert_eq!(deltas[2]["arguments"], "_id\":\"A1\"}");
        let body = s.finish();
        let r = parse_reply(&def, &state, &spec, &body);
        assert_eq!(
            r.decision,
            Ok(
                json!({"decision": "call_tool", "tool": "lookup_order", "args": {"order_id": "A1"}})
            )
        );
        assert_eq!(r.usage.unwrap()["tokens"], 12);
        assert_eq!(r.message["tool_calls"][0]["id"], "c9");
        assert!(StreamReply::default().line("data: {oops").is_err());
    }

    #[test]
    fn a_prompt_is_recorded_by_hashes_of_its_new_messages() {
        let m = |role: &str, c: &str| json!({"role": role, "content": c});
        let first = vec![m("system", "s"), m("user", "task")];
        let (r1, b1) = prompt_record(&first);
        assert_eq!(r1["new"].as_array().unwrap().len(), 2);
        assert_eq!(b1.len(), 2);
        let mut second = first.clone();
        second.push(m("assistant", "a"));
        second.push(m("tool", "result"));
        let (r2, b2) = prompt_record(&second);
        assert_eq!(r2["parent"], r1["sha256"]);
        assert_eq!(r2["new"].as_array().unwrap().len(), 2);
        assert_eq!(b2.len(), 2);
        assert_eq!(r2["messages"], 4);
        for b in &b2 {
            assert_eq!(b.sha256, sha256_hex(&b.content));
        }
    }

    proptest! {
        #[test]
        fn the_prompt_record_stays_small_however_long_the_run(steps in 1usize..60) {
            let mut messages = vec![json!({"role": "user", "content": "task"})];
            let mut sizes = Vec::new();
            for i in 0..steps {
                messages.push(json!({"role": "assistant", "content": format!("step {i}")}));
                messages.push(json!({"role": "tool", "content": format!("result {i}")}));
                let (record, _) = prompt_record(&messages);
                sizes.push(canonical_json(&record).len());
            }
            let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            prop_assert!(hi - lo <= 4, "record sizes vary: {sizes:?}");
        }

        #[test]
        fn any_reply_is_read_without_panicking(text in ".{0,200}") {
            let def = def();
            let (state, spec) = acting(&def);
            let body = reply_with(json!([call("lookup_order", &text)]));
            let r = parse_reply(&def, &state, &spec, &body);
            if let Ok(d) = r.decision {
                prop_assert_eq!(d["decision"].as_str(), Some("call_tool"));
            }
        }
    }
}
