//! Routes for runs that need a person and for the fleet's limits: the resume brief, verifying
//! a log, a what-if replay on another definition, resolving an in-doubt call
//! ([`rein_ops::recovery`]), and the limits in Redis.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Extension, Path, Query, State};
use axum::response::{IntoResponse, Response};
use rein_accel::limits::KeyState;
use rein_ops::recovery::{self, BriefView, ResolveBody, ResolveResponse, VerifyView};
use rein_ops::{Code, Error, ErrorBody};
use rein_store::Scope;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use crate::extract::{parse_body, path_id, query};
use crate::{ApiError, App, Caller};

/// The resume brief a model would be given to pick the run up (what `rein brief` prints):
/// task, steps done with their results (or references), the pending step, the last error.
/// A checkpoint that does not match the log is named in `warnings`, and the brief follows
/// the log.
#[utoipa::path(get, path = "/v1/runs/{id}/brief", tag = "runs",
    params(("id" = Uuid, Path, description = "Run id")),
    responses((status = 200, description = "The brief", body = BriefView),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody)))]
pub async fn brief_run(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
) -> Result<Json<BriefView>, ApiError> {
    caller.require(Scope::Read)?;
    Ok(Json(recovery::brief(&app.store, path_id(id)?).await?))
}

/// Whether the run's log replays to its stored projection and to every checkpoint (what
/// `rein runs verify` checks). A mismatch is an answer (`ok: false` and the `problem`), not
/// an error.
#[utoipa::path(get, path = "/v1/runs/{id}/verify", tag = "runs",
    params(("id" = Uuid, Path, description = "Run id")),
    responses((status = 200, description = "The verdict", body = VerifyView),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody)))]
pub async fn verify_run(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
) -> Result<Json<VerifyView>, ApiError> {
    caller.require(Scope::Read)?;
    Ok(Json(recovery::verify(&app.store, path_id(id)?).await?))
}

#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct WhatIfQuery {
    /// The registered definition version to replay on: `NAME@VERSION`, or `NAME` for its
    /// current version (default: the current version of the run's own definition name).
    #[param(value_type = Option<rein_ops::schema::NamedVersion>, inline)]
    definition: Option<String>,
}

/// A definition as a what-if names it.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub struct WhatIfDefinition {
    name: String,
    version: u32,
    hash: String,
}

/// What a what-if replay found, as `rein replay RUN --definition … --json` prints it.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub struct WhatIfView {
    run_id: Uuid,
    /// The version the compared events ran on.
    recorded_definition: WhatIfDefinition,
    /// The version replayed on.
    definition: WhatIfDefinition,
    #[schema(value_type = rein_ops::schema::WhatIfVerdict)]
    verdict: String,
    /// Events in the log.
    events: u64,
    /// Events replayed on both before the comparison ended.
    compared: u64,
    /// The first event decided differently: sequence, event, state_before, kind, what the
    /// recorded run did and what the other definition would do, why, the rejection and the
    /// guard values of the candidate transitions.
    #[schema(value_type = Option<rein_ops::schema::JsonObject>)]
    divergence: Option<Value>,
    /// Where the recorded run ends: state, status, terminal_reason, sequence.
    #[schema(value_type = rein_ops::schema::JsonObject)]
    recorded: Value,
    /// Where the other definition takes it.
    #[schema(value_type = rein_ops::schema::JsonObject)]
    replayed: Value,
    /// For a migrated run: the sequence of its last DEFINITION_MIGRATED, from which the
    /// comparison starts, and why.
    #[schema(value_type = Option<rein_ops::schema::JsonObject>)]
    compared_after: Option<Value>,
}

/// What if the run had run on another definition version (what `rein replay RUN
/// --definition NAME@VERSION` does): its recorded log is replayed, side-effect free, on the
/// version it ran on and on the other, with recorded tool and model results reused; the
/// first event the other decides differently, or the same outcome. Only registered versions
/// are named here (the CLI also takes a file); without one, the current version of the
/// run's definition name: what today's version would have done.
#[utoipa::path(get, path = "/v1/runs/{id}/whatif", tag = "runs",
    params(("id" = Uuid, Path, description = "Run id"), WhatIfQuery),
    responses((status = 200, description = "The comparison", body = WhatIfView),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 404, description = "No such run or definition version", body = ErrorBody),
              (status = 422, description = "Invalid query", body = ErrorBody)))]
pub async fn whatif_run(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
    q: Result<Query<WhatIfQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    caller.require(Scope::Read)?;
    let id = path_id(id)?;
    let q = query(q)?;
    let named = match q.definition {
        Some(named) => named,
        None => app.store.run(id).await?.definition,
    };
    let new = rein_ops::whatif::registered_definition(&app.store, &named).await?;
    Ok(Json(rein_ops::whatif::run(&app.store, id, &new).await?))
}

/// Settle the run's in-doubt call by hand (what `rein resolve` does): `applied` with the
/// call's result event, or `not_applied` (the step is dispatched again under the same
/// idempotency key). The log records the token's subject as `operator:SUBJECT`.
#[utoipa::path(post, path = "/v1/runs/{id}/resolve", tag = "runs",
    params(("id" = Uuid, Path, description = "A run with an open call (status needs_operator)")),
    request_body = ResolveBody,
    responses((status = 200, description = "The settlement was committed", body = ResolveResponse),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the operate scope, or the run's queue is beyond the token's bounds", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody),
              (status = 409, description = "The run has no open call (conflict), or the result event does not apply (invalid_transition)", body = ErrorBody),
              (status = 422, description = "The body is not valid", body = ErrorBody)))]
pub async fn resolve_run(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
    body: Bytes,
) -> Result<Json<ResolveResponse>, ApiError> {
    let who = caller.require(Scope::Operate)?;
    let id = path_id(id)?;
    let body: ResolveBody = parse_body(&body)?;
    let done = recovery::resolve(&app.store, id, body, &who.subject, Some(who)).await?;
    Ok(Json(done))
}

#[derive(Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct LimitsQuery {
    /// Limit keys to inspect, comma-separated; every key in use when absent. Each is 1..=128
    /// of letters, digits, `:`, `_`, `-`, `.` and `/` (`rein_core::limit_key_problem`); at
    /// most 1,000 (`LIMIT_KEYS_MAX`).
    #[serde(default)]
    pub keys: Option<String>,
}

/// The fleet-wide limits' state in Redis (what `rein limits` prints): how far ahead each
/// rate is booked, how far ahead deferred runs were sent, and who holds concurrency slots.
/// An API without Redis (`--redis-url`) has no fleet-wide limits: it answers an empty list
/// with `Rein-Fleet-Limits: none`.
#[utoipa::path(get, path = "/v1/limits", tag = "fleet",
    params(LimitsQuery),
    responses((status = 200, description = "One entry per key with entries in Redis; none when this API has no Redis", body = Vec<rein_ops::schema::JsonObject>,
               headers(("Rein-Fleet-Limits" = String, description = "`none` when this API has no Redis (`--redis-url`): no fleet-wide limits are configured, and the list is empty; absent otherwise"))),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 422, description = "A key is not a limit key", body = ErrorBody),
              (status = 503, description = "Redis is unreachable", body = ErrorBody)))]
pub async fn list_limits(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
    q: Result<Query<LimitsQuery>, QueryRejection>,
) -> Result<Json<Vec<KeyState>>, ApiError> {
    caller.require(Scope::Read)?;
    let q = query(q)?;
    let keys: Vec<String> = q
        .keys
        .iter()
        .flat_map(|k| k.split(','))
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
        .collect();
    let Some(config) = app.redis.as_ref() else {
        recovery::check_limit_keys(&keys)?;
        let none: Vec<KeyState> = Vec::new();
        return Ok(([(FLEET_LIMITS_HEADER, "none")], Json(none)).into_response());
    };
    Ok(Json(recovery::limits(config, &keys).await?).into_response())
}
    #[param(pattern = r"^[A-Za-z0-9:_./-]{0,128}(,[A-Za-z0-9:_./-]{0,128}){0,999}$")]
/// Answers `GET /v1/limits` on an API without Redis: no fleet-wide limits are configured.
const FLEET_LIMITS_HEADER: &str = "rein-fleet-limits";

