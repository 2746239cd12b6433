//! Budgets (per run): usage accounting and exhaustion, pure. Handlers report usage in the
//! events they produce (`payload.usage = {"tokens": N, "cost": X}`); every definition event
//! applied is a step. When a declared budget is used up, the engine commits the definition's
//! budget event (once) instead of letting the run spend on. The wall-time budget is measured
//! by the database clock and fired by the scheduler with `{"budget": "wall_time_ms"}`.
//!
//! What is guaranteed, exactly. Usage is known only once a step reports it, so a budget is
//! judged after each commit, never before a step: the commit whose usage reaches or crosses
//! a limit is recorded in full (usage may end above the limit by what that one commit
//! reported, e.g. 4 steps of 300 tokens against 1000 end at 1200), and the budget event is
//! appended to that same commit, so no later step starts under the budget. The `steps`
//! budget counts definition events: with `steps = N` the N-th event ends the budget, and
//! the budget event itself is counted too (`steps_used` ends at N + 1). All of this holds
//! when the state the run is in takes the budget event; one that does not lets the run go
//! on (and spend) until it reaches a state that does, where the event is committed with
//! the first commit there. Validation warns about every state with an action that does not
//! take it ([`warnings`]).

use serde_json::{Value, json};

use crate::definition::{Definition, DefinitionProblem, DefinitionSpec, StateKind};
use crate::event::Event;
use crate::reject::RejectReason;
use crate::state::RunState;

/// Accounts `event` into `next.usage`. Does nothing for a definition without a budget, so
/// the logs of older definitions reduce exactly as before.
pub(crate) fn account(
    def: &Definition,
    next: &mut RunState,
    event: &Event,
    definition_event: bool,
) -> Result<(), RejectReason> {
    let Some(budget) = def.budget() else {
        return Ok(());
    };
    if let Some(usage) = event.payload.get("usage") {
        let bad = |what: &str| RejectReason::BadPayload {
            message: format!("`usage.{what}` must be a non-negative number"),
        };
        let Some(usage) = usage.as_object() else {
            return Err(RejectReason::BadPayload {
                message: "`usage` must be an object {tokens, cost}".into(),
            });
        };
        if let Some(tokens) = usage.get("tokens") {
            let tokens = tokens.as_u64().ok_or_else(|| bad("tokens"))?;
            next.usage.tokens = next.usage.tokens.saturating_add(tokens);
        }
        if let Some(cost) = usage.get("cost") {
            let cost = cost
                .as_f64()
                .filter(|c| c.is_finite() && *c >= 0.0)
                .ok_or_else(|| bad("cost"))?;
            next.usage.cost += cost;
        }
    }
    if definition_event {
        next.usage.steps = next.usage.steps.saturating_add(1);
        if event.kind == budget.event && next.usage.exhausted.is_none() {
            next.usage.exhausted = Some(
                event
                    .payload
                    .get("budget")
                    .and_then(Value::as_str)
                    .unwrap_or("budget")
                    .to_owned(),
            );
        }
    }
    Ok(())
}

/// The budget `run` has used up, with what it used and its limit.
pub fn exhausted(def: &Definition, run: &RunState) -> Option<(&'static str, f64, f64)> {
    let budget = def.budget()?;
    let u = &run.usage;
    [
        ("tokens", u.tokens as f64, budget.tokens.map(|t| t as f64)),
        ("cost", u.cost, budget.cost),
        ("steps", u.steps as f64, budget.steps.map(|s| s as f64)),
    ]
    .into_iter()
    .find_map(|(name, used, limit)| limit.filter(|l| used >= *l).map(|l| (name, used, l)))
}

/// The budget event to commit now, if a budget is used up and its event has not fired.
pub fn exhausted_event(def: &Definition, run: &RunState) -> Option<(String, Value)> {
    let budget = def.budget()?;
    if run.usage.exhausted.is_some() {
        return None;
    }
    let (name, used, limit) = exhausted(def, run)?;
    Some((
        budget.event.clone(),
        json!({ "reason": "budget_exhausted", "budget": name, "used": used, "limit": limit }),
    ))
}

/// The payload of the wall-time budget's event (fired by the scheduler).
pub fn wall_time_payload(limit_ms: u64) -> Value {
    json!({ "reason": "budget_exhausted", "budget": "wall_time_ms", "limit": limit_ms })
}

/// One warning per state with an action that does not take the budget event: a run that
/// uses its budget up there goes on spending until it reaches a state that takes it.
pub(crate) fn warnings(spec: &DefinitionSpec) -> Vec<DefinitionProblem> {
    let Some(budget) = &spec.budget else {
        return Vec::new();
    };
    spec.states
        .iter()
        .enumerate()
        .filter(|(_, s)| s.kind == StateKind::Active && s.action.is_some())
        .filter(|(_, s)| {
            !spec
                .transitions
                .iter()
                .any(|t| t.from == s.name && t.event == budget.event)
        })
        .map(|(i, s)| DefinitionProblem {
            item: format!("states[{i}] ({})", s.name),
            reason: format!(
                "runs an action but does not take the budget event `{}`: a run that uses its budget up here goes on spending until it reaches a state that takes it",
                budget.event
            ),
        })
        .collect()
}
