//! `GET /v1/runs/{id}/stream`: a run followed live as server-sent events, until it ends.
//! What is sent is [`rein_ops::stream::follow`]'s; this module frames it as SSE, bounds how
//! many streams are open at once, and ends them when the server stops.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Extension;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use rein_ops::stream::{Item, RunEnd};
use rein_ops::{Code, Error, ErrorBody};
use rein_store::Scope;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;
use utoipa::IntoParams;
use uuid::Uuid;

use crate::extract::{path_id, query};
use crate::server::Stopping;
use crate::{ApiError, App, Caller};

/// Streams open at once unless `--max-streams` says otherwise.
pub const STREAMS_MAX_DEFAULT: usize = 256;
/// A comment line is sent at most this long apart on a stream where nothing else is, so that
/// proxies and clients see it alive and a client that went away is noticed.
pub const KEEP_ALIVE_MS: u64 = 15_000;

/// The keep-alive interval of streams on connections closed after `idle_timeout_ms` of
/// silence: [`KEEP_ALIVE_MS`], or a third of the idle timeout when that is shorter.
pub fn keep_alive_ms(idle_timeout_ms: u64) -> u64 {
    KEEP_ALIVE_MS.min(idle_timeout_ms / 3).max(1)
}
/// Metric: streams open now.
pub const STREAMS_OPEN: &str = "rein_api_streams_open";
/// Metric: streams refused because `--max-streams` were open.
pub const STREAMS_REFUSED: &str = "rein_api_streams_refused_total";

/// The help text of the stream metrics, and their series at 0.
pub fn register_metrics() {
    metrics::describe_gauge!(
        STREAMS_OPEN,
        "Run streams (GET /v1/runs/{id}/stream) open now"
    );
    metrics::describe_counter!(
        STREAMS_REFUSED,
        "Run streams refused with 503 because --max-streams were open"
    );
    metrics::gauge!(STREAMS_OPEN).set(0.0);
    metrics::counter!(STREAMS_REFUSED).increment(0);
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub(crate) struct StreamQuery {
    /// Start after this sequence number (default 0: from the first event). A
    /// `Last-Event-ID` header wins over it.
    #[param(value_type = Option<rein_ops::schema::Sequence>, inline)]
    after: Option<i64>,
}

/// Follow a run live as server-sent events (`text/event-stream`) until it ends. First every
/// committed event after `Last-Event-ID` (or `after`; default: all), each as `event:
/// committed` with `id:` its sequence number and `data:` the event as `GET
/// /v1/runs/{id}/events` shows it; then, as they happen, each new committed event and, when
/// this server has Redis (`--redis-url`), the live deltas of the run's actions as `event:
/// delta` (`data:` e.g. `{"type":"delta","content":"Hel"}`, `{"type":"tool_call_delta",
/// "name":"..","arguments":".."}`, `{"type":"reply_done"}`; no `id:`). Deltas are best effort:
/// without Redis, or for a slow reader, there are none, and the committed events alone are
/// the record. The stream ends with `event: end`, `data:` how the run ended (`outcome`
/// succeeded, failed or cancelled); a run already terminal gets its events and `end` at
/// once. `event: error` (`data:` the error document) ends a stream that cannot go on. A
/// comment line is sent every 15 s (a third of `--idle-timeout-ms` when shorter) while
/// nothing else is. Streams that end without `end`
/// (the server stopping) are resumed with `Last-Event-ID`. At most `--max-streams` are open
/// per server: one more is answered 503 with `Retry-After`.
#[utoipa::path(get, path = "/v1/runs/{id}/stream", tag = "runs",
    params(("id" = Uuid, Path, description = "Run id"), StreamQuery,
           ("Last-Event-ID" = inline(Option<rein_ops::schema::Sequence>), Header, nullable = false,
            description = "The `id` of the last event a client read: the stream resumes after it")),
    responses((status = 200, description = "The run's events as server-sent events (`text/event-stream`), each `event: NAME`, `data: JSON` and a blank line: `committed` (`id:` its sequence; data: an EventView), `delta` (data: `{\"type\": \"delta\"|\"tool_call_delta\"|\"reply_done\", ...}`), last `end` (data: `{\"run_id\", \"outcome\": \"succeeded\"|\"failed\"|\"cancelled\", \"status\": \"terminal\", \"state\", \"sequence\", \"terminal_reason\"}`) or `error` (data: an ErrorBody); `:` comment lines keep it alive",
               content_type = "text/event-stream", body = String,
               example = json!("event: committed\nid: 1\ndata: {\"sequence\":1,\"type\":\"RUN_STARTED\",...}\n\nevent: end\ndata: {\"run_id\":\"...\",\"outcome\":\"succeeded\",\"status\":\"terminal\",\"state\":\"DONE\",\"sequence\":4,\"terminal_reason\":null}\n\n")),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope; a token bound to queues reads only runs in them", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody),
              (status = 422, description = "Invalid query or Last-Event-ID", body = ErrorBody),
              (status = 503, description = "This server has --max-streams streams open (unavailable); retry after Retry-After", body = ErrorBody,
               headers(("Retry-After" = u64, description = "Seconds until asking again may succeed")))))]
pub(crate) async fn stream_run(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
    stopping: Option<Extension<Stopping>>,
    id: Result<Path<Uuid>, PathRejection>,
    q: Result<Query<StreamQuery>, QueryRejection>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let who = caller.require(Scope::Read)?;
    let id = path_id(id)?;
    let q = query(q)?;
    let last_event_id = headers
        .get("last-event-id")
        .map(|v| v.to_str().unwrap_or("not text"));
    let after = rein_ops::stream::start_after(last_event_id, q.after)?;
    let Ok(permit) = app.streams.clone().try_acquire_owned() else {
        metrics::counter!(STREAMS_REFUSED).increment(1);
        let mut e = Error::new(
            Code::Unavailable,
            format!(
                "this server has its {} streams open (--max-streams); retry shortly, or read the run's events with GET /v1/runs/{{id}}/events",
                app.limits.streams_max
            ),
        );
        e.retry_after_s = Some(1);
        return Err(e.into());
    };
    rein_ops::stream::open(&app.store, id, Some(who)).await?;
    // Subscribed before the log is read, so no delta published meanwhile is missed.
    let deltas = match &app.redis {
        Some(config) => match rein_accel::stream::subscribe_run(config, &id.to_string()).await {
            Ok(s) => Some(Box::pin(s) as rein_ops::stream::Deltas),
            Err(e) => {
                tracing::warn!(run = %id, error = %e, "cannot subscribe to the run's deltas in Redis; the stream carries committed events only");
                None
            }
        },
        None => None,
    };
    let (tx, rx) = mpsc::channel(rein_ops::stream::BUFFER);
    let follow = rein_ops::stream::follow(
        app.store.clone(),
        id,
        after,
        deltas,
        Duration::from_millis(app.limits.stream_poll_ms),
        tx,
    );
    tokio::spawn(async move {
        let _permit = permit;
        metrics::gauge!(STREAMS_OPEN).increment(1.0);
        match stopping {
            Some(Extension(stopping)) => {
                tokio::select! {
                    () = follow => {}
                    () = stopping.wait() => {}
                }
            }
            None => follow.await,
        }
        metrics::gauge!(STREAMS_OPEN).decrement(1.0);
    });
    let events = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
    .map(|item| Ok::<Event, Infallible>(sse_event(item)));
    let mut response = Sse::new(events)
        .keep_alive(
            KeepAlive::new().interval(Duration::from_millis(app.limits.stream_keep_alive_ms)),
        )
        .into_response();
    // Proxies that buffer answers (nginx) pass this one on as it comes.
    response
        .headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    Ok(response)
}

/// One item as an SSE event.
fn sse_event(item: Result<Item, Error>) -> Event {
    match item {
        Ok(Item::Committed(event)) => Event::default()
            .event("committed")
            .id(event.sequence.to_string())
            .data(json!(event).to_string()),
        Ok(Item::Delta(delta)) => Event::default().event("delta").data(delta.to_string()),
        Ok(Item::End(end)) => Event::default().event("end").data(end_json(&end)),
        Err(e) => {
            tracing::warn!(error = %e.message, "a run stream ends with an error");
            Event::default()
                .event("error")
                .data(json!(e.body()).to_string())
        }
    }
}

fn end_json(end: &RunEnd) -> String {
    json!(end).to_string()
}
