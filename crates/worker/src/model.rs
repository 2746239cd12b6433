//! The `model` action: asks an OpenAI-compatible Chat Completions endpoint
//! (`POST {base_url}/chat/completions`) what the run does next. What is sent and how the
//! reply is read is pure and lives in [`rein_core::model`]; this module does the call.
//!
//! - The API key comes from the worker's environment variable the definition names in
//!   `api_key_env`, which must be on the worker's allow-list (`--model-key-env`, or bound
//!   with `--model-key`); it is sent as `Authorization: Bearer`, only to an endpoint the key
//!   is bound to ([`rein_core::model_keys`]; otherwise the call is fatal, `key_not_bound`,
//!   and nothing is sent), and never written to an event or a log line.
//! - `base_url` (or the worker's `REIN_MODEL_URL`) passes the worker's egress policy like an
//!   http node's URL.
//! - Failures (SPEC R2): connect errors, timeouts, 408, 429, 5xx and a stream cut short are
//!   transient, with `Retry-After` honoured, committed as the table's `transient_event`;
//!   400 (`context_length_exceeded` named), 401, 403, 404 and a key the worker lacks are
//!   fatal, as `fatal_event`, with a reason saying what to fix. Without those events the run
//!   waits for an operator with the same reason. A malformed 2xx reply is a decision
//!   rejected at step `parse`. The call has no side effect: nothing is dispatched, and a
//!   retry simply asks again.
//! - `stream = true` reads server-sent events, publishes each delta to watchers of the run
//!   ([`rein_accel::stream`]) and commits only the final message.

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use rein_core::Event;
use rein_core::definition::{ModelSpec, StateSpec};
use rein_core::model::{self as pure, StreamReply, StreamStep};
use rein_core::model_keys::{self, KeyBindings};
use rein_core::retry::{Failure, kind};
use rein_store::Store;
use serde_json::{Value, json};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::handler::{ActionContext, BoxFuture, ModelReply, NodeHandler, Outcome};
use crate::http::{Admission, Http, admit, error_chain, retry_after_s};

/// Largest reply body read from a model endpoint.
pub const REPLY_BYTES_MAX: usize = 4 * 1024 * 1024;
/// Longest error `type` or `code` of an endpoint's error reply named in the failure; a
/// longer one, or one that is not an identifier, is left out (the provider's prose is never
/// copied into the log, which every `read` token can see).
const ERROR_IDENTIFIER_LEN_MAX: usize = 64;

/// How a worker's model actions call out.
#[derive(Debug, Clone)]
pub struct ModelOptions {
    /// Environment variables a definition may name as its `api_key_env`.
    pub key_envs: Vec<String>,
    /// Used when a definition gives no `base_url` (the worker's `REIN_MODEL_URL`).
    pub default_base_url: Option<String>,
    /// Where each key may be sent (`--model-key`).
    pub keys: KeyBindings,
}

impl Default for ModelOptions {
    /// The defaults, with this process's `REIN_MODEL_URL`.
    fn default() -> Self {
        let default_base_url = std::env::var("REIN_MODEL_URL")
            .ok()
            .filter(|u| !u.is_empty());
        ModelOptions {
            key_envs: pure::KEY_ENV_DEFAULTS
                .iter()
                .map(|s| (*s).to_owned())
                .collect(),
            keys: KeyBindings::new(Vec::new(), default_base_url.as_deref()).unwrap_or_default(),
            default_base_url,
        }
    }
}

impl ModelOptions {
    /// [`ModelOptions::default`] with the bindings of this process's `REIN_MODEL_KEYS`
    /// (`NAME=URL[,URL…]`, `;` between bindings), whose names join the allow-list.
    pub fn from_env() -> Result<ModelOptions, String> {
        let mut options = ModelOptions::default();
        let given = std::env::var("REIN_MODEL_KEYS")
            .unwrap_or_default()
            .split(';')
            .filter(|b| !b.trim().is_empty())
            .map(model_keys::Binding::parse)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("REIN_MODEL_KEYS: {e}"))?;
        for binding in &given {
            if !options.key_envs.contains(&binding.name) {
                options.key_envs.push(binding.name.clone());
            }
        }
        options.keys = KeyBindings::new(given, options.default_base_url.as_deref())?;
        Ok(options)
    }

    /// Refuses an allow-list naming a variable no definition may read.
    pub fn validate(&self) -> Result<(), String> {
        if self.key_envs.len() > 64 {
            return Err("give at most 64 --model-key-env variables".into());
        }
        for name in &self.key_envs {
            if let Some(problem) = pure::key_env_problem(name) {
                return Err(format!("--model-key-env: {problem}"));
            }
        }
        Ok(())
    }
}

/// The `model` action.
#[derive(Clone)]
pub struct Model {
    store: Store,
    http: Http,
    options: Arc<ModelOptions>,
}

impl Model {
    /// A model action calling out through `http`'s egress policy and clients.
    pub fn new(store: Store, http: Http, options: ModelOptions) -> Model {
        Model {
            store,
            http,
            options: Arc::new(options),
        }
    }
}

/// How a call failed, before it becomes the table's event.
enum Failed {
    Transient(Failure),
    Fatal(Failure),
}

fn failed(spec: &ModelSpec, failed: Failed) -> Outcome {
    let (event, failure) = match failed {
        Failed::Transient(f) => (spec.transient_event.as_deref(), f),
        Failed::Fatal(f) => (spec.fatal_event.as_deref(), f),
    };
    match event {
        Some(event) => Outcome::failed(event, &failure),
        // Not dispatched: the runtime records it as needing an operator, with this reason.
        None => Outcome::InDoubt(format!(
            "model call failed ({}): {}",
            failure.kind, failure.message
        )),
    }
}

fn fatal(kind: &str, message: String) -> Failed {
    Failed::Fatal(Failure::fatal(kind, &message))
}

impl NodeHandler for Model {
    fn side_effect(&self, _ctx: &ActionContext) -> bool {
        false
    }

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome> {
        let this = self.clone();
        Box::pin(async move {
            let Some(state) = ctx.definition.state(&ctx.node).cloned() else {
                return Outcome::InDoubt(format!("state {} is not declared", ctx.node));
            };
            let Some(spec) = state.model.clone() else {
                return Outcome::InDoubt(format!(
                    "state {} has no `[states.model]` table; nothing was sent",
                    ctx.node
                ));
            };
            let span = tracing::info_span!(
                "gen_ai.chat",
                otel.name = %format!("chat {}", spec.model),
                gen_ai.operation.name = "chat",
                gen_ai.system = "openai",
                gen_ai.request.model = %spec.model,
                gen_ai.request.max_tokens = spec.max_tokens,
                gen_ai.request.temperature = spec.temperature,
            );
            let outcome = match this
                .call(&ctx, &state, &spec)
                .instrument(span.clone())
                .await
            {
                Ok(reply) => {
                    if let Some(m) = reply.replied.get("model").and_then(Value::as_str) {
                        span.set_attribute("gen_ai.response.model", m.to_owned());
                    }
                    let usage = &reply.replied["usage"];
                    for (key, attr) in [
                        ("input_tokens", "gen_ai.usage.input_tokens"),
                        ("output_tokens", "gen_ai.usage.output_tokens"),
                    ] {
                        if let Some(n) = usage.get(key).and_then(Value::as_i64) {
                            span.set_attribute(attr, n);
                        }
                    }
                    Outcome::Model(reply)
                }
                Err(f) => failed(&spec, f),
            };
            crate::trace::record_outcome(&span, &outcome);
            outcome
        })
    }
}

impl Model {
    /// The key to send to `base`, read only once the key may go there.
    fn key(&self, spec: &ModelSpec, base: &str) -> Result<Option<String>, Failed> {
        let Some(name) = &spec.api_key_env else {
            return Ok(None);
        };
        if let Some(problem) = pure::key_env_problem(name) {
            return Err(fatal("key_refused", problem));
        }
        if !self.options.key_envs.iter().any(|k| k == name) {
            return Err(fatal(
                "key_refused",
                format!(
                    "`{name}` is not on this worker's key allow-list ({}); start the worker with --model-key-env {name} or name an allowed variable",
                    self.options.key_envs.join(", ")
                ),
            ));
        }
        if let Err(not_bound) = self.options.keys.check(name, base) {
            return Err(fatal(
                model_keys::KEY_NOT_BOUND,
                format!("{not_bound}; nothing was sent"),
            ));
        }
        match std::env::var(name) {
            Ok(key) if !key.is_empty() => Ok(Some(key)),
            _ => Err(fatal(
                "unauthorized",
                format!(
                    "unauthorized: the worker has no {name} set; set it in the worker's environment"
                ),
            )),
        }
    }

    async fn conversation(
        &self,
        ctx: &ActionContext,
        spec: &ModelSpec,
    ) -> Result<Vec<Value>, Failed> {
        let unreadable = |e: rein_store::StoreError| {
            Failed::Transient(Failure::transient(
                "store",
                &format!("cannot read the run's log to build the conversation: {e}"),
            ))
        };
        let input = self.store.run_input(ctx.run_id).await.map_err(unreadable)?;
        // A fork continues its source's conversation up to where it was forked.
        let log: Vec<Event> = self
            .store
            .lineage(ctx.run_id)
            .await
            .map_err(unreadable)?
            .into_iter()
            .map(|e| Event::new(u64::try_from(e.sequence).unwrap_or(0), e.kind, e.payload))
            .collect();
        let log = resolve_blobs(&self.store, ctx.run_id, log)
            .await
            .map_err(unreadable)?;
        Ok(pure::conversation(spec, &ctx.run, &input, &log))
    }

    async fn call(
        &self,
        ctx: &ActionContext,
        state: &StateSpec,
        spec: &ModelSpec,
    ) -> Result<ModelReply, Failed> {
        let Some(base) = spec
            .base_url
            .clone()
            .or_else(|| self.options.default_base_url.clone())
        else {
            return Err(fatal(
                "no_endpoint",
                "the model table gives no base_url and the worker has no REIN_MODEL_URL; set one of them".into(),
            ));
        };
        let key = self.key(spec, &base)?;
        let text = format!("{}/chat/completions", base.trim_end_matches('/'));
        let (egress, clients) = self.http.parts();
        let (url, client) = match admit(&egress, &clients, &text).await {
            Ok(admitted) => admitted,
            Err(Admission::Refused(refused)) => return Err(egress_refused(&refused)),
            Err(Admission::NoClient(e)) => {
                return Err(Failed::Transient(Failure::transient(kind::NETWORK, &e)));
            }
        };
        let messages = self.conversation(ctx, spec).await?;
        let body = pure::request_body(&ctx.definition, state, spec, &messages);
        let mut request = client.post(url).json(&body);
        if let Some(key) = &key {
            request = request.bearer_auth(key);
        }
        let exchange = async {
            let response = request.send().await.map_err(|e| {
                // The policy refused the address the host name resolved to: asking again
                // resolves to the same refusal.
                if let Some(refused) = crate::egress::refusal_in(&e) {
                    return egress_refused(refused);
                }
                let what = if e.is_connect() {
                    kind::NETWORK
                } else {
                    kind::IN_DOUBT
                };
                Failed::Transient(Failure::transient(
                    what,
                    &format!("model endpoint unreachable: {}", error_chain(&e)),
                ))
            })?;
            let status = response.status().as_u16();
            if !(200..300).contains(&status) {
                return Err(error_reply(spec, response).await);
            }
            if spec.stream {
                read_stream(ctx, response).await
            } else {
                let bytes = read_body(response).await?;
                Ok(serde_json::from_slice::<Value>(&bytes).unwrap_or_else(
                    |e| json!({ "unreadable": format!("the reply is not JSON: {e}") }),
                ))
            }
        };
        let timeout = Duration::from_millis(spec.timeout_ms);
        let reply_body = tokio::select! {
            r = tokio::time::timeout(timeout, exchange) => match r {
                Ok(r) => r?,
                Err(_) => return Err(Failed::Transient(Failure::transient(
                    kind::TIMEOUT,
                    &format!("the model gave no complete reply within {} ms (timeout_ms)", spec.timeout_ms),
                ))),
            },
            _ = ctx.cancel.cancelled() => return Err(Failed::Transient(Failure::transient(
                kind::IN_DOUBT, "cancelled while the model call was in flight"))),
        };
        let mut reply = pure::parse_reply(&ctx.definition, state, spec, &reply_body);
        if let Some(why) = reply_body.get("unreadable").and_then(Value::as_str) {
            reply.decision = Err(why.to_owned());
        }
        let (prompt, blobs) = pure::prompt_record(&messages);
        Ok(ModelReply {
            decision: reply.decision.clone(),
            replied: pure::replied_payload(spec, prompt, &reply),
            blobs,
        })
    }
}

fn egress_refused(refused: &crate::egress::Refused) -> Failed {
    fatal(
        kind::EGRESS_REFUSED,
        format!(
            "the worker's egress policy refuses the model endpoint: {} (rule {}); nothing was sent",
            refused.reason, refused.rule
        ),
    )
}

/// Blob references among the top-level payload fields of the log (SPEC E5: a large tool
/// result, a reply, a call's arguments) are read back, so the conversation quotes what the
/// tools returned and the model said, not where it is stored. Each blob is read once, and
/// only when `run_id` (or a run it was forked from) recorded it: a reference it did not
/// stays as it is.
async fn resolve_blobs(
    store: &Store,
    run_id: uuid::Uuid,
    mut log: Vec<Event>,
) -> Result<Vec<Event>, rein_store::StoreError> {
    let mut read: std::collections::HashMap<String, Value> = std::collections::HashMap::new();
    for event in log.iter_mut() {
        let Some(fields) = event.payload.as_object_mut() else {
            continue;
        };
        for value in fields.values_mut() {
            let Some(blob) = rein_core::blob::reference_of(value) else {
                continue;
            };
            if let Some(known) = read.get(&blob.sha256) {
                *value = known.clone();
                continue;
            }
            let Some(content) = store.read_blob_of(run_id, &blob).await? else {
                continue;
            };
            read.insert(blob.sha256.clone(), content.clone());
            *value = content;
        }
    }
    Ok(log)
}

async fn read_body(mut response: reqwest::Response) -> Result<Vec<u8>, Failed> {
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > REPLY_BYTES_MAX {
                    return Err(fatal(
                        kind::BAD_REPLY,
                        format!("the model's reply is larger than {REPLY_BYTES_MAX} bytes"),
                    ));
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(body),
            Err(e) => {
                return Err(Failed::Transient(Failure::transient(
                    "reply_cut",
                    &format!("the reply was cut short: {}", error_chain(&e)),
                )));
            }
        }
    }
}

/// Reads a server-sent event stream, publishing deltas as they come; a stream that ends
/// before `data: [DONE]` was cut, which is transient.
async fn read_stream(
    ctx: &ActionContext,
    mut response: reqwest::Response,
) -> Result<Value, Failed> {
    let run_id = ctx.run_id.to_string();
    let mut stream = StreamReply::default();
    let mut pending: Vec<u8> = Vec::new();
    let cut = |why: String| {
        Failed::Transient(Failure::transient(
            "stream_cut",
            &format!("the model's stream was cut before it finished: {why}"),
        ))
    };
    loop {
        let chunk = match response.chunk().await {
            Ok(Some(chunk)) => chunk,
            Ok(None) => break,
            Err(e) => return Err(cut(error_chain(&e))),
        };
        pending.extend_from_slice(&chunk);
        if pending.len() > REPLY_BYTES_MAX {
            return Err(fatal(kind::BAD_REPLY, "a stream line is too long".into()));
        }
        while let Some(end) = pending.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            match stream.line(line.trim_end_matches(['\r', '\n'])) {
                Ok(StreamStep::Deltas(deltas)) => {
                    for d in deltas {
                        ctx.deltas.send(&run_id, d.to_string());
                    }
                }
                Ok(StreamStep::Done) => {
                    ctx.deltas
                        .send(&run_id, json!({ "type": "reply_done" }).to_string());
                    return Ok(stream.finish());
                }
                Err(why) => {
                    return Ok(json!({ "unreadable": format!("malformed stream: {why}") }));
                }
            }
        }
    }
    Err(cut("the connection closed without `data: [DONE]`".into()))
}

/// Whether an endpoint's error `type` or `code` is a short identifier that may be named.
fn is_identifier(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= ERROR_IDENTIFIER_LEN_MAX
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// What an endpoint's error reply was, without its prose: its `type` and `code` when they
/// are identifiers, and its size.
fn error_description(error_type: Option<&str>, code: Option<&str>, size: &str) -> String {
    let mut parts = Vec::new();
    if let Some(t) = error_type {
        parts.push(format!("type {t}"));
    }
    if let Some(c) = code.filter(|c| Some(*c) != error_type) {
        parts.push(format!("code {c}"));
    }
    parts.push(format!("a body of {size}"));
    format!(" (the endpoint's error: {})", parts.join(", "))
}

/// The failure an error status stands for, with what to fix.
async fn error_reply(spec: &ModelSpec, response: reqwest::Response) -> Failed {
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| retry_after_s(v, Utc::now()));
    let body = read_body(response).await;
    let size = match &body {
        Ok(bytes) => format!("{} bytes", bytes.len()),
        Err(_) => format!("over {REPLY_BYTES_MAX} bytes or cut short"),
    };
    let error = body
        .ok()
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .unwrap_or(Value::Null);
    let error = &error["error"];
    let identifier = |field: &str| {
        error[field]
            .as_str()
            .filter(|v| is_identifier(v))
            .map(str::to_owned)
    };
    let (error_type, error_code) = (identifier("type"), identifier("code"));
    let code = error_code
        .clone()
        .or_else(|| error_type.clone())
        .unwrap_or_default();
    let said = error_description(error_type.as_deref(), error_code.as_deref(), &size);
    let key = spec.api_key_env.as_deref().unwrap_or("the API key");
    let mut failure = match status {
        408 | 429 | 500..=599 => {
            return Failed::Transient(
                Failure::from_http_status(
                    status,
                    retry_after,
                    &format!("model endpoint answered {status}{said}"),
                )
                .unwrap_or_else(|| Failure::transient(kind::HTTP_5XX, "model endpoint failed")),
            );
        }
        400 if code == "context_length_exceeded" => Failure::fatal(
            "context_length_exceeded",
            &format!(
                "context_length_exceeded: the conversation is longer than model `{}` takes; lower max_tokens, shorten the system prompt or the tool results, or use a model with a longer context{said}",
                spec.model
            ),
        ),
        400 => Failure::fatal(
            "bad_request",
            &format!("bad request: the endpoint refused the request{said}"),
        ),
        401 => Failure::fatal("unauthorized", &format!("unauthorized: check {key}{said}")),
        403 => Failure::fatal(
            "forbidden",
            &format!(
                "forbidden: the key in {key} may not use model `{}`{said}",
                spec.model
            ),
        ),
        404 => Failure::fatal(
            "not_found",
            &format!(
                "not found: check base_url and the model name `{}`{said}",
                spec.model
            ),
        ),
        _ => Failure::fatal(
            kind::of_http_status(status),
            &format!("model endpoint answered {status}{said}"),
        ),
    };
    failure.status = Some(status);
    Failed::Fatal(failure)
}
