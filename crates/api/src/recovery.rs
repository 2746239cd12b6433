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
use rein_ops::recovery::{
    self, BriefView, Replayed, ResolveBody, ResolveResponse, VerifyView, replay_budget,
};
use rein_ops::{Code, Error, ErrorBody};
use rein_store::Scope;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};
use uuid::Uuid;

use crate::extract::{parse_body, path_id, query};
use crate::replays::refused_over_budget;
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
/// an error. The replay runs on the server's replay threads: its cost (events times what
/// the definition's guards may take an event) is checked before it starts, at most
/// `--max-replays` run at once (`--max-replays-per-token` for one token), and one whose
/// client goes away is stopped.
#[utoipa::path(get, path = "/v1/runs/{id}/verify", tag = "runs",
    params(("id" = Uuid, Path, description = "Run id")),
    responses((status = 200, description = "The verdict", body = VerifyView),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody),
              (status = 422, description = "The replay may cost more than the API replays for one request (validation_failed; details: cost, limit, events): run `rein runs verify` where the database is reachable", body = ErrorBody),
              (status = 429, description = "This token has --max-replays-per-token replays running (too_many_requests)", body = ErrorBody,
               headers(("Retry-After" = u64, description = "Seconds until asking again may succeed"))),
              (status = 503, description = "This server has --max-replays replays running (unavailable)", body = ErrorBody,
               headers(("Retry-After" = u64, description = "Seconds until asking again may succeed")))))]
pub async fn verify_run(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
) -> Result<Json<VerifyView>, ApiError> {
    let who = caller.require(Scope::Read)?;
    let id = path_id(id)?;
    recovery::verify_budget(&app.store, id)
        .await
        .inspect_err(refused_over_budget)?;
    let slot = app.replays.slot(who.token_id)?;
    let (store, runtime) = (app.store.clone(), tokio::runtime::Handle::current());
    let verified = app
        .replays
        .run(slot, move |cancel| {
            runtime.block_on(recovery::verify_until(&store, id, cancel))
        })
        .await??;
    Ok(Json(verified))
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
/// run's definition name: what today's version would have done. The replays run on the
/// server's replay threads: their cost (events times what both definitions' guards may take
/// an event) is checked before they start, at most `--max-replays` run at once
/// (`--max-replays-per-token` for one token), and one whose client goes away is stopped.
#[utoipa::path(get, path = "/v1/runs/{id}/whatif", tag = "runs",
    params(("id" = Uuid, Path, description = "Run id"), WhatIfQuery),
    responses((status = 200, description = "The comparison", body = WhatIfView),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the read scope", body = ErrorBody),
              (status = 404, description = "No such run or definition version", body = ErrorBody),
              (status = 422, description = "Invalid query, or the replays may cost more than the API replays for one request (validation_failed; details: cost, limit, events): run `rein replay` where the database is reachable", body = ErrorBody),
              (status = 429, description = "This token has --max-replays-per-token replays running (too_many_requests)", body = ErrorBody,
               headers(("Retry-After" = u64, description = "Seconds until asking again may succeed"))),
              (status = 503, description = "This server has --max-replays replays running (unavailable)", body = ErrorBody,
               headers(("Retry-After" = u64, description = "Seconds until asking again may succeed")))))]
pub async fn whatif_run(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
    q: Result<Query<WhatIfQuery>, QueryRejection>,
) -> Result<Json<Value>, ApiError> {
    let who = caller.require(Scope::Read)?;
    let id = path_id(id)?;
    let q = query(q)?;
    let row = app.store.run(id).await?;
    let named = q.definition.unwrap_or_else(|| row.definition.clone());
    let new = rein_ops::whatif::registered_definition(&app.store, &named).await?;
    let old = app
        .store
        .load_definition(&row.definition, Some(row.version))
        .await?;
    // From the row, before the log is read; again once the versions it ran on are known.
    let events = row.last_sequence.max(0) as u64;
    replay_budget(Replayed::WhatIf, id, events, &[&old, &new]).inspect_err(refused_over_budget)?;
    let slot = app.replays.slot(who.token_id)?;
    let replay = rein_ops::whatif::Replay::load(&app.store, id, new).await?;
    replay.budget().inspect_err(refused_over_budget)?;
    let compared = app
        .replays
        .run(slot, move |cancel| replay.compare(cancel))
        .await?;
    // `None` only when cancelled, which only the end of this request does.
    compared
        .map(Json)
        .ok_or_else(|| Error::new(Code::Internal, "the what-if was cancelled".to_owned()).into())
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
    #[param(pattern = r"^[A-Za-z0-9:_./-]{0,128}(,[A-Za-z0-9:_./-]{0,128}){0,999}$")]
    pub keys: Option<String>,
}

/// Answers `GET /v1/limits` on an API without Redis: no fleet-wide limits are configured.
const FLEET_LIMITS_HEADER: &str = "rein-fleet-limits";

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
) -> Result<Response, ApiError> {
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
