//! The API's handlers. Each is annotated for the OpenAPI document, which `utoipa-axum`
//! collects from the same `routes!` calls that mount them, so the document lists exactly
//! what is served.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use rein_store::{EnqueueRequest, INBOX_TTL_MS_DEFAULT, Scope, SendOutcome};
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

/// Recent runs, newest first, optionally filtered.
#[utoipa::path(get, path = "/v1/runs", tag = "runs", params(RunsQuery),
    responses((status = 200, description = "Runs", body = [RunView]),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 422, description = "Invalid query", body = ErrorBody)))]
async fn list_runs(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    q: Result<Query<RunsQuery>, QueryRejection>,
) -> Result<Json<Vec<Value>>, ApiError> {
    caller.require(Scope::Read)?;
    let q = query(q)?;
    let limit = page(q.limit)?;
    let status = filter("status", q.status)?;
    let definition = filter("definition", q.definition)?;
    let rows = app
        .store
        .list_runs(status.as_deref(), definition.as_deref(), limit)
        .await?;
    Ok(Json(rows.iter().map(run_json).collect()))
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
