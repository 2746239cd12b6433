//! Routes that change runs in flight ([`rein_ops::moves`]): moving the runs of a definition
//! version to another, forking a run from a sequence of its log, and forgetting data keys of
//! a run.

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{Extension, Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use rein_core::checkpoint::Migrations;
use rein_ops::moves::{
    self, ForkBody, ForkResponse, MigrateBody, MigrateResponse, RedactBody, RedactResponse,
};
use rein_ops::{Code, Error, ErrorBody};
use rein_store::Scope;
use uuid::Uuid;

use crate::extract::{DefinitionPath, definition_name, parse_body, path_id};
use crate::replays::refused_over_budget;
use crate::{ApiError, App, Caller};

/// Move the unfinished runs of one version of a definition to a newer one (what `rein
/// definitions migrate` does), with the `[migration]` the newer versions declare; `dry_run`
/// lists what would move and what would not, and why. Each moved run gets a
/// DEFINITION_MIGRATED event recording both versions and the token's subject; a run a worker
/// holds is waited for up to `wait_s`, then reported `busy`.
#[utoipa::path(post, path = "/v1/definitions/{name}/migrate", tag = "definitions",
    request_body = MigrateBody,
    params(DefinitionPath),
    responses((status = 200, description = "What moved, what would, and what did not, with why", body = MigrateResponse),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the admin scope: a migration moves runs of every queue", body = ErrorBody),
              (status = 404, description = "No such name or version", body = ErrorBody),
              (status = 409, description = "`from` and `to` are the same version or `to` is the older one, or live workers of an older release could claim moved runs (not for `dry_run`)", body = ErrorBody),
              (status = 422, description = "Invalid request", body = ErrorBody)))]
pub async fn migrate_definition(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
    name: Result<Path<String>, PathRejection>,
    body: Bytes,
) -> Result<Json<MigrateResponse>, ApiError> {
    let who = caller.require(Scope::Admin)?;
    let name = definition_name(name)?;
    let body: MigrateBody = parse_body(&body)?;
    let by = format!("operator:{}", who.subject);
    let done = moves::migrate(&app.store, &name, &body, &by, &Migrations::new(), &|_| {}).await?;
    Ok(Json(done))
}

/// Fork a run (what `rein fork` does): a new run, linked to the source as its parent, whose
/// log starts with the source's state at sequence `at` (a RUN_FORKED event carrying it) and
/// continues live, optionally on another version and with patched data. The source is never
/// touched. A fork at an open or in-doubt call is refused. The source's log up to `at` is
/// replayed on the server's replay threads: its cost (`at` events times what the
/// definition's guards may take an event) is checked before it starts, at most
/// `--max-replays` run at once (`--max-replays-per-token` for one token), and one whose
/// client goes away is stopped before anything is created.
#[utoipa::path(post, path = "/v1/runs/{id}/fork", tag = "runs",
    params(("id" = Uuid, Path, description = "The run to fork")),
    request_body = ForkBody,
    responses((status = 201, description = "The fork", body = ForkResponse),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the operate scope, or the run's queue is beyond the token's bounds", body = ErrorBody),
              (status = 404, description = "No such run or version", body = ErrorBody),
              (status = 409, description = "The run's log has no event at that sequence, or the run is not between steps there", body = ErrorBody),
              (status = 422, description = "Invalid request, or replaying the log up to `at` may cost more than the API replays for one request (validation_failed; details: cost, limit, events): run `rein fork` where the database is reachable", body = ErrorBody),
              (status = 429, description = "This token has --max-replays-per-token replays running (too_many_requests)", body = ErrorBody,
               headers(("Retry-After" = u64, description = "Seconds until asking again may succeed"))),
              (status = 503, description = "This server has --max-replays replays running (unavailable)", body = ErrorBody,
               headers(("Retry-After" = u64, description = "Seconds until asking again may succeed")))))]
pub async fn fork_run(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let who = caller.require(Scope::Operate)?;
    let id = path_id(id)?;
    let body: ForkBody = parse_body(&body)?;
    let by = format!("operator:{}", who.subject);
    let at = moves::fork_checked(&body)?;
    // From the row, before the log is read; again once the versions it ran on are known.
    moves::fork_budget(&app.store, id, at)
        .await
        .inspect_err(refused_over_budget)?;
    let slot = app.replays.slot(who.token_id)?;
    let replay = moves::ForkReplay::load(&app.store, id, at).await?;
    replay.budget().inspect_err(refused_over_budget)?;
    let at = app
        .replays
        .run(slot, move |cancel| replay.replay(cancel))
        .await??
        // `None` only when cancelled, which only the end of this request does.
        .ok_or_else(|| Error::new(Code::Internal, "the fork's replay was cancelled".to_owned()))?;
    let done = moves::fork_at(&app.store, at, &body, &by, Some(who)).await?;
    Ok((StatusCode::CREATED, Json(done)).into_response())
}

/// Forget personal data of a run (what `rein runs redact` does): the named keys of its data
/// are replaced, in its input, every event that carries them, its projection and its
/// checkpoints, by markers holding a keyed hash of each value (HMAC-SHA256 under the API's
/// `REIN_REDACTION_KEY`, in the marker's `sha256` field); the redaction is recorded with the
/// token's subject and the reason, and the run still verifies. Markers an older release left
/// unkeyed in these keys are replaced by keyed ones. Of a finished run, the blobs that only
/// finished, redacted runs refer to are deleted. Refused while a worker holds the run, and
/// for a key the definition reads (its replay would decide differently).
#[utoipa::path(post, path = "/v1/runs/{id}/redact", tag = "runs",
    params(("id" = Uuid, Path, description = "The run to redact")),
    request_body = RedactBody,
    responses((status = 200, description = "What was replaced, and the blobs deleted", body = RedactResponse),
              (status = 401, description = "No or bad token", body = ErrorBody),
              (status = 403, description = "Needs the operate scope, or the run's queue is beyond the token's bounds", body = ErrorBody),
              (status = 404, description = "No such run", body = ErrorBody),
              (status = 409, description = "A worker holds the run, the definition reads a key, or the run moved meanwhile", body = ErrorBody),
              (status = 422, description = "Invalid request", body = ErrorBody),
              (status = 503, description = "This API was started without `REIN_REDACTION_KEY`, so it does not redact (unavailable)", body = ErrorBody)))]
pub async fn redact_run(
    State(app): State<Arc<App>>,
    Extension(caller): Extension<Caller>,
    id: Result<Path<Uuid>, PathRejection>,
    body: Bytes,
) -> Result<Json<RedactResponse>, ApiError> {
    let who = caller.require(Scope::Operate)?;
    let id = path_id(id)?;
    let body: RedactBody = parse_body(&body)?;
    let by = format!("operator:{}", who.subject);
    Ok(Json(
        moves::redact(&app.store, id, &body, &by, Some(who)).await?,
    ))
}
