//! What an operator reaches for when a run needs a person: the resume brief a model would be
//! given (SPEC D3), a check that the log replays to what is stored (SPEC E2), settling an
//! in-doubt call by hand (SPEC M9, X7), and the fleet-wide limits' state in Redis (SPEC K1).

use rein_accel::RedisConfig;
use rein_accel::limits::KeyState;
use rein_core::Definition;
use rein_core::brief::ResumeBrief;
use rein_core::replay_cost::{self, Cancel, REPLAY_COST_MAX};
use rein_store::{INBOX_TTL_MS_DEFAULT, Sender, Store, TokenInfo};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::ToSchema;
use uuid::Uuid;

use crate::error::{Code, Error};

/// Longest name of whoever resolves a call.
pub const RESOLVER_BYTES_MAX: usize = 256;
/// Most limit keys one request inspects; without keys, at most this many in use are listed.
pub const LIMIT_KEYS_MAX: usize = 1000;

/// The resume brief of a run, and what in the stored checkpoints was not trusted.
#[derive(Serialize, Deserialize, ToSchema)]
pub struct BriefView {
    /// Task, steps done with their results (or references), the pending step, the last
    /// error: what a model is given to pick the run up.
    #[schema(value_type = crate::schema::JsonObject)]
    pub brief: ResumeBrief,
    /// Checkpoints that did not match the log: the brief was rebuilt from the log instead.
    pub warnings: Vec<String>,
}

/// The resume brief of `run_id`, rebuilt from the log where a checkpoint does not match it.
pub async fn brief(store: &Store, run_id: Uuid) -> Result<BriefView, Error> {
    let (brief, warnings) = store.resume_brief_checked(run_id).await?;
    Ok(BriefView { brief, warnings })
}

/// Whether a run's log replays to its stored projection and to every checkpoint.
#[derive(Serialize, Deserialize, ToSchema)]
pub struct VerifyView {
    pub run_id: Uuid,
    /// True when the log replays to the projection and to every checkpoint.
    pub ok: bool,
    /// What does not match, when something does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

/// Replays `run_id`'s log and compares it with what is stored.
pub async fn verify(store: &Store, run_id: Uuid) -> Result<VerifyView, Error> {
    verify_until(store, run_id, &Cancel::new()).await
}

/// [`verify`], stopping early once `cancel` is set (the answer then means nothing).
pub async fn verify_until(
    store: &Store,
    run_id: Uuid,
    cancel: &Cancel,
) -> Result<VerifyView, Error> {
    let problem = store.verify_run_until(run_id, cancel).await?;
    Ok(VerifyView {
        run_id,
        ok: problem.is_none(),
        problem,
    })
}

/// A replay of a stored log served to a remote caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Replayed {
    /// The log on the version(s) it ran on, once (`verify`).
    Verify,
    /// The log on its own version and on another, each event explained and applied on both
    /// (a what-if).
    WhatIf,
    /// The log up to a sequence, once, for the state a fork starts in (the events replayed
    /// are the sequence).
    Fork,
}

/// The steps replaying `events` events of `run_id` on `defs` may take
/// ([`replay_cost::replay_cost`]); past [`REPLAY_COST_MAX`] a validation error saying the
/// cost, the limit and what to run instead, before anything is replayed.
pub fn replay_budget(
    what: Replayed,
    run_id: Uuid,
    events: u64,
    defs: &[&Definition],
) -> Result<u64, Error> {
    let (guard_runs, instead) = match what {
        Replayed::Verify => (1, format!("`rein runs verify {run_id}`")),
        Replayed::WhatIf => (
            2,
            format!("`rein replay {run_id} --definition NAME@VERSION`"),
        ),
        Replayed::Fork => (1, format!("`rein fork {run_id} --at {events}`")),
    };
    let cost = replay_cost::replay_cost(events, defs, guard_runs);
    if cost <= REPLAY_COST_MAX {
        return Ok(cost);
    }
    let on: Vec<String> = defs
        .iter()
        .map(|d| {
            format!(
                "{} v{} (guards up to {} steps an event)",
                d.name(),
                d.version(),
                replay_cost::guard_steps_bound(d)
            )
        })
        .collect();
    Err(Error::validation(format!(
        "replaying run {run_id}'s {events} events on {} may take up to {cost} evaluation \
         steps; the API replays at most {REPLAY_COST_MAX} for one request: run {instead} where \
         the database is reachable (it has no such limit)",
        on.join(" and ")
    ))
    .with_details(json!({
        "run_id": run_id,
        "events": events,
        "cost": cost,
        "limit": REPLAY_COST_MAX,
    })))
}

/// [`replay_budget`] of verifying `run_id`, from its row alone (before its log is read), on
/// the version it is on now.
pub async fn verify_budget(store: &Store, run_id: Uuid) -> Result<u64, Error> {
    let row = store.run(run_id).await?;
    let def = store
        .load_definition(&row.definition, Some(row.version))
        .await?;
    replay_budget(
        Replayed::Verify,
        run_id,
        row.last_sequence.max(0) as u64,
        &[&def],
    )
}

/// Whether an in-doubt call took effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Resolution {
    /// It took effect: the run gets the call's result event, as the operator states it.
    Applied,
    /// It did not: the step is dispatched again with the same idempotency key.
    NotApplied,
}

/// How an operator settles a run's in-doubt call.
#[derive(Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"resolution": "applied", "event": "TOOL_SUCCEEDED",
    "payload": {"result": {"checked": "by phone"}}}))]
pub struct ResolveBody {
    pub resolution: Resolution,
    /// `applied` only, and then required: the event naming the call's result, e.g.
    /// `TOOL_SUCCEEDED`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<crate::schema::Name>)]
    pub event: Option<String>,
    /// `applied` only: the result event's payload, a JSON object (default `{}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub payload: Option<Value>,
}

/// What resolving committed.
#[derive(Serialize, Deserialize, ToSchema)]
pub struct ResolveResponse {
    pub run_id: Uuid,
    /// The call that was in doubt.
    pub call_id: String,
    /// The event committed: the result event, or `ACTION_NOT_APPLIED`.
    pub event: String,
    /// Who resolved it, as the log records it (`operator:NAME`).
    pub sender: String,
}

/// Settles `run_id`'s open call as `by` says, within `token`'s queues when one is given (`by` is recorded as `operator:BY`). A run with
/// no open call is a conflict; an `applied` without its result event, or a `not_applied`
/// with one, is refused.
pub async fn resolve(
    store: &Store,
    run_id: Uuid,
    body: ResolveBody,
    by: &str,
    token: Option<&TokenInfo>,
) -> Result<ResolveResponse, Error> {
    if by.trim().is_empty() || by.len() > RESOLVER_BYTES_MAX {
        return Err(Error::validation(format!(
            "who resolves the call must be named in 1..={RESOLVER_BYTES_MAX} bytes"
        )));
    }
    let mut payload = match body.payload {
        None => json!({}),
        Some(Value::Object(map)) => Value::Object(map),
        Some(_) => return Err(Error::validation("the payload must be a JSON object")),
    };
    let event = match (body.resolution, body.event) {
        (Resolution::NotApplied, None) => None,
        (Resolution::NotApplied, Some(_)) => {
            return Err(Error::validation(
                "`not-applied` takes no --event (no result event: the step is dispatched again)",
            ));
        }
        (Resolution::Applied, None) => {
            return Err(Error::validation(
                "`applied` needs --event naming the call's result (e.g. TOOL_SUCCEEDED)",
            ));
        }
        (Resolution::Applied, Some(event)) => {
            crate::service::name("event", Some(event.clone()))?;
            Some(event)
        }
    };
    crate::service::within_queues(store, token, run_id).await?;
    let row = store.run(run_id).await?;
    let Some(call_id) = row.projection.pending_call().map(str::to_owned) else {
        return Err(Error::conflict(format!(
            "run {run_id} has no open call to resolve (state {}, status {})",
            row.state, row.status
        ))
        .with_details(json!({ "run_id": run_id, "state": row.state, "status": row.status })));
    };
    let sender = format!("operator:{by}");
    let event = match event {
        None => {
            payload = json!({ "call_id": call_id, "by": sender });
            "ACTION_NOT_APPLIED".to_owned()
        }
        Some(event) => {
            payload["call_id"] = json!(call_id);
            payload["resolved_by"] = json!(sender);
            event
        }
    };
    let operator = Sender::Operator(sender.clone());
    store
        .send(run_id, &event, payload, &operator, INBOX_TTL_MS_DEFAULT)
        .await?;
    Ok(ResolveResponse {
        run_id,
        call_id,
        event,
        sender,
    })
}

/// Refuses `keys` unless each is a limit key, and at most [`LIMIT_KEYS_MAX`] of them.
pub fn check_limit_keys(keys: &[String]) -> Result<(), Error> {
    if keys.len() > LIMIT_KEYS_MAX {
        return Err(Error::validation(format!(
            "at most {LIMIT_KEYS_MAX} limit keys at once"
        )));
    }
    match keys.iter().find_map(|k| rein_core::limit_key_problem(k)) {
        Some(problem) => Err(Error::validation(problem)),
        None => Ok(()),
    }
}

/// The fleet-wide limits' state in Redis: how far ahead each rate is booked, how far ahead
/// deferred runs were sent, and who holds concurrency slots; for `keys`, or for every key in
/// use when none is named.
pub async fn limits(config: &RedisConfig, keys: &[String]) -> Result<Vec<KeyState>, Error> {
    check_limit_keys(keys)?;
    let unreachable = |e: String| {
        Error::new(
            Code::Unavailable,
            format!("cannot read Redis: {e}; is it running and is --redis-url right?"),
        )
    };
    let keys = if keys.is_empty() {
        rein_accel::limits::keys_in_use(config, LIMIT_KEYS_MAX)
            .await
            .map_err(unreachable)?
    } else {
        keys.to_vec()
    };
    rein_accel::limits::inspect(config, &keys)
        .await
        .map_err(unreachable)
}
