//! The pure reducer `X_n = R(X_{n-1}, e_n)` (SPEC E3) and event selection (SPEC M6).

use crate::definition::{Definition, Effect, Transition};
use crate::event::{EngineEvent, Event};
use crate::guard::{GuardInput, GuardScope};
use crate::limits;
pub use crate::reject::{InvalidTransition, RejectReason};
use crate::retry_policy::RetryDecision;
use crate::state::{ActionSlot, ActionStatus, RunState};

/// Applies one event. Pure: the result depends only on the arguments.
pub fn apply(
    def: &Definition,
    run: &RunState,
    event: &Event,
) -> Result<RunState, InvalidTransition> {
    let reject = |reason| InvalidTransition {
        state: run.state.clone(),
        event: event.kind.clone(),
        sequence: event.sequence,
        reason,
    };
    if event.sequence != run.sequence + 1 {
        return Err(reject(RejectReason::OutOfOrder {
            expected: run.sequence + 1,
        }));
    }
    if let Some(engine) = EngineEvent::parse(&event.kind) {
        return apply_engine(def, run, event, engine).map_err(reject);
    }
    if !def.has_event(&event.kind) {
        return Err(reject(RejectReason::UnknownEvent));
    }
    if def.is_terminal(&run.state) {
        return Err(reject(RejectReason::Terminal));
    }
    let candidates = def.candidates(&run.state, &event.kind);
    if candidates.is_empty() {
        return Err(reject(RejectReason::NotInTable));
    }
    if let Some(decision) = refused_retry(def, run, event) {
        return Err(reject(RejectReason::RetryRefused {
            why: decision.reason().to_owned(),
        }));
    }
    let is_call_result = def.is_call_result(&event.kind);
    if is_call_result {
        let got = event.payload.get("call_id").and_then(|v| v.as_str());
        if got != run.pending_call() {
            return Err(reject(RejectReason::CallMismatch {
                pending: run.pending_call().map(str::to_owned),
                got: got.map(str::to_owned),
            }));
        }
    }
    let transition = select(def, run, event, candidates).map_err(reject)?;
    let mut next = fire(def, run, event, transition, is_call_result);
    crate::budget::account(def, &mut next, event, true).map_err(reject)?;
    Ok(next)
}

/// The decision against a retry `event` stands for, when it is the `due` event of the run's
/// backoff state and records the retry's inputs (`payload.retry = {elapsed_ms}`, as the
/// scheduler writes it) and R1 does not allow it. A due event recorded without them (logs
/// written before retries were judged here, or an operator's) is not judged, so such logs
/// replay exactly as they did.
pub fn refused_retry(def: &Definition, run: &RunState, event: &Event) -> Option<RetryDecision> {
    let backoff = def.state(&run.state)?.backoff.as_ref()?;
    if backoff.due != event.kind {
        return None;
    }
    let retry = event.payload.get("retry")?.as_object()?;
    let elapsed_ms = retry.get("elapsed_ms").and_then(serde_json::Value::as_u64);
    let decision =
        def.retry_policy(&run.state)
            .decide(run.last_error.as_ref(), run.attempt, elapsed_ms);
    (decision != RetryDecision::Retry).then_some(decision)
}

/// The event the engine itself commits after `run`'s latest event, if any: the joined or
/// failed event of a decided join, else the budget event of a used-up budget, else
/// STEP_LIMIT_REACHED when the run's log reached its ceiling ([`crate::runaway`]). Storage
/// appends it to the same commit when the definition accepts it.
pub fn follow_up(def: &Definition, run: &RunState) -> Option<(String, serde_json::Value)> {
    if def.is_terminal(&run.state) {
        return None;
    }
    crate::join::decided_event(def, run)
        .or_else(|| crate::budget::exhausted_event(def, run))
        .or_else(|| crate::runaway::step_limit_event(def, run))
}

/// The first candidate (highest priority) whose guards all hold.
fn select<'d>(
    def: &Definition,
    run: &RunState,
    event: &Event,
    candidates: &'d [Transition],
) -> Result<&'d Transition, RejectReason> {
    // A first candidate without guards holds whatever the run is: nothing reads the guards'
    // view of the run, so it is not built (it copies the run's results and data).
    if let Some(first) = candidates.first().filter(|t| t.guards.is_empty()) {
        return Ok(first);
    }
    let input = guard_input(def, run, event);
    let mut scope = GuardScope::new(&input);
    let mut first_failure = None;
    'candidates: for transition in candidates {
        for guard in &transition.guards {
            let failure = match guard.eval(&mut scope) {
                Ok(true) => continue,
                Ok(false) => RejectReason::GuardFailed {
                    kind: guard.kind,
                    guard: guard.name.clone(),
                },
                Err(error) => RejectReason::GuardError {
                    kind: guard.kind,
                    guard: guard.name.clone(),
                    error,
                },
            };
            first_failure.get_or_insert(failure);
            continue 'candidates;
        }
        return Ok(transition);
    }
    Err(first_failure.unwrap_or(RejectReason::NotInTable))
}

/// What the guards of `event`'s candidate transitions see in `run`.
pub(crate) fn guard_input<'e>(
    def: &Definition,
    run: &RunState,
    event: &'e Event,
) -> GuardInput<'e> {
    GuardInput {
        run: run.guard_view(),
        event: serde_json::json!({ "type": event.kind, "payload": event.payload }),
        payload: &event.payload,
        retry: serde_json::to_value(def.retry_policy(&run.state)).unwrap_or_default(),
        constants: serde_json::to_value(def.constants()).unwrap_or_default(),
        budget: def.budget_view(),
    }
}

fn fire(
    def: &Definition,
    run: &RunState,
    event: &Event,
    t: &Transition,
    is_call_result: bool,
) -> RunState {
    let mut next = run.clone();
    next.sequence = event.sequence;
    if t.to != run.state {
        next.entered_at_sequence = event.sequence;
        next.reminders_sent = 0;
    } else if def
        .state(&run.state)
        .and_then(|s| s.approval.as_ref())
        .and_then(|a| a.reminder_event.as_deref())
        == Some(event.kind.as_str())
    {
        next.reminders_sent += 1;
    }
    next.state = t.to.clone();
    merge_data(&mut next.data, &event.payload);
    if t.to != run.state {
        crate::join::on_enter(def, &mut next, event.sequence);
    }
    if let Some(error) = event.payload.get("error") {
        next.last_error = Some(error.clone());
    }
    let completes_step = t.effects.contains(&Effect::CompleteStep);
    for effect in &t.effects {
        match effect {
            Effect::IncrementAttempt => next.attempt = next.attempt.saturating_add(1),
            Effect::ResetAttempt => next.attempt = 0,
            Effect::AppendResult => {
                if next.results.len() >= limits::RESULTS_KEPT_MAX {
                    next.results.remove(0);
                }
                next.results.push(serde_json::json!({
                    "call_id": event.payload.get("call_id"),
                    "step": run.action.as_ref().map(|a| a.step),
                    "node": run.action.as_ref().map(|a| a.node.clone()),
                    "value": event.payload.get("result").cloned().unwrap_or(serde_json::Value::Null),
                }));
            }
            Effect::CompleteStep => {}
        }
    }
    if is_call_result {
        next.needs_operator = false;
        if completes_step {
            next.action = None;
            next.steps_completed += 1;
            next.attempt = 0;
        } else if let Some(slot) = next.action.as_mut() {
            slot.status = ActionStatus::Failed;
            slot.call_id = None;
        }
    }
    if def.is_terminal(&next.state) {
        next.terminal_reason = Some(reason_of(event));
    }
    next
}

fn reason_of(event: &Event) -> String {
    match event.payload.get("reason") {
        Some(serde_json::Value::String(s)) if !s.is_empty() => s.clone(),
        _ => event.kind.clone(),
    }
}

/// `payload.data` (an object) is merged into the run's business data, key by key.
fn merge_data(data: &mut serde_json::Value, payload: &serde_json::Value) {
    let Some(serde_json::Value::Object(update)) = payload.get("data") else {
        return;
    };
    if !data.is_object() {
        *data = serde_json::json!({});
    }
    if let serde_json::Value::Object(map) = data {
        for (k, v) in update {
            map.insert(k.clone(), v.clone());
        }
    }
}

fn apply_engine(
    def: &Definition,
    run: &RunState,
    event: &Event,
    engine: EngineEvent,
) -> Result<RunState, RejectReason> {
    let mut next = run.clone();
    next.sequence = event.sequence;
    let str_field = |name: &str| -> Result<String, RejectReason> {
        event
            .payload
            .get(name)
            .and_then(|v| v.as_str())
            .map(str::to_owned)
            .ok_or_else(|| RejectReason::BadPayload {
                message: format!("{} needs a string `{name}`", engine.as_str()),
            })
    };
    let pending_must_be = |call_id: &str| -> Result<(), RejectReason> {
        if run.pending_call() == Some(call_id) {
            Ok(())
        } else {
            Err(RejectReason::CallMismatch {
                pending: run.pending_call().map(str::to_owned),
                got: Some(call_id.to_owned()),
            })
        }
    };
    match engine {
        EngineEvent::Cancel => {
            if def.is_terminal(&run.state) {
                return Err(RejectReason::Terminal);
            }
            next.state = def.cancel_state().to_owned();
            next.entered_at_sequence = event.sequence;
            next.terminal_reason =
                Some(match event.payload.get("reason").and_then(|r| r.as_str()) {
                    Some(reason) if !reason.is_empty() => format!("cancelled: {reason}"),
                    _ => "cancelled".to_owned(),
                });
            next.needs_operator = false;
            next.join = None;
        }
        EngineEvent::StepLimitReached => {
            if def.is_terminal(&run.state) {
                return Err(RejectReason::Terminal);
            }
            if !crate::runaway::reached(def, event.sequence) {
                return Err(RejectReason::BadPayload {
                    message: format!(
                        "the run's ceiling is {} events; it is not reached at sequence {}",
                        def.max_events(),
                        event.sequence
                    ),
                });
            }
            next.state = def.cancel_state().to_owned();
            next.entered_at_sequence = event.sequence;
            next.terminal_reason = Some(crate::runaway::STEP_LIMIT.to_owned());
            next.needs_operator = false;
            next.join = None;
        }
        EngineEvent::ActionDispatched => {
            if def.is_terminal(&run.state) {
                return Err(RejectReason::Terminal);
            }
            if let Some(pending) = run.pending_call() {
                return Err(RejectReason::BadPayload {
                    message: format!(
                        "call {pending} is still pending; resolve it before dispatching again"
                    ),
                });
            }
            let step = event
                .payload
                .get("step")
                .and_then(|v| v.as_u64())
                .and_then(|s| u32::try_from(s).ok())
                .ok_or_else(|| RejectReason::BadPayload {
                    message: "ACTION_DISPATCHED needs a numeric `step`".into(),
                })?;
            next.action = Some(ActionSlot {
                action_id: str_field("action_id")?,
                node: str_field("node")?,
                step,
                idempotency_key: str_field("idempotency_key")?,
                call_id: Some(str_field("call_id")?),
                status: ActionStatus::Dispatched,
                tool: event
                    .payload
                    .get("tool")
                    .and_then(|v| v.as_str())
                    .map(str::to_owned),
                action_hash: event
                    .payload
                    .get("action_hash")
                    .and_then(|v| v.as_str())
                    .map(str::to_owned),
                lost: None,
            });
            next.needs_operator = false;
        }
        EngineEvent::ActionResultInDoubt => {
            pending_must_be(&str_field("call_id")?)?;
            if let Some(slot) = next.action.as_mut() {
                slot.status = ActionStatus::InDoubt;
                // Recorded only by engines that classify why an answer was lost; older
                // records leave the slot as it always was.
                if let Some(kind) = event.payload["error"]["kind"].as_str() {
                    slot.lost = Some(kind.to_owned());
                }
            }
        }
        EngineEvent::ActionNotApplied => {
            pending_must_be(&str_field("call_id")?)?;
            if let Some(slot) = next.action.as_mut() {
                slot.status = ActionStatus::Failed;
                slot.call_id = None;
            }
            next.needs_operator = false;
        }
        EngineEvent::ActionDeferred => {
            if def.state(&run.state).map(|s| s.kind) != Some(crate::definition::StateKind::Active) {
                return Err(RejectReason::BadPayload {
                    message: "only an action of an active state can be deferred".into(),
                });
            }
            if let Some(pending) = run.pending_call() {
                return Err(RejectReason::BadPayload {
                    message: format!("call {pending} is in flight; it cannot be deferred"),
                });
            }
            str_field("key")?;
            if event
                .payload
                .get("wait_ms")
                .and_then(|v| v.as_u64())
                .is_none()
            {
                return Err(RejectReason::BadPayload {
                    message: "ACTION_DEFERRED needs a numeric `wait_ms`".into(),
                });
            }
        }
        EngineEvent::OperatorRequired => {
            if def.is_terminal(&run.state) {
                return Err(RejectReason::Terminal);
            }
            next.needs_operator = true;
        }
        EngineEvent::DecisionRejected
        | EngineEvent::ApprovalRequested
        | EngineEvent::ApprovalReminder
        | EngineEvent::ApprovalDecided
        | EngineEvent::LeaseExpired
        | EngineEvent::InboxExpired
        | EngineEvent::BranchRejected
        | EngineEvent::ModelReplied => {}
        EngineEvent::DefinitionMigrated => migrated(def, run, event, &mut next)?,
        EngineEvent::RunForked => forked(def, run, event, &mut next)?,
        EngineEvent::BranchSucceeded | EngineEvent::BranchFailed => {
            if def.is_terminal(&run.state) {
                return Err(RejectReason::Terminal);
            }
            let succeeded = engine == EngineEvent::BranchSucceeded;
            crate::join::record(def, &mut next, &event.payload, succeeded)?;
        }
    }
    crate::budget::account(def, &mut next, event, false)?;
    Ok(next)
}

fn bad(message: String) -> RejectReason {
    RejectReason::BadPayload { message }
}

fn version_field(event: &Event, name: &str) -> Result<u32, RejectReason> {
    event
        .payload
        .get(name)
        .and_then(|v| v.as_u64())
        .and_then(|v| u32::try_from(v).ok())
        .ok_or_else(|| bad(format!("{} needs a numeric `{name}`", event.kind)))
}

/// DEFINITION_MIGRATED, reduced with the version the run moves to (SPEC V1).
fn migrated(
    def: &Definition,
    run: &RunState,
    event: &Event,
    next: &mut RunState,
) -> Result<(), RejectReason> {
    let (from, to) = (
        version_field(event, "from_version")?,
        version_field(event, "to_version")?,
    );
    if run.definition != def.name() || run.version != from || def.version() != to || from == to {
        return Err(bad(format!(
            "moves {}@v{from} to v{to}, but the run is {}@v{} and the event is reduced with v{}",
            def.name(),
            run.definition,
            run.version,
            def.version()
        )));
    }
    crate::movable::between_steps(run).map_err(|why| bad(format!("cannot move: {why}")))?;
    let state = event
        .payload
        .get("state")
        .and_then(|v| v.as_str())
        .ok_or_else(|| bad("DEFINITION_MIGRATED needs a string `state`".into()))?;
    if def.state(state).is_none() || def.is_terminal(state) {
        return Err(bad(format!(
            "state `{state}` is not a non-terminal state of v{to}"
        )));
    }
    let data = event
        .payload
        .get("data")
        .filter(|d| d.is_object())
        .ok_or_else(|| bad("DEFINITION_MIGRATED needs an object `data`".into()))?;
    next.version = to;
    next.data = data.clone();
    if state != run.state {
        next.state = state.to_owned();
        next.entered_at_sequence = event.sequence;
        next.attempt = 0;
        next.action = None;
        next.reminders_sent = 0;
    }
    Ok(())
}

/// RUN_FORKED: the fork's first event, which makes its state the source's snapshot (SPEC E6).
fn forked(
    def: &Definition,
    run: &RunState,
    event: &Event,
    next: &mut RunState,
) -> Result<(), RejectReason> {
    if run.sequence != 0 {
        return Err(bad("RUN_FORKED can only be a run's first event".into()));
    }
    let snapshot: RunState = event
        .payload
        .get("snapshot")
        .cloned()
        .ok_or_else(|| bad("RUN_FORKED needs a `snapshot`".into()))
        .and_then(|s| {
            serde_json::from_value(s).map_err(|e| bad(format!("RUN_FORKED snapshot: {e}")))
        })?;
    if snapshot.definition != def.name() || snapshot.version != def.version() {
        return Err(bad(format!(
            "the snapshot is of {}@v{}, the run of {}@v{}",
            snapshot.definition,
            snapshot.version,
            def.name(),
            def.version()
        )));
    }
    if def.state(&snapshot.state).is_none() || def.is_terminal(&snapshot.state) {
        return Err(bad(format!(
            "the snapshot's state `{}` is not a non-terminal state of v{}",
            snapshot.state,
            def.version()
        )));
    }
    crate::movable::between_steps(&snapshot).map_err(|why| bad(format!("cannot fork: {why}")))?;
    *next = snapshot;
    next.sequence = event.sequence;
    next.entered_at_sequence = event.sequence;
    Ok(())
}

/// Applies `event` with the version of the definition it is reduced with: the one the run is
/// on, or for DEFINITION_MIGRATED the one it moves to. `def_of` gives a version of the run's
/// definition, `None` when it is not known.
pub fn apply_across<'d>(
    def_of: &dyn Fn(u32) -> Option<&'d Definition>,
    run: &RunState,
    event: &Event,
) -> Result<(RunState, &'d Definition), InvalidTransition> {
    let version = if event.kind == EngineEvent::DefinitionMigrated.as_str() {
        version_field(event, "to_version").ok()
    } else {
        Some(run.version)
    };
    let reject = |reason| InvalidTransition {
        state: run.state.clone(),
        event: event.kind.clone(),
        sequence: event.sequence,
        reason,
    };
    let def = version.and_then(def_of).ok_or_else(|| {
        reject(bad(format!(
            "version {version:?} of the definition is not known"
        )))
    })?;
    Ok((apply(def, run, event)?, def))
}

/// Picks among competing candidate events by the definition's declared priority (SPEC M6),
/// never by the order they were given in: the strongest candidate the reducer accepts wins.
/// Returns the index of the chosen candidate and the state after it, or every rejection.
pub fn decide(
    def: &Definition,
    run: &RunState,
    candidates: &[(String, serde_json::Value)],
) -> Result<(usize, RunState), Vec<InvalidTransition>> {
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&a, &b| {
        let (ea, eb) = (&candidates[a].0, &candidates[b].0);
        def.event_rank(ea)
            .cmp(&def.event_rank(eb))
            .then_with(|| ea.cmp(eb))
    });
    let mut rejections = Vec::new();
    for i in order {
        let (kind, payload) = &candidates[i];
        let event = Event::new(run.sequence + 1, kind.clone(), payload.clone());
        match apply(def, run, &event) {
            Ok(next) => return Ok((i, next)),
            Err(e) => rejections.push(e),
        }
    }
    Err(rejections)
}

/// Replays a whole log from `X_0`. On the first rejection, returns its 0-based index.
pub fn replay<'e>(
    def: &Definition,
    initial: RunState,
    events: impl IntoIterator<Item = &'e Event>,
) -> Result<RunState, (usize, InvalidTransition)> {
    let mut run = initial;
    for (i, event) in events.into_iter().enumerate() {
        run = apply(def, &run, event).map_err(|e| (i, e))?;
    }
    Ok(run)
}
