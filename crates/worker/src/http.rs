//! The `http` node action (SPEC I2): the node is an HTTP endpoint, in any language. Rein
//! POSTs the run context to the state's `http.url` with the step's idempotency key and the
//! fencing token, and commits what the JSON reply says.
//!
//! Reply `2xx` with `{"events": [{"type": T, "payload": {..}?}, ..]}` (several are
//! candidates; the definition's priority picks one) or `{"decision": {..}}` (a model
//! decision the engine validates). Failures go through [`rein_core::retry::Failure`], with
//! a fine class a retry policy's `non_retryable` may name: connect errors (`network`), 408
//! (`timeout`), 429 (`http_429`) and 5xx (`http_5xx`) commit `http.transient_event`; other
//! 4xx, 3xx and malformed replies (`bad_reply`, rejected at step `parse`, e.g. a reply
//! holding a NUL character) commit `http.fatal_event`; a timeout or a lost connection after
//! the request was sent is in doubt, and `http.reconcile_url` is asked about it by
//! idempotency key before anything is sent again (SPEC X7). Text quoted from a reply has NUL
//! replaced with U+FFFD, so one node's bytes cannot make its result unstorable.
//!
//! Every call first passes the worker's egress policy ([`crate::egress`]): a URL it refuses
//! commits `http.fatal_event` with reason `egress_refused` and the rule in `error.rule`,
//! and nothing is sent. An error reply's body is not recorded, since the event log is read
//! by every `read` token and a node may be tricked into answering with another service's
//! secrets: the error says its status, content type, length and SHA-256 instead. A worker
//! started with `--http-quote-error-bodies` quotes its first 512 bytes as well.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use rein_core::EngineEvent;
use rein_core::definition::HttpSpec;
use rein_core::retry::{ErrorClass, Failure, kind};
use serde_json::{Map, Value, json};

use crate::egress::{Policy, Refused};
use crate::handler::{ActionContext, BoxFuture, NodeHandler, Outcome, Reconciled};

/// Largest request body an http node sends.
pub const REQUEST_BYTES_MAX: usize = 1024 * 1024;
/// Largest reply body an http node reads.
pub const REPLY_BYTES_MAX: usize = 1024 * 1024;
/// Most candidate events one reply may carry.
pub const REPLY_EVENTS_MAX: usize = 32;
/// Longest event type a reply may name.
const EVENT_TYPE_LEN_MAX: usize = 128;
/// Results repeated in the request's `resume` brief.
const RESUME_RESULTS: usize = 3;
/// Results kept when the full list would make the request too large.
const RESULTS_WHEN_TRIMMED: usize = 8;
/// How much of an error reply's body is quoted in the error event, when bodies are quoted.
const ERROR_SNIPPET_BYTES: usize = 512;
/// Longest content type an error names.
const CONTENT_TYPE_LEN_MAX: usize = 64;
/// Time allowed to open a connection. A connect error means nothing was sent (transient);
/// a call whose whole `timeout_ms` passes first is in doubt, which is never unsafe.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Most ports a handler keeps a pooled client for; calls on further ports get a client of
/// their own, which is dropped after the call.
const PORT_CLIENTS_MAX: usize = 64;

/// How a worker's http nodes call out.
#[derive(Debug, Default)]
pub struct HttpOptions {
    /// Where calls may connect.
    pub egress: Policy,
    /// Quote the first [`ERROR_SNIPPET_BYTES`] of an error reply's body in the error event
    /// (off: only its status, content type, length and hash are recorded).
    pub quote_error_bodies: bool,
}

/// The `http` node action. One client per port called (its resolver checks addresses for
/// that port, [`Policy::resolver`]): connections are pooled across calls.
#[derive(Clone)]
pub struct Http {
    egress: Arc<Policy>,
    clients: Arc<Mutex<HashMap<u16, reqwest::Client>>>,
    quote_error_bodies: bool,
}

impl Default for Http {
    fn default() -> Self {
        Http::new()
    }
}

impl Http {
    /// Calls anywhere but the ranges [`Policy::new`] refuses; error bodies are not quoted.
    pub fn new() -> Http {
        Http::with_options(HttpOptions::default())
    }

    /// The egress policy and pooled clients, for another action that calls out the same way.
    pub(crate) fn parts(&self) -> (Arc<Policy>, Arc<Mutex<HashMap<u16, reqwest::Client>>>) {
        (self.egress.clone(), self.clients.clone())
    }

    pub fn with_options(options: HttpOptions) -> Http {
        Http {
            egress: Arc::new(options.egress),
            clients: Arc::default(),
            quote_error_bodies: options.quote_error_bodies,
        }
    }
}

/// Checks `text` against the egress policy and picks the client for its port.
pub(crate) async fn admit(
    egress: &Arc<Policy>,
    clients: &Mutex<HashMap<u16, reqwest::Client>>,
    text: &str,
) -> Result<(url::Url, reqwest::Client), Admission> {
    let url = egress.check_url(text).await.map_err(Admission::Refused)?;
    let port = url
        .port_or_known_default()
        .ok_or_else(|| Admission::NoClient(format!("{text} names no port")))?;
    let mut clients = clients.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(client) = clients.get(&port) {
        return Ok((url, client.clone()));
    }
    let client = reqwest::Client::builder()
        // A POST is never re-sent somewhere else: a 3xx is the node's answer.
        .redirect(reqwest::redirect::Policy::none())
        // Connect only to addresses the policy checked: a proxy would choose its own.
        .no_proxy()
        .dns_resolver(egress.resolver(port))
        .connect_timeout(CONNECT_TIMEOUT)
        .pool_idle_timeout(Duration::from_secs(30))
        .user_agent(concat!("rein/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| Admission::NoClient(format!("cannot build the HTTP client: {e}")))?;
    if clients.len() < PORT_CLIENTS_MAX {
        clients.insert(port, client.clone());
    }
    Ok((url, client))
}

/// Why a call cannot start.
pub(crate) enum Admission {
    Refused(Refused),
    NoClient(String),
}

fn spec_of(ctx: &ActionContext) -> Option<HttpSpec> {
    ctx.definition.state(&ctx.node)?.http.clone()
}

impl NodeHandler for Http {
    /// An HTTP node may have effects anywhere: every call is dispatched first, with its
    /// idempotency key, so a lost answer is reconciled rather than blindly repeated.
    fn side_effect(&self, _ctx: &ActionContext) -> bool {
        true
    }

    fn run(&self, ctx: ActionContext) -> BoxFuture<Outcome> {
        let (egress, clients) = (self.egress.clone(), self.clients.clone());
        let quote = self.quote_error_bodies;
        Box::pin(async move {
            let Some(spec) = spec_of(&ctx) else {
                return Outcome::InDoubt(format!(
                    "state {} has no `http` table; nothing was sent",
                    ctx.node
                ));
            };
            let body = match request_body(&ctx) {
                Ok(body) => body,
                Err(message) => {
                    return fatal(
                        &spec,
                        &Failure::fatal(kind::BAD_REQUEST, &message),
                        "http_request_too_large",
                    );
                }
            };
            let (url, client) = match admit(&egress, &clients, &spec.url).await {
                Ok(admitted) => admitted,
                Err(Admission::Refused(refused)) => return egress_refused(&spec, &refused),
                Err(Admission::NoClient(e)) => {
                    return Outcome::InDoubt(format!("{e}; nothing was sent"));
                }
            };
            let request = with_headers(client.post(url), &ctx).body(body);
            let exchange = exchange(request, spec.timeout_ms, &ctx);
            match exchange.await {
                Exchange::Reply(reply) => outcome_of_reply(&spec, reply, quote),
                Exchange::Egress(refused) => egress_refused(&spec, &refused),
                Exchange::NotSent(message) => {
                    transient(&spec, &Failure::transient(kind::NETWORK, &message))
                }
                Exchange::Refused(message) => fatal(
                    &spec,
                    &Failure::fatal(kind::BAD_REQUEST, &message),
                    "http_bad_request",
                ),
                Exchange::InDoubt(message) => Outcome::InDoubt(message),
                Exchange::TimedOut(message) => Outcome::TimedOut(message),
            }
        })
    }

    fn reconcile(&self, ctx: ActionContext) -> Option<BoxFuture<Result<Reconciled, String>>> {
        let spec = spec_of(&ctx)?;
        let url = spec.reconcile_url.clone()?;
        let (egress, clients) = (self.egress.clone(), self.clients.clone());
        let quote = self.quote_error_bodies;
        Some(Box::pin(async move {
            let (url, client) = match admit(&egress, &clients, &url).await {
                Ok(admitted) => admitted,
                Err(Admission::Refused(refused)) => {
                    return Err(format!("reconcile endpoint: nothing was sent: {refused}"));
                }
                Err(Admission::NoClient(e)) => return Err(e),
            };
            let body = json!({
                "idempotency_key": ctx.idempotency_key,
                "run_id": ctx.run_id,
                "node": ctx.node,
                "action_id": ctx.action_id,
                "step": ctx.step,
            });
            let body = serde_json::to_vec(&body).map_err(|e| e.to_string())?;
            let request = with_headers(client.post(url), &ctx).body(body);
            match exchange(request, spec.timeout_ms, &ctx).await {
                Exchange::Reply(Answer {
                    status: 200..=299,
                    body: Ok(Ok(body)),
                    ..
                }) => parse_reconcile_reply(&body).map_err(|e| format!("reconcile reply: {e}")),
                Exchange::Reply(Answer {
                    status: 200..=299,
                    body: Ok(Err(size)),
                    ..
                }) => Err(format!(
                    "reconcile reply is larger than {REPLY_BYTES_MAX} bytes ({size} read)"
                )),
                Exchange::Reply(Answer {
                    status: 200..=299,
                    body: Err(e),
                    ..
                }) => Err(format!("reconcile reply lost: {e}")),
                Exchange::Reply(reply) => Err(format!(
                    "reconcile endpoint answered {}: {}",
                    reply.status,
                    reply.describe_body(quote).0
                )),
                Exchange::Egress(refused) => {
                    Err(format!("reconcile endpoint: nothing was sent: {refused}"))
                }
                Exchange::NotSent(m)
                | Exchange::Refused(m)
                | Exchange::InDoubt(m)
                | Exchange::TimedOut(m) => Err(format!("reconcile endpoint: {m}")),
            }
        }))
    }
}

fn with_headers(request: reqwest::RequestBuilder, ctx: &ActionContext) -> reqwest::RequestBuilder {
    request
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header(reqwest::header::ACCEPT, "application/json")
        .header("Idempotency-Key", &ctx.idempotency_key)
        .header("Rein-Fencing-Token", ctx.fencing_token.to_string())
        .header("Rein-Run-Id", ctx.run_id.to_string())
        .header("Rein-Call-Id", &ctx.call_id)
        .header(
            "traceparent",
            crate::trace::current_traceparent(ctx.run_id, rand::random()),
        )
}

/// The request body: the run context, the resume brief (SPEC D3, `brief`) and its older short
/// form (`resume`), at most
/// [`REQUEST_BYTES_MAX`] bytes. Older results are left out (`results_truncated`) when the
/// full list would not fit; run data that alone does not fit is an error.
fn request_body(ctx: &ActionContext) -> Result<Vec<u8>, String> {
    let data_len = serde_json::to_vec(&ctx.run.data)
        .map_err(|e| format!("run data cannot be encoded: {e}"))?
        .len();
    if data_len > REQUEST_BYTES_MAX {
        return Err(format!(
            "the run's data is {data_len} bytes; an http node sends at most {REQUEST_BYTES_MAX}"
        ));
    }
    let brief = ctx.resume_brief();
    let results = &ctx.run.results;
    let body = |results: &[Value], truncated: bool| {
        json!({
            "run_id": ctx.run_id,
            "definition": { "name": ctx.definition.name(), "version": ctx.definition.version() },
            "node": ctx.node,
            "state": ctx.run.state,
            "step": ctx.step,
            "attempt": ctx.run.attempt,
            "action_id": ctx.action_id,
            "call_id": ctx.call_id,
            "idempotency_key": ctx.idempotency_key,
            "fencing_token": ctx.fencing_token,
            "data": ctx.run.data,
            "results": results,
            "results_truncated": truncated,
            "brief": brief,
            "resume": {
                "steps_completed": ctx.run.steps_completed,
                "attempt": ctx.run.attempt,
                "last_error": ctx.run.last_error,
                "last_results": &results[results.len().saturating_sub(RESUME_RESULTS)..],
            },
        })
    };
    // Results come resolved (SPEC E5); when they do not fit, the large ones go as their
    // blob references again, which the node reads with `GET /v1/blobs/{sha256}`.
    let referenced = as_references(results);
    for (results, truncated) in [
        (results.as_slice(), false),
        (referenced.as_slice(), false),
        (
            &referenced[referenced.len().saturating_sub(RESULTS_WHEN_TRIMMED)..],
            results.len() > RESULTS_WHEN_TRIMMED,
        ),
    ] {
        let bytes = serde_json::to_vec(&body(results, truncated))
            .map_err(|e| format!("run context cannot be encoded: {e}"))?;
        if bytes.len() <= REQUEST_BYTES_MAX {
            return Ok(bytes);
        }
    }
    Err(format!(
        "the run context (data and recent results) exceeds the {REQUEST_BYTES_MAX}-byte request limit"
    ))
}

/// `results` with each value larger than the default inline bound replaced by its blob
/// reference (the sha256 and size of its canonical JSON, as the event stored it).
fn as_references(results: &[Value]) -> Vec<Value> {
    results
        .iter()
        .map(|r| {
            let mut r = r.clone();
            if let Some(value) = r.get_mut("value") {
                let text = rein_core::hash::canonical_json(value);
                if text.len() > rein_core::limits::PAYLOAD_INLINE_BYTES_DEFAULT {
                    *value = rein_core::blob::reference(&rein_core::blob::BlobRef {
                        sha256: rein_core::hash::sha256_hex(text.as_bytes()),
                        bytes: text.len(),
                    });
                }
            }
            r
        })
        .collect()
}

/// An answer: a status came back.
struct Answer {
    status: u16,
    retry_after_s: Option<u64>,
    /// The media type the reply declares, if it is a short plain token (`type/subtype`).
    content_type: Option<String>,
    /// `Ok(Ok(bytes))`, `Ok(Err(bytes_seen))` when larger than [`REPLY_BYTES_MAX`], `Err`
    /// when the connection broke while reading it.
    body: Result<Result<Vec<u8>, usize>, String>,
}

/// What became of one request.
enum Exchange {
    Reply(Answer),
    /// Not sent: the egress policy refused the address the host resolved to.
    Egress(Refused),
    /// Certainly not sent (no connection could be made).
    NotSent(String),
    /// The request could not even be built (e.g. a malformed URL).
    Refused(String),
    /// Sent, or possibly sent, and no complete answer came back.
    InDoubt(String),
    /// Sent, and no complete answer came back within the call's `timeout_ms`.
    TimedOut(String),
}

async fn exchange(
    request: reqwest::RequestBuilder,
    timeout_ms: u64,
    ctx: &ActionContext,
) -> Exchange {
    let call = async {
        let response = match request.send().await {
            Ok(response) => response,
            Err(e) if crate::egress::refusal_in(&e).is_some() => {
                return match crate::egress::refusal_in(&e) {
                    Some(refused) => Exchange::Egress(refused.clone()),
                    None => Exchange::NotSent(error_chain(&e)),
                };
            }
            Err(e) if e.is_builder() => return Exchange::Refused(format!("invalid request: {e}")),
            Err(e) if e.is_connect() => {
                return Exchange::NotSent(format!("cannot connect: {}", error_chain(&e)));
            }
            Err(e) => {
                return Exchange::InDoubt(format!(
                    "connection lost after the request was sent: {}",
                    error_chain(&e)
                ));
            }
        };
        let status = response.status().as_u16();
        let retry_after_s = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| retry_after_s(v, Utc::now()));
        let content_type = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| media_type(v.as_bytes()));
        let body = read_bounded(response, REPLY_BYTES_MAX).await;
        Exchange::Reply(Answer {
            status,
            retry_after_s,
            content_type,
            body,
        })
    };
    tokio::select! {
        exchange = tokio::time::timeout(Duration::from_millis(timeout_ms), call) => match exchange {
            Ok(exchange) => exchange,
            Err(_) => Exchange::TimedOut(format!(
                "no complete reply within {timeout_ms} ms; the request may have been applied"
            )),
        },
        _ = ctx.cancel.cancelled() => {
            Exchange::InDoubt("cancelled while the call was in flight".into())
        }
    }
}

pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// Reads at most `max` bytes of the body; `Ok(Err(n))` once more than `max` arrived.
async fn read_bounded(
    mut response: reqwest::Response,
    max: usize,
) -> Result<Result<Vec<u8>, usize>, String> {
    if let Some(len) = response.content_length()
        && len > max as u64
    {
        return Ok(Err(usize::try_from(len).unwrap_or(usize::MAX)));
    }
    let mut body = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if body.len() + chunk.len() > max {
                    return Ok(Err(body.len() + chunk.len()));
                }
                body.extend_from_slice(&chunk);
            }
            Ok(None) => return Ok(Ok(body)),
            Err(e) => return Err(error_chain(&e)),
        }
    }
}

/// `Retry-After` in seconds: either delay-seconds or an HTTP date (RFC 9110 §10.2.3).
pub fn retry_after_s(value: &str, now: DateTime<Utc>) -> Option<u64> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(seconds);
    }
    let when = DateTime::parse_from_rfc2822(value).ok()?;
    let ms = (when.with_timezone(&Utc) - now).num_milliseconds().max(0);
    Some((ms as u64).div_ceil(1000))
}

fn outcome_of_reply(spec: &HttpSpec, answer: Answer, quote: bool) -> Outcome {
    let status = answer.status;
    let bad_reply = |message: &str| {
        let outcome = fatal(
            spec,
            &Failure::fatal(kind::BAD_REPLY, &format!("malformed reply: {message}"))
                .with_status(Some(status)),
            "http_bad_reply",
        );
        // A reply is judged in steps like a decision; a malformed one fails the first.
        annotated(outcome, |payload| payload["error"]["step"] = "parse".into())
    };
    let (described, summary) = answer.describe_body(quote);
    let message = format!("node answered {status}: {described}");
    match Failure::from_http_status(status, answer.retry_after_s, &message) {
        None => match answer.body {
            Ok(Ok(bytes)) => match parse_reply(&bytes) {
                Ok(Reply::Events(events)) => Outcome::Events(events),
                Ok(Reply::Decision(decision)) => Outcome::Decision(decision),
                Err(message) => bad_reply(&message),
            },
            Ok(Err(size)) => bad_reply(&format!(
                "larger than {REPLY_BYTES_MAX} bytes ({size} seen)"
            )),
            // The node answered 2xx, so it probably acted; its answer is lost.
            Err(e) => Outcome::InDoubt(format!("reply {status} lost while reading it: {e}")),
        },
        Some(failure) => {
            let outcome = match failure.class {
                ErrorClass::Transient { .. } => transient(spec, &failure),
                ErrorClass::Fatal => fatal(spec, &failure, &format!("http_status_{status}")),
                ErrorClass::InDoubt => return Outcome::InDoubt(message),
            };
            annotated(outcome, |payload| {
                payload["error"]["body"] = summary.clone()
            })
        }
    }
}

impl Answer {
    /// The error body in words and as `error.body`: its length, declared content type and
    /// the first 16 hex digits of its SHA-256, never its text; with `quote`, up to
    /// [`ERROR_SNIPPET_BYTES`] of it as storable text (invalid UTF-8 and NUL become U+FFFD).
    fn describe_body(&self, quote: bool) -> (String, Value) {
        let bytes = match &self.body {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(size)) => {
                return (
                    format!("(body of {size}+ bytes not read)"),
                    json!({ "bytes": size, "read": false }),
                );
            }
            Err(e) => {
                return (
                    format!("(body lost: {})", rein_core::text::storable(e)),
                    json!({ "read": false }),
                );
            }
        };
        let hash = rein_core::hash::sha256_hex(bytes);
        let hash = &hash[..16];
        let summary = json!({
            "bytes": bytes.len(),
            "content_type": self.content_type,
            "sha256_prefix": hash,
        });
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return ("(empty body)".into(), summary);
        }
        let text = if quote {
            let cut = &bytes[..bytes.len().min(ERROR_SNIPPET_BYTES)];
            rein_core::text::storable(String::from_utf8_lossy(cut).trim())
        } else {
            format!(
                "{} bytes of {}, sha256 {hash}...; the body is not recorded (a worker started \
                 with --http-quote-error-bodies records its first {ERROR_SNIPPET_BYTES} bytes)",
                bytes.len(),
                self.content_type.as_deref().unwrap_or("undeclared type"),
            )
        };
        (text, summary)
    }
}

/// The media type of a `Content-Type` value (`type/subtype`, parameters dropped), when it is
/// a short token of the characters RFC 9110 allows there; otherwise nothing.
fn media_type(value: &[u8]) -> Option<String> {
    let value = std::str::from_utf8(value).ok()?;
    let media = value.split(';').next()?.trim().to_ascii_lowercase();
    let token = |t: &str| {
        !t.is_empty()
            && t.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
    };
    let (kind, sub) = media.split_once('/')?;
    (media.len() <= CONTENT_TYPE_LEN_MAX && token(kind) && token(sub)).then_some(media)
}

/// `outcome` with `edit` applied to each event's payload.
fn annotated(mut outcome: Outcome, edit: impl Fn(&mut Value)) -> Outcome {
    if let Outcome::Events(events) = &mut outcome {
        for (_, payload) in events {
            edit(payload);
        }
    }
    outcome
}

fn transient(spec: &HttpSpec, failure: &Failure) -> Outcome {
    Outcome::failed(&spec.transient_event, failure)
}

fn fatal(spec: &HttpSpec, failure: &Failure, reason: &str) -> Outcome {
    let outcome = Outcome::failed(&spec.fatal_event, failure);
    annotated(outcome, |payload| payload["reason"] = reason.into())
}

/// A call the egress policy stopped: nothing was sent, and sending again cannot help.
fn egress_refused(spec: &HttpSpec, refused: &Refused) -> Outcome {
    let failure = Failure::fatal(
        kind::EGRESS_REFUSED,
        &format!("nothing was sent: {refused}"),
    );
    annotated(fatal(spec, &failure, kind::EGRESS_REFUSED), |payload| {
        payload["error"]["rule"] = refused.rule.into();
    })
}

/// A well-formed 2xx reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Events(Vec<(String, Value)>),
    Decision(Value),
}

/// Parses `{"events": [..]}` or `{"decision": {..}}`; the error says what is wrong.
pub fn parse_reply(bytes: &[u8]) -> Result<Reply, String> {
    let value: Value =
        serde_json::from_slice(bytes).map_err(|e| format!("reply is not JSON: {e}"))?;
    if let Some(at) = rein_core::text::nul_at(&value) {
        return Err(format!(
            "the reply holds a NUL character (\\u0000) at {at}, which cannot be stored"
        ));
    }
    if let Some(at) = rein_core::blob::key_at(&value) {
        return Err(rein_core::blob::key_refused("the reply", &at));
    }
    let Value::Object(mut reply) = value else {
        return Err("reply must be a JSON object".into());
    };
    if let Some(key) = reply.keys().find(|k| *k != "events" && *k != "decision") {
        return Err(format!(
            "unknown field `{key}`: a reply has `events` or `decision`"
        ));
    }
    match (reply.remove("events"), reply.remove("decision")) {
        (Some(events), None) => parse_events(events).map(Reply::Events),
        (None, Some(decision @ Value::Object(_))) => Ok(Reply::Decision(decision)),
        (None, Some(_)) => Err("`decision` must be an object".into()),
        (Some(_), Some(_)) => Err("a reply has `events` or `decision`, not both".into()),
        (None, None) => Err("a reply needs `events` or `decision`".into()),
    }
}

fn parse_events(events: Value) -> Result<Vec<(String, Value)>, String> {
    let Value::Array(events) = events else {
        return Err("`events` must be an array".into());
    };
    if events.is_empty() || events.len() > REPLY_EVENTS_MAX {
        return Err(format!(
            "`events` must hold 1..={REPLY_EVENTS_MAX} events, not {}",
            events.len()
        ));
    }
    events
        .into_iter()
        .enumerate()
        .map(|(i, event)| parse_event(event).map_err(|e| format!("events[{i}]: {e}")))
        .collect()
}

fn parse_event(event: Value) -> Result<(String, Value), String> {
    let Value::Object(mut event) = event else {
        return Err("an event must be an object".into());
    };
    if let Some(key) = event.keys().find(|k| *k != "type" && *k != "payload") {
        return Err(format!(
            "unknown field `{key}`: an event has `type` and `payload`"
        ));
    }
    let kind = match event.remove("type") {
        Some(Value::String(kind)) if !kind.is_empty() && kind.len() <= EVENT_TYPE_LEN_MAX => kind,
        _ => {
            return Err(format!(
                "`type` must be a string of 1..={EVENT_TYPE_LEN_MAX} bytes"
            ));
        }
    };
    if EngineEvent::is_reserved(&kind) {
        return Err(format!(
            "`{kind}` is an engine event; a node cannot send it"
        ));
    }
    let payload = match event.remove("payload") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(payload @ Value::Object(_)) => payload,
        Some(_) => return Err("`payload` must be an object".into()),
    };
    let size = serde_json::to_vec(&payload)
        .map(|b| b.len())
        .unwrap_or(usize::MAX);
    if size > rein_core::limits::EVENT_PAYLOAD_BYTES_MAX {
        return Err(format!(
            "payload of `{kind}` is {size} bytes; at most {} are accepted",
            rein_core::limits::EVENT_PAYLOAD_BYTES_MAX
        ));
    }
    Ok((kind, payload))
}

/// Parses `{"applied": true, "events": [..]}` or `{"applied": false}`.
pub fn parse_reconcile_reply(bytes: &[u8]) -> Result<Reconciled, String> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    if let Some(at) = rein_core::blob::key_at(&value) {
        return Err(rein_core::blob::key_refused("the answer", &at));
    }
    let Value::Object(mut reply) = value else {
        return Err("must be a JSON object".into());
    };
    match reply.remove("applied") {
        Some(Value::Bool(true)) => match reply.remove("events") {
            Some(events) => parse_events(events).map(Reconciled::Applied),
            None => Err("`applied: true` needs the `events` the call produced".into()),
        },
        Some(Value::Bool(false)) => Ok(Reconciled::NotApplied),
        _ => Err("needs a boolean `applied`".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_results_go_as_the_references_their_events_stored() {
        let big = json!({ "text": "x".repeat(rein_core::limits::PAYLOAD_INLINE_BYTES_DEFAULT) });
        let small = json!({ "n": 1 });
        let (stored, _) = rein_core::blob::externalize(
            &json!({ "result": big }),
            rein_core::limits::PAYLOAD_INLINE_BYTES_DEFAULT,
        )
        .unwrap();
        let results = vec![
            json!({ "step": 1, "value": small }),
            json!({ "step": 2, "value": big }),
        ];
        let sent = as_references(&results);
        assert_eq!(sent[0], results[0], "a small value goes as it is");
        assert_eq!(sent[1]["step"], 2);
        assert_eq!(
            sent[1]["value"], stored["result"],
            "the reference is the one the event holds, so GET /v1/blobs finds it"
        );
    }

    #[test]
    fn retry_after_takes_seconds_or_an_http_date() {
        let now = DateTime::parse_from_rfc3339("2015-10-21T07:28:00Z")
            .unwrap()
            .with_timezone(&Utc);
        assert_eq!(retry_after_s(" 7 ", now), Some(7));
        assert_eq!(
            retry_after_s("Wed, 21 Oct 2015 07:28:30 GMT", now),
            Some(30)
        );
        assert_eq!(retry_after_s("Wed, 21 Oct 2015 07:27:00 GMT", now), Some(0));
        assert_eq!(retry_after_s("soon", now), None);
        assert_eq!(retry_after_s("-3", now), None);
    }

    #[test]
    fn replies_parse_or_say_what_is_wrong() {
        assert_eq!(
            parse_reply(br#"{"events":[{"type":"A"},{"type":"B","payload":{"x":1}}]}"#),
            Ok(Reply::Events(vec![
                ("A".into(), json!({})),
                ("B".into(), json!({ "x": 1 })),
            ]))
        );
        assert_eq!(
            parse_reply(br#"{"decision":{"decision":"PLAN_READY"}}"#),
            Ok(Reply::Decision(json!({ "decision": "PLAN_READY" })))
        );
        for (body, says) in [
            (&b"<html>"[..], "not JSON"),
            (br#"[1]"#, "JSON object"),
            (br#"{}"#, "needs `events` or `decision`"),
            (br#"{"events":[]}"#, "1..=32"),
            (br#"{"events":[{"type":""}]}"#, "events[0]: `type`"),
            (
                br#"{"events":[{"type":"A","payload":3}]}"#,
                "`payload` must be an object",
            ),
            (br#"{"events":[{"type":"CANCEL"}]}"#, "engine event"),
            (
                br#"{"events":[{"type":"A","extra":1}]}"#,
                "unknown field `extra`",
            ),
            (br#"{"event":[]}"#, "unknown field `event`"),
            (br#"{"decision":"A"}"#, "must be an object"),
            (br#"{"decision":{},"events":[{"type":"A"}]}"#, "not both"),
        ] {
            let err = parse_reply(body).expect_err(&String::from_utf8_lossy(body));
            assert!(err.contains(says), "{err:?} should say {says:?}");
        }
        let big = format!(
            r#"{{"events":[{{"type":"A","payload":{{"s":"{}"}}}}]}}"#,
            "x".repeat(rein_core::limits::EVENT_PAYLOAD_BYTES_MAX)
        );
        assert!(parse_reply(big.as_bytes()).unwrap_err().contains("bytes"));
    }

    #[test]
    fn a_nul_is_refused_in_a_reply_and_replaced_in_a_quoted_error_body() {
        for reply in [
            &br#"{"events":[{"type":"A","payload":{"x":"a\u0000b"}}]}"#[..],
            br#"{"decision":{"decision":"A","reason":"\u0000"}}"#,
        ] {
            let err = parse_reply(reply).expect_err("refused");
            assert!(err.contains("NUL character"), "{err}");
        }
        let err =
            parse_reply(br#"{"events":[{"type":"A","payload":{"x":"a\u0000b"}}]}"#).unwrap_err();
        assert!(err.contains("$.events[0].payload.x"), "{err}");
        let Outcome::Events(events) =
            outcome_of_reply(&spec(), answer(500, None, Ok(Ok(b"a\0b".to_vec()))), true)
        else {
            panic!("a 500 is an event");
        };
        let message = events[0].1["error"]["message"].as_str().unwrap();
        assert!(message.contains("a\u{FFFD}b"), "{message:?}");
        assert!(!message.contains('\0'));
        let Outcome::Events(events) = outcome_of_reply(
            &spec(),
            answer(
                200,
                None,
                Ok(Ok(
                    br#"{"events":[{"type":"A","payload":{"x":"\u0000"}}]}"#.to_vec()
                )),
            ),
            false,
        ) else {
            panic!("a rejected reply is the fatal event");
        };
        assert_eq!(events[0].0, "HARD");
        assert_eq!(events[0].1["error"]["step"], "parse");
        assert_eq!(events[0].1["reason"], "http_bad_reply");
    }

    #[test]
    fn a_blob_reference_in_a_reply_is_a_rejected_reply_at_parse() {
        let forged = format!(r#"{{"$blob":{{"sha256":"{}","bytes":9}}}}"#, "a".repeat(64));
        for reply in [
            format!(r#"{{"events":[{{"type":"A","payload":{{"result":{forged}}}}}]}}"#),
            format!(r#"{{"events":[{{"type":"A","payload":{{"r":{{"deep":[{forged}]}}}}}}]}}"#),
            format!(r#"{{"decision":{{"decision":"A","payload":{{"x":{forged}}}}}}}"#),
        ] {
            let Outcome::Events(events) = outcome_of_reply(
                &spec(),
                answer(200, None, Ok(Ok(reply.clone().into_bytes()))),
                false,
            ) else {
                panic!("a rejected reply is the fatal event: {reply}");
            };
            assert_eq!(events[0].0, "HARD");
            assert_eq!(events[0].1["error"]["step"], "parse");
            let message = events[0].1["error"]["message"].as_str().unwrap();
            assert!(message.contains("`$blob` key at $."), "{message}");
        }
        let answer = format!(
            r#"{{"applied":true,"events":[{{"type":"A","payload":{{"result":{forged}}}}}]}}"#
        );
        assert!(parse_reconcile_reply(answer.as_bytes()).is_err());
    }

    #[test]
    fn reconcile_replies_parse() {
        assert_eq!(
            parse_reconcile_reply(br#"{"applied":false}"#),
            Ok(Reconciled::NotApplied)
        );
        assert_eq!(
            parse_reconcile_reply(br#"{"applied":true,"events":[{"type":"OK"}]}"#),
            Ok(Reconciled::Applied(vec![("OK".into(), json!({}))]))
        );
        assert!(parse_reconcile_reply(br#"{"applied":true}"#).is_err());
        assert!(parse_reconcile_reply(br#"{"applied":"yes"}"#).is_err());
    }

    fn answer(
        status: u16,
        retry_after_s: Option<u64>,
        body: Result<Result<Vec<u8>, usize>, String>,
    ) -> Answer {
        Answer {
            status,
            retry_after_s,
            content_type: Some("text/plain".into()),
            body,
        }
    }

    #[test]
    fn an_error_body_is_recorded_by_its_length_type_and_hash_unless_quoting_is_on() {
        let secret = b"db_password=hunter2".to_vec();
        let Outcome::Events(events) =
            outcome_of_reply(&spec(), answer(500, None, Ok(Ok(secret.clone()))), false)
        else {
            panic!("a 500 is an event");
        };
        let error = &events[0].1["error"];
        assert!(!events[0].1.to_string().contains("hunter2"), "{error}");
        let message = error["message"].as_str().unwrap();
        assert!(
            message.contains("node answered 500: 19 bytes of text/plain"),
            "{message}"
        );
        assert!(message.contains("--http-quote-error-bodies"), "{message}");
        let hash = rein_core::hash::sha256_hex(&secret);
        assert_eq!(error["body"]["sha256_prefix"], &hash[..16]);
        assert_eq!(error["body"]["bytes"], 19);
        assert_eq!(error["body"]["content_type"], "text/plain");

        let Outcome::Events(events) =
            outcome_of_reply(&spec(), answer(500, None, Ok(Ok(secret))), true)
        else {
            panic!("a 500 is an event");
        };
        let message = events[0].1["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("db_password=hunter2"),
            "quoted on request: {message}"
        );
    }

    #[test]
    fn only_a_plain_media_type_is_kept_from_content_type() {
        for (value, kept) in [
            (&b"text/plain; charset=utf-8"[..], Some("text/plain")),
            (b"Application/JSON", Some("application/json")),
            (b"text/plain; secret=hunter2", Some("text/plain")),
            (b"db password=hunter2", None),
            (b"hunter2", None),
            (b"text/\xff", None),
            (b"", None),
        ] {
            assert_eq!(media_type(value).as_deref(), kept, "{value:?}");
        }
        let long = format!("text/{}", "x".repeat(CONTENT_TYPE_LEN_MAX));
        assert_eq!(media_type(long.as_bytes()), None);
    }

    fn spec() -> HttpSpec {
        HttpSpec {
            url: "http://127.0.0.1:1/".into(),
            timeout_ms: 1000,
            transient_event: "SOFT".into(),
            fatal_event: "HARD".into(),
            reconcile_url: None,
        }
    }

    #[test]
    fn statuses_are_classified_by_rein_core() {
        let body = |s: &str| Ok(Ok(s.as_bytes().to_vec()));
        let Outcome::Events(events) =
            outcome_of_reply(&spec(), answer(503, Some(2), body("busy")), true)
        else {
            panic!("503 must be an event");
        };
        assert_eq!(events[0].0, "SOFT");
        assert_eq!(events[0].1["retry_after_ms"], 2000);
        assert_eq!(events[0].1["error"]["class"], "transient");
        assert_eq!(events[0].1["error"]["status"], 503);
        assert!(
            events[0].1["error"]["message"]
                .as_str()
                .unwrap()
                .contains("busy")
        );
        for status in [429, 500, 408] {
            let Outcome::Events(events) =
                outcome_of_reply(&spec(), answer(status, None, body("")), false)
            else {
                panic!("{status} must be an event");
            };
            assert_eq!(events[0].0, "SOFT", "{status}");
            assert!(events[0].1.get("retry_after_ms").is_none());
        }
        for status in [400, 403, 404, 422, 409, 301] {
            let Outcome::Events(events) =
                outcome_of_reply(&spec(), answer(status, None, body("no")), false)
            else {
                panic!("{status} must be an event");
            };
            assert_eq!(events[0].0, "HARD", "{status}");
            assert_eq!(events[0].1["error"]["class"], "fatal");
            assert_eq!(events[0].1["reason"], format!("http_status_{status}"));
        }
        let Outcome::Events(events) =
            outcome_of_reply(&spec(), answer(200, None, body("nope")), false)
        else {
            panic!("a malformed 2xx must be the fatal event");
        };
        assert_eq!(events[0].0, "HARD");
        assert_eq!(events[0].1["reason"], "http_bad_reply");
        assert!(matches!(
            outcome_of_reply(&spec(), answer(200, None, Err("reset".into())), false),
            Outcome::InDoubt(_)
        ));
        assert!(matches!(
            outcome_of_reply(&spec(), answer(200, None, Ok(Err(REPLY_BYTES_MAX + 1))), false),
            Outcome::Events(e) if e[0].0 == "HARD"
        ));
    }
}
