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
use rein_core::Format;
use rein_store::{RunFilter, Scope, Sender};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{IntoParams, Modify, OpenApi, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use rein_ops::schema;
use rein_ops::service::{NEXT_AFTER, NEXT_CURSOR};
use rein_ops::{Code, Error, ErrorBody};

use crate::extract::{
    DefinitionPath, caller_name, definition_name, idempotency_key, page_body, paging_headers,
    parse_body, path_id, query,
};
use crate::{ApiError, App, Caller};
use rein_ops::service::{
    self, CurrentResponse, DefinitionView, Delivery, EnqueueBody, EnqueueResponse, Publisher,
    RegisterResponse, RerunResponse, SendResponse,
};

type AppState = State<Arc<App>>;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Rein API",
        description = "Durable runs of LLM agents on PostgreSQL: enqueue, inspect, send events, decide approvals."
    ),
    tags(
        (name = "runs", description = "Runs: enqueue, read and page, send events, rerun, diagnose"),
        (name = "approvals", description = "Approval requests and the decisions on them"),
        (name = "definitions", description = "State-machine definitions and their versions"),
        (name = "blobs", description = "Large payload values, stored once by content hash"),
        (name = "fleet", description = "Workers and schedulers"),
        (name = "health", description = "Probes and metrics, without a token"),
        (name = "meta", description = "This document, without a token")
    ),
    servers((url = "/", description = "The server this document was read from (`rein api` serves it at /openapi.json)")),
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
    let mut router = OpenApiRouter::with_openapi(ApiDoc::openapi())
        .routes(routes!(healthz))
        .routes(routes!(metrics))
        .routes(routes!(readyz))
        .routes(routes!(openapi_json))
        .routes(routes!(me))
        .routes(routes!(list_runs, enqueue_run))
        .routes(routes!(get_run))
        .routes(routes!(why_run))
        .routes(routes!(run_usage))
        .routes(routes!(run_events, send_event))
        .routes(routes!(crate::stream::stream_run))
        .routes(routes!(list_approvals))
        .routes(routes!(grant_approval))
        .routes(routes!(deny_approval))
        .routes(routes!(rerun_run))
        .routes(routes!(list_workers))
        .routes(routes!(list_definitions, register_definition))
        .routes(routes!(get_definition))
        .routes(routes!(set_current_definition))
        .routes(routes!(crate::moves::migrate_definition))
        .routes(routes!(crate::moves::fork_run))
        .routes(routes!(crate::moves::redact_run))
        .routes(routes!(crate::recovery::brief_run))
        .routes(routes!(crate::recovery::verify_run))
        .routes(routes!(crate::recovery::whatif_run))
        .routes(routes!(crate::recovery::resolve_run))
        .routes(routes!(crate::recovery::list_limits))
        .routes(routes!(crate::webhooks::list_webhooks))
        .routes(routes!(crate::webhooks::list_deliveries))
        .routes(routes!(get_blob));
    schema::document_bad_path_parameters(router.get_openapi_mut());
    schema::document_errors(router.get_openapi_mut());
    schema::optional_bodies_without_null(router.get_openapi_mut());
    schema::link_runs(router.get_openapi_mut());
    router
}

// ---- shapes -------------------------------------------------------------------------------

#[derive(Serialize, ToSchema)]
struct Health {
    status: String,
}

/// An event sent to a run from outside.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"type": "CANCEL", "payload": {}}))]
struct SendBody {
    /// Event type, e.g. USER_REPLY or CANCEL: a name of the run's definition.
    #[serde(rename = "type")]
    #[schema(value_type = schema::Name)]
    kind: String,
    /// Any JSON value (default `{}`).
    #[serde(default = "empty_object")]
    #[schema(value_type = Value)]
    payload: Value,
}

/// A person's decision on an approval request. The body is optional: none (or `{}`)
/// decides without a comment.
#[derive(Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
struct DecideBody {
    /// Why; kept with the decision (at most 4096 bytes).
    #[schema(value_type = Option<schema::Comment>)]
    comment: Option<String>,
}

/// A run as `GET /v1/runs/{id}` returns it.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct RunView {
    run_id: Uuid,
    definition: String,
    version: u32,
    #[schema(value_type = schema::Status)]
    status: String,
    /// The state of its definition it is in (the definition's own names).
    state: String,
    sequence: i64,
    attempt: u32,
    steps_completed: u32,
    /// The action the run's current step dispatched and has no result for yet.
    #[schema(value_type = Option<schema::JsonObject>)]
    pending_action: Option<Value>,
    terminal_reason: Option<String>,
    /// Who enqueued it: the token's subject, the CLI's `--as` name; a fan-out branch's
    /// parent's. Absent for runs created before Rein recorded it.
    enqueued_by: Option<String>,
    #[schema(value_type = schema::Name)]
    queue: String,
    priority: i32,
    /// The run that started it as a branch (fan-out); absent for a run enqueued directly.
    parent_run_id: Option<Uuid>,
    /// When it reached a terminal status.
    finished_at: Option<DateTime<Utc>>,
    /// Its newest event: type, sequence and time.
    last_event: Option<LastEventView>,
    lease: LeaseView,
    wake_at: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    state_entered_at: DateTime<Utc>,
    /// The run's business data: always in `GET /v1/runs/{id}`, in `GET /v1/runs` only with
    /// `data=true`.
    #[schema(value_type = Option<schema::JsonObject>)]
    data: Option<Value>,
    /// What its model calls used, all models together (`GET /v1/runs/{id}/usage` has them
    /// by model); null for a run with no model call.
    usage: Option<rein_ops::usage::UsageSums>,
}

#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct LastEventView {
    #[serde(rename = "type")]
    kind: String,
    sequence: i64,
    occurred_at: DateTime<Utc>,
}

/// Who the bearer token belongs to and what it may do: what a client shows and hides.
#[derive(Serialize, ToSchema)]
struct MeView {
    /// The token's subject: what decisions and sent events record as their sender.
    subject: String,
    /// Its scopes; `admin` includes every other.
    scopes: Vec<String>,
    token_id: Uuid,
    /// The queues its runs may be in; absent when it is not bound to queues.
    queues: Option<Vec<String>>,
    /// The highest priority it may give a run; absent when unbounded.
    priority_max: Option<i32>,
}

#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct LeaseView {
    worker: Option<String>,
    token: i64,
    until: Option<DateTime<Utc>>,
    live: bool,
}

/// One page of `GET /v1/runs?envelope=true`: the runs and, in the body as in the headers,
/// where the next page starts.
#[derive(Serialize, ToSchema)]
struct RunsPageView {
    runs: Vec<RunView>,
    /// The `cursor` of the next page (as `Rein-Next-Cursor`); null on the last page.
    #[schema(value_type = Option<schema::Cursor>)]
    next_cursor: Option<String>,
    /// Whether the page holds fewer runs than `limit` because more would pass its byte
    /// bound (as `Rein-Page-Truncated`).
    truncated: bool,
}

/// What `GET /v1/runs` answers: the runs as an array, or with `envelope=true` an object that
/// carries the cursor too.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
enum RunsAnswer {
    Runs(Vec<RunView>),
    Page(RunsPageView),
}

/// One page of `GET /v1/runs/{id}/events?envelope=true`: the events and, in the body as in
/// the headers, where the next page starts.
#[derive(Serialize, ToSchema)]
struct EventsPageView {
    events: Vec<EventView>,
    /// The `after` of the next page (as `Rein-Next-After`); null on the last page.
    #[schema(value_type = Option<schema::Sequence>)]
    next_after: Option<i64>,
    /// Whether the page holds fewer events than `limit` because more would pass its byte
    /// bound (as `Rein-Page-Truncated`).
    truncated: bool,
}

/// What `GET /v1/runs/{id}/events` answers: the events as an array, or with
/// `envelope=true` an object that carries the next page's `after` too.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
#[allow(dead_code)]
enum EventsAnswer {
    Events(Vec<EventView>),
    Page(EventsPageView),
}

/// A worker or scheduler as `GET /v1/workers` lists it.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct WorkerView {
    worker_id: String,
    /// `worker` or `scheduler`.
    role: String,
    started_at: DateTime<Utc>,
    /// Its last heartbeat, by the database clock.
    heartbeat_at: DateTime<Utc>,
    /// Milliseconds since its last heartbeat.
    silent_ms: f64,
    /// Runs it holds a live lease on right now.
    leases_held: i64,
    /// Whether it holds a live leader lease (a scheduler doing the scanning).
    leader: bool,
    /// What it reported about itself with its heartbeat (queues, version...).
    #[schema(value_type = schema::JsonObject)]
    info: Value,
}

/// Why a run is where it is, as `rein why --json` prints it: the facts in the order of a
/// diagnosis, then what it waits for and what would move it.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct WhyView {
    run_id: Uuid,
    definition: String,
    version: u32,
    queue: String,
    state: String,
    #[schema(value_type = schema::Status)]
    status: String,
    since: WhySince,
    sequence: i64,
    attempt: u32,
    terminal_reason: Option<String>,
    /// The newest event of its log: sequence, type, payload, node, token, worker,
    /// occurred_at, ago_ms.
    #[schema(value_type = Option<schema::JsonObject>)]
    last_event: Option<Value>,
    lease: Option<WhyLease>,
    fencing_token: i64,
    /// The dispatched action without a result: node, step, action_id, tool, status,
    /// call_id, idempotency_key and its ledger row.
    #[schema(value_type = Option<schema::JsonObject>)]
    pending_action: Option<Value>,
    /// The newest decision the guards rejected, with the guard's reason.
    #[schema(value_type = Option<schema::JsonObject>)]
    last_rejection: Option<Value>,
    needs_operator: bool,
    operator_reason: Option<String>,
    /// The newest OPERATOR_REQUIRED event: sequence and reason.
    #[schema(value_type = Option<schema::JsonObject>)]
    operator_required: Option<Value>,
    /// The last error a step reported (any JSON value).
    #[schema(value_type = Value)]
    last_error: Option<Value>,
    effects: WhyEffects,
    /// Its approval requests.
    #[schema(value_type = Vec<schema::JsonObject>)]
    approvals: Vec<Value>,
    /// Events waiting in its inbox for a state that takes them.
    #[schema(value_type = Vec<schema::JsonObject>)]
    inbox: Vec<Value>,
    timer: Option<WhyTimer>,
    fleet: WhyFleet,
    /// The database clock when these facts were read.
    db_now: DateTime<Utc>,
    /// The transitions out of the run's state, highest priority first within an event,
    /// each with its guards' values against the run as it is (SPEC I4): `{event, from, to,
    /// priority, index, holds, chosen, guards: [{kind, name, expr, value (true, false,
    /// error, not_evaluated), error, reads_event}]}`. Guards are evaluated with an event
    /// without payload; one that reads the event says so.
    #[schema(value_type = Vec<schema::JsonObject>)]
    transitions_out: Vec<Value>,
    /// What the run waits for, in words.
    waiting_for: String,
    /// What would move it, in words.
    next_step: String,
}

#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct WhySince {
    state_entered_at: DateTime<Utc>,
    in_state_ms: f64,
    updated_at: DateTime<Utc>,
    updated_ago_ms: f64,
}

#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct WhyLease {
    worker: String,
    token: i64,
    until: Option<DateTime<Utc>>,
    live: bool,
    /// Milliseconds until it expires; negative once it has.
    left_ms: Option<f64>,
}

/// The side effects of the run's actions.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct WhyEffects {
    /// Rows of the side-effect ledger: one per dispatched action.
    #[schema(value_type = Vec<schema::JsonObject>)]
    actions: Vec<Value>,
    /// What the simulated tools recorded.
    #[schema(value_type = Vec<schema::JsonObject>)]
    sim: Vec<Value>,
}

#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct WhyTimer {
    wake_at: DateTime<Utc>,
    /// Milliseconds until it fires; negative when overdue.
    due_in_ms: Option<f64>,
}

/// Live members of the fleet, by their heartbeats in the last minute.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct WhyFleet {
    workers: i64,
    schedulers: i64,
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
    /// Any JSON value (an object for the engine's own events).
    #[schema(value_type = Value)]
    payload: Value,
    node: Option<String>,
    schema_version: i32,
    token: i64,
    worker: String,
    occurred_at: DateTime<Utc>,
    /// Who sent it from outside the engine: `api:SUBJECT` for an API token, the `--as` name
    /// of the CLI, the approver or the operator. Absent for the engine's own events.
    sender: Option<String>,
}

/// An approval request.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct ApprovalView {
    approval_id: Uuid,
    run_id: Uuid,
    node: String,
    tool: String,
    /// The tool's arguments, as the action would send them.
    #[schema(value_type = Value)]
    args: Value,
    action_hash: String,
    risk: String,
    #[schema(value_type = schema::ApprovalStatus)]
    status: String,
    requested_at: DateTime<Utc>,
    expires_at: DateTime<Utc>,
    decided_by: Option<String>,
    decided_at: Option<DateTime<Utc>>,
    comment: Option<String>,
    consumed_at: Option<DateTime<Utc>>,
    open: bool,
}

/// A decided approval request and how the decision reached its run.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
struct DecisionView {
    #[serde(flatten)]
    approval: ApprovalView,
    delivery: Delivery,
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct RunsQuery {
    /// Only runs with this status.
    #[param(value_type = Option<schema::Status>, inline)]
    status: Option<String>,
    /// Only runs of this definition.
    #[param(value_type = Option<schema::Name>, inline)]
    definition: Option<String>,
    /// Only runs in this state of their definition.
    #[param(value_type = Option<schema::Name>, inline)]
    state: Option<String>,
    /// Only runs in this queue.
    #[param(value_type = Option<schema::Name>, inline)]
    queue: Option<String>,
    /// Only the branches (child runs) of this run.
    parent: Option<Uuid>,
    /// Only runs whose id starts with these hex digits (1 to 32; dashes ignored).
    #[param(value_type = Option<schema::IdPrefix>, inline)]
    id_prefix: Option<String>,
    /// At most this many, newest first (default 50).
    #[param(value_type = Option<schema::PageLimit>, inline)]
    limit: Option<i64>,
    /// Continue after the last run of a previous page: the `Rein-Next-Cursor` header it
    /// came with.
    #[param(value_type = Option<schema::Cursor>, inline)]
    cursor: Option<String>,
    /// Only runs created strictly after this instant (RFC 3339).
    created_after: Option<DateTime<Utc>>,
    /// Only runs created strictly before this instant (RFC 3339).
    created_before: Option<DateTime<Utc>>,
    /// Each run with its `data` (default false: a list leaves the business data out).
    data: Option<bool>,
    /// Answer an object, `{runs, next_cursor, truncated}`, that carries the paging headers'
    /// facts in the body too (default false: the runs as an array).
    envelope: Option<bool>,
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct EventsQuery {
    /// Only events after this sequence number (default 0: from the first): the
    /// `Rein-Next-After` header of the page before.
    #[param(value_type = Option<schema::Sequence>, inline)]
    after: Option<i64>,
    /// At most this many, in sequence order (default 100).
    #[param(value_type = Option<schema::PageLimit>, inline)]
    limit: Option<i64>,
    /// Answer an object, `{events, next_after, truncated}`, that carries the paging headers'
    /// facts in the body too (default false: the events as an array).
    envelope: Option<bool>,
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct ApprovalsQuery {
    /// Every request, decided, expired and void ones too (default: only open ones).
    all: Option<bool>,
    /// Only this run's requests.
    run: Option<Uuid>,
    /// At most this many, newest first (default 50).
    #[param(value_type = Option<schema::PageLimit>, inline)]
    limit: Option<i64>,
}

fn empty_object() -> Value {
    json!({})
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

/// Prometheus metrics of this process, in the text exposition format.
#[utoipa::path(get, path = "/metrics", tag = "health", security(()),
    responses((status = 200, description = "Metrics", content_type = "text/plain", body = String)))]
async fn metrics(State(app): AppState) -> Response {
    crate::metrics_endpoint::metrics_handler(&app.store)
        .await
        .into_response()
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
        Err(e) => {
            ApiError::from(Error::new(Code::Unavailable, format!("not ready: {e}"))).into_response()
        }
    }
}

/// This document. It needs no token: it describes the API and holds no tenant's data.
#[utoipa::path(get, path = "/openapi.json", tag = "meta", security(()),
    responses((status = 200, description = "The OpenAPI 3.1 document", body = schema::JsonObject)))]
async fn openapi_json(State(app): AppState) -> Response {
    match app.openapi.get() {
        Some(doc) => Json(doc.clone()).into_response(),
        None => ApiError::from(Error::new(
            Code::Unavailable,
            "the document is not built yet".to_owned(),
        ))
        .into_response(),
    }
}

/// Create a run. With an `Idempotency-Key` header, the same key with the same body returns
/// the same run. Keys belong to the token's subject: another subject's same key is another
/// key. A token bound to queues enqueues only into them (into its first when the body names
/// none) and within its priority ceiling; a token with quotas is refused with 429 and
/// `Retry-After` while they are used up.
#[utoipa::path(post, path = "/v1/runs", tag = "runs", request_body = EnqueueBody,
    params(("Idempotency-Key" = inline(Option<schema::IdempotencyKey>), Header, nullable = false, description = "Client key (1..=256 bytes), scoped to the token's subject: the same key with the same body returns the same run; with another body it is a conflict")),
    responses((status = 201, description = "Created", body = EnqueueResponse),
              (status = 200, description = "The run this Idempotency-Key already created for this body", body = EnqueueResponse),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the enqueue scope, or the queue or priority is beyond the token's bounds (details: queue and allowed_queues, or priority and priority_max)", body = ErrorBody),
              (status = 404, description = "No such definition (version)", body = ErrorBody),
              (status = 409, description = "The Idempotency-Key was used with another body (conflict; details.idempotency_key)", body = ErrorBody),
              (status = 413, description = "Body too large", body = ErrorBody),
              (status = 422, description = "Invalid request (details.field names a field that cannot be stored, e.g. one with a NUL character)", body = ErrorBody),
              (status = 429, description = "A quota of the token is used up (quota_exceeded; details: quota, limit, retry_after_s)", body = ErrorBody,
               headers(("Retry-After" = u64, description = "Seconds until asking again may succeed")))))]
async fn enqueue_run(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let who = caller.require(Scope::Enqueue)?;
    let body: EnqueueBody = parse_body(&body)?;
    let key = idempotency_key(&headers)?;
    let done = service::enqueue(
        &app.store,
        body,
        key,
        (&caller_name(&who.subject), &who.subject),
        Some(who),
        super::trace_layer::traceparent(&headers),
    )
    .await?;
    let status = if done.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(done)).into_response())
}

/// Recent runs, newest first by (created_at, run_id), optionally filtered, without their
/// `data` unless `data=true`. When more runs follow, the `Rein-Next-Cursor` header carries
/// the `cursor` of the next page. A page holds at most about `rein api --page-bytes-max`
/// bytes (default 2 MiB) of runs, and always one: when the bound cuts it short of `limit`,
/// `Rein-Page-Truncated: bytes` says so and the cursor continues after its last run.
#[utoipa::path(get, path = "/v1/runs", tag = "runs", params(RunsQuery),
    responses((status = 200, description = "Runs: an array, or with `envelope=true` a page object", body = RunsAnswer,
               headers(("Rein-Next-Cursor" = String, description = "Cursor of the next page; absent on the last page"),
                       ("Rein-Page-Truncated" = String, description = "`bytes` when the page holds fewer runs than `limit` because more would pass the page's byte bound; absent otherwise"))),
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
    let id_range = match q.id_prefix.as_deref() {
        None => None,
        Some(prefix) => Some(rein_store::id_prefix_range(prefix).ok_or_else(|| {
            Error::validation("id_prefix must be 1 to 32 hex digits of a run id (dashes allowed)")
                .with_details(json!({ "field": "id_prefix" }))
        })?),
    };
    let filter = RunFilter {
        status: q.status,
        definition: q.definition,
        created_after: q.created_after,
        created_before: q.created_before,
        state: q.state,
        queue: q.queue,
        parent: q.parent,
        id_range,
    };
    let shape = (q.data.unwrap_or(false), app.limits.page_bytes_max);
    let page = service::runs(&app.store, filter, q.cursor.as_deref(), q.limit, shape).await?;
    let envelope = q.envelope.unwrap_or(false);
    let mut response = page_body(
        envelope,
        ("runs", page.runs),
        ("next_cursor", json!(page.next)),
        page.truncated,
    );
    paging_headers(&mut response, (NEXT_CURSOR, page.next), page.truncated);
    Ok(response)
}

/// The caller: the bearer token's subject, scopes and bounds.
#[utoipa::path(get, path = "/v1/me", tag = "meta",
    responses((status = 200, description = "The token's subject, scopes and bounds", body = MeView),
              (status = 401, description = "No or bad token", body = ErrorBody)))]
async fn me(Extension(caller): Extension<Caller>) -> Json<MeView> {
    let token = caller.0;
    Json(MeView {
        subject: token.subject,
        scopes: token.scopes,
        token_id: token.token_id,
        queues: token.bounds.queues,
        priority_max: token.bounds.priority_max,
    })
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
    Ok(Json(service::run(&app.store, path_id(id)?).await?))
}

/// Why the run is where it is (what `rein why` prints): state and since when, last event,
/// lease, pending action, rejected decisions, side effects, approvals, inbox, timer, and
/// what it waits for and what would move it.
#[utoipa::path(get, path = "/v1/runs/{id}/why", tag = "runs",
    params(("id" = Uuid, Path, description = "Run id")),
    responses((status = 200, description = "The diagnosis", body = WhyView),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody)))]
async fn why_run(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
) -> Result<Json<Value>, ApiError> {
    caller.require(Scope::Read)?;
    Ok(Json(service::why(&app.store, path_id(id)?).await?))
}

/// What the run's model calls used, by model (the model its definition asked for) and in
/// all: calls, input and output tokens, reasoning and cached tokens where the server
/// reported them, and cost where the model has a price. Budget or not.
#[utoipa::path(get, path = "/v1/runs/{id}/usage", tag = "runs",
    params(("id" = Uuid, Path, description = "Run id")),
    responses((status = 200, description = "The run's model usage", body = rein_ops::usage::UsageView),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody)))]
async fn run_usage(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
) -> Result<Json<rein_ops::usage::UsageView>, ApiError> {
    caller.require(Scope::Read)?;
    Ok(Json(
        rein_ops::usage::usage(&app.store, path_id(id)?).await?,
    ))
}

/// Run a finished run again: a new run with its definition version, input, queue and
/// priority, linked to it (SPEC E6). It is held to the token's bounds and quotas like an
/// enqueue.
#[utoipa::path(post, path = "/v1/runs/{id}/rerun", tag = "runs",
    params(("id" = Uuid, Path, description = "A finished run")),
    responses((status = 201, description = "The new run", body = RerunResponse),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the operate scope, or the run's queue or priority is beyond the token's bounds", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody),
              (status = 409, description = "The run has not finished", body = ErrorBody),
              (status = 429, description = "A quota of the token is used up (quota_exceeded)", body = ErrorBody,
               headers(("Retry-After" = u64, description = "Seconds until asking again may succeed")))))]
async fn rerun_run(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
) -> Result<Response, ApiError> {
    let who = caller.require(Scope::Operate)?;
    let done = service::rerun(&app.store, path_id(id)?, &who.subject, Some(who)).await?;
    Ok((StatusCode::CREATED, Json(done)).into_response())
}

/// Workers and schedulers: last heartbeat (by the database clock) and leases held.
#[utoipa::path(get, path = "/v1/workers", tag = "fleet",
    responses((status = 200, description = "Workers and schedulers", body = [WorkerView]),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody)))]
async fn list_workers(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Value>, ApiError> {
    caller.require(Scope::Read)?;
    Ok(Json(json!(service::workers(&app.store).await?)))
}

/// The run's event log in sequence order, a page at a time: while more events follow, the
/// `Rein-Next-After` header carries the `after` of the next page. A page holds at most about
/// `rein api --page-bytes-max` bytes of events, and always one; `Rein-Page-Truncated: bytes`
/// says when that bound cut it short of `limit`.
#[utoipa::path(get, path = "/v1/runs/{id}/events", tag = "runs",
    params(("id" = Uuid, Path, description = "Run id"), EventsQuery),
    responses((status = 200, description = "The run's events: an array, or with `envelope=true` a page object", body = EventsAnswer,
               headers(("Rein-Next-After" = String, description = "The `after` of the next page (the last sequence number of this one); absent on the last page"),
                       ("Rein-Page-Truncated" = String, description = "`bytes` when the page holds fewer events than `limit` because more would pass the page's byte bound; absent otherwise"))),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody),
              (status = 422, description = "Invalid query", body = ErrorBody)))]
async fn run_events(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
    q: Result<Query<EventsQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    caller.require(Scope::Read)?;
    let id = path_id(id)?;
    let q = query(q)?;
    let page = service::events(&app.store, id, q.after, q.limit, app.limits.page_bytes_max).await?;
    let envelope = q.envelope.unwrap_or(false);
    let mut response = page_body(
        envelope,
        ("events", json!(page.events)),
        ("next_after", json!(page.next)),
        page.truncated,
    );
    let next = page.next.map(|after| after.to_string());
    paging_headers(&mut response, (NEXT_AFTER, next), page.truncated);
    Ok(response)
}

/// Send an event to a run (reply, cancel, ...): applied at once when no worker holds the
/// run and its state takes the event, otherwise queued in its inbox. Only CANCEL and the
/// definition's `external_events` are accepted; engine events and call results are the
/// engine's own (event_not_allowed). An approval event also needs the approve scope, and
/// its payload's `approver` is the token's subject, whatever the request wrote there. The
/// event records the token's subject as its sender. A token bound to queues sends only to
/// runs in them.
#[utoipa::path(post, path = "/v1/runs/{id}/events", tag = "runs", request_body = SendBody,
    params(("id" = Uuid, Path, description = "Run id"),
           ("Idempotency-Key" = inline(Option<schema::IdempotencyKey>), Header, nullable = false, description = "Client key (1..=256 bytes): sending again with the same key returns what became of the first send instead of applying it twice")),
    responses((status = 200, description = "Applied", body = SendResponse),
              (status = 202, description = "Queued in the run's inbox", body = SendResponse),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the operate scope (forbidden; an approval event also needs approve; a token bound to queues reaches only runs in them), or the event is not one outside callers may send (event_not_allowed)", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody),
              (status = 409, description = "The run cannot take this event (invalid_transition), or the Idempotency-Key was used with another event (conflict)", body = ErrorBody),
              (status = 413, description = "Body too large", body = ErrorBody),
              (status = 422, description = "Invalid request (details.field names a field that cannot be stored, e.g. one with a NUL character)", body = ErrorBody)))]
async fn send_event(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let who = caller.require(Scope::Operate)?;
    let id = path_id(id)?;
    let key = idempotency_key(&headers)?;
    let body: SendBody = parse_body(&body)?;
    let sender = Sender::Outside {
        name: caller_name(&who.subject),
        approver: who.allows(Scope::Approve).then(|| who.subject.clone()),
    };
    let sent = service::send(
        &app.store,
        id,
        &body.kind,
        body.payload,
        &sender,
        key.as_deref(),
        Some(who),
    )
    .await?;
    let status = if sent.applied() {
        StatusCode::OK
    } else {
        StatusCode::ACCEPTED
    };
    Ok((status, Json(sent)).into_response())
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
    let rows = service::approvals(&app.store, q.all.unwrap_or(false), q.run, q.limit).await?;
    Ok(Json(rows).into_response())
}

/// Grant an approval request; the token's subject is recorded as the approver. Where the
/// run's definition sets `approver_may_not_be_enqueuer` (or the server runs with
/// `--approver-may-not-be-enqueuer`), the subject that enqueued the run may not grant it.
#[utoipa::path(post, path = "/v1/approvals/{id}/grant", tag = "approvals", request_body = Option<DecideBody>,
    params(("id" = Uuid, Path, description = "Approval request id")),
    responses((status = 200, description = "Granted; `delivery` says which event the run got and whether it is applied or queued", body = DecisionView),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the approve scope; a token bound to queues decides only for runs in them; or the token's subject enqueued the run and the duties are separated (details.rule)", body = ErrorBody),
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
#[utoipa::path(post, path = "/v1/approvals/{id}/deny", tag = "approvals", request_body = Option<DecideBody>,
    params(("id" = Uuid, Path, description = "Approval request id")),
    responses((status = 200, description = "Denied; `delivery` says which event the run got and whether it is applied or queued", body = DecisionView),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the approve scope; a token bound to queues decides only for runs in them", body = ErrorBody),
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
    let decided = service::decide(
        &app.store,
        id,
        grant,
        &who.subject,
        body.comment.as_deref(),
        Some(who),
    )
    .await?;
    Ok(Json(decided).into_response())
}

// ---- blobs --------------------------------------------------------------------------------

/// A large payload value an event refers to by hash (`{"$blob": {"sha256": H, "bytes": N}}`
/// in its payload, or a model prompt's message hashes), read back and checked against the
/// hash. A token sees a blob only when a run it may read refers to it (a token bound to
/// queues: a run in one of them); with `run`, only when that run, or a run it was forked
/// from, refers to it (a fork reads its source's blobs even from another queue). A run
/// refers to the blobs its own commits stored or found stored, never to a hash written into
/// a payload. Otherwise the answer is 404, as for an unknown hash. A path that is not 64
/// lowercase hex digits is refused like any malformed path (422).
#[utoipa::path(get, path = "/v1/blobs/{sha256}", tag = "blobs",
    params(("sha256" = inline(schema::Sha256), Path, description = "The blob's sha256: 64 lowercase hex digits"),
           BlobQuery),
    responses((status = 200, description = "The blob's value, size and hash", body = service::BlobView),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 404, description = "No such blob, or none that a run this token may read (with `run`: that run or one it was forked from) refers to", body = ErrorBody),
              (status = 422, description = "Invalid hash or query", body = ErrorBody)))]
async fn get_blob(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    sha256: Result<Path<String>, PathRejection>,
    q: Result<Query<BlobQuery>, QueryRejection>,
) -> Result<Response, ApiError> {
    let who = caller.require(Scope::Read)?;
    let sha256 = sha256
        .map(|Path(s)| s)
        .map_err(|e| Error::validation(format!("bad blob hash in the path: {e}")))?;
    let q = query(q)?;
    Ok(Json(service::blob(&app.store, &sha256, q.run, Some(who)).await?).into_response())
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct BlobQuery {
    /// Read the blob as this run's: it or a run it was forked from must refer to it.
    run: Option<Uuid>,
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
    /// Who registered it (a token's subject, the CLI's `--as` name, `rein` for a
    /// built-in); absent for versions registered before Rein recorded it.
    registered_by: Option<String>,
    /// Whether runs enqueued without a version start with this one.
    current: bool,
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct DefinitionQuery {
    /// This version; the name's current version when absent.
    #[param(value_type = Option<schema::Version>, inline)]
    version: Option<u32>,
}

/// Which version of a definition name runs enqueued without a version start with.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"version": 2}))]
struct CurrentBody {
    /// A registered version of the name.
    #[serde(default, deserialize_with = "schema::integral")]
    #[schema(value_type = schema::Version, required = true)]
    version: Option<u32>,
    /// For a built-in name, allow a version other than the one this binary ships (needs
    /// the admin scope).
    #[serde(default)]
    allow_builtin: bool,
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
struct RegisterQuery {
    /// Overrides the Content-Type (JSON unless `application/toml` or `application/yaml`).
    #[param(inline)]
    format: Option<DocumentFormat>,
    /// Make this version the name's current one (the one runs enqueued without a version
    /// start with). A new name's first version is current anyway; otherwise registering
    /// leaves the pointer where it is.
    make_current: Option<bool>,
    /// For a built-in name (lifecycle, research-agent, refund-agent, chain4), allow a
    /// version other than the one this binary ships (needs the admin scope).
    allow_builtin: Option<bool>,
}

/// The language of a definition document.
#[derive(Deserialize, ToSchema, Clone, Copy)]
#[serde(rename_all = "lowercase")]
enum DocumentFormat {
    Toml,
    Json,
    Yaml,
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
    Ok(Json(service::definitions(&app.store).await?).into_response())
}

/// One definition version (the current one unless `version`) with its spec, who
/// registered it and whether it is current.
#[utoipa::path(get, path = "/v1/definitions/{name}", tag = "definitions",
    params(DefinitionPath, DefinitionQuery),
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
    let name = definition_name(name)?;
    let q = query(q)?;
    Ok(Json(service::definition(&app.store, &name, q.version).await?).into_response())
}

/// Register a definition version, recorded as published by the token's subject. The body
/// is the document: TOML with `Content-Type: application/toml` or `?format=toml`, YAML with
/// `application/yaml` (or `text/yaml`, `application/x-yaml`) or `?format=yaml`, JSON
/// otherwise; all three give one definition the same hash. The same body again is a no-op; a
/// different body under a registered version is refused. The version becomes current only with `make_current=true` (or as a new name's
/// first); a built-in name takes no other version than the shipped one without
/// `allow_builtin=true` (admin).
#[utoipa::path(post, path = "/v1/definitions", tag = "definitions",
    request_body(description = "The definition document (JSON, TOML or YAML)",
                 content((schema::JsonObject = "application/json"), (String = "application/toml"), (String = "application/yaml"))),
    params(RegisterQuery),
    responses((status = 201, description = "Registered", body = RegisterResponse),
              (status = 200, description = "This body was already registered", body = RegisterResponse),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the publish scope (allow_builtin: admin)", body = ErrorBody),
              (status = 409, description = "The version is registered with another body, or the name is a built-in's (details.builtin_version)", body = ErrorBody),
              (status = 413, description = "Body too large", body = ErrorBody),
              (status = 422, description = "Invalid definition; details.problems locates each problem", body = ErrorBody)))]
async fn register_definition(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    q: Result<Query<RegisterQuery>, QueryRejection>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let who = caller.require(Scope::Publish)?;
    let q = query(q)?;
    let allow_builtin = q.allow_builtin.unwrap_or(false);
    if allow_builtin {
        caller.require(Scope::Admin)?;
    }
    let format = match q.format {
        Some(DocumentFormat::Toml) => Format::Toml,
        Some(DocumentFormat::Json) => Format::Json,
        Some(DocumentFormat::Yaml) => Format::Yaml,
        None => {
            let media = headers
                .get(axum::http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.split(';').next())
                .map(|v| v.trim().to_ascii_lowercase());
            match media.as_deref() {
                Some("application/toml") => Format::Toml,
                Some("application/yaml" | "application/x-yaml" | "text/yaml") => Format::Yaml,
                _ => Format::Json,
            }
        }
    };
    let text =
        std::str::from_utf8(&body).map_err(|_| Error::validation("the definition is not UTF-8"))?;
    let publisher = Publisher {
        by: &who.subject,
        make_current: q.make_current.unwrap_or(false),
        allow_builtin,
        model_keys: &app.model_keys,
    };
    let done = service::register(&app.store, text, format, publisher).await?;
    let status = if done.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(done)).into_response())
}

/// Make a registered version the name's current one: runs enqueued without a version (and
/// fan-out branches that name none) start with it from now on; runs already started keep
/// theirs. Recorded as moved by the token's subject. A built-in name takes no other version
/// than the shipped one without `allow_builtin` (admin).
#[utoipa::path(post, path = "/v1/definitions/{name}/current", tag = "definitions",
    request_body = CurrentBody,
    params(DefinitionPath),
    responses((status = 200, description = "The current version now, and the one before", body = CurrentResponse),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the publish scope (allow_builtin: admin)", body = ErrorBody),
              (status = 404, description = "No such name or version", body = ErrorBody),
              (status = 409, description = "The name is a built-in's and the version is not the shipped one (details.builtin_version)", body = ErrorBody),
              (status = 422, description = "Invalid request", body = ErrorBody)))]
async fn set_current_definition(
    State(app): AppState,
    Extension(caller): Extension<Caller>,
    name: Result<Path<String>, PathRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let who = caller.require(Scope::Publish)?;
    let name = definition_name(name)?;
    let body: CurrentBody = parse_body(&body)?;
    let version = body.version.ok_or_else(|| {
        Error::validation("name the version to make current: {\"version\": N}")
            .with_details(json!({ "field": "version" }))
    })?;
    if body.allow_builtin {
        caller.require(Scope::Admin)?;
    }
    let moved = service::set_current(
        &app.store,
        &name,
        version,
        (&who.subject, body.allow_builtin),
    )
    .await?;
    Ok(Json(moved).into_response())
}
