//! The API's handlers. Each is annotated for the OpenAPI document, which `utoipa-axum`
//! collects from the same `routes!` calls that mount them, so the document lists exactly
//! what is served.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use rein_core::{Definition, Format, GuardRegistry};
use rein_store::{EnqueueRequest, INBOX_TTL_MS_DEFAULT, RunFilter, Scope, SendOutcome, StoreError};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_json::{Value, json};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{IntoParams, Modify, OpenApi, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::error::ErrorBody;
use super::{ApiError, App, Caller};
use crate::ops::run_json;

/// Page sizes accepted by list endpoints.
const PAGE_MAX: i64 = 1000;
const PAGE_DEFAULT: i64 = 50;
/// Longest filter value accepted (names are at most 64 bytes).
const FILTER_BYTES_MAX: usize = 128;

/// The response header naming the next page of `GET /v1/runs`.
const NEXT_CURSOR: &str = "rein-next-cursor";
/// Longest cursor accepted (a real one is about 180 characters).
const CURSOR_BYTES_MAX: usize = 512;

type AppState = State<Arc<App>>;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Rein API",
        description = "Durable runs of LLM agents on PostgreSQL: enqueue, inspect, send events, decide approvals."
    ),
    modifiers(&BearerAuth),
    security(("bearer" = [])),
    components(schemas(ErrorBody))
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

pub fn router() -> OpenApiRouter<Arc<App>> {
    OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(openapi_json))
        .routes(routes!(list_runs, enqueue_run))
        .routes(routes!(get_run))
        .routes(routes!(run_events, send_event))
        .routes(routes!(list_approvals))
        .routes(routes!(grant_approval))
        .routes(routes!(deny_approval))
        .routes(routes!(rerun_run))
        .routes(routes!(list_workers))
        .routes(routes!(list_definitions, register_definition))
        .routes(routes!(get_definition))
}

// ---- shapes -------------------------------------------------------------------------------

#[derive(Serialize, ToSchema)]
struct Health {
    status: String,
}

/// A new run.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct EnqueueBody {
    /// Definition name (registered in the database).
    definition: String,
    /// Definition version; the newest when absent.
    version: Option<u32>,
    /// The run's input (its initial business data).
    #[serde(default = "empty_object")]
    #[schema(value_type = Object)]
    input: Value,
    /// Queue name (default `default`).
    queue: Option<String>,
    /// Higher is claimed first (default 0).
    priority: Option<i32>,
}

#[derive(Serialize, ToSchema)]
struct EnqueueResponse {
    run_id: Uuid,
    /// False when the Idempotency-Key named a run that already existed.
    created: bool,
}

/// An event sent to a run from outside.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
struct SendBody {
    /// Event type, e.g. USER_REPLY or CANCEL.
    #[serde(rename = "type")]
    kind: String,
    #[serde(default = "empty_object")]
    #[schema(value_type = Object)]
    payload: Value,
}

#[derive(Serialize, ToSchema)]
struct SendResponse {
    /// `applied` (committed at `sequence`) or `queued` (waits in the run's inbox).
    outcome: String,
    sequence: Option<i64>,
    inbox_id: Option<i64>,
}

/// A person's decision on an approval request.
#[derive(Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
struct DecideBody {
    /// Why; kept with the decision (at most 4096 bytes).
    comment: Option<String>,
}

/// A run as `GET /v1/runs/{id}` returns it.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct RunView {
    run_id: Uuid,
    definition: String,
    version: u32,
    status: String,
    state: String,
    sequence: i64,
    attempt: u32,
    steps_completed: u32,
    #[schema(value_type = Option<Object>)]
    pending_action: Option<Value>,
    terminal_reason: Option<String>,
    lease: LeaseView,
    wake_at: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    state_entered_at: DateTime<Utc>,
    #[schema(value_type = Object)]
    data: Value,
}

#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct LeaseView {
    worker: Option<String>,
    token: i64,
    until: Option<DateTime<Utc>>,
    live: bool,
}

/// One event of a run's log.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct EventView {
    run_id: Uuid,
    sequence: i64,
    event_id: Uuid,
    #[serde(rename = "type")]
    kind: String,
    #[schema(value_type = Object)]
    payload: Value,
    node: Option<String>,
    schema_version: i32,
    token: i64,
    worker: String,
    occurred_at: DateTime<Utc>,
}

/// An approval request.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct ApprovalView {
    approval_id: Uuid,
    run_id: Uuid,
    node: String,
    tool: String,
    #[schema(value_type = Object)]
    args: Value,
    action_hash: String,
    risk: String,
    /// pending, granted, denied or void.
    status: String,
    requested_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    decided_by: Option<String>,
    decided_at: Option<DateTime<Utc>>,
    comment: Option<String>,
    consumed_at: Option<DateTime<Utc>>,
    open: bool,
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct RunsQuery {
    /// Only runs with this status (e.g. runnable, waiting, terminal).
    status: Option<String>,
    /// Only runs of this definition.
    definition: Option<String>,
    /// At most this many, newest first (1..=1000, default 50).
    limit: Option<i64>,
    /// Continue after the last run of a previous page: the `Rein-Next-Cursor` header it
    /// came with (opaque).
    cursor: Option<String>,
    /// Only runs created strictly after this instant (RFC 3339).
    created_after: Option<DateTime<Utc>>,
    /// Only runs created strictly before this instant (RFC 3339).
    created_before: Option<DateTime<Utc>>,
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct ApprovalsQuery {
    /// Every request, decided, expired and void ones too (default: only open ones).
    all: Option<bool>,
    /// Only this run's requests.
    run: Option<Uuid>,
    /// At most this many, newest first (1..=1000, default 50).
    limit: Option<i64>,
}

fn empty_object() -> Value {
    json!({})
}

// ---- helpers ------------------------------------------------------------------------------

/// Parses a JSON body (any content type); an empty body reads as `{}`.
fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let text: &[u8] = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        body
    };
    serde_json::from_slice(text)
        .map_err(|e| ApiError::validation(format!("the request body is not valid: {e}")))
}

fn path_id(id: Result<Path<Uuid>, PathRejection>) -> Result<Uuid, ApiError> {
    id.map(|Path(id)| id)
        .map_err(|e| ApiError::validation(format!("the id in the path is not a UUID: {e}")))
}

fn query<T>(q: Result<Query<T>, QueryRejection>) -> Result<T, ApiError> {
    q.map(|Query(q)| q)
        .map_err(|e| ApiError::validation(format!("bad query string: {e}")))
}

fn page(limit: Option<i64>) -> Result<i64, ApiError> {
    let limit = limit.unwrap_or(PAGE_DEFAULT);
    if !(1..=PAGE_MAX).contains(&limit) {
        return Err(ApiError::validation(format!(
            "limit must be 1..={PAGE_MAX}"
        )));
    }
    Ok(limit)
}

/// Lowercase hex of `rfc3339|uuid`: opaque to clients, safe in headers and query strings.
fn encode_cursor(at: DateTime<Utc>, run_id: Uuid) -> String {
    let text = format!(
        "{}|{run_id}",
        at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
    );
    text.bytes().map(|b| format!("{b:02x}")).collect()
}

fn decode_cursor(cursor: &str) -> Result<(DateTime<Utc>, Uuid), ApiError> {
    let bad = || ApiError::validation("the cursor is malformed; use a Rein-Next-Cursor value");
    if cursor.is_empty() || cursor.len() > CURSOR_BYTES_MAX || !cursor.len().is_multiple_of(2) {
        return Err(bad());
    }
    let bytes = (0..cursor.len())
        .step_by(2)
        .map(|i| {
            cursor
                .get(i..i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
        })
        .collect::<Option<Vec<u8>>>()
        .ok_or_else(bad)?;
    let text = String::from_utf8(bytes).map_err(|_| bad())?;
    let (at, id) = text.split_once('|').ok_or_else(bad)?;
    let at = DateTime::parse_from_rfc3339(at).map_err(|_| bad())?;
    let id = Uuid::parse_str(id).map_err(|_| bad())?;
    Ok((at.with_timezone(&Utc), id))
}

fn filter(name: &str, value: Option<String>) -> Result<Option<String>, ApiError> {
    match value {
        Some(v) if v.is_empty() || v.len() > FILTER_BYTES_MAX => Err(ApiError::validation(
            format!("{name} must be 1..={FILTER_BYTES_MAX} bytes"),
        )),
        other => Ok(other),
    }
}

// ---- handlers -----------------------------------------------------------------------------

/// Liveness: the process serves requests.
#[utoipa::path(get, path = "/healthz", tag = "health", security(()),
    responses((status = 200, description = "Alive", body = Health)))]
async fn healthz() -> Json<Health> {
    Json(Health {
        status: "ok".to_owned(),
    })
}

/// Readiness: the database is reachable and its schema matches this binary.
#[utoipa::path(get, path = "/readyz", tag = "health", security(()),
    responses((status = 200, description = "Ready", body = Health),
              (status = 503, description = "Database unreachable or schema mismatch", body = ErrorBody)))]
async fn readyz(State(app): AppState) -> Response {
    match app.store.check_schema().await {
        Ok(()) => Json(Health {
            status: "ready".to_owned(),
        })
        .into_response(),
        Err(e) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            format!("not ready: {e}"),
        )
        .into_response(),
    }
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "meta",
    responses((status = 200, description = "The OpenAPI 3.1 document", body = Object),
              (status = 401, description = "No or bad token", body = ErrorBody)))]
async fn openapi_json(State(app): AppState, Extension(_caller): Extension<Caller>) -> Response {
    match app.openapi.get() {
        Some(doc) => Json(doc.clone()).into_response(),
        None => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "the document is not built yet".to_owned(),
        )
        .into_response(),
    }
}

/// Create a run. With an `Idempotency-Key` header, the same key returns the same run.
#[utoipa::path(post, path = "/v1/runs", tag = "runs", request_body = EnqueueBody,
    params(("Idempotency-Key" = Option<String>, Header, description = "Client key (1..=256 bytes): the same key returns the same run")),
    responses((status = 201, description = "Created", body = EnqueueResponse),
              (status = 200, description = "The run this Idempotency-Key already created", body = EnqueueResponse),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the enqueue scope", body = ErrorBody),
              (status = 413, description = "Body too large", body = ErrorBody),
              (status = 422, description = "Invalid request", body = ErrorBody)))]
async fn enqueue_run(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    caller.require(Scope::Enqueue)?;
    let body: EnqueueBody = parse_body(&body)?;
    let key = match headers.get("idempotency-key") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .map_err(|_| ApiError::validation("the Idempotency-Key header is not ASCII"))?
                .to_owned(),
        ),
    };
    if body.definition.is_empty() || body.definition.len() > FILTER_BYTES_MAX {
        return Err(ApiError::validation(format!(
            "definition must be 1..={FILTER_BYTES_MAX} bytes"
        )));
    }
    let def = app
        .store
        .load_definition(&body.definition, body.version)
        .await?;
    let mut request = EnqueueRequest::new(def, body.input);
    request.client_key = key;
    if let Some(queue) = body.queue {
        request.queue = queue;
    }
    request.priority = body.priority.unwrap_or(0);
    let done = app.store.enqueue(request).await?;
    let status = if done.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(EnqueueResponse {
            run_id: done.run_id,
            created: done.created,
        }),
    )
        .into_response())
}

/// Recent runs, newest first by (created_at, run_id), optionally filtered. When more runs
/// follow, the `Rein-Next-Cursor` header carries the `cursor` of the next page.
#[utoipa::path(get, path = "/v1/runs", tag = "runs", params(RunsQuery),
    responses((status = 200, description = "Runs", body = [RunView],
               headers(("Rein-Next-Cursor" = String, description = "Cursor of the next page; absent on the last page"))),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 422, description = "Invalid query or cursor", body = ErrorBody)))]
async fn list_runs(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    q: Result<Query<RunsQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    caller.require(Scope::Read)?;
    let q = query(q)?;
    let limit = page(q.limit)?;
    let filter = RunFilter {
        status: filter("status", q.status)?,
        definition: filter("definition", q.definition)?,
        created_after: q.created_after,
        created_before: q.created_before,
    };
    let after = q.cursor.as_deref().map(decode_cursor).transpose()?;
    // One row more than asked tells whether another page follows.
    let mut rows = app.store.list_runs_page(&filter, after, limit + 1).await?;
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let next = match rows.last() {
        Some(last) if more => Some(encode_cursor(last.created_at, last.run_id)),
        _ => None,
    };
    let mut response = Json(rows.iter().map(run_json).collect::<Vec<_>>()).into_response();
    // Hex digits are always a valid header value.
    if let Some(value) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        response.headers_mut().insert(NEXT_CURSOR, value);
    }
    Ok(response)
}

/// One run: state, status, sequence, lease, data.
#[utoipa::path(get, path = "/v1/runs/{id}", tag = "runs",
    params(("id" = Uuid, Path, description = "Run id")),
    responses((status = 200, description = "The run", body = RunView),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody)))]
async fn get_run(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
) -> Result<Json<Value>, ApiError> {
    caller.require(Scope::Read)?;
    let row = app.store.run(path_id(id)?).await?;
    Ok(Json(run_json(&row)))
}

#[derive(Serialize, ToSchema)]
struct RerunResponse {
    /// The new run.
    run_id: Uuid,
    /// The finished run it repeats.
    parent_run_id: Uuid,
}

/// Run a finished run again: a new run with its definition version, input, queue and
/// priority, linked to it (SPEC E6).
#[utoipa::path(post, path = "/v1/runs/{id}/rerun", tag = "runs",
    params(("id" = Uuid, Path, description = "A finished run")),
    responses((status = 201, description = "The new run", body = RerunResponse),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the operate scope", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody),
              (status = 409, description = "The run has not finished", body = ErrorBody)))]
async fn rerun_run(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
) -> Result<Response, ApiError> {
    caller.require(Scope::Operate)?;
    let parent = path_id(id)?;
    let run_id = match app.store.rerun(parent).await {
        Ok(id) => id,
        Err(rein_store::StoreError::Invalid(m)) => return Err(ApiError::conflict(m)),
        Err(e) => return Err(e.into()),
    };
    Ok((
        StatusCode::CREATED,
        Json(RerunResponse {
            run_id,
            parent_run_id: parent,
        }),
    )
        .into_response())
}

/// Workers and schedulers: last heartbeat (by the database clock) and leases held.
#[utoipa::path(get, path = "/v1/workers", tag = "fleet",
    responses((status = 200, description = "Workers and schedulers", body = [Value]),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody)))]
async fn list_workers(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Value>, ApiError> {
    caller.require(Scope::Read)?;
    let members = app.store.members().await?;
    Ok(Json(serde_json::json!(members)))
}

/// The run's event log, in sequence order.
#[utoipa::path(get, path = "/v1/runs/{id}/events", tag = "runs",
    params(("id" = Uuid, Path, description = "Run id")),
    responses((status = 200, description = "The run's events", body = [EventView]),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody)))]
async fn run_events(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
) -> Result<Response, ApiError> {
    caller.require(Scope::Read)?;
    let id = path_id(id)?;
    app.store.run(id).await?;
    let events = app.store.history(id).await?;
    Ok(Json(events).into_response())
}

/// Send an event to a run (reply, cancel, ...): applied at once when no worker holds the
/// run and its state takes the event, otherwise queued in its inbox.
#[utoipa::path(post, path = "/v1/runs/{id}/events", tag = "runs", request_body = SendBody,
    params(("id" = Uuid, Path, description = "Run id")),
    responses((status = 200, description = "Applied", body = SendResponse),
              (status = 202, description = "Queued in the run's inbox", body = SendResponse),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the operate scope", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody),
              (status = 409, description = "The run cannot take this event (invalid_transition)", body = ErrorBody),
              (status = 413, description = "Body too large", body = ErrorBody),
              (status = 422, description = "Invalid request", body = ErrorBody)))]
async fn send_event(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let who = caller.require(Scope::Operate)?;
    let id = path_id(id)?;
    let body: SendBody = parse_body(&body)?;
    if body.kind.is_empty() || body.kind.len() > FILTER_BYTES_MAX {
        return Err(ApiError::validation(format!(
            "type must be 1..={FILTER_BYTES_MAX} bytes"
        )));
    }
    let sender = format!("api:{}", who.subject);
    let outcome = app
        .store
        .send(id, &body.kind, body.payload, &sender, INBOX_TTL_MS_DEFAULT)
        .await?;
    Ok(match outcome {
        SendOutcome::Applied { sequence } => (
            StatusCode::OK,
            Json(SendResponse {
                outcome: "applied".to_owned(),
                sequence: Some(sequence),
                inbox_id: None,
            }),
        )
            .into_response(),
        SendOutcome::Queued { inbox_id } => (
            StatusCode::ACCEPTED,
            Json(SendResponse {
                outcome: "queued".to_owned(),
                sequence: None,
                inbox_id: Some(inbox_id),
            }),
        )
            .into_response(),
    })
}

/// Approval requests, newest first: the open ones unless `all`.
#[utoipa::path(get, path = "/v1/approvals", tag = "approvals", params(ApprovalsQuery),
    responses((status = 200, description = "Approval requests", body = [ApprovalView]),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 422, description = "Invalid query", body = ErrorBody)))]
async fn list_approvals(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    q: Result<Query<ApprovalsQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    caller.require(Scope::Read)?;
    let q = query(q)?;
    let limit = page(q.limit)?;
    let rows = app
        .store
        .approvals(q.all.unwrap_or(false), q.run, limit)
        .await?;
    Ok(Json(rows).into_response())
}

/// Grant an approval request; the token's subject is recorded as the approver.
#[utoipa::path(post, path = "/v1/approvals/{id}/grant", tag = "approvals", request_body = DecideBody,
    params(("id" = Uuid, Path, description = "Approval request id")),
    responses((status = 200, description = "Granted; the run got its granted event", body = ApprovalView),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the approve scope", body = ErrorBody),
              (status = 404, description = "No such request", body = ErrorBody),
              (status = 409, description = "Already decided, expired or void", body = ErrorBody),
              (status = 422, description = "Invalid request", body = ErrorBody)))]
async fn grant_approval(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    decide(app, caller, id, body, true).await
}

/// Deny an approval request; the token's subject is recorded as the approver.
#[utoipa::path(post, path = "/v1/approvals/{id}/deny", tag = "approvals", request_body = DecideBody,
    params(("id" = Uuid, Path, description = "Approval request id")),
    responses((status = 200, description = "Denied; the run got its denied event", body = ApprovalView),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the approve scope", body = ErrorBody),
              (status = 404, description = "No such request", body = ErrorBody),
              (status = 409, description = "Already decided, expired or void", body = ErrorBody),
              (status = 422, description = "Invalid request", body = ErrorBody)))]
async fn deny_approval(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    decide(app, caller, id, body, false).await
}

async fn decide(
    app: Arc<App>,
    caller: Caller,
    id: Result<Path<Uuid>, PathRejection>,
    body: Bytes,
    grant: bool,
) -> Result<Response, ApiError> {
    let who = caller.require(Scope::Approve)?;
    let id = path_id(id)?;
    let body: DecideBody = parse_body(&body)?;
    if body
        .comment
        .as_ref()
        .is_some_and(|c| c.len() > rein_store::COMMENT_BYTES_MAX)
    {
        return Err(ApiError::validation(format!(
            "comment must be at most {} bytes",
            rein_store::COMMENT_BYTES_MAX
        )));
    }
    // Unknown → 404; known but no longer decidable → 409 with the store's reason.
    let existing = match app.store.approval(id).await {
        Ok(a) => a,
        Err(rein_store::StoreError::Invalid(_)) => {
            return Err(
                ApiError::not_found(format!("approval request {id} not found"))
                    .with_details(json!({ "approval_id": id })),
            );
        }
        Err(e) => return Err(e.into()),
    };
    match app
        .store
        .decide_approval(id, grant, &who.subject, body.comment.as_deref())
        .await
    {
        Ok(decided) => Ok(Json(decided).into_response()),
        Err(rein_store::StoreError::Invalid(message)) => Err(ApiError::conflict(message)
            .with_details(json!({ "approval_id": id, "status": existing.status }))),
        Err(e) => Err(e.into()),
    }
}

// ---- definitions --------------------------------------------------------------------------

/// A registered definition version.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct DefinitionSummary {
    name: String,
    version: u32,
    hash: String,
    description: String,
    created_at: DateTime<Utc>,
}

/// A definition version with its spec.
#[derive(Serialize, ToSchema)]
struct DefinitionView {
    name: String,
    version: u32,
    hash: String,
    /// The validated document, as `rein definitions show --format json` prints it.
    #[schema(value_type = Object)]
    spec: Value,
}

#[derive(Serialize, ToSchema)]
struct RegisterResponse {
    name: String,
    version: u32,
    /// False when this exact body was already registered under this version.
    created: bool,
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct DefinitionQuery {
    /// This version; the newest when absent.
    version: Option<u32>,
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct RegisterQuery {
    /// `toml` or `json`; overrides the Content-Type (JSON unless `application/toml`).
    format: Option<String>,
}

/// The registered definitions: every version of each, by name then version.
#[utoipa::path(get, path = "/v1/definitions", tag = "definitions",
    responses((status = 200, description = "Definitions", body = [DefinitionSummary]),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody)))]
async fn list_definitions(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
) -> Result<Response, ApiError> {
    caller.require(Scope::Read)?;
    Ok(Json(app.store.list_definitions().await?).into_response())
}

/// One definition version (the newest unless `version`) with its spec.
#[utoipa::path(get, path = "/v1/definitions/{name}", tag = "definitions",
    params(("name" = String, Path, description = "Definition name"), DefinitionQuery),
    responses((status = 200, description = "The definition", body = DefinitionView),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 404, description = "No such name or version", body = ErrorBody),
              (status = 422, description = "Invalid query", body = ErrorBody)))]
async fn get_definition(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    name: Result<Path<String>, PathRejection>,
    q: Result<Query<DefinitionQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    caller.require(Scope::Read)?;
    let name = name
        .map(|Path(n)| n)
        .map_err(|e| ApiError::validation(format!("bad definition name: {e}")))?;
    let name = filter("name", Some(name))?.unwrap_or_default();
    let q = query(q)?;
    let def = match app.store.load_definition(&name, q.version).await {
        Ok(def) => def,
        Err(e @ StoreError::UnknownDefinition { .. }) => {
            return Err(ApiError::not_found(e.to_string())
                .with_details(json!({ "definition": name, "version": q.version })));
        }
        Err(e) => return Err(e.into()),
    };
    let spec = serde_json::to_value(def.spec())
        .map_err(|e| ApiError::from(StoreError::Corrupt(e.to_string())))?;
    Ok(Json(DefinitionView {
        name: def.name().to_owned(),
        version: def.version(),
        hash: def.hash().to_owned(),
        spec,
    })
    .into_response())
}

/// Register a definition version. The body is the document: TOML with
/// `Content-Type: application/toml` or `?format=toml`, JSON otherwise. The same body again
/// is a no-op; a different body under a registered version is refused.
#[utoipa::path(post, path = "/v1/definitions", tag = "definitions",
    request_body(description = "The definition document (JSON or TOML)",
                 content((Object = "application/json"), (String = "application/toml"))),
    params(RegisterQuery),
    responses((status = 201, description = "Registered", body = RegisterResponse),
              (status = 200, description = "This body was already registered", body = RegisterResponse),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the operate scope", body = ErrorBody),
              (status = 409, description = "The version is registered with another body", body = ErrorBody),
              (status = 413, description = "Body too large", body = ErrorBody),
              (status = 422, description = "Invalid definition; details.problems locates each problem", body = ErrorBody)))]
async fn register_definition(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    q: Result<Query<RegisterQuery>, QueryRejection>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    caller.require(Scope::Operate)?;
    let q = query(q)?;
    let format = match q.format.as_deref() {
        Some("toml") => Format::Toml,
        Some("json") => Format::Json,
        Some(other) => {
            return Err(ApiError::validation(format!(
                "format must be `toml` or `json`, not `{other}`"
            )));
        }
        None => {
            let toml = headers
                .get(axum::http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split(';').next())
                .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/toml"));
            if toml { Format::Toml } else { Format::Json }
        }
    };
    let text = std::str::from_utf8(&body)
        .map_err(|_| ApiError::validation("the definition is not UTF-8"))?;
    let def = Definition::parse(text, format, &GuardRegistry::new()).map_err(|e| {
        let problems: Vec<Value> = e
            .problems()
            .into_iter()
            .map(|p| json!({ "item": p.item, "reason": p.reason }))
            .collect();
        ApiError::validation(format!(
            "the definition is invalid ({} problem{})",
            problems.len(),
            if problems.len() == 1 { "" } else { "s" }
        ))
        .with_details(json!({ "problems": problems }))
    })?;
    let created = app.store.register_definition(&def).await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((
        status,
        Json(RegisterResponse {
            name: def.name().to_owned(),
            version: def.version(),
            created,
        }),
    )
        .into_response())
}
