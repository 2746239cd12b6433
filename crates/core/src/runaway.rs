//! Runaway runs, pure: the ceiling on a run's events and the validation warning for cycles
//! that only timers drive.
//!
//! Every run has a ceiling on its log, `max_events` (default
//! [`limits::RUN_EVENTS_DEFAULT`], a definition may set another). It is judged by sequence
//! alone, so it is deterministic: the commit that brings a run's log to `max_events - 1`
//! events or more also commits STEP_LIMIT_REACHED, which ends the run in the definition's
//! cancel state with reason `step_limit`. With one event per commit the log ends at exactly
//! `max_events`; a commit of several events may pass the ceiling by those. While a call is
//! in flight the ceiling waits for its result (at most one step more), so no action is
//! dispatched and abandoned unrun. Replay never consults the ceiling (it is a follow-up of
//! a commit, like a decided join), so logs written before it replay exactly as before.
//!
//! The cancel state is where the run ends because it is the one terminal state every
//! definition names and that the engine may enter from any non-terminal state without a
//! transition of its own; the event (STEP_LIMIT_REACHED, not CANCEL) and the reason
//! (`step_limit`) tell the failure apart from a cancellation, and metrics count it failed.
//!
//! A loop that returns to the same state is legitimate (an agent's ACTING → ACTING); the
//! ceiling, not validation, stops one that never ends. Validation only warns about a cycle
//! made entirely of timer events, which a run goes round with no worker and no outside
//! event at all.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use crate::definition::{Definition, DefinitionProblem, DefinitionSpec, StateKind};
use crate::event::EngineEvent;
use crate::limits;
use crate::state::RunState;

/// The terminal reason of a run the ceiling ended.
pub const STEP_LIMIT: &str = "step_limit";

/// Whether the event at `sequence` may be the ceiling's: the log has reached `max_events`.
pub fn reached(def: &Definition, sequence: u64) -> bool {
    sequence >= def.max_events()
}

/// STEP_LIMIT_REACHED with its payload, when `run`'s next event reaches its ceiling and no
/// call is in flight.
pub fn step_limit_event(def: &Definition, run: &RunState) -> Option<(String, Value)> {
    if def.is_terminal(&run.state)
        || run.pending_call().is_some()
        || !reached(def, run.sequence.saturating_add(1))
    {
        return None;
    }
    Some((
        EngineEvent::StepLimitReached.as_str().to_owned(),
        json!({
            "reason": STEP_LIMIT,
            "max_events": def.max_events(),
            "state": run.state,
        }),
    ))
}

/// What is wrong with a declared `max_events`, if anything.
pub(crate) fn max_events_problem(max_events: u64) -> Option<String> {
    (!(limits::RUN_EVENTS_MIN..=limits::RUN_EVENTS_MAX).contains(&max_events)).then(|| {
        format!(
            "must be {}..={} (a run's log ends at this many events)",
            limits::RUN_EVENTS_MIN,
            limits::RUN_EVENTS_MAX
        )
    })
}

/// The events the scheduler fires on its own in `state` (a waiting state's backoff, timeout
/// and approval timers). A reminder that keeps the run where it is fires once per stay, so
/// its self-loop is no cycle.
fn timer_events(state: &crate::definition::StateSpec) -> BTreeSet<&str> {
    let mut events = BTreeSet::new();
    if state.kind != StateKind::Waiting {
        return events;
    }
    if let Some(b) = &state.backoff {
        events.insert(b.due.as_str());
        events.insert(b.exhausted.as_str());
    }
    if let Some(t) = &state.timeout {
        events.insert(t.event.as_str());
    }
    if let Some(a) = &state.approval {
        events.insert(a.expiry_event.as_str());
    }
    events
}

/// One warning per group of states that timers alone move around in a cycle.
pub(crate) fn timer_cycle_warnings(spec: &DefinitionSpec) -> Vec<DefinitionProblem> {
    let states: BTreeMap<&str, &crate::definition::StateSpec> =
        spec.states.iter().map(|s| (s.name.as_str(), s)).collect();
    // Timer edges: (from, event, to), in declaration order.
    let mut edges: Vec<(&str, &str, &str)> = Vec::new();
    for t in &spec.transitions {
        let Some(from) = states.get(t.from.as_str()) else {
            continue;
        };
        let reminder = from
            .approval
            .as_ref()
            .and_then(|a| a.reminder_event.as_deref());
        let timer = timer_events(from).contains(t.event.as_str())
            || (reminder == Some(t.event.as_str()) && t.to != t.from);
        if timer && states.contains_key(t.to.as_str()) {
            edges.push((&t.from, &t.event, &t.to));
        }
    }
    let reach = |start: &str| -> BTreeSet<&str> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![start];
        while let Some(s) = stack.pop() {
            for (_, _, to) in edges.iter().filter(|(from, _, _)| *from == s) {
                if seen.insert(*to) {
                    stack.push(to);
                }
            }
        }
        seen
    };
    let reachable: BTreeMap<&str, BTreeSet<&str>> = states.keys().map(|s| (*s, reach(s))).collect();
    let mut reported: BTreeSet<&str> = BTreeSet::new();
    let mut warnings = Vec::new();
    for s in spec.states.iter().map(|s| s.name.as_str()) {
        if reported.contains(s) || !reachable[s].contains(s) {
            continue;
        }
        // The states that reach `s` and that `s` reaches: its cycle group.
        let group: Vec<&str> = spec
            .states
            .iter()
            .map(|t| t.name.as_str())
            .filter(|t| reachable[s].contains(t) && reachable[t].contains(s))
            .collect();
        reported.extend(group.iter().copied());
        let path: Vec<String> = edges
            .iter()
            .filter(|(from, _, to)| group.contains(from) && group.contains(to))
            .map(|(from, event, to)| format!("{from} + {event} -> {to}"))
            .collect();
        warnings.push(DefinitionProblem {
            item: format!("states ({})", group.join(", ")),
            reason: format!(
                "a cycle made only of timer events ({}): a run here loops with no worker and no outside event until its ceiling of {} events ends it with reason `{STEP_LIMIT}`",
                path.join("; "),
                spec.max_events.unwrap_or(limits::RUN_EVENTS_DEFAULT)
            ),
        });
    }
    warnings
}
