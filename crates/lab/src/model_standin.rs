//! A stand-in OpenAI-compatible model server for tests and the demo (a model API is an
//! external party, so a fake is allowed). It speaks the published Chat Completions wire
//! format: `POST /v1/chat/completions` (also `/chat/completions`) with `model`, `messages`,
//! `tools`, `tool_choice`, `stream`; it answers `choices[0].message.tool_calls[].function
//! .{name, arguments}`, `usage{prompt_tokens, completion_tokens, total_tokens}` and `model`,
//! or server-sent `chat.completion.chunk` events ending in `data: [DONE]` when asked to
//! stream.
//!
//! Scriptable: a JSON list of replies (from `--script FILE` or `POST /control/script`),
//! taken one per request, each one of
//!
//! ```json
//! {"tool_call": {"name": "refund", "arguments": {"order_id": "A1", "amount": 150}}}
//! {"tool_calls": [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]}
//! {"text": "I think I am done"}
//! {"status": 429, "retry_after_s": 1}      {"status": 500}      {"status": 401}
//! {"status": 400, "code": "context_length_exceeded"}
//! {"raw": "{not json"}                      {"cut_stream": true, "tool_call": {...}}
//! ```
//!
//! with optional `"delay_ms"` (a slow reply), `"repeat": N` (the entry N times) and
//! `"usage": {"prompt_tokens", "completion_tokens"}`. Once the script is used up it plays
//! the support-agent policy: look the order up, refund it, finish (or give up when the
//! refund was denied). `GET /control/requests` returns every request body received, in
//! order.
//!
//! Like llama-cpp-python's server, a stand-in told to (`--refuse-tool-choice-required`,
//! [`StandIn::refuse_tool_choice_required`]) answers 500 to `"tool_choice": "required"`,
//! taking only `auto`, `none` or a named function.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};

/// Most requests the stand-in keeps for `GET /control/requests`.
const REQUESTS_KEPT_MAX: usize = 10_000;
/// Most entries a script may hold (after `repeat`).
const SCRIPT_ENTRIES_MAX: usize = 100_000;

#[derive(Default)]
struct Inner {
    script: Mutex<VecDeque<Value>>,
    requests: Mutex<Vec<Value>>,
    authorizations: Mutex<Vec<Option<String>>>,
    /// When each kept request arrived (for `rein bench --model`).
    arrivals: Mutex<Vec<std::time::Instant>>,
    /// Answer 500 to `"tool_choice": "required"`, as llama-cpp-python's server does.
    refuse_required: std::sync::atomic::AtomicBool,
}

/// A running stand-in's shared state.
#[derive(Clone, Default)]
pub struct StandIn {
    inner: Arc<Inner>,
}

impl StandIn {
    /// A stand-in that plays `script` first (see the module docs).
    pub fn with_script(script: &Value) -> Result<StandIn, String> {
        let standin = StandIn::default();
        standin.set_script(script)?;
        Ok(standin)
    }

    fn set_script(&self, script: &Value) -> Result<(), String> {
        let Some(entries) = script.as_array() else {
            return Err("a script is a JSON list of replies".into());
        };
        let mut out = VecDeque::new();
        for entry in entries {
            if !entry.is_object() {
                return Err(format!("a script entry is an object, not {entry}"));
            }
            let repeat = entry.get("repeat").and_then(Value::as_u64).unwrap_or(1);
            for _ in 0..repeat {
                if out.len() >= SCRIPT_ENTRIES_MAX {
                    return Err(format!(
                        "a script holds at most {SCRIPT_ENTRIES_MAX} replies"
                    ));
                }
                out.push_back(entry.clone());
            }
        }
        *self.inner.script.lock().unwrap_or_else(|e| e.into_inner()) = out;
        Ok(())
    }

    /// From now on, answer 500 to `"tool_choice": "required"` (as llama-cpp-python's
    /// OpenAI-compatible server does), before any scripted reply is taken.
    pub fn refuse_tool_choice_required(&self) {
        self.inner
            .refuse_required
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The request bodies received so far.
    pub fn requests(&self) -> Vec<Value> {
        self.inner
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// When each request received arrived, in order (parallel to [`StandIn::requests`]).
    pub fn arrivals(&self) -> Vec<std::time::Instant> {
        self.inner
            .arrivals
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The `Authorization` header of each request received, in order.
    pub fn authorizations(&self) -> Vec<Option<String>> {
        self.inner
            .authorizations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/chat/completions", post(completions))
            .route("/chat/completions", post(completions))
            .route("/control/script", post(script))
            .route("/control/requests", get(requests))
            .route("/healthz", get(|| async { "ok" }))
            .with_state(self.clone())
    }

    /// Serves on `listener` until the process ends.
    pub async fn serve(self, listener: tokio::net::TcpListener) -> std::io::Result<()> {
        axum::serve(listener, self.router()).await
    }
}

async fn script(State(s): State<StandIn>, body: axum::body::Bytes) -> Response {
    let parsed = serde_json::from_slice::<Value>(&body).map_err(|e| e.to_string());
    match parsed.and_then(|v| s.set_script(&v)) {
        Ok(()) => (StatusCode::OK, "ok").into_response(),
        Err(e) => (StatusCode::BAD_REQUEST, e).into_response(),
    }
}

async fn requests(State(s): State<StandIn>) -> Response {
    axum::Json(Value::Array(s.requests())).into_response()
}

async fn completions(
    State(s): State<StandIn>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let arrived = std::time::Instant::now();
    let Ok(request) = serde_json::from_slice::<Value>(&body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "the body is not JSON",
        );
    };
    {
        let mut kept = s.inner.requests.lock().unwrap_or_else(|e| e.into_inner());
        if kept.len() < REQUESTS_KEPT_MAX {
            kept.push(request.clone());
            s.inner
                .arrivals
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(arrived);
            let auth = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            s.inner
                .authorizations
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(auth);
        }
    }
    if request.get("model").and_then(Value::as_str).is_none()
        || !request.get("messages").is_some_and(Value::is_array)
    {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "`model` and `messages` are required",
        );
    }
    if s.inner
        .refuse_required
        .load(std::sync::atomic::Ordering::Relaxed)
        && request.get("tool_choice").and_then(Value::as_str) == Some("required")
    {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_server_error",
            "tool_choice 'required' is not supported: use 'auto', 'none' or a named function",
        );
    }
    let entry = s
        .inner
        .script
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .pop_front()
        .unwrap_or_else(|| support_agent(&request));
    if let Some(ms) = entry.get("delay_ms").and_then(Value::as_u64) {
        tokio::time::sleep(Duration::from_millis(ms.min(600_000))).await;
    }
    if let Some(status) = entry.get("status").and_then(Value::as_u64) {
        let status = StatusCode::from_u16(u16::try_from(status).unwrap_or(500))
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let code = entry
            .get("code")
            .and_then(Value::as_str)
            .unwrap_or("stand_in_error");
        let mut response = error(status, code, "scripted failure");
        if let Some(s) = entry.get("retry_after_s").and_then(Value::as_u64)
            && let Ok(v) = HeaderValue::from_str(&s.to_string())
        {
            response.headers_mut().insert(header::RETRY_AFTER, v);
        }
        return response;
    }
    if let Some(raw) = entry.get("raw").and_then(Value::as_str) {
        return (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            raw.to_owned(),
        )
            .into_response();
    }
    let model = format!(
        "{}-standin-2026-01",
        request["model"].as_str().unwrap_or("model")
    );
    let calls: Vec<Value> = match (entry.get("tool_call"), entry.get("tool_calls")) {
        (Some(one), _) => vec![one.clone()],
        (None, Some(Value::Array(many))) => many.clone(),
        _ => Vec::new(),
    };
    let calls: Vec<(String, String, String)> = calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let arguments = match &c["arguments"] {
                Value::String(s) => s.clone(),
                Value::Null => "{}".to_owned(),
                other => other.to_string(),
            };
            (
                format!("call_{}_{i}", s.requests().len()),
                c["name"].as_str().unwrap_or("").to_owned(),
                arguments,
            )
        })
        .collect();
    let content = entry.get("text").and_then(Value::as_str).map(str::to_owned);
    let prompt_tokens = entry["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap_or_else(|| (request["messages"].to_string().len() / 4) as u64);
    let completion_tokens = entry["usage"]["completion_tokens"]
        .as_u64()
        .unwrap_or_else(|| {
            let said: usize = calls.iter().map(|c| c.1.len() + c.2.len()).sum::<usize>()
                + content.as_deref().map_or(0, str::len);
            (said / 4 + 5) as u64
        });
    let usage = json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    });
    if request["stream"] == json!(true) {
        let cut = entry["cut_stream"] == json!(true);
        return stream(&model, content.as_deref(), &calls, &usage, cut);
    }
    let mut message = json!({ "role": "assistant", "content": content });
    if !calls.is_empty() {
        message["tool_calls"] = calls
            .iter()
            .map(|(id, name, arguments)| {
                json!({ "id": id, "type": "function", "function": { "name": name, "arguments": arguments } })
            })
            .collect();
    }
    axum::Json(json!({
        "id": format!("chatcmpl-{}", s.requests().len()),
        "object": "chat.completion",
        "model": model,
        "choices": [{
            "index": 0,
            "message": message,
            "finish_reason": if calls.is_empty() { "stop" } else { "tool_calls" },
        }],
        "usage": usage,
    }))
    .into_response()
}

fn error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        axum::Json(json!({ "error": { "message": message, "type": code, "code": code } })),
    )
        .into_response()
}

/// The reply as server-sent chunks: content a few characters at a time, each call's
/// arguments in three fragments, usage last, then `[DONE]` (left out when `cut`).
fn stream(
    model: &str,
    content: Option<&str>,
    calls: &[(String, String, String)],
    usage: &Value,
    cut: bool,
) -> Response {
    let chunk = |delta: Value, finish: Option<&str>| {
        let c = json!({
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [{ "index": 0, "delta": delta, "finish_reason": finish }],
        });
        format!("data: {c}\n\n")
    };
    let mut out = chunk(json!({ "role": "assistant", "content": "" }), None);
    if let Some(text) = content {
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(4) {
            out.push_str(&chunk(
                json!({ "content": piece.iter().collect::<String>() }),
                None,
            ));
        }
    }
    for (index, (id, name, arguments)) in calls.iter().enumerate() {
        out.push_str(&chunk(
            json!({ "tool_calls": [{ "index": index, "id": id, "type": "function",
                                     "function": { "name": name, "arguments": "" } }] }),
            None,
        ));
        let chars: Vec<char> = arguments.chars().collect();
        let size = chars.len().div_ceil(3).max(1);
        for piece in chars.chunks(size) {
            out.push_str(&chunk(
                json!({ "tool_calls": [{ "index": index,
                                         "function": { "arguments": piece.iter().collect::<String>() } }] }),
                None,
            ));
        }
    }
    if cut {
        // The connection ends in the middle of the reply.
        return (
            [(header::CONTENT_TYPE, "text/event-stream")],
            Body::from(out),
        )
            .into_response();
    }
    out.push_str(&chunk(
        json!({}),
        Some(if calls.is_empty() {
            "stop"
        } else {
            "tool_calls"
        }),
    ));
    let last =
        json!({ "object": "chat.completion.chunk", "model": model, "choices": [], "usage": usage });
    out.push_str(&format!("data: {last}\n\ndata: [DONE]\n\n"));
    (
        [(header::CONTENT_TYPE, "text/event-stream")],
        Body::from(out),
    )
        .into_response()
}

/// The support agent of the demo: look up the order, refund it, finish; give up when the
/// refund was denied. Like a sloppy model, it never repeats a call: a refund that needs
/// approval is run by the engine once granted, and its result is what the agent sees next. It reads the order from the task (`order_id`, `amount` in the run
/// input) and where it is from the conversation.
fn support_agent(request: &Value) -> Value {
    let empty = Vec::new();
    let messages = request["messages"].as_array().unwrap_or(&empty);
    let task: Value = messages
        .iter()
        .find(|m| m["role"] == "user")
        .and_then(|m| m["content"].as_str())
        .and_then(|t| serde_json::from_str(t).ok())
        .unwrap_or(Value::Null);
    let order_id = task["order_id"].as_str().unwrap_or("A1").to_owned();
    let amount = task.get("amount").cloned().unwrap_or(json!(25));
    let last_call = messages
        .iter()
        .rev()
        .find_map(|m| m["tool_calls"][0]["function"]["name"].as_str());
    let last = messages.last();
    let last_text = last.and_then(|m| m["content"].as_str()).unwrap_or("");
    // A denial answers the refund's own call (`"status":"denied"`); logs from before Rein
    // answered it that way said it in a user message.
    let denied = last_text.contains(r#""status":"denied""#)
        || (last.is_some_and(|m| m["role"] == "user") && last_text.contains(" denied the call"));
    let call = |name: &str, arguments: Value| json!({ "tool_call": { "name": name, "arguments": arguments } });
    match last_call {
        _ if denied => call(
            "GIVE_UP",
            json!({ "payload": { "reason": "the refund was denied" } }),
        ),
        None => call("lookup_order", json!({ "order_id": order_id })),
        Some("lookup_order") => call("refund", json!({ "order_id": order_id, "amount": amount })),
        Some("refund") => call(
            "FINISH",
            json!({ "payload": { "data": { "summary": format!("refunded {amount} on order {order_id}") } } }),
        ),
        Some(_) => call("FINISH", json!({})),
    }
}

/// `rein stand-in-model --listen ADDR [--script FILE]`: serves until killed; prints
/// `listening on ADDR` once it accepts connections.
#[derive(clap::Args, Debug)]
pub struct StandInArgs {
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// A JSON file with the list of replies to play first.
    #[arg(long)]
    pub script: Option<std::path::PathBuf>,
    /// Answer 500 to `"tool_choice": "required"`, as llama-cpp-python's server does.
    #[arg(long)]
    pub refuse_tool_choice_required: bool,
}

pub async fn stand_in_model(args: StandInArgs) -> u8 {
    let script = match &args.script {
        None => json!([]),
        Some(path) => match std::fs::read(path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<Value>(&b).map_err(|e| e.to_string()))
        {
            Ok(v) => v,
            Err(e) => {
                eprintln!("error: --script {}: {e}", path.display());
                return rein_process::exit::INPUT;
            }
        },
    };
    let standin = match StandIn::with_script(&script) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: --script: {e}");
            return rein_process::exit::INPUT;
        }
    };
    if args.refuse_tool_choice_required {
        standin.refuse_tool_choice_required();
    }
    let listener = match tokio::net::TcpListener::bind(args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: cannot listen on {}: {e}", args.listen);
            return rein_process::exit::INPUT;
        }
    };
    match listener.local_addr() {
        Ok(addr) => println!("listening on {addr}"),
        Err(e) => {
            eprintln!("error: {e}");
            return rein_process::exit::INPUT;
        }
    }
    match standin.serve(listener).await {
        Ok(()) => rein_process::exit::OK,
        Err(e) => {
            eprintln!("error: {e}");
            rein_process::exit::INPUT
        }
    }
}
